"""The classify ensemble (preprocess -> mlp -> topk, scheduled in the front) against the same three calls
made one after another by a client, over the library client and HTTP, at each concurrency.

    python benchmarks/ensemble_bench.py --seconds 10 [--concurrency 1 16] [--carriers library http]

For each carrier and concurrency it prints throughput (requests/s of one image each), latency p50/p99,
and for the ensemble its per-step overhead: mean ensemble latency minus the mean of its steps' compute
(the front's stats, summed over the steps each request ran in), divided by the number of steps. The
steps alone (each model called directly at the highest concurrency) give the slowest step's own
throughput, which the ensemble's is compared with. A JSON line per measurement follows the table.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

WIDTH, STEPS = 1024, ("preprocess", "mlp", "topk")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LibraryCalls:
    """One library client per thread."""

    def __init__(self, endpoint: str) -> None:
        from gepool import Client

        self.client = Client(endpoint, timeout=120)

    def ensemble(self, x: np.ndarray) -> np.ndarray:
        return self.client.infer("classify", {"IMAGE": x})["CLASSES"]

    def chain(self, x: np.ndarray) -> np.ndarray:
        normed = self.client.infer("preprocess", {"RAW": x})["NORMED"]
        logits = self.client.infer("mlp", {"INPUT": normed})["LOGITS"]
        return self.client.infer("topk", {"LOGITS": logits})["CLASSES"]

    def step(self, model: str, x: np.ndarray) -> None:
        name = {"preprocess": "RAW", "mlp": "INPUT", "topk": "LOGITS"}[model]
        self.client.infer(model, {name: x if model != "topk" else x[:, :1000]})

    def close(self) -> None:
        self.client.close()


class HttpCalls:
    """One tritonclient.http client per thread, binary tensors."""

    def __init__(self, url: str) -> None:
        import tritonclient.http as http

        self.http, self.client = http, http.InferenceServerClient(url, network_timeout=120)

    def _infer(self, model: str, name: str, x: np.ndarray, out: str) -> np.ndarray:
        inp = self.http.InferInput(name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = self.client.infer(model, [inp], outputs=[self.http.InferRequestedOutput(out, binary_data=True)])
        return res.as_numpy(out)

    def ensemble(self, x: np.ndarray) -> np.ndarray:
        return self._infer("classify", "IMAGE", x, "CLASSES")

    def chain(self, x: np.ndarray) -> np.ndarray:
        normed = self._infer("preprocess", "RAW", x, "NORMED")
        logits = self._infer("mlp", "INPUT", normed, "LOGITS")
        return self._infer("topk", "LOGITS", logits, "CLASSES")

    def close(self) -> None:
        self.client.close()


def measure(make, call: str, concurrency: int, seconds: float, arg=None) -> dict:
    """Closed loop: ``concurrency`` threads, each with its own client (made in its thread: tritonclient's
    HTTP client is bound to the thread that made it), connected and warm before the clock starts."""
    x = (np.random.default_rng(0).random((1, WIDTH), dtype=np.float32) * 255)
    args = [arg, x] if arg else [x]
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[str] = []
    ready = threading.Barrier(concurrency + 1)
    stop = [0.0]

    def loop(i: int) -> None:
        c = make()
        fn = getattr(c, call)
        try:
            fn(*args)
        finally:
            ready.wait()
        ready.wait()  # the clock starts
        while time.perf_counter() < stop[0]:
            t = time.perf_counter()
            try:
                fn(*args)
            except Exception as exc:  # counted, not fatal: the figure says how many failed
                errors.append(str(exc))
                continue
            lat[i].append(time.perf_counter() - t)
        c.close()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    started = time.perf_counter()
    stop[0] = started + seconds
    ready.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        print(f"{call} c={concurrency}: {len(errors)} failed, first: {errors[0][:300]}", file=sys.stderr)
    flat = np.array([v for per in lat for v in per]) if any(lat) else np.array([np.nan])
    return {"requests": int(np.isfinite(flat).sum()), "errors": len(errors), "rps": len(flat) / wall,
            "p50_us": float(np.percentile(flat, 50) * 1e6), "p99_us": float(np.percentile(flat, 99) * 1e6),
            "mean_us": float(flat.mean() * 1e6)}


def ensemble_compute(stats: dict) -> tuple[int, float]:
    """(requests, seconds of their steps' compute) the front has counted for the ensemble."""
    h = stats["classify"]["histograms"]["compute"]
    return h["count"], h["sum"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement (default 10)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--carriers", nargs="+", default=["library", "http"], choices=["library", "http"])
    parser.add_argument("--repository", help="a repository holding classify and its steps (default: written "
                                             "to a temporary folder by examples/make_models.py)")
    args = parser.parse_args()

    import make_models

    from gepool import Client, Pool

    repo = args.repository or make_models.make_examples(tempfile.mkdtemp(prefix="gepool-ens-bench-"))
    port = free_port()
    rows = []
    with Pool(repo, http_port=port if "http" in args.carriers else 0) as pool:
        stats_client = Client(pool.endpoint, timeout=60)
        x = np.random.default_rng(1).random((3, WIDTH), dtype=np.float32)
        lib = LibraryCalls(pool.endpoint)
        assert np.array_equal(lib.ensemble(x), lib.chain(x)), "the ensemble and the chain disagree"
        lib.close()
        makers = {"library": lambda: LibraryCalls(pool.endpoint), "http": lambda: HttpCalls(f"127.0.0.1:{port}")}
        for carrier in args.carriers:
            for c in args.concurrency:
                for call in ("ensemble", "chain"):
                    before = ensemble_compute(stats_client.stats())
                    r = measure(makers[carrier], call, c, args.seconds)
                    after = ensemble_compute(stats_client.stats())
                    row = {"carrier": carrier, "concurrency": c, "mode": call, **r}
                    if call == "ensemble" and after[0] > before[0]:
                        compute_us = (after[1] - before[1]) / (after[0] - before[0]) * 1e6
                        row["steps_compute_us"] = compute_us
                        row["overhead_per_step_us"] = (r["mean_us"] - compute_us) / len(STEPS)
                    rows.append(row)
        top = max(args.concurrency)
        for model in STEPS:
            r = measure(lambda: LibraryCalls(pool.endpoint), "step", top, args.seconds, model)
            rows.append({"carrier": "library", "concurrency": top, "mode": f"{model} alone", **r})
        stats_client.close()
    print(f"\n{'carrier':8} {'c':>3} {'mode':16} {'req/s':>8} {'p50 us':>9} {'p99 us':>9} {'steps us':>9} "
          f"{'ovh/step us':>11} {'errors':>6}")
    for r in rows:
        print(f"{r['carrier']:8} {r['concurrency']:>3} {r['mode']:16} {r['rps']:8.1f} {r['p50_us']:9.0f} "
              f"{r['p99_us']:9.0f} {r.get('steps_compute_us', float('nan')):9.0f} "
              f"{r.get('overhead_per_step_us', float('nan')):11.0f} {r['errors']:>6}")
    slowest = min((r for r in rows if r["mode"].endswith(" alone")), key=lambda r: r["rps"])
    for r in rows:
        if r["mode"] == "ensemble" and r["concurrency"] == top:
            print(f"{r['carrier']} c={top}: ensemble {r['rps']:.1f} req/s = {r['rps'] / slowest['rps']:.0%} of the "
                  f"slowest step alone ({slowest['mode']}, {slowest['rps']:.1f} req/s)")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
