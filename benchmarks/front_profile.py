"""The front's CPU per request under the gateway's HTTP load, by function: py-spy samples of the front process
while wrk drives the sidecar (as benchmarks/gateway_bench.py does), with perf's syscall counts beside them.

    python benchmarks/front_profile.py [--seconds 10] [--levels 8,64] [--models tiny,mlp] [--top 15]
        [--rate 100] [--raw-dir DIR] [--no-syscalls]

Per model and level: req/s, the front's CPU us per request (utime+stime from /proc over the window / the
requests the pool counted), its sendmsg/recvmsg/waits per request (perf's syscall tracepoints, as
benchmarks/lane_syscalls.py counts them), and the top functions by self and by cumulative time, each in
us per request: samples x (1 / rate) / requests, and as a share of all samples. py-spy runs with --gil: only
samples of the thread holding the GIL count, so a wait (epoll, select: the GIL released) does not; on this
kind of host the samples add up to about half to two thirds of the CPU /proc gives (the shares are the
figures to read). py-spy pauses the process for each sample, which costs the front a little: read its CPU
per request from a run without it (gateway_ab.py, or ``--rate 0`` here). ``--raw-dir`` keeps py-spy's collapsed stacks.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gateway_bench as gb  # noqa: E402
import lane_syscalls  # noqa: E402

SYSCALLS = ("read", "write", "readv", "writev", "sendmsg", "recvmsg", "sendto", "recvfrom", "epoll_wait", "epoll_pwait",
            "epoll_ctl", "select", "pselect6", "poll", "ppoll", "sched_yield", "futex", "getpid", "getsockopt",
            "ioctl", "mmap", "munmap", "madvise", "brk", "lseek", "newfstat", "newfstatat", "clock_nanosleep")
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_raw(path: str) -> tuple[collections.Counter, collections.Counter, int]:
    """(self samples, cumulative samples, total samples) by 'function (file)' from py-spy's raw format."""
    own, cum = collections.Counter(), collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = []
            for frame in stack.split(";"):
                m = FRAME.match(frame)
                frames.append(f"{m['func']} ({m['file']})" if m else frame)
            if frames and frames[0].startswith("process "):  # py-spy's "process PID:..." root with --threads
                frames = frames[1:]
            if not frames:
                continue
            own[frames[-1]] += n
            for name in set(frames):
                cum[name] += n
    return own, cum, total


def count_syscalls(pid: int, seconds: float, out: str) -> subprocess.Popen:
    events = ",".join(f"syscalls:sys_enter_{e}" for e in SYSCALLS)
    return subprocess.Popen(["perf", "stat", "-x,", "-o", out, "-e", events, "-p", str(pid), "--", "sleep",
                             str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches over every thread of ``pid``: voluntary ones are wake-ups."""
    vol = invol = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except OSError:
            pass
    return vol, invol


def user_system(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / gb.TICK, int(fields[12]) / gb.TICK


def spy(pid: int, seconds: float, rate: int, out: str) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--format", "raw", "--function", "--gil",
                             "--rate", str(rate), "--duration", str(max(1, round(seconds))), "--output", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def table(title: str, counts: collections.Counter, other: collections.Counter, per_sample_us: float,
          top: int) -> None:
    total = sum(counts.values()) if title.startswith("by self") else sum(other.values())
    print(f"  {title}")
    print(f"  {'self us':>8s} {'cum us':>8s} {'self %':>6s} {'cum %':>6s}  function (file)")
    for name, n in counts.most_common(top):
        a, b = (n, other[name]) if title.startswith("by self") else (other[name], n)
        print(f"  {a * per_sample_us:8.1f} {b * per_sample_us:8.1f} {a / total * 100:6.1f} {b / total * 100:6.1f}"
              f"  {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="per model and level")
    p.add_argument("--levels", default="8,64")
    p.add_argument("--models", default="tiny,mlp")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--rate", type=int, default=100,
                   help="py-spy samples per second (0: no py-spy, for the counts alone)")
    p.add_argument("--raw-dir", help="keep py-spy's collapsed stacks here")
    p.add_argument("--no-syscalls", action="store_true", help="skip perf's syscall counts")
    args = p.parse_args()
    for tool in ("wrk", "py-spy") + (() if args.no_syscalls else ("perf",)):
        if shutil.which(tool) is None:
            raise SystemExit(f"needs {tool}")
    from gepool.bench.results import server_window

    with gb.served("gepool-frontprof-") as (pool, url, workdir):
        client = pool.client()
        front = pool.process.pid
        for model in args.models.split(","):
            gb.run_wrk(url, model, 8, 1.0, workdir)  # warm-up
            for conc in [int(c) for c in args.levels.split(",")]:
                raw = os.path.join(args.raw_dir or workdir, f"front-{model}-c{conc}.txt")
                perf_out = os.path.join(workdir, "front.perf")
                before = client.stats()[model]
                cpu0, sw0 = user_system(front), switches(front)
                sampler = spy(front, args.seconds, args.rate, raw) if args.rate else None
                counter = None if args.no_syscalls else count_syscalls(front, args.seconds, perf_out)
                r = gb.run_wrk(url, model, conc, args.seconds, workdir)
                if sampler is not None:
                    sampler.wait(60)
                if counter is not None:
                    counter.wait(60)
                cpu1, sw1 = user_system(front), switches(front)
                window = server_window(before, client.stats()[model])
                n = max(window["requests"], 1)
                user, system = ((b - a) / n * 1e6 for a, b in zip(cpu0, cpu1))
                print(f"\n{model} c={conc}: {r['rps']:.0f} req/s, batch {window['avg_batch_size']:.1f}, "
                      f"front CPU {user + system:.1f} us/request (user {user:.1f}, system {system:.1f}; "
                      f"{'under py-spy' if args.rate else 'no py-spy'}), context switches per request: "
                      f"voluntary {(sw1[0] - sw0[0]) / n:.2f} involuntary {(sw1[1] - sw0[1]) / n:.2f}")
                if counter is not None:
                    counts = lane_syscalls.read_counts(perf_out)
                    print("  syscalls per request: " + " ".join(
                        f"{e} {c / n:.2f}" for e, c in sorted(counts.items(), key=lambda kv: -kv[1]) if c))
                if not args.rate or not os.path.exists(raw):
                    print("  (no py-spy samples)" if args.rate else "")
                    continue
                own, cum, total = parse_raw(raw)
                per_sample_us = 1e6 / args.rate / n
                print(f"  {total} samples = {total * per_sample_us:.1f} us/request of running Python")
                table("by self time", own, cum, per_sample_us, args.top)
                table("by cumulative time", cum, own, per_sample_us, args.top)


if __name__ == "__main__":
    main()
