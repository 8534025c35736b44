"""Where a lone ensemble request's time goes: per-step queue and compute from the pool's stats, ensemble vs chain."""

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), HERE]

import make_models  # noqa: E402
from ensemble_bench import LibraryCalls  # noqa: E402

STEPS = ("preprocess", "mlp", "topk")


def snapshot(client) -> dict:
    stats = client.stats()
    return {m: (stats[m]["requests"], stats[m]["batches"], stats[m]["queue_us"], stats[m]["compute_us"])
            for m in STEPS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per mode and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of ensemble then chain, alternating")
    parser.add_argument("--mlp-threads", type=int, help="intra_op_thread_count of mlp (default: the pool's sizing)")
    args = parser.parse_args()
    from gepool import Pool

    repo = make_models.make_examples(tempfile.mkdtemp(prefix="gepool-ens-probe-"))
    if args.mlp_threads:
        with open(os.path.join(repo, "mlp", "config.pbtxt"), "a") as f:
            f.write(f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{args.mlp_threads}" }} }}\n')
    print("mode        us/req   per step: queue us per request, compute us per batch")
    with Pool(repo) as pool:
        calls = LibraryCalls(pool.endpoint)
        x = np.random.default_rng(0).random((1, 1024), dtype=np.float32)
        for _ in range(args.rounds):
            for mode in ("ensemble", "chain"):
                call = getattr(calls, mode)
                for _ in range(20):
                    call(x)
                before, started = snapshot(calls.client), time.perf_counter()
                for _ in range(args.requests):
                    call(x)
                per_request = (time.perf_counter() - started) / args.requests * 1e6
                after = snapshot(calls.client)
                parts = []
                for m in STEPS:
                    reqs, batches = after[m][0] - before[m][0], after[m][1] - before[m][1]
                    parts.append(f"{m} q {(after[m][2] - before[m][2]) / max(reqs, 1):6.0f} "
                                 f"c {(after[m][3] - before[m][3]) / max(batches, 1):6.0f}")
                print(f"{mode:9s} {per_request:8.0f}   " + "   ".join(parts), flush=True)
        calls.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
