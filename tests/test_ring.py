"""The slot ring and segments in one process: layout, states, bounds, permissions, clean-up."""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from gepool.ipc import layout, naming, ring
from gepool.ipc.ring import Ring, TensorDesc
from gepool.ipc.shm import Segment


@pytest.fixture
def a_ring():
    r = Ring.create(naming.segment_name(naming.new_owner_id(), "test"), 2, 10_000)
    yield r
    r.segment.unlink()
    r.close()


def test_layout_aligns_every_tensor():
    offsets, end = layout.pack([10, 300, 1], start=5)
    assert offsets == [256, 512, 1024]
    assert end == 1280
    assert all(o % layout.ALIGN == 0 for o in offsets)


def test_fill_run_finish_through_a_second_mapping(a_ring):
    worker = Ring.attach(a_ring.handle())
    try:
        front_slot, worker_slot = a_ring.slots[1], worker.slots[1]
        assert front_slot.state == ring.FREE
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        front_slot.data[0:x.nbytes] = x.tobytes()
        front_slot.fill(5, 3, [TensorDesc("FP32", (3, 4), 0, x.nbytes)], 1.0)
        assert worker_slot.state == ring.FILLED
        seq, batch, descs = worker_slot.read()
        assert (seq, batch) == (5, 3)
        np.testing.assert_array_equal(worker_slot.array(descs[0]), x)
        worker_slot.set_state(ring.RUNNING)
        out = TensorDesc("INT64", (3, 1), 256, 24)
        worker_slot.array(out)[:] = [[7], [8], [9]]
        worker_slot.finish(1, [out], 2.0, 3.0)
        assert front_slot.state == ring.DONE
        seq, outs, error, times = front_slot.result()
        assert (seq, error, times) == (5, "", (1.0, 2.0, 3.0))
        np.testing.assert_array_equal(front_slot.array(outs[0]).ravel(), [7, 8, 9])
        front_slot.release()
        assert worker_slot.state == ring.FREE
    finally:
        worker.close()


def test_failure_carries_its_message(a_ring):
    slot = a_ring.slots[0]
    slot.fill(1, 1, [TensorDesc("FP32", (1,), 0, 4)], 0.0)
    slot.fail("RuntimeError: boom", 1.0, 2.0)
    assert slot.state == ring.FAILED
    assert slot.result()[2] == "RuntimeError: boom"


def test_descriptor_past_the_data_area_is_refused(a_ring):
    slot = a_ring.slots[0]
    slot.fill(1, 1, [TensorDesc("FP32", (1,), a_ring.data_bytes, 4)], 0.0)
    with pytest.raises(ValueError, match="past the data area"):
        slot.read()


def test_request_table_carries_rows_outputs_and_single_failures_across_mappings(a_ring):
    worker = Ring.attach(a_ring.handle())
    try:
        front_slot, worker_slot = a_ring.slots[0], worker.slots[0]
        one = [TensorDesc("FP32", (6, 1), 0, 24)]
        front_slot.fill(1, 6, one, 0.0, requests=[(2, 0b01), (1, 0b11), (3, 0b10)])
        assert worker_slot.requests() == [(2, 0b01), (1, 0b11), (3, 0b10)]
        worker_slot.set_state(ring.RUNNING)
        worker_slot.fail_requests({0: "first is bad", 2: ring.Failure.of("third is bad", 3)})
        worker_slot.finish(1, [], 1.0, 2.0)
        assert front_slot.result()[2] == ""  # the batch itself is DONE
        failed = front_slot.request_errors()
        assert failed == {0: "first is bad", 2: "third is bad"}
        assert failed[0].code is None and failed[2].code == 3  # a python model's TritonError code
        front_slot.release()
        front_slot.fill(2, 6, one, 0.0, requests=[(6, 1)])  # a refill forgets the last batch's failures
        assert front_slot.request_errors() == {} and worker_slot.requests() == [(6, 1)]
        front_slot.fill(3, 6, one, 0.0)
        assert worker_slot.requests() == []  # a batch the front did not describe
    finally:
        worker.close()


def test_request_table_bounds(a_ring):
    slot = a_ring.slots[1]
    one = [TensorDesc("FP32", (1,), 0, 4)]
    with pytest.raises(ValueError, match=f"at most {ring.MAX_REQUESTS} requests"):
        slot.fill(1, ring.MAX_REQUESTS + 1, one, 0.0, requests=[(1, 1)] * (ring.MAX_REQUESTS + 1))
    slot.fill(1, 3, one, 0.0, requests=[(1, 1)] * 3)
    with pytest.raises(ValueError, match="outside 0..2"):
        slot.fail_requests({3: "no such request"})
    slot.fail_requests({0: ring.Failure.of("a", -1), 1: ring.Failure.of("b", ring.MAX_FAILURE_CODE + 1),
                        2: ring.Failure.of("c", ring.MAX_FAILURE_CODE)})
    assert [m.code for m in slot.request_errors().values()] == [None, None, ring.MAX_FAILURE_CODE]  # what fits
    long = "x" * ring.REQUEST_ERROR_BYTES  # three failures share the area: each message is cut to its share
    slot.fail_requests({i: long for i in range(3)})
    got = slot.request_errors()
    assert sorted(got) == [0, 1, 2] and all(len(m) == ring.REQUEST_ERROR_BYTES // 3 for m in got.values())


def test_too_many_tensors_is_refused(a_ring):
    with pytest.raises(ValueError, match="at most"):
        a_ring.slots[0].fill(1, 1, [TensorDesc("FP32", (1,), 0, 4)] * (ring.MAX_TENSORS + 1), 0.0)


def test_segment_is_owner_only_and_survives_unlink():
    name = naming.segment_name(naming.new_owner_id(), "perm")
    seg = Segment.create(name, 4096)
    try:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{name[1:]}").st_mode)
        assert mode == 0o600
        other = Segment.attach(name)
        seg.unlink()
        assert not os.path.exists(f"/dev/shm/{name[1:]}")
        seg.buf[0:3] = b"abc"
        assert other.buf[0:3] == b"abc"  # both mappings outlive the name
        other.close()
    finally:
        seg.unlink()
        seg.close()


def test_cleanup_removes_only_dead_owners_segments():
    code = ("from gepool.ipc import naming; from gepool.ipc.shm import Segment; "
            "s = Segment.create(naming.segment_name(naming.new_owner_id(), 'orphan'), 4096); print(s.name)")
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    live = Segment.create(naming.segment_name(naming.new_owner_id(), "live"), 4096)
    try:
        assert dead[1:] in naming.list_segments()
        removed = naming.cleanup_dead()
        assert dead[1:] in removed
        assert live.name[1:] not in removed
        assert live.name[1:] in naming.list_segments()
    finally:
        live.unlink()
        live.close()


def test_doorbell_records_and_prepare(tmp_path):
    """Runs and completions cross the FIFOs whole and in order; PREPARE is a record of its own."""
    from gepool.ipc import doorbell

    paths = doorbell.make(str(tmp_path), "bell")
    front = doorbell.FrontBell(paths)
    worker = doorbell.WorkerBell(paths)
    try:
        assert worker.runs() == []
        front.prepare()
        front.ring(1, 7)
        front.ring(0, 8)
        assert worker.runs() == [(doorbell.PREPARE, 0), (1, 7), (0, 8)]
        worker.done(1, 7)
        assert front.completions() == [(1, 7)]
    finally:
        worker.close()
        front.close()
