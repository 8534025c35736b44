"""The packages a user installs with gepool[test] agree with each other, and gepool's pb2 modules live beside theirs."""

import configparser
import importlib.metadata as md
import os
import subprocess
import sys

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirements(extras: tuple[str, ...]) -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in (x.split("#")[0].strip() for x in lines) if line]


def _unmet(roots: list[Requirement]) -> list[str]:
    """Every requirement reachable from ``roots`` (with their extras) that the installed versions break."""
    todo, seen, unmet = [(r, "gepool") for r in roots], set(), []
    while todo:
        req, by = todo.pop()
        key = (req.name.lower(), frozenset(req.extras))
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{by} needs {req}: not installed")
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            unmet.append(f"{by} needs {req}, {req.name} {dist.version} is installed")
        if key in seen:
            continue
        seen.add(key)
        for line in dist.requires or ():
            sub = Requirement(line)
            env = [dict(default_environment(), extra=e) for e in (req.extras or {""})]
            if sub.marker is None or any(sub.marker.evaluate(e) for e in env):
                todo.append((sub, f"{req.name} {dist.version}"))
    return unmet


def test_the_test_extra_installs_as_one_consistent_set():
    assert not _unmet(_requirements(("test",))), _unmet(_requirements(("test",)))


def test_the_pin_that_forced_an_old_protobuf_is_gone():
    triton = next(r for r in _requirements(("test",)) if r.name == "tritonclient")
    assert {"http", "grpc"} <= triton.extras and not triton.specifier.contains("2.40.0")
    assert not any(r.name == "setuptools" for r in _requirements(("test",)))  # no pkg_resources needed any more


def test_onnx_tritonclient_and_gepool_protobufs_work_in_one_process():
    # a fresh interpreter: the import order is the user's, not whatever the test session loaded first
    code = r"""
import google.protobuf, onnx, tritonclient.grpc, tritonclient.http
from google.protobuf import text_format
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as triton_pb
from gepool.common import model_config_pb2 as gepool_pb, onnx_subset_pb2
from gepool.common.onnx_io import _signature

text = 'name: "m" max_batch_size: 4 input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]'
ours, theirs = text_format.Parse(text, gepool_pb.ModelConfig()), text_format.Parse(text, triton_pb.ModelConfig())
assert ours.SerializeToString() == theirs.SerializeToString()  # same field numbers, two packages
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])])
model = helper.make_model(graph)
onnx.checker.check_model(model)
sig = _signature(memoryview(model.SerializeToString()))
assert [(t.name, t.datatype, t.dims) for t in sig.inputs] == [("x", "FP32", (-1, 3))]
tritonclient.grpc.InferInput("x", [1, 3], "FP32")
tritonclient.http.InferInput("x", [1, 3], "FP32")
print(google.protobuf.__version__, onnx.__version__)
"""
    pytest.importorskip("tritonclient.grpc")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
