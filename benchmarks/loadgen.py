"""Load and accounting the peer benchmarks share: wrk posting a KServe v2 JSON body, and CPU per process from /proc."""

import json
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

CLK_TCK = os.sysconf("SC_CLK_TCK")
REQUEST_TIMEOUT_S = 30.0
WRK_SCRIPT = """
local f = io.open("{body}", "rb")
wrk.method = "POST"
wrk.body = f:read("*a")
wrk.headers["Content-Type"] = "application/json"
f:close()
"""
_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def kserve_json(name: str, x: np.ndarray) -> bytes:
    """A KServe v2 infer body with one FP32 tensor as JSON data."""
    return json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()
    return float(value) * _UNIT[unit]


def wrk(target: str, body: bytes, concurrency: int, seconds: float) -> dict | None:
    """wrk posting ``body`` to ``target`` with ``concurrency`` connections (closed loop) for ``seconds``,
    after a one-second warm-up: requests, errors (non-2xx and socket errors), rps, p50_ms, p99_ms and the
    CPU seconds wrk itself used; None when wrk is missing or failed (its output is printed)."""
    exe = shutil.which("wrk")
    if exe is None:
        return None
    scratch = tempfile.mkdtemp(prefix="gepool-wrk-")
    try:
        with open(os.path.join(scratch, "body"), "wb") as f:
            f.write(body)
        script = os.path.join(scratch, "post.lua")
        with open(script, "w") as f:
            f.write(WRK_SCRIPT.format(body=os.path.join(scratch, "body")))
        subprocess.run([exe, "-t1", "-c1", "-d1s", "-s", script, target], capture_output=True)  # warm-up
        proc = subprocess.Popen([exe, f"-t{min(2, concurrency)}", f"-c{concurrency}",
                                 f"-d{max(1, round(seconds))}s", f"--timeout={REQUEST_TIMEOUT_S:.0f}s", "--latency",
                                 "-s", script, target], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"\s50%\s+(\S+)", out)
    p99 = re.search(r"\s99%\s+(\S+)", out)
    if proc.returncode != 0 or not (rps and p50 and p99):
        print(f"wrk on {target} failed:\n{out[-1500:]}")
        return None
    done = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad[1]) if bad else 0) + (sum(map(int, socket_errors.groups())) if socket_errors else 0)
    return {"requests": int(done[1]) if done else 0, "errors": errors, "rps": float(rps[1]),
            "p50_ms": _ms(p50[1]), "p99_ms": _ms(p99[1]), "client_cpu_s": usage.ru_utime + usage.ru_stime}


def descendants(root: int) -> dict[int, str]:
    """pid -> title for every process below ``root`` (Ray's gcs_server and raylet, its workers, gepool's
    fronts and workers)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found[child] = title(child)
                frontier.append(child)
    return found


def title(pid: int) -> str:
    """A process's group: a Ray worker's title without the method it runs now, or its module or script."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0].split(".")[0]
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    if "-c" in argv[:-1]:
        return "python -c " + argv[argv.index("-c") + 1][:40]
    if len(argv) > 1 and argv[1].endswith(".py"):
        return os.path.basename(argv[1])
    return os.path.basename(argv[0])


def cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_s(root: int) -> float:
    """CPU seconds so far of ``root`` and every process below it."""
    return cpu_s(root) + sum(cpu_s(p) for p in descendants(root))
