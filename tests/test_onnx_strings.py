"""ONNX models with string tensors, as Triton's onnxruntime backend serves them: ONNX STRING is TYPE_STRING
(BYTES), with or without a config.pbtxt; an element that is not UTF-8 text is refused at admission, naming the
input, before it can join (and fail) a batch of other requests."""

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.ipc import dtypes
from gepool.scheduler.requests import check_text
from tests import repo as test_repo

CONFIG = """
    platform: "onnxruntime_onnx"
    max_batch_size: 4
    input [ { name: "S" data_type: TYPE_STRING dims: [ 2 ] }, { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "S_OUT" data_type: TYPE_STRING dims: [ 2 ] }, { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
    dynamic_batching { }
"""


def strings_model(repo: str, name: str, config: str | None) -> None:
    """S_OUT = S (strings), Y = X + 1, each [batch, 2]."""
    from onnx import TensorProto, helper, numpy_helper

    s = helper.make_tensor_value_info("S", TensorProto.STRING, ["batch", 2])
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 2])
    s_out = helper.make_tensor_value_info("S_OUT", TensorProto.STRING, ["batch", 2])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 2])
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [helper.make_node("Identity", ["S"], ["S_OUT"]), helper.make_node("Add", ["X", "one"], ["Y"])]
    test_repo.make_models._save(helper.make_graph(nodes, name, [s, x], [s_out, y], [one]),
                                f"{repo}/{name}/1/model.onnx")
    if config is not None:
        test_repo.write(f"{repo}/{name}/config.pbtxt", config)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("strings"))
    strings_model(repo, "strings", CONFIG)
    strings_model(repo, "auto", None)  # its config completed from the model, as Triton's auto-complete
    with Pool(repo) as p:
        yield p


@pytest.mark.parametrize("model", ["strings", "auto"])
def test_string_tensors_go_through_onnxruntime_unchanged(pool, model):
    texts = np.array([["é".encode(), b""], [b"a\x00b", b"x" * 300], ["日本".encode(), b"\xf0\x9f\x99\x82"]],
                     dtype=object)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    with pool.client() as c:
        assert c.status()["models"][model]["state"] == "READY"
        out = c.infer(model, {"S": texts, "X": x})
    assert out["S_OUT"].shape == (3, 2) and out["S_OUT"].tolist() == texts.tolist()
    np.testing.assert_array_equal(out["Y"], x + 1)


@pytest.mark.parametrize("texts", [
    [[b"ok", b"\xff"]],  # elements of different lengths
    [[b"\xc3", b"\xa9"]],  # of one length: together they decode ("\xc3\xa9" is e-acute), alone neither does
    [[b"a\xed\xa0\x80", b"abcd"]],  # a surrogate's bytes
])
def test_an_element_that_is_not_utf8_is_refused_naming_the_input(pool, texts):
    with pool.client() as c:
        with pytest.raises(errors.InvalidArgument) as refused:
            c.infer("strings", {"S": np.array(texts, dtype=object), "X": np.zeros((1, 2), np.float32)})
        assert c.infer("strings", {"S": np.array([[b"a", b"b"]], dtype=object),
                                   "X": np.zeros((1, 2), np.float32)})["S_OUT"].tolist() == [[b"a", b"b"]]
    assert refused.value.message == ("input 'S': an onnxruntime model's string tensor takes UTF-8 text, and an "
                                     "element of this one is not")


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_check_text_reads_each_element_alone(monkeypatch, chunk):
    """In chunks of any size (a character split across two chunks is still one character)."""
    monkeypatch.setattr("gepool.scheduler.requests.TEXT_CHUNK_BYTES", chunk)
    test_check_text_reads_each_element_alone_unchunked()
    assert _ok("日本語".encode(), "語本日".encode()) and _ok("é" * 7, "a" * 5) and not _ok("é".encode() * 3, b"ab\xff")


def _ok(*items) -> bool:
    buf = memoryview(dtypes.serialize_bytes(np.array(items, dtype=object)))
    try:
        check_text("S", buf, len(items))
    except errors.InvalidArgument:
        return False
    return True


def test_check_text_reads_each_element_alone_unchunked():
    ok = _ok
    assert ok(b"\xc3\xa9", b"ab") and ok(b"", b"") and ok(b"abc", b"d\x00") and ok()
    assert not ok(b"\xc3", b"\xa9") and not ok(b"ab\xc3", b"\xa9cd") and not ok(b"\x80a", b"bc")
    assert not ok(b"ok", b"\xff") and not ok(b"\xe2\x82", b"x")
