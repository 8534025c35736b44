"""The response cache and the failure reasons in the front's core, in-process with a fake clock: a hit rings
no worker, a full queue and a queue timeout count as REJECTED."""

import numpy as np

from gepool.common import errors
from gepool.ipc import protocol
from tests import test_core as core_h  # the harness (the module, so its tests are not collected twice)


def test_a_hit_is_answered_without_ringing_a_worker(tmp_path):
    core_h.echo_model(tmp_path, params="response_cache { enable: true }")
    h = core_h.Harness(tmp_path, cache_size=1 << 20)
    try:
        (w,) = h.out.spawned
        h.ready_all()
        a = h.infer(1.5)
        h.step()
        assert h.compute(w) == [1]
        b = h.infer(1.5)
        h.step()
        assert w.bell.rung == []  # nothing handed to the worker
        got = core_h.results(h.out.take())
        np.testing.assert_array_equal(got[a], np.full((1, 4), 3.0, np.float32))
        np.testing.assert_array_equal(got[b], got[a])
        c = h.infer(2.5)  # other bytes: a miss
        h.step()
        assert len(w.bell.rung) == 1
        h.compute(w)
        np.testing.assert_array_equal(core_h.results(h.out.take())[c], np.full((1, 4), 5.0, np.float32))
        stats = h.core.control.group("echo").stats.as_dict()
        assert stats["cache_hit"]["count"] == 1 and stats["cache_miss"]["count"] == 2
        assert stats["batches"] == 2 and stats["requests"] == 3
        assert h.core.status()["cache"]["entries"] == 2
    finally:
        h.close()


def test_a_full_queue_and_a_queue_timeout_fail_as_rejected(tmp_path):
    core_h.echo_model(tmp_path, extra_db="default_queue_policy { max_queue_size: 1 "
                                         "default_timeout_microseconds: 100000 }")
    h = core_h.Harness(tmp_path)
    try:
        (w,) = h.out.spawned
        h.ready_all()
        h.infer(1.0)
        h.step()  # runs
        h.infer(2.0)  # queued behind it
        full = h.infer(3.0)  # the queue holds one
        replies = core_h.results(h.out.take())
        assert isinstance(replies[full], protocol.Error) and replies[full].code == errors.Unavailable.code
        h.tick(0.2)  # the queued one times out
        (late,) = core_h.results(h.out.take()).values()
        assert late.code == errors.Timeout.code
        h.infer(1.0, inputs=[["INPUT", "FP32", [1, 5], 0]])  # a bad request: OTHER
        reasons = h.core.control.group("echo").stats.as_dict()["failure_reasons"]
        assert reasons == {"REJECTED": 2, "CANCELED": 0, "BACKEND": 0, "OTHER": 1}
    finally:
        h.close()
