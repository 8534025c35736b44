"""BLS calls that could never run are refused at once (the front's wait-for check), and the calls of a batch
that is gone are taken out of their queues unrun: real pools, real workers, python models held on gate files."""

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

WIDTH = 4
CALL_TIMEOUT_S = 600  # each model's own BLS timeout: a call that waited it out would fail these tests' deadlines
REFUSED_WITHIN_S = 30  # a refusal comes this soon after the calls are made, far inside CALL_TIMEOUT_S

# 1 in the first element: a client's request; it waits for its go gate to go, then calls its callee with -x
# (the callee echoes that). 2: holds its worker until the hold gate goes, then echoes. Else (the warmup's
# zeros, a call's -x) it echoes.
MUTUAL_PY = '''
import os
import time


def _wait_gone(path):
    deadline = time.monotonic() + 120
    while path and os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


class Model:
    def initialize(self, config):
        p = config["parameters"]
        self.pool, self.callee, self.go, self.hold = config["pool"], p["callee"], p["go"], p.get("hold", "")
        self.timeout = float(p["timeout_s"])

    def execute(self, inputs):
        x = inputs["INPUT"]
        if x[0, 0] == 1:
            _wait_gone(self.go)
            return {"OUTPUT": self.pool.infer(self.callee, {"INPUT": -x}, ["OUTPUT"], timeout=self.timeout)["OUTPUT"]}
        if x[0, 0] == 2:
            _wait_gone(self.hold)
        return {"OUTPUT": x.copy()}
'''

# MUTUAL_PY's client request as Triton writes BLS (pb_utils.InferenceRequest(...).exec()): a failed call comes
# back as an error response, passed on as this request's own, its Triton code named.
TRITON_MUTUAL_PY = '''
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        p = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.callee, self.go, self.timeout_us = p["callee"], p["go"], int(float(p["timeout_s"]) * 1e6)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if x[0, 0] != 1:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", x.copy())]))
                continue
            deadline = time.monotonic() + 120
            while os.path.exists(self.go) and time.monotonic() < deadline:
                time.sleep(0.005)
            call = pb_utils.InferenceRequest(model_name=self.callee, requested_output_names=["OUTPUT"],
                                             inputs=[pb_utils.Tensor("INPUT", -x)], timeout=self.timeout_us)
            response = call.exec()
            if response.has_error():
                err = response.error()
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"Triton code {err.code()}: {err.message()}")))
                continue
            out = pb_utils.get_output_tensor_by_name(response, "OUTPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''

# Three calls to CALLEE at once. A positive first element: fire and forget (its batch ends with them queued,
# once a last call on the same socket, so after them, is answered); negative: it waits for all three.
SPRAY_PY = '''
import numpy as np


class Model:
    def initialize(self, config):
        self.pool = config["pool"]

    def execute(self, inputs):
        x = inputs["INPUT"]
        if not x.any():
            return {"OUTPUT": x.copy()}
        calls = [self.pool.infer_async("CALLEE", {"INPUT": np.abs(x)}) for _ in range(3)]
        if x[0, 0] > 0:
            self.pool.infer_async("echo", {"INPUT": x}).result(timeout=60)
            return {"OUTPUT": x.copy()}
        return {"OUTPUT": sum(c.result(timeout=600)["OUTPUT"] for c in calls)}
'''


def spray_py(callee: str) -> str:
    return SPRAY_PY.replace("CALLEE", callee)


def _model(repo: str, name: str, py: str, params: dict, count: int = 1) -> None:
    """No dynamic_batching (Triton's default scheduler): the front hands a busy worker its next request at
    once, into its ring's second slot, so only the front's rule keeps a BLS call out of a busy worker."""
    test_repo.write(f"{repo}/{name}/1/model.py", py)
    extra = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())
    test_repo.write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
        output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
        {extra}
    """)


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    d = tmp_path_factory.mktemp("gates")
    return {k: str(d / k) for k in ("go1", "go2", "go3", "hold", "sink")}


@pytest.fixture(scope="module")
def deadlock_pool(tmp_path_factory, gates):
    repo = str(tmp_path_factory.mktemp("bls_deadlock"))
    t = str(CALL_TIMEOUT_S)
    _model(repo, "ma", MUTUAL_PY, {"callee": "mb", "go": gates["go1"], "timeout_s": t})
    _model(repo, "mb", MUTUAL_PY, {"callee": "ma", "go": gates["go1"], "timeout_s": t})
    _model(repo, "ta", TRITON_MUTUAL_PY, {"callee": "tb", "go": gates["go3"], "timeout_s": t})
    _model(repo, "tb", TRITON_MUTUAL_PY, {"callee": "ta", "go": gates["go3"], "timeout_s": t})
    _model(repo, "pa", MUTUAL_PY, {"callee": "pb", "go": gates["go2"], "timeout_s": t})
    _model(repo, "pb", MUTUAL_PY, {"callee": "pa", "go": gates["go2"], "hold": gates["hold"], "timeout_s": t}, count=2)
    _model(repo, "spray", spray_py("sink"), {})
    test_repo.recorder(repo, "sink", gate=gates["sink"], max_batch=8, preferred="8", delay_us=0, dims=str(WIDTH))
    test_repo.recorder(repo, "echo", max_batch=8, preferred="8", delay_us=0, dims=str(WIDTH))
    with Pool(repo) as pool:
        yield pool


def _x(first: float) -> np.ndarray:
    x = np.arange(1, WIDTH + 1, dtype=np.float32)[None, :] / 10
    x[0, 0] = first
    return x


def _busy(c, model: str, batches: int) -> bool:
    return c.stats()[model]["batches"] >= batches


def _gate(path: str) -> None:
    open(path, "w").close()


def _ungate(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("a, b, gate, code", [("ma", "mb", "go1", "[UNAVAILABLE]"),
                                              ("ta", "tb", "go3", "Triton code 4:")])  # TritonError.UNAVAILABLE
def test_two_models_calling_each_other_from_two_requests_are_refused_at_once_not_left_to_time_out(
        deadlock_pool, gates, a, b, gate, code):
    """a's only worker runs request 1, b's only worker request 2; then each calls the other. Whichever call
    comes second would wait forever (each worker waits on the other's call): it is refused at once, naming the
    cycle, and the other request is served once the refused one's batch is over. The same for Triton's
    python models (their error response carries the refusal)."""
    c = deadlock_pool.client(timeout=CALL_TIMEOUT_S)
    go = gates[gate]
    _gate(go)
    try:
        fa = c.infer_async(a, {"INPUT": _x(1)})
        fb = c.infer_async(b, {"INPUT": _x(1)})
        assert wait_until(lambda: _busy(c, a, 1) and _busy(c, b, 1))
    finally:
        _ungate(go)
    released = time.monotonic()
    results = {}
    for name, fut in ((a, fa), (b, fb)):
        try:
            results[name] = fut.result(timeout=REFUSED_WITHIN_S + 30)
        except errors.GepoolError as exc:
            results[name] = exc
    assert time.monotonic() - released < REFUSED_WITHIN_S
    refused = [n for n, r in results.items() if isinstance(r, errors.GepoolError)]
    assert len(refused) == 1, results
    (loser,) = refused
    winner = b if loser == a else a
    err = results[loser]
    assert isinstance(err, errors.ModelError), err
    callee = winner
    # refused by the wait-for check (UNAVAILABLE), not timed out ("no answer"): the cycle, models and workers
    assert code in err.message and "no answer" not in err.message, err.message
    assert f"model '{callee}' cannot take this BLS call" in err.message, err.message
    w = r"\(worker \d+\)"
    assert re.search(rf"{loser} {w} -> {callee} {w} -> {loser} {w}", err.message), err.message
    np.testing.assert_array_equal(results[winner]["OUTPUT"], -_x(1))
    assert c.stats()[callee]["failure_reasons"]["REJECTED"] >= 1
    # both serve again
    for name in (a, b):
        np.testing.assert_array_equal(c.infer(name, {"INPUT": _x(3)})["OUTPUT"], _x(3))


@pytest.mark.timeout(180)
def test_the_same_pair_with_two_instances_of_one_is_served_by_queueing(deadlock_pool, gates):
    """pb has two workers: one runs request 2 (it will call pa), the other a request held on the hold gate;
    pa's one worker runs request 1 (it will call pb). Neither call is refused: pb's second worker will be
    free, so pa's call waits in pb's queue for it (never in the ring of pb's first worker, behind a batch
    that waits on pa), and both requests are served."""
    c = deadlock_pool.client(timeout=CALL_TIMEOUT_S)
    go, hold = gates["go2"], gates["hold"]
    _gate(go)
    _gate(hold)
    try:
        before = c.stats()["pb"]["batches"]
        fb = c.infer_async("pb", {"INPUT": _x(1)})
        assert wait_until(lambda: _busy(c, "pb", before + 1))
        held = c.infer_async("pb", {"INPUT": _x(2)})
        assert wait_until(lambda: _busy(c, "pb", before + 2))
        fa = c.infer_async("pa", {"INPUT": _x(1)})
        assert wait_until(lambda: _busy(c, "pa", 1))
        _ungate(go)
        # each call is admitted and waits in its callee's queue: pa's for pb's held worker, pb's for pa's
        status = lambda: c.status()["models"]  # noqa: E731
        assert wait_until(lambda: status()["pa"]["queued"] == 1 and status()["pb"]["queued"] == 1), status()
    finally:
        _ungate(go)
        _ungate(hold)
    np.testing.assert_array_equal(held.result(timeout=60)["OUTPUT"], _x(2))
    np.testing.assert_array_equal(fa.result(timeout=60)["OUTPUT"], -_x(1))
    np.testing.assert_array_equal(fb.result(timeout=60)["OUTPUT"], -_x(1))
    assert c.stats()["pa"]["failures"] == 0 and c.stats()["pb"]["failures"] == 0


def _sink_counts(c) -> tuple[int, int]:
    s = c.stats()["sink"]
    return s["rows"], s["failure_reasons"]["CANCELED"]


@pytest.mark.timeout(180)
def test_the_queued_calls_of_a_killed_caller_never_reach_their_callee(deadlock_pool, gates):
    """spray's batch makes three calls to sink, whose worker is held: the calls queue. SIGKILL spray's worker:
    its calls leave sink's queue unrun (CANCELED in sink's statistics), sink runs only what the test sent it,
    and both models keep serving."""
    c = deadlock_pool.client(timeout=120)
    gate = gates["sink"]
    rows0, canceled0 = _sink_counts(c)
    _gate(gate)
    try:
        held = c.infer_async("sink", {"INPUT": -np.ones((1, WIDTH), np.float32)})
        assert wait_until(lambda: c.stats()["sink"]["rows"] == rows0 + 1)
        (pid,) = c.status()["models"]["spray"]["worker_pids"]
        fut = c.infer_async("spray", {"INPUT": _x(-1)})
        assert wait_until(lambda: c.status()["models"]["sink"]["queued"] == 3)
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: c.status()["models"]["sink"]["queued"] == 0)
        assert _sink_counts(c) == (rows0 + 1, canceled0 + 3)
    finally:
        _ungate(gate)
    with pytest.raises(errors.GepoolError, match="died"):
        fut.result(timeout=60)  # its only worker died under it: nothing to retry it on
    assert (held.result(timeout=60)["OUTPUT"] == -1).all()
    probe = c.infer("sink", {"INPUT": _x(5)})  # behind anything still queued in sink
    np.testing.assert_array_equal(probe["OUTPUT"], _x(5))
    assert _sink_counts(c) == (rows0 + 2, canceled0 + 3)  # the held request and the probe: no call ran
    assert wait_until(lambda: c.status()["models"]["spray"]["ready_workers"] == 1, 60)
    np.testing.assert_array_equal(c.infer("spray", {"INPUT": np.zeros((1, WIDTH), np.float32)})["OUTPUT"], 0)


@pytest.mark.timeout(180)
def test_the_queued_calls_of_a_batch_that_finished_without_them_never_run(deadlock_pool, gates):
    """spray fires three calls at a held sink and returns without waiting for them: once its batch is over,
    its calls leave sink's queue unrun."""
    c = deadlock_pool.client(timeout=120)
    gate = gates["sink"]
    rows0, canceled0 = _sink_counts(c)
    _gate(gate)
    try:
        held = c.infer_async("sink", {"INPUT": -np.ones((1, WIDTH), np.float32)})
        assert wait_until(lambda: c.stats()["sink"]["rows"] == rows0 + 1)
        np.testing.assert_array_equal(c.infer("spray", {"INPUT": _x(1)})["OUTPUT"], _x(1))
        assert wait_until(lambda: _sink_counts(c)[1] == canceled0 + 3)
        assert c.status()["models"]["sink"]["queued"] == 0
    finally:
        _ungate(gate)
    assert (held.result(timeout=60)["OUTPUT"] == -1).all()
    np.testing.assert_array_equal(c.infer("sink", {"INPUT": _x(5)})["OUTPUT"], _x(5))
    assert _sink_counts(c) == (rows0 + 2, canceled0 + 3)


# Its warmup's zeros call CALLEE (none: echo) with a timeout, after an initialize that takes load_s.
WARM_CALL_PY = '''
import time


class Model:
    def initialize(self, config):
        p = config["parameters"]
        self.pool, self.callee, self.timeout = config["pool"], p.get("callee", ""), float(p["timeout_s"])
        time.sleep(float(p.get("load_s", "0")))

    def execute(self, inputs):
        x = inputs["INPUT"]
        if self.callee and not x.any():
            return {"OUTPUT": self.pool.infer(self.callee, {"INPUT": x}, ["OUTPUT"], timeout=self.timeout)["OUTPUT"]}
        return {"OUTPUT": x.copy()}
'''
WARM_TIMEOUT_S = 20  # the warmups' calls: before the books saw them, the cycle ended only when this ran out

# WARM_CALL_PY as Triton writes BLS (pb_utils.InferenceRequest(...).exec()): a failed call's error response is
# passed on as the request's own, as Triton's BLS examples do.
TRITON_WARM_CALL_PY = '''
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        p = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.callee, self.timeout_us = p.get("callee", ""), int(float(p["timeout_s"]) * 1e6)
        time.sleep(float(p.get("load_s", "0")))

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if not self.callee or x.any():
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", x.copy())]))
                continue
            call = pb_utils.InferenceRequest(model_name=self.callee, requested_output_names=["OUTPUT"],
                                             inputs=[pb_utils.Tensor("INPUT", x)], timeout=self.timeout_us)
            response = call.exec()
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            out = pb_utils.get_output_tensor_by_name(response, "OUTPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''


@pytest.mark.parametrize("py", [WARM_CALL_PY, TRITON_WARM_CALL_PY], ids=["pool-handle", "pb_utils"])
def test_warmups_calling_each_other_are_refused_at_once_and_a_warmup_waits_for_a_merely_loading_callee(tmp_path, py):
    """ring_a's and ring_b's warmups call each other while both load: the call that closes the cycle is refused
    at once with UNAVAILABLE naming it, the warmup that made it fails, and so does the other's (its callee
    failed to load): both models are UNAVAILABLE in the status and the index, the cycle in their reasons.
    waiter's warmup calls slow, still in its initialize: it waits, and both come up READY. The same through the
    pool handle and through Triton's pb_utils."""
    repo = str(tmp_path)
    t = str(WARM_TIMEOUT_S)
    _model(repo, "ring_a", py, {"callee": "ring_b", "timeout_s": t})
    _model(repo, "ring_b", py, {"callee": "ring_a", "timeout_s": t})
    _model(repo, "waiter", py, {"callee": "slow", "timeout_s": t})
    _model(repo, "slow", py, {"timeout_s": t, "load_s": "1"})
    with Pool(repo) as pool:
        models = pool.status["models"]
        assert models["waiter"]["state"] == "READY" and models["slow"]["state"] == "READY"
        reasons = [models[m]["reason"] for m in ("ring_a", "ring_b")]
        assert [models[m]["state"] for m in ("ring_a", "ring_b")] == ["UNAVAILABLE"] * 2, models
        cycle = re.compile(r"\((ring_\w) \(worker \d+, warming up\) -> (ring_\w) \(worker \d+, warming up\) -> \1 ")
        assert all("warmup 'default1' failed" in r and cycle.search(r) for r in reasons), reasons
        # one warmup's call was refused; the other's failed with its callee's load, which names that refusal
        assert sorted("can no longer run this BLS call" in r for r in reasons) == [False, True], reasons
        assert all("cannot take this BLS call" in r for r in reasons), reasons
        assert "is LOADING" not in " ".join(reasons), reasons  # what the handle raised once its retries ran out
        c = pool.client()
        index = {m["name"]: m for m in c.query("index", {"ready": False})["models"]}
        assert index["ring_a"]["state"] == index["ring_b"]["state"] == "UNAVAILABLE"
        assert cycle.search(index["ring_a"].get("reason", "")), index["ring_a"]
        x = np.ones((1, WIDTH), np.float32)
        np.testing.assert_array_equal(c.infer("waiter", {"INPUT": x})["OUTPUT"], x)
        zeros = np.zeros((2, WIDTH), np.float32)  # waiter's BLS path, now to a READY slow
        np.testing.assert_array_equal(c.infer("waiter", {"INPUT": zeros})["OUTPUT"], zeros)
        with pytest.raises(errors.ModelNotReady, match="ring_a"):
            c.infer("ring_a", {"INPUT": x})
