"""gepool replicas on Ray Serve: a local Ray (2 CPUs), an application of 2 replicas on the example models,
requests through the handle and through Serve's HTTP proxy with tritonclient, a killed front, shutdown."""

import concurrent.futures
import os
import signal

import numpy as np
import pytest
import yaml

from gepool.cli.args import Parser, UsageError
from gepool.common import errors
from gepool.ipc import naming
from tests import repo as test_repo
from tests.conftest import free_port, running, wait_until

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'gepool[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'gepool[ray]')")
ort = pytest.importorskip("onnxruntime")

from gepool.cli import ray_serve  # noqa: E402  (needs ray)
from gepool.ray import app as serve_app  # noqa: E402
from gepool.ray import deployment_options, sizing  # noqa: E402
from gepool.ray.app import build  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_TIMEOUT_S = 60.0  # no request may take longer, even one sent to a replica whose front was killed
REPLACE_TIMEOUT_S = 120.0
OBJECT_STORE_BYTES = 128 << 20  # Ray's default is 30% of the memory, in /dev/shm


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("ray-models"))
    test_repo.make_models.make_tiny(repo)
    test_repo.make_models.make_mlp(repo)
    return repo


@pytest.fixture(scope="module")
def sessions(repo):
    return {name: ort.InferenceSession(f"{repo}/{name}/1/model.onnx", providers=["CPUExecutionProvider"])
            for name in ("tiny", "mlp")}


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network here
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                 logging_level="warning", _node_ip_address="127.0.0.1")  # loopback only
    except Exception as exc:  # pragma: no cover - a host where Ray cannot start
        pytest.skip(f"Ray cannot start here: {type(exc).__name__}: {exc}")
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def served(cluster, repo):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build(repo, replicas=2, num_cpus=0.5, cpu_threads=1, health_check_period_s=1.0,
                             graceful_shutdown_timeout_s=20.0), name="gepool", route_prefix="/")
    return handle, port


def inputs_for(name: str, i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    width = 16 if name == "tiny" else 1024
    rows = 1 + i % 3
    return {"INPUT0" if name == "tiny" else "INPUT": rng.standard_normal((rows, width), dtype=np.float32)}


def expected(sessions, name: str, inputs: dict) -> np.ndarray:
    return sessions[name].run(None, inputs)[0]


def output_name(name: str) -> str:
    return "OUTPUT0" if name == "tiny" else "LOGITS"


def replicas_seen(handle, calls: int = 40) -> dict[str, dict]:
    """replica id -> pool_info, from calls routed as Serve routes them (until both replicas answered); a
    replica whose pool is gone answers with an error, and is not counted."""
    seen: dict[str, dict] = {}
    for _ in range(calls):
        try:
            info = handle.pool_info.remote().result(timeout_s=RESULT_TIMEOUT_S)
        except errors.Unavailable:
            continue
        seen[info["replica_id"]] = info
        if len(seen) >= 2:
            break
    return seen


# -- sizing and configuration (no replica runs) ----------------------------------------------------
def test_sizing_sets_request_limits_from_max_batch_size_and_instances(repo, tmp_path):
    assert sizing(repo, "tiny").target_ongoing_requests == 8  # max_batch_size 8, one instance
    mlp = sizing(repo, "mlp")
    assert (mlp.max_batch_size, mlp.batches_in_flight, mlp.target_ongoing_requests) == (32, 1, 32)
    assert sizing(repo).model == "mlp"  # the largest, by default
    assert mlp.max_ongoing_requests == 64
    two = str(tmp_path / "two")
    test_repo.recorder(two, "pair", max_batch=8, preferred="8", count=2)
    assert sizing(two).target_ongoing_requests == 16  # two instances, a batch of 8 each
    options = deployment_options(repo, replicas=2, max_replicas=5)
    assert options["max_ongoing_requests"] == 64 and "num_replicas" not in options
    auto = options["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (2, 5, 32)
    assert deployment_options(repo, replicas=3, npus=1)["ray_actor_options"]["resources"] == {"NPU": 1}
    with pytest.raises(errors.InvalidArgument, match="sizing model 'nope' is not in the repository"):
        sizing(repo, "nope")
    with pytest.raises(errors.InvalidArgument, match="min"):
        deployment_options(repo, replicas=3, max_replicas=2)


def test_serve_config_file_builds_and_refuses_unknown_args(repo):
    with open(os.path.join(ROOT, "deploy", "ray", "serve.yaml")) as f:
        config = yaml.safe_load(f)
    from ray.serve.schema import ServeDeploySchema
    ServeDeploySchema.model_validate(config)  # what `serve run` / `serve deploy` check the file against
    (application,) = config["applications"]
    assert application["import_path"] == "gepool.ray:app"
    module, _, attr = application["import_path"].partition(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is serve_app
    args = {**application["args"], "model_repository": repo}
    assert isinstance(serve_app(args), serve.Application)
    with pytest.raises(errors.InvalidArgument, match="does not take max_batch"):
        serve_app({**args, "max_batch": 4})


def test_gepool_ray_command_line(repo):
    parser = Parser(prog="gepool ray")
    ray_serve.add_arguments(parser)
    args = parser.parse_args(["--model-repository", repo, "--replicas", "2", "--address", "auto"])
    assert args.address == "auto" and args.replicas == 2
    assert isinstance(ray_serve.application(args), serve.Application)
    with pytest.raises(UsageError, match="--replicas"):
        parser.parse_args(["--model-repository", repo, "--replicas", "0"])
    with pytest.raises(UsageError, match="--model-repository '/nope' is not a folder"):
        ray_serve.application(parser.parse_args(["--model-repository", "/nope"]))
    with pytest.raises(UsageError, match="below --replicas"):
        ray_serve.application(parser.parse_args(["--model-repository", repo, "--replicas", "3",
                                                 "--max-replicas", "2"]))


# -- a running application ---------------------------------------------------------------------------
def test_handle_answers_equal_onnxruntime_from_three_callers(served, sessions):
    handle, _ = served

    def caller(offset: int) -> int:
        for i in range(offset, 300, 3):
            name = "tiny" if i % 3 else "mlp"
            x = inputs_for(name, i)
            out = handle.infer.remote(name, x).result(timeout_s=RESULT_TIMEOUT_S)
            np.testing.assert_allclose(out[output_name(name)], expected(sessions, name, x), rtol=1e-5, atol=1e-5)
        return offset

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert sorted(pool.map(caller, range(3))) == [0, 1, 2]


def test_http_through_serve_proxy_with_tritonclient(served, sessions):
    import tritonclient.http as triton

    _, port = served
    url = f"127.0.0.1:{port}"
    with triton.InferenceServerClient(url) as probe:
        assert probe.is_server_live() and probe.is_server_ready() and probe.is_model_ready("tiny")
        meta = probe.get_model_metadata("tiny")
        assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}]
        assert probe.get_model_config("mlp")["max_batch_size"] == 32
        assert not probe.is_model_ready("nope")

    def client(offset: int) -> int:
        with triton.InferenceServerClient(url) as c:
            for i in range(offset, 100, 3):
                name = "tiny" if i % 4 else "mlp"
                x = inputs_for(name, 1000 + i)
                (key, value), = x.items()
                tensor = triton.InferInput(key, list(value.shape), "FP32")
                tensor.set_data_from_numpy(value, binary_data=bool(i % 2))
                result = c.infer(name, [tensor])
                np.testing.assert_allclose(result.as_numpy(output_name(name)), expected(sessions, name, x),
                                           rtol=1e-5, atol=1e-5)
        return offset

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert sorted(pool.map(client, range(3))) == [0, 1, 2]
    with triton.InferenceServerClient(url) as c:
        bad = triton.InferInput("INPUT0", [1, 15], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 15), np.float32))
        with pytest.raises(Exception, match="INPUT0"):  # the pool's own 400, through the proxy
            c.infer("tiny", [bad])


def test_requests_spread_over_both_replicas(served):
    handle, _ = served
    seen = replicas_seen(handle)
    assert len(seen) == 2, f"only replica(s) {list(seen)} answered"
    served_by = {rid: info["stats"]["tiny"]["requests"] + info["stats"]["mlp"]["requests"]
                 for rid, info in seen.items()}
    assert all(n > 0 for n in served_by.values()), served_by
    assert sum(served_by.values()) >= 400, served_by  # the 300 handle and 100 HTTP requests above
    assert len({info["front_pid"] for info in seen.values()}) == 2


def test_a_killed_front_is_replaced_and_no_request_hangs(served, sessions):
    handle, _ = served
    before = replicas_seen(handle)
    victim, info = next(iter(before.items()))
    os.kill(info["front_pid"], signal.SIGKILL)

    def one(i: int) -> str:
        x = inputs_for("tiny", 5000 + i)
        try:
            out = handle.infer.remote("tiny", x).result(timeout_s=RESULT_TIMEOUT_S)
        except TimeoutError:
            return "hung"
        except Exception:  # the dead replica's answer, until Serve takes it out
            return "error"
        np.testing.assert_allclose(out["OUTPUT0"], expected(sessions, "tiny", x), rtol=1e-5, atol=1e-5)
        return "answered"

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(one, range(30)))
    assert "hung" not in outcomes and "answered" in outcomes, outcomes

    def replaced() -> bool:
        ids = set(replicas_seen(handle, calls=10))
        return len(ids) == 2 and victim not in ids

    assert wait_until(replaced, REPLACE_TIMEOUT_S, interval=0.5), "Serve did not replace the replica"
    assert not running(info["front_pid"])
    x = inputs_for("tiny", 9999)
    out = handle.infer.remote("tiny", x).result(timeout_s=RESULT_TIMEOUT_S)
    np.testing.assert_allclose(out["OUTPUT0"], expected(sessions, "tiny", x), rtol=1e-5, atol=1e-5)


def test_serve_shutdown_leaves_no_gepool_process_and_no_segment(served):
    handle, _ = served
    pids = set()
    for info in replicas_seen(handle).values():
        pids.add(info["front_pid"])
        for model in info["status"]["models"].values():
            pids.update(model["worker_pids"])
    assert len(pids) >= 4  # two fronts, each with a worker per model
    serve.shutdown()
    assert wait_until(lambda: not any(running(p) for p in pids), 60), [p for p in pids if running(p)]
    left = [e for e in naming.list_segments() if naming.owner_pid(e) in pids]
    assert not left, left


def test_gepool_ray_serves_in_the_foreground_and_drains_on_sigterm(cluster, repo, sessions, tmp_path):
    """``gepool ray`` (the module the ``gepool`` command runs) joins the cluster, deploys its replicas, answers
    over Serve's proxy, and on SIGTERM deletes its application, whose pools stop, then exits 0."""
    import subprocess
    import sys

    import tritonclient.http as triton

    serve.shutdown()  # the module's application is gone by now; the command starts Serve on its own port
    port = free_port()
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:  # files: Ray's log lines never fill a pipe
        proc = subprocess.Popen([sys.executable, "-m", "gepool.cli.ray_serve", "--model-repository", repo,
                                 "--replicas", "1", "--num-cpus", "0.5", "--http-port", str(port),
                                 "--address", ray.get_runtime_context().gcs_address], stdout=out, stderr=err)
    try:
        def started() -> bool:
            return "gepool on Ray Serve:" in out_path.read_text() or proc.poll() is not None

        assert wait_until(started, REPLACE_TIMEOUT_S, interval=0.2) and proc.poll() is None, err_path.read_text()
        line = next(t for t in out_path.read_text().splitlines() if t.startswith("gepool on Ray Serve:"))
        assert line.startswith("gepool on Ray Serve: 1 replica(s)") and f"http://127.0.0.1:{port}" in line
        with triton.InferenceServerClient(f"127.0.0.1:{port}") as c:
            assert c.is_server_ready()
            x = inputs_for("tiny", 77)
            tensor = triton.InferInput("INPUT0", [*x["INPUT0"].shape], "FP32")
            tensor.set_data_from_numpy(x["INPUT0"])
            np.testing.assert_allclose(c.infer("tiny", [tensor]).as_numpy("OUTPUT0"),
                                       expected(sessions, "tiny", x), rtol=1e-5, atol=1e-5)
        info = serve.get_app_handle("gepool").pool_info.remote().result(timeout_s=RESULT_TIMEOUT_S)
        pids = {info["front_pid"], *(p for m in info["status"]["models"].values() for p in m["worker_pids"])}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, err_path.read_text()
        assert "stopping (replicas drain)" in out_path.read_text()
        assert wait_until(lambda: not any(running(p) for p in pids), 60)
        assert not [e for e in naming.list_segments() if naming.owner_pid(e) in pids]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_ingress_refuses_oversized_bodies_before_reading_and_unknown_routes():
    """The ingress's own answers, on Starlette requests as Serve's proxy hands them over: a declared body
    over the limit is 413 before a byte is read, an undeclared one is cut off at the limit, and a path
    or method outside KServe v2 is 404 or 405. None of these reaches the pool (there is none here)."""
    import asyncio

    from starlette.requests import Request

    from gepool.ray import kserve_http

    def request(path: str, method: str = "POST", headers: dict | None = None, chunks=()) -> Request:
        chunks = list(chunks)
        read = []

        async def receive():
            read.append(True)
            body = chunks.pop(0) if chunks else b""
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}

        scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
        req = Request(scope, receive)
        req.reads = read
        return req

    async def ready() -> bool:
        raise AssertionError("not asked")

    async def answer(req: Request):
        return await kserve_http.handle(req, None, ready, 1024)

    huge = request("/v2/models/tiny/infer", headers={"Content-Length": str(10 ** 12)})
    response = asyncio.run(answer(huge))
    assert response.status_code == 413 and b"1000000000000 bytes" in response.body and not huge.reads
    streamed = request("/v2/models/tiny/infer", chunks=[b"x" * 600, b"x" * 600, b"x" * 600])
    response = asyncio.run(answer(streamed))
    assert response.status_code == 413 and len(streamed.reads) == 2  # stopped once past the limit
    assert asyncio.run(answer(request("/v2/repository/index"))).status_code == 404
    assert asyncio.run(answer(request("/v2/models/tiny/infer", "GET"))).status_code == 405
    assert asyncio.run(answer(request("/v2/models/tiny/versions/x1/infer"))).status_code == 400
    assert asyncio.run(answer(request("/v2/health/live", "GET"))).status_code == 200


def test_a_cancelled_request_cancels_its_call_to_the_pool():
    """Serve cancels a request whose HTTP client went away: the replica's call into the pool (a task of its
    own, raced against the front's exit) is cancelled with it, not left pending until it is destroyed."""
    import asyncio

    from gepool.ray.replica import GepoolReplica

    async def scenario() -> tuple[bool, bool]:
        replica = object.__new__(GepoolReplica.func_or_class)  # no pool: only the race is exercised
        replica._front_gone = asyncio.get_running_loop().create_future()
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def call():
            started.set()
            try:
                await asyncio.Event().wait()  # a reply that never comes
            except asyncio.CancelledError:
                cancelled.set()
                raise

        request = asyncio.ensure_future(replica._unless_front_gone(call()))
        await started.wait()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await asyncio.wait_for(cancelled.wait(), 5)
        return request.cancelled(), cancelled.is_set()

    assert asyncio.run(scenario()) == (True, True)
