"""Model lifecycle under load: reloads, config changes, unloads and failed loads lose no request."""

import os
import shutil
import threading
import time

import numpy as np
import pytest

from gepool import Client, Pool
from gepool.common import errors
from tests.conftest import rss_kb, wait_until
from tests.repo import ADD_PY, write

BROKEN_PY = '''
class Model:
    def initialize(self, config):
        raise RuntimeError("version 3 is broken")

    def execute(self, inputs):
        return {}
'''


def versioned(repo: str, name: str, versions=(1,), policy: str = "", extra: str = "", delay_us: int = 500) -> None:
    for v in versions:
        write(f"{repo}/{name}/{v}/model.py", ADD_PY)
    write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
        {policy}
        {extra}
    """)


class Load:
    """Threads sending requests to one model, recording which version answered each (x + version)."""

    def __init__(self, endpoint: str, model: str, threads: int = 3) -> None:
        self.model, self.stop = model, threading.Event()
        self.versions: list[float] = []
        self.errors: list[str] = []
        self.client = Client(endpoint, timeout=60)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        x = np.full((1, 2), 10 * i, np.float32)
        while not self.stop.is_set():
            try:
                out = self.client.infer(self.model, {"INPUT": x})["OUTPUT"]
                self.versions.append(float(out[0, 0] - x[0, 0]))
            except errors.GepoolError as exc:
                self.errors.append(str(exc))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.client.close()


def test_reload_config_change_unload_and_failed_load_under_load(tmp_path):
    repo = str(tmp_path)
    versioned(repo, "a")
    versioned(repo, "b")
    with Pool(repo, model_control_mode="explicit", load_models=("a", "b")) as pool:
        c = pool.client()
        load_a, load_b = Load(pool.endpoint, "a"), Load(pool.endpoint, "b", threads=1)
        try:
            assert wait_until(lambda: len(load_a.versions) > 50)
            versioned(repo, "a", versions=(2,))  # a new version directory
            assert c.load("a")["versions"] == [2]
            n = len(load_a.versions)
            assert wait_until(lambda: len(load_a.versions) > n + 50)
            assert wait_until(lambda: load_a.versions[-1] == 2.0)  # a thread's answer from before may come last
            versioned(repo, "a", versions=(), delay_us=2000)  # a config change
            c.load("a")
            n = len(load_a.versions)
            c.unload("b")
            with pytest.raises(errors.ModelNotFound):
                c.infer("b", {"INPUT": np.zeros((1, 2), np.float32)})
            write(f"{repo}/a/3/model.py", BROKEN_PY)  # a failed load keeps version 2 serving
            with pytest.raises(errors.ModelNotReady, match="version 3 is broken"):
                c.load("a")
            assert wait_until(lambda: len(load_a.versions) > n + 50)
        finally:
            load_a.finish()
            load_b.finish()
        assert load_a.errors == [], load_a.errors[:5]
        assert set(load_a.versions) <= {1.0, 2.0} and load_a.versions[-1] == 2.0
        assert load_a.versions.index(2.0) > 0 and 1.0 not in load_a.versions[load_a.versions.index(2.0) + 100:]
        assert all("unknown model" in e for e in load_b.errors)  # only what was addressed to the unloaded one
        status = c.status()["models"]
        assert "b" not in status and status["a"]["versions"] == {"2": "READY"}
        assert "version 3 is broken" in status["a"]["reason"] or status["a"]["state"] == "READY"


def test_poll_mode_follows_the_repository(tmp_path):
    repo = str(tmp_path)
    versioned(repo, "a")
    versioned(repo, "gone")
    with Pool(repo, model_control_mode="poll", poll_secs=0.3) as pool:
        c = pool.client()
        x = np.zeros((1, 2), np.float32)
        assert c.infer("a", {"INPUT": x})["OUTPUT"][0, 0] == 1.0
        versioned(repo, "a", versions=(2,))
        assert wait_until(lambda: c.status()["models"]["a"]["versions"] == {"2": "READY"}, 60)
        assert c.infer("a", {"INPUT": x})["OUTPUT"][0, 0] == 2.0
        shutil.rmtree(f"{repo}/a/2")  # a deleted version: back to version 1
        assert wait_until(lambda: c.status()["models"]["a"]["versions"] == {"1": "READY"}, 60)
        shutil.rmtree(f"{repo}/gone")
        assert wait_until(lambda: "gone" not in c.status()["models"], 60)
        with pytest.raises(errors.Unavailable, match="POLL"):
            c.load("a")


def test_explicit_mode_ignores_the_repository_until_told(tmp_path):
    repo = str(tmp_path)
    versioned(repo, "a")
    versioned(repo, "b")
    with Pool(repo, model_control_mode="explicit", load_models=("a",)) as pool:
        c = pool.client()
        assert set(c.status()["models"]) == {"a"}
        with pytest.raises(errors.ModelNotFound):
            c.infer("b", {"INPUT": np.zeros((1, 2), np.float32)})
        c.load("b")
        assert c.infer("b", {"INPUT": np.zeros((1, 2), np.float32)})["OUTPUT"][0, 0] == 1.0
        with pytest.raises(errors.InvalidArgument, match="plain directory name"):
            c.load("../etc")
    with Pool(repo) as pool:  # mode none
        with pytest.raises(errors.Unavailable, match="NONE"):
            pool.client().load("a")


def test_versions_and_traffic_split(tmp_path):
    repo = str(tmp_path)
    versioned(repo, "a", versions=(1, 2), policy="version_policy { all { } }",
              extra='parameters { key: "traffic_split" value: { string_value: "1:90,2:10" } }')
    with Pool(repo) as pool:
        c = pool.client()
        x = np.zeros((1, 2), np.float32)
        assert c.infer("a", {"INPUT": x}, version=1)["OUTPUT"][0, 0] == 1.0
        assert c.infer("a", {"INPUT": x}, version=2)["OUTPUT"][0, 0] == 2.0
        assert c.model_metadata("a")["versions"] == ["1", "2"]
        futures = [c.infer_async("a", {"INPUT": x}) for _ in range(2000)]
        answers = [f.result(timeout=120) for f in futures]
        got = [out["OUTPUT"][0, 0] for out in answers]
        # each answer names the version that ran it (this model adds its version to the input)
        assert [float(out.model_version) for out in answers] == got
        share = got.count(2.0) / len(got)
        assert 0.06 < share < 0.14, share  # 10% asked; generous bounds over 2,000 draws
        stats = c.stats()["a"]
        assert stats["version_requests"]["2"] >= got.count(2.0)
        assert stats["versions"]["2"]["requests"] >= got.count(2.0)  # per-version stats, to compare the two
        assert stats["versions"]["1"]["requests"] + stats["versions"]["2"]["requests"] == stats["requests"]


def test_load_unload_cycles_stay_flat(tmp_path):
    from gepool.ipc import naming

    repo = str(tmp_path)
    versioned(repo, "a")
    versioned(repo, "b")
    with Pool(repo, model_control_mode="explicit", load_models=("a",)) as pool:
        c = pool.client()
        front = c.status()["pid"]
        figures = []
        for i in range(20):
            c.load("b")
            assert c.infer("b", {"INPUT": np.zeros((1, 2), np.float32)})["OUTPUT"][0, 0] == 1.0
            c.unload("b")
            assert wait_until(lambda: "b" not in c.status()["models"], 30)
            if i in (1, 19):
                time.sleep(0.2)
                figures.append((rss_kb(front), len(os.listdir(f"/proc/{front}/fd")), len(naming.list_segments())))
        print(f"load/unload x20: front RSS, fds, segments after cycle 2: {figures[0]}, after cycle 20: {figures[1]}")
        # file descriptors do not grow with cycles (a worker's last sockets may still be closing)
        assert figures[1][1] <= figures[0][1] + 2 or wait_until(
            lambda: len(os.listdir(f"/proc/{front}/fd")) <= figures[0][1] + 2, 10)
        assert figures[1][0] - figures[0][0] < 16 * 1024  # nor does memory (kB)
