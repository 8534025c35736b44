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
