"""The asyncio client's own CPU per request (the sidecar's client path without HTTP), a base revision against
this tree, alternating in one run.

    python benchmarks/aio_client_ab.py [--base REV] [--rounds 3] [--seconds 5] [--concurrency 64]

One process holds an AsyncClient with ``--concurrency`` closed loops of one-row requests to a pool of its
own (tiny, max batch 32, dynamic batching); the figure is that process's CPU time (time.process_time) over
the window divided by the requests answered in it. The pool's processes are not counted.
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
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def measure(args: argparse.Namespace) -> None:
    import asyncio
    import time

    import make_models
    import numpy as np

    from gepool import AsyncClient, Pool

    repo = tempfile.mkdtemp(prefix="gepool-aioab-")
    make_models.make_tiny(repo, max_batch=32)
    x = np.zeros((1, 16), np.float32)

    async def run(endpoint: str) -> tuple[float, int]:
        async with AsyncClient(endpoint) as c:
            for _ in range(200):  # warm-up
                await c.infer("tiny", {"INPUT0": x})
            done, stop = 0, time.monotonic() + args.seconds

            async def loop() -> None:
                nonlocal done
                while time.monotonic() < stop:
                    await c.infer("tiny", {"INPUT0": x})
                    done += 1

            started = time.process_time()
            await asyncio.gather(*(loop() for _ in range(args.concurrency)))
            return (time.process_time() - started) / max(done, 1) * 1e6, done

    try:
        with Pool(repo) as pool:
            us, done = asyncio.run(run(pool.endpoint))
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    print(f"RESULT {us:.2f} {done}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="a revision to alternate with this tree; without it, this tree alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(args)
        return
    import gateway_ab

    work = tempfile.mkdtemp(prefix="gepool-aioab-tree-")
    versions: dict[str, str | None] = {"head": None}
    try:
        if args.base:
            gateway_ab.tree(args.base, os.path.join(work, "base"))
            versions = {"base": os.path.join(work, "base", "root"), "head": None}
        results: dict[str, list[float]] = {v: [] for v in versions}
        for r in range(args.rounds):
            order = list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]
            for label, root in order:
                env = dict(os.environ, PYTHONPATH=root) if root else dict(os.environ)
                cmd = [sys.executable, os.path.abspath(__file__), "--measure", "--seconds", str(args.seconds),
                       "--concurrency", str(args.concurrency)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"no result from {label}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                us, done = line.split()[1:]
                results[label].append(float(us))
                print(f"round {r + 1} {label}: {float(us):.1f} us CPU per request ({done} requests)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedian client CPU per request over {args.rounds} rounds at concurrency {args.concurrency}: "
          + ", ".join(f"{label} {statistics.median(v):.1f} us" for label, v in results.items()))


if __name__ == "__main__":
    main()
