"""A client that truncates its own registered arena fails its own requests and crashes nothing: the front
reads and writes arenas through their fd, never a mapping (a mapped read past the end is SIGBUS)."""

import os

import numpy as np
import pytest

from gepool import Client, Pool
from gepool.common import errors
from tests.repo import make_models

WIDE = 16384  # FP32 per row: 64 KiB, past the size at which a lone arena request runs in the arena itself


@pytest.fixture(scope="module")
def tpool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("truncated"))
    make_models.make_tiny(repo)
    make_models.make_tiny(repo, name="wide", width=WIDE, max_batch=4)
    with Pool(repo) as pool:
        yield pool


def _alive(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.parametrize("model, width", [("tiny", 16), ("wide", WIDE)], ids=["slot-copy", "direct"])
def test_a_truncated_arena_fails_its_request_and_nothing_dies(tpool, model, width):
    front = tpool.process.pid
    with tpool.client() as other, Client(tpool.endpoint, shared_memory=True, arena_min_bytes=0) as c:
        workers = c.status()["models"][model]["worker_pids"]
        x = c.empty((1, width), np.float32)
        x[:] = 1.0
        np.testing.assert_array_equal(c.infer(model, {"INPUT0": x})["OUTPUT0"], np.full((1, width), 3.0))
        os.truncate("/dev/shm" + c.arena.segment.name, 0)
        with pytest.raises(errors.InvalidArgument, match="was truncated"):
            c.infer(model, {"INPUT0": x}, timeout=60)
        assert _alive(front)
        assert other.status()["models"][model]["worker_pids"] == workers  # no worker died either
        y = np.full((1, width), 2.0, np.float32)
        np.testing.assert_array_equal(other.infer(model, {"INPUT0": y})["OUTPUT0"], np.full((1, width), 5.0))


def test_an_arena_raced_by_truncation_stops_running_direct_batches(tpool):
    """A thread truncates and restores the client's arena while it sends direct-size requests: a worker
    that maps the arena could meet the truncation mid-read (SIGBUS); once the front sees the arena truncated,
    or a worker die in it, it copies that arena's requests through the slot. At most one worker dies."""
    import threading

    with Client(tpool.endpoint, shared_memory=True, arena_min_bytes=0) as c:
        restarts = c.status()["models"]["wide"]["restarts"]
        path, size = "/dev/shm" + c.arena.segment.name, c.arena.size
        x = c.empty((1, WIDE), np.float32)
        x[:] = 1.0
        stop = threading.Event()

        def flip():
            while not stop.is_set():
                os.truncate(path, 0)
                os.truncate(path, size)

        flipper = threading.Thread(target=flip)
        flipper.start()
        try:
            outcomes = set()
            for _ in range(300):
                try:
                    c.infer("wide", {"INPUT0": x}, timeout=60)
                    outcomes.add("ok")
                except errors.GepoolError as exc:
                    outcomes.add(type(exc).__name__)
        finally:
            stop.set()
            flipper.join()
        assert "InvalidArgument" in outcomes, outcomes  # the truncations were seen
        assert c.status()["models"]["wide"]["restarts"] - restarts <= 1
        assert _alive(tpool.process.pid)
        x[:] = 1.0  # the arena whole again (a truncation zeroes it): its requests are served, through the slot
        np.testing.assert_array_equal(c.infer("wide", {"INPUT0": x})["OUTPUT0"], np.full((1, WIDE), 3.0))
