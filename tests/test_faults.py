"""Faults caused for real: killed and hung workers, a killed front, a dead client, overload."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gepool import Client, Pool
from gepool.common import errors
from gepool.ipc.sockets import runtime_dir
from tests import repo as test_repo
from tests.conftest import _descendants, rss_kb, running, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def repo(tmp_path):
    gate = str(tmp_path / "gate")
    models = str(tmp_path / "models")
    test_repo.make_models.make_tiny(models)
    test_repo.recorder(models, "pair", gate=gate, count=2, max_batch=8, preferred="8", delay_us=1000)
    test_repo.recorder(models, "hangs", gate=gate, max_batch=8, preferred="8", delay_us=1000,
                       extra='parameters { key: "execution_timeout_ms" value: { string_value: "500" } }')
    test_repo.recorder(models, "busy", max_batch=4, preferred="4", delay_us=2000, extra="""
        parameters { key: "sleep_ms" value: { string_value: "20" } }""")
    busy = os.path.join(models, "busy", "config.pbtxt")
    with open(busy) as f:
        text = f.read()
    with open(busy, "w") as f:  # bounded queue, 300 ms queue timeout that requests may shorten
        f.write(text.replace("max_queue_delay_microseconds: 2000 }", "max_queue_delay_microseconds: 2000 "
                             "default_queue_policy { max_queue_size: 64 default_timeout_microseconds: 300000 "
                             "allow_timeout_override: true } }"))
    return models, gate


def batches(c, model):
    return c.stats()[model]["batches"]


def test_killed_worker_batch_is_retried_on_the_other_worker(repo):
    models, gate = repo
    open(gate, "w").close()
    with Pool(models) as pool:
        c = pool.client()
        before = set(c.status()["models"]["pair"]["worker_pids"])
        assert len(before) == 2
        fut = c.infer_async("pair", {"INPUT": np.full((8, 4), -1, np.float32)})
        assert wait_until(lambda: batches(c, "pair") == 1)
        (holder,) = c.status()["models"]["pair"]["busy_worker_pids"]  # the worker holding the batch
        os.kill(holder, signal.SIGKILL)
        assert wait_until(lambda: batches(c, "pair") == 2), "the batch was not retried"
        os.unlink(gate)
        out = fut.result(timeout=60)  # answered by the surviving worker
        assert out["BATCH"][0, 0] == 8 and (out["OUTPUT"] == -1).all()
        assert wait_until(lambda: len(c.status()["models"]["pair"]["worker_pids"]) == 2, 60)
        assert holder not in c.status()["models"]["pair"]["worker_pids"]  # replaced
        assert c.status()["models"]["pair"]["restarts"] == 1


def test_hung_worker_is_killed_its_batch_answered_and_replaced(repo):
    models, gate = repo
    open(gate, "w").close()  # never removed while the batch runs: the execute hangs
    with Pool(models) as pool:
        c = pool.client()
        old = c.status()["models"]["hangs"]["worker_pids"]
        start = time.monotonic()
        with pytest.raises(errors.WorkerDied, match="did not finish a batch within 500 ms"):
            c.infer("hangs", {"INPUT": np.full((8, 4), -1, np.float32)}, timeout=60)
        assert time.monotonic() - start < 30
        os.unlink(gate)
        assert wait_until(lambda: c.status()["models"]["hangs"]["worker_pids"] not in ([], old), 60)
        assert c.infer("hangs", {"INPUT": np.ones((1, 4), np.float32)})["BATCH"][0, 0] == 1


def test_killed_front_workers_exit_clients_fail_fast_and_reconnect(repo, tmp_path):
    models, gate = repo
    open(gate, "w").close()
    endpoint = f"ipc://{tmp_path}/front.sock"
    pool = Pool(models, endpoint=endpoint).start()
    plain = shm = None
    try:
        workers = _descendants(pool.process.pid)
        plain = Client(endpoint, timeout=3)
        shm = Client(endpoint, shared_memory=True, timeout=3, arena_min_bytes=0)
        fut = plain.infer_async("pair", {"INPUT": np.full((8, 4), -1, np.float32)})
        assert wait_until(lambda: plain.stats()["pair"]["batches"] == 1)
        # the I/O thread's lane is up: this one goes straight onto it from this thread, and waits (held by
        # the gate too: pair has a second, idle instance, which would answer a row the gate lets through
        # before the kill whenever this process is descheduled between the two lines below)
        queued = plain.infer_async("pair", {"INPUT": np.full((8, 4), -2, np.float32)})
        pool.process.kill()
        pool.process.wait()
        late = plain.infer_async("tiny", {"INPUT0": np.ones((1, 16), np.float32)})  # onto a dead lane
        for f in (fut, queued, late):
            with pytest.raises(errors.PoolUnavailable):
                f.result(timeout=30)
        assert wait_until(lambda: not any(running(p) for p in workers), 60), "workers outlived the front"
        with pytest.raises(errors.PoolUnavailable):
            plain.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})
        os.unlink(gate)
        pool.stop()  # removes what the killed front could not: its sockets, doorbells and endpoint files
        front_pid, runtime = pool.process.pid, runtime_dir()
        assert not [e for e in os.listdir(runtime) if e.startswith(f"gepool-{front_pid}x")]
        assert not os.path.exists(endpoint[len("ipc://"):]) and not os.path.exists(endpoint[len("ipc://"):] + ".lane")
        with Pool(models, endpoint=endpoint):
            for c in (plain, shm):  # the same client objects: ZMQ reconnected, the arena is registered again
                x = np.arange(16, dtype=np.float32)[None]
                np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
    finally:
        for c in (plain, shm):
            if c is not None:
                c.close()
        pool.stop()


def test_dead_client_releases_its_arena_and_others_are_served(repo):
    models, gate = repo
    with Pool(models) as pool:
        code = (f"import os, numpy as np; from gepool import Client; c = Client({pool.endpoint!r}, "
                "shared_memory=True, arena_min_bytes=0); "
                "[c.infer_async('busy', {'INPUT': np.ones((1, 4), np.float32)}) for _ in range(20)]; os._exit(0)")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
        c = pool.client()
        assert wait_until(lambda: c.status()["arenas"] == 0, 30), "the dead client's arena was kept"
        assert c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})["OUTPUT0"][0, 0] == 3.0


def test_overload_every_request_answered_and_memory_bounded(repo):
    """'busy' runs 4 rows per 20 ms (~200 rows/s); 1,600 requests arrive at ~4x that rate. Each is
    answered: served, timed out in the queue (300 ms), or refused because the queue is full."""
    models, _ = repo
    with Pool(models) as pool:
        c = pool.client()
        front = c.status()["pid"]
        rss_before = rss_kb(front)
        futures = []
        start = time.monotonic()
        for i in range(1600):
            futures.append(c.infer_async("busy", {"INPUT": np.full((1, 4), i, np.float32)}, timeout=120))
            lag = start + i / 800 - time.monotonic()
            if lag > 0:
                time.sleep(lag)
        outcomes = {"ok": 0, "TIMEOUT": 0, "UNAVAILABLE": 0}
        for i, f in enumerate(futures):
            try:
                out = f.result(timeout=120)
                assert out["OUTPUT"][0, 0] == i
                outcomes["ok"] += 1
            except errors.GepoolError as exc:
                outcomes[exc.code] += 1
        rss_after = rss_kb(front)
    print(f"overload: {outcomes}, front RSS {rss_before} -> {rss_after} kB")
    assert sum(outcomes.values()) == 1600, outcomes
    assert outcomes["ok"] > 0 and outcomes["UNAVAILABLE"] + outcomes["TIMEOUT"] > 0, outcomes
    assert rss_after - rss_before < 64 * 1024, (rss_before, rss_after)


def test_sigterm_under_load_answers_every_accepted_request(repo):
    """Three threads keep requests flowing; SIGTERM arrives. Every request before a thread's first refusal
    was accepted and must succeed; the refusal says the pool is stopping; the front exits 0 and its
    children go."""
    import threading

    models, _ = repo
    pool = Pool(models).start()
    outcomes: list[list[str]] = [[] for _ in range(3)]
    try:
        workers = _descendants(pool.process.pid)
        client = Client(pool.endpoint, timeout=3)

        def flow(i: int) -> None:
            while True:
                try:
                    client.infer("busy", {"INPUT": np.full((1, 4), i, np.float32)})
                    outcomes[i].append("ok")
                except errors.GepoolError as exc:
                    outcomes[i].append(exc.code)
                    return

        threads = [threading.Thread(target=flow, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert wait_until(lambda: all(len(o) >= 5 for o in outcomes), 60)
        pool.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert pool.process.wait(60) == 0
        client.close()
        assert wait_until(lambda: not any(running(p) for p in workers), 60)
    finally:
        pool.stop()
    for o in outcomes:
        assert o[-1] in ("UNAVAILABLE", "POOL_UNAVAILABLE") and set(o[:-1]) == {"ok"}, o
