"""One level split across several client processes, for loads one Python process cannot produce."""

import json
import subprocess
import sys
from dataclasses import asdict

import numpy as np

from gepool.bench.display import Display
from gepool.bench.load import make_inputs, measure, request_rows
from gepool.bench.results import Level, percentiles, server_window
from gepool.bench.ticker import Ticker
from gepool.common import errors

CHILD_GRACE_S = 300.0  # past the level's length, for a child to start, connect and answer


def run_level_processes(client, endpoint: str, model: str, mode: str, value: float, seconds: float,
                        batch_size: int, processes: int, shared_memory: bool,
                        input_files: dict[str, str] | None = None, display: Display | None = None) -> Level:
    """``value`` (a concurrency or a rate) shared among ``processes`` children, each
    ``python -m gepool.bench.processes ARGS_JSON``: it runs its share and prints its level (with every
    latency) as JSON; this merges them and reads the server once. ``input_files``: .npy files by input
    name that every child sends instead of generated data."""
    before = client.stats()[model]
    share = value / processes
    args = {"endpoint": endpoint, "model": model, "mode": mode, "seconds": seconds, "batch_size": batch_size,
            "shared_memory": shared_memory, "inputs": input_files or {}}
    procs = []
    for i in range(processes):
        mine = dict(args, value=share if mode == "rate" else int(value) // processes + (i < int(value) % processes),
                    seed=i)
        procs.append(subprocess.Popen([sys.executable, "-m", "gepool.bench.processes", json.dumps(mine)],
                                      stdout=subprocess.PIPE, text=True))
    level = Level(mode, value, processes=processes)
    latencies: list[float] = []

    def counts() -> tuple:  # the children report at their end: meanwhile, what the server has answered
        now = client.stats()[model]
        return None, now["requests"] - before["requests"], now["failures"] - before["failures"], None

    parts = []
    with Ticker(display, mode, value, seconds, processes, counts):
        for proc in procs:
            out, _ = proc.communicate(timeout=seconds + CHILD_GRACE_S)
            if proc.returncode != 0:
                raise errors.Internal(f"a bench client process failed (exit code {proc.returncode})")
            parts.append(json.loads(out))
    for part in parts:
        for key in ("sent", "ok", "rows"):
            setattr(level, key, getattr(level, key) + part[key])
        for kind, n in part["errors"].items():
            level.errors[kind] = level.errors.get(kind, 0) + n
        level.seconds = max(level.seconds, part["seconds"])
        level.send_lag_s = max(level.send_lag_s, part["send_lag_s"])
        level.client_saturated |= part["client_saturated"]
        level.client_cpu = max(level.client_cpu, part["client_cpu"])
        latencies += part["raw_latencies"]
    level.latency_ms = percentiles(latencies)
    level.throughput_rps = level.ok / level.seconds if level.seconds else 0.0
    level.rows_per_s = level.rows / level.seconds if level.seconds else 0.0
    level.server = server_window(before, client.stats()[model])
    return level


def main(argv: list[str]) -> int:
    """A child: its share of a level, as JSON on stdout."""
    from gepool.client import Client

    a = json.loads(argv[0])
    with Client(a["endpoint"], shared_memory=a["shared_memory"]) as c:
        meta = c.model_metadata(a["model"])
        inputs = dict(make_inputs(meta, a["batch_size"], a.get("seed", 0)),
                      **{name: np.load(path) for name, path in a.get("inputs", {}).items()})
        rows = request_rows(inputs, meta.get("max_batch_size", 0) > 0)
        level, latencies = measure(c, a["model"], inputs, a["mode"], a["value"], a["seconds"], rows)
    print(json.dumps(dict(asdict(level), raw_latencies=latencies)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
