"""The response cache: LRU by bytes, then through a real pool (library client and tritonclient HTTP): a
repeated request is answered by the front without a worker, what differs misses, the size stays bounded,
and a model without response_cache never caches."""

import os

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.scheduler.cache import ENTRY_OVERHEAD_BYTES, ResponseCache, parse_cache_config
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

CACHE_BYTES = 256 << 10
WIDE = 8192  # FP32 per row: 32 KiB in, 32 KiB out (a request that travels through an arena)
ENABLE = "response_cache { enable: true }\n"


# -- the cache alone -----------------------------------------------------------------------
def test_lru_by_bytes_never_exceeds_its_size():
    cache = ResponseCache(3 * (100 + ENTRY_OVERHEAD_BYTES))
    for k in (b"a", b"b", b"c"):
        assert cache.put(k, [], [b"x" * 100], 1)
    assert cache.get(b"a") is not None  # a is now the most recently used
    assert cache.put(b"d", [], [b"x" * 100], 1)
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"d") is not None
    assert cache.used <= cache.capacity and cache.evictions == 1
    assert not cache.put(b"big", [], [b"x" * cache.capacity], 1)  # cannot fit at all: nothing evicted for it
    assert len(cache.entries) == 3 and cache.used == 3 * (100 + ENTRY_OVERHEAD_BYTES)
    assert cache.as_dict()["hits"] == 3 and cache.as_dict()["misses"] == 1


def test_cache_config_takes_triton_local_form():
    assert parse_cache_config("local,size=1048576") == 1 << 20
    for bad in ("redis,host=x", "local", "local,size=1M", "local,count=3"):
        with pytest.raises(ValueError, match="cache-config"):
            parse_cache_config(bad)


# -- through a pool ------------------------------------------------------------------------
def _enable(repo: str, name: str) -> None:
    with open(os.path.join(repo, name, "config.pbtxt"), "a") as f:
        f.write(ENABLE)


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache-gate") / "gate")


@pytest.fixture(scope="module")
def cache_pool(tmp_path_factory, gate):
    repo = str(tmp_path_factory.mktemp("cache-models"))
    test_repo.make_models.make_tiny(repo, "cached")
    _enable(repo, "cached")
    test_repo.make_models.make_tiny(repo, "plain")
    test_repo.make_models.make_tiny(repo, "wide", width=WIDE, max_batch=2)
    _enable(repo, "wide")
    test_repo.recorder(repo, "rec", preferred="4", delay_us=0, gate=gate, extra=ENABLE)
    with Pool(repo, cache_size=CACHE_BYTES, http_port=free_port()) as pool:
        yield pool


@pytest.fixture(scope="module")
def lib(cache_pool):
    return cache_pool.client()


def _stats(client, model: str) -> dict:
    return client.stats()[model]


def test_a_repeated_request_is_answered_from_the_cache(lib):
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 7
    before = _stats(lib, "cached")
    first = lib.infer("cached", {"INPUT0": x})["OUTPUT0"]
    second = lib.infer("cached", {"INPUT0": x})["OUTPUT0"]
    np.testing.assert_array_equal(first, x * 2 + 1)
    np.testing.assert_array_equal(second, first)
    after = _stats(lib, "cached")
    assert after["batches"] == before["batches"] + 1  # the worker ran it once
    assert after["rows"] == before["rows"] + 2  # a hit is no inference (Triton's inference_count)
    assert after["requests"] == before["requests"] + 2  # but a success
    assert after["cache_hit"]["count"] == before["cache_hit"]["count"] + 1
    assert after["cache_miss"]["count"] == before["cache_miss"]["count"] + 1
    assert after["cache_hit"]["ns"] > before["cache_hit"]["ns"]
    assert after["cache_miss"]["ns"] > before["cache_miss"]["ns"]


def test_different_inputs_shapes_and_outputs_miss(lib):
    x = np.full((1, 16), 3.5, np.float32)
    lib.infer("cached", {"INPUT0": x})
    before = _stats(lib, "cached")
    y = x.copy()
    y[0, 15] = 3.25
    np.testing.assert_array_equal(lib.infer("cached", {"INPUT0": y})["OUTPUT0"], y * 2 + 1)
    np.testing.assert_array_equal(lib.infer("cached", {"INPUT0": np.repeat(x, 2, 0)})["OUTPUT0"],
                                  np.repeat(x, 2, 0) * 2 + 1)
    after = _stats(lib, "cached")
    assert after["cache_hit"]["count"] == before["cache_hit"]["count"]
    assert after["batches"] == before["batches"] + 2
    # the requested outputs are part of the key: all outputs, then one of them, then that one again
    r = np.full((1, 4), 1.5, np.float32)
    assert set(lib.infer("rec", {"INPUT": r})) == {"OUTPUT", "BATCH"}
    only = lib.infer("rec", {"INPUT": r}, ["OUTPUT"])
    assert set(only) == {"OUTPUT"}
    assert set(lib.infer("rec", {"INPUT": r}, ["OUTPUT"])) == {"OUTPUT"}
    rec = _stats(lib, "rec")
    assert rec["cache_miss"]["count"] == 2 and rec["cache_hit"]["count"] == 1 and rec["batches"] == 2


def test_a_model_without_response_cache_never_caches(lib):
    x = np.ones((1, 16), np.float32)
    before = _stats(lib, "plain")
    for _ in range(3):
        np.testing.assert_array_equal(lib.infer("plain", {"INPUT0": x})["OUTPUT0"], x * 2 + 1)
    after = _stats(lib, "plain")
    assert after["batches"] == before["batches"] + 3
    assert after["cache_hit"] == {"count": 0, "ns": 0} and after["cache_miss"] == {"count": 0, "ns": 0}


def test_eviction_keeps_the_cache_within_its_size(cache_pool, lib):
    per_entry = WIDE * 4 + ENTRY_OVERHEAD_BYTES
    rows = [np.full((1, WIDE), float(i), np.float32) for i in range(2 * CACHE_BYTES // per_entry)]
    for x in rows:
        lib.infer("wide", {"INPUT0": x})
    cache = lib.status()["cache"]
    assert cache["size"] == CACHE_BYTES and cache["used"] <= CACHE_BYTES
    assert cache["evictions"] >= len(rows) - CACHE_BYTES // per_entry
    before = _stats(lib, "wide")
    lib.infer("wide", {"INPUT0": rows[-1]})  # the most recent one is still there
    lib.infer("wide", {"INPUT0": rows[0]})  # the oldest was evicted
    after = _stats(lib, "wide")
    assert after["cache_hit"]["count"] == before["cache_hit"]["count"] + 1
    assert after["batches"] == before["batches"] + 1


def test_arena_inputs_rewritten_after_sending_cannot_poison_the_cache(cache_pool, lib, gate):
    """A local client may rewrite its arena while its request waits: the response cached under the
    inputs' hash must be the response to those inputs."""
    open(gate, "w").close()
    try:
        held = lib.infer_async("rec", {"INPUT": np.full((1, 4), -1.0, np.float32)})  # holds the worker
        assert wait_until(lambda: lib.status()["models"]["rec"]["slots_busy"] >= 1)
        with cache_pool.client(shared_memory=True, arena_bytes=1 << 20, arena_min_bytes=0) as shm:
            x = shm.empty((1, 4), np.float32)
            x[:] = 5.0
            fut = shm.infer_async("rec", {"INPUT": x})
            assert wait_until(lambda: lib.status()["models"]["rec"]["queued"] == 1)
            x[:] = 6.0  # after admission: what the request asked about stays 5
            os.unlink(gate)
            assert fut.result(timeout=60)["OUTPUT"].tolist() == [[5.0] * 4]
        held.result(timeout=60)
    finally:
        if os.path.exists(gate):
            os.unlink(gate)
    before = _stats(lib, "rec")
    again = lib.infer("rec", {"INPUT": np.full((1, 4), 5.0, np.float32)})["OUTPUT"]
    assert again.tolist() == [[5.0] * 4]
    assert _stats(lib, "rec")["cache_hit"]["count"] == before["cache_hit"]["count"] + 1


def test_tritonclient_http_hits_the_cache(cache_pool, lib):
    httpclient = pytest.importorskip("tritonclient.http")
    x = np.full((1, 16), 0.125, np.float32)
    before = _stats(lib, "cached")
    with httpclient.InferenceServerClient(f"127.0.0.1:{cache_pool.http_port}") as triton:
        for _ in range(2):
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            np.testing.assert_array_equal(triton.infer("cached", [inp]).as_numpy("OUTPUT0"), x * 2 + 1)
    after = _stats(lib, "cached")
    assert after["batches"] == before["batches"] + 1
    assert after["cache_hit"]["count"] == before["cache_hit"]["count"] + 1


def test_a_pool_without_a_cache_serves_an_enabled_model_uncached(tmp_path):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo, "cached")
    _enable(repo, "cached")
    with Pool(repo) as pool:
        c = pool.client()
        x = np.ones((1, 16), np.float32)
        for _ in range(2):
            c.infer("cached", {"INPUT0": x})
        s = c.stats()["cached"]
        assert s["batches"] == 2 and s["cache_miss"]["count"] == 0 and c.status()["cache"] is None


# -- point 7: failures by Triton's reason, and the front's copy times -------------------------
def test_failures_count_by_reason_and_copy_times_are_measured(lib):
    before = _stats(lib, "rec")
    with pytest.raises(errors.InvalidArgument):
        lib.infer("rec", {"INPUT": np.ones((1, 5), np.float32)})  # refused by admission
    with pytest.raises(errors.ModelError):
        lib.infer("rec", {"INPUT": np.full((1, 4), -7.0, np.float32)})  # the model fails it
    after = _stats(lib, "rec")
    reasons = {r: after["failure_reasons"][r] - before["failure_reasons"][r] for r in after["failure_reasons"]}
    assert reasons == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 1}
    assert after["failures"] == before["failures"] + 2
    plain = _stats(lib, "plain")
    assert sum(plain["batch_compute_input_s"].values()) > 0 and sum(plain["batch_compute_output_s"].values()) > 0
    assert set(plain["batch_compute_input_s"]) == {int(k) for k in plain["batch_sizes"]}
