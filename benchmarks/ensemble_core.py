"""The front core's own CPU per ensemble request against a direct one, in-process, base against head.

    python benchmarks/ensemble_core.py [--base REV] [--head REV] [--rounds 5] [--seconds 1.5] [--batch 8]
        [--wait] [--profile]

No process, no socket: the core of ``tests/test_core.py`` with its recording outbox, real rings, a fake
clock and the workers played in-process (``benchmarks/core_steps.py``'s method). The ensemble is three
echo steps in a line (a -> b -> c); ``--batch`` ensemble requests arrive, then each step's batch runs in
turn, so every step request goes slot to slot at once; with ``--wait`` a direct request keeps each next
step's worker busy while the previous step completes, so that every step request waits in its queue.
The direct figure is ``--batch`` requests to a alone. Each round runs base and head (ABBA order) in
their own child process, each importing its own tree (laid out as gateway_ab.py does); prints the
medians in us of process CPU per request, and the ensemble's cost over the direct one's. ``--profile``
(without ``--base``) prints the head's cProfile of the ensemble, by CPU time.
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


def child(seconds: float, batch: int, wait: bool, profile: bool) -> tuple[float, float]:
    sys.path.append(ROOT)  # tests/ (the harness), after the tree on PYTHONPATH (whose gepool comes first)
    import numpy as np

    from gepool.ipc import protocol
    from tests.test_core import Harness, echo_model
    from tests.test_ensemble_core import pipe

    repo = tempfile.mkdtemp(prefix="gepool-enscore-")
    for name in "abc":
        echo_model(repo, name)
    pipe(repo, "pipe", ["a", "b", "c"])
    for name in ("a", "b", "c", "pipe"):  # room for a whole --batch in one batch
        path = os.path.join(repo, name, "config.pbtxt")
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace("max_batch_size: 8", f"max_batch_size: {max(8, batch)}"))
    h = Harness(repo)
    try:
        h.ready_all()
        ws = {w.model.name: w for w in h.out.spawned}
        x = memoryview(np.ones((1, 4), np.float32).tobytes())

        def heads(model: str, name: str) -> list[memoryview]:
            return [memoryview(protocol.Infer(i + 1, model, protocol.NO_VERSION, [[name, "FP32", [1, 4], 0]], None,
                                              0, 0, protocol.NO_ARENA, 0, 0).encode()) for i in range(batch)]

        ens_heads, direct_heads = heads("pipe", "X"), heads("a", "INPUT")
        busy = {m: heads(m, "INPUT")[:1] for m in "bc"}
        out, on_message = h.out, h.core.on_message

        def ensemble() -> None:
            for head in ens_heads:
                on_message(b"\0client", [head, x])
            h.step()
            for prev, m in (("a", "b"), ("b", "c"), ("c", None)):
                if wait and m is not None:
                    on_message(b"\0client", [busy[m][0], x])  # the next step's worker computes meanwhile
                    h.step()
                h.compute(ws[prev])
                if wait and m is not None:
                    h.compute(ws[m])  # the direct request; the step requests then go out as one batch
            out.replies.clear()

        def direct() -> None:
            for head in direct_heads:
                on_message(b"\0client", [head, x])
            h.step()
            h.compute(ws["a"])
            out.replies.clear()

        for fn in (ensemble, direct):
            for _ in range(100):
                fn()
        out.reply = lambda identity, parts, copy=False: out.replies.append(parts)  # no decoding in the timing
        h.core.dispatch.reply = out.reply
        if profile:
            import cProfile
            import pstats

            p = cProfile.Profile(time.process_time)
            p.runcall(lambda: [ensemble() for _ in range(1000)])
            st = pstats.Stats(p).sort_stats("tottime")
            st.print_stats(30)
            if os.environ.get("ENSCORE_CALLERS"):
                st.print_callers(os.environ["ENSCORE_CALLERS"])
        got = []
        for fn in (ensemble, direct):
            n, started, end = 0, time.process_time(), time.monotonic() + seconds
            while time.monotonic() < end:
                for _ in range(20):
                    fn()
                n += 20 * batch
            got.append((time.process_time() - started) / n * 1e6)
        return got[0], got[1]
    finally:
        h.close()
        shutil.rmtree(repo, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the revision to compare against (without it: the working tree alone)")
    p.add_argument("--head", help="the revision measured against it (default: the working tree)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.5, help="per mode, version and round")
    p.add_argument("--batch", type=int, default=8, help="requests per batch (the models' max_batch_size: at least 8)")
    p.add_argument("--wait", action="store_true", help="each step request waits in its queue")
    p.add_argument("--profile", action="store_true", help="print the head's cProfile of the ensemble")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        ens, direct = child(args.seconds, args.batch, args.wait, args.profile)
        print(f"RESULT {ens} {direct}")
        return
    sys.path.insert(0, HERE)
    from gateway_ab import ab_rounds

    def flags(label: str, r: int) -> list[str]:
        return (["--seconds", str(args.seconds), "--batch", str(args.batch)] + ["--wait"] * args.wait
                + ["--profile"] * (args.profile and label == "head" and r == 0))

    results: dict[str, list[tuple[float, float]]] = {}
    for r, label, out, (ens, direct) in ab_rounds(__file__, args.base, args.head, args.rounds, flags,
                                                  "gepool-enscore-ab-"):
        if args.profile and label == "head" and r == 0:
            print(out)
        results.setdefault(label, []).append((ens, direct))
        print(f"round {r + 1} {label}: ensemble {ens:.1f} direct {direct:.1f} us/request", flush=True)
    print(f"core CPU per request, batches of {args.batch}{', steps waiting' if args.wait else ''}, median of "
          f"{args.rounds} ({time.strftime('%F %T')}, load {os.getloadavg()[0]:.2f}):")
    for label, rs in results.items():
        ens, direct = statistics.median(e for e, _ in rs), statistics.median(d for _, d in rs)
        print(f"  {label}: ensemble {ens:.1f} us, direct {direct:.1f} us, ensemble - direct {ens - direct:.1f} us "
              f"({(ens - direct) / 3:.1f} per step)")


if __name__ == "__main__":
    main()
