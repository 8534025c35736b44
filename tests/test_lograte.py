"""The front's log lines that peers cause (scheduler/lograte.py): one per cause and peer each period, with
what was held back counted; bounded for many peers too; and a hostile lane client's flood says one line."""

import logging
import select
import time

import numpy as np

from gepool.ipc import lane, protocol
from gepool.scheduler import lanes as front_lanes
from gepool.scheduler import lograte
from tests.test_lane_batch import _front_lanes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.lograte"]


def test_one_line_per_cause_and_peer_each_period_with_the_held_back_counted(caplog):
    clock = Clock()
    limited = lograte.Limited(logging.getLogger("test.lograte"), 10.0, clock)
    caplog.set_level(logging.INFO, "test.lograte")
    for i in range(1000):
        limited.log(logging.WARNING, "bad", b"peer-a", "bad message %d", i)
    limited.log(logging.WARNING, "bad", b"peer-b", "bad message from b")
    limited.log(logging.WARNING, "short", b"peer-a", "short message")
    assert _lines(caplog) == ["bad message 0", "bad message from b", "short message"]
    clock.now += 9.9
    limited.log(logging.WARNING, "bad", b"peer-a", "still quiet")
    clock.now += 0.2
    limited.log(logging.WARNING, "bad", b"peer-a", "bad message again")
    assert _lines(caplog)[-1] == "bad message again (and 1000 more like it in the last 10 s, not logged)"
    clock.now += 10.1
    limited.log(logging.WARNING, "bad", b"peer-a", "later")
    assert _lines(caplog)[-1] == "later"


def test_many_peers_share_one_line_per_cause_past_the_cap(caplog):
    clock = Clock()
    limited = lograte.Limited(logging.getLogger("test.lograte"), 10.0, clock)
    caplog.set_level(logging.INFO, "test.lograte")
    for i in range(10 * lograte.MAX_PEERS):
        limited.log(logging.WARNING, "bad", i.to_bytes(8, "little"), "bad message")
    assert len(_lines(caplog)) == lograte.MAX_PEERS + 1
    assert len(limited._seen) == lograte.MAX_PEERS + 1
    clock.now += 11  # the peers went quiet: a new one has its own line again
    limited.log(logging.WARNING, "bad", b"new", "from a new peer")
    assert _lines(caplog)[-1] == "from a new peer" and len(limited._seen) < lograte.MAX_PEERS


def test_a_lane_client_flooding_oversized_messages_costs_one_log_line_and_hears_each_refusal(tmp_path, caplog,
                                                                                              monkeypatch):
    monkeypatch.setattr(front_lanes, "limited", lograte.Limited(front_lanes.log))
    caplog.set_level(logging.INFO, "gepool.lanes")
    lanes, conn, _ = _front_lanes(tmp_path, limit=1000)
    try:
        big = np.zeros(lane.RECORD_MAX + 1, np.uint8)
        replies = []
        for i in range(50):
            conn.send([protocol.Query(i, "status", {}).encode(), big], 30)
            deadline = time.monotonic() + 30
            while not select.select([conn.sock], [], [], 0)[0] and time.monotonic() < deadline:
                lanes.pump(10)  # the front's pass: read, answer, flush
                lanes.flush()
            replies.append(protocol.decode(conn.recv(time.monotonic() + 30)[0]))
        assert [r.req_id for r in replies] == list(range(50))
        assert all(isinstance(r, protocol.Error) for r in replies)
        lines = [r.getMessage() for r in caplog.records if r.name == "gepool.lanes"]
        assert len(lines) == 1 and "refusing a message" in lines[0], lines
    finally:
        conn.close()
        lanes.close()
