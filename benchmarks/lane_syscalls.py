"""Syscalls per request on the lane between the HTTP sidecar and the front, under wrk: counts contention does
not distort (sendmsg, recvmsg and poll-type waits per request, per process), for this tree or, alternating,
for a base revision and this tree.

    python benchmarks/lane_syscalls.py [--base REV] [--rounds 2] [--seconds 5] [--levels 8,64] [--models tiny]

Counted with perf's syscall tracepoints (``perf stat -e syscalls:sys_enter_*  -p PID``, every thread of the
process), over the same window as wrk's load; divided by the requests the pool counted in it. "waits" are
poll, ppoll, select, pselect6, epoll_wait and epoll_pwait: each is one look at the process's descriptors,
the loop's wake-ups included. CPU us per request is utime+stime from /proc over the window.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gateway_ab  # noqa: E402
import gateway_bench as gb  # noqa: E402

WAITS = ("poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait")
EVENTS = ("sendmsg", "recvmsg", "sendto", "recvfrom") + WAITS
ROW = re.compile(r"^ROW (\S+) (\d+) (\S+) (.*)$")


def perf_count(pid: int, seconds: float, out: str) -> subprocess.Popen:
    events = ",".join(f"syscalls:sys_enter_{e}" for e in EVENTS)
    return subprocess.Popen(["perf", "stat", "-x,", "-o", out, "-e", events, "-p", str(pid), "--", "sleep",
                             str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_counts(path: str) -> dict[str, int]:
    counts = {}
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) > 2 and fields[2].startswith("syscalls:sys_enter_"):
                counts[fields[2].removeprefix("syscalls:sys_enter_")] = int(fields[0]) if fields[0].isdigit() else 0
    return counts


def measure(args: argparse.Namespace) -> None:
    """One run on the gepool that PYTHONPATH gives: a ROW line per model, level and process."""
    from gepool.bench.results import server_window

    with gb.served("gepool-lanesys-") as (pool, url, workdir):
        client = pool.client()
        procs = {k: v for k, v in gb.processes(pool.process.pid, None).items() if k in ("front", "sidecar")}
        for model in args.models.split(","):
            gb.run_wrk(url, model, 8, 1.0, workdir)  # warm-up
            for conc in [int(c) for c in args.levels.split(",")]:
                before_stats = client.stats()[model]
                cpu0 = {k: gb.cpu_seconds(p) for k, p in procs.items()}
                outs = {k: os.path.join(workdir, f"{k}.perf") for k in procs}
                counters = [perf_count(p, args.seconds, outs[k]) for k, p in procs.items()]
                r = gb.run_wrk(url, model, conc, args.seconds, workdir)
                for c in counters:
                    c.wait(60)
                cpu1 = {k: gb.cpu_seconds(p) for k, p in procs.items()}
                n = max(server_window(before_stats, client.stats()[model])["requests"], 1)
                for k in procs:
                    counts = read_counts(outs[k])
                    fields = {"rps": r["rps"], "cpu_us": (cpu1[k] - cpu0[k]) / n * 1e6}
                    fields.update({e: counts.get(e, 0) / n for e in ("sendmsg", "recvmsg")})
                    fields["waits"] = sum(counts.get(e, 0) for e in WAITS) / n
                    print(f"ROW {model} {conc} {k} " + " ".join(f"{f}={v:.3f}" for f, v in fields.items()),
                          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="a revision to alternate with this tree (ABBA); without it, this tree alone")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0, help="per level and version")
    p.add_argument("--levels", default="8,64")
    p.add_argument("--models", default="tiny")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child run
    args = p.parse_args()
    if args.measure:
        measure(args)
        return
    if shutil.which("perf") is None or shutil.which("wrk") is None:
        raise SystemExit("needs perf and wrk")
    work = tempfile.mkdtemp(prefix="gepool-lanesys-ab-")
    versions = {"head": None}
    try:
        if args.base:
            into = os.path.join(work, "base")
            gateway_ab.tree(args.base, into)
            versions = {"base": os.path.join(into, "root"), "head": None}
        results: dict[str, list[dict]] = {v: [] for v in versions}
        for r in range(args.rounds):
            order = list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]
            for label, root in order:
                env = dict(os.environ, PYTHONPATH=root) if root else dict(os.environ)
                cmd = [sys.executable, os.path.abspath(__file__), "--measure", "--seconds", str(args.seconds),
                       "--levels", args.levels, "--models", args.models]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root or os.getcwd())
                run = {}
                for line in proc.stdout.splitlines():
                    m = ROW.match(line)
                    if m:
                        model, conc, who, rest = m.groups()
                        run[(model, int(conc), who)] = {k: float(v) for k, v in (f.split("=") for f in rest.split())}
                        print(f"round {r + 1} {label} {line[4:]}", flush=True)
                if not run:
                    print(proc.stdout[-2000:], proc.stderr[-2000:])
                results[label].append(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedians over {args.rounds} rounds, per request (base {args.base or '-'}, head: this tree)")
    keys = sorted(set().union(*(set(r) for runs in results.values() for r in runs)))
    for key in keys:
        line = f"{key[0]:5s} c={key[1]:<3d} {key[2]:8s}"
        for field in ("rps", "cpu_us", "sendmsg", "recvmsg", "waits"):
            meds = []
            for label in results:
                vals = [r[key][field] for r in results[label] if key in r]
                meds.append(f"{statistics.median(vals):.2f}" if vals else "-")
            line += f"  {field} " + "/".join(meds)
        print(line)
    if args.base:
        print("(each figure: base/head)")


if __name__ == "__main__":
    main()
