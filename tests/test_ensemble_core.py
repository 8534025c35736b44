"""Ensembles in the front's core, in-process with a fake clock: priority, timeout and retries of the steps."""

import os

import numpy as np

from gepool.common import errors
from gepool.ipc import protocol
from gepool.scheduler.states import ModelState
from tests.repo import write
from tests.test_core import MODEL_PY, echo_model, harness, results  # noqa: F401  (harness: the fixture)


def pipe(repo, name: str, steps: list[str], mbs: int = 8) -> None:
    """An ensemble X -> Y through ``steps`` in a line, each model's INPUT to its OUTPUT."""
    chain(repo, name, [(model, "INPUT", "OUTPUT") for model in steps], mbs)


def ens_infer(h, value: float, model: str = "pipe", **kw) -> int:
    h.next_id += 1
    x = np.full((1, 4), value, np.float32)
    msg = protocol.Infer(h.next_id, model, protocol.NO_VERSION, [["X", "FP32", [1, 4], 0]], None, 0, 0,
                         protocol.NO_ARENA, 0, 0)
    for k, v in kw.items():
        setattr(msg, k, v)
    h.core.on_message(b"\0client", [memoryview(msg.encode()), memoryview(x.tobytes())])
    h.step()
    return h.next_id


def first_input(w, index: int) -> float:
    _, _, (desc,) = w.ring.slots[index].read()
    return float(w.ring.slots[index].array(desc)[0, 0])


def test_two_steps_hand_their_tensors_on_inside_the_core(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    h.ready_all()
    assert h.core.control.groups["pipe"].state() == ModelState.AVAILABLE
    wa, wb = sorted(h.out.spawned, key=lambda w: w.model.name)
    rid = ens_infer(h, 1.5)
    assert h.compute(wa) == [1] and not h.out.take()  # step 1 done: nothing for the client yet
    assert h.compute(wb) == [1]
    got = results(h.out.take())
    np.testing.assert_array_equal(got[rid], np.full((1, 4), 6.0, np.float32))  # 1.5 * 2 * 2


def test_a_step_request_carries_the_ensemble_requests_priority(tmp_path, harness):  # noqa: F811
    write(f"{tmp_path}/p/1/model.py", MODEL_PY)
    write(f"{tmp_path}/p/config.pbtxt", """
        backend: "python"
        max_batch_size: 1
        input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        dynamic_batching { priority_levels: 2 default_priority_level: 2 }
    """)
    pipe(tmp_path, "pipe", ["p"], mbs=1)
    h = harness()
    h.ready_all()
    (w,) = h.out.spawned
    h.infer(1.0, model="p")
    h.infer(2.0, model="p")
    h.step()
    assert len(w.bell.rung) == 2  # both slots taken: what comes next queues
    h.infer(3.0, model="p")  # the default level, first in line
    ens_infer(h, 7.0, priority=1)  # level 1: goes first
    h.step()
    assert len(h.core.control.groups["p"].default().batcher) == 2
    h.compute(w)
    first, second = w.bell.rung
    assert (first_input(w, first[0]), first_input(w, second[0])) == (7.0, 3.0)


def test_the_timeout_covers_the_whole_pipeline(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    h.ready_all()
    wa, wb = sorted(h.out.spawned, key=lambda w: w.model.name)
    rid = ens_infer(h, 1.0, timeout_us=1_000_000)
    h.clock.now += 2.0  # step 1 ran past the request's whole timeout
    h.compute(wa)
    err = results(h.out.take())[rid]
    assert err.code == errors.Timeout.code and "ensemble 'pipe' step 2 ('b')" in err.message
    assert not wb.bell.rung and not len(wb.model.batcher)  # step 2 never queued
    assert h.core.control.groups["pipe"].stats.failures == 1


def test_a_step_whose_worker_dies_runs_once_more_on_another(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a", count=2)
    pipe(tmp_path, "pipe", ["a"])
    h = harness()
    h.ready_all()
    rid = ens_infer(h, 1.0)
    (dying,) = [w for w in h.out.spawned if w.bell.rung]
    (other,) = [w for w in h.out.spawned if w is not dying]
    dying.bell.rung = []
    h.exit(dying, -9)
    h.step()
    assert h.compute(other) == [1]
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 2.0, np.float32))


def test_a_step_model_that_goes_away_fails_queued_ensemble_requests_naming_the_step(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    pipe(tmp_path, "pipe", ["a"])
    h = harness()
    h.ready_all()
    (w,) = h.out.spawned
    h.infer(1.0, model="a")
    h.step()
    rid = ens_infer(h, 1.0)  # queued behind the running batch
    w.bell.rung = []
    w.load_failed = True  # it will not come back
    h.exit(w, 1)
    err = results(h.out.take())[rid]
    assert "ensemble 'pipe' step 1 ('a')" in err.message
    group = h.core.control.groups["pipe"]
    assert group.state() == ModelState.UNAVAILABLE and "step 1 ('a')" in group.default().reason


class Journal:
    """Every worker's bell writes, in order: ("prepare" | "ring", model name)."""

    def __init__(self, workers) -> None:
        self.log: list[tuple[str, str]] = []
        for w in workers:
            ring = w.bell.ring
            w.bell.prepare = lambda name=w.model.name: self.log.append(("prepare", name))
            w.bell.ring = lambda slot, seq, name=w.model.name, ring=ring: (self.log.append(("ring", name)),
                                                                           ring(slot, seq))

    def take(self) -> list[tuple[str, str]]:
        out, self.log = self.log, []
        return out


def prewaking(h) -> list:
    """Its workers ready as real synchronous ones say they are (they answer a PREPARE record), polling on."""
    h.core.polling.enabled = True  # the harness turns it off; a pool on more than one CPU has it on
    for w in h.out.spawned:
        h.core.on_worker_message(protocol.WorkerReady(w.id, protocol.PROTOCOL_VERSION, w.process.pid,
                                                      {"prewake": True}))
    h.tick()
    return sorted(h.out.spawned, key=lambda w: w.model.name)


def test_a_lone_ensemble_request_prewakes_each_steps_worker_before_its_batch(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    wa, wb = prewaking(h)
    journal = Journal([wa, wb])
    for value in (1.0, 3.0):  # the second comes after a whole pipeline: traffic is sequential
        rid = ens_infer(h, value)
        assert journal.take() == [("prepare", "a"), ("ring", "a")]
        h.compute(wa)  # b's worker is woken as a's batch completes, before b's batch is admitted
        assert journal.take() == [("prepare", "b"), ("ring", "b")]
        h.compute(wb)
        assert journal.take() == []
        np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), value * 4, np.float32))
    assert h.core.polling.prewakes == 4


def test_no_step_worker_is_prewoken_while_another_computes_or_traffic_batches(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    echo_model(tmp_path, "c")
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    wa, wb, wc = prewaking(h)
    journal = Journal([wa, wb, wc])
    h.infer(1.0, model="c")
    h.step()
    journal.take()
    ens_infer(h, 1.0)  # c computes: the cores are taken, a's worker wakes on its batch alone
    h.compute(wa)
    assert journal.take() == [("ring", "a"), ("ring", "b")]
    h.compute(wb)
    h.compute(wc)
    h.out.take()
    h.infer(2.0, model="a")
    h.step()
    journal.take()
    ens_infer(h, 1.0)  # both queue behind a's direct batch, then run as one batch: traffic batches now
    ens_infer(h, 2.0)
    h.compute(wa)
    assert journal.take() == [("ring", "a")]
    assert h.compute(wa) == [2]
    assert journal.take() == [("ring", "b")]
    assert h.compute(wb) == [2]


# -- nested ensembles: a step that is itself an ensemble ------------------------------------------

def chain(repo, name: str, steps: list[tuple[str, str, str]], mbs: int = 8) -> None:
    """An ensemble X -> Y through ``steps`` in a line, each (model, its input, its output)."""
    os.makedirs(f"{repo}/{name}/1", exist_ok=True)
    blocks = []
    for i, (model, inp, out) in enumerate(steps):
        src = "X" if i == 0 else f"t{i}"
        dst = "Y" if i == len(steps) - 1 else f"t{i + 1}"
        blocks.append(f'{{ model_name: "{model}" input_map {{ key: "{inp}" value: "{src}" }} '
                      f'output_map {{ key: "{out}" value: "{dst}" }} }}')
    write(f"{repo}/{name}/config.pbtxt", f"""
        platform: "ensemble"
        max_batch_size: {mbs}
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        ensemble_scheduling {{ step [ {", ".join(blocks)} ] }}
    """)


def nested_repo(repo) -> None:
    """outer = a, then inner; inner = b, then c: three doublings in all."""
    for name in "abc":
        echo_model(repo, name)
    chain(repo, "inner", [("b", "INPUT", "OUTPUT"), ("c", "INPUT", "OUTPUT")])
    chain(repo, "outer", [("a", "INPUT", "OUTPUT"), ("inner", "X", "Y")])


def reasons(h) -> dict[str, tuple[str, str]]:
    return {name: (g.default().state, g.default().reason) for name, g in h.core.control.groups.items()
            if g.default() is not None}


def test_an_inner_ensemble_runs_as_a_sub_pipeline_of_the_outer(tmp_path, harness):  # noqa: F811
    nested_repo(tmp_path)
    h = harness()
    h.ready_all()
    assert reasons(h)["outer"] == (ModelState.AVAILABLE, "") and reasons(h)["inner"] == (ModelState.AVAILABLE, "")
    wa, wb, wc = sorted(h.out.spawned, key=lambda w: w.model.name)
    rid = ens_infer(h, 1.5, model="outer")
    assert h.compute(wa) == [1] and not h.out.take()
    assert h.compute(wb) == [1] and not h.out.take()  # the inner ensemble's first step: nobody answered yet
    assert h.compute(wc) == [1]
    got = results(h.out.take())
    np.testing.assert_array_equal(got[rid], np.full((1, 4), 12.0, np.float32))  # 1.5 * 2 ** 3
    stats = {name: g.stats for name, g in h.core.control.groups.items()}
    assert stats["outer"].requests == 1 and stats["inner"].requests == 1  # the inner counts its own request
    assert stats["a"].requests == stats["b"].requests == stats["c"].requests == 1
    assert stats["outer"].batches == stats["inner"].batches == 0
    assert h.core.control.groups["inner"].version_requests == {1: 1}


def test_the_outer_timeout_bounds_the_inner_ensembles_steps(tmp_path, harness):  # noqa: F811
    nested_repo(tmp_path)
    h = harness()
    h.ready_all()
    wa, wb, wc = sorted(h.out.spawned, key=lambda w: w.model.name)
    rid = ens_infer(h, 1.0, model="outer", timeout_us=1_000_000)
    h.clock.now += 0.6
    h.compute(wa)
    assert wb.bell.rung  # the inner ensemble started in time
    h.clock.now += 0.6  # 1.2 s since the outer request came: past its whole timeout
    h.compute(wb)
    err = results(h.out.take())[rid]
    assert err.code == errors.Timeout.code
    assert err.message.startswith("ensemble 'outer' step 2 ('inner'): ensemble 'inner' step 2 ('c'): "), err.message
    assert not wc.bell.rung and not len(wc.model.batcher)
    assert h.core.control.groups["outer"].stats.failures == 1 and h.core.control.groups["inner"].stats.failures == 1


def test_an_inner_ensembles_steps_carry_the_outer_requests_priority(tmp_path, harness):  # noqa: F811
    write(f"{tmp_path}/p/1/model.py", MODEL_PY)
    write(f"{tmp_path}/p/config.pbtxt", """
        backend: "python"
        max_batch_size: 1
        input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        dynamic_batching { priority_levels: 2 default_priority_level: 2 }
    """)
    chain(tmp_path, "inner", [("p", "INPUT", "OUTPUT")], mbs=1)
    chain(tmp_path, "outer", [("inner", "X", "Y")], mbs=1)
    h = harness()
    h.ready_all()
    (w,) = h.out.spawned
    h.infer(1.0, model="p")
    h.infer(2.0, model="p")
    h.step()
    assert len(w.bell.rung) == 2
    h.infer(3.0, model="p")  # the default level, first in line
    ens_infer(h, 7.0, model="outer", priority=1)  # level 1, two ensembles down: goes first
    h.step()
    h.compute(w)
    first, second = w.bell.rung
    assert (first_input(w, first[0]), first_input(w, second[0])) == (7.0, 3.0)


def test_unloading_a_model_deep_inside_makes_every_ensemble_above_it_unavailable(tmp_path, harness):  # noqa: F811
    nested_repo(tmp_path)
    h = harness(model_control_mode="explicit", load_models=("a", "b", "c", "inner", "outer"))
    h.ready_all()
    assert reasons(h)["outer"][0] == ModelState.AVAILABLE
    h.send(protocol.Query(1, "unload", {"model": "c"}))
    h.tick()
    state, reason = reasons(h)["inner"]
    assert state == ModelState.UNAVAILABLE and reason == "ensemble 'inner' step 2 ('c'): model 'c' is unloaded"
    state, reason = reasons(h)["outer"]
    assert state == ModelState.UNAVAILABLE and "ensemble 'outer' step 2 ('inner')" in reason \
        and "ensemble 'inner' step 2 ('c'): model 'c' is unloaded" in reason, reason
    h.out.take()
    rid = ens_infer(h, 1.0, model="outer")
    err = results(h.out.take())[rid]
    assert err.code == errors.ModelNotReady.code and "model 'c' is unloaded" in err.message
    h.send(protocol.Query(2, "load", {"model": "c"}))
    h.tick()
    assert reasons(h)["outer"][0] == ModelState.LOADING  # c's new worker is starting: so is everything above it
    h.ready_all()
    assert reasons(h)["outer"] == (ModelState.AVAILABLE, "") and reasons(h)["inner"] == (ModelState.AVAILABLE, "")
    rid = ens_infer(h, 1.0, model="outer")
    for name in "abc":  # the generation serving now (c's old one drains)
        h.compute(h.core.control.groups[name].default().workers[0])
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 8.0, np.float32))


def test_a_step_model_reloaded_with_a_config_that_no_longer_fits_makes_the_ensemble_unavailable(tmp_path, harness):  # noqa: F811
    for name in "ab":
        echo_model(tmp_path, name)
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness(model_control_mode="explicit", load_models=("a", "b", "pipe"))
    h.ready_all()
    assert reasons(h)["pipe"] == (ModelState.AVAILABLE, "")
    for mbs, want in ((4, (ModelState.UNAVAILABLE, "ensemble 'pipe' step 2 ('b'): model 'b' batches at most 4 rows, "
                                                    "less than the ensemble's max_batch_size 8")),
                      (8, (ModelState.AVAILABLE, ""))):
        path = tmp_path / "b" / "config.pbtxt"
        path.write_text(path.read_text().replace(f"max_batch_size: {12 - mbs}", f"max_batch_size: {mbs}"))
        h.send(protocol.Query(mbs, "load", {"model": "b"}))
        h.ready_all()
        h.tick()  # b's old generation drains
        assert reasons(h)["pipe"] == want


def test_a_nesting_cycle_makes_each_ensemble_on_it_unavailable_naming_the_cycle(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    chain(tmp_path, "e1", [("a", "INPUT", "OUTPUT"), ("e2", "X", "Y")])
    chain(tmp_path, "e2", [("e3", "X", "Y")])
    chain(tmp_path, "e3", [("e1", "X", "Y")])
    chain(tmp_path, "above", [("e2", "X", "Y")])  # not on the cycle, but stands on it
    h = harness()
    h.ready_all()
    got = reasons(h)
    assert got["e1"] == (ModelState.UNAVAILABLE, "ensemble 'e1': circular dependency between ensembles: "
                                                 "e1 -> e2 -> e3 -> e1")
    assert got["e2"][1] == "ensemble 'e2': circular dependency between ensembles: e2 -> e3 -> e1 -> e2"
    assert got["e3"][1] == "ensemble 'e3': circular dependency between ensembles: e3 -> e1 -> e2 -> e3"
    assert got["above"][0] == ModelState.UNAVAILABLE and "e2 -> e3 -> e1 -> e2" in got["above"][1]
    assert got["a"][0] == ModelState.AVAILABLE
    rid = ens_infer(h, 1.0, model="e1")
    assert "circular dependency between ensembles" in results(h.out.take())[rid].message


def test_ensembles_nest_at_most_eight_deep(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    for depth in range(1, 10):  # e9 runs a; e8 runs e9; ... e1 runs e2: e1 heads a chain of nine
        chain(tmp_path, f"e{depth}", [("a", "INPUT", "OUTPUT") if depth == 9 else (f"e{depth + 1}", "X", "Y")])
    h = harness()
    h.ready_all()
    got = reasons(h)
    assert got["e1"] == (ModelState.UNAVAILABLE, "ensemble 'e1': ensembles nest 9 deep, past the limit of 8: "
                                                 "e1 -> e2 -> e3 -> e4 -> e5 -> e6 -> e7 -> e8 -> e9")
    assert all(got[f"e{d}"] == (ModelState.AVAILABLE, "") for d in range(2, 10))
    (w,) = h.out.spawned
    rid = ens_infer(h, 1.0, model="e2")  # eight deep: served
    h.compute(w)
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 2.0, np.float32))


# -- copies per hop: a step's outputs go from its slot to the next step's slot ---------------------

def copies(h) -> tuple[int, int, int]:
    c = h.core.ensembles.copies
    return c.out_bytes, c.handed_bytes, c.answered_bytes


def test_a_steps_outputs_reach_the_next_steps_slot_in_one_copy(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    h.ready_all()
    wa, wb = sorted(h.out.spawned, key=lambda w: w.model.name)
    rid = ens_infer(h, 1.5)
    h.compute(wa)
    assert len(wb.bell.rung) == 1
    assert copies(h) == (0, 16, 0)  # 16 bytes went slot to slot: only the batch's copy
    h.compute(wb)
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 6.0, np.float32))
    assert copies(h) == (0, 16, 16)  # and the answer went from b's slot into the reply


def test_a_retried_step_reads_its_inputs_from_the_dead_workers_slot(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b", count=2)
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    h.ready_all()
    (wa,) = [w for w in h.out.spawned if w.model.name == "a"]
    h.infer(9.0, model="a")  # keeps a busy: the two ensemble requests' first steps batch behind it
    h.step()
    rids = [ens_infer(h, 1.0), ens_infer(h, 3.0)]
    h.compute(wa)  # the direct request; then both step 1 requests, as one batch
    h.out.take()
    assert h.compute(wa) == [2]
    (dying,) = [w for w in h.out.spawned if w.model.name == "b" and w.bell.rung]
    assert dying.bell.rung and copies(h) == (0, 32, 0)  # both rows of a's slot went straight into b's, as one batch
    h.infer(100.0, model="a")  # a's slot is refilled and rewritten: the step outputs it held are gone
    h.step()
    h.compute(wa)
    h.out.take()
    dying.bell.rung = []
    h.exit(dying, -9)  # its ring is closed and unlinked
    h.step()
    (other,) = [w for w in h.out.spawned if w.model.name == "b" and w is not dying]
    assert h.compute(other) == [2]
    got = results(h.out.take())
    np.testing.assert_array_equal(got[rids[0]], np.full((1, 4), 4.0, np.float32))
    np.testing.assert_array_equal(got[rids[1]], np.full((1, 4), 12.0, np.float32))
    assert copies(h)[0] == 0


def test_a_step_that_has_to_wait_gets_the_runs_own_copy(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    h.ready_all()
    wa, wb = sorted(h.out.spawned, key=lambda w: w.model.name)
    h.infer(5.0, model="b")  # b computes: the step request queues
    h.step()
    rid = ens_infer(h, 1.5)
    h.compute(wa)
    assert len(wb.bell.rung) == 1 and copies(h) == (16, 0, 0)  # copied out of a's slot to wait
    h.infer(100.0, model="a")  # a's slot is refilled meanwhile
    h.step()
    h.compute(wa)
    h.compute(wb)  # the direct request, then the step
    h.compute(wb)
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 6.0, np.float32))


def test_a_step_reading_from_the_same_model_waits_on_a_copy(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    pipe(tmp_path, "pipe", ["a", "a"])  # its next batch could take the very slot the outputs are in
    h = harness()
    h.ready_all()
    (wa,) = h.out.spawned
    rid = ens_infer(h, 1.5)
    h.compute(wa)
    assert copies(h) == (16, 0, 0)
    h.compute(wa)
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 6.0, np.float32))


def test_a_tensor_both_handed_on_and_answered_is_copied_out_once_for_the_answer(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    os.makedirs(f"{tmp_path}/pipe/1", exist_ok=True)
    write(f"{tmp_path}/pipe/config.pbtxt", """
        platform: "ensemble"
        max_batch_size: 8
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "T" data_type: TYPE_FP32 dims: [ 4 ] } ]
        ensemble_scheduling { step [
          { model_name: "a" input_map { key: "INPUT" value: "X" } output_map { key: "OUTPUT" value: "T" } },
          { model_name: "b" input_map { key: "INPUT" value: "T" } output_map { key: "OUTPUT" value: "Y" } } ] }
    """)
    h = harness()
    h.ready_all()
    wa, wb = sorted(h.out.spawned, key=lambda w: w.model.name)
    rid = ens_infer(h, 1.5)
    h.compute(wa)
    assert copies(h) == (16, 16, 0)  # T went to b's slot, and into the run's buffers for the answer
    h.infer(100.0, model="a")  # a's slot is rewritten before the answer
    h.step()
    h.compute(wa)
    h.out.take()
    h.compute(wb)
    (_, msg, frames), = h.out.take()
    assert msg.req_id == rid and [o[0] for o in msg.outputs] == ["Y", "T"]
    assert np.frombuffer(frames[0], np.float32).tolist() == [6.0] * 4
    assert np.frombuffer(frames[1], np.float32).tolist() == [3.0] * 4
    assert copies(h) == (16, 16, 16)


def test_a_step_withdrawn_in_the_completion_that_started_it_is_not_handed_over(tmp_path, harness):  # noqa: F811
    """a's output T feeds b and c, started in that order when a's step is done; c's model went for good, so
    c's step is refused and the run fails, withdrawing b's step from b's queue in the same completion. The
    hand-over then copies nothing for it (the run is over: its tensors are dropped, not copied out for a
    request nobody will run), and b's queue is left empty."""
    for name in "abc":
        echo_model(tmp_path, name)
    write(f"{tmp_path}/e/config.pbtxt", """
        platform: "ensemble"
        max_batch_size: 8
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "Y1" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "Y2" data_type: TYPE_FP32 dims: [ 4 ] } ]
        ensemble_scheduling { step [
          { model_name: "a" input_map { key: "INPUT" value: "X" } output_map { key: "OUTPUT" value: "T" } },
          { model_name: "b" input_map { key: "INPUT" value: "T" } output_map { key: "OUTPUT" value: "Y1" } },
          { model_name: "c" input_map { key: "INPUT" value: "T" } output_map { key: "OUTPUT" value: "Y2" } } ] }
    """)
    write(f"{tmp_path}/e/1/.keep", "")
    h = harness()
    h.ready_all()
    wa, wb, wc = sorted(h.out.spawned, key=lambda w: w.model.name)
    rid = ens_infer(h, 1.0, model="e")
    assert len(wa.bell.rung) == 1
    wc.load_failed = True  # c goes for good while a runs
    h.exit(wc, 1)
    copies = h.core.ensembles.copies
    before = copies.out_bytes
    h.compute(wa)
    err = results(h.out.take())[rid]
    assert "ensemble 'e' step 3 ('c')" in err.message, err.message
    b = h.core.control.group("b").default()
    assert len(b.batcher) == 0 and b.stats.failure_reasons["CANCELED"] == 1 and not wb.bell.rung
    assert copies.out_bytes == before, (before, copies.out_bytes)  # nothing copied out for the withdrawn step


def test_a_step_request_its_model_cannot_take_is_refused_naming_the_step_and_the_limit(tmp_path, harness):  # noqa: F811
    """A step request is made from the run's tensors without a message, yet checked against what the step's
    model takes as a client's would be: here b's slots hold one row, not eight."""
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b", params='parameters { key: "slot_bytes" value: { string_value: "600" } }')
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    h.ready_all()
    wa, wb = sorted(h.out.spawned, key=lambda w: w.model.name)
    h.next_id += 1
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    msg = protocol.Infer(h.next_id, "pipe", protocol.NO_VERSION, [["X", "FP32", [8, 4], 0]], None, 0, 0,
                         protocol.NO_ARENA, 0, 0)
    h.core.on_message(b"\0client", [memoryview(msg.encode()), memoryview(x.tobytes())])
    h.step()
    assert h.compute(wa) == [8]
    err = results(h.out.take())[h.next_id]
    assert err.code == errors.RequestTooLarge.code
    assert "ensemble 'pipe' step 2 ('b')" in err.message and "a slot of model 'b' holds 600" in err.message
    assert not wb.bell.rung and not len(wb.model.batcher)
    rid = ens_infer(h, 1.5)  # one row fits: the pool serves on
    h.compute(wa)
    h.compute(wb)
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 6.0, np.float32))


def test_step_requests_keep_the_ensemble_requests_identity_deadline_and_origin(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    echo_model(tmp_path, "b")
    pipe(tmp_path, "pipe", ["a", "b"])
    h = harness()
    h.ready_all()
    wa, wb = sorted(h.out.spawned, key=lambda w: w.model.name)
    h.infer(5.0, model="b")  # b computes: the step request waits in b's queue, where it can be read
    h.step()
    rid = ens_infer(h, 1.5, timeout_us=3_000_000, origin=int(protocol.Origin.HTTP))
    h.clock.now += 1.0
    h.compute(wa)
    (pending,) = list(wb.model.batcher.queue)
    req = pending.item
    assert (req.identity, req.req_id, req.model, req.rows, req.shapes) == (b"\0client", rid, "b", 1, [(1, 4)])
    assert req.origin == protocol.Origin.HTTP and req.arena == protocol.NO_ARENA and req.outputs is None
    assert req.deadline == req.expires == h.clock.now + 2.0
    assert req.nbytes == 32  # its input and its output, one row each


# -- explicit model control: an ensemble's steps load with it ------------------------------------

def ab_pipe(repo) -> None:
    """Echo models a and b, and the ensemble pipe: X -> a -> b -> Y."""
    for name in "ab":
        echo_model(repo, name)
    pipe(repo, "pipe", ["a", "b"])


def test_an_explicit_load_of_an_ensemble_loads_its_steps_and_answers_once_they_are_ready(tmp_path, harness):  # noqa: F811
    for name in "abc":
        echo_model(tmp_path, name)
    pipe(tmp_path, "inner", ["b", "c"])
    chain(tmp_path, "outer", [("a", "INPUT", "OUTPUT"), ("inner", "X", "Y")])
    h = harness(model_control_mode="explicit")
    assert h.core.control.groups == {}
    h.send(protocol.Query(7, "load", {"model": "outer"}))
    h.tick()
    assert sorted(h.core.control.groups) == ["a", "b", "c", "inner", "outer"]  # Triton loads what it stands on
    assert h.out.take() == []  # answered when its steps are ready, not before
    assert reasons(h)["outer"][0] == ModelState.LOADING
    h.ready_all()
    h.tick()
    (_, loaded, _), = h.out.take()
    assert isinstance(loaded, protocol.Reply) and loaded.req_id == 7 and loaded.body["loaded"] == "outer"
    rid = ens_infer(h, 1.0, model="outer")
    for name in "abc":
        h.compute(h.core.control.groups[name].default().workers[0])
    np.testing.assert_array_equal(results(h.out.take())[rid], np.full((1, 4), 8.0, np.float32))


def test_an_explicit_load_of_an_ensemble_whose_step_cannot_load_fails_naming_the_step(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    pipe(tmp_path, "pipe", ["a", "missing"])
    h = harness(model_control_mode="explicit")
    h.send(protocol.Query(8, "load", {"model": "pipe"}))
    h.ready_all()
    h.tick()
    (_, reply, _), = h.out.take()
    assert isinstance(reply, protocol.Error) and reply.req_id == 8 and reply.code == errors.ModelNotReady.code
    assert reply.message == "model 'pipe' failed to load: ensemble 'pipe' step 2 ('missing'): model 'missing' is " \
                            "not loaded", reply.message
    assert sorted(h.core.control.groups) == ["a", "pipe"]


def test_an_ensemble_load_leaves_a_loaded_step_as_it_serves(tmp_path, harness):  # noqa: F811
    ab_pipe(tmp_path)
    h = harness(model_control_mode="explicit", load_models=("a",))
    h.ready_all()
    (a_worker,) = h.out.spawned
    h.send(protocol.Query(9, "load", {"model": "pipe"}))
    assert [w.model.name for w in h.out.spawned[1:]] == ["b"]  # a is not loaded again
    h.ready_all()
    h.tick()
    (_, loaded, _), = h.out.take()
    assert isinstance(loaded, protocol.Reply) and loaded.body["loaded"] == "pipe"
    assert h.core.control.groups["a"].default().workers == [a_worker]


def test_the_wildcard_startup_model_loads_the_whole_repository(tmp_path, harness):  # noqa: F811
    ab_pipe(tmp_path)
    h = harness(model_control_mode="explicit", load_models=("*",))
    h.ready_all()
    assert sorted(h.core.control.groups) == ["a", "b", "pipe"]
    assert reasons(h)["pipe"] == (ModelState.AVAILABLE, "")


def test_an_exception_while_loading_an_ensembles_steps_answers_the_load_once(tmp_path, harness):  # noqa: F811
    ab_pipe(tmp_path)
    h = harness(model_control_mode="explicit")
    place = h.out.place

    def no_room(config):
        if config.name == "b":
            raise OSError(28, "No space left on device")
        return place(config)

    h.out.place = no_room
    h.send(protocol.Query(1, "load", {"model": "pipe"}))
    h.ready_all()
    h.tick(200)
    answers = [(type(msg).__name__, msg.req_id) for _, msg, _ in h.out.take()]
    assert answers == [("Error", 1)], answers  # the failure, and not the waiting load's answer as well
    assert h.core.control.after_steps == {}


def test_a_steps_coded_failure_keeps_its_code_through_the_ensemble(tmp_path, harness):  # noqa: F811
    """A python model's TritonError(..., INVALID_ARG) is a 400 through an ensemble as it is alone."""
    from gepool.ipc.ring import Failure

    ab_pipe(tmp_path)
    h = harness()
    for w in h.out.spawned:  # as a python model's worker reports itself: it answers each request alone
        h.core.on_worker_message(protocol.WorkerReady(w.id, protocol.PROTOCOL_VERSION, w.process.pid,
                                                      {"per_request": True}))
    h.tick()
    rid = ens_infer(h, 1.0)
    w = h.core.control.groups["a"].default().workers[0]
    rung, w.bell.rung = w.bell.rung, []
    for index, _ in rung:
        slot = w.ring.slots[index]
        slot.fail_requests({0: Failure.of("bad value", 3)})  # as the worker marks a request its model refused
        slot.fail("bad value", h.clock.now, h.clock.now)
    h.core.on_completions(w, rung)
    h.step()
    err = results(h.out.take())[rid]
    assert err.code == errors.InvalidArgument.code, err
    assert err.message == "ensemble 'pipe' step 1 ('a'): model 'a' failed: bad value", err.message


def test_a_step_name_outside_the_repository_is_not_loaded(tmp_path, harness):  # noqa: F811
    echo_model(tmp_path, "a")
    pipe(tmp_path, "pipe", ["a", str(tmp_path / "a")])  # an absolute path to a real model folder
    h = harness(model_control_mode="explicit")
    h.send(protocol.Query(3, "load", {"model": "pipe"}))
    h.ready_all()
    assert sorted(h.core.control.groups) == ["a", "pipe"]
    (_, reply, _), = h.out.take()
    assert isinstance(reply, protocol.Error) and "is not loaded" in reply.message, reply
