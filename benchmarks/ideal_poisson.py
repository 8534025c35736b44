"""The best p99 any batching policy could give the MLP under Poisson load (benchmarks/README.md)."""

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MAX_BATCH = 32


def batch_times(model_path: str, seconds: float) -> dict[int, float]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = len(os.sched_getaffinity(0))
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
    out = {}
    for bs in (1, 4, 8, 16, 32):
        x = np.random.default_rng(0).standard_normal((bs, 1024)).astype(np.float32)
        sess.run(None, {"INPUT": x})
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            t = time.perf_counter()
            sess.run(None, {"INPUT": x})
            times.append(time.perf_counter() - t)
        out[bs] = float(np.median(times))
    return out


def simulate(rate: float, fixed: float, per_row: float, n: int = 200_000, seed: int = 1) -> dict:
    """One worker, greedy batches; returns latency percentiles and the per-batch average compute."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
    latency = np.empty(n)
    computes = []
    free_at, i = 0.0, 0
    while i < n:
        start = max(free_at, arrivals[i])
        j = i + 1
        while j < n and j - i < MAX_BATCH and arrivals[j] <= start:
            j += 1
        compute = fixed + per_row * (j - i)
        free_at = start + compute
        latency[i:j] = free_at - arrivals[i:j]
        computes.append((compute, j - i))
        i = j
    c = np.array(computes)
    return {"p50": np.percentile(latency, 50), "p99": np.percentile(latency, 99),
            "compute_avg": c[:, 0].mean(), "batch_avg": c[:, 1].mean()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()

    import core

    repo = core.example_repo("gepool-ideal-")
    times = batch_times(f"{repo}/mlp/1/model.onnx", args.seconds)
    sizes = np.array(sorted(times))
    per_row, fixed = np.polyfit(sizes, [times[s] for s in sizes], 1)
    for bs in sizes:
        print(f"   in-process batch {bs:2d}: {times[bs] * 1e3:6.2f} ms (fit {(fixed + per_row * bs) * 1e3:6.2f})")
    rate = args.load * 16 / times[16]
    r = simulate(rate, fixed, per_row)
    print(f"compute = {fixed * 1e3:.2f} ms + {per_row * 1e3:.3f} ms x rows; Poisson {rate:.0f}/s "
          f"({args.load:.0%} of batch-16 throughput)")
    print(f"ideal one worker: p50 {r['p50'] * 1e3:.1f} ms, p99 {r['p99'] * 1e3:.1f} ms = "
          f"{r['p99'] / r['compute_avg']:.2f}x compute ({r['compute_avg'] * 1e3:.1f} ms, batch {r['batch_avg']:.1f})")


if __name__ == "__main__":
    main()
