"""The front core's own CPU per request, in-process: admission, batching, copy in, completion, answer.

    python benchmarks/core_steps.py [--base REV] [--head REV] [--rounds 5] [--seconds 2] [--batch 8] [--fastest]

No process, no socket: the core of ``tests/test_core.py`` with its recording outbox, real rings, a fake
clock (the batcher sends at once: no queue delay) and the worker played in-process, so that what is
timed (process CPU time over ``--seconds`` of requests) is the core's Python and nothing of the host's
load but cache effects. Each round runs base and head (ABBA order) in their own child process, each
importing its own tree (laid out as gateway_ab.py does). Prints the median per version, in us per
request.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(seconds: float, batch: int, fastest_burst: bool = False) -> float:
    # tests/ (the harness), after the tree on PYTHONPATH: first, ROOT/gepool would shadow that tree's gepool
    sys.path.append(ROOT)
    import numpy as np

    from gepool.ipc import protocol
    from tests.test_core import Harness, echo_model

    repo = tempfile.mkdtemp(prefix="gepool-coresteps-")
    echo_model(repo)
    h = Harness(repo)
    try:
        h.ready_all()
        (w,) = h.core.workers.values()
        x = memoryview(np.ones((1, 4), np.float32).tobytes())
        headers = []
        for i in range(batch):
            msg = protocol.Infer(i + 1, "echo", protocol.NO_VERSION, [["INPUT", "FP32", [1, 4], 0]], None, 0, 0,
                                 protocol.NO_ARENA, 0, 0)
            headers.append(memoryview(msg.encode()))
        out, on_message, step = h.out, h.core.on_message, h.step

        def once() -> None:
            for head in headers:
                on_message(b"\0client", [head, x])
            step()
            h.compute(w)
            out.replies.clear()

        for _ in range(200):
            once()
        out.reply = lambda identity, parts, copy=False: out.replies.append(parts)  # no decoding in the timing
        h.core.dispatch.reply = out.reply
        n, started, end = 0, time.process_time(), time.monotonic() + seconds
        fastest = float("inf")
        while time.monotonic() < end:
            burst = time.process_time()
            for _ in range(50):
                once()
            fastest = min(fastest, time.process_time() - burst)
            n += 50 * batch
        if fastest_burst:
            return fastest / (50 * batch) * 1e6
        return (time.process_time() - started) / n * 1e6
    finally:
        h.close()
        shutil.rmtree(repo, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the revision to compare against (without it: the working tree alone)")
    p.add_argument("--head", help="the revision measured against it (default: the working tree)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0, help="per version and round")
    p.add_argument("--batch", type=int, default=8, help="requests per batch")
    p.add_argument("--fastest", action="store_true",
                   help="the fastest burst of 50 batches, not the mean: on a loaded host, what the others' turns "
                        "(cache, steal) did not slow down")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(f"RESULT {child(args.seconds, args.batch, args.fastest)}")
        return
    sys.path.insert(0, HERE)
    from gateway_ab import ab_rounds

    results: dict[str, list[float]] = {}
    flags = ["--seconds", str(args.seconds), "--batch", str(args.batch)] + ["--fastest"] * args.fastest
    for r, label, _, (us,) in ab_rounds(__file__, args.base, args.head, args.rounds, lambda label, r: flags,
                                        "gepool-coresteps-ab-"):
        results.setdefault(label, []).append(us)
        print(f"round {r + 1} {label}: {us:.2f} us/request", flush=True)
    med = {label: statistics.median(v) for label, v in results.items()}
    line = " ".join(f"{label} {v:.2f}" for label, v in med.items())
    if "base" in med:
        line += f" ({(med['head'] / med['base'] - 1) * 100:+.1f}%)"
    how = "fastest burst" if args.fastest else "mean"
    print(f"core CPU per request ({how}), batches of {args.batch}, median of {args.rounds}: {line} us "
          f"({time.strftime('%F %T')}, load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
