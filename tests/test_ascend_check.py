"""tools/ascend_check.py against the pyACL stand-in: a good model passes every check, a wrong reference fails."""

import json
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from tests import ge_repo

CHECKS = ("load", "gear 1", "gear 2", "padding 3 -> 4", "gear 4", "gear 8", "padding 7 -> 8", "streams",
          "device status", "teardown in flight", "execution timeout")


def make(tmp_path, wrong: bool = False) -> list[str]:
    ge_repo.net(str(tmp_path / "net.onnx"))
    om = tmp_path / "model.om"
    om.write_text(json.dumps({"onnx": "net.onnx", "gears": [1, 2, 4, 8], "exec_delay_ms": 20}))
    x = np.random.default_rng(3).standard_normal((8, 16)).astype(np.float32)
    y = ort.InferenceSession(str(tmp_path / "net.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    if wrong:
        y[5] += 1.0  # only batches holding row 5 differ
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return ["--om", str(om), "--input", str(tmp_path / "x.npy"), "--reference", str(tmp_path / "y.npy"),
            "--json", str(tmp_path / "report.json")]


def check(tmp_path, args: list[str], env: dict) -> tuple[int, str, dict]:
    reports = tmp_path / "acl-reports"
    reports.mkdir(exist_ok=True)
    full = dict(os.environ, PYTHONPATH=ge_repo.STANDIN, ACL_STANDIN_REPORT_DIR=str(reports), **env)
    proc = subprocess.run([sys.executable, os.path.join(ge_repo.TOOLS, "ascend_check.py"), *args],
                          capture_output=True, text=True, env=full, timeout=300, cwd=str(tmp_path))
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    for r in ge_repo.reports(str(reports)):  # every phase released everything, nothing under a queued task
        assert r["finalized"] and r["leaks"] == {} and r["released_while_queued"] == 0, r
    return proc.returncode, proc.stdout, json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize("env", [{}, {"ACL_STANDIN_SOC": "Ascend310"}, {"ACL_STANDIN_RUN_MODE": "device"}],
                         ids=["910", "310", "board"])
def test_a_good_model_passes_every_check(tmp_path, env):
    rc, out, report = check(tmp_path, make(tmp_path), env)
    assert rc == 0, out
    assert {c["check"]: c["status"] for c in report["checks"]} == dict.fromkeys(CHECKS, "PASS"), out
    assert "RESULT: 11 passed, 0 failed, 0 skipped" in out
    assert ("timed event waits no" in out) == (env.get("ACL_STANDIN_SOC") == "Ascend310"), out
    assert ("run mode ACL_DEVICE" in out) == ("ACL_STANDIN_RUN_MODE" in env), out


def test_a_wrong_reference_fails_the_batches_that_hold_it(tmp_path):
    rc, out, report = check(tmp_path, make(tmp_path, wrong=True), {})
    status = {c["check"]: c["status"] for c in report["checks"]}
    assert rc == 1, out
    assert status["gear 8"] == status["padding 7 -> 8"] == status["streams"] == "FAIL", out
    assert status["gear 4"] == status["gear 1"] == "PASS", out
    assert "max |diff|" in out
