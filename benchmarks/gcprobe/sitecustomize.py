"""Garbage collections per generation of every Python process started with this folder on PYTHONPATH.

    PYTHONPATH=benchmarks/gcprobe GCPROBE_DIR=/tmp/gc python benchmarks/gateway_bench.py ...

Each process (the pool's front, workers and sidecar inherit the environment) rewrites
GCPROBE_DIR/PID.txt once a second: its command line, then per generation the number of collections,
their total seconds and the longest one. Without GCPROBE_DIR it does nothing.
"""

import gc
import os
import sys
import threading
import time

_OUT = os.environ.get("GCPROBE_DIR")
DUMP_EVERY_S = 1.0

if _OUT:
    _stats = {"n": [0, 0, 0], "t": [0.0, 0.0, 0.0], "max": [0.0, 0.0, 0.0]}
    _started = [0.0]

    def _count(phase: str, info: dict) -> None:
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        g, took = info["generation"], time.perf_counter() - _started[0]
        _stats["n"][g] += 1
        _stats["t"][g] += took
        _stats["max"][g] = max(_stats["max"][g], took)

    def _dump() -> None:
        path = os.path.join(_OUT, f"{os.getpid()}.txt")
        while True:
            time.sleep(DUMP_EVERY_S)
            with open(path, "w") as f:
                f.write(f"{' '.join(sys.argv)[:200]}\n{_stats}\n")

    gc.callbacks.append(_count)
    threading.Thread(target=_dump, daemon=True, name="gcprobe").start()
