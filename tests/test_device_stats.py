"""Live device gauges: each worker's DeviceStats reach the front's status and the gateway's /metrics."""

import json
import os
import signal
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gepool import Pool
from gepool.http.metrics import render
from gepool.ipc import protocol
from gepool.scheduler.states import WorkerState
from tests import ge_repo
from tests.conftest import free_port, wait_until
from tests.repo import make_models, write
from tests.test_core import Harness, echo_model

MIB = 1 << 20


def scrape(pool) -> dict[str, list]:
    """Family name -> its samples, from the pool's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{pool.metrics_port}/metrics", timeout=30).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, **labels) -> float | None:
    for s in families.get(name, []):
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


# -- the front's books, in-process -----------------------------------------------------------

def test_the_front_keeps_the_latest_sample_of_the_process_it_knows(tmp_path):
    echo_model(str(tmp_path))
    h = Harness(tmp_path)
    try:
        (w,) = h.out.spawned
        info = {"stats": {"rss_bytes": 5 * MIB, "cpu_seconds": 0.25}}
        h.core.on_worker_message(protocol.WorkerReady(w.id, protocol.PROTOCOL_VERSION, w.process.pid, info))
        h.tick()

        def devices():
            return h.core.status()["models"]["echo"]["devices"]

        assert devices() == [{"worker": w.id, "device": "cpu", "pid": w.process.pid, "rss_bytes": 5 * MIB,
                              "cpu_seconds": 0.25}]
        h.core.on_worker_message(protocol.DeviceStats(w.id, w.process.pid, {
            "rss_bytes": 7 * MIB, "cpu_seconds": 1.5, "memory_used_bytes": 3 * MIB, "memory_total_bytes": 8 * MIB,
            "utilization_ratio": 0.5, "health": "HEALTHY"}))
        (d,) = devices()
        assert (d["rss_bytes"], d["memory_used_bytes"], d["utilization_ratio"], d["health"]) == \
            (7 * MIB, 3 * MIB, 0.5, "HEALTHY")
        # a predecessor's late sample (another pid) is not this worker's
        h.core.on_worker_message(protocol.DeviceStats(w.id, w.process.pid + 1, {"rss_bytes": 1}))
        assert devices()[0]["rss_bytes"] == 7 * MIB
        # what is not a reading never reaches the status (and so never a Prometheus line)
        h.core.on_worker_message(protocol.DeviceStats(w.id, w.process.pid, {
            "rss_bytes": -1, "cpu_seconds": float("nan"), "utilization_ratio": 3.0, "health": "x\n}",
            "memory_used_bytes": "9", "evil": 1, "memory_total_bytes": 8 * MIB}))
        assert devices() == [{"worker": w.id, "device": "cpu", "pid": w.process.pid, "memory_total_bytes": 8 * MIB}]
        h.core.on_worker_message(protocol.DeviceStats(w.id, w.process.pid, "not a dict"))
        assert devices() == []
        h.core.on_worker_message(protocol.DeviceStats(w.id, w.process.pid, {"rss_bytes": MIB}))
        h.core.on_worker_exit(w, -9)
        assert w.state != WorkerState.READY and devices() == []  # a dead worker is not reported
        h.tick()
    finally:
        h.close()


def test_metrics_render_each_workers_readings_and_leave_out_what_it_lacks():
    status = {"models": {"net": {"version": 1, "queued": 0, "devices": [
        {"worker": 3, "device": "ascend:0", "pid": 10, "rss_bytes": 100, "cpu_seconds": 2.5,
         "memory_used_bytes": 300, "memory_total_bytes": 1000, "utilization_ratio": 0.37},
        {"worker": 4, "device": "cpu", "pid": 11, "rss_bytes": 200, "cpu_seconds": 1.0}]}}}
    text = render(status, {}).decode()
    lines = text.splitlines()
    for line in ('gepool_device_memory_used_bytes{device="ascend:0",model="net",worker="3"} 300.0',
                 'gepool_device_memory_total_bytes{device="ascend:0",model="net",worker="3"} 1000.0',
                 'gepool_device_utilization_ratio{device="ascend:0",model="net",worker="3"} 0.37',
                 'gepool_worker_resident_memory_bytes{device="ascend:0",model="net",worker="3"} 100.0',
                 'gepool_worker_resident_memory_bytes{device="cpu",model="net",worker="4"} 200.0',
                 'gepool_worker_cpu_seconds_total{device="cpu",model="net",worker="4"} 1.0'):
        assert line in lines, (line, text)
    assert not any(line.startswith("gepool_device_") and 'worker="4"' in line for line in lines), text


# -- real workers --------------------------------------------------------------------------------

@pytest.fixture
def standin(monkeypatch, tmp_path):
    """The stand-in `acl` on the workers' path, its reports collected, a control folder for what the
    device reports."""
    report_dir, control = tmp_path / "acl-reports", tmp_path / "control"
    report_dir.mkdir()
    control.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ge_repo.STANDIN, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ACL_STANDIN_REPORT_DIR", str(report_dir))
    monkeypatch.setenv("ACL_STANDIN_CONTROL_DIR", str(control))
    monkeypatch.setenv("ACL_STANDIN_DEVICE_MEMORY", str(256 * MIB))
    return control


def put(control, **values) -> None:
    tmp = control / "device0.json.tmp"
    tmp.write_text(json.dumps(values))
    os.replace(tmp, control / "device0.json")  # a reader never sees half a file


def test_npu_gauges_follow_what_the_device_reports(standin, tmp_path):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net", params={"memory_pool_size": "64M"})
    put(standin, cube=37, vector=12, status=0)
    with Pool(repo, metrics_port=free_port()) as pool:
        out = pool.client().infer("net", {"input": np.ones((2, 16), np.float32)})
        assert out["output"].shape == (2, 4)
        (d,) = pool.client().status()["models"]["net"]["devices"]
        assert d["device"] == "ascend:0" and d["health"] == "HEALTHY" and d["memory_total_bytes"] == 256 * MIB
        labels = {"model": "net", "device": "ascend:0", "worker": str(d["worker"])}
        first = scrape(pool)
        assert value(first, "gepool_device_utilization_ratio", **labels) == 0.37
        assert value(first, "gepool_device_memory_total_bytes", **labels) == 256 * MIB
        used = value(first, "gepool_device_memory_used_bytes", **labels)
        assert 0 < used < 256 * MIB
        assert value(first, "gepool_worker_resident_memory_bytes", **labels) > 0
        # another process takes 64 MiB of the device and the AI Core gets busier: the gauges move
        put(standin, cube=80, vector=5, status=0, other_bytes=64 * MIB)
        assert wait_until(lambda: value(scrape(pool), "gepool_device_utilization_ratio", **labels) == 0.8, 60, 0.25), \
            "the utilization gauge never moved"
        assert wait_until(lambda: value(scrape(pool), "gepool_device_memory_used_bytes", **labels)
                          == used + 64 * MIB, 60, 0.25)


def test_a_cpu_worker_reports_its_resident_memory_and_cpu_time(tmp_path):
    repo = str(tmp_path / "models")
    make_models.make_tiny(repo)
    with Pool(repo, metrics_port=free_port()) as pool:
        pool.client().infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})
        (d,) = pool.client().status()["models"]["tiny"]["devices"]
        labels = {"model": "tiny", "worker": str(d["worker"]), "device": d["device"]}
        families = scrape(pool)
        rss = value(families, "gepool_worker_resident_memory_bytes", **labels)
        assert rss is not None and rss > 10 * MIB  # onnxruntime and numpy are loaded in it
        assert value(families, "gepool_worker_cpu_seconds", **labels) > 0
        assert value(families, "gepool_device_memory_used_bytes", **labels) is None  # a CPU has no device memory


FAILS_ONCE_MARKED_PY = '''
import os

import numpy as np


class Model:
    def initialize(self, config):
        marker = config["parameters"]["marker"]
        if os.path.exists(marker):
            raise RuntimeError("cannot load again")

    def execute(self, inputs):
        return {"Y": np.asarray(inputs["X"], np.float32) * 2}
'''


def test_a_dead_workers_series_are_gone(tmp_path):
    repo, marker = str(tmp_path / "models"), str(tmp_path / "marker")
    write(f"{repo}/once/1/model.py", FAILS_ONCE_MARKED_PY)
    write(f"{repo}/once/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 4
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        parameters {{ key: "marker" value: {{ string_value: "{marker}" }} }}
    """)
    with Pool(repo, metrics_port=free_port()) as pool:
        c = pool.client()
        (d,) = c.status()["models"]["once"]["devices"]
        assert value(scrape(pool), "gepool_worker_resident_memory_bytes", model="once") is not None
        open(marker, "w").close()  # its replacement cannot load: the model stays without a ready worker
        os.kill(d["pid"], signal.SIGKILL)
        assert wait_until(lambda: c.status()["models"]["once"]["restarts"] >= 1, 60)
        assert c.status()["models"]["once"]["ready_workers"] == 0
        families = scrape(pool)
        for name in ("gepool_worker_resident_memory_bytes", "gepool_worker_cpu_seconds"):
            assert value(families, name, model="once") is None, families[name]
