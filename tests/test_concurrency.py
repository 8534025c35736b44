"""Hundreds of requests in flight from threads and processes: each answer belongs to its own request."""

import concurrent.futures
import os
import subprocess
import sys

import numpy as np
import pytest

from gepool.common import errors

HERE = os.path.dirname(os.path.abspath(__file__))
PER_CLIENT = 120


def _thread_client(pool, seed: int, shared: bool) -> int:
    with pool.client(shared_memory=shared, arena_min_bytes=0) as c:
        xs = [np.full((1 + i % 3, 16), seed * 100_000 + i, np.float32) for i in range(PER_CLIENT)]
        futures = [c.infer_async("tiny", {"INPUT0": x}) for x in xs]
        blocking = [c.infer("tiny", {"INPUT0": x}) for x in xs[:10]]  # sync calls while futures fly
        for x, out in zip(xs[:10], blocking):
            np.testing.assert_array_equal(out["OUTPUT0"], 2 * x + 1)
        for x, fut in zip(xs, futures):
            np.testing.assert_array_equal(fut.result(timeout=120)["OUTPUT0"], 2 * x + 1)
    return PER_CLIENT


@pytest.mark.parametrize("shared", [False, True], ids=["frames", "shm"])
def test_threads_and_processes_without_cross_talk(pool, shared):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "client_proc.py"), pool.endpoint, str(PER_CLIENT),
                               str(seed), "1" if shared else "0"], stdout=subprocess.PIPE, text=True, env=env)
             for seed in (1, 2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            counts = list(ex.map(lambda seed: _thread_client(pool, seed, shared), (3, 4, 5)))
        outs = [p.communicate(timeout=180)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert counts == [PER_CLIENT] * 3
    assert outs == [f"ok {PER_CLIENT}"] * 2, outs
    assert [p.returncode for p in procs] == [0, 0]


def test_one_client_shared_by_many_threads(client):
    def work(seed: int) -> None:
        for i in range(30):
            x = np.full((2, 16), seed * 1000 + i, np.float32)
            np.testing.assert_array_equal(client.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(work, range(8)))


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "zmq"])
def test_closed_loops_driven_from_future_callbacks(pool, lane):
    """Each answer's callback (run on the client's I/O thread) sends the next request: the I/O thread
    sends those itself, between replies, and every chain runs to its end with its own answers."""
    import threading

    chains, steps = 8, 40
    finished = threading.Event()
    seen: dict[int, list] = {c: [] for c in range(chains)}
    errors_seen: list = []
    lock = threading.Lock()

    with pool.client(lane=lane) as client:
        def send(chain: int, step: int) -> None:
            x = np.full((1, 16), chain * 1000 + step, np.float32)
            client.infer_async("tiny", {"INPUT0": x}).add_done_callback(
                lambda fut: on_done(chain, step, fut))

        def on_done(chain: int, step: int, fut) -> None:
            try:
                seen[chain].append(float(fut.result()["OUTPUT0"][0, 0]))
            except Exception as exc:  # an error must fail the test, not vanish in the I/O thread
                errors_seen.append(exc)
                finished.set()
                return
            if step + 1 < steps:
                send(chain, step + 1)
            with lock:
                if all(len(v) == steps for v in seen.values()):
                    finished.set()

        for chain in range(chains):
            send(chain, 0)
        assert finished.wait(120), {c: len(v) for c, v in seen.items()}
    assert not errors_seen
    assert seen == {c: [2 * (c * 1000 + s) + 1 for s in range(steps)] for c in range(chains)}


def test_closing_a_client_settles_every_future(pool):
    """Futures still waiting to be sent, or answered, when the client closes fail with Unavailable
    instead of hanging."""
    for _ in range(5):
        client = pool.client()
        x = np.ones((1, 16), np.float32)
        client.infer("tiny", {"INPUT0": x})
        futures = [client.infer_async("tiny", {"INPUT0": x}) for _ in range(300)]
        client.close()
        for fut in futures:
            try:
                np.testing.assert_array_equal(fut.result(timeout=30)["OUTPUT0"], 2 * x + 1)
            except Exception as exc:  # a hung future raises TimeoutError here and fails the test
                assert isinstance(exc, errors.Unavailable), repr(exc)
