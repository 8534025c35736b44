"""The KServe v2 HTTP sidecar with real clients: tritonclient.http, raw HTTP, prometheus_client, perf_analyzer."""

import http.client
import json
import os
import shutil
import subprocess
import urllib.request

import numpy as np
import onnxruntime as ort
import pytest

from gepool import Client, Pool
from tests import repo as test_repo
from tests.conftest import SIDECAR_SERVERS, free_port, wait_until

httpclient = pytest.importorskip("tritonclient.http")
RNG = np.random.default_rng(21)


@pytest.fixture(scope="module", params=SIDECAR_SERVERS)
def http_pool(tmp_path_factory, request):
    repo = str(tmp_path_factory.mktemp("http-models"))
    test_repo.make_models.make_all(repo)
    test_repo.bytes_model(repo)
    with Pool(repo, http_port=free_port(), metrics_port=free_port(), http_server=request.param) as pool:
        pool.repo = repo
        yield pool


@pytest.fixture(scope="module")
def triton(http_pool):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{http_pool.http_port}")
    yield c
    c.close()


def direct(repo: str, name: str, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(os.path.join(repo, name, "1", "model.onnx"),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def test_health_metadata_and_config(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("mlp") and triton.is_model_ready("mlp", "1")
    assert not triton.is_model_ready("mlp", "2")
    meta = triton.get_server_metadata()
    assert {"binary_tensor_data", "statistics", "system_shared_memory"} <= set(meta["extensions"])
    mm = triton.get_model_metadata("mlp")
    assert mm["versions"] == ["1"] and mm["platform"] == "onnxruntime_onnx"
    assert mm["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 1024]}]
    cfg = triton.get_model_config("mlp")
    assert cfg["max_batch_size"] == 32 and cfg["input"][0]["dims"] == [1024]  # int64 as numbers
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 5000
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    assert cfg["instance_group"][0]["kind"] == "KIND_CPU"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_matches_onnxruntime(http_pool, triton, binary):
    x = RNG.standard_normal((3, 1024)).astype(np.float32)
    inp = httpclient.InferInput("INPUT", [3, 1024], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("LOGITS", binary_data=binary)
    result = triton.infer("mlp", [inp], outputs=[out], request_id="r7")
    (want,) = direct(http_pool.repo, "mlp", {"INPUT": x})
    np.testing.assert_allclose(result.as_numpy("LOGITS"), want, rtol=1e-4, atol=1e-4)
    assert result.get_response()["id"] == "r7"
    assert result.get_response()["model_version"] == "1"  # the version that ran it, from the reply


def test_bytes_through_the_python_backend(triton):
    text = np.array([[b"gepool"], [b"ascend npu"], ["h\u00e9".encode()]], dtype=object)
    for binary in (True, False):
        inp = httpclient.InferInput("TEXT", [3, 1], "BYTES")
        inp.set_data_from_numpy(text, binary_data=binary)
        result = triton.infer("shout", [inp])
        assert result.as_numpy("UPPER")[:, 0].tolist() == [b"GEPOOL", b"ASCEND NPU", "H\u00e9".encode()]
        assert result.as_numpy("LENGTH")[:, 0].tolist() == [6, 10, 3]


def test_system_shared_memory(http_pool, triton):
    import tritonclient.utils.shared_memory as shm

    x = RNG.standard_normal((2, 16)).astype(np.float32)
    key_in, key_out = f"/gepool_test_in_{os.getpid()}", f"/gepool_test_out_{os.getpid()}"
    h_in = shm.create_shared_memory_region("in", key_in, x.nbytes)
    h_out = shm.create_shared_memory_region("out", key_out, x.nbytes)
    try:
        shm.set_shared_memory_region(h_in, [x])
        triton.register_system_shared_memory("in", key_in, x.nbytes)
        triton.register_system_shared_memory("out", key_out, x.nbytes)
        assert {r["name"] for r in triton.get_system_shared_memory_status()} == {"in", "out"}
        inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        out.set_shared_memory("out", x.nbytes)
        result = triton.infer("tiny", [inp], outputs=[out])
        meta = result.get_output("OUTPUT0")  # metadata only: the data went into the region
        assert "data" not in meta and meta["parameters"]["shared_memory_region"] == "out"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(h_out, np.float32, [2, 16]), 2 * x + 1)
        triton.unregister_system_shared_memory()
        assert triton.get_system_shared_memory_status() == []
        triton.unregister_cuda_shared_memory()  # perf_analyzer calls it: a harmless no-op
    finally:
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)


def test_unknown_model_is_400(triton):
    from tritonclient.utils import InferenceServerException

    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    with pytest.raises(InferenceServerException) as info:
        triton.infer("nosuch", [inp])
    assert info.value.status() == "400" and "unknown model" in info.value.message()


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else {}
    finally:
        conn.close()


def _binary(header: dict, blob: bytes, length: int | None = None) -> tuple[bytes, dict]:
    h = json.dumps(header).encode()
    return h + blob, {"Inference-Header-Content-Length": str(len(h) if length is None else length)}


GOOD = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": list(range(16))}]}


@pytest.mark.parametrize("body, headers, words", [
    (b"{not json", {}, "failed to parse the request JSON"),
    (*_binary({"inputs": []}, b"", length=9999), "does not fit"),
    (*_binary({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                           "parameters": {"binary_data_size": 60}}]}, b"\0" * 60), "60 bytes of data"),
    (*_binary({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                           "parameters": {"binary_data_size": 64}}]}, b"\0" * 32), "runs past"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP99", "data": [0] * 16}]}).encode(),
     {}, "unknown datatype 'FP99'"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0] * 15}]}).encode(),
     {}, "15 values of data for shape [1, 16]"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {
        "shared_memory_region": "nowhere", "shared_memory_byte_size": 64}}]}).encode(), {},
     "Unable to find system shared memory region: 'nowhere'"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 15], "datatype": "FP32", "data": [0] * 15}]}).encode(),
     {}, "does not match the model's [-1, 16]"),
    (json.dumps({**GOOD, "parameters": {"max_tokens": 3}}).encode(), {},
     "parameter 'max_tokens' is not supported by gepool (supported: binary_data_output, priority, timeout)"),
    (json.dumps({**GOOD, "parameters": {"sequence_id": 3}}).encode(), {},
     "parameter 'sequence_id': sequence batching is not supported"),
    (json.dumps({**GOOD, "parameters": {"timeout": -5}}).encode(), {},
     "'timeout' must be a non-negative integer, got -5"),
])
def test_malformed_http_gets_400_and_pool_serves_on(http_pool, body, headers, words):
    status, reply = post(http_pool.http_port, "/v2/models/tiny/infer", body, headers)
    assert status == 400, reply
    assert words in reply["error"]
    status, reply = post(http_pool.http_port, "/v2/models/tiny/infer", json.dumps(GOOD).encode())
    assert status == 200 and reply["outputs"][0]["data"][:3] == [1.0, 3.0, 5.0]


def _raw_post(port: int, model: str, body: bytes) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers={"Inference-Header-Content-Length": "0"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_a_raw_binary_request_is_the_one_inputs_bytes(http_pool):
    """Triton's raw binary request: no JSON, the body is the model's one input (batch 1), outputs come binary."""
    x = np.arange(16, dtype=np.float32)
    status, headers, body = _raw_post(http_pool.http_port, "tiny", x.tobytes())
    assert status == 200, body
    hlen = int(headers["inference-header-content-length"])
    (out,) = json.loads(body[:hlen])["outputs"]
    assert out["name"] == "OUTPUT0" and out["shape"] == [1, 16] and out["parameters"] == {"binary_data_size": 64}
    np.testing.assert_array_equal(np.frombuffer(body[hlen:], np.float32), 2 * x + 1)

    status, headers, body = _raw_post(http_pool.http_port, "shout", b"hello")  # BYTES of shape [1]: the body
    assert status == 200, body
    hlen = int(headers["inference-header-content-length"])
    outs = {o["name"]: o for o in json.loads(body[:hlen])["outputs"]}
    upper_size = outs["UPPER"]["parameters"]["binary_data_size"]
    blobs = body[hlen:]
    assert [o["name"] for o in json.loads(body[:hlen])["outputs"]][0] == "UPPER"
    assert blobs[:upper_size] == b"\x05\0\0\0HELLO" and np.frombuffer(blobs[upper_size:], np.int32).tolist() == [5]

    status, _, body = _raw_post(http_pool.http_port, "tiny", x.tobytes()[:60])
    assert status == 400 and json.loads(body)["error"] == ("input 'INPUT0': the raw request's 60 bytes do not make a "
                                                           "FP32 tensor of shape [1, 16]")
    status, _, body = _raw_post(http_pool.http_port, "nosuch", x.tobytes())
    assert status == 400 and "unknown model" in json.loads(body)["error"]


def test_the_timeout_parameter_is_the_requests_timeout_in_microseconds():
    from gepool.http import kserve
    body = json.dumps({**GOOD, "parameters": {"timeout": 2500, "priority": 2}}).encode()
    req = kserve.parse_request(body, None)
    assert req.timeout_s == pytest.approx(0.0025) and req.priority == 2
    assert kserve.parse_request(json.dumps(GOOD).encode(), None).timeout_s is None


def test_shared_memory_offsets_are_checked(http_pool, tmp_path):
    key = f"/gepool_test_small_{os.getpid()}"
    path = f"/dev/shm/{key[1:]}"
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    port = http_pool.http_port
    try:
        status, reply = post(port, "/v2/systemsharedmemory/region/big/register",
                             json.dumps({"key": key, "offset": 0, "byte_size": 128}).encode())
        assert status == 400 and "invalid args" in reply["error"]
        status, _ = post(port, "/v2/systemsharedmemory/region/small/register",
                         json.dumps({"key": key, "offset": 0, "byte_size": 64}).encode())
        assert status == 200
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {
            "shared_memory_region": "small", "shared_memory_byte_size": 64, "shared_memory_offset": 32}}]}
        status, reply = post(port, "/v2/models/tiny/infer", json.dumps(body).encode())
        assert status == 400 and "lies outside shared memory region 'small'" in reply["error"]
    finally:
        post(port, "/v2/systemsharedmemory/region/small/unregister", b"")
        os.unlink(path)


@pytest.mark.aiohttp_only
def test_metrics_parse_and_move(http_pool, triton):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_pool.metrics_port}/metrics", timeout=30).read()
        samples = {}
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                # the parser reports Triton's suffix-less counters as "<name>_total"; summed over protocols
                key = (s.name.removesuffix("_total"), s.labels.get("model"), s.labels.get("le"))
                samples[key] = samples.get(key, 0) + s.value
        return samples

    before = scrape()
    inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_data_from_numpy(np.ones((2, 16), np.float32))
    for _ in range(3):
        triton.infer("tiny", [inp])
    after = scrape()
    key = ("nv_inference_request_success", "tiny", None)
    assert after[key] - before.get(key, 0) == 3
    assert after[("nv_inference_count", "tiny", None)] - before.get(("nv_inference_count", "tiny", None), 0) == 6
    assert after[("gepool_request_duration_seconds_count", "tiny", None)] >= 3
    assert after[("gepool_batch_size_bucket", "tiny", "+Inf")] >= 3


# .ci/run extracts perf_analyzer here from the tritonclient 2.40.0 wheel (current wheels ship none)
PERF_ANALYZER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".perf_analyzer")


def _perf_analyzer_env() -> dict | None:
    exe = shutil.which("perf_analyzer", path=os.pathsep.join([PERF_ANALYZER_DIR, os.environ.get("PATH", "")]))
    if exe is None:
        return None
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(exe), env.get("PATH", "")])
    try:
        import nvidia.cuda_runtime

        lib = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join([lib, env.get("LD_LIBRARY_PATH", "")])
    except ImportError:
        pass
    probe = subprocess.run([exe, "--version"], capture_output=True, text=True, env=env)
    if "error while loading shared libraries" in probe.stderr:
        return None
    return env


@pytest.mark.aiohttp_only
def test_perf_analyzer_concurrency_1_to_8(http_pool):
    env = _perf_analyzer_env()
    if env is None:
        pytest.skip("perf_analyzer cannot run here: .ci/run extracts it from the tritonclient==2.40.0 wheel into "
                    ".perf_analyzer/; it needs Debian's libb64-0d and libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12)")
    proc = subprocess.run(["perf_analyzer", "-m", "tiny", "-u", f"127.0.0.1:{http_pool.http_port}", "-i", "http",
                           "--concurrency-range", "1:8:7", "--measurement-interval", "1000", "-v",
                           # what is tested is that it works, not how steady this host is: its stability
                           # check (max/min of 3 windows within 10%) fails on a busy 2-core machine
                           "--stability-percentage", "1000"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Concurrency: 1, throughput" in proc.stdout and "Concurrency: 8, throughput" in proc.stdout
    assert "error" not in proc.stdout.lower().replace("errors: 0", ""), proc.stdout[-3000:]


@pytest.mark.aiohttp_only
def test_repository_index_and_control_mode(http_pool, triton):
    from tritonclient.utils import InferenceServerException

    index = {m["name"]: m for m in triton.get_model_repository_index()}
    assert index["tiny"]["state"] == "READY" and index["tiny"]["version"] == "1"
    with pytest.raises(InferenceServerException, match="NONE"):  # this pool was started in mode none
        triton.load_model("tiny")


@pytest.mark.aiohttp_only
def test_bench_over_http(http_pool, monkeypatch):
    import gepool.bench.ticker
    from gepool.bench import Display, bench_http

    class Seen(Display):
        ticks, ends = [], []

        def tick(self, progress) -> None:
            self.ticks.append(progress)

        def finished(self, level, again_with: int = 0) -> None:
            self.ends.append(level)

    monkeypatch.setattr(gepool.bench.ticker, "PROGRESS_EVERY_S", 0.05)
    url = f"127.0.0.1:{http_pool.http_port}"
    seen = Seen()
    report = bench_http(url, "tiny", concurrency=[2], rates=[50.0], seconds=1.0, batch_size=2, display=seen)
    assert [(lv.mode, lv.level) for lv in seen.ends] == [("concurrency", 2), ("rate", 50.0)]
    assert {t.mode for t in seen.ticks} == {"concurrency", "rate"}
    assert all(t.sent >= t.ok for t in seen.ticks)
    for lv in report["levels"]:
        assert lv["ok"] == lv["sent"] > 0 and lv["errors"] == {}
        assert lv["rows"] == 2 * lv["ok"]
        assert lv["server"]["requests"] == lv["ok"]  # from /v2/models/tiny/stats, before and after
        assert lv["latency_ms"]["p50"] <= lv["latency_ms"]["p99"]
        assert lv["client_cpu"] > 0
    assert 25 <= report["levels"][1]["sent"] <= 80
    given = bench_http(url, "tiny", concurrency=[1], seconds=0.5, given={"INPUT0": np.ones((3, 16), np.float32)})
    assert given["inputs"] == {"INPUT0": [3, 16]}
    (lv,) = given["levels"]
    assert lv["ok"] > 0 and lv["rows"] == 3 * lv["ok"] and lv["server"]["avg_batch_size"] >= 3


def test_the_sidecar_reaches_the_front_over_a_lane(http_pool, triton):
    """The sidecar is an AsyncClient on the pool's ipc endpoint: it must hold a lane, not talk ZMQ."""
    from tests.conftest import _descendants

    assert triton.is_model_ready("tiny")
    sidecars = [pid for pid in _descendants(http_pool.process.pid)
                if b"_gateway_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert sidecars  # one on a small host, one per 8 cores on a larger one
    with Client(http_pool.endpoint, lane=False) as c:
        assert wait_until(lambda: set(sidecars) <= set(c.status()["lane_pids"]), 30)


@pytest.mark.aiohttp_only
def test_trace_settings_answer_as_triton_with_tracing_off(http_pool, triton):
    from tritonclient.utils import InferenceServerException

    off = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0", "trace_file": "",
           "trace_mode": "triton"}
    assert triton.get_trace_settings() == off
    assert triton.get_trace_settings(model_name="tiny") == off
    assert triton.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": None}) == off
    assert triton.update_trace_settings(model_name="tiny", settings={"trace_count": "-1"}) == off
    for settings, words in (({"trace_level": ["TIMESTAMPS"]}, "trace setting 'trace_level' can only be ['OFF']"),
                            ({"trace_rate": "1"}, "trace setting 'trace_rate'"),
                            ({"trace_file": "/tmp/trace.json"}, "trace file location can not be updated"),
                            ({"trace_sampling": "1"}, "unknown trace setting 'trace_sampling'")):
        with pytest.raises(InferenceServerException) as info:
            triton.update_trace_settings(settings=settings)
        assert info.value.status() == "400" and words in info.value.message(), info.value.message()
    with pytest.raises(InferenceServerException) as info:
        triton.get_trace_settings(model_name="nosuch")
    assert info.value.status() == "400" and "Request for unknown model : nosuch" in info.value.message()
    assert {"logging", "trace"} <= set(triton.get_server_metadata()["extensions"])


@pytest.mark.aiohttp_only
def test_log_settings_read_and_a_refused_change_changes_nothing(triton):
    from tritonclient.utils import InferenceServerException

    settings = triton.get_log_settings()  # the pool logs warnings and errors (Pool's default level)
    assert settings == {"log_file": "", "log_info": False, "log_warning": True, "log_error": True,
                        "log_verbose_level": 0, "log_format": "default"}
    with pytest.raises(InferenceServerException) as info:
        triton.update_log_settings({"log_error": False})  # errors off while warnings are on: no threshold does it
    assert info.value.status() == "400" and "log_error false with log_warning on" in info.value.message()
    assert triton.get_log_settings() == settings


@pytest.mark.aiohttp_only
def test_host_and_cache_metrics_as_triton_names_them(http_pool, triton):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_pool.metrics_port}/metrics", timeout=30).read()
        return {family.name: (family.type, family.samples) for family in text_string_to_metric_families(text.decode())}

    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    for _ in range(3):  # the pool's processes and this one use CPU in the interval the scrape reports
        triton.infer("tiny", [inp])
    assert sum(range(2_000_000)) > 0
    families = scrape()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    for name in ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"):
        kind, samples = families[name]
        assert kind == "gauge" and len(samples) == 1 and samples[0].labels == {}, (name, samples)
    assert families["nv_cpu_memory_total_bytes"][1][0].value == total
    assert 0 < families["nv_cpu_memory_used_bytes"][1][0].value < total
    assert 0 < families["nv_cpu_utilization"][1][0].value <= 1.0
    for name in ("nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model", "nv_cache_hit_duration_per_model",
                 "nv_cache_miss_duration_per_model", "nv_inference_compute_input_duration_us",
                 "nv_inference_compute_output_duration_us"):
        kind, samples = families[name]
        assert kind == "counter" and {s.labels["model"] for s in samples} >= {"tiny", "mlp"}, (name, samples)
    kind, samples = families["nv_inference_request_failure"]
    assert {s.labels["reason"] for s in samples if s.labels["model"] == "tiny"} == \
        {"REJECTED", "CANCELED", "BACKEND", "OTHER"}
    stats = triton.get_inference_statistics("tiny")["model_stats"][0]["inference_stats"]
    assert {"cache_hit", "cache_miss", "compute_input", "compute_output"} <= set(stats)


def test_metrics_export_the_stats_the_front_reports_under_tritons_names():
    """What the front's stats carry (cache hits and misses, measured compute input/output, failures by
    reason) reaches Triton's series; /v2/models/stats reads the same numbers."""
    from gepool.http.metrics import render
    from gepool.http.statistics import model_statistics

    hist = {"buckets": [], "counts": [0], "sum": 0.0, "count": 4}
    stats = {"requests": 4, "failures": 3, "batches": 2, "rows": 5, "batch_sizes": {2: 1, 3: 1},
             "batch_compute_s": {2: 0.5, 3: 0.25}, "queue_us": 10, "compute_us": 750_000, "request_us": 900_000,
             "last_inference": 1.0, "histograms": {"request": hist, "queue": hist, "compute": hist},
             "cache_hit": {"count": 6, "ns": 12_000}, "cache_miss": {"count": 4, "ns": 8_000},
             "compute_input": {"count": 2, "ns": 30_000}, "compute_output": {"count": 2, "ns": 50_000},
             "failure_reasons": {"REJECTED": 2, "BACKEND": 1}}
    text = render({"models": {"m": {"version": 3, "queued": 0}}}, {"m": stats}, (0.25, 1000, 400)).decode()
    for line in ('nv_cache_num_hits_per_model{model="m",version="3"} 6',
                 'nv_cache_hit_duration_per_model{model="m",version="3"} 12',
                 'nv_cache_num_misses_per_model{model="m",version="3"} 4',
                 'nv_cache_miss_duration_per_model{model="m",version="3"} 8',
                 'nv_inference_compute_input_duration_us{model="m",version="3"} 30',
                 'nv_inference_compute_output_duration_us{model="m",version="3"} 50',
                 'nv_inference_request_failure{model="m",reason="REJECTED",version="3"} 2',
                 'nv_inference_request_failure{model="m",reason="BACKEND",version="3"} 1',
                 'nv_inference_request_failure{model="m",reason="OTHER",version="3"} 0',
                 "nv_cpu_utilization 0.25", "nv_cpu_memory_total_bytes 1000", "nv_cpu_memory_used_bytes 400"):
        assert line in text.splitlines(), line
    got = model_statistics("m", "3", stats)["inference_stats"]
    assert got["cache_hit"] == {"count": 6, "ns": 12_000} and got["compute_output"] == {"count": 2, "ns": 50_000}
    plain = render({"models": {}}, {"m": dict(stats, failure_reasons=None)}).decode()
    assert 'nv_inference_request_failure{model="m",reason="OTHER",version="1"} 3' in plain.splitlines()
    assert "nv_cpu_utilization" not in plain


def test_cpu_utilization_is_the_busy_share_between_readings_and_memory_is_total_less_available(tmp_path):
    from gepool.http.host import CpuUtilization, memory

    stat, meminfo = tmp_path / "stat", tmp_path / "meminfo"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 100 0 100 800 0 0 0 0 0 0\n")
    now = [0.0]
    cpu = CpuUtilization(clock=lambda: now[0], path=str(stat))
    # busy (user nice system irq softirq steal) +60 +10 +30 +5 +5 +0 = 110; idle (idle iowait) +80 +20 = 100
    stat.write_text("cpu  160 10 130 880 20 5 5 0 0 0\n")
    now[0] = 0.5
    assert cpu.read() == pytest.approx(110 / 210)  # within MIN_INTERVAL_S: the interval goes on
    stat.write_text("cpu  170 10 130 970 20 5 5 0 0 0\n")  # +10 busy, +90 idle more
    now[0] = 1.5
    assert cpu.read() == pytest.approx(120 / 310)  # still from the start; a new interval begins here
    stat.write_text("cpu  200 10 130 980 20 5 5 0 0 0\n")  # +30 busy, +10 idle since
    now[0] = 1.6
    assert cpu.read() == pytest.approx(30 / 40)
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")
    assert memory(str(meminfo)) == (1000 * 1024, 750 * 1024)
    meminfo.write_text("MemTotal:       1000 kB\n")
    assert memory(str(meminfo)) == (0, 0)


@pytest.mark.aiohttp_only
def test_classification_is_asked_of_the_front_never_ignored(triton):
    """``InferRequestedOutput(..., class_count=N)`` reaches the front as [name, N]: the top N classes come
    back in Triton's "value:index" form (a request for classes is never answered with the raw tensor)."""
    x = np.array([[0, 5, 1, 7, 2, 3, 4, 6, 8, 9, 15, 10, 11, 12, 14, 13]], np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    result = triton.infer("tiny", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=3)])
    assert result.as_numpy("OUTPUT0").tolist() == [[b"31.000000:10", b"29.000000:14", b"27.000000:15"]]


@pytest.mark.skipif(os.geteuid() != 0, reason="calling as a second user needs root to setuid(65534)")
def test_only_the_pools_user_changes_the_log_settings(http_pool, triton):
    """More logging is more disk and more detail in the log: another local user may read the settings,
    not change them."""
    from tests.test_http_hostile import as_nobody

    def call(method: str, body: bytes) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", http_pool.http_port, timeout=60)
        try:
            conn.request(method, "/v2/logging", body=body or None)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    before = triton.get_log_settings()
    code, reply = as_nobody(call, "POST", json.dumps({"log_verbose_level": 3}).encode())
    assert code == 403 and "changing the log settings is allowed only to the pool's own user" in reply["error"]
    assert as_nobody(call, "GET", b"") == [200, before]
    assert triton.get_log_settings() == before
