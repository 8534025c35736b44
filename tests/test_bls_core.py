"""The front's BLS books in-process (tests/test_core.py's harness: a real core, real rings, the workers played):
the wait-for check, where a call may wait, and the calls a gone batch leaves behind."""

import numpy as np
import pytest

from gepool.common import errors
from gepool.ipc import protocol
from gepool.scheduler.states import WorkerState
from tests.test_core import echo_model, harness, results  # noqa: F401  (harness: the fixture)

ONE = "preferred_batch_size: [ 1 ]"  # a one-row batch is full: the front hands it even to a busy worker's ring


def _workers(h, name: str) -> list:
    return [w for w in h.out.spawned if w.model.name == name]


def _model(h, name: str):
    return h.core.control.group(name).default()


def _running(h, w, value: float, name: str | None = None) -> tuple[int, list]:
    """A client's request that ``w`` runs now: (its req_id, the caller field its batch's calls carry)."""
    req = h.infer(value, name or w.model.name)
    h.step()
    (slot, seq) = w.bell.rung[-1]
    return req, [w.id, slot, seq, w.key]


def _warming(w) -> list:
    """The caller field of ``w``'s warmup's calls."""
    return [w.id, protocol.WARMUP_SLOT, 0, w.key]


def _call(h, model: str, caller: list, value: float = -1.0) -> int:
    req = h.infer(value, model, caller=caller)
    h.step()
    return req


def _errors(replies) -> dict:
    return {k: v for k, v in results(replies).items() if isinstance(v, protocol.Error)}


def test_two_batches_calling_each_others_model_the_second_call_is_refused_naming_the_cycle(tmp_path, front):
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    h.ready_all()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    r1, from_a = _running(h, wa, 1.0)
    r2, from_b = _running(h, wb, 1.0)
    ab = _call(h, "b", from_a)  # b's worker runs a batch that calls nothing (yet): it waits in b's queue
    assert h.out.take() == [] and len(_model(h, "b").batcher) == 1
    ba = _call(h, "a", from_b)  # a's worker waits on ab, which waits on b's worker, which would wait on this
    err = results(h.out.take())[ba]
    assert err.code == errors.Unavailable.code
    assert (f"model 'a' cannot take this BLS call: every worker that could run it waits, through BLS calls, on "
            f"the batch that made it (b (worker {wb.id}) -> a (worker {wa.id}) -> b (worker {wb.id}))") in err.message
    assert len(_model(h, "a").batcher) == 0 and _model(h, "a").stats.failure_reasons["REJECTED"] == 1
    # b's batch fails (its model raised the error): its worker takes ab, a's batch gets its answer, r1 is served
    h.compute(wb)
    h.compute(wb)
    got = results(h.out.take())
    assert set(got) == {r2, ab} and isinstance(got[ab], np.ndarray)
    h.compute(wa)
    assert isinstance(results(h.out.take())[r1], np.ndarray)
    assert not h.core.calls.by_worker


def test_with_a_second_instance_that_will_be_free_both_calls_queue_and_are_served(tmp_path, front):
    """b's second worker runs a batch that calls nothing: the calls are not refused, and each waits in its
    callee's queue for a free worker, never in the ring of a busy one (there it would wait on that worker's
    batch, which may wait on the call). A client's request still goes into a busy worker's ring."""
    echo_model(tmp_path, "a", extra_db=ONE)
    echo_model(tmp_path, "b", count=2, extra_db=ONE)
    h = front()
    h.ready_all()
    (wa,), (wb1, wb2) = _workers(h, "a"), _workers(h, "b")
    r2, from_b = _running(h, wb1, 1.0)
    hold, _ = _running(h, wb2, 2.0)
    r1, from_a = _running(h, wa, 1.0)
    other = h.infer(3.0, "a")
    h.step()
    assert len(wa.inflight) == 2  # a client's request: copied in behind the running batch as before
    ba = _call(h, "a", from_b)
    ab = _call(h, "b", from_a)  # wb1 waits on ba, which waits on wa, which waits on this; but wb2 will be free
    assert h.out.take() == []
    assert len(_model(h, "a").batcher) == 1 and len(_model(h, "b").batcher) == 1
    assert [len(w.inflight) for w in (wa, wb1, wb2)] == [2, 1, 1]
    assert h.compute(wb2) == [1] and h.compute(wb2) == [1]  # hold, then ab on the worker it freed
    got = results(h.out.take())
    assert set(got) == {hold, ab} and isinstance(got[ab], np.ndarray)
    h.compute(wa)  # r1 and other
    h.compute(wa)  # then ba
    h.compute(wb1)
    got = results(h.out.take())
    assert set(got) == {r1, other, ba, r2} and all(isinstance(v, np.ndarray) for v in got.values())


def test_a_call_whose_callee_waits_on_a_free_model_is_served(tmp_path, front):
    """a -> b while b's batch waits on c, whose worker calls nothing: a chain that resolves on its own."""
    for name in ("a", "b", "c"):
        echo_model(tmp_path, name)
    h = front()
    h.ready_all()
    (wa,), (wb,), (wc,) = _workers(h, "a"), _workers(h, "b"), _workers(h, "c")
    _, from_a = _running(h, wa, 1.0)
    _, from_b = _running(h, wb, 1.0)
    _running(h, wc, 1.0)
    bc = _call(h, "c", from_b)
    ab = _call(h, "b", from_a)
    assert h.out.take() == [] and len(_model(h, "b").batcher) == 1 and len(_model(h, "c").batcher) == 1
    h.compute(wc)
    h.compute(wc)
    assert bc in results(h.out.take())
    h.compute(wb)
    h.compute(wb)
    assert ab in results(h.out.take())


def test_a_dead_callers_queued_calls_leave_unrun_and_its_running_calls_answer_is_thrown_away(tmp_path, front):
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b", count=2)
    h = front()
    h.ready_all()
    (wa,), (wb1, wb2) = _workers(h, "a"), _workers(h, "b")
    hold, _ = _running(h, wb1, 2.0)
    r1, from_a = _running(h, wa, 1.0)
    running = _call(h, "b", from_a)  # on wb2, idle
    queued = [_call(h, "b", from_a) for _ in range(2)]  # both b workers busy: queued
    assert len(wb2.inflight) == 1 and len(_model(h, "b").batcher) == 2
    b = _model(h, "b")
    h.exit(wa, -9)
    got = results(h.out.take())
    assert set(got) == {r1, *queued}
    assert got[r1].code == errors.WorkerDied.code
    for q in queued:
        assert got[q].code == errors.Unavailable.code
        assert f"canceled: the batch of model 'a' that made it is gone (worker {wa.id} died" in got[q].message
    assert len(b.batcher) == 0 and b.stats.failure_reasons["CANCELED"] == 2
    assert h.compute(wb2) == [1]  # the running call finishes; its answer is replaced by the cancellation
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == running and reply.code == errors.Unavailable.code and "canceled" in reply.message
    assert b.stats.failure_reasons["CANCELED"] == 3 and b.stats.requests == 0  # counted as what its caller heard
    assert h.compute(wb1) == [1] and list(results(h.out.take())) == [hold]
    assert b.stats.requests == 1 and b.stats.failures == 3
    assert not wb1.bell.rung and not wb2.bell.rung and not h.core.calls.by_worker


def test_a_running_call_of_a_gone_caller_is_not_run_again_when_its_own_worker_dies(tmp_path, front):
    """The front's usual recovery would run the call once more on the callee's other worker: nobody waits for
    it, so it leaves the queue unrun instead."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b", count=2)
    h = front()
    h.ready_all()
    (wa,), (wb1, wb2) = _workers(h, "a"), _workers(h, "b")
    hold, _ = _running(h, wb1, 2.0)
    r1, from_a = _running(h, wa, 1.0)
    running = _call(h, "b", from_a)
    assert len(wb2.inflight) == 1
    h.exit(wa, -9)
    assert list(results(h.out.take())) == [r1]
    h.exit(wb2, -9)  # its batch would be retried on wb1, behind hold
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == running and "canceled" in reply.message
    assert len(_model(h, "b").batcher) == 0 and _model(h, "b").stats.failure_reasons["CANCELED"] == 1
    assert h.compute(wb1) == [1] and list(results(h.out.take())) == [hold] and not wb1.bell.rung
    assert not h.core.calls.orphans and not h.core.calls.by_worker


def test_the_queued_calls_of_a_batch_that_finished_leave_unrun(tmp_path, front):
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    h.ready_all()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    hold, _ = _running(h, wb, 2.0)
    r1, from_a = _running(h, wa, 1.0)
    calls = [_call(h, "b", from_a) for _ in range(3)]
    h.compute(wa)  # it returned without waiting for them
    got = results(h.out.take())
    assert isinstance(got.pop(r1), np.ndarray) and set(got) == set(calls)
    assert all("canceled" in e.message and "(it finished)" in e.message for e in got.values())
    assert h.compute(wb) == [1] and list(results(h.out.take())) == [hold]
    assert not wb.bell.rung and _model(h, "b").stats.failure_reasons["CANCELED"] == 3


def test_a_queued_call_left_with_no_worker_that_could_run_it_fails_when_that_worker_fails_for_good(tmp_path, front):
    """b's second worker is restarting, so a's call waits for it; its load then fails: nothing can ever run the
    call, which is failed at once; the call it waited against is then served."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b", count=2)
    h = front()
    h.ready_all()
    (wa,), (wb1, wb2) = _workers(h, "a"), _workers(h, "b")
    h.exit(wb2, -9)
    r2, from_b = _running(h, wb1, 1.0)
    r1, from_a = _running(h, wa, 1.0)
    ba = _call(h, "a", from_b)
    ab = _call(h, "b", from_a)  # wb2 restarts: it will be free
    assert h.out.take() == []
    h.tick(5.0)
    assert wb2.state == WorkerState.STARTING
    h.core.on_worker_message(protocol.WorkerFailed(wb2.id, "weights missing"))
    err = results(h.out.take())[ab]
    assert err.code == errors.Unavailable.code and "model 'b' can no longer run this BLS call" in err.message
    assert f"a (worker {wa.id}) -> b (worker {wb1.id}) -> a (worker {wa.id})" in err.message
    h.compute(wa)  # a's batch fails with that error; then it runs ba
    h.compute(wa)
    h.compute(wb1)
    got = results(h.out.take())
    assert set(got) == {r1, ba, r2} and isinstance(got[ba], np.ndarray)


def test_a_warming_up_worker_waits_on_its_warmups_calls_and_they_end_with_the_warmup(tmp_path, front):
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    h.ready(wb)
    h.tick()
    r2, from_b = _running(h, wb, 1.0)
    warm = _call(h, "b", _warming(wa))  # a's warmup calls b: queued behind r2
    ba = _call(h, "a", from_b)  # a is still LOADING: refused as not ready, as any request
    assert results(h.out.take())[ba].code == errors.ModelNotReady.code
    h.ready(wa)  # the warmup is over: its call leaves b's queue unrun
    got = results(h.out.take())
    assert list(got) == [warm] and "(its warmup ended)" in got[warm].message
    assert len(_model(h, "b").batcher) == 0


@pytest.mark.parametrize("callee_count", [1, 2])
def test_calls_of_many_threads_of_one_batch_wait_together(tmp_path, front, callee_count):
    """One batch with several calls in flight at once (threads, or an async execute): it waits on all of
    them. b's batch calls a while a's batch has three calls queued at b."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b", count=callee_count)
    h = front()
    h.ready_all()
    (wa,), wbs = _workers(h, "a"), _workers(h, "b")
    r2, from_b = _running(h, wbs[0], 1.0)
    holds = [_running(h, w, 2.0)[0] for w in wbs[1:]]
    _, from_a = _running(h, wa, 1.0)
    calls = [_call(h, "b", from_a) for _ in range(3)]
    ba = _call(h, "a", from_b)
    got = _errors(h.out.take())
    if callee_count == 1:
        assert list(got) == [ba] and "cannot take this BLS call" in got[ba].message
    else:
        assert got == {} and len(holds) == 1 and len(_model(h, "a").batcher) == 1
        assert len(_model(h, "b").batcher) == len(calls)


def test_a_withdrawn_request_leaves_its_queue_its_rows_its_bytes_and_its_deadline():
    from gepool.scheduler.batcher import DynamicBatcher, QueueBudget
    from gepool.scheduler.queues import DELAY, Policy, PolicyQueues

    budget = QueueBudget(1 << 20)
    levels = PolicyQueues(2, 1, Policy(default_timeout_us=1000, timeout_action=DELAY))
    b = DynamicBatcher(16, (8,), 0, clock=lambda: 0.0, queues=levels, budget=budget)
    a, x, y = object(), object(), object()
    assert b.add(a, 2, nbytes=10, priority=1) and b.add(x, 3, nbytes=20, priority=2, deadline_us=500)
    assert b.add(y, 1, nbytes=40, priority=2, deadline_us=2000)
    assert b.timeout_deadline() == 0.0005
    assert b.withdraw(x) and not b.withdraw(x) and not b.withdraw(object())
    assert [p.item for p in b.queue] == [a, y] and len(b) == 2 and b.rows == 3 and budget.used == 50
    assert b.timeout_deadline() == 0.001  # x's deadline no longer counts
    assert b.withdraw(a) and b.withdraw(y) and len(b) == 0 and b.rows == 0 and budget.used == 0
    assert b.timeout_deadline() is None


def test_a_restarted_workers_old_key_is_refused_and_its_new_one_served(tmp_path, front):
    """a's worker dies and is restarted: a call naming its new process's batch with the old process's key is
    refused (PermissionDenied, b runs nothing), the same call with the new key is served."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    h.ready_all()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    old = wa.key
    h.exit(wa, -9)
    h.tick(1.0)
    assert wa.state == WorkerState.STARTING and wa.key != old
    h.ready(wa)
    h.tick()
    ra, from_a = _running(h, wa, 1.0)
    stale = _call(h, "b", [*from_a[:3], old])
    err = results(h.out.take())[stale]
    assert err.code == errors.PermissionDenied.code and "key" in err.message, err.message
    assert not wb.bell.rung and len(_model(h, "b").batcher) == 0 and not h.core.calls.by_worker
    fresh = _call(h, "b", from_a)
    assert h.compute(wb) == [1]
    np.testing.assert_array_equal(results(h.out.take())[fresh], np.full((1, 4), -2.0, np.float32))
    h.compute(wa)
    assert isinstance(results(h.out.take())[ra], np.ndarray) and not h.core.calls.by_worker


def test_a_call_over_the_pools_queued_bytes_is_refused_by_the_budget_before_the_wait_for_check(
        tmp_path, harness):  # noqa: F811
    """The two batches' cycle of the first test, with the pool's queues full: the call that would close the
    cycle is refused by the cheap check (max_queued_bytes), before its wait-for walk, and books nothing."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = harness(max_queued_bytes=100)  # a one-row request holds 32 bytes
    h.ready_all()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    _, from_a = _running(h, wa, 1.0)
    _, from_b = _running(h, wb, 1.0)
    _call(h, "b", from_a)
    for _ in range(2):
        _call(h, "b", from_a)
    assert h.out.take() == [] and h.core.control.budget.used == 96
    ba = _call(h, "a", from_b)
    err = results(h.out.take())[ba]
    assert err.code == errors.Unavailable.code and "max_queued_bytes (100)" in err.message, err.message
    assert "cannot take this BLS call" not in err.message
    assert len(_model(h, "a").batcher) == 0 and wb.id not in h.core.calls.by_worker


def test_two_warmups_calling_each_others_loading_model_the_second_call_is_refused_naming_the_cycle(tmp_path, front):
    """a's warmup calls b while both load: it waits in b's queue. b's warmup then calls a: that call closes the
    cycle and is refused at once. b's warmup fails with it, and a's call, which only b could run, fails with b's
    reason: both models end UNAVAILABLE, as Triton fails a model whose warmup fails."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    ab = _call(h, "b", _warming(wa))
    assert h.out.take() == [] and len(wb.model.batcher) == 1
    ba = _call(h, "a", _warming(wb))
    err = results(h.out.take())[ba]
    assert err.code == errors.Unavailable.code
    cycle = f"b (worker {wb.id}, warming up) -> a (worker {wa.id}, warming up) -> b (worker {wb.id}, warming up)"
    assert (f"model 'a' cannot take this BLS call: every worker that could run it waits, through BLS calls, on "
            f"the batch that made it ({cycle})") in err.message, err.message
    assert len(wa.model.batcher) == 0 and wa.model.stats.failure_reasons["REJECTED"] == 1
    reason = f"RuntimeError: warmup 'default1' failed: Unavailable: {err.message}"
    h.core.on_worker_message(protocol.WorkerFailed(wb.id, reason))
    got = results(h.out.take())[ab]
    assert got.code == errors.Unavailable.code and "model 'b' can no longer run this BLS call" in got.message
    assert cycle in got.message, got.message  # b's reason, named in a's error
    assert len(wb.model.batcher) == 0 and not h.core.calls.by_worker.get(wb.id)
    h.exit(wb, 3)
    h.core.on_worker_message(protocol.WorkerFailed(wa.id, f"RuntimeError: warmup 'default1' failed: {got.message}"))
    h.exit(wa, 3)
    for w in (wa, wb):
        assert w.model.state == "UNAVAILABLE" and cycle in w.model.reason
    assert not h.core.calls.by_worker


def test_a_warmups_call_into_a_loading_model_waits_and_is_served_once_that_model_is_ready(tmp_path, front):
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    ab = _call(h, "b", _warming(wa))
    assert h.out.take() == [] and not wb.bell.rung
    h.ready(wb)
    h.tick()
    assert h.compute(wb) == [1]
    np.testing.assert_array_equal(results(h.out.take())[ab], np.full((1, 4), -2.0, np.float32))
    h.ready(wa)
    h.tick()
    assert wa.model.state == "READY" and wb.model.state == "READY" and not h.core.calls.by_worker


def test_a_serving_batchs_call_into_a_loading_model_is_still_refused_as_not_ready(tmp_path, front):
    """Only a warmup waits for a loading callee: a serving batch that did would hold its worker meanwhile."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    h.ready(wa)
    h.tick()
    _, from_a = _running(h, wa, 1.0)
    ab = _call(h, "b", from_a)
    err = results(h.out.take())[ab]
    assert err.code == errors.ModelNotReady.code and "LOADING" in err.message
    assert len(wb.model.batcher) == 0


def test_three_warmups_in_a_ring_the_call_that_closes_it_is_refused_naming_every_hop(tmp_path, front):
    for name in ("a", "b", "c"):
        echo_model(tmp_path, name)
    h = front()
    (wa,), (wb,), (wc,) = _workers(h, "a"), _workers(h, "b"), _workers(h, "c")
    ab = _call(h, "b", _warming(wa))
    bc = _call(h, "c", _warming(wb))
    assert h.out.take() == []
    ca = _call(h, "a", _warming(wc))
    err = results(h.out.take())[ca]
    assert err.code == errors.Unavailable.code
    assert (f"(c (worker {wc.id}, warming up) -> a (worker {wa.id}, warming up) -> b (worker {wb.id}, warming up) "
            f"-> c (worker {wc.id}, warming up))") in err.message, err.message
    h.ready(wc)  # c's warmup survived the refusal (its model caught it): c runs b's call, then b runs a's
    h.tick()
    assert h.compute(wc) == [1] and bc in results(h.out.take())
    h.ready(wb)
    h.tick()
    assert h.compute(wb) == [1] and ab in results(h.out.take())
    h.ready(wa)
    h.tick()
    assert all(w.model.state == "READY" for w in (wa, wb, wc)) and not h.core.calls.by_worker


def test_unloading_a_loading_model_that_holds_a_warmups_call_stops_it_and_fails_the_call(tmp_path, harness):  # noqa: F811
    """A warmup's call waits in a loading model's queue: an unload must still stop that model (before, a
    draining model with anything queued was left to load, then served the call after its unload)."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = harness(model_control_mode="explicit", load_models=("a", "b"))
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    ab = _call(h, "b", _warming(wa))
    assert h.out.take() == [] and len(wb.model.batcher) == 1
    h.send(protocol.Query(1, "unload", {"model": "b"}))
    h.tick()
    assert wb in h.out.stopped or wb in h.out.killed
    h.exit(wb, 0)
    err = results(h.out.take())[ab]
    assert isinstance(err, protocol.Error) and "b" in err.message, err
    assert len(wb.model.batcher) == 0 and not h.core.calls.by_worker.get(wa.id)


def test_a_call_no_worker_will_run_quotes_only_the_current_reasons_not_a_recovered_workers_old_one(tmp_path, front):
    """b's first worker died once and serves again (its old reason still on it); its batch waits on a call
    into c, whose one worker then fails for good, as b's second did: a's call into b can never run, and the
    error names why now (b's failed worker, and c's), not the crash b's first worker recovered from."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b", count=2)
    echo_model(tmp_path, "c")
    h = front()
    h.ready_all()
    (wa,), (wb1, wb2), (wc,) = _workers(h, "a"), _workers(h, "b"), _workers(h, "c")
    for w, why in ((wb1, None), (wb2, "b's weights missing")):
        h.exit(w, -9)
        h.tick(5.0)
        assert w.state == WorkerState.STARTING
        if why is None:
            h.ready(w)
        else:
            h.core.on_worker_message(protocol.WorkerFailed(w.id, why))
        h.tick()
    assert wb1.state == WorkerState.READY and "exit code -9" in wb1.reason  # recovered, its reason stale
    _running(h, wc, 1.0)  # c computes: b's call waits in c's queue
    _, from_b = _running(h, wb1, 1.0)
    bc = _call(h, "c", from_b)
    _, from_a = _running(h, wa, 1.0)
    ab = _call(h, "b", from_a)
    assert _errors(h.out.take()) == {}
    h.exit(wc, -9)
    h.tick(5.0)
    h.core.on_worker_message(protocol.WorkerFailed(wc.id, "c's weights missing"))
    got = _errors(h.out.take())
    assert got[ab].code == errors.Unavailable.code
    assert ("model 'b' can no longer run this BLS call: no worker of model 'b' will ever be free to run it "
            "(b's weights missing; model 'c': c's weights missing)") in got[ab].message, got[ab].message
    assert "exit code -9" not in got[ab].message
    assert "no worker of model 'c' will ever be free to run it (c's weights missing)" in got[bc].message


def test_a_warmups_call_into_a_model_that_keeps_crashing_while_it_loads_fails_naming_it(tmp_path, front):
    """b's worker dies each time it loads: after CRASH_LOOP_DEATHS deaths in a row a's warmup's call into b
    is failed, naming b and the crash, instead of waiting out its timeout; a new one is refused at once."""
    from gepool.scheduler.calls import CRASH_LOOP_DEATHS

    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    h = front()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    ab = _call(h, "b", _warming(wa))
    for death in range(1, CRASH_LOOP_DEATHS + 1):
        assert h.out.take() == [] and wb.state == WorkerState.STARTING
        h.exit(wb, -11)
        if death < CRASH_LOOP_DEATHS:
            h.tick(60.0)  # past its backoff: it starts loading again
    err = results(h.out.take())[ab]
    assert err.code == errors.Unavailable.code
    assert (f"model 'b' can no longer run this BLS call: no worker of model 'b' will ever be free to run it "
            f"(worker {wb.id} died with exit code -11, {CRASH_LOOP_DEATHS} times in a row while loading)"
            ) in err.message, err.message
    assert len(wb.model.batcher) == 0 and not h.core.calls.by_worker
    again = _call(h, "b", _warming(wa))
    err = results(h.out.take())[again]
    assert err.code == errors.Unavailable.code and "model 'b' cannot take this BLS call" in err.message
    assert wb.restart_at is not None  # the pool's own restarts go on
