"""The ge backend where real Ascend hosts differ from the default stand-in: Ascend 310 waits, board run mode,
non-batch dynamic modes, teardown with work in flight, an aborted context, and the device's health."""

import json
import os

import numpy as np
import onnxruntime as ort
import pytest

from gepool import Pool
from gepool.common import errors
from tests import ge_repo
from tests.conftest import wait_until

RNG = np.random.default_rng(21)


@pytest.fixture
def standin(monkeypatch, tmp_path):
    report_dir = tmp_path / "acl-reports"
    report_dir.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ge_repo.STANDIN, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ACL_STANDIN_REPORT_DIR", str(report_dir))
    return str(report_dir)


def direct(onnx_path: str, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def clean(report_dir: str) -> list[dict]:
    reps = ge_repo.reports(report_dir)
    assert reps
    for r in reps:
        assert r["finalized"] and r["leaks"] == {}, r
        assert r["released_while_queued"] == 0 and r["busy_stream_destroys"] == 0, r
    return reps


def serves(c, name: str, onnx_path: str, rows=(1, 3, 8)) -> None:
    for n in rows:
        x = RNG.standard_normal((n, 16)).astype(np.float32)
        np.testing.assert_allclose(c.infer(name, {"input": x})["output"], direct(onnx_path, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("env", [{"ACL_STANDIN_SOC": "Ascend310"},
                                 {"ACL_STANDIN_ABSENT": "rt.synchronize_event_with_timeout"}],
                         ids=["ascend310", "no-timed-wait"])
def test_untimed_waits_serve_and_keep_the_execution_timeout(standin, tmp_path, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    repo = str(tmp_path / "models")
    onnx_path = ge_repo.ge_model(repo, "net", faults={"hang_on_value": -9}, params={"execution_timeout_ms": "500"})
    with Pool(repo) as pool:
        c = pool.client()
        assert pool.status["models"]["net"]["state"] == "READY"
        serves(c, "net", onnx_path)
        old = c.status()["models"]["net"]["worker_pids"]
        with pytest.raises((errors.ModelError, errors.WorkerDied), match="execution_timeout_ms|died"):
            c.infer("net", {"input": np.full((1, 16), -9, np.float32)}, timeout=60)
        assert wait_until(lambda: c.status()["models"]["net"]["worker_pids"] not in ([], old), 60)
        serves(c, "net", onnx_path, rows=(2,))


def test_board_run_mode_aligns_its_copies(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("ACL_STANDIN_RUN_MODE", "device")
    repo = str(tmp_path / "models")
    onnx_path = ge_repo.ge_model(repo, "net")
    with Pool(repo) as pool:
        assert pool.status["models"]["net"]["state"] == "READY", pool.status["models"]["net"]
        serves(pool.client(), "net", onnx_path)
    clean(standin)


@pytest.mark.parametrize("om, mode", [({"hw_gears": [[224, 224], [448, 448]]}, "dynamic image size"),
                                      ({"dims_gears": [[1, 16], [2, 16]]}, "dynamic dims")])
def test_a_non_batch_dynamic_model_is_refused_naming_its_mode(standin, tmp_path, om, mode):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net", gears=(), batch=8, faults=om)
    with Pool(repo) as pool:
        reason = pool.status["models"]["net"]["reason"]
    assert mode in reason and "--dynamic_batch_size" in reason, reason
    clean(standin)


def test_an_aborted_context_replaces_the_worker(standin, tmp_path):
    repo = str(tmp_path / "models")
    onnx_path = ge_repo.ge_model(repo, "net", faults={"abort_on_value": -5})
    with Pool(repo) as pool:
        c = pool.client()
        old = c.status()["models"]["net"]["worker_pids"]
        with pytest.raises((errors.ModelError, errors.WorkerDied), match="507015|died"):
            c.infer("net", {"input": np.full((2, 16), -5, np.float32)}, timeout=60)
        assert wait_until(lambda: c.status()["models"]["net"]["worker_pids"] not in ([], old), 60)
        serves(c, "net", onnx_path, rows=(2, 5))


def test_an_abnormal_device_status_restarts_its_worker(standin, tmp_path, monkeypatch):
    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setenv("ACL_STANDIN_CONTROL_DIR", str(control))
    repo = str(tmp_path / "models")
    onnx_path = ge_repo.ge_model(repo, "net")
    with Pool(repo) as pool:
        c = pool.client()
        old = c.status()["models"]["net"]["worker_pids"]
        serves(c, "net", onnx_path, rows=(1,))
        (control / "device0.json").write_text(json.dumps({"status": 1}))
        assert wait_until(lambda: c.status()["models"]["net"]["worker_pids"] != old, 60)
        (control / "device0.json").write_text(json.dumps({"status": 0}))
        assert wait_until(lambda: c.status()["models"]["net"]["state"] == "READY"
                          and c.status()["models"]["net"]["worker_pids"] not in ([], old), 60)
        serves(c, "net", onnx_path, rows=(3,))


STALLED_AT_CLOSE = r'''
import json, sys
import numpy as np
import ascend_check
from gepool.common.config import parse_config
from gepool.workers.backends.ge import GeBackend
folder = sys.argv[1]
if sys.argv[2] == "no-drain":
    GeBackend._drain = lambda self: set()  # the close() of before: release whatever is still queued
config = parse_config(folder + "/config.pbtxt", "net")
h = ascend_check.Harness(config, folder + "/1", "ascend:0")
idx = h.submit([np.ones((4, 16), np.float32)])
got = h.wait(2)  # the batch fails at the timeout, then the device is reported lost; the stream still runs
_, error = h.result(idx)
try:
    h.close()
except Exception as exc:  # the close() of before fails part-way once the stand-in refuses a release
    import acl
    acl.finalize()  # writes the stand-in's report
    error += f" | close: {exc}"
print(json.dumps({"got": got, "error": error, "lost": h.lost}))
'''


@pytest.mark.parametrize("drain", [True, False], ids=["close", "close-without-drain"])
def test_close_drains_a_stalled_stream_before_releasing(standin, tmp_path, drain):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net", stream_num=1, faults={"exec_delay_ms": 1500},
                     params={"execution_timeout_ms": "300"})
    out = ge_repo.run_script(STALLED_AT_CLOSE, os.path.join(repo, "net"), "drain" if drain else "no-drain",
                             env={"ACL_STANDIN_REPORT_DIR": standin})
    assert -1 in out["got"] and "execution_timeout_ms" in out["error"] and out["lost"], out
    (report,) = ge_repo.reports(standin)
    if drain:  # released only once the stalled stream ran out: nothing freed under a queued task
        assert report["finalized"] and report["leaks"] == {}, report
        assert report["released_while_queued"] == 0 and report["busy_stream_destroys"] == 0, report
    else:  # what the stand-in catches when close() does not synchronize first
        assert report["released_while_queued"] > 0 and report["busy_stream_destroys"] > 0, report


DEVICE_STATUS = r'''
import json, os, sys
import numpy as np
import ascend_check
from gepool.common.config import parse_config
folder, control = sys.argv[1], sys.argv[2]
def put(**values):
    with open(os.path.join(control, "device0.json"), "w") as f:
        json.dump(values, f)
put(cube=37, vector=12, status=0)
config = parse_config(folder + "/config.pbtxt", "net")
h = ascend_check.Harness(config, folder + "/1", "ascend:0")
out = {"ready": h.backend.info["device"], "first": h.backend.device_status()}
put(cube=80, vector=5, status=0)
out["second"] = h.backend.device_status()
put(cube=80, status=1)
got = h.wait(1, timeout_s=30)  # the health thread reports the device lost
out["got"], out["lost"], out["third"] = got, h.lost, h.backend.device_status()
h.close()
print(json.dumps(out))
'''


def test_device_status_follows_what_the_device_reports(standin, tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net", params={"memory_pool_size": "64M"})
    out = ge_repo.run_script(DEVICE_STATUS, os.path.join(repo, "net"), str(control),
                             env={"ACL_STANDIN_REPORT_DIR": standin, "ACL_STANDIN_CONTROL_DIR": str(control),
                                  "ACL_STANDIN_DEVICE_MEMORY": str(1 << 28)})
    first, second, third = out["first"], out["second"], out["third"]
    assert first["utilization_ratio"] == 0.37 and first["utilization"]["vector"] == 0.12, first
    assert second["utilization_ratio"] == 0.8 and second["utilization"]["vector"] == 0.05, second
    assert first["memory_total_bytes"] == 1 << 28 and 0 < first["memory_used_bytes"] < 1 << 28, first
    assert out["ready"]["memory_used_bytes"] == first["memory_used_bytes"], out
    assert first["health"] == second["health"] == "HEALTHY"
    assert out["got"] == [-1] and "abnormal" in out["lost"][0] and third["health"] == "LOST", out


ABSENT = r'''
import json, sys
import ascend_check
from gepool.common.config import parse_config
config = parse_config(sys.argv[1] + "/config.pbtxt", "net")
h = ascend_check.Harness(config, sys.argv[1] + "/1", "ascend:0")
status = h.backend.device_status()
h.close()
print(json.dumps(status))
'''


def test_device_calls_a_release_lacks_are_absent_not_zero(standin, tmp_path):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net")
    absent = "rt.get_device_utilization_rate,rt.query_device_status"
    status = ge_repo.run_script(ABSENT, os.path.join(repo, "net"),
                                env={"ACL_STANDIN_REPORT_DIR": standin, "ACL_STANDIN_ABSENT": absent})
    assert "utilization_ratio" not in status and "utilization" not in status and "health" not in status, status
    assert status["memory_total_bytes"] > 0, status
    clean(standin)
