"""Where a lone ensemble request's time goes: per-step queue and compute from the pool's stats, ensemble vs chain.

    python benchmarks/ensemble_probe.py --seconds 2 --rounds 3 [--baseline main] [--mlp-threads 1] \
        [--queue-delay-us 0] [--rows 1]

Each round runs the ensemble, then the client's chain of the same three calls, one request at a time,
for ``--seconds`` each. ``--baseline REV`` also starts a pool from that git revision of this repository
(exported to a temporary folder) and alternates the two pools round by round, in turn first, so that a
change is measured before and after under the same load; the chain, which no ensemble change should
touch, is the control. The last lines are the medians over the rounds. ``--queue-delay-us N`` sets the
three steps' max_queue_delay_microseconds (0: a lone step request goes out the moment it is queued, so
its input is handed from the previous step's slot straight into its own); ``--rows`` the rows per request.
"""

import argparse
import contextlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "examples"), HERE]

import make_models  # noqa: E402
from ensemble_bench import LibraryCalls, export, pool_of  # noqa: E402

STEPS = ("preprocess", "mlp", "topk")


def snapshot(client) -> dict:
    stats = client.stats()
    return {m: (stats[m]["requests"], stats[m]["batches"], stats[m]["queue_us"], stats[m]["compute_us"])
            for m in STEPS}


COPIES = ("out_bytes", "handed_bytes", "answered_bytes")


def copies(client) -> dict:
    """The front's count of ensemble step outputs' bytes by where they went (empty from a pool without it)."""
    return client.status().get("ensemble_copies") or {}


def measure(calls: LibraryCalls, mode: str, x: np.ndarray, seconds: float) -> dict:
    call = getattr(calls, mode)
    for _ in range(20):
        call(x)
    before, n, started = snapshot(calls.client), 0, time.perf_counter()
    copied = copies(calls.client)
    while time.perf_counter() - started < seconds:
        call(x)
        n += 1
    out = {"us": (time.perf_counter() - started) / n * 1e6}
    after, now = snapshot(calls.client), copies(calls.client)
    out["copies"] = {k: (now[k] - copied[k]) / n for k in COPIES if k in now}
    for m in STEPS:
        reqs, batches = after[m][0] - before[m][0], after[m][1] - before[m][1]
        out[m] = ((after[m][2] - before[m][2]) / max(reqs, 1), (after[m][3] - before[m][3]) / max(batches, 1))
    return out


def line(label: str, r: dict) -> str:
    parts = [f"{m} q {r[m][0]:6.0f} c {r[m][1]:6.0f}" for m in STEPS]
    moved = r.get("copies") or {}
    tail = "   bytes/req " + " ".join(f"{k.split('_')[0]} {moved[k]:.0f}" for k in COPIES) if moved else ""
    return f"{label:18s} {r['us']:8.0f}   " + "   ".join(parts) + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="per mode, pool and round (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of ensemble then chain, alternating")
    parser.add_argument("--baseline", metavar="REV", help="also measure a pool from this git revision, alternating")
    parser.add_argument("--mlp-threads", type=int, help="intra_op_thread_count of mlp (default: the pool's sizing)")
    parser.add_argument("--queue-delay-us", type=int, help="the steps' max_queue_delay_microseconds "
                                                            "(default: the example's, 500/5000/500)")
    parser.add_argument("--rows", type=int, default=1, help="rows per request (default 1; at most 32)")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="gepool-ens-probe-")
    repo = make_models.make_examples(os.path.join(work, "repo"))
    if args.mlp_threads:
        with open(os.path.join(repo, "mlp", "config.pbtxt"), "a") as f:
            f.write(f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{args.mlp_threads}" }} }}\n')
    if args.queue_delay_us is not None:
        for step in STEPS:
            path = os.path.join(repo, step, "config.pbtxt")
            with open(path) as f:
                text = f.read()
            text = re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {args.queue_delay_us}",
                          text)
            with open(path, "w") as f:
                f.write(text)
    sites = {"this": None}
    if args.baseline:
        sites = {args.baseline: export(args.baseline, os.path.join(work, "baseline")), "this": None}
    os.chdir(work)  # a front started here imports gepool from its PYTHONPATH or the installed one, not a checkout
    print("pool/mode          us/req   per step: queue us per request, compute us per batch; bytes of step "
          "outputs per request copied out of a slot, handed slot to slot, answered from a slot")
    results: dict[str, list[dict]] = {}
    x = np.random.default_rng(0).random((args.rows, 1024), dtype=np.float32)
    with contextlib.ExitStack() as stack:
        pools = {name: stack.enter_context(pool_of(repo, site)) for name, site in sites.items()}
        clients = {name: LibraryCalls(pool.endpoint) for name, pool in pools.items()}
        for c in clients.values():
            stack.callback(c.close)
        for r in range(args.rounds):
            for name, calls in (clients.items() if r % 2 == 0 else reversed(clients.items())):  # ABBA
                for mode in ("ensemble", "chain"):
                    r = measure(calls, mode, x, args.seconds)
                    results.setdefault(f"{name} {mode}", []).append(r)
                    print(line(f"{name} {mode}", r), flush=True)
    print("medians over the rounds:")
    for label, rs in results.items():
        med = {"us": statistics.median(r["us"] for r in rs)}
        for m in STEPS:
            med[m] = tuple(statistics.median(r[m][k] for r in rs) for k in (0, 1))
        if rs[0].get("copies"):
            med["copies"] = {k: statistics.median(r["copies"][k] for r in rs) for k in COPIES}
        print(line(label, med))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
