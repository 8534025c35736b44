"""``bench()``: every level against a pool through the library client, in this process or several."""

import os
import tempfile
from dataclasses import asdict

import numpy as np

from gepool.bench.display import Display
from gepool.bench.load import make_inputs, request_rows, run_level
from gepool.bench.processes import run_level_processes
from gepool.bench.results import Level


def bench(client, model: str, concurrency: list[int] | None = None, rates: list[float] | None = None,
          seconds: float = 5.0, batch_size: int = 1, processes: int | str = 1, given: dict | None = None,
          display: Display | None = None) -> dict:
    """Every level in this process, or split across ``processes`` client processes; ``"auto"`` starts
    with one and doubles while the client side is saturated (up to the host's cores).
    ``given`` replaces generated inputs by name (arrays, e.g. loaded from .npy files); ``display``
    hears each level's progress as it runs, and its end."""
    meta = client.model_metadata(model)
    inputs = dict(make_inputs(meta, batch_size), **(given or {}))
    rows = request_rows(inputs, meta.get("max_batch_size", 0) > 0)
    plan = [("concurrency", c) for c in (concurrency or [])] + [("rate", r) for r in (rates or [])]
    auto = processes == "auto"
    most = max(1, os.cpu_count() or 1) if auto else int(processes)
    shm = getattr(client, "arena", None) is not None
    with tempfile.TemporaryDirectory(prefix="gepool-bench-") as tmp:
        files = {}
        for name, arr in (given or {}).items():  # child processes load the same data
            files[name] = os.path.join(tmp, f"input{len(files)}.npy")
            np.save(files[name], arr)

        def run(mode: str, value: float, n: int) -> Level:
            if n == 1:
                return run_level(client, model, inputs, mode, value, seconds, rows, display)
            return run_level_processes(client, client.endpoint, model, mode, value, seconds, batch_size, n,
                                       shm, files, display)

        levels = []
        for mode, value in plan:
            n = 1 if auto else most
            level = run(mode, value, n)
            while auto and level.client_saturated and 2 * n <= most and (mode == "rate" or value >= 2 * n):
                n *= 2
                if display is not None:
                    display.finished(level, again_with=n)
                level = run(mode, value, n)
            if display is not None:
                display.finished(level)
            levels.append(level)
    return {"model": model, "batch_size": batch_size, "seconds": seconds,
            "inputs": {k: list(v.shape) for k, v in inputs.items()}, "processes": processes,
            "pool": pool_setup(client, model), "levels": [asdict(x) for x in levels]}


def pool_setup(client, model: str) -> dict:
    """What the figures depend on besides the load: the model's workers and their threads, and whether
    the front polls (concurrency-1 latency depends on it)."""
    status = client.status()
    m = status["models"].get(model, {})
    return {"workers": len(m.get("worker_pids", [])), "worker_threads": m.get("worker_threads", []),
            "polling": status.get("polling", {}).get("mode", "unknown")}
