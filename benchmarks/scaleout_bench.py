"""Plain Ray Serve with onnxruntime against gepool replicas on Ray Serve, through the handle and over HTTP.

    python benchmarks/scaleout_bench.py [--seconds S] [--replicas N] [--num-cpus C] [--threads T]
                                        [--ray-cpus N | --address auto] [--only peer|gepool]

One local Ray (``--ray-cpus``, default 2, loopback only) runs, one after the other, two Serve applications
on the same ONNX files with the same batching (max batch 32, 1 ms wait): the peer, a ``@serve.deployment``
whose ``@serve.batch`` methods run onnxruntime (what a Ray user writes), and ``gepool.ray.build`` (one gepool
pool per replica). Each is loaded at concurrency 1, 8 and 64 on tiny and mlp through the Serve handle from
this process (asyncio) and over HTTP through Serve's proxy (wrk posting a KServe v2 JSON body; an aiohttp
loop when wrk is missing). Per level: req/s, p50/p99, what the server side saw (average batch and the
time a request spent inside the pool, or the peer's batch handler), and the CPU per request of each
process Ray and gepool run (every descendant of this process, from /proc, grouped by its title), of this
process and of wrk. Ray is stopped at the end, and the script fails (exit 1) if a gepool process or
segment outlives it.
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import sys
import time

import loadgen
import numpy as np
import peers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
CONCURRENCY = (1, 8, 64)
MODELS = {"tiny": ("INPUT0", "OUTPUT0", 16), "mlp": ("INPUT", "LOGITS", 1024)}
WAIT_S = peers.DELAY_US / 1e6
WARMUP_REQUESTS = 20
OBJECT_STORE_BYTES = 128 << 20  # Ray's default is 30% of the memory, in /dev/shm
REQUEST_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 60.0
CPU_SHARE_SHOWN = 0.02  # process groups under this share of the level's CPU are summed as "other"


# -- the peer: what a Ray Serve user writes for an ONNX model ------------------------------------------------
def peer_deployment(serve):
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    @serve.deployment(name="ort")
    class OrtPeer:
        """onnxruntime sessions for tiny and mlp, each behind its own ``@serve.batch`` queue."""

        def __init__(self, repo: str, threads: int) -> None:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.sessions = {m: ort.InferenceSession(f"{repo}/{m}/1/model.onnx", opts,
                                                     providers=["CPUExecutionProvider"]) for m in MODELS}
            self.counts = {m: {"requests": 0, "batches": 0, "rows": 0, "compute_us": 0.0} for m in MODELS}
            self.batched = {"tiny": self.run_tiny, "mlp": self.run_mlp}

        def run(self, model: str, xs: list[np.ndarray]) -> list[np.ndarray]:
            name, out, _ = MODELS[model]
            t = time.perf_counter()
            y = self.sessions[model].run([out], {name: np.concatenate(xs)})[0]
            c = self.counts[model]
            c["requests"] += len(xs)
            c["batches"] += 1
            c["rows"] += sum(len(x) for x in xs)
            c["compute_us"] += (time.perf_counter() - t) * 1e6
            return np.split(y, np.cumsum([len(x) for x in xs])[:-1])

        @serve.batch(max_batch_size=peers.MAX_BATCH, batch_wait_timeout_s=WAIT_S)
        async def run_tiny(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            return self.run("tiny", xs)

        @serve.batch(max_batch_size=peers.MAX_BATCH, batch_wait_timeout_s=WAIT_S)
        async def run_mlp(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            return self.run("mlp", xs)

        async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            name, out, _ = MODELS[model]
            return {out: await self.batched[model](inputs[name])}

        async def __call__(self, request: Request) -> JSONResponse:
            found = re.fullmatch(r"/v2/models/(tiny|mlp)/infer", request.url.path)
            if found is None or request.method != "POST":
                return JSONResponse({"error": "not found"}, status_code=404)
            model = found[1]
            body = json.loads(await request.body())
            (tensor,) = body["inputs"]
            x = np.asarray(tensor["data"], np.float32).reshape(tensor["shape"])
            y = await self.batched[model](x)
            out = MODELS[model][1]
            return JSONResponse({"model_name": model, "outputs": [
                {"name": out, "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}]})

        def stats_with_id(self) -> tuple[dict, str]:
            """This replica's counters per model, and its id."""
            return {m: dict(c) for m, c in self.counts.items()}, serve.get_replica_context().replica_id.unique_id

    return OrtPeer


# -- CPU per process, from /proc ----------------------------------------------------------------------------
def cpu_snapshot(known: dict[int, str]) -> dict[int, tuple[str, float]]:
    """pid -> (group, CPU seconds so far); ``known`` names processes a title does not (gepool's workers)."""
    below = loadgen.descendants(os.getpid())
    snap = {pid: (known.get(pid, name), loadgen.cpu_s(pid)) for pid, name in below.items()}
    snap[os.getpid()] = ("this process (handle client)", loadgen.cpu_s(os.getpid()))
    return snap


def cpu_by_group(before: dict, after: dict) -> dict[str, float]:
    groups: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        spent = cpu - before.get(pid, (name, 0.0))[1]
        groups[name] = groups.get(name, 0.0) + max(spent, 0.0)
    return groups


# -- load ---------------------------------------------------------------------------------------------------
def inputs_for(model: str) -> dict[str, np.ndarray]:
    name, _, width = MODELS[model]
    return {name: np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)}


def summary(lat: list[float], errors: int, elapsed: float) -> dict:
    arr = np.array(lat) if lat else np.array([float("nan")])
    return {"requests": len(lat), "errors": errors, "rps": len(lat) / elapsed,
            "p50_ms": float(np.median(arr)) * 1e3, "p99_ms": float(np.percentile(arr, 99)) * 1e3,
            "client_cpu_s": 0.0}


async def handle_level(handle, model: str, concurrency: int, seconds: float) -> dict:
    x = inputs_for(model)
    for _ in range(WARMUP_REQUESTS):
        await handle.infer.remote(model, x)
    lat: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal errors
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                await asyncio.wait_for(handle.infer.remote(model, x), REQUEST_TIMEOUT_S)
            except Exception:  # counted, not fatal: the level reports them
                errors += 1
                continue
            lat.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return summary(lat, errors, time.perf_counter() - start)


def kserve_body(model: str) -> bytes:
    (name, x), = inputs_for(model).items()
    return loadgen.kserve_json(name, x)


async def aiohttp_level(url: str, model: str, concurrency: int, seconds: float) -> dict:
    import aiohttp

    body, target = kserve_body(model), f"{url}/v2/models/{model}/infer"
    headers = {"Content-Type": "application/json"}
    lat: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        for _ in range(WARMUP_REQUESTS):
            async with session.post(target, data=body, headers=headers) as r:
                await r.read()
        stop = time.perf_counter() + seconds

        async def caller() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                t = time.perf_counter()
                try:
                    async with session.post(target, data=body, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except Exception:  # counted, not fatal
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return summary(lat, errors, time.perf_counter() - start)


# -- the server's own view ----------------------------------------------------------------------------------
def gepool_window(before: dict, after: dict, model: str) -> str:
    reqs = sum(a[model]["requests"] - before.get(rid, {}).get(model, {}).get("requests", 0) for rid, a in after.items())
    batches = sum(a[model]["batches"] - before.get(rid, {}).get(model, {}).get("batches", 0)
                  for rid, a in after.items())
    rows = sum(a[model]["rows"] - before.get(rid, {}).get(model, {}).get("rows", 0) for rid, a in after.items())
    inside = sum(a[model]["request_us"] - before.get(rid, {}).get(model, {}).get("request_us", 0)
                 for rid, a in after.items())
    compute = sum(a[model]["compute_us"] - before.get(rid, {}).get(model, {}).get("compute_us", 0)
                  for rid, a in after.items())
    return (f"batch {rows / max(batches, 1):4.1f}, in pool {inside / max(reqs, 1) / 1e3:6.2f} ms/req, "
            f"compute {compute / max(batches, 1) / 1e3:6.2f} ms/batch")


def peer_window(before: dict, after: dict, model: str) -> str:
    d = {k: sum(a[model][k] - before.get(rid, {}).get(model, {}).get(k, 0) for rid, a in after.items())
         for k in ("requests", "batches", "rows", "compute_us")}
    batches = max(d["batches"], 1)
    return f"batch {d['rows'] / batches:4.1f}, compute {d['compute_us'] / batches / 1e3:6.2f} ms/batch"


def replica_stats(handle, kind: str, replicas: int) -> dict:
    """replica -> {model: counters}, asking until every replica answered (Serve routes each call)."""
    seen: dict[str, dict] = {}
    for _ in range(10 * replicas):
        if kind == "gepool":
            info = handle.pool_info.remote().result(timeout_s=REQUEST_TIMEOUT_S)
            seen[info["replica_id"]] = info["stats"]
        else:
            stats, rid = handle.stats_with_id.remote().result(timeout_s=REQUEST_TIMEOUT_S)
            seen[rid] = stats
        if len(seen) >= replicas:
            break
    return seen


# -- the run ------------------------------------------------------------------------------------------------
def check_answers(handle, url: str, repo: str) -> None:
    """One request per model through the handle and over HTTP, each equal to onnxruntime run here: the
    levels measure the same work on both applications."""
    import urllib.request

    import onnxruntime as ort

    for model, (_, out, _) in MODELS.items():
        x = inputs_for(model)
        want = ort.InferenceSession(f"{repo}/{model}/1/model.onnx", providers=["CPUExecutionProvider"]).run(None, x)[0]
        got = handle.infer.remote(model, x).result(timeout_s=REQUEST_TIMEOUT_S)[out]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        request = urllib.request.Request(f"{url}/v2/models/{model}/infer", kserve_body(model),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
            (tensor,) = json.loads(r.read())["outputs"]
        np.testing.assert_allclose(np.asarray(tensor["data"], np.float32).reshape(tensor["shape"]), want,
                                   rtol=1e-4, atol=1e-4)


def run_app(kind: str, app, serve, url: str, args, results: list, pids: set) -> None:
    handle = serve.run(app, name=kind, route_prefix="/")
    known: dict[int, str] = {}
    if kind == "gepool":
        fronts: set[int] = set()
        for _ in range(20 * args.replicas):  # Serve routes each call: ask until every replica answered
            info = handle.pool_info.remote().result(timeout_s=REQUEST_TIMEOUT_S)
            fronts.add(info["front_pid"])
            known[info["front_pid"]] = "gepool front"
            known.update((p, f"gepool worker ({m})") for m, s in info["status"]["models"].items()
                         for p in s["worker_pids"])
            if len(fronts) >= args.replicas:
                break
        pids.update(known)
    check_answers(handle, url, args.repo)
    window = gepool_window if kind == "gepool" else peer_window
    for model in MODELS:
        for path in ("handle", "http"):
            for conc in CONCURRENCY:
                before_stats = replica_stats(handle, kind, args.replicas)
                before = cpu_snapshot(known)
                if path == "handle":
                    result = asyncio.run(handle_level(handle, model, conc, args.seconds))
                elif shutil.which("wrk"):
                    result = loadgen.wrk(f"{url}/v2/models/{model}/infer", kserve_body(model), conc, args.seconds)
                else:
                    result = asyncio.run(aiohttp_level(url, model, conc, args.seconds))
                after = cpu_snapshot(known)
                if result is None:
                    continue
                result["server"] = window(before_stats, replica_stats(handle, kind, args.replicas), model)
                result["cpu"] = cpu_by_group(before, after)
                if result["client_cpu_s"]:
                    result["cpu"]["wrk (HTTP client)"] = result["client_cpu_s"]
                results.append((kind, model, path, conc, result))
                print(f"{kind:6s} {model:4s} {path:6s} c={conc:<3d} {result['rps']:7.0f} req/s  p50 "
                      f"{result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:7.2f} ms  errors {result['errors']}",
                      file=sys.stderr, flush=True)
    serve.delete(kind)


def report(results: list, args) -> None:
    print(f"\nRay Serve on {args.ray_cpus} CPUs: {args.replicas} replica(s) per application, {args.num_cpus} CPU and "
          f"{args.threads} onnxruntime thread(s) each; max batch {peers.MAX_BATCH}, wait {peers.DELAY_US} us; "
          f"{args.seconds:g} s per level; batch 1 per request")
    print(f"{'app':6s} {'model':5s} {'path':6s} {'conc':>4s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'err':>4s}"
          "  server side")
    for kind, model, path, conc, r in results:
        print(f"{kind:6s} {model:5s} {path:6s} {conc:4d} {r['rps']:7.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
              f"{r['errors']:4d}  {r['server']}")
    print("\nCPU per request (us) by process, per level (processes under "
          f"{CPU_SHARE_SHOWN:.0%} of the level's CPU summed as 'other'):")
    for kind, model, path, conc, r in results:
        n = max(r["requests"], 1)
        total = sum(r["cpu"].values())
        shown = {k: v for k, v in sorted(r["cpu"].items(), key=lambda kv: -kv[1]) if v >= CPU_SHARE_SHOWN * total}
        other = total - sum(shown.values())
        cells = ", ".join(f"{k} {v / n * 1e6:.0f}" for k, v in shown.items())
        print(f"{kind:6s} {model:5s} {path:6s} c={conc:<3d} total {total / n * 1e6:6.0f}: {cells}"
              + (f", other {other / n * 1e6:.0f}" if other > 0 else ""))
    by = {(k, m, p, c): r for k, m, p, c, r in results}
    print("\ngepool against the peer (req/s ratio, p99 ratio):")
    for (kind, model, path, conc), r in by.items():
        peer = by.get(("peer", model, path, conc))
        if kind == "gepool" and peer:
            print(f"{model:5s} {path:6s} c={conc:<3d} {r['rps'] / peer['rps']:5.2f}x  "
                  f"{r['p99_ms'] / peer['p99_ms']:5.2f}x")


def wait_gone(pids: set) -> list[int]:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and cpu_state(p) != "Z"]
        time.sleep(0.2)
    return alive


def cpu_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each level")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of each application")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each replica reserves")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime threads per model in each replica")
    parser.add_argument("--ray-cpus", type=int, default=2, help="CPUs the local Ray schedules")
    parser.add_argument("--only", choices=("peer", "gepool"), help="run one application")
    parser.add_argument("--address", help="join this Ray cluster ('auto', HOST:PORT) instead of starting one; "
                                          "the CPU per process then covers only what this process started")
    args = parser.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from gepool.ipc import naming
    from gepool.ray import build

    repo = args.repo = peers.matched_repo("gepool-scaleout-")
    port = peers.free_port()
    results: list = []
    pids: set[int] = set()
    if args.address:
        ray.init(address=args.address, logging_level="warning")
    else:
        ray.init(num_cpus=args.ray_cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                 logging_level="warning", _node_ip_address="127.0.0.1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # after ray.init: the finally below stops Ray
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        peer = peer_deployment(serve).options(num_replicas=args.replicas, max_ongoing_requests=2 * peers.MAX_BATCH,
                                              ray_actor_options={"num_cpus": args.num_cpus})
        apps = {"peer": peer.bind(repo, args.threads),
                "gepool": build(repo, replicas=args.replicas, num_cpus=args.num_cpus, cpu_threads=args.threads)}
        for kind, app in apps.items():
            if args.only in (None, kind):
                run_app(kind, app, serve, url, args, results, pids)
    finally:
        if args.address:
            for kind in ("peer", "gepool"):  # leave the cluster's own Serve running
                serve.delete(kind)
        else:
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(repo, ignore_errors=True)
    report(results, args)
    if not shutil.which("wrk"):
        print("(HTTP levels ran on an aiohttp loop in this process: wrk is not installed)")
    alive = wait_gone(pids)
    left = [e for e in naming.list_segments() if naming.owner_pid(e) in pids]
    if alive or left:
        print(f"LEFT BEHIND after Ray stopped: gepool processes {alive}, segments {left}")
        return 1
    print(f"Ray stopped; the {len(pids)} gepool processes exited and left no segment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
