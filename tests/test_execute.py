"""The worker's execution of a slot, in-process on a real ring and real backends: cached batch plans
give the same answers as the full path, for backends that write in place and ones that do not."""

import os

import numpy as np
import pytest

from gepool.common.config import parse_config
from gepool.ipc.ring import Ring, TensorDesc
from gepool.workers.backends import create_backend
from gepool.workers.execute import execute_slot
from tests import repo as test_repo


@pytest.fixture
def ring():
    r = Ring.create(f"/gepool.{os.getpid()}xtest.execute", 2, 1 << 16)
    yield r
    r.close()
    r.segment.unlink()


def _run(ring, backend, config, plans, x: np.ndarray, index: int, seq: int) -> dict:
    slot = ring.slots[index]
    slot.data[:x.nbytes] = x.tobytes()
    slot.fill(seq, x.shape[0], [TensorDesc("FP32", x.shape, 0, x.nbytes)], 0.0)
    execute_slot(slot, backend, config, None, plans)
    got_seq, outs, error, _ = slot.result()
    assert not error and got_seq == seq, error
    out = {t.name: slot.array(d).copy() for t, d in zip(config.outputs, outs, strict=True)}
    slot.release()
    return out


def test_onnx_batches_reuse_their_slot_plans(tmp_path, ring):
    test_repo.make_models.make_tiny(str(tmp_path))
    config = parse_config(str(tmp_path / "tiny" / "config.pbtxt"), "tiny")
    backend = create_backend(config, str(tmp_path / "tiny" / "1"), "cpu", 1)
    plans: dict = {}
    try:
        for seq in range(1, 41):  # batch sizes 1..4, in both slots: 8 layouts
            x = np.random.default_rng(seq).random((1 + seq % 4, 16), dtype=np.float32)
            out = _run(ring, backend, config, plans, x, (seq // 4) % 2, seq)
            np.testing.assert_array_equal(out["OUTPUT0"], 2 * x + 1)
        assert len(plans) == 8  # one per (slot, batch size): later batches of a layout ran from its plan
    finally:
        plans.clear()
        backend.close()


def test_a_backend_that_returns_new_arrays_is_never_planned(tmp_path, ring):
    test_repo.recorder(str(tmp_path), "rec", dims="16")
    config = parse_config(str(tmp_path / "rec" / "config.pbtxt"), "rec")
    backend = create_backend(config, str(tmp_path / "rec" / "1"), "cpu", 1)
    plans: dict = {}
    try:
        for seq in range(1, 13):
            x = np.full((1 + seq % 3, 16), seq, np.float32)
            out = _run(ring, backend, config, plans, x, seq % 2, seq)
            np.testing.assert_array_equal(out["OUTPUT"], x)
            assert out["BATCH"].ravel().tolist() == [x.shape[0]] * x.shape[0]
        assert plans == {}
    finally:
        backend.close()


def test_a_per_request_backend_gets_the_request_table_and_fails_requests_alone(tmp_path, ring):
    from tests.test_triton_python import PICKY_CONFIG, PICKY_PY

    test_repo.write(str(tmp_path / "picky" / "1" / "model.py"), PICKY_PY)
    test_repo.write(str(tmp_path / "picky" / "config.pbtxt"), PICKY_CONFIG)
    config = parse_config(str(tmp_path / "picky" / "config.pbtxt"), "picky")
    backend = create_backend(config, str(tmp_path / "picky" / "1"), "cpu", 1)
    plans: dict = {}
    try:
        x = np.arange(12, dtype=np.float32).reshape(6, 2)
        x[2:5] *= -1  # the second request (rows 2..4) starts negative
        slot = ring.slots[0]
        slot.data[:x.nbytes] = x.tobytes()
        all_outputs = 0b111
        for seq in (1, 2):  # the second time round, from the same slot and layout
            slot.fill(seq, 6, [TensorDesc("FP32", x.shape, 0, x.nbytes)], 0.0,
                      requests=[(2, all_outputs), (3, 0b011), (1, 0b001)])
            execute_slot(slot, backend, config, None, plans)
            _, outs, error, _ = slot.result()
            assert not error
            assert slot.request_errors() == {1: "negative input -4.0 refused"}
            got = {t.name: slot.array(d) for t, d in zip(config.outputs, outs, strict=True)}
            np.testing.assert_array_equal(got["OUTPUT0"][:2], x[:2] + 1)
            np.testing.assert_array_equal(got["OUTPUT0"][5:], x[5:] + 1)
            assert got["NREQ"].ravel().tolist() == [3, 3, 0, 0, 0, 3]  # one execute() call; filler for the failed
            assert got["ARGS"][0, 0] != b"" and got["ARGS"][5, 0] == b""  # only the first request asked for it
            del got
            slot.release()
        slot.fill(3, 6, [TensorDesc("FP32", x.shape, 0, x.nbytes)], 0.0)  # no table: the batch is one request
        execute_slot(slot, backend, config, None, plans)
        _, outs, error, _ = slot.result()
        assert not error and slot.request_errors() == {}
        assert slot.array(outs[1]).ravel().tolist() == [1] * 6  # NREQ: one request of six rows
        slot.release()
    finally:
        plans.clear()
        backend.close()
