"""The ONNX signature reader on hostile bytes: every corrupt file is a config error naming the model."""

import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gepool.common.onnx_io import OnnxFormatError, read_signature
from gepool.common.repository import load_source

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def model_bytes(weight_floats: int = 12) -> bytes:
    w = numpy_helper.from_array(np.ones((weight_floats,), np.float32), "W")
    graph = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", weight_floats])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", weight_floats])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


GOOD = model_bytes()


def test_every_truncation_of_a_model_reads_or_fails_cleanly(tmp_path):
    path = tmp_path / "model.onnx"
    for n in range(len(GOOD)):
        path.write_bytes(GOOD[:n])
        try:
            sig = read_signature(str(path))
        except OnnxFormatError:
            continue
        assert all(t.name for t in sig.inputs + sig.outputs)  # a prefix that parses still names its tensors
    path.write_bytes(GOOD)
    assert [t.name for t in read_signature(str(path)).inputs] == ["x"]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.integers(0, len(GOOD)))
def test_random_bytes_never_raise_anything_else(tmp_path_factory, junk, at):
    path = tmp_path_factory.mktemp("junk") / "model.onnx"
    path.write_bytes(GOOD[:at] + junk + GOOD[at:])
    try:
        read_signature(str(path))
    except OnnxFormatError:
        pass


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"\x3a\xff\xff\xff\xff\x0f", "runs past the end"),  # graph: a 4 GiB length in a 6-byte file
    (b"\x3a" + b"\xff" * 11, "longer than 10 bytes"),
    (b"\x3b\x00", "wire type 3"),
    (b"\x08\x07", "no graph"),  # ir_version only
])
def test_corrupt_files_are_named_config_errors(tmp_path, data, words):
    model = tmp_path / "m"
    os.makedirs(model / "1")
    (model / "1" / "model.onnx").write_bytes(data)
    src = load_source(str(tmp_path), "m")
    assert src.config is None and words in src.error and "model 'm'" in src.error, src.error


def test_a_directory_named_model_onnx_is_refused(tmp_path):
    os.makedirs(tmp_path / "m" / "1" / "model.onnx")
    src = load_source(str(tmp_path), "m")
    assert src.config is None and src.error


def test_an_oversized_declaration_is_refused_before_it_is_decoded(tmp_path):
    # GraphProto(input: ValueInfoProto of 2 MiB), inside ModelProto.graph
    value_info = b"\x0a\x01x" + b"\x1a" + _varint(2 << 20) + b"d" * (2 << 20)  # name, then a huge doc_string
    graph = b"\x5a" + _varint(len(value_info)) + value_info
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x3a" + _varint(len(graph)) + graph)
    with pytest.raises(OnnxFormatError, match="declaration of"):
        read_signature(str(path))


def test_the_weights_are_skipped_not_copied(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(model_bytes(weight_floats=8 << 20))  # a 32 MiB initializer
    tracemalloc.start()
    try:
        sig = read_signature(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sig.inputs[0].dims == (-1, 8 << 20)
    assert peak < 1 << 20, peak  # Python-side allocations while reading: far below the file's size


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)
