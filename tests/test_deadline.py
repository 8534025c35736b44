"""A client's deadline travels with its request (deadline_us): a request nobody waits for any more leaves
its queue unrun, and the deadline never stands in for the timeout that Triton's queue policy may let a
request override (timeout_us)."""

import os
import time

import numpy as np
import pytest
import zmq

from gepool import Client, Pool
from gepool.common import errors
from gepool.ipc import protocol
from tests import repo as test_repo
from tests.conftest import wait_until

COUNTING_PY = '''
import os
import time

import numpy as np


class Model:
    def initialize(self, config):
        self.gate = config["parameters"]["gate_file"]
        self.log = config["parameters"]["log_file"]

    def execute(self, inputs):
        x = inputs["X"]
        with open(self.log, "a") as f:  # one line per execution, before anything can block
            f.write(f"{float(x.flat[0])}\\n")
        if (x < 0).any():
            deadline = time.monotonic() + 120
            while os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        return {"Y": x.copy()}
'''


def _model(repo: str, name: str, gate: str, log: str, policy: str = "") -> None:
    test_repo.write(f"{repo}/{name}/1/model.py", COUNTING_PY)
    test_repo.write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 1
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        dynamic_batching {{ max_queue_delay_microseconds: 0 {policy} }}
        parameters {{ key: "gate_file" value: {{ string_value: "{gate}" }} }}
        parameters {{ key: "log_file" value: {{ string_value: "{log}" }} }}
    """)


POLICY_S = 1.5


@pytest.fixture(scope="module")
def dpool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deadline")
    repo, gate = str(tmp / "models"), str(tmp / "gate")
    _model(repo, "counted", gate, str(tmp / "counted.log"))
    _model(repo, "policed", gate, str(tmp / "policed.log"),
           f"default_queue_policy {{ default_timeout_microseconds: {int(POLICY_S * 1e6)} "
           "allow_timeout_override: false }")
    with Pool(repo) as pool:
        pool.gate, pool.logs = gate, {m: str(tmp / f"{m}.log") for m in ("counted", "policed")}
        yield pool


def _ran(pool, model: str) -> list[float]:
    """The values the model executed, but for the zeros the pool's own load-time runs use."""
    if not os.path.exists(pool.logs[model]):
        return []
    with open(pool.logs[model]) as f:
        return [v for v in map(float, f) if v != 0.0]


def _x(value: float) -> dict:
    return {"X": np.full((1, 1), value, np.float32)}


def _block(client: Client, pool, model: str) -> list:
    """Two requests that wait at the gate: one running, one in the worker's second slot. What comes
    after them waits in the front's queue."""
    blocked = [client.infer_async(model, _x(-1.0)), client.infer_async(model, _x(-2.0))]
    assert wait_until(lambda: _ran(pool, model) == [-1.0])  # the worker is inside execute
    assert wait_until(lambda: client.stats()[model]["batches"] == 2)  # and the second slot is taken
    return blocked


def test_a_request_whose_client_gave_up_never_runs(dpool):
    """The client waits its default timeout (no timeout= given): it gives up while the worker is blocked,
    and the front drops its request unrun, counted as a client timeout, not run once the worker frees."""
    open(dpool.gate, "w").close()
    with dpool.client() as patient, Client(dpool.endpoint, timeout=0.5) as hasty:
        blocked = _block(patient, dpool, "counted")
        with pytest.raises(errors.PoolUnavailable):
            hasty.infer("counted", _x(2.0))
        assert wait_until(lambda: patient.stats()["counted"].get("client_timeouts") == 1), patient.stats()["counted"]
        os.unlink(dpool.gate)
        assert [f.result(60)["Y"][0, 0] for f in blocked] == [-1.0, -2.0]
        np.testing.assert_array_equal(patient.infer("counted", _x(3.0))["Y"], [[3.0]])
        assert _ran(dpool, "counted") == [-1.0, -2.0, 3.0]  # 2.0 was dropped, never executed
        stats = patient.stats()["counted"]
        assert stats["failure_reasons"]["CANCELED"] == 1 and stats["requests"] == 3, stats


def _raw_infer(endpoint: str, req_id: int, timeout_us: int, deadline_us: int) -> tuple[object, float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(endpoint)
    try:
        msg = protocol.Infer(req_id, "policed", protocol.NO_VERSION, [["X", "FP32", [1, 1], 0]], None, timeout_us,
                             0, protocol.NO_ARENA, 0, 0, deadline_us)
        start = time.monotonic()
        sock.send_multipart([msg.encode(), np.full((1, 1), float(req_id), np.float32).tobytes()])
        reply = protocol.decode(sock.recv_multipart()[0])
        return reply, time.monotonic() - start
    finally:
        sock.close()
        ctx.term()


def test_the_queue_policy_timeout_is_the_policys_not_the_clients(dpool):
    """allow_timeout_override: false. A request asking 0.2 s (timeout_us) with a client that waits 30 s
    times out per the policy (TIMEOUT, after the policy's 1.5 s); one whose client waits only 0.3 s with no
    timeout of its own is dropped as its client's (POOL_UNAVAILABLE), not answered as a policy timeout.
    Neither runs."""
    open(dpool.gate, "w").close()
    with dpool.client() as patient:
        blocked = _block(patient, dpool, "policed")
        reply, took = _raw_infer(dpool.endpoint, 7, 200_000, 30_000_000)
        assert reply.code == errors.Timeout.code and reply.message == "Request timeout expired", reply
        assert took >= POLICY_S - 0.05  # the 0.2 s it asked for did not override the policy
        reply, took = _raw_infer(dpool.endpoint, 8, 0, 300_000)
        assert reply.code == errors.PoolUnavailable.code and "client's deadline" in reply.message, reply
        assert took >= 0.3 - 0.05
        with pytest.raises(errors.Timeout, match="Request timeout expired"):
            patient.infer("policed", _x(9.0))  # the client's default wait is long: the policy's timeout
        os.unlink(dpool.gate)
        assert [f.result(60)["Y"][0, 0] for f in blocked] == [-1.0, -2.0]
        assert _ran(dpool, "policed") == [-1.0, -2.0]
