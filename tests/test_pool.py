"""Pool lifecycle with real processes: clean exit, a killed worker, shutdown while requests run."""

import logging
import os
import signal
import time

import numpy as np
import pytest

from gepool import Client, Pool
from gepool.common import errors
from tests import repo as test_repo
from tests.conftest import _descendants, cpu_seconds, running, wait_until


@pytest.fixture
def small_repo(tmp_path):
    gate = str(tmp_path / "gate")
    test_repo.make_models.make_tiny(str(tmp_path / "models"))
    test_repo.recorder(str(tmp_path / "models"), "gated", gate=gate, delay_us=1000)
    return str(tmp_path / "models"), gate


def test_pool_exit_leaves_no_process_and_no_segment(small_repo):
    repo, _ = small_repo
    with Pool(repo) as pool:
        assert pool.status["models"]["tiny"]["state"] == "READY"
        front = pool.process.pid
        children = _descendants(front)
        assert len(children) >= 2
        assert pool.client().infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})["OUTPUT0"][0, 0] == 1.0
    assert pool.process.returncode == 0
    # workers are joined by the front; multiprocessing's resource tracker follows it out on its own
    assert wait_until(lambda: not any(running(pid) for pid in children)), [p for p in children if running(p)]


def _batches(client, model):
    return client.stats()[model]["batches"]


def test_killed_worker_fails_its_batch_and_comes_back(small_repo):
    repo, gate = small_repo
    open(gate, "w").close()
    with Pool(repo) as pool:
        c = pool.client()
        old_pid = c.status()["models"]["gated"]["worker_pids"][0]
        fut = c.infer_async("gated", {"INPUT": np.full((8, 4), -1, np.float32)})
        assert wait_until(lambda: _batches(c, "gated") == 1)
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(errors.WorkerDied, match="died"):
            fut.result(timeout=60)
        os.unlink(gate)
        assert wait_until(lambda: c.status()["models"]["gated"]["worker_pids"] not in ([], [old_pid]), 60)
        out = c.infer("gated", {"INPUT": np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(out["OUTPUT"], np.ones((1, 4)))


def test_sigterm_drains_requests_in_flight(small_repo):
    repo, gate = small_repo
    open(gate, "w").close()
    pool = Pool(repo).start()
    try:
        with Client(pool.endpoint) as c:
            running = c.infer_async("gated", {"INPUT": np.full((8, 4), -1, np.float32)})
            assert wait_until(lambda: _batches(c, "gated") == 1)
            queued = [c.infer_async("gated", {"INPUT": np.full((1, 4), i, np.float32)}) for i in range(3)]
            assert wait_until(lambda: c.status()["models"]["gated"]["queued"] + _batches(c, "gated") >= 2)
            pool.process.send_signal(signal.SIGTERM)
            assert wait_until(lambda: c.status()["stopping"])
            with pytest.raises(errors.Unavailable, match="shutting down"):
                c.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})
            os.unlink(gate)
            assert running.result(timeout=60)["BATCH"][0, 0] == 8
            for i, fut in enumerate(queued):
                np.testing.assert_array_equal(fut.result(timeout=60)["OUTPUT"], np.full((1, 4), i, np.float32))
        assert pool.process.wait(60) == 0
    finally:
        pool.stop()


def test_tcp_endpoint_on_loopback_with_both_carriers(small_repo):
    repo, _ = small_repo
    with Pool(repo, endpoint="tcp://127.0.0.1:*") as pool:
        assert pool.endpoint.startswith("tcp://127.0.0.1:") and not pool.endpoint.endswith("*")
        for shared in (False, True):
            with Client(pool.endpoint, shared_memory=shared, arena_min_bytes=0) as c:
                x = np.arange(32, dtype=np.float32).reshape(2, 16)
                np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)


def test_sigterm_grace_reports_not_ready_but_keeps_serving(small_repo):
    repo, _ = small_repo
    pool = Pool(repo, exit_grace_s=5).start()  # the request after SIGTERM must reach the front within it
    try:
        with Client(pool.endpoint) as c:
            x = np.ones((1, 16), np.float32)
            pool.process.send_signal(signal.SIGTERM)
            assert wait_until(lambda: c.status()["stopping"])  # not ready at once...
            assert c.infer("tiny", {"INPUT0": x})["OUTPUT0"][0, 0] == 3.0  # ...yet still serving
            with pytest.raises((errors.Unavailable, errors.PoolUnavailable)):
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # until the grace ends and the drain refuses
                    c.infer("tiny", {"INPUT0": x}, timeout=5)
        assert pool.process.wait(60) == 0
    finally:
        pool.stop()


@pytest.mark.parametrize("busy_poll_us, mode", [(0, "adaptive"), (2000, "fixed"), (-1, "off")])
def test_polling_front_serves_and_sleeps_when_idle(small_repo, busy_poll_us, mode):
    """Polling (adaptive by default, fixed when asked, or off) spends CPU only right after events: the
    answers are the same (sequential requests also wake their worker early with a PREPARE record), and
    an idle front and worker go back to sleep instead of spinning."""
    repo, _ = small_repo
    with Pool(repo, busy_poll_us=busy_poll_us) as pool:
        c = pool.client()
        one_cpu = len(os.sched_getaffinity(0)) == 1  # the front inherits it: adaptive polling stays off
        assert c.status()["polling"]["mode"] == ("off" if mode == "adaptive" and one_cpu else mode)
        for i in range(200):
            x = np.full((1 + i % 3, 16), i, np.float32)
            np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
        futures = [c.infer_async("tiny", {"INPUT0": np.full((1, 16), i, np.float32)}) for i in range(50)]
        assert [f.result(30)["OUTPUT0"][0, 0] for f in futures] == [2 * i + 1 for i in range(50)]
        pids = {"front": pool.process.pid, "worker": c.status()["models"]["tiny"]["worker_pids"][0]}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        time.sleep(2.0)
        for name, pid in pids.items():  # the worker polls a little after each PREPARE, then sleeps too
            idle_cpu = cpu_seconds(pid) - before[name]
            assert idle_cpu < 0.5, f"the {name} used {idle_cpu:.2f}s of CPU in 2s of idleness"


def test_the_front_sleeps_while_a_queue_waits_for_its_busy_worker(small_repo):
    """A request queued behind a running batch waits for the worker past its 1 ms delay (the batch
    keeps growing until the worker frees). The front used to keep that delay as its wake-up time and
    spun in poll(0) until the batch ended, taking a core from the worker; now it sleeps until an
    event, then sends the queued request."""
    repo, gate = small_repo
    open(gate, "w").close()
    try:
        with Pool(repo) as pool:
            c = pool.client()
            running = c.infer_async("gated", {"INPUT": np.full((8, 4), -1, np.float32)})
            assert wait_until(lambda: _batches(c, "gated") == 1)
            queued = c.infer_async("gated", {"INPUT": np.full((1, 4), 3, np.float32)})
            assert wait_until(lambda: c.status()["models"]["gated"]["queued"] == 1)
            before = cpu_seconds(pool.process.pid)
            time.sleep(2.0)
            spent = cpu_seconds(pool.process.pid) - before
            assert spent < 0.5, f"the front used {spent:.2f}s of CPU in 2s while its worker was busy"
            assert not queued.done() and _batches(c, "gated") == 1
            os.unlink(gate)
            assert running.result(timeout=60)["BATCH"][0, 0] == 8
            np.testing.assert_array_equal(queued.result(timeout=60)["OUTPUT"], np.full((1, 4), 3, np.float32))
    finally:
        if os.path.exists(gate):
            os.unlink(gate)


def test_a_repeated_bad_request_does_not_keep_waking_the_worker(small_repo):
    """Sequential requests wake their idle worker early (PREPARE), and it polls for the batch; a request
    that then fails admission brings no batch, so after one the front stops prewaking that model until
    a request for it is admitted. (A pool of its own: a worker busy elsewhere would stop prewakes.)"""
    repo, _ = small_repo
    with Pool(repo) as pool:
        _check_prewakes_after_refusals(pool.client())


def _check_prewakes_after_refusals(client) -> None:
    if client.status()["polling"]["mode"] != "adaptive":
        pytest.skip("adaptive polling is off on a front confined to one CPU")
    good, bad = np.ones((1, 16), np.float32), np.ones((1, 15), np.float32)
    client.infer("tiny", {"INPUT0": good})  # a lone batch: traffic counts as sequential
    before = client.status()["polling"]["prewakes"]
    for _ in range(30):
        with pytest.raises(errors.InvalidArgument):
            client.infer("tiny", {"INPUT0": bad})
    after_bad = client.status()["polling"]["prewakes"]
    assert after_bad - before <= 1, "a refused request's worker was woken again and again"
    for _ in range(3):
        np.testing.assert_array_equal(client.infer("tiny", {"INPUT0": good})["OUTPUT0"], 2 * good + 1)
    assert client.status()["polling"]["prewakes"] > after_bad, "admitted requests prewake again"


def test_a_pool_with_nothing_to_start_is_ready_at_once(tmp_path):
    """No worker ever reports, so readiness must not wait for an event: an empty repository, and one
    whose only model cannot load (reported UNAVAILABLE with the reason), both start."""
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    test_repo.write(str(broken / "bad" / "config.pbtxt"), 'name: "bad"\n')
    with Pool(str(empty), start_timeout=60) as pool:
        assert pool.status["models"] == {}
    with Pool(str(broken), start_timeout=60) as pool:
        bad = pool.status["models"]["bad"]
        assert bad["state"] == "UNAVAILABLE" and "backend" in bad["reason"], bad


def test_each_model_splits_the_cpu_budget_among_its_own_instances(tmp_path):
    """Models do not split the cores between them (an idle session costs nothing): each gets the whole
    budget, divided among its instances; a config's intra_op_thread_count wins. The counts are the
    ones the workers' onnxruntime sessions were built with."""
    from gepool.scheduler.control import cpu_threads

    repo = str(tmp_path)
    for name in ("one", "two", "set"):
        test_repo.make_models.make_tiny(repo, name)
    config = os.path.join(repo, "two", "config.pbtxt")
    test_repo.write(config, open(config).read().replace("count: 1", "count: 2"))
    with open(os.path.join(repo, "set", "config.pbtxt"), "a") as f:
        f.write('parameters { key: "intra_op_thread_count" value: { string_value: "3" } }\n')
    with Pool(repo, cpu_threads=6) as pool:
        models = pool.status["models"]
        assert [models[n]["worker_threads"] for n in ("one", "two", "set")] == [[6], [3, 3], [3]], models
        out = pool.client().infer("two", {"INPUT0": np.ones((1, 16), np.float32)})
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((1, 16), 3.0))
    assert cpu_threads(0, 1) == len(os.sched_getaffinity(0))
    assert cpu_threads(0, 64) == 1


_OWNER = """
import sys, time
from gepool import Pool
pool = Pool(sys.argv[1], http_port=int(sys.argv[2])).start()
print(pool.process.pid, pool.endpoint, flush=True)
time.sleep(600)
"""


def test_a_pool_never_stopped_dies_with_the_process_that_started_it(small_repo, tmp_path):
    """A death pipe: the owner is SIGKILLed, never stopping its Pool; the front, its workers and the HTTP
    sidecar exit (the front drains and removes its files as on SIGTERM) instead of living on under init."""
    import subprocess
    import sys

    from tests.conftest import free_port

    repo, _ = small_repo
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, repo, str(free_port())], stdout=subprocess.PIPE,
                             text=True, env=env)
    processes: list[int] = []
    try:
        front, endpoint = owner.stdout.readline().split()
        processes = _descendants(owner.pid)  # the front, its workers, the sidecar, spawn's resource tracker
        assert int(front) in processes and len(processes) >= 3, processes
        owner.kill()
        owner.wait()
        assert wait_until(lambda: not any(running(p) for p in processes), 60), \
            [p for p in processes if running(p)]
        assert not os.path.exists(endpoint[len("ipc://"):]), "the front did not stop cleanly"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()
        for pid in processes:  # survivors of a failed run, so that they do not outlive the tests
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_missing_repository_is_an_error_at_once_naming_the_folder(tmp_path):
    """Before any process starts: not a front that comes up empty, nor a wait for its start-up."""
    def fronts() -> set[int]:
        return {p for p in _descendants(os.getpid()) if b"gepool.pool" in open(f"/proc/{p}/cmdline", "rb").read()}

    before = fronts()
    missing = str(tmp_path / "no-such-models")
    (tmp_path / "a-file").write_text("")
    for path in (missing, str(tmp_path / "a-file")):
        with pytest.raises(FileNotFoundError, match=f"the model repository '{path}' is not a folder"):
            Pool(path)
        with pytest.raises(FileNotFoundError, match="is not a folder"):
            with Pool(path):
                pass
    assert fronts() == before, "a front was started for a repository that is not there"


def test_pool_keywords_are_its_options_and_readable_on_it(small_repo):
    from gepool.options import PoolOptions

    repo, _ = small_repo
    pool = Pool(repo, cpu_threads=2, exit_grace_s=0.5)
    assert isinstance(pool.options, PoolOptions) and pool.options.repository == repo
    assert (pool.cpu_threads, pool.exit_grace_s, pool.http_port, pool.log_level) == (2, 0.5, 0, logging.WARNING)
    assert pool.endpoint.startswith("ipc://") and pool.endpoint.endswith(".sock")  # one of its own
    assert not hasattr(pool, "no_such_option")
    with Pool(PoolOptions(repository=repo, cpu_threads=1)) as started:
        assert started.status["models"]["tiny"]["worker_threads"] == [1]
