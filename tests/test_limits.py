"""Hostile sizes and identities inside the front: declared sizes checked before memory is taken, arenas
that only their client may use, loads that cannot hang the pool, and a runtime folder of our own."""

import socket
import struct
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

from gepool import Client, Pool
from gepool.common import errors
from gepool.ipc import dtypes, lane, naming, protocol
from gepool.scheduler.requests import MAX_BYTES_ELEMENTS
from tests import repo as test_repo
from tests.conftest import free_port, rss_kb, wait_until

MIB = 1 << 20
RSS_BUDGET_KB = 50 * 1024  # what hostile declarations may cost the front, all together

HANG_PY = """
import time


class Model:
    def initialize(self, config):
        time.sleep(3600)

    def execute(self, inputs):
        return {}
"""

EXIT3_PY = """
import os

import numpy as np


class Model:
    def execute(self, inputs):
        x = inputs["X"]
        if (x == 3).any():
            os._exit(3)  # the model's own code, at run time, with the old "cannot load" code
        return {"Y": x.copy()}
"""

TEXT_CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
    output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

TEXT_PY = """
import numpy as np


class Model:
    def execute(self, inputs):
        return {"N": np.array([inputs["TEXT"].size], np.int32)}
"""


@pytest.fixture(scope="module")
def limits_pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("limits"))
    test_repo.make_models.make_tiny(repo)
    test_repo.recorder(repo, "big", extra='parameters { key: "slot_bytes" value: { string_value: "256M" } }')
    test_repo.write(f"{repo}/text/1/model.py", TEXT_PY)
    test_repo.write(f"{repo}/text/config.pbtxt", TEXT_CONFIG)
    with Pool(repo) as pool:
        yield pool


def _lane_path(pool) -> str:
    return lane.path_for(pool.endpoint[len("ipc://"):])


def _raw_lane(pool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(30)
    sock.connect(_lane_path(pool))
    assert sock.recv(lane.RECORD_MAX) == lane.ACCEPTED
    return sock


def _declare(sock: socket.socket, req_id: int, declared: int) -> None:
    """The first record of a message whose one tensor part declares ``declared`` bytes; none of them follow."""
    header = protocol.Infer(req_id, "big", -1, [["INPUT", "FP32", [1, 4], 0]], None, 0, 0, protocol.NO_ARENA, 0,
                            0).encode()
    sizes = [len(header), declared]
    sock.send(b"\x01" + struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes) + header)


def _answers_meanwhile(pool, stop: threading.Event, counts: list) -> None:
    with Client(pool.endpoint) as c:
        x = np.ones((1, 16), np.float32)
        while not stop.is_set():
            np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": x}, timeout=30)["OUTPUT0"], 2 * x + 1)
            counts[0] += 1


def test_declared_lane_sizes_cost_the_front_nothing_until_sent(limits_pool):
    """Two lanes declaring 2 GiB (over the limit: refused, the lane kept) and four declaring 200 MiB
    (under the 256 MiB slot: taken only as bytes arrive): the front's RSS grows by under 50 MiB and
    another client is answered all along."""
    pid = limits_pool.process.pid
    with Client(limits_pool.endpoint) as c:
        c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})
    before = rss_kb(pid)
    stop, counts = threading.Event(), [0]
    other = threading.Thread(target=_answers_meanwhile, args=(limits_pool, stop, counts))
    other.start()
    socks = []
    try:
        for i in range(2):
            sock = _raw_lane(limits_pool)
            socks.append(sock)
            _declare(sock, 100 + i, 2 << 30)
            msg = protocol.decode(sock.recv(lane.RECORD_MAX)[5 + 8:])
            assert isinstance(msg, protocol.Error) and msg.req_id == 100 + i
            assert msg.code == errors.RequestTooLarge.code and "larger than the" in msg.message
        for i in range(4):
            sock = _raw_lane(limits_pool)
            socks.append(sock)
            _declare(sock, 200 + i, 200 * MIB)
        seen = counts[0]
        assert wait_until(lambda: counts[0] >= seen + 20, 60), "another client was not answered meanwhile"
        grown = rss_kb(pid) - before
        assert grown < RSS_BUDGET_KB, f"the front grew by {grown} KiB on declarations alone"
    finally:
        stop.set()
        other.join()
        for sock in socks:
            sock.close()


def test_an_oversized_message_is_drained_and_its_lane_serves_on(limits_pool):
    """A message past the largest slot plus headers, sent whole: answered REQUEST_TOO_LARGE, its records
    read and dropped, and the next message on the same lane served."""
    conn = lane.Connection(_lane_path(limits_pool))
    try:
        declared = 300 * MIB
        header = protocol.Infer(7, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, protocol.NO_ARENA,
                                0, 0).encode()
        conn.sock.settimeout(60)
        conn.sock.send(b"\x01" + struct.pack("<I2Q", 2, len(header), declared) + header)
        chunk = b"\x01" + bytes(lane.RECORD_MAX - 1)
        left = declared
        while left:  # the rest, record by record, from one buffer
            n = min(left, lane.RECORD_MAX - 1)
            left -= n
            conn.sock.send(chunk[:n + 1] if left else b"\x00" + chunk[1:n + 1])
        msg, _ = _decode(conn.recv(None))
        assert isinstance(msg, protocol.Error) and msg.req_id == 7 and msg.code == errors.RequestTooLarge.code
        x = np.ones((1, 16), np.float32)
        conn.send([protocol.Infer(8, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, protocol.NO_ARENA,
                                  0, 0).encode(), x.tobytes()], 60)
        msg, parts = _decode(conn.recv(None))
        assert isinstance(msg, protocol.Result) and msg.req_id == 8
        np.testing.assert_array_equal(np.frombuffer(parts[0], np.float32), 2 * x.ravel() + 1)
    finally:
        conn.close()


def _decode(parts):
    return protocol.decode(parts[0]), parts[1:]


def _text_infer(req_id: int, count: int, blob: bytes) -> list:
    return [protocol.Infer(req_id, "text", -1, [["TEXT", "BYTES", [count], 0]], None, 0, 0, protocol.NO_ARENA, 0,
                           0).encode(), blob]


def test_bytes_element_counts_are_checked_against_the_bytes_sent(limits_pool):
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(limits_pool.endpoint)
    try:
        pid = limits_pool.process.pid
        before = rss_kb(pid)
        sock.send_multipart(_text_infer(1, 300_000_000, b"\0" * 8))  # 300 M elements declared, 8 bytes sent
        msg = protocol.decode(sock.recv_multipart()[0])
        assert msg.code == errors.InvalidArgument.code and "300000000 BYTES elements need at least" in msg.message
        varied = dtypes.serialize_bytes(np.array([b"", b"a"] * 2_000_000, dtype=object))  # 4 M elements, 10 MB
        sock.send_multipart(_text_infer(2, 4_000_000, varied))
        msg = protocol.decode(sock.recv_multipart()[0])
        assert msg.code == errors.RequestTooLarge.code and f"at most {MAX_BYTES_ELEMENTS} elements" in msg.message
        assert rss_kb(pid) - before < RSS_BUDGET_KB
        same = dtypes.serialize_bytes(np.array([b"ab"] * 100_000, dtype=object))  # one length: checked at once
        sock.send_multipart(_text_infer(3, 100_000, same))
        msg = protocol.decode(sock.recv_multipart()[0])
        assert isinstance(msg, protocol.Result), msg
        few = dtypes.serialize_bytes(np.array([b"", b"abc", b"z"], dtype=object))
        sock.send_multipart(_text_infer(4, 3, few))
        assert isinstance(protocol.decode(sock.recv_multipart()[0]), protocol.Result)
    finally:
        sock.close()
        ctx.term()


ARENA_ATTACK = """
import sys
from gepool.ipc import lane, protocol

conn = lane.Connection(sys.argv[1])
arena, name = int(sys.argv[2]), sys.argv[3]
msgs = [protocol.Infer(1, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, arena, 0, 4096),
        protocol.UnregisterArena(2, arena), protocol.RegisterArena(3, name, 64)]
for msg in msgs:
    conn.send([msg.encode()], 10)
    reply = protocol.decode(conn.recv(None)[0])
    print(type(reply).__name__, getattr(reply, "code", ""), getattr(reply, "message", ""), flush=True)
conn.close()
"""


def test_an_arena_serves_only_its_own_client(limits_pool, tmp_path):
    """Another process on a lane, and another ZMQ client, naming a client's arena: refused, the arena
    untouched and still registered; a lane may not register an arena another process made."""
    import zmq

    with Client(limits_pool.endpoint, shared_memory=True, arena_min_bytes=0) as owner:
        arena_id, name = owner._arena_id, owner.arena.segment.name
        owner.arena.buf[:4096] = b"\x07" * 4096
        out = subprocess.run([sys.executable, "-c", ARENA_ATTACK, _lane_path(limits_pool), str(arena_id), name],
                             capture_output=True, text=True, timeout=60)
        lines = out.stdout.splitlines()
        assert len(lines) == 3, out.stderr
        assert lines[0].startswith("Error INVALID_ARGUMENT") and "not registered by this client" in lines[0]
        assert lines[1].startswith("Error INVALID_ARGUMENT")
        assert lines[2].startswith("Error PERMISSION_DENIED") and "not made by this client's process" in lines[2]

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(limits_pool.endpoint)
        try:
            sock.send(protocol.Infer(4, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, arena_id, 0,
                                     4096).encode())
            msg = protocol.decode(sock.recv())
            assert msg.code == errors.InvalidArgument.code and "not registered by this client" in msg.message
            sock.send(protocol.UnregisterArena(5, arena_id).encode())
            assert protocol.decode(sock.recv()).code == errors.InvalidArgument.code
            pool_segment = naming.segment_name(limits_pool.status["pool_id"], "w1.0")
            sock.send(protocol.RegisterArena(6, pool_segment, 64).encode())
            msg = protocol.decode(sock.recv())
            assert msg.code == errors.PermissionDenied.code and "pool's own segments" in msg.message
        finally:
            sock.close()
            ctx.term()

        assert bytes(owner.arena.buf[:4096]) == b"\x07" * 4096  # nobody wrote there
        x = owner.empty((1, 16), np.float32)
        x[:] = 2.0
        np.testing.assert_array_equal(owner.infer("tiny", {"INPUT0": x})["OUTPUT0"], np.full((1, 16), 5.0))
        assert owner.status()["arenas"] >= 1


def test_a_model_that_never_loads_times_out_and_the_pool_serves(tmp_path):
    """initialize() never returns: after its model_load_timeout_s the worker is killed, the model is
    UNAVAILABLE saying why, the pool ready, its HTTP port listening and the other model serving."""
    test_repo.make_models.make_tiny(str(tmp_path))
    test_repo.write(f"{tmp_path}/hang/1/model.py", HANG_PY)
    test_repo.write(f"{tmp_path}/hang/config.pbtxt", """
        backend: "python"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
        parameters { key: "model_load_timeout_s" value: { string_value: "2" } }
    """)
    port = free_port()
    with Pool(str(tmp_path), http_port=port) as pool, pool.client() as c:
        hang = pool.status["models"]["hang"]
        assert hang["state"] == "UNAVAILABLE" and "model_load_timeout_s" in hang["reason"], hang
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/tiny/ready", timeout=30) as reply:
            assert reply.status == 200  # the HTTP port listens, and serves the model that loaded
        assert c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})["OUTPUT0"][0, 0] == 3.0
        with pytest.raises(errors.ModelNotReady, match="did not load within 2 s"):
            c.infer("hang", {"X": np.ones((1, 1), np.float32)})


def test_a_model_exiting_with_code_3_at_run_time_is_restarted(tmp_path):
    test_repo.write(f"{tmp_path}/exit3/1/model.py", EXIT3_PY)
    test_repo.write(f"{tmp_path}/exit3/config.pbtxt", """
        backend: "python"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    """)
    with Pool(str(tmp_path)) as pool, pool.client() as c:
        with pytest.raises(errors.WorkerDied):
            c.infer("exit3", {"X": np.full((1, 1), 3, np.float32)})

        def served() -> bool:
            try:
                return c.infer("exit3", {"X": np.ones((1, 1), np.float32)})["Y"][0, 0] == 1.0
            except errors.GepoolError:
                return False

        assert wait_until(served, 60), c.status()["models"]["exit3"]
        assert c.status()["models"]["exit3"]["state"] == "READY"
