"""End to end through a real pool: outputs equal onnxruntime run directly, for every example model."""

import os

import numpy as np
import onnxruntime as ort
import pytest

from gepool.common import errors

RNG = np.random.default_rng(7)


def direct(model_repo: str, name: str, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(os.path.join(model_repo, name, "1", "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["frames", "shm"])
@pytest.mark.parametrize("name, input_name, width, max_bs", [("tiny", "INPUT0", 16, 8), ("mlp", "INPUT", 1024, 32)])
@pytest.mark.parametrize("rows", ["1", "3", "max"])
def test_onnx_models_match_onnxruntime(pool, model_repo, shared_memory, name, input_name, width, max_bs, rows):
    n = max_bs if rows == "max" else int(rows)
    x = RNG.standard_normal((n, width)).astype(np.float32)
    with pool.client(shared_memory=shared_memory, arena_min_bytes=0) as c:
        out = c.infer(name, {input_name: x})
    (want,) = direct(model_repo, name, {input_name: x})
    (got,) = out.values()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_python_postprocess_matches_numpy(client, rows):
    logits = RNG.standard_normal((rows, 1000)).astype(np.float32)
    out = client.infer("postprocess", {"LOGITS": logits})
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out["PROBS"], z / z.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out["CLASS"][:, 0], logits.argmax(axis=1))
    assert out["CLASS"].dtype == np.int64


def test_multi_row_requests_batched_together_come_back_split(client, model_repo):
    sizes = [3, 1, 2, 2]  # 8 rows: the mlp's preferred size, so they are likely to share a batch
    xs = [RNG.standard_normal((n, 1024)).astype(np.float32) for n in sizes]
    futures = [client.infer_async("mlp", {"INPUT": x}) for x in xs]
    (want,) = direct(model_repo, "mlp", {"INPUT": np.concatenate(xs)})
    row = 0
    for n, fut in zip(sizes, futures):
        got = fut.result(timeout=60)["LOGITS"]
        assert got.shape == (n, 1000)
        np.testing.assert_allclose(got, want[row:row + n], rtol=1e-4, atol=1e-4)
        row += n


def test_requested_outputs_only(client):
    out = client.infer("postprocess", {"LOGITS": np.zeros((2, 1000), np.float32)}, outputs=["CLASS"])
    assert list(out) == ["CLASS"]


def test_metadata_and_status(client):
    meta = client.model_metadata("mlp")
    assert meta["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 1024]}]
    assert meta["outputs"] == [{"name": "LOGITS", "datatype": "FP32", "shape": [-1, 1000]}]
    assert meta["versions"] == ["1"] and meta["max_batch_size"] == 32
    models = client.status()["models"]
    assert models["tiny"]["state"] == "READY"
    assert models["cannot_load"]["state"] == "UNAVAILABLE"
    assert "weights are missing" in models["cannot_load"]["reason"]
    assert models["bad_config"]["state"] == "UNAVAILABLE"
    reason = models["bad_config"]["reason"]
    assert "config.pbtxt:5:" in reason and "preferred_batch_size" in reason


def test_a_model_that_cannot_load_is_refused_with_its_reason(client):
    with pytest.raises(errors.ModelNotReady, match="weights are missing"):
        client.infer("cannot_load", {"X": np.zeros((1, 1), np.float32)})
    assert client.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})["OUTPUT0"][0, 0] == 3.0


def test_explicit_version(client):
    x = np.ones((1, 16), np.float32)
    assert client.infer("tiny", {"INPUT0": x}, version=1)["OUTPUT0"][0, 0] == 3.0
    with pytest.raises(errors.ModelNotFound, match="no version 2"):
        client.infer("tiny", {"INPUT0": x}, version=2)


def test_model_fault_fails_its_batch_and_the_pool_serves_on(client):
    with pytest.raises(errors.ModelError, match="asked to fail"):
        client.infer("lone", {"INPUT": np.full((1, 4), -7, np.float32)})
    out = client.infer("lone", {"INPUT": np.ones((1, 4), np.float32)})
    np.testing.assert_array_equal(out["OUTPUT"], np.ones((1, 4)))


async def _async_many(endpoint: str, shared_memory: bool):
    import asyncio

    from gepool import AsyncClient

    async with AsyncClient(endpoint, shared_memory=shared_memory, arena_min_bytes=0) as c:
        xs = [np.full((1, 16), i, np.float32) for i in range(50)]
        outs = await asyncio.gather(*(c.infer("tiny", {"INPUT0": x}) for x in xs))
        return [o["OUTPUT0"][0, 0] for o in outs]


@pytest.mark.parametrize("shared_memory", [False, True], ids=["frames", "shm"])
def test_async_client_many_in_flight(pool, shared_memory):
    import asyncio

    got = asyncio.run(_async_many(pool.endpoint, shared_memory))
    assert got == [2 * i + 1 for i in range(50)]
