"""The front's own cost per request under the HTTP sidecar, two versions alternating in one run.

    python benchmarks/front_wait.py --base REV [--head REV] [--rounds 3] [--seconds 8] [--models tiny,mlp]
        [--levels 1,64] [--seq 2000] [--no-perf]

Each round runs one child per version (base first in odd rounds, head first in even ones), each
importing its own tree (laid out as gateway_ab.py does) but measured by this one script. A child
starts a pool with the HTTP sidecar, drives it with wrk (KServe v2 JSON, one thread) at each level and
counts, over the middle of the level, per request the pool answered: the front's CPU microseconds
(utime+stime), its context switches (voluntary + involuntary, /proc/PID/status) and, with perf,
its syscalls (all, and poll/select/pselect6/epoll_wait/sched_yield/read/write/sendmsg/recvmsg apart;
``--models ''`` for none). ``--seq``
adds the library client's tiny p50 at concurrency 1 (back to back, over a lane), the figure the
front's adaptive polling exists for. Medians over the rounds at the end; on a shared host compare
per-request counts, not req/s.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SYSCALLS = ("poll", "select", "pselect6", "epoll_wait", "sched_yield", "read", "write", "sendmsg", "recvmsg")


def ctx_switches(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def perf_counts(pid: int, seconds: float) -> dict[str, int]:
    events = ["raw_syscalls:sys_enter"] + [f"syscalls:sys_enter_{s}" for s in SYSCALLS]
    proc = subprocess.run(["perf", "stat", "-x,", "-e", ",".join(events), "-p", str(pid), "--", "sleep",
                           str(seconds)], capture_output=True, text=True)
    out = {}
    for line in proc.stderr.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[0].isdigit():
            name = fields[2].removeprefix("syscalls:sys_enter_").removeprefix("raw_syscalls:sys_enter")
            out[name or "syscalls"] = int(fields[0])
    return out


def child(args: argparse.Namespace) -> None:
    import gateway_bench as gb
    import numpy as np

    from gepool import Pool
    from gepool.scheduler import loop

    print("# loop from", loop.__file__, file=sys.stderr)
    repo = gb.make_repo()
    workdir = tempfile.mkdtemp(prefix="gepool-frontwait-")
    port = gb.free_port()
    rows = {}
    try:
        if args.seq:  # the example repository's tiny (no queue delay), as benchmarks/polling.py measures it
            import core

            seq_repo = core.example_repo("gepool-frontwait-seq-")
            try:
                with Pool(seq_repo) as pool:
                    seq_client, cpu0 = pool.client(), gb.cpu_seconds(pool.process.pid)
                    times = core.tiny_latency(seq_client, args.seq)  # and 100 to warm up
                    rows["seq tiny cpu_us"] = (gb.cpu_seconds(pool.process.pid) - cpu0) / (args.seq + 100) * 1e6
            finally:
                shutil.rmtree(seq_repo, ignore_errors=True)
            rows["seq tiny p50_us"] = float(np.median(times) * 1e6)
            rows["seq tiny p99_us"] = float(np.percentile(times, 99) * 1e6)
        with Pool(repo, http_port=port, metrics_port=0) as pool:
            url = f"http://127.0.0.1:{port}"
            client = pool.client()
            front = pool.process.pid
            for model in filter(None, args.models.split(",")):
                gb.run_wrk(url, model, 8, 1.0, workdir)  # warm-up
                for conc in (int(c) for c in args.levels.split(",")):
                    done = {}
                    wrk = threading.Thread(target=lambda m=model, c=conc, d=done: d.update(
                        gb.run_wrk(url, m, c, args.seconds, workdir)))
                    wrk.start()
                    time.sleep(min(1.0, args.seconds / 4))
                    window = args.seconds / 2
                    stats0, cpu0, cs0 = client.stats()[model], gb.cpu_seconds(front), ctx_switches(front)
                    if args.perf:
                        counts = perf_counts(front, window)
                    else:
                        time.sleep(window)
                        counts = {}
                    stats1, cpu1, cs1 = client.stats()[model], gb.cpu_seconds(front), ctx_switches(front)
                    wrk.join()
                    n = max(1, stats1["requests"] - stats0["requests"])
                    batches = max(1, stats1["batches"] - stats0["batches"])
                    row = {"rps": done.get("rps", float("nan")), "p50_ms": done.get("p50_ms", float("nan")),
                           "batch": (stats1["rows"] - stats0["rows"]) / batches,
                           "cpu_us": (cpu1 - cpu0) / n * 1e6, "ctxsw": (cs1 - cs0) / n}
                    row.update({k: v / n for k, v in counts.items()})
                    for k, v in row.items():
                        rows[f"{model} c={conc} {k}"] = v
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the revision to compare against (without it: the working tree alone)")
    p.add_argument("--head", help="the revision measured against it (default: the working tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="per level and version (the middle half is counted)")
    p.add_argument("--models", default="tiny,mlp")
    p.add_argument("--levels", default="1,64")
    p.add_argument("--seq", type=int, default=2000, help="library-client requests at concurrency 1 (0: none)")
    p.add_argument("--no-perf", dest="perf", action="store_false", help="no syscall counts (perf stat)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed")
    if args.perf and shutil.which("perf") is None:
        raise SystemExit("perf is not installed (or pass --no-perf)")
    from gateway_ab import tree

    work = tempfile.mkdtemp(prefix="gepool-frontwait-ab-")
    try:
        versions = {}
        for label, rev in (("base", args.base), ("head", args.head)) if args.base else (("head", args.head),):
            into = os.path.join(work, label)
            tree(rev, into)
            versions[label] = os.path.join(into, "root")
        results: dict[str, list[dict]] = {label: [] for label in versions}
        for r in range(args.rounds):
            order = list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]
            for label, root in order:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--seconds", str(args.seconds),
                       "--models", args.models, "--levels", args.levels, "--seq", str(args.seq)]
                if not args.perf:
                    cmd.append("--no-perf")
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root,
                                      env=dict(os.environ, PYTHONPATH=root))
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"no result from {label}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
                results[label].append(json.loads(line[len("RESULT "):]))
                print(f"round {r + 1} {label}: " + " ".join(f"{k} {v:.3g}" for k, v in results[label][-1].items()),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedians over {args.rounds} rounds (base {args.base}, head {args.head or 'working tree'}; "
          f"per request the pool answered)")
    keys = list(dict.fromkeys(k for label in results for r in results[label] for k in r))
    for key in keys:
        med = {label: statistics.median([r[key] for r in results[label] if key in r]) for label in results}
        line = f"{key:28s} " + " ".join(f"{label} {v:9.2f}" for label, v in med.items())
        if "base" in med and med["base"]:
            line += f" {(med['head'] / med['base'] - 1) * 100:+6.1f}%"
        print(line)
    print(f"({time.strftime('%F %T')}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
