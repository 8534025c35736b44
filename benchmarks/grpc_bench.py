"""The example models over gepool's KServe v2 gRPC and HTTP endpoints with perf_analyzer (benchmarks/README.md).

    python benchmarks/grpc_bench.py [--seconds S] [--triton-grpc HOST:PORT]

Runs ``perf_analyzer -i grpc`` (unary and ``--streaming``) and ``-i http`` against one pool at
concurrency 1, 8 and 64 on tiny and mlp, and, with ``--triton-grpc``, the same gRPC command against
a Triton (e.g. PyTriton's bundled tritonserver on 8001) serving models of the same names, so both
come from one run on one host. perf_analyzer comes from the tritonclient 2.40.0 wheel (see .ci/run).
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile

from http_bench import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
CONCURRENCY = (1, 8, 64)
MODELS = ("tiny", "mlp")


def perf_analyzer(model: str, url: str, protocol: str, concurrency: int, seconds: float,
                  streaming: bool = False) -> dict | None:
    from tests.test_http import _perf_analyzer_env

    env = _perf_analyzer_env()
    if env is None:
        return None
    fd, out = tempfile.mkstemp(suffix=".csv")
    os.close(fd)
    try:
        proc = subprocess.run(["perf_analyzer", "-m", model, "-u", url, "-i", protocol,
                               *(["--streaming"] if streaming else []), "--concurrency-range", str(concurrency),
                               "--measurement-interval", str(int(seconds * 1000)), "-f", out],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stdout[-1500:], proc.stderr[-1500:])
            return None
        with open(out) as f:
            row = next(csv.DictReader(f))
    finally:
        os.unlink(out)
    return {"rps": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
            "p99_us": float(row["p99 latency"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--triton-grpc", help="HOST:PORT of a Triton gRPC endpoint serving tiny and mlp")
    args = parser.parse_args()

    from core import example_repo

    from gepool import Pool

    repo = example_repo("gepool-grpc-bench-")
    http_port, grpc_port = free_port(), free_port()
    rows = []
    with Pool(repo, http_port=http_port, grpc_port=grpc_port):
        for model in MODELS:
            for conc in CONCURRENCY:
                runs = {"grpc": perf_analyzer(model, f"127.0.0.1:{grpc_port}", "grpc", conc, args.seconds),
                        "grpc-stream": perf_analyzer(model, f"127.0.0.1:{grpc_port}", "grpc", conc, args.seconds,
                                                     streaming=True),
                        "http": perf_analyzer(model, f"127.0.0.1:{http_port}", "http", conc, args.seconds)}
                if args.triton_grpc:
                    runs["triton-grpc"] = perf_analyzer(model, args.triton_grpc, "grpc", conc, args.seconds)
                rows.append((model, conc, runs))
    print(f"{'model':6s} {'conc':>4s} | " + " | ".join(f"{k:>11s} req/s   p50 us   p99 us" for k in rows[0][2]))
    nan = {"rps": float("nan"), "p50_us": float("nan"), "p99_us": float("nan")}
    for model, conc, runs in rows:
        cells = [r or nan for r in runs.values()]
        print(f"{model:6s} {conc:4d} | " + " | ".join(f"{c['rps']:17.0f} {c['p50_us']:8.0f} {c['p99_us']:8.0f}"
                                                      for c in cells))
    if any(r is None for _, _, runs in rows for r in runs.values()):
        print("(a perf_analyzer run failed or could not start: see its output above, and .ci/run for the binary)")


if __name__ == "__main__":
    main()
