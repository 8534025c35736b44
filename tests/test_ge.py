"""The GE (Ascend) backend end to end, against the pyACL stand-in in tests/standin."""

import os
import signal

import numpy as np
import onnxruntime as ort
import pytest

from gepool import Client, Pool
from gepool.common import errors
from tests import ge_repo
from tests.conftest import wait_until
from tests.repo import make_models

RNG = np.random.default_rng(11)


@pytest.fixture
def standin(monkeypatch, tmp_path):
    """Puts the stand-in `acl` on the workers' path and collects its per-process reports."""
    report_dir = tmp_path / "acl-reports"
    report_dir.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ge_repo.STANDIN, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ACL_STANDIN_REPORT_DIR", str(report_dir))
    return str(report_dir)


def direct(onnx_path: str, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def no_leaks(report_dir: str, expect: int) -> list[dict]:
    reps = ge_repo.reports(report_dir)
    assert len(reps) == expect, reps
    for r in reps:
        assert r["finalized"] and r["leaks"] == {}, r
        assert r["unpinned_async_copies"] == 0, r
    return reps


def test_serves_gears_hit_and_missed_and_releases_everything(standin, tmp_path):
    repo = str(tmp_path / "models")
    onnx_path = ge_repo.ge_model(repo, "net", gears=(1, 2, 4, 8), devices=(0, 1), faults={"fail_on_value": -7})
    fixed = ge_repo.ge_model(repo, "fixed", gears=(), batch=4, max_batch=4)
    ge_repo.ge_model(repo, "badload", faults={"fail_load": 545001})
    ge_repo.ge_model(repo, "overcap", params={"memory_pool_size": "1K"})
    make_models.make_tiny(repo)
    with Pool(repo) as pool:
        models = pool.status["models"]
        assert models["net"]["state"] == "READY" and models["net"]["workers"] == 2
        assert "acl.mdl.load_from_file failed with 545001 (ACL_ERROR_GE_LOAD_MODEL)" in models["badload"]["reason"]
        assert "memory_pool_size" in models["overcap"]["reason"]
        c = pool.client()
        for rows in (1, 3, 8):  # 3 misses a gear: padded to 4, sliced back
            x = RNG.standard_normal((rows, 16)).astype(np.float32)
            np.testing.assert_allclose(c.infer("net", {"input": x})["output"], direct(onnx_path, x), rtol=1e-5,
                                       atol=1e-5)
        x = RNG.standard_normal((3, 16)).astype(np.float32)
        np.testing.assert_allclose(c.infer("fixed", {"input": x})["output"], direct(fixed, x), rtol=1e-5, atol=1e-5)
        # a failed execute fails its batch with the ACL error; the next batch succeeds
        with pytest.raises(errors.ModelError, match="507011"):
            c.infer("net", {"input": np.full((2, 16), -7, np.float32)})
        x = RNG.standard_normal((2, 16)).astype(np.float32)
        np.testing.assert_allclose(c.infer("net", {"input": x})["output"], direct(onnx_path, x), rtol=1e-5,
                                   atol=1e-5)
        assert c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})["OUTPUT0"][0, 0] == 3.0
    no_leaks(standin, expect=5)  # net on two devices, fixed, and the two failed loads: all released


def test_gears_become_the_preferred_batch_sizes(standin, tmp_path):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net", gears=(4, 8), max_batch=8, delay_us=10_000_000)
    with Pool(repo) as pool:
        c = pool.client()
        futures = [c.infer_async("net", {"input": np.ones((1, 16), np.float32)}) for _ in range(4)]
        for f in futures:  # four singles reach gear 4 (a preferred size now) instead of waiting out a 10 s delay
            f.result(timeout=60)
        assert c.stats()["net"]["batch_sizes"] == {4: 1}


@pytest.mark.parametrize("stream_num", [1, 3])
def test_stream_num_batches_in_flight(standin, tmp_path, stream_num):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "slow", stream_num=stream_num, faults={"exec_delay_ms": 300})
    with Pool(repo) as pool:
        c = pool.client()
        futures = [c.infer_async("slow", {"input": np.full((8, 16), i, np.float32)}) for i in range(4)]
        for f in futures:
            f.result(timeout=120)
        assert c.stats()["slow"]["batch_sizes"] == {8: 4}
    (report,) = no_leaks(standin, expect=1)
    assert report["max_concurrent_executes"] == stream_num
    assert report["executes"] == 4


def test_two_devices_share_the_load(standin, tmp_path):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net", devices=(0, 1), stream_num=1, faults={"exec_delay_ms": 50})
    with Pool(repo) as pool:
        c = pool.client()
        futures = [c.infer_async("net", {"input": np.full((8, 16), i, np.float32)}) for i in range(12)]
        for f in futures:
            f.result(timeout=120)
    per_device = [sum(r["executes_per_device"][d] for r in no_leaks(standin, expect=2)) for d in (0, 1)]
    assert sum(per_device) == 12 and min(per_device) >= 3, per_device


def test_hung_device_fails_its_batch_and_the_worker_is_replaced(standin, tmp_path):
    repo = str(tmp_path / "models")
    onnx_path = ge_repo.ge_model(repo, "net", faults={"hang_on_value": -9},
                                 params={"execution_timeout_ms": "500"})
    make_models.make_tiny(repo)
    with Pool(repo) as pool:
        c = pool.client()
        old = c.status()["models"]["net"]["worker_pids"]
        with pytest.raises((errors.ModelError, errors.WorkerDied), match="stopped answering|died"):
            c.infer("net", {"input": np.full((1, 16), -9, np.float32)}, timeout=60)
        assert c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})["OUTPUT0"][0, 0] == 3.0
        assert wait_until(lambda: c.status()["models"]["net"]["worker_pids"] not in ([], old), 60)
        x = RNG.standard_normal((2, 16)).astype(np.float32)
        np.testing.assert_allclose(c.infer("net", {"input": x})["output"], direct(onnx_path, x), rtol=1e-5,
                                   atol=1e-5)


def test_without_pyacl_a_ge_model_is_unavailable_and_others_serve(tmp_path, monkeypatch):
    monkeypatch.delenv("ACL_STANDIN_REPORT_DIR", raising=False)
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net")
    make_models.make_tiny(repo)
    with Pool(repo) as pool:
        reason = pool.status["models"]["net"]["reason"]
        assert "pyACL" in reason and "was not found" in reason and "pip install acl" in reason
        c = pool.client()
        with pytest.raises(errors.ModelNotReady, match="pyACL"):
            c.infer("net", {"input": np.ones((1, 16), np.float32)})
        assert c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})["OUTPUT0"][0, 0] == 3.0


def test_sigterm_under_load_answers_and_releases(standin, tmp_path):
    repo = str(tmp_path / "models")
    ge_repo.ge_model(repo, "net", stream_num=2, faults={"exec_delay_ms": 100})
    pool = Pool(repo).start()
    try:
        with Client(pool.endpoint) as c:
            futures = [c.infer_async("net", {"input": np.full((8, 16), i, np.float32)}) for i in range(6)]
            assert wait_until(lambda: c.stats()["net"]["batches"] >= 1)
            pool.process.send_signal(signal.SIGTERM)
            for f in futures:
                assert f.result(timeout=60)["output"].shape == (8, 4)
        assert pool.process.wait(60) == 0
    finally:
        pool.stop()
    no_leaks(standin, expect=1)
