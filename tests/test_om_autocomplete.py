"""Auto-complete of Ascend .om models from their pyACL description, against the stand-in in tests/standin."""

import json
import os

import numpy as np
import onnxruntime as ort
import pytest

from gepool import Pool
from gepool.common.errors import ConfigError
from gepool.common.render import render
from gepool.common.repository import load_source, model_config
from tests import ge_repo


@pytest.fixture
def standin(monkeypatch, tmp_path):
    report_dir = tmp_path / "acl-reports"
    report_dir.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ge_repo.STANDIN, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ACL_STANDIN_REPORT_DIR", str(report_dir))
    return str(report_dir)


def om_model(repo, name: str, **spec) -> str:
    """An .om (the stand-in's JSON) wrapping ge_repo's network, and no config.pbtxt."""
    version = os.path.join(repo, name, "1")
    os.makedirs(version)
    ge_repo.net(os.path.join(version, "net.onnx"))
    with open(os.path.join(version, "model.om"), "w") as f:
        json.dump({"onnx": "net.onnx", **spec}, f)
    return os.path.join(version, "net.onnx")


def released(report_dir: str) -> list[dict]:
    reps = ge_repo.reports(report_dir)
    assert reps and all(r["finalized"] and r["leaks"] == {} for r in reps), reps
    return reps


def test_an_om_with_gears_is_completed_from_its_description(standin, tmp_path):
    om_model(tmp_path, "net", gears=[1, 2, 4, 8])
    out = render(model_config(str(tmp_path / "net"), "net"))
    assert out["backend"] == "ge" and out["max_batch_size"] == 8  # the largest gear
    assert [(t["name"], t["data_type"], t["dims"]) for t in out["input"]] == [("input", "TYPE_FP32", [16])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in out["output"]] == [("output", "TYPE_FP32", [4])]
    assert "dynamic_batching" in out and out["instance_group"][0]["kind"] == "KIND_ASCEND"
    assert len(released(standin)) == 1  # the probe process let go of its device, context and model


def test_a_fixed_batch_om_is_unbatched_unless_the_config_says(standin, tmp_path):
    om_model(tmp_path, "fixed", batch=4)
    cfg = model_config(str(tmp_path / "fixed"), "fixed")
    assert cfg.max_batch_size == 0 and cfg.inputs[0].dims == (4, 16) and cfg.dynamic_batching is None
    (tmp_path / "fixed" / "config.pbtxt").write_text('backend: "ge"\nmax_batch_size: 4\n')
    cfg = model_config(str(tmp_path / "fixed"), "fixed")
    assert cfg.max_batch_size == 4 and cfg.inputs[0].dims == (16,) and cfg.dynamic_batching is not None


def test_without_pyacl_an_incomplete_om_config_says_what_is_missing(tmp_path):
    om_model(tmp_path, "net", gears=[1, 2])
    with pytest.raises(ConfigError, match="needs pyACL, which is not installed"):
        model_config(str(tmp_path / "net"), "net")


def test_a_model_pyacl_cannot_load_is_a_named_config_error(standin, tmp_path):
    om_model(tmp_path, "broken", gears=[1], fail_load=545001)
    src = load_source(str(tmp_path), "broken")
    assert src.config is None and "model 'broken': cannot auto-complete from the .om" in src.error
    assert "545001" in src.error


def test_a_pool_serves_a_config_less_om(standin, tmp_path):
    onnx_path = om_model(tmp_path, "net", gears=[1, 2, 4])
    with Pool(str(tmp_path)) as pool:
        assert pool.status["models"]["net"]["state"] == "READY", pool.status["models"]["net"]
        c = pool.client()
        cfg = c.query("config", {"model": "net"})
        assert cfg["max_batch_size"] == 4 and cfg["input"][0]["dims"] == [16]
        x = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
        got = c.infer("net", {"input": x})["output"]
        want = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
