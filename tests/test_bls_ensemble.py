"""BLS calls into ensembles in a real pool: a cycle through an ensemble is refused at once, naming it, and the
pipeline a gone batch started stops, its queued steps unrun; an inner pipeline stops with its failed outer one,
a failure of its own, its queued step unrun. Python models held on gate files."""

import os
import re
import signal
import time

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from tests import repo as test_repo
from tests.conftest import wait_until
from tests.test_bls_deadlock import MUTUAL_PY, TRITON_MUTUAL_PY, WIDTH, _model, spray_py

# each model's own BLS timeout: long enough that a call left to wait it out fails the time bound below, short
# enough that a run without the wait-for check through ensembles fails on that bound, not on the test's timeout
CALL_TIMEOUT_S = 75
REFUSED_WITHIN_S = 30

# A positive first element: three calls to the ensemble "es", not waited for (its batch ends with them queued,
# once a last call on the same socket, so after them, is answered); negative: it waits for all three.
FAN_PY = spray_py("es")


# fails a request whose first element is -3 (after its other branch has started); else echoes
BOOM_PY = '''
class Model:
    def execute(self, inputs):
        x = inputs["INPUT"]
        if x[0, 0] == -3:
            raise RuntimeError("boom")
        return {"OUTPUT": x.copy()}
'''

# par runs the ensemble inn (its one step the held sink) and boom side by side
PAR_PBTXT = f"""
    platform: "ensemble"
    max_batch_size: 8
    input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
    output [ {{ name: "Y1" data_type: TYPE_FP32 dims: [ {WIDTH} ] }}, {{ name: "B" data_type: TYPE_INT32 dims: [ 1 ] }},
             {{ name: "Y2" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
    ensemble_scheduling {{ step [
      {{ model_name: "inn" input_map {{ key: "INPUT" value: "INPUT" }}
        output_map {{ key: "OUTPUT" value: "Y1" }} output_map {{ key: "BATCH" value: "B" }} }},
      {{ model_name: "boom" input_map {{ key: "INPUT" value: "INPUT" }} output_map {{ key: "OUTPUT" value: "Y2" }} }}
    ] }}
"""


def _ensemble(repo: str, name: str, step: str, outputs: tuple[str, ...] = ("OUTPUT",)) -> None:
    dtype = {"OUTPUT": f"TYPE_FP32 dims: [ {WIDTH} ]", "BATCH": "TYPE_INT32 dims: [ 1 ]"}
    outs = ", ".join(f'{{ name: "{o}" data_type: {dtype[o]} }}' for o in outputs)
    maps = " ".join(f'output_map {{ key: "{o}" value: "{o}" }}' for o in outputs)
    os.makedirs(f"{repo}/{name}/1", exist_ok=True)
    test_repo.write(f"{repo}/{name}/config.pbtxt", f"""
        platform: "ensemble"
        max_batch_size: 8
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
        output [ {outs} ]
        ensemble_scheduling {{ step [ {{ model_name: "{step}" input_map {{ key: "INPUT" value: "INPUT" }} {maps} }} ] }}
    """)


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    d = tmp_path_factory.mktemp("gates")
    return {k: str(d / k) for k in ("go1", "go2", "sink")}


@pytest.fixture(scope="module")
def pool(tmp_path_factory, gates):
    repo = str(tmp_path_factory.mktemp("bls_ensemble"))
    t = str(CALL_TIMEOUT_S)
    # ma calls the ensemble em, whose one step is mb; mb calls ma. The same as Triton python models: ta, et, tb
    _model(repo, "ma", MUTUAL_PY, {"callee": "em", "go": gates["go1"], "timeout_s": t})
    _model(repo, "mb", MUTUAL_PY, {"callee": "ma", "go": gates["go1"], "timeout_s": t})
    _ensemble(repo, "em", "mb")
    _model(repo, "ta", TRITON_MUTUAL_PY, {"callee": "et", "go": gates["go2"], "timeout_s": t})
    _model(repo, "tb", TRITON_MUTUAL_PY, {"callee": "ta", "go": gates["go2"], "timeout_s": t})
    _ensemble(repo, "et", "tb")
    _model(repo, "fan", FAN_PY, {})
    test_repo.recorder(repo, "sink", gate=gates["sink"], max_batch=8, preferred="8", delay_us=0, dims=str(WIDTH))
    test_repo.recorder(repo, "echo", max_batch=8, preferred="8", delay_us=0, dims=str(WIDTH))
    _ensemble(repo, "es", "sink", ("OUTPUT", "BATCH"))
    _ensemble(repo, "inn", "sink", ("OUTPUT", "BATCH"))
    _model(repo, "boom", BOOM_PY, {})
    os.makedirs(f"{repo}/par/1", exist_ok=True)
    test_repo.write(f"{repo}/par/config.pbtxt", PAR_PBTXT)
    with Pool(repo) as p:
        yield p


def _x(first: float) -> np.ndarray:
    x = np.arange(1, WIDTH + 1, dtype=np.float32)[None, :] / 10
    x[0, 0] = first
    return x


def _gate(path: str) -> None:
    open(path, "w").close()


def _ungate(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("a, b, e, gate, code", [("ma", "mb", "em", "go1", "[UNAVAILABLE]"),
                                                 ("ta", "tb", "et", "go2", "Triton code 4:")])
def test_two_models_waiting_on_each_other_through_an_ensemble_are_refused_at_once(pool, gates, a, b, e, gate, code):
    """a's only worker runs request 1, b's only worker request 2; then a calls the ensemble e (whose step is b)
    and b calls a. Whichever call comes second would wait forever: it is refused at once, naming the cycle
    through the ensemble's step, and the other request is served."""
    c = pool.client(timeout=CALL_TIMEOUT_S + 60)
    _gate(gates[gate])
    try:
        fa = c.infer_async(a, {"INPUT": _x(1)})
        fb = c.infer_async(b, {"INPUT": _x(1)})
        assert wait_until(lambda: c.stats()[a]["batches"] >= 1 and c.stats()[b]["batches"] >= 1)
    finally:
        _ungate(gates[gate])
    released = time.monotonic()
    results = {}
    for name, fut in ((a, fa), (b, fb)):
        try:
            results[name] = fut.result(timeout=CALL_TIMEOUT_S + 30)
        except errors.GepoolError as exc:
            results[name] = exc
    assert time.monotonic() - released < REFUSED_WITHIN_S, results
    refused = [n for n, r in results.items() if isinstance(r, errors.GepoolError)]
    assert len(refused) == 1, results
    (loser,) = refused
    winner = b if loser == a else a
    msg = results[loser].message
    assert code in msg and "no answer" not in msg, msg
    w = r"\(worker \d+\)"
    step = f"ensemble '{e}' step 1 \\('{b}'\\)"
    if loser == b:  # b's call into a came second
        assert f"model '{a}' cannot take this BLS call" in msg, msg
        assert re.search(rf"{b} {w} -> {a} {w} -> {step} -> {b} {w}", msg), msg
    else:  # a's call into the ensemble came second: its step is refused, and the ensemble fails naming it
        assert f"ensemble '{e}' step 1 ('{b}'): model '{b}' cannot take this BLS call" in msg, msg
        assert re.search(rf"{a} {w} -> {step} -> {b} {w} -> {a} {w}", msg), msg
    np.testing.assert_array_equal(results[winner]["OUTPUT"], -_x(1))
    for name in (a, b, e):  # all serve again
        np.testing.assert_array_equal(c.infer(name, {"INPUT": _x(3)})["OUTPUT"], _x(3))


def _counts(c) -> tuple[int, int, int]:
    s = c.stats()
    return s["sink"]["rows"], s["sink"]["failure_reasons"]["CANCELED"], s["es"]["failure_reasons"]["CANCELED"]


@pytest.mark.timeout(180)
def test_the_ensemble_runs_of_a_killed_caller_stop_their_queued_steps_never_run(pool, gates):
    """fan's batch calls the ensemble es three times; es's step model sink is held, so the three steps queue.
    SIGKILL fan's worker: the steps leave sink's queue unrun (CANCELED in sink's and in es's statistics), sink
    runs only what the test sent it, and all three keep serving."""
    c = pool.client(timeout=120)
    gate = gates["sink"]
    rows0, sink0, es0 = _counts(c)
    _gate(gate)
    try:
        held = c.infer_async("sink", {"INPUT": -np.ones((1, WIDTH), np.float32)})
        assert wait_until(lambda: c.stats()["sink"]["rows"] == rows0 + 1)
        (pid,) = c.status()["models"]["fan"]["worker_pids"]
        fut = c.infer_async("fan", {"INPUT": _x(-1)})
        assert wait_until(lambda: c.status()["models"]["sink"]["queued"] == 3)
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: c.status()["models"]["sink"]["queued"] == 0)
        assert wait_until(lambda: _counts(c) == (rows0 + 1, sink0 + 3, es0 + 3)), _counts(c)
    finally:
        _ungate(gate)
    with pytest.raises(errors.GepoolError, match="died"):
        fut.result(timeout=60)
    assert (held.result(timeout=60)["OUTPUT"] == -1).all()
    probe = c.infer("es", {"INPUT": _x(5)})  # behind anything still queued in sink
    np.testing.assert_array_equal(probe["OUTPUT"], _x(5))
    assert _counts(c) == (rows0 + 2, sink0 + 3, es0 + 3)  # the held request and the probe: no step ran
    assert wait_until(lambda: c.status()["models"]["fan"]["ready_workers"] == 1, 60)
    np.testing.assert_array_equal(c.infer("fan", {"INPUT": np.zeros((1, WIDTH), np.float32)})["OUTPUT"], 0)


@pytest.mark.timeout(180)
def test_the_ensemble_runs_of_a_batch_that_finished_without_them_stop(pool, gates):
    """fan fires three calls at es (its step held) and returns without waiting: once its batch is over, the
    three steps leave sink's queue unrun."""
    c = pool.client(timeout=120)
    gate = gates["sink"]
    rows0, sink0, es0 = _counts(c)
    _gate(gate)
    try:
        held = c.infer_async("sink", {"INPUT": -np.ones((1, WIDTH), np.float32)})
        assert wait_until(lambda: c.stats()["sink"]["rows"] == rows0 + 1)
        np.testing.assert_array_equal(c.infer("fan", {"INPUT": _x(1)})["OUTPUT"], _x(1))
        assert wait_until(lambda: _counts(c)[1:] == (sink0 + 3, es0 + 3)), _counts(c)
        assert c.status()["models"]["sink"]["queued"] == 0
    finally:
        _ungate(gate)
    assert (held.result(timeout=60)["OUTPUT"] == -1).all()
    np.testing.assert_array_equal(c.infer("es", {"INPUT": _x(5)})["OUTPUT"], _x(5))
    assert _counts(c) == (rows0 + 2, sink0 + 3, es0 + 3)


@pytest.mark.timeout(180)
def test_an_inner_pipeline_stops_with_its_failed_outer_its_queued_step_never_run(pool, gates):
    """sink (a recording model) is held by a request of its own, so par's branch inn queues its step behind it;
    par's branch boom fails: par fails at once, naming boom's step, and inn stops with it (CANCELED in inn's
    statistics) at once: its step leaves sink's queue unrun (CANCELED in sink's), and sink runs only the held
    request and the probe after it."""
    c = pool.client(timeout=120)
    gate = gates["sink"]
    rows0, sink0, _ = _counts(c)
    before = c.stats()["inn"]
    _gate(gate)
    try:
        held = c.infer_async("sink", {"INPUT": -np.ones((1, WIDTH), np.float32)})
        assert wait_until(lambda: c.stats()["sink"]["rows"] == rows0 + 1)
        fut = c.infer_async("par", {"INPUT": _x(-3)})
        with pytest.raises(errors.GepoolError, match=r"ensemble 'par' step 2 \('boom'\)"):
            fut.result(timeout=60)
        after = c.stats()["inn"]
        assert after["failures"] == before["failures"] + 1, after
        assert after["failure_reasons"]["CANCELED"] == before["failure_reasons"]["CANCELED"] + 1
        assert c.status()["models"]["sink"]["queued"] == 0
        assert _counts(c)[:2] == (rows0 + 1, sink0 + 1)
    finally:
        _ungate(gate)
    assert (held.result(timeout=60)["OUTPUT"] == -1).all()
    np.testing.assert_array_equal(c.infer("sink", {"INPUT": _x(5)})["OUTPUT"], _x(5))  # behind anything queued
    assert _counts(c)[:2] == (rows0 + 2, sink0 + 1)  # the held request and the probe: inn's step never ran
    assert c.stats()["inn"]["requests"] == before["requests"]  # not counted a success either
    np.testing.assert_array_equal(c.infer("par", {"INPUT": _x(2)})["Y2"], _x(2))
