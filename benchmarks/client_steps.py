"""The library client's per-request steps alone (encode_infer, lane.record, decode, result), CPU microseconds
per call, a base revision against this tree, alternating in one run.

    python benchmarks/client_steps.py [--base REV] [--rounds 3] [--seconds 1]

Each step runs for ``--seconds`` in a process of its own version (this thread's CPU time over calls made),
on one-row requests shaped as the sidecar's: tiny (1x16 FP32 in, 1x16 out) and the MLP (1x1024 in, 1x1000
out). No pool runs: these are the steps' own costs, without sockets or the event loop.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
SHAPES = {"tiny": ((1, 16), (1, 16)), "mlp": ((1, 1024), (1, 1000))}


def _per_call(seconds: float, fn) -> float:
    import time

    n, start, stop_at = 0, time.thread_time(), time.monotonic() + seconds
    while time.monotonic() < stop_at:
        for _ in range(100):
            fn()
        n += 100
    return (time.thread_time() - start) / n * 1e6


def measure(seconds: float) -> None:
    from functools import partial

    import numpy as np

    from gepool import _wire
    from gepool.ipc import lane, protocol

    for model, (shape_in, shape_out) in SHAPES.items():
        x = np.zeros(shape_in, np.float32)
        y = np.zeros(shape_out, np.float32)
        sent = _wire.encode_infer(model, {"INPUT0": x}, None, None, None, None, 0, _wire.ARENA_MIN, 120.0, 0,
                                  protocol.Origin.HTTP)
        reply = [memoryview(protocol.Result(sent.req_id, [["OUTPUT0", "FP32", list(shape_out), 0]], False, 1)
                            .encode()), memoryview(y.tobytes())]
        msg, rest = _wire.decode(reply)
        steps = {
            "encode_infer": partial(_wire.encode_infer, model, {"INPUT0": x}, None, None, None, None, 0,
                                    _wire.ARENA_MIN, 120.0, 0, protocol.Origin.HTTP),
            "lane.record": partial(lane.record, sent.frames),
            "decode": partial(_wire.decode, reply),
            "result": partial(_wire.result, msg, rest, None, sent),
        }
        for step, fn in steps.items():
            print(f"RESULT {model} {step} {_per_call(seconds, fn):.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="a revision to alternate with this tree; without it, this tree alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="per step, per round, per version")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(args.seconds)
        return
    import gateway_ab

    work = tempfile.mkdtemp(prefix="gepool-steps-tree-")
    versions: dict[str, str | None] = {"head": None}
    try:
        if args.base:
            gateway_ab.tree(args.base, os.path.join(work, "base"))
            versions = {"base": os.path.join(work, "base", "root"), "head": None}
        results: dict[tuple[str, str, str], list[float]] = {}
        for r in range(args.rounds):
            order = list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]
            for label, root in order:
                env = dict(os.environ, PYTHONPATH=root) if root else dict(os.environ)
                cmd = [sys.executable, os.path.abspath(__file__), "--measure", "--seconds", str(args.seconds)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
                lines = [ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not lines:
                    raise SystemExit(f"no result from {label}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                for model, step, us in lines:
                    results.setdefault((model, step, label), []).append(float(us))
                print(f"round {r + 1} {label}: " + ", ".join(f"{m} {s} {float(u):.2f}" for m, s, u in lines),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedian CPU us per call over {args.rounds} rounds:")
    for model in SHAPES:
        for step in ("encode_infer", "lane.record", "decode", "result"):
            cells = [f"{label} {statistics.median(results[(model, step, label)]):6.2f}" for label in versions
                     if (model, step, label) in results]
            print(f"  {model:5s} {step:13s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
