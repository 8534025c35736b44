"""The example models over gepool's KServe v2 HTTP endpoint and the library client (benchmarks/README.md)."""

import argparse
import csv
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

SHAPES = {"tiny": ("INPUT0", 16), "mlp": ("INPUT", 1024)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perf_analyzer(model: str, port: int, concurrency: int, seconds: float) -> dict | None:
    exe = shutil.which("perf_analyzer")
    if exe is None:
        return None
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime

        env["LD_LIBRARY_PATH"] = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib")
    except ImportError:
        pass
    out = tempfile.mktemp(suffix=".csv")
    proc = subprocess.run([exe, "-m", model, "-u", f"127.0.0.1:{port}", "-i", "http", "--concurrency-range",
                           str(concurrency), "--measurement-interval", str(int(seconds * 1000)), "-f", out],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(proc.stdout[-1500:], proc.stderr[-1500:])
        return None
    with open(out) as f:
        row = next(csv.DictReader(f))
    os.unlink(out)
    return {"rps": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
            "p99_us": float(row["p99 latency"])}


def library(client, model: str, concurrency: int, seconds: float) -> dict:
    name, width = SHAPES[model]
    x = np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)
    client.infer(model, {name: x})
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            client.infer(model, {name: x})
            lat[i].append(time.perf_counter() - t)

    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_lat = np.concatenate([np.array(v) for v in lat])
    return {"rps": len(all_lat) / (time.perf_counter() - start), "p50_us": np.median(all_lat) * 1e6,
            "p99_us": np.percentile(all_lat, 99) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()

    from core import example_repo

    from gepool import Pool

    repo = example_repo("gepool-bench-")
    port = free_port()
    rows = []
    with Pool(repo, http_port=port) as pool:
        client = pool.client()
        for model in ("tiny", "mlp"):
            for conc in (1, 8):
                lib = library(client, model, conc, args.seconds)
                http = perf_analyzer(model, port, conc, args.seconds)
                rows.append((model, conc, lib, http))
    print(f"{'model':6s} {'conc':>4s} | {'library req/s':>13s} {'p50 us':>8s} {'p99 us':>8s} | "
          f"{'HTTP req/s':>10s} {'p50 us':>8s} {'p99 us':>8s} | HTTP/library")
    for model, conc, lib, http in rows:
        h = http or {"rps": float("nan"), "p50_us": float("nan"), "p99_us": float("nan")}
        print(f"{model:6s} {conc:4d} | {lib['rps']:13.0f} {lib['p50_us']:8.0f} {lib['p99_us']:8.0f} | "
              f"{h['rps']:10.0f} {h['p50_us']:8.0f} {h['p99_us']:8.0f} | {h['rps'] / lib['rps']:.2f}")
    if any(r[3] is None for r in rows):
        print("(perf_analyzer could not run: see the module docstring)")


if __name__ == "__main__":
    main()
