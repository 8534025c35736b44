"""BLS: python models calling other models of their pool (gepool's pool handle and Triton's pb_utils), with
real workers, a real front and onnxruntime; call chains refused where they would wait on themselves."""

import contextlib
import json
import os
import signal
import struct

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from tests import repo as test_repo
from tests.conftest import free_port, wait_until
from tests.test_triton_python import ADD_SUB_CONFIG, ADD_SUB_PY

WIDTH = 16  # the test mlp maps FP32[16] -> FP32[16], so its output can be fed back

# The client's loop, in a model: mlp three times, each output the next input. Zeros (the warmup's) call too.
LOOP_PY = '''
class Model:
    def initialize(self, config):
        self.pool = config["pool"]
        self.times = int(config["parameters"].get("times", "3"))
        self.callee = config["parameters"].get("callee", "mlp")

    def execute(self, inputs):
        x = inputs["INPUT"]
        for _ in range(self.times):
            x = self.pool.infer(self.callee, {"INPUT": x})[self.callee == "mlp" and "LOGITS" or "OUTPUT"]
        return {"OUTPUT": x}
'''

# Calls mlp only for rows whose sum is positive; ROUTE says which rows it sent.
COND_PY = '''
import numpy as np


class Model:
    def initialize(self, config):
        self.pool = config["pool"]

    def execute(self, inputs):
        x = inputs["INPUT"]
        route = (x.sum(axis=1) > 0)
        out = x.copy()
        if route.any():
            out[route] = self.pool.infer("mlp", {"INPUT": np.ascontiguousarray(x[route])})["LOGITS"]
        return {"OUTPUT": out, "ROUTE": route.astype(np.int32)[:, None]}
'''

# Calls the model named by its "callee" parameter with its own input (not on the warmup's zeros).
CALLER_PY = '''
class Model:
    def initialize(self, config):
        self.pool = config["pool"]
        self.callee = config["parameters"]["callee"]
        self.timeout = float(config["parameters"].get("timeout_s", "0")) or None

    def execute(self, inputs):
        x = inputs["INPUT"]
        if not x.any():
            return {"OUTPUT": x.copy()}
        return {"OUTPUT": self.pool.infer(self.callee, {"INPUT": x}, ["OUTPUT"], timeout=self.timeout)["OUTPUT"]}
'''

# A request of ones: writes the caller its calls carry, less the key ([worker, slot, seq]), to the "seen" file,
# waits for the "gate" file to go, then calls mlp. Else it echoes.
WITNESS_PY = '''
import json
import os
import time


class Model:
    def initialize(self, config):
        self.pool, p = config["pool"], config["parameters"]
        self.seen, self.gate = p["seen"], p["gate"]

    def execute(self, inputs):
        x = inputs["INPUT"]
        if not (x == 1).all():
            return {"OUTPUT": x.copy()}
        with open(self.seen + ".tmp", "w") as f:
            json.dump(self.pool._caller()[:3], f)
        os.rename(self.seen + ".tmp", self.seen)
        deadline = time.monotonic() + 120
        while os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        return {"OUTPUT": self.pool.infer("mlp", {"INPUT": x})["LOGITS"]}
'''

# One call per row, from four threads at once: the handle is shared by the worker's threads.
THREADS_PY = '''
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class Model:
    def initialize(self, config):
        self.pool = config["pool"]
        self.threads = ThreadPoolExecutor(4)

    def execute(self, inputs):
        x = inputs["INPUT"]
        rows = self.threads.map(lambda r: self.pool.infer("mlp", {"INPUT": x[r:r + 1]})["LOGITS"], range(len(x)))
        return {"OUTPUT": np.concatenate(list(rows))}

    def finalize(self):
        self.threads.shutdown()
'''

# gepool's handle from an async def execute: two calls in flight at once.
ASYNC_PY = '''
import asyncio


class Model:
    def initialize(self, config):
        self.pool = config["pool"]

    async def execute(self, inputs):
        x = inputs["INPUT"]
        if not x.any():
            return {"OUTPUT": x.copy(), "BATCH": x[:, :1].astype("int32")}
        a, b = await asyncio.gather(self.pool.infer_async("duo", {"INPUT": x}),
                                    self.pool.infer_async("duo", {"INPUT": -x}))
        return {"OUTPUT": a["OUTPUT"] - b["OUTPUT"], "BATCH": a["BATCH"] + b["BATCH"]}
'''

# Triton's python_backend examples/bls/sync_model.py, statement for statement (comments left out): the
# callee's name comes in the MODEL_NAME input; here it calls the add_sub model of test_triton_python.
TRITON_SYNC_BLS_PY = '''
import triton_python_backend_utils as pb_utils
import json


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")

            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")

            model_name = pb_utils.get_input_tensor_by_name(
                request, "MODEL_NAME"
            )

            model_name_string = model_name.as_numpy()[0]

            infer_request = pb_utils.InferenceRequest(
                model_name=model_name_string,
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[in_0, in_1],
            )

            infer_response = infer_request.exec()

            if infer_response.has_error():
                raise pb_utils.TritonModelException(
                    infer_response.error().message()
                )

            inference_response = pb_utils.InferenceResponse(
                output_tensors=infer_response.output_tensors()
            )
            responses.append(inference_response)

        return responses

    def finalize(self):
        print("Cleaning up...")
'''

# Triton's examples/bls/config.pbtxt (TYPE_STRING for its TYPE_BYTES, which Triton reads as the same), and a
# model_warmup that names the callee: gepool warms a model up before READY, and an empty name finds no model.
TRITON_BLS_CONFIG = '''
name: "triton_bls"
backend: "python"
input [ { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [{ kind: KIND_CPU }]
model_warmup [ {
  name: "callee" batch_size: 1
  inputs { key: "MODEL_NAME" value: { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "model_name" } }
  inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
  inputs { key: "INPUT1" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
} ]
'''

# async_exec as Triton's examples/bls/async_model.py uses it: two calls gathered, here to two models, and
# an error response (a model that does not exist) reported, not raised.
TRITON_ASYNC_BLS_PY = '''
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT")
            if not x.as_numpy().any():
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", x.as_numpy()),
                                                             pb_utils.Tensor("BATCH", np.zeros((len(x.as_numpy()), 1),
                                                                                      np.int32))]))
                continue
            calls = [pb_utils.InferenceRequest(model_name="duo", requested_output_names=["OUTPUT", "BATCH"],
                                               inputs=[x]).async_exec() for _ in range(2)]
            missing = pb_utils.InferenceRequest(model_name="nowhere", requested_output_names=["OUTPUT"],
                                                inputs=[x]).exec()
            first, second = await asyncio.gather(*calls)
            if first.has_error() or second.has_error() or not missing.has_error():
                raise pb_utils.TritonModelException("unexpected answers")
            batch = pb_utils.get_output_tensor_by_name(first, "BATCH").as_numpy()
            out = pb_utils.get_output_tensor_by_name(second, "OUTPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out),
                                                         pb_utils.Tensor("BATCH", batch)]))
        return responses
'''


def _python_model(repo: str, name: str, py: str, *, outputs: str = "", params: dict | None = None,
                  count: int = 1) -> None:
    test_repo.write(f"{repo}/{name}/1/model.py", py)
    extra = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in
                    (params or {}).items())
    outputs = outputs or f'{{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }}'
    test_repo.write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
        output [ {outputs} ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
        dynamic_batching {{ }}
        {extra}
    """)


@pytest.fixture(scope="module")
def bls_repo(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("bls"))
    gate = os.path.join(repo, "gate")
    test_repo.make_models.make_mlp(repo, sizes=(WIDTH, 32, WIDTH))
    _python_model(repo, "loop", LOOP_PY)
    _python_model(repo, "outer", LOOP_PY, params={"times": "2", "callee": "loop"})  # outer -> loop -> mlp
    _python_model(repo, "threads", THREADS_PY)
    _python_model(repo, "cond", COND_PY, outputs=f'{{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }}, '
                  '{ name: "ROUTE" data_type: TYPE_INT32 dims: [ 1 ] }')
    _python_model(repo, "self_call", CALLER_PY, params={"callee": "self_call"})
    _python_model(repo, "ping", CALLER_PY, params={"callee": "pong"})
    _python_model(repo, "pong", CALLER_PY, params={"callee": "ping"})
    _python_model(repo, "impatient", CALLER_PY, params={"callee": "held", "timeout_s": "1.5"})
    _python_model(repo, "via_held", CALLER_PY, params={"callee": "held"})
    _python_model(repo, "witness", WITNESS_PY, params={"seen": f"{repo}/witness_seen", "gate": f"{repo}/witness_gate"})
    test_repo.recorder(repo, "held", gate=gate, max_batch=8, preferred="8", delay_us=0, dims=str(WIDTH))
    # two calls reach it as one batch of two (BATCH 2) only if they are in flight at once
    test_repo.recorder(repo, "duo", max_batch=2, preferred="2", delay_us=60_000_000, dims=str(WIDTH))
    batch_out = (f'{{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }}, '
                 '{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }')
    _python_model(repo, "gather", ASYNC_PY, outputs=batch_out)
    _python_model(repo, "triton_async", TRITON_ASYNC_BLS_PY, outputs=batch_out)
    test_repo.write(f"{repo}/add_sub/1/model.py", ADD_SUB_PY)
    test_repo.write(f"{repo}/add_sub/config.pbtxt", ADD_SUB_CONFIG)
    test_repo.write(f"{repo}/triton_bls/1/model.py", TRITON_SYNC_BLS_PY)
    test_repo.write(f"{repo}/triton_bls/config.pbtxt", TRITON_BLS_CONFIG)
    os.makedirs(f"{repo}/triton_bls/warmup")
    with open(f"{repo}/triton_bls/warmup/model_name", "wb") as f:
        f.write(struct.pack("<I", 7) + b"add_sub")  # Triton's BYTES form: a length, then the bytes
    return repo, gate


@pytest.fixture(scope="module")
def bls_pool(bls_repo):
    with Pool(bls_repo[0], http_port=free_port()) as pool:
        yield pool


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)


def test_a_model_calling_mlp_in_a_loop_equals_the_client_doing_it(bls_pool):
    c = bls_pool.client()
    for rows in (1, 3, 8):
        x = _x(rows, rows)
        want = x
        for _ in range(3):
            want = c.infer("mlp", {"INPUT": want})["LOGITS"]
        np.testing.assert_array_equal(c.infer("loop", {"INPUT": x})["OUTPUT"], want)


def test_threads_of_one_model_share_its_handle(bls_pool):
    c = bls_pool.client()
    x = _x(8, 11)
    out = c.infer("threads", {"INPUT": x}, timeout=60)["OUTPUT"]
    for r in range(8):
        np.testing.assert_allclose(out[r:r + 1], c.infer("mlp", {"INPUT": x[r:r + 1]})["LOGITS"], rtol=1e-5, atol=1e-6)


def test_a_chain_of_calls_is_served_by_queueing_under_concurrency(bls_pool):
    """outer -> loop -> mlp, one instance each, 12 requests at once: every caller waits only on models
    further down its chain, so each request is answered (by queueing), and each with its own rows."""
    c = bls_pool.client()
    xs = [_x(1 + i % 3, 100 + i) for i in range(12)]
    futures = [c.infer_async("outer", {"INPUT": x}) for x in xs]
    for x, fut in zip(xs, futures, strict=True):
        want = x
        for _ in range(6):
            want = c.infer("mlp", {"INPUT": want})["LOGITS"]
        np.testing.assert_allclose(fut.result(timeout=120)["OUTPUT"], want, rtol=1e-5, atol=1e-6)


def test_a_conditional_call_runs_only_for_the_rows_that_ask_for_it(bls_pool):
    c = bls_pool.client()
    x = _x(4, 7)
    x[1] = -np.abs(x[1])
    x[3] = np.abs(x[3])
    x[0], x[2] = -np.abs(x[0]), np.abs(x[2])
    before = c.stats()["mlp"]["requests"]
    out = c.infer("cond", {"INPUT": x})
    assert out["ROUTE"][:, 0].tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(out["OUTPUT"][[0, 1]], x[[0, 1]])
    np.testing.assert_array_equal(out["OUTPUT"][[2, 3]], c.infer("mlp", {"INPUT": x[[2, 3]]})["LOGITS"])
    assert c.stats()["mlp"]["requests"] == before + 2  # one call from the model, one from this test
    c.infer("cond", {"INPUT": -np.abs(x)})
    assert c.stats()["mlp"]["requests"] == before + 2  # no row asked: no call


@pytest.mark.timeout(120)  # the guard: a hang fails here, not at the suite's limit
def test_a_model_calling_itself_gets_an_error_not_a_hang(bls_pool):
    c = bls_pool.client()
    with pytest.raises(errors.ModelError, match=r"model 'self_call' calls itself through BLS: "
                                                r"self_call -> self_call"):
        c.infer("self_call", {"INPUT": np.ones((1, WIDTH), np.float32)}, timeout=60)
    assert c.infer("self_call", {"INPUT": np.zeros((1, WIDTH), np.float32)})["OUTPUT"].shape == (1, WIDTH)


@pytest.mark.timeout(120)
def test_a_call_back_through_another_model_gets_an_error_naming_the_chain(bls_pool):
    c = bls_pool.client()
    with pytest.raises(errors.ModelError, match=r"model 'ping' calls itself through BLS: ping -> pong -> ping"):
        c.infer("ping", {"INPUT": np.ones((1, WIDTH), np.float32)}, timeout=60)
    with pytest.raises(errors.ModelError, match=r"model 'pong' calls itself through BLS: pong -> ping -> pong"):
        c.infer("pong", {"INPUT": np.ones((2, WIDTH), np.float32)}, timeout=60)


@contextlib.contextmanager
def holding_held(c, gate: str):
    """'held' blocked on the gate file for the block's length: yields the future of the request holding
    its one worker, and lets it go (the gate removed) however the block ends."""
    open(gate, "w").close()
    try:
        held = c.infer_async("held", {"INPUT": np.full((1, WIDTH), -1, np.float32)})
        assert wait_until(lambda: c.stats()["held"]["batches"] >= 1)
        yield held
    finally:
        os.unlink(gate)


def test_a_call_honours_its_timeout_when_the_callee_is_stuck(bls_pool, bls_repo):
    c = bls_pool.client()
    with holding_held(c, bls_repo[1]) as held:
        with pytest.raises(errors.ModelError, match="no answer"):
            c.infer("impatient", {"INPUT": np.ones((1, WIDTH), np.float32)}, timeout=60)
    assert (held.result(timeout=60)["OUTPUT"] == -1).all()


def test_a_call_without_a_timeout_gets_the_calling_requests_remaining_time(bls_pool, bls_repo):
    """via_held's call names no timeout; its client gives 3 s. The front expires the call in held's queue
    when those 3 s are up, so via_held's worker is free again long before the handle's own 60 s."""
    c = bls_pool.client()
    with holding_held(c, bls_repo[1]) as held:
        with pytest.raises(errors.GepoolError, match="no answer"):
            c.infer("via_held", {"INPUT": np.ones((1, WIDTH), np.float32)}, timeout=3)
        # held is still held: only a freed via_held worker answers this (zeros: no call) within 30 s
        out = c.infer("via_held", {"INPUT": np.zeros((1, WIDTH), np.float32)}, timeout=30)
        assert out["OUTPUT"].shape == (1, WIDTH)
    assert (held.result(timeout=60)["OUTPUT"] == -1).all()


def test_async_calls_from_an_async_execute_are_in_flight_together(bls_pool):
    """duo batches two requests only when both are queued at once (its max queue delay is a minute)."""
    c = bls_pool.client()
    x = _x(1, 3)
    out = c.infer("gather", {"INPUT": x}, timeout=60)
    np.testing.assert_array_equal(out["OUTPUT"], 2 * x)
    assert out["BATCH"][0, 0] == 4  # each call ran in a batch of two


def test_triton_async_exec_runs_two_calls_at_once_and_reports_errors_as_responses(bls_pool):
    c = bls_pool.client()
    x = _x(1, 4)
    out = c.infer("triton_async", {"INPUT": x}, timeout=60)
    np.testing.assert_array_equal(out["OUTPUT"], x)
    assert out["BATCH"][0, 0] == 2


def test_triton_bls_example_runs_unchanged_through_tritonclient_http(bls_pool):
    import tritonclient.http as httpclient

    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 0.5, np.float32)
    with httpclient.InferenceServerClient(f"127.0.0.1:{bls_pool.http_port}") as triton:
        inputs = [httpclient.InferInput("MODEL_NAME", [1], "BYTES"), httpclient.InferInput("INPUT0", [4], "FP32"),
                  httpclient.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(np.array([b"add_sub"], dtype=object))
        inputs[1].set_data_from_numpy(a)
        inputs[2].set_data_from_numpy(b)
        result = triton.infer("triton_bls", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        inputs[0].set_data_from_numpy(np.array([b"no_such_model"], dtype=object))
        with pytest.raises(Exception, match="no_such_model"):  # the callee's error, raised by the model
            triton.infer("triton_bls", inputs)


def test_a_worker_killed_during_its_call_gets_its_request_retried_and_the_pool_keeps_serving(bls_pool, bls_repo):
    _, gate = bls_repo
    c = bls_pool.client()
    (pid,) = c.status()["models"]["via_held"]["worker_pids"]
    held_before = c.stats()["held"]["batches"]
    open(gate, "w").close()
    try:
        fut = c.infer_async("via_held", {"INPUT": np.full((1, WIDTH), -1, np.float32)})
        assert wait_until(lambda: c.stats()["held"]["batches"] > held_before)  # via_held waits in its call
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: c.status()["models"]["via_held"]["worker_pids"] not in ([], [pid]), 60)
    finally:
        os.unlink(gate)
    try:
        out = fut.result(timeout=90)  # retried on the restarted worker (or failed, clearly): never lost
        assert (out["OUTPUT"] == -1).all()
    except errors.GepoolError as exc:
        assert "died" in exc.message or "worker" in exc.message, exc
    assert c.infer("via_held", {"INPUT": np.ones((2, WIDTH), np.float32)}, timeout=60)["OUTPUT"].shape == (2, WIDTH)
    assert wait_until(lambda: not any(c.status()["models"][m].get("busy_worker_pids") for m in ("held", "via_held")))


@pytest.mark.timeout(120)
def test_a_client_naming_a_live_batch_of_a_python_worker_as_its_caller_is_refused(bls_pool, bls_repo):
    """witness's worker runs a batch held on a gate; an ordinary client of the pool sends BLS calls naming that
    batch as their caller (as a python worker's handle would, but without the key the front started the
    worker with, or with a made-up one). Each is refused naming the caller field, mlp runs none of them, and
    witness's own call, once its gate goes, is served."""
    from gepool import bls

    repo, _ = bls_repo
    seen, gate = f"{repo}/witness_seen", f"{repo}/witness_gate"
    c = bls_pool.client()
    x = np.ones((1, WIDTH), np.float32)
    open(gate, "w").close()
    try:
        fut = c.infer_async("witness", {"INPUT": x})
        assert wait_until(lambda: os.path.exists(seen))
        with open(seen) as f:
            caller = json.load(f)  # [worker, slot, seq] of the batch now running
        assert c.status()["models"]["witness"]["busy_worker_pids"]
        before = c.stats()["mlp"]
        for forged, error in ((caller, errors.InvalidArgument), ([*caller, bytes(16)], errors.PermissionDenied),
                              ([*caller, os.urandom(16)], errors.PermissionDenied)):
            forger = bls._caller_client(bls_pool.endpoint, lambda forged=forged: forged)
            try:
                with pytest.raises(error, match="caller"):
                    forger.infer("mlp", {"INPUT": x}, timeout=30)
            finally:
                forger.close()
        after = c.stats()["mlp"]
        assert (after["requests"], after["rows"]) == (before["requests"], before["rows"])
        assert not fut.done()
    finally:
        os.unlink(gate)
    np.testing.assert_array_equal(fut.result(timeout=60)["OUTPUT"], c.infer("mlp", {"INPUT": x})["LOGITS"])


class _Model:
    def __init__(self, name: str) -> None:
        self.name = name


def test_the_front_derives_the_chain_from_the_calling_batch_and_limits_its_depth():
    """The front's rule on its own: each BLS call names its caller's batch; the chain is that batch's
    requests' chains, then its model; a model already in it, or a chain past MAX_BLS_DEPTH, is refused."""
    from gepool.scheduler.books import Workers
    from gepool.scheduler.requests import MAX_BLS_DEPTH, Request, bls_chain

    workers = Workers()
    names = [f"m{i}" for i in range(MAX_BLS_DEPTH + 1)]
    ws = [_worker(workers, n) for n in names]
    chain: tuple[str, ...] = ()
    for i, w in enumerate(ws[:-1]):
        w.free = [0, 1]
        req = Request(b"c", i, w.model.name, [], [], 1, 0, None, -1, 0, 0, 0.0, chain=chain)
        w.take(7, [req], 1, False, 0.0)  # its batch in slot 1, seq 7, waits on the call below
        if i + 1 < MAX_BLS_DEPTH:
            chain = bls_chain(_call([w.id, 1, 7, w.key]), names[i + 1], workers, 0.0)
            assert chain == tuple(names[:i + 1])
        else:
            with pytest.raises(errors.InvalidArgument, match=f"past the limit of {MAX_BLS_DEPTH}"):
                bls_chain(_call([w.id, 1, 7, w.key]), names[i + 1], workers, 0.0)
    with pytest.raises(errors.InvalidArgument, match="model 'm1' calls itself through BLS: m1 -> m2 -> m3 -> m1"):
        bls_chain(_call([ws[3].id, 1, 7, ws[3].key]), "m1", workers, 0.0)
    warmup = _call([ws[3].id, -1, 0, ws[3].key])  # a warmup's call: its model only
    assert bls_chain(warmup, "m3x", workers, 0.0) == ("m3",)
    with pytest.raises(errors.Unavailable, match="no longer running"):
        bls_chain(_call([ws[3].id, 1, 8, ws[3].key]), "m9", workers, 0.0)  # a batch since answered (or its worker dead)
    for bad in ([ws[0].id, 1, 7], ["w", 1, 7, ws[0].key], None, [ws[0].id, 1, 7, "k"]):
        with pytest.raises(errors.InvalidArgument):
            bls_chain(_call(bad), "m1", workers, 0.0)


def test_a_call_gets_the_last_deadline_of_its_calling_batch_as_its_own_at_the_latest():
    """One execute may make one call for its whole batch: the call lives while any of the batch's requests
    does (the last deadline), and a request in it without a deadline leaves the call's own timeout alone."""
    from gepool.scheduler.books import Workers
    from gepool.scheduler.requests import Request, bls_chain

    workers = Workers()
    w = _worker(workers, "a")
    w.free = [0, 1]
    reqs = [Request(b"c", i, "a", [], [], 1, 0, None, -1, 0, 0, 0.0, deadline=d) for i, d in enumerate((12.0, 10.0))]
    w.take(3, reqs, 2, False, 0.0)
    for asked, want in ((0, 4_000_000), (5_000_000, 4_000_000), (1_000_000, 1_000_000)):
        msg = _call([w.id, 1, 3, w.key], asked)
        bls_chain(msg, "b", workers, 8.0)
        assert msg.deadline_us == want and msg.timeout_us == 0  # 4 s left of the last deadline (12.0 at 8.0)
    msg = _call([w.id, 1, 3, w.key])
    bls_chain(msg, "b", workers, 11.0)  # the request of deadline 10.0 is past it; the other still waits
    assert msg.deadline_us == 1_000_000
    with pytest.raises(errors.Timeout, match="every request of the batch .* is past its timeout"):
        bls_chain(_call([w.id, 1, 3, w.key]), "b", workers, 12.5)

    w.free = [0]
    open_ended = [Request(b"c", i, "a", [], [], 1, 0, None, -1, 0, 0, 0.0, deadline=d)
                  for i, d in enumerate((None, 10.0), start=2)]
    w.take(4, open_ended, 2, False, 0.0)
    for asked in (0, 5_000_000):
        msg = _call([w.id, 0, 4, w.key], asked)
        bls_chain(msg, "b", workers, 30.0)
        assert msg.deadline_us == asked


def test_a_caller_without_its_workers_key_is_refused_naming_the_field():
    """Only a worker's own process knows the key it was started with: a caller naming a live batch of that
    worker with no key, another worker's key, or none at all is refused as such, before anything else. A
    caller naming a worker the pool does not have gets the same refusal, word for word (and neither names the
    worker's model), so worker ids cannot be mapped to models by asking; the keys are in no repr."""
    from gepool.ipc import protocol
    from gepool.scheduler.books import Workers
    from gepool.scheduler.requests import Request, bls_chain

    workers = Workers()
    a, b = _worker(workers, "a"), _worker(workers, "b")
    a.free = [0, 1]
    a.take(7, [Request(b"c", 0, "a", [], [], 1, 0, None, -1, 0, 0, 0.0)], 1, False, 0.0)
    assert bls_chain(_call([a.id, 1, 7, a.key]), "x", workers, 0.0) == ("a",)
    messages = set()
    for caller in ([a.id, 1, 7, b.key], [a.id, 1, 7, bytes(len(a.key))], [a.id, 1, 7, a.key[:-1]], [a.id, 1, 7, b""],
                   [999, 1, 7, a.key], [999, 1, 7, bytes(protocol.CALLER_KEY_BYTES)], [-1, 1, 7, b""]):
        with pytest.raises(errors.PermissionDenied, match="caller names no worker of this pool, or not with that "
                                                          "worker's key") as exc:
            bls_chain(_call(caller), "x", workers, 0.0)
        assert a.key.hex() not in exc.value.message and "'a'" not in exc.value.message
        messages.add(exc.value.message)
    assert len(messages) == 1, messages
    assert a.key.hex() not in repr(a) and repr(a.key) not in repr(a)
    restarted = a.key
    a.started(1.0)  # a new process, a new key: the old one names nothing
    assert a.key != restarted and len(a.key) == protocol.CALLER_KEY_BYTES
    with pytest.raises(errors.PermissionDenied):
        bls_chain(_call([a.id, -1, 0, restarted]), "x", workers, 0.0)


def test_a_workers_spec_shows_no_key():
    from gepool.workers.main import WorkerSpec

    key = os.urandom(16)
    spec = WorkerSpec(1, None, "", "cpu", 1, None, "ipc://x", 1, bls_key=key)
    assert spec.bls_key == key and key.hex() not in repr(spec) and repr(key) not in repr(spec)


def _worker(workers, name: str):
    return workers.add(_Model(name), "cpu", 1, 2, 1 << 20)


def _call(caller, deadline_us: int = 0):
    from gepool.ipc import protocol

    return protocol.Infer(1, "x", -1, [], None, 0, 0, protocol.NO_ARENA, 0, 0, deadline_us, caller=caller)


def test_infer_carries_its_caller_and_a_message_without_one_still_decodes():
    import msgpack

    from gepool.ipc import protocol

    msg = _call([3, 1, 7], 5)
    back = protocol.decode(msg.encode())
    assert back == msg and back.caller == [3, 1, 7]
    fields = msgpack.unpackb(msg.encode())
    assert protocol.decode(msgpack.packb(fields[:-2])).caller is None  # a client that sends no caller
    with pytest.raises(protocol.ProtocolError, match="Infer needs 10 to 14 fields, got 15"):
        protocol.decode(msgpack.packb([*fields, 0]))
    with pytest.raises(protocol.ProtocolError, match="Infer needs 10 to 14 fields, got 9"):
        protocol.decode(msgpack.packb(fields[:-5]))
