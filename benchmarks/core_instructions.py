"""The front core's instructions per request, in-process, counted by valgrind: a figure a loaded host cannot move.

    python benchmarks/core_instructions.py [--base REV] [--head REV] [--iterations 200] [--batch 8]

The workload of ``core_steps.py`` (test_core's harness: admission, batching, copy in, the worker played
in-process, completion, the answer built; no process, no socket), run under ``valgrind --tool=callgrind``
twice per version, with 10 and with 10 + ``--iterations`` batches: the difference of the two totals over
the requests between them is what one request costs, start-up and model loading cancelled out. Each run
takes about 40 s (valgrind's own start-up, mostly). On a shared host, where CPU time per request moves by
+-20% from one run to the next, this is the figure to compare two revisions by; it counts instructions,
not cache misses, so confirm a gain in time (core_steps.py, gateway_ab.py) on a quiet host.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WARM = 10  # batches in the shorter run: the longer one's extra batches are the ones counted
# set iteration orders; no OpenBLAS thread (it spins after start-up for as long as the host lets it: counted)
FIXED_ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}


def child(iterations: int, batch: int) -> None:
    # tests/ (the harness), after the tree on PYTHONPATH: first, ROOT/gepool would shadow that tree's gepool
    sys.path.append(ROOT)
    import numpy as np

    from gepool.ipc import protocol
    from tests.test_core import Harness, echo_model

    repo = tempfile.mkdtemp(prefix="gepool-coreinstr-")
    echo_model(repo)
    h = Harness(repo)
    try:
        h.ready_all()
        (w,) = h.core.workers.values()
        x = memoryview(np.ones((1, 4), np.float32).tobytes())
        headers = [memoryview(protocol.Infer(i + 1, "echo", protocol.NO_VERSION, [["INPUT", "FP32", [1, 4], 0]],
                                             None, 0, 0, protocol.NO_ARENA, 0, 0).encode()) for i in range(batch)]
        h.out.reply = lambda identity, parts, copy=False: None  # no decoding in the count
        h.core.dispatch.reply = h.out.reply
        on_message = h.core.on_message
        for _ in range(iterations):
            for head in headers:
                on_message(b"\0client", [head, x])
            h.step()
            h.compute(w)
    finally:
        h.close()
        shutil.rmtree(repo, ignore_errors=True)


def count(root: str, iterations: int, batch: int) -> int:
    proc = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                           os.path.abspath(__file__), "--child", "--iterations", str(iterations), "--batch",
                           str(batch)], capture_output=True, text=True, cwd=root,
                          env={**os.environ, **FIXED_ENV, "PYTHONPATH": root})
    m = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"no count from {root}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return int(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the revision to compare against (without it: the working tree alone)")
    p.add_argument("--head", help="the revision measured against it (default: the working tree)")
    p.add_argument("--iterations", type=int, default=200, help="batches counted")
    p.add_argument("--batch", type=int, default=8, help="requests per batch")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.iterations, args.batch)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind")
    sys.path.insert(0, HERE)
    from gateway_ab import tree

    work = tempfile.mkdtemp(prefix="gepool-coreinstr-ab-")
    try:
        per_request = {}
        for label, rev in (("base", args.base), ("head", args.head)) if args.base else (("head", args.head),):
            into = os.path.join(work, label)
            tree(rev, into)
            root = os.path.join(into, "root")
            short, long = count(root, WARM, args.batch), count(root, WARM + args.iterations, args.batch)
            per_request[label] = (long - short) / (args.iterations * args.batch)
            print(f"{label} ({rev or 'working tree'}): {per_request[label]:,.0f} instructions per request", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "base" in per_request:
        change = (per_request["head"] / per_request["base"] - 1) * 100
        print(f"head against base: {change:+.1f}% instructions per request (batches of {args.batch})")


if __name__ == "__main__":
    main()
