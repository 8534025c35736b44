"""CPU seconds of a running pool's processes by role (front, each worker by model, sidecar, this client)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gateway_bench import cmdline, cpu_seconds, descendants  # noqa: E402

CLIENT = "client"


def pool_processes(status: dict) -> dict[str, list[int]]:
    """{role: pids} of the pool whose status this is: "front", "worker <model>" per model with a worker,
    "sidecar" (the gateway and whatever it started) when one runs. Workers are read from the status,
    the sidecar from the front's children, as ``benchmarks/gateway_bench.py`` finds it."""
    front = status["pid"]
    out: dict[str, list[int]] = {"front": [front]}
    for name, model in sorted(status["models"].items()):
        if model.get("worker_pids"):
            out[f"worker {name}"] = list(model["worker_pids"])
    for pid in descendants(front):
        if "_gateway_main" in cmdline(pid):
            out["sidecar"] = [pid, *descendants(pid)]
    out[CLIENT] = [os.getpid()]
    return out


def changed(before: dict[str, list[int]], after: dict[str, list[int]]) -> list[str]:
    """The roles whose processes differ between two readings of ``pool_processes`` (one restarted, came or
    went): over a window between them, their CPU is wrong (a dead process reads 0, a new one is missed)."""
    return sorted(r for r in before.keys() | after.keys() if sorted(before.get(r, ())) != sorted(after.get(r, ())))


def sample(procs: dict[str, list[int]]) -> dict[str, float]:
    """utime+stime (all threads) of each role now, in seconds."""
    return {role: sum(cpu_seconds(p) for p in pids) for role, pids in procs.items()}


def per_request(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """CPU microseconds per request of each role over the window between two samples."""
    return {role: (after[role] - before[role]) / max(requests, 1) * 1e6 for role in before}


def cores() -> int:
    return len(os.sched_getaffinity(0))
