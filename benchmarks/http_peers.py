"""gepool's KServe v2 HTTP against PyTriton's and Mosec's, with wrk posting the same JSON body (benchmarks/README.md).

    python benchmarks/http_peers.py [--seconds S] [--threads N] [--peers pytriton,mosec]

One pool, PyTriton and Mosec serve the same ONNX files with the same batching (peers.matched_repo:
max batch 32, 1 ms wait; PyTriton and gepool also prefer 8/16/32) and onnxruntime on ``--threads``
threads; wrk posts one KServe v2 JSON row at concurrency 1, 8 and 64 on tiny and mlp to each in turn.
Per level: req/s, p50/p99, errors, and the CPU per request of the server's processes (from /proc: the
pool's front, workers and HTTP sidecar; the peer's whole session) and of wrk. A peer that cannot start
is left out with the reason printed.
"""

import argparse
import os
import shutil
import sys

import loadgen
import numpy as np
import peers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
CONCURRENCY = (1, 8, 64)
MODELS = {"tiny": "INPUT0", "mlp": "INPUT"}
NAN = float("nan")


def body_for(repo: str, model: str) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The wrk body of one row, its input and onnxruntime's answer for it."""
    import onnxruntime as ort

    session = ort.InferenceSession(f"{repo}/{model}/1/model.onnx", providers=["CPUExecutionProvider"])
    (meta,) = session.get_inputs()
    x = np.random.default_rng(0).standard_normal((1, meta.shape[1])).astype(np.float32)
    return loadgen.kserve_json(meta.name, x), x, session.run(None, {meta.name: x})[0]


def check_answer(url: str, body: bytes, want: np.ndarray) -> None:
    import json
    import urllib.request

    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=loadgen.REQUEST_TIMEOUT_S) as r:
        (tensor,) = json.loads(r.read())["outputs"]
    np.testing.assert_allclose(np.asarray(tensor["data"], np.float32).reshape(tensor["shape"]), want,
                               rtol=1e-4, atol=1e-4)


def server_cpu(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far per server: a peer's session under its root, gepool everything else below here."""
    below = loadgen.descendants(os.getpid())
    owned = {pid: name for name, root in roots.items() for pid in [root, *loadgen.descendants(root)]}
    totals = {name: 0.0 for name in ["gepool", *roots]}
    for pid in below:
        totals[owned.get(pid, "gepool")] += loadgen.cpu_s(pid)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each level")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="onnxruntime threads per model, gepool's and the peers' (default: every core)")
    parser.add_argument("--peers", default="pytriton,mosec", help="which peers to start beside gepool")
    args = parser.parse_args()
    unknown = sorted(set(args.peers.split(",")) - {"pytriton", "mosec"})
    if unknown:
        parser.error(f"--peers: no peer {', '.join(unknown)} (pytriton, mosec)")
    if shutil.which("wrk") is None:
        sys.exit("http_peers.py needs wrk (apt-get install wrk)")

    from gepool import Pool

    repo = peers.matched_repo("gepool-http-peers-")
    targets: dict[str, str] = {}
    stops, roots, rows = [], {}, []
    try:
        for name in args.peers.split(","):
            try:
                if name == "pytriton":
                    http_port, _, stop = peers.start_pytriton(repo, threads=args.threads)
                else:
                    http_port, stop = peers.start_mosec(repo, threads=args.threads)
            except (peers.PeerUnavailable, OSError) as exc:
                print(f"{name} left out: {exc}")
                continue
            stops.append(stop)
            roots[name] = stop.pid
            targets[name] = f"http://127.0.0.1:{http_port}"
        port = peers.free_port()
        with Pool(repo, http_port=port, grpc_port=0, cpu_threads=args.threads):
            targets = {"gepool": f"http://127.0.0.1:{port}", **targets}
            bodies = {model: body_for(repo, model) for model in MODELS}
            for url in targets.values():
                for model, (body, _, want) in bodies.items():
                    check_answer(f"{url}/v2/models/{model}/infer", body, want)
            for model, (body, _, _) in bodies.items():
                for conc in CONCURRENCY:
                    for server, url in targets.items():
                        before = server_cpu(roots)
                        result = loadgen.wrk(f"{url}/v2/models/{model}/infer", body, conc, args.seconds)
                        after = server_cpu(roots)
                        if result is not None:
                            result["server_cpu_s"] = after[server] - before[server]
                        rows.append((model, conc, server, result))
    finally:
        for stop in stops:
            stop()
        shutil.rmtree(repo, ignore_errors=True)
    print(f"\nmax batch {peers.MAX_BATCH}, wait {peers.DELAY_US} us, {args.threads} onnxruntime thread(s); wrk, one "
          f"JSON row per request, {args.seconds:g} s per level; CPU in us per request")
    print(f"{'model':5s} {'conc':>4s} {'server':8s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'err':>4s} "
          f"{'server CPU':>10s} {'wrk CPU':>8s}")
    for model, conc, server, r in rows:
        if r is None:
            print(f"{model:5s} {conc:4d} {server:8s} (wrk failed)")
            continue
        n = max(r["requests"], 1)
        print(f"{model:5s} {conc:4d} {server:8s} {r['rps']:7.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
              f"{r['errors']:4d} {r['server_cpu_s'] / n * 1e6:10.0f} {r['client_cpu_s'] / n * 1e6:8.0f}")
    by = {(m, c, s): r for m, c, s, r in rows if r is not None}
    for peer in roots:
        print(f"\ngepool against {peer}: req/s ratio, p99 ratio")
        for model in MODELS:
            for conc in CONCURRENCY:
                a, b = by.get((model, conc, "gepool")), by.get((model, conc, peer))
                if a and b:
                    print(f"{model:5s} {conc:4d}   {a['rps'] / b['rps']:5.2f}x   {a['p99_ms'] / b['p99_ms']:5.2f}x")


if __name__ == "__main__":
    main()
