"""A tcp peer (any local user, without CURVE) cannot make the front buffer a frame that no queue could hold:
libzmq allocates what a frame's header declares, so the front's socket refuses it at the header."""

import socket
import struct
import time

import numpy as np

from gepool import Client, Pool
from tests import repo as test_repo
from tests.conftest import rss_kb

QUEUED = 64 << 20
SENT = 256 << 20  # of a frame declared as 1 GiB
RSS_BUDGET_KB = 50 << 10


def _zmtp_dealer(host: str, port: int) -> socket.socket:
    """A raw ZMTP 3.0 peer (NULL mechanism) that has said READY as a DEALER."""
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\0" * 16 + b"\x00" + b"\0" * 31)
    s.recv(64)
    ready = bytes([5]) + b"READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(bytes([0x04, len(ready)]) + ready)
    return s


def test_a_frame_declared_past_the_queue_budget_is_refused_at_its_header(tmp_path):
    test_repo.make_models.make_tiny(str(tmp_path))
    with Pool(str(tmp_path), endpoint="tcp://127.0.0.1:*", max_queued_bytes=QUEUED) as pool, \
            Client(pool.endpoint) as other:
        front = pool.process.pid
        host, port = pool.endpoint[len("tcp://"):].rsplit(":", 1)
        before = rss_kb(front)
        attacker = _zmtp_dealer(host, int(port))
        time.sleep(0.2)  # the handshake done: what follows is a message
        sent = 0
        try:
            attacker.sendall(b"\x02" + struct.pack(">Q", 1 << 30))  # a long, last frame of 1 GiB
            chunk = bytes(1 << 20)
            while sent < SENT:
                attacker.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # disconnected at the header, as it should be
        finally:
            attacker.close()
        assert rss_kb(front) - before < RSS_BUDGET_KB, (sent, rss_kb(front) - before)
        x = np.ones((1, 16), np.float32)
        assert other.infer("tiny", {"INPUT0": x})["OUTPUT0"][0, 0] == 3.0
