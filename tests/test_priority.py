"""Request priority end to end: the library client, HTTP's parameters.priority and gRPC's priority parameter
reach the model's priority levels (Triton's: 1 is the highest, 0 and levels past priority_levels run at
default_priority_level)."""

import concurrent.futures
import json
import os
import urllib.error
import urllib.request

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from tests.conftest import free_port, wait_until
from tests.repo import write

grpcclient = pytest.importorskip("tritonclient.grpc")

# SEQ: the order in which the model ran each batch. A negative X holds its batch while the gate file exists.
ORDERED_PY = '''
import itertools
import os
import time

import numpy as np


class Model:
    def initialize(self, config):
        self.gate = config["parameters"]["gate_file"]
        self.seq = itertools.count(1)

    def execute(self, inputs):
        x = inputs["X"]
        if (x < 0).any():
            deadline = time.monotonic() + 120
            while os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        n = x.shape[0]
        return {"Y": x.copy(), "SEQ": np.full((n, 1), next(self.seq), np.int64)}
'''


@pytest.fixture(scope="module")
def ppool(tmp_path_factory):
    root = tmp_path_factory.mktemp("prio")
    repo, gate = str(root / "models"), str(root / "gate")
    write(f"{repo}/ordered/1/model.py", ORDERED_PY)
    write(f"{repo}/ordered/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 1
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }}, {{ name: "SEQ" data_type: TYPE_INT64 dims: [ 1 ] }} ]
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        dynamic_batching {{ priority_levels: 2 default_priority_level: 2 }}
        parameters {{ key: "gate_file" value: {{ string_value: "{gate}" }} }}
    """)
    with Pool(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=0) as pool:
        pool.gate = gate
        yield pool


def _x(value: float) -> np.ndarray:
    return np.full((1, 1), value, np.float32)


class Library:
    def __init__(self, pool) -> None:
        self.client = pool.client()

    def send(self, value: float, priority: int):
        fut = self.client.infer_async("ordered", {"X": _x(value)}, priority=priority)
        return lambda: int(fut.result(timeout=120)["SEQ"][0, 0])


class Http:
    """KServe v2 JSON with ``parameters.priority``, as tritonclient.http sends it (a thread per request:
    tritonclient.http's async_infer runs on gevent, which a plain sleep never yields to)."""

    def __init__(self, pool) -> None:
        self.url = f"http://127.0.0.1:{pool.http_port}/v2/models/ordered/infer"
        self.threads = concurrent.futures.ThreadPoolExecutor(8)

    def send(self, value: float, priority: int):
        body = json.dumps({"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32", "data": [value]}],
                           "parameters": {"priority": priority}}).encode()

        def call() -> int:
            with urllib.request.urlopen(urllib.request.Request(self.url, body), timeout=120) as r:
                out = {o["name"]: o for o in json.loads(r.read())["outputs"]}
            return int(out["SEQ"]["data"][0])
        fut = self.threads.submit(call)
        return lambda: fut.result(timeout=120)


class Grpc:
    def __init__(self, pool) -> None:
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{pool.grpc_port}")

    def send(self, value: float, priority: int):
        inp = grpcclient.InferInput("X", [1, 1], "FP32")
        inp.set_data_from_numpy(_x(value))
        done = []
        self.client.async_infer("ordered", [inp], lambda result, error: done.append((result, error)),
                                priority=priority)

        def seq() -> int:
            assert wait_until(lambda: done, 120), "no answer"
            result, error = done[0]
            assert error is None, error
            return int(result.as_numpy("SEQ")[0, 0])
        return seq


@pytest.mark.parametrize("surface", [Library, Http, Grpc], ids=lambda s: s.__name__.lower())
def test_queued_high_priority_requests_run_before_low_ones(ppool, surface):
    """Every slot of the one worker holds a batch that waits on the gate; low-priority requests queue,
    then high-priority ones; once the gate opens the model runs the high ones first (SEQ is the order
    the model ran them in, not a time)."""
    c, via = ppool.client(), surface(ppool)

    def load():
        m = c.status()["models"]["ordered"]
        return m["queued"], m["slots_busy"], m["slots"]

    def queue(value: float, priority: int):
        # one at a time, each seen queued: a gateway may pass on requests sent together in any order
        queued = load()[0]
        answer = via.send(value, priority)
        assert wait_until(lambda: load()[0] == queued + 1), load()
        return answer

    open(ppool.gate, "w").close()
    try:
        slots = load()[2]
        blockers = [Library(ppool).send(-1.0, 0) for _ in range(slots)]
        assert wait_until(lambda: load()[:2] == (0, slots)), load()  # every slot holds a blocked batch
        # level 2 by name, by 0 (the default level) and by a level past priority_levels (Triton: the default)
        low = [queue(float(i), p) for i, p in enumerate((2, 0, 9))]
        high = [queue(10.0 + i, 1) for i in range(2)]
    finally:
        os.unlink(ppool.gate)
    ran = [b() for b in blockers]
    low_seq, high_seq = [f() for f in low], [f() for f in high]
    assert max(ran) < min(high_seq), (ran, high_seq)
    assert max(high_seq) < min(low_seq), (high_seq, low_seq)
    assert high_seq == sorted(high_seq) and low_seq == sorted(low_seq)  # FIFO within a level


def test_a_bad_priority_is_refused_naming_it(ppool):
    x = _x(1.0)
    with pytest.raises(errors.InvalidArgument, match="priority must be an integer"):
        ppool.client().infer("ordered", {"X": x}, priority=-1)
    with pytest.raises(errors.InvalidArgument, match="priority must be an integer"):
        ppool.client().infer("ordered", {"X": x}, priority=True)
    body = json.dumps({"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}],
                       "parameters": {"priority": -2}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{ppool.http_port}/v2/models/ordered/infer", body)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and "'priority' must be a non-negative integer, got -2" in err.value.read().decode()
    body = json.dumps({"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}],
                       "parameters": {"priority": 1 << 64}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{ppool.http_port}/v2/models/ordered/infer", body)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and "'priority' must be an integer in 0..18446744073709551615" in \
        err.value.read().decode()  # read where the parameters are, as over gRPC
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{ppool.grpc_port}")
    inp = grpcclient.InferInput("X", [1, 1], "FP32")
    inp.set_data_from_numpy(x)
    out = g.infer("ordered", [inp], priority=2)  # a valid one serves
    assert out.as_numpy("Y")[0, 0] == 1.0
