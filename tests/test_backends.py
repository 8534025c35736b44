"""The backend contract: registration checks the whole API, capabilities are class attributes, placement
comes from the backend (a KIND_GPU group with no GPU backend is a config error, through a real pool)."""

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.common.config import parse_config
from gepool.common.errors import ConfigError
from gepool.workers import main as worker_main
from gepool.workers.backends import backend_class, create_backend, placements, register
from gepool.workers.backends.base import AsyncBackend, Backend, SyncBackend
from tests import repo as test_repo

GPU_GROUP = "instance_group [ { count: 1 kind: KIND_GPU } ]"


def _gpu_tiny(repo: str) -> None:
    test_repo.make_models.make_tiny(repo)
    path = f"{repo}/tiny/config.pbtxt"
    text = open(path).read()
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in text
    with open(path, "w") as f:
        f.write(text.replace("instance_group [ { count: 1 kind: KIND_CPU } ]", GPU_GROUP))


def test_kind_gpu_with_onnxruntime_is_a_config_error_naming_the_group(tmp_path):
    _gpu_tiny(str(tmp_path))
    with Pool(str(tmp_path)) as pool:
        c = pool.client()
        model = c.status()["models"]["tiny"]
        assert model["state"] == "UNAVAILABLE"
        assert "instance_group[0] has kind KIND_GPU" in model["reason"], model["reason"]
        assert "gepool has no GPU backend" in model["reason"]
        assert model["workers"] == 0  # nothing ran on a CPU in its place
        with pytest.raises(errors.ModelNotReady, match="KIND_GPU"):
            c.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})


def test_explicit_load_of_a_kind_gpu_model_answers_the_config_error(tmp_path):
    _gpu_tiny(str(tmp_path))
    with Pool(str(tmp_path), model_control_mode="explicit") as pool:
        c = pool.client()
        with pytest.raises(errors.ModelNotReady, match=r"instance_group\[0\] has kind KIND_GPU"):
            c.load("tiny")


def test_placements_come_from_each_backend(tmp_path):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)
    path = f"{repo}/tiny/config.pbtxt"
    text = open(path).read().replace("instance_group [ { count: 1 kind: KIND_CPU } ]",
                                     "instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 kind: KIND_CPU } ]")
    with open(path, "w") as f:
        f.write(text)
    assert placements(parse_config(path, "tiny")) == [("cpu", 1), ("cpu", 1), ("cpu", 1)]
    test_repo.write(f"{repo}/npu/config.pbtxt", """
        backend: "ge"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
        instance_group [ { count: 2 kind: KIND_ASCEND ascend_devices: [ 1, 0 ] } ]
        parameters { key: "stream_num" value: { string_value: "3" } }
    """)
    assert placements(parse_config(f"{repo}/npu/config.pbtxt", "npu")) == [("ascend:0", 6), ("ascend:1", 6)]


def test_a_gpu_group_is_refused_by_the_cpu_backends(tmp_path):
    repo = str(tmp_path)
    _gpu_tiny(repo)
    with pytest.raises(ConfigError, match=r"instance_group\[0\] has kind KIND_GPU: backend 'onnxruntime'"):
        placements(parse_config(f"{repo}/tiny/config.pbtxt", "tiny"))
    test_repo.recorder(repo, "rec", extra="")
    path = f"{repo}/rec/config.pbtxt"
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text.replace("kind: KIND_CPU", "kind: KIND_GPU"))
    with pytest.raises(ConfigError, match="backend 'python' runs on KIND_CPU or KIND_MODEL only"):
        placements(parse_config(path, "rec"))


def test_a_kind_the_backend_cannot_run_is_refused_naming_the_group(tmp_path):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)
    path = f"{repo}/tiny/config.pbtxt"
    onnx_text = open(path).read()
    with open(path, "w") as f:
        f.write(onnx_text.replace("kind: KIND_CPU", "kind: KIND_MODEL"))
    with pytest.raises(ConfigError, match=r"instance_group\[0\] has kind KIND_MODEL: backend 'onnxruntime'"):
        placements(parse_config(path, "tiny"))
    test_repo.write(f"{repo}/npu/config.pbtxt", """
        backend: "ge"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
        instance_group [ { kind: KIND_GPU } ]
    """)
    with pytest.raises(ConfigError, match="backend 'ge' runs on KIND_ASCEND instances, not KIND_GPU"):
        placements(parse_config(f"{repo}/npu/config.pbtxt", "npu"))


class _NoExecute(SyncBackend):
    name = "no-execute"

    def close(self) -> None:
        pass


class _NoPump(AsyncBackend):
    name = "no-pump"

    def warmup(self) -> int:
        return 0

    def start(self, notify, fatal) -> None:
        pass

    def submit(self, slot, index, seq, plan) -> None:
        pass


class _Bare(Backend):
    name = "bare"

    def warmup(self) -> int:
        return 0


class _Whole(SyncBackend):
    name = "whole"

    def execute(self, inputs, outputs):
        return {}


@pytest.mark.parametrize("cls, missing", [(_NoExecute, "execute"), (_NoPump, "pump")])
def test_a_backend_missing_a_declared_method_is_refused(tmp_path, cls, missing):
    with pytest.raises(TypeError, match=f"does not implement {missing}"):
        register(cls)
    with pytest.raises(TypeError, match=missing):
        cls(None, str(tmp_path), "cpu", 1)
    with pytest.raises(ValueError, match=f"unknown backend '{cls.name}'"):
        backend_class(cls.name)


def test_a_backend_must_choose_the_sync_or_the_async_api():
    with pytest.raises(TypeError, match="exactly one of SyncBackend and AsyncBackend"):
        register(_Bare)

    class Lying(_Whole):
        name = "lying"
        asynchronous = True

    with pytest.raises(TypeError, match="'asynchronous' contradicts its base class"):
        register(Lying)


def test_a_complete_backend_registers_once_under_its_name():
    try:
        assert register(_Whole) is _Whole
        assert backend_class("whole") is _Whole

        class Other(_Whole):
            pass

        with pytest.raises(ValueError, match="'whole' is already registered"):
            register(Other)
    finally:
        from gepool.workers import backends

        backends._registry.pop("whole", None)


def test_capabilities_are_class_attributes_reported_when_ready(tmp_path):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)
    test_repo.recorder(repo, "rec")
    assert backend_class("onnxruntime").arena_io and not backend_class("onnxruntime").asynchronous
    assert backend_class("ge").asynchronous and not backend_class("ge").arena_io
    onnx = create_backend(parse_config(f"{repo}/tiny/config.pbtxt", "tiny"), f"{repo}/tiny/1", "cpu", 1)
    py = create_backend(parse_config(f"{repo}/rec/config.pbtxt", "rec"), f"{repo}/rec/1", "cpu", 1)
    try:
        info = worker_main.ready_info(onnx, 2)
        assert info["arena_io"] and info["prewake"] and not info["per_request"] and info["warmup_runs"] == 2
        assert info["threads"] == 1  # the backend's own info travels with them
        py.arena_io = True  # an instance attribute is not a declared capability: the class's is reported
        assert not worker_main.ready_info(py, 0)["arena_io"]
    finally:
        onnx.close()
        py.close()
