"""Batching through a real pool: the recorder model reports the batch each row ran in."""

import os
import random
import time

import numpy as np

from tests.conftest import wait_until


def batches(client, model: str) -> int:
    return client.stats()[model]["batches"]


def test_eight_concurrent_requests_run_as_one_batch_of_eight(client, gate_file):
    """preferred [4, 8], a 10 s delay. The worker is held busy by a gated request, so the 8 requests
    queue up; when the 8th arrives the batch cannot grow further and goes as one batch of 8."""
    open(gate_file, "w").close()
    try:
        before = batches(client, "recorder")
        # 8 rows reach the largest preferred size, so the blocker goes at once without waiting the delay
        blocker = client.infer_async("recorder", {"INPUT": np.full((8, 4), -1, np.float32)})
        assert wait_until(lambda: batches(client, "recorder") == before + 1), "the gated batch never started"
        futures = [client.infer_async("recorder", {"INPUT": np.full((1, 4), i, np.float32)}) for i in range(8)]
        assert wait_until(lambda: batches(client, "recorder") == before + 2), "the 8 requests were never batched"
    finally:
        os.unlink(gate_file)
    assert blocker.result(timeout=60)["BATCH"][0, 0] == 8
    for i, fut in enumerate(futures):
        out = fut.result(timeout=60)
        assert out["BATCH"][0, 0] == 8
        np.testing.assert_array_equal(out["OUTPUT"], np.full((1, 4), i, np.float32))


def test_a_lone_request_is_answered_once_the_delay_passes(client):
    """'lone' waits up to 200 ms for company (preferred [4, 8]); alone, it still gets an answer."""
    start = time.monotonic()
    out = client.infer("lone", {"INPUT": np.ones((1, 4), np.float32)}, timeout=60)
    waited = time.monotonic() - start
    assert out["BATCH"][0, 0] == 1
    assert waited >= 0.19  # it did wait for the delay: a lower bound the design guarantees, not a speed


def test_batches_never_exceed_max_batch_size(pool):
    """Random request sizes from many threads against 'pair' (max 8, two workers): every batch <= 8 rows,
    every row counted once, and each request's rows come back to it."""
    rng = random.Random(3)
    sizes = [rng.randint(1, 5) for _ in range(120)]
    with pool.client() as c:
        before = c.stats()["pair"]
        futures = [(n, i, c.infer_async("pair", {"INPUT": np.full((n, 4), i, np.float32)}))
                   for i, n in enumerate(sizes)]
        for n, i, fut in futures:
            out = fut.result(timeout=120)
            assert out["OUTPUT"].shape == (n, 4)
            assert (out["OUTPUT"] == i).all()
            assert n <= out["BATCH"][0, 0] <= 8
        after = c.stats()["pair"]
    assert max(int(k) for k in after["batch_sizes"]) <= 8
    assert after["rows"] - before["rows"] == sum(sizes)
    assert after["batches"] - before["batches"] < len(sizes)  # some requests did share a batch
