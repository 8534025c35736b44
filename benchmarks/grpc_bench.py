"""gepool's KServe v2 gRPC and HTTP endpoints against PyTriton's, with perf_analyzer (benchmarks/README.md).

    python benchmarks/grpc_bench.py [--seconds S] [--peer pytriton|none] [--triton-grpc HOST:PORT]
        [--models tiny,mlp] [--levels 1,8,64] [--grpc-server native|grpcio]
        [--compare-servers | --compare-io | --compare-sync [--sync-threads N]] [--rounds N]

Runs ``perf_analyzer -i grpc`` (unary and ``--streaming``) and ``-i http`` against one pool at
concurrency 1, 8 and 64 on tiny and mlp, and the same commands against PyTriton (Triton's own fronts,
onnxruntime in its infer callable, started by ``peers.start_pytriton``) serving the same ONNX files
with the same batching (max batch 32, preferred 8/16/32, 1 ms delay), so both come from one run on one
host. With ``--peer none``, or when PyTriton cannot start (the reason is printed), gepool's gRPC is
compared with its own HTTP. ``--triton-grpc`` adds any running Triton serving models of the same
names. perf_analyzer comes from the tritonclient 2.40.0 wheel (see .ci/run).

Every gepool cell also gets the sidecar's CPU per request (utime+stime from /proc over the requests
the pool counted in the same window) and its context switches per request (every thread's, from
/proc/PID/task/*/status): a thread hand-off costs one of each, and on a busy host a wait for a core.
``--compare-servers`` alternates, round by round (the order swapped each round), two pools that differ
only in what serves their gRPC port: gepool's native server and grpc.aio (``--grpc-server``).
``--compare-io`` alternates, round by round, two pools that differ only in grpcio's socket I/O: on
grpcio's EventEngine threads (its default, "engine") or on the thread that polls the completion queue
(GRPC_EXPERIMENTS turning the EventEngine listener and endpoints off, "poller"). ``--compare-sync``
alternates, on one pool, gRPC unary through its grpc.aio sidecar, through a sync ``grpc.server`` whose
handler threads call the front with the sync client (grpc_sync_proto.py, a process of its own) and HTTP.
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile

import peers
from gateway_bench import cpu_seconds, processes

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
CONCURRENCY = (1, 8, 64)
MODELS = ("tiny", "mlp")
NAN = {"rps": float("nan"), "p50_us": float("nan"), "p99_us": float("nan")}
# GRPC_EXPERIMENTS for socket I/O on the completion-queue thread (grpcio reads it when the sidecar imports it)
POLLER_IO = "-event_engine_listener,-event_engine_for_all_other_endpoints"


def switches_by_thread(pid: int) -> dict[str, int]:
    """"tid name" -> the thread's voluntary + nonvoluntary context switches so far, for every thread of pid."""
    out = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                out[f"{tid} {name}"] = sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
        except OSError:
            pass  # a thread that ended
    return out


def context_switches(pid: int) -> int:
    return sum(switches_by_thread(pid).values())


class Sidecar:
    """The pool's sidecar process and the pool's own count of successful requests per model."""

    def __init__(self, pool, grpc_url: str, pid: int | None = None) -> None:
        self.pid = pid or processes(pool.process.pid, None)["sidecar"]
        self.url = grpc_url

    def served(self, model: str) -> int:
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(self.url) as client:
            stats = client.get_inference_statistics(model, as_json=True)
        return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))

    def measure(self, model: str, run) -> dict | None:
        """``run()``'s perf_analyzer row with the sidecar's CPU and context switches per request added."""
        n0, cpu0, cs0 = self.served(model), cpu_seconds(self.pid), switches_by_thread(self.pid)
        row = run()
        n = max(1, self.served(model) - n0)
        if row is not None:
            cs = switches_by_thread(self.pid)
            row["cpu_us"] = 1e6 * (cpu_seconds(self.pid) - cpu0) / n
            per = {t: (c - cs0.get(t, 0)) / n for t, c in cs.items()}
            row["cs"] = sum(per.values())
            row["cs_threads"] = sorted(((v, t) for t, v in per.items() if v >= 0.5), reverse=True)
        return row


def perf_analyzer(model: str, url: str, protocol: str, concurrency: int, seconds: float,
                  streaming: bool = False, stability: float = 10.0) -> dict | None:
    from tests.test_http import _perf_analyzer_env

    env = _perf_analyzer_env()
    if env is None:
        return None
    fd, out = tempfile.mkstemp(suffix=".csv")
    os.close(fd)
    try:
        proc = subprocess.run(["perf_analyzer", "-m", model, "-u", url, "-i", protocol,
                               *(["--streaming"] if streaming else []), "--concurrency-range", str(concurrency),
                               "--measurement-interval", str(int(seconds * 1000)),
                               "--stability-percentage", str(stability), "-f", out],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"perf_analyzer {protocol} {model} c={concurrency} on {url} failed:", proc.stdout[-1500:],
                  proc.stderr[-1500:])
            return None
        with open(out) as f:
            row = next(csv.DictReader(f))
    finally:
        os.unlink(out)
    return {"rps": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
            "p99_us": float(row["p99 latency"])}


def check_answers(url: str, repo: str) -> None:
    """One tritonclient.grpc request per model, equal to onnxruntime run here: both servers do the same work."""
    import numpy as np
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        for model in MODELS:
            session = ort.InferenceSession(f"{repo}/{model}/1/model.onnx", providers=["CPUExecutionProvider"])
            (meta,), (out,) = session.get_inputs(), session.get_outputs()
            x = np.random.default_rng(0).standard_normal((1, meta.shape[1])).astype(np.float32)
            tensor = grpcclient.InferInput(meta.name, list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            got = client.infer(model, [tensor]).as_numpy(out.name)
            np.testing.assert_allclose(got, session.run(None, {meta.name: x})[0], rtol=1e-4, atol=1e-4)


def table(rows: list) -> None:
    """req/s, p50 and p99 in us per endpoint; for gepool's, the sidecar's CPU us and context switches per
    request."""
    print(f"{'model':6s} {'conc':>4s} | " + " | ".join(f"{k:>14s} req/s p50 us p99 us cpu us  cs" for k in rows[0][2]))
    for model, conc, runs in rows:
        cells = [r or NAN for r in runs.values()]
        print(f"{model:6s} {conc:4d} | " + " | ".join(
            f"{c['rps']:20.0f} {c['p50_us']:6.0f} {c['p99_us']:6.0f} {c.get('cpu_us', float('nan')):6.0f} "
            f"{c.get('cs', float('nan')):3.0f}" for c in cells))


def ratios(rows: list, ours: str, theirs: str) -> None:
    """gepool's row against the bar's: throughput ratio and p99 ratio (the issue's goal: >= 1 and < 1)."""
    print(f"\n{ours} against {theirs}: req/s ratio (goal >= 1), p99 ratio (goal < 1)")
    for model, conc, runs in rows:
        a, b = runs.get(ours) or NAN, runs.get(theirs) or NAN
        print(f"{model:6s} {conc:4d}   {a['rps'] / b['rps']:5.2f}x   {a['p99_us'] / b['p99_us']:5.2f}x")


def gepool_runs(pool, model: str, conc: int, pa, http: bool = True, tag: str = "gepool") -> dict:
    """One level against one pool: gRPC unary and streaming, and HTTP, with the sidecar's figures."""
    local = f"127.0.0.1:{pool.grpc_port}"
    side = Sidecar(pool, local)
    runs = {f"{tag}-grpc": side.measure(model, lambda: pa(model, local, "grpc", conc)),
            f"{tag}-stream": side.measure(model, lambda: pa(model, local, "grpc", conc, streaming=True))}
    if http:
        runs[f"{tag}-http"] = side.measure(model, lambda: pa(model, f"127.0.0.1:{pool.http_port}", "http", conc))
    return runs


def compare_servers(repo: str, args, pa) -> None:
    """Rounds alternating a pool whose gRPC port is served by the native server with one served by grpc.aio,
    the same levels on each; HTTP on the native one's pool, as the bar both should reach."""
    from gepool import Pool

    rows: dict[tuple, dict] = {}
    kinds = ("native", "grpcio")
    for rnd in range(args.rounds):
        for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
            with Pool(repo, http_port=peers.free_port(), grpc_port=peers.free_port(), cpu_threads=args.threads,
                      grpc_server=kind) as pool:
                check_answers(f"127.0.0.1:{pool.grpc_port}", repo)
                for model in args.models:
                    for conc in args.levels:
                        runs = gepool_runs(pool, model, conc, pa, http=kind == "native", tag=kind)
                        rows.setdefault((model, conc), {}).update({f"{k}#{rnd}": v for k, v in runs.items()})
    print(f"\n{args.rounds} round(s) alternating; {args.threads} onnxruntime thread(s); window {args.seconds:g} s")
    for rnd in range(args.rounds):
        print(f"\nround {rnd}")
        cells = [(m, c, {k.split("#")[0]: v for k, v in runs.items() if k.endswith(f"#{rnd}")})
                 for (m, c), runs in rows.items()]
        table(cells)
        ratios(cells, "native-grpc", "grpcio-grpc")
        ratios(cells, "native-stream", "grpcio-stream")
        ratios(cells, "native-grpc", "native-http")


def compare_io(repo: str, args, pa) -> None:
    """Rounds alternating a pool whose gRPC socket I/O runs on grpcio's EventEngine threads (its default)
    with one whose I/O runs on the completion-queue thread, the same levels on each."""
    from gepool import Pool

    rows: dict[tuple, dict] = {}
    for rnd in range(args.rounds):
        for tag, experiments in (("engine", None), ("poller", POLLER_IO)):
            saved = os.environ.get("GRPC_EXPERIMENTS")
            if experiments is not None:
                os.environ["GRPC_EXPERIMENTS"] = experiments  # the sidecar inherits it
            try:
                pool = Pool(repo, http_port=peers.free_port(), grpc_port=peers.free_port(), cpu_threads=args.threads,
                            grpc_server="grpcio")
                pool.start()
            finally:
                if experiments is not None:
                    if saved is None:
                        os.environ.pop("GRPC_EXPERIMENTS", None)
                    else:
                        os.environ["GRPC_EXPERIMENTS"] = saved
            try:
                for model in args.models:
                    for conc in args.levels:
                        runs = gepool_runs(pool, model, conc, pa, http=tag == "engine", tag=tag)
                        rows.setdefault((model, conc), {}).update({f"{k}#{rnd}": v for k, v in runs.items()})
            finally:
                pool.stop()
    print(f"\n{args.rounds} round(s) alternating; {args.threads} onnxruntime thread(s); window {args.seconds:g} s")
    for rnd in range(args.rounds):
        print(f"\nround {rnd}")
        table([(m, c, {k.split("#")[0]: v for k, v in runs.items() if k.endswith(f"#{rnd}")})
               for (m, c), runs in rows.items()])


def compare_sync(repo: str, args, pa) -> None:
    """Rounds alternating, on one pool, gRPC unary through the pool's grpc.aio sidecar, through
    grpc_sync_proto.py's sync grpc.server (a process of its own on the same pool), and HTTP."""
    from gepool import Pool

    rows: dict[tuple, dict] = {}
    with Pool(repo, http_port=peers.free_port(), grpc_port=peers.free_port(), cpu_threads=args.threads,
              grpc_server="grpcio") as pool:
        port = peers.free_port()
        proto = subprocess.Popen([sys.executable, os.path.join(HERE, "grpc_sync_proto.py"), "--endpoint",
                                  pool.endpoint, "--port", str(port), "--threads", str(args.sync_threads)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            if proto.stdout.readline().strip() != "ready":
                raise SystemExit("grpc_sync_proto.py did not start (its error is above)")
            check_answers(f"127.0.0.1:{port}", repo)
            aio = Sidecar(pool, f"127.0.0.1:{pool.grpc_port}")
            sync = Sidecar(pool, aio.url, pid=proto.pid)
            cells = [("aio-grpc", aio, f"127.0.0.1:{pool.grpc_port}", "grpc"),
                     ("sync-grpc", sync, f"127.0.0.1:{port}", "grpc"),
                     ("http", aio, f"127.0.0.1:{pool.http_port}", "http")]
            for rnd in range(args.rounds):
                for model in args.models:
                    for conc in args.levels:
                        runs = rows.setdefault((model, conc, rnd), {})
                        for tag, side, url, protocol in (cells if rnd % 2 == 0 else cells[::-1]):
                            runs[tag] = side.measure(model, lambda m=model, u=url, p=protocol, c=conc: pa(m, u, p, c))
        finally:
            proto.terminate()
            proto.wait(30)
    print(f"\n{args.rounds} round(s) alternating the order; {args.threads} onnxruntime thread(s); "
          f"{args.sync_threads} sync handler threads; window {args.seconds:g} s")
    for rnd in range(args.rounds):
        print(f"\nround {rnd}")
        table([(m, c, {k: runs[k] for k in ("aio-grpc", "sync-grpc", "http")})
               for (m, c, r), runs in rows.items() if r == rnd])
    print("\ncontext switches per request by thread (tid name: count; threads under 0.5 left out)")
    for (m, c, r), runs in rows.items():
        for tag, row in runs.items():
            if row is not None:
                print(f"{m:6s} {c:4d} #{r} {tag:9s} " + ", ".join(f"{t}: {v:.1f}" for v, t in row["cs_threads"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="perf_analyzer's measurement window")
    parser.add_argument("--peer", choices=("pytriton", "none"), default="pytriton")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="onnxruntime threads per model, gepool's and the peer's (default: every core)")
    parser.add_argument("--stability", type=float, default=10.0,
                        help="perf_analyzer's --stability-percentage (raise it on a busy host)")
    parser.add_argument("--triton-grpc", help="HOST:PORT of a Triton gRPC endpoint serving tiny and mlp")
    parser.add_argument("--models", type=lambda t: t.split(","), default=list(MODELS))
    parser.add_argument("--levels", type=lambda t: [int(c) for c in t.split(",")], default=list(CONCURRENCY))
    parser.add_argument("--grpc-server", choices=("native", "grpcio"), default=None,
                        help="what serves the pool's gRPC port (default: the pool's default)")
    parser.add_argument("--compare-servers", action="store_true",
                        help="rounds alternating pools on the native gRPC server and on grpc.aio")
    parser.add_argument("--compare-io", action="store_true",
                        help="gepool only: alternate gRPC socket I/O on grpcio's EventEngine threads (its "
                             "default) and on the completion-queue thread, --rounds times")
    parser.add_argument("--compare-sync", action="store_true",
                        help="gepool only: alternate gRPC unary through the grpc.aio sidecar, through a sync "
                             "grpc.server (grpc_sync_proto.py) and HTTP, --rounds times")
    parser.add_argument("--sync-threads", type=int, default=8, help="--compare-sync: the sync server's threads")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from gepool import Pool

    repo = peers.matched_repo("gepool-grpc-bench-")

    def pa(model: str, url: str, protocol: str, conc: int, **kw) -> dict | None:
        return perf_analyzer(model, url, protocol, conc, args.seconds, stability=args.stability, **kw)

    if args.compare_servers or args.compare_io or args.compare_sync:
        try:
            (compare_servers if args.compare_servers else compare_io if args.compare_io else compare_sync)(
                repo, args, pa)
        finally:
            shutil.rmtree(repo, ignore_errors=True)
        return
    peer = None
    if args.peer == "pytriton":
        try:
            peer = peers.start_pytriton(repo, threads=args.threads)
        except (peers.PeerUnavailable, OSError) as exc:
            print(f"PyTriton cannot run here, so gepool's gRPC is compared with its HTTP only: {exc}")
    http_port, grpc_port = peers.free_port(), peers.free_port()
    rows = []
    try:
        with Pool(repo, http_port=http_port, grpc_port=grpc_port, cpu_threads=args.threads,
                  **({"grpc_server": args.grpc_server} if args.grpc_server else {})) as pool:
            check_answers(f"127.0.0.1:{grpc_port}", repo)
            if peer is not None:
                check_answers(f"127.0.0.1:{peer[1]}", repo)
            for model in args.models:
                for conc in args.levels:
                    runs = gepool_runs(pool, model, conc, pa)
                    if peer is not None:
                        runs["pytriton-grpc"] = pa(model, f"127.0.0.1:{peer[1]}", "grpc", conc)
                        runs["pytriton-http"] = pa(model, f"127.0.0.1:{peer[0]}", "http", conc)
                    if args.triton_grpc:
                        runs["triton-grpc"] = pa(model, args.triton_grpc, "grpc", conc)
                    rows.append((model, conc, runs))
    finally:
        if peer is not None:
            peer[2]()
        shutil.rmtree(repo, ignore_errors=True)
    print(f"\nmax batch {peers.MAX_BATCH}, preferred {list(peers.PREFERRED)}, delay {peers.DELAY_US} us on both; "
          f"{args.threads} onnxruntime thread(s); perf_analyzer window {args.seconds:g} s, batch 1")
    table(rows)
    if peer is not None:
        ratios(rows, "gepool-grpc", "pytriton-grpc")
        ratios(rows, "gepool-http", "pytriton-http")
    else:
        ratios(rows, "gepool-grpc", "gepool-http")
    if any(r is None for _, _, runs in rows for r in runs.values()):
        print("(a perf_analyzer run failed or could not start: see its output above, and .ci/run for the binary)")


if __name__ == "__main__":
    main()
