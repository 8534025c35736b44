"""BLS calls into ensembles in the front's core (tests/test_core.py's harness: a real core, real rings, the
workers played): each step request is booked as a call of the batch that made it, so the wait-for check sees
through the ensemble, and a gone batch stops the pipeline it started; an inner pipeline stops with its failed
outer one, a failure of its own, its queued steps unrun."""

import numpy as np
import pytest

from gepool.common import errors
from gepool.scheduler.states import WorkerState
from tests.repo import write
from tests.test_bls_core import _call, _model, _running, _warming, _workers
from tests.test_core import echo_model, results
from tests.test_ensemble_core import chain, ens_infer, pipe


def _stats(h, name: str):
    return h.core.control.groups[name].stats


def _ensembles(repo, nested: bool) -> str:
    """'e' runs b (or, nested, 'outer' runs 'inner', which runs b); returns the name a caller calls."""
    if not nested:
        pipe(repo, "e", ["b"])
        return "e"
    chain(repo, "inner", [("b", "INPUT", "OUTPUT")])
    chain(repo, "outer", [("inner", "X", "Y")])
    return "outer"


@pytest.mark.parametrize("nested", [False, True])
def test_a_cycle_through_an_ensemble_is_refused_naming_the_ensemble_and_its_step(tmp_path, front, nested):
    """a's batch calls the ensemble, whose step b queues behind b's running batch; that batch then calls a,
    whose only worker waits on the step: the call into a is refused at once, the ensemble named on the cycle.
    Without the step booked as a's call, a's worker looks free and the call would wait out its timeout."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    ens = _ensembles(tmp_path, nested)
    h = front()
    h.ready_all()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    rb, from_b = _running(h, wb, 1.0)
    ra, from_a = _running(h, wa, 1.0)
    ae = ens_infer(h, -1.0, model=ens, caller=from_a)
    assert h.out.take() == [] and len(_model(h, "b").batcher) == 1  # the step waits for b's worker
    ba = _call(h, "a", from_b)
    err = results(h.out.take())[ba]
    hops = ("ensemble 'outer' step 1 ('inner') -> ensemble 'inner' step 1 ('b')" if nested
            else "ensemble 'e' step 1 ('b')")
    assert err.code == errors.Unavailable.code
    assert (f"model 'a' cannot take this BLS call: every worker that could run it waits, through BLS calls, on the "
            f"batch that made it (b (worker {wb.id}) -> a (worker {wa.id}) -> {hops} -> b (worker {wb.id}))"
            ) in err.message, err.message
    assert len(_model(h, "a").batcher) == 0
    # b's batch is answered (its model raised the error), then b runs the step, and a's batch is answered
    assert h.compute(wb) == [1] and h.compute(wb) == [1]
    got = results(h.out.take())
    assert set(got) == {rb, ae}
    np.testing.assert_array_equal(got[ae], np.full((1, 4), -2.0, np.float32))
    h.compute(wa)
    assert isinstance(results(h.out.take())[ra], np.ndarray)
    assert not h.core.calls.by_worker and not h.core.calls.orphans


def test_a_step_that_would_close_a_cycle_is_refused_and_fails_the_ensemble_naming_it(tmp_path, front):
    """b's batch calls a first (it queues: a's batch waits on nothing yet); then a's batch calls the ensemble,
    whose step b would wait on b's worker, which waits on a: the step is refused, and the ensemble request
    fails with the step and the cycle named."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "e", ["b"])
    h = front()
    h.ready_all()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    _, from_b = _running(h, wb, 1.0)
    _, from_a = _running(h, wa, 1.0)
    ba = _call(h, "a", from_b)
    assert h.out.take() == [] and len(_model(h, "a").batcher) == 1
    ae = ens_infer(h, -1.0, model="e", caller=from_a)
    err = results(h.out.take())[ae]
    assert err.code == errors.Unavailable.code
    assert err.message.startswith("ensemble 'e' step 1 ('b'): model 'b' cannot take this BLS call: "), err.message
    assert (f"(a (worker {wa.id}) -> ensemble 'e' step 1 ('b') -> b (worker {wb.id}) -> a (worker {wa.id}))"
            in err.message), err.message
    assert len(_model(h, "b").batcher) == 0
    assert _stats(h, "e").failure_reasons["REJECTED"] == 1 and _stats(h, "b").failure_reasons["REJECTED"] == 1
    h.compute(wa)  # a's batch is answered; a runs ba; then b's batch is answered
    h.compute(wa)
    h.compute(wb)
    assert ba in results(h.out.take())
    assert not h.core.calls.by_worker


def test_a_later_step_that_would_close_a_cycle_is_refused_when_it_comes_to_start(tmp_path, front):
    """The ensemble runs c (free), then b. b's batch calls a while step c runs (a's batch then waits only on c:
    not refused); once c is done, step b would wait on b's worker, which waits on a: that step is refused."""
    for name in "abc":
        echo_model(tmp_path, name)
    pipe(tmp_path, "e", ["c", "b"])
    h = front()
    h.ready_all()
    (wa,), (wb,), (wc,) = _workers(h, "a"), _workers(h, "b"), _workers(h, "c")
    _, from_b = _running(h, wb, 1.0)
    _, from_a = _running(h, wa, 1.0)
    ae = ens_infer(h, -1.0, model="e", caller=from_a)
    assert len(wc.bell.rung) == 1  # step 1 runs at once
    ba = _call(h, "a", from_b)
    assert h.out.take() == [] and len(_model(h, "a").batcher) == 1
    h.compute(wc)
    err = results(h.out.take())[ae]
    assert err.message.startswith("ensemble 'e' step 2 ('b'): model 'b' cannot take this BLS call: "), err.message
    assert f"-> ensemble 'e' step 2 ('b') -> b (worker {wb.id})" in err.message, err.message
    assert len(_model(h, "b").batcher) == 0 and _stats(h, "e").failures == 1
    h.compute(wa)
    h.compute(wa)
    h.compute(wb)
    assert ba in results(h.out.take()) and not h.core.calls.by_worker


@pytest.mark.parametrize("nested", [False, True])
def test_a_dead_callers_ensemble_stops_its_queued_step_leaves_unrun(tmp_path, front, nested):
    """a's batch calls the ensemble; its step waits in b's queue behind a held batch. a's worker dies: the step
    leaves b's queue unrun (CANCELED in b's statistics), the call hears the cancellation, each ensemble counts
    a CANCELED failure, and b runs only the held batch."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    ens = _ensembles(tmp_path, nested)
    h = front()
    h.ready_all()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    hold, _ = _running(h, wb, 2.0)
    ra, from_a = _running(h, wa, 1.0)
    ae = ens_infer(h, -1.0, model=ens, caller=from_a)
    assert len(_model(h, "b").batcher) == 1
    h.exit(wa, -9)
    got = results(h.out.take())
    assert set(got) == {ra, ae} and got[ra].code == errors.WorkerDied.code
    assert got[ae].code == errors.Unavailable.code
    assert (f"BLS call to ensemble '{ens}' canceled: the batch of model 'a' that made it is gone (worker {wa.id} "
            f"died") in got[ae].message, got[ae].message
    assert len(_model(h, "b").batcher) == 0 and _stats(h, "b").failure_reasons["CANCELED"] == 1
    for name in (["outer", "inner"] if nested else ["e"]):
        assert _stats(h, name).failure_reasons["CANCELED"] == 1 and _stats(h, name).failures == 1, name
    assert h.compute(wb) == [1] and list(results(h.out.take())) == [hold]
    assert not wb.bell.rung and not h.core.calls.by_worker and not h.core.calls.orphans


def test_an_ensemble_whose_caller_finished_starts_none_of_its_later_steps(tmp_path, front):
    """a's batch calls the ensemble (b, then c) and is answered while step b runs: the call hears the
    cancellation at once, step b's answer is thrown away, and c never sees a request."""
    for name in "abc":
        echo_model(tmp_path, name)
    pipe(tmp_path, "e", ["b", "c"])
    h = front()
    h.ready_all()
    (wa,), (wb,), (wc,) = _workers(h, "a"), _workers(h, "b"), _workers(h, "c")
    ra, from_a = _running(h, wa, 1.0)
    ae = ens_infer(h, -1.0, model="e", caller=from_a)
    assert len(wb.bell.rung) == 1  # step b runs
    h.compute(wa)  # a's execute returned without waiting for the ensemble
    got = results(h.out.take())
    assert set(got) == {ra, ae} and "(it finished)" in got[ae].message and "canceled" in got[ae].message
    assert h.compute(wb) == [1] and h.out.take() == []  # its answer goes nowhere
    b = _stats(h, "b")
    assert b.rows == 1 and b.requests == 0 and b.failure_reasons["CANCELED"] == 1  # dropped: not answered
    assert not wc.bell.rung and not len(_model(h, "c").batcher) and _stats(h, "c").requests == 0
    assert _stats(h, "e").failure_reasons["CANCELED"] == 1 and _stats(h, "e").requests == 0
    assert not h.core.calls.by_worker and not h.core.calls.orphans


def test_a_warmups_call_into_an_ensemble_stops_when_the_warmup_ends(tmp_path, front):
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "e", ["b"])
    h = front()
    (wa,), (wb,) = _workers(h, "a"), _workers(h, "b")
    h.ready(wb)
    h.tick()
    hold, _ = _running(h, wb, 2.0)
    assert wa.state == WorkerState.STARTING
    warm = ens_infer(h, -1.0, model="e", caller=_warming(wa))
    assert len(_model(h, "b").batcher) == 1
    h.ready(wa)
    got = results(h.out.take())
    assert list(got) == [warm] and "(its warmup ended)" in got[warm].message
    assert len(_model(h, "b").batcher) == 0


@pytest.mark.parametrize("nested, queued", [(True, False), (True, True), (False, True)])
def test_an_inner_pipeline_stops_with_its_failed_outer_its_queued_step_unrun(tmp_path, front, nested, queued):
    """outer runs inner (b) and c side by side; c's step fails: the outer fails at once, and inner stops with
    it, a failure (CANCELED) of 'inner'. Inner's step queued behind b's held batch leaves b's queue unrun
    (CANCELED in b's statistics, b runs only the held batch); one already running is run, its answer dropped
    (CANCELED in b's statistics too, never counted answered).
    Not nested (outer runs b itself beside c): b's queued step leaves likewise."""
    echo_model(tmp_path, "b")
    echo_model(tmp_path, "c")
    chain(tmp_path, "inner", [("b", "INPUT", "OUTPUT")])
    first = ('{ model_name: "inner" input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y1" } }' if nested
             else '{ model_name: "b" input_map { key: "INPUT" value: "X" } output_map { key: "OUTPUT" value: "Y1" } }')
    write(f"{tmp_path}/outer/config.pbtxt", f"""
        platform: "ensemble"
        max_batch_size: 8
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "Y1" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "Y2" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        ensemble_scheduling {{ step [ {first},
          {{ model_name: "c" input_map {{ key: "INPUT" value: "X" }} output_map {{ key: "OUTPUT" value: "Y2" }} }} ] }}
    """)
    write(f"{tmp_path}/outer/1/.keep", "")
    h = front()
    h.ready_all()
    (wb,), (wc,) = _workers(h, "b"), _workers(h, "c")
    held_b = _running(h, wb, 2.0)[0] if queued else None
    held, _ = _running(h, wc, 2.0)
    rid = ens_infer(h, 1.0, model="outer")
    assert len(wb.bell.rung) == 1 and len(_model(h, "b").batcher) == int(queued)
    assert len(_model(h, "c").batcher) == 1
    wc.bell.rung = []
    wc.load_failed = True  # c goes for good: its queued step fails
    h.exit(wc, 1)
    err = results(h.out.take())[rid]
    assert "ensemble 'outer' step 2 ('c')" in err.message, err.message
    assert _stats(h, "outer").failures == 1
    inner, b = _stats(h, "inner"), _stats(h, "b")
    assert inner.failures == int(nested) and inner.failure_reasons["CANCELED"] == int(nested) and inner.requests == 0
    assert len(_model(h, "b").batcher) == 0 and b.failure_reasons["CANCELED"] == int(queued)
    assert h.compute(wb) == [1] and h.compute(wb) == []  # the held batch (queued), or inner's step
    got = results(h.out.take())
    assert list(got) == ([held_b] if queued else []), got
    inner, b = _stats(h, "inner"), _stats(h, "b")
    assert inner.failures == int(nested) and inner.requests == 0 and b.rows == 1
    # the held batch answered (queued), or inner's running step's answer dropped: CANCELED, not answered
    assert b.requests == int(queued) and b.failure_reasons["CANCELED"] == 1


def test_a_call_into_an_ensemble_whose_step_is_the_caller_is_refused_by_the_chain_and_books_nothing(tmp_path, front):
    echo_model(tmp_path, "a")
    pipe(tmp_path, "e", ["a"])
    h = front()
    h.ready_all()
    (wa,) = _workers(h, "a")
    _, from_a = _running(h, wa, 1.0)
    ae = ens_infer(h, -1.0, model="e", caller=from_a)
    err = results(h.out.take())[ae]
    assert err.code == errors.InvalidArgument.code
    assert err.message == "ensemble 'e' step 1 ('a'): model 'a' calls itself through BLS: a -> e -> a", err.message
    assert len(_model(h, "a").batcher) == 0 and not h.core.calls.by_worker


def test_a_warmup_calling_its_own_model_through_a_loading_ensemble_is_refused_at_once(tmp_path, front):
    """a's warmup calls e, whose step is a: both still load. Refused at once (before: retried until the call's
    timeout, e being LOADING while a is)."""
    echo_model(tmp_path, "a")
    pipe(tmp_path, "e", ["a"])
    h = front()
    (wa,) = _workers(h, "a")
    ae = ens_infer(h, -1.0, model="e", caller=_warming(wa))
    err = results(h.out.take())[ae]
    assert err.code == errors.InvalidArgument.code and "model 'a' calls itself through BLS: a -> e -> a" in err.message
    assert len(wa.model.batcher) == 0 and not h.core.calls.by_worker


def test_warmups_waiting_on_each_other_through_a_loading_ensemble_the_closing_call_is_refused(tmp_path, front):
    """a's warmup calls e (step b) while a, b and so e load: the step waits in b's queue. b's warmup calls a:
    refused at once, e's step named on the cycle. A warmup's call into e whose step only loads is served."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    echo_model(tmp_path, "c")
    pipe(tmp_path, "e", ["b"])
    pipe(tmp_path, "f", ["a"])
    h = front()
    (wa,), (wb,), (wc,) = _workers(h, "a"), _workers(h, "b"), _workers(h, "c")
    ae = ens_infer(h, -1.0, model="e", caller=_warming(wa))
    assert h.out.take() == [] and len(wb.model.batcher) == 1
    ba = _call(h, "a", _warming(wb))
    err = results(h.out.take())[ba]
    assert err.code == errors.Unavailable.code
    assert (f"(b (worker {wb.id}, warming up) -> a (worker {wa.id}, warming up) -> ensemble 'e' step 1 ('b') -> "
            f"b (worker {wb.id}, warming up))") in err.message, err.message
    cf = ens_infer(h, -3.0, model="f", caller=_warming(wc))  # waits on a, which waits on b: no cycle
    assert h.out.take() == [] and len(wa.model.batcher) == 1
    h.ready(wb)
    h.tick()
    assert h.compute(wb) == [1]
    np.testing.assert_array_equal(results(h.out.take())[ae], np.full((1, 4), -2.0, np.float32))
    h.ready(wa)
    h.tick()
    assert h.compute(wa) == [1]
    np.testing.assert_array_equal(results(h.out.take())[cf], np.full((1, 4), -6.0, np.float32))
    h.ready(wc)
    h.tick()
    assert not h.core.calls.by_worker
