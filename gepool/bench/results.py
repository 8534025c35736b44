"""What one load level measured (``Level``), its latency percentiles and the server's view of its window."""

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class Level:
    mode: str  # "concurrency" or "rate"
    level: float
    seconds: float = 0.0
    sent: int = 0
    ok: int = 0
    rows: int = 0
    errors: dict = field(default_factory=dict)
    latency_ms: dict = field(default_factory=dict)  # p50 p90 p95 p99 max mean
    throughput_rps: float = 0.0
    rows_per_s: float = 0.0
    client_saturated: bool = False
    send_lag_s: float = 0.0
    client_cpu: float = 0.0  # the busiest client process's CPU seconds per second of the level
    processes: int = 1
    server: dict = field(default_factory=dict)


def level_label(mode: str | None, value: float | None) -> str:
    """'conc 16' or 'rate 1000', as the report, the live display and the sweep name a level."""
    if mode is None:
        return "-"
    return f"{'conc' if mode == 'concurrency' else 'rate'} {value:g}"


def percentiles(latencies_s: list[float]) -> dict:
    """p50/p90/p95/p99, max and mean in milliseconds of latencies in seconds; {} for none."""
    if not latencies_s:
        return {}
    arr = np.asarray(latencies_s) * 1000
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["max"], out["mean"] = float(arr.max()), float(arr.mean())
    return out


def batch_counts(sizes: dict) -> dict[int, int]:
    """{batch size: count} with int keys, from the pool's stats or a report read back from JSON (str keys)."""
    return {int(k): int(v) for k, v in sizes.items()}


def server_window(before: dict, after: dict) -> dict:
    """What the pool saw between two stats snapshots of one model."""
    batches = after["batches"] - before["batches"]
    reqs = after["requests"] - before["requests"]
    was = batch_counts(before["batch_sizes"])
    sizes = {k: v - was.get(k, 0) for k, v in batch_counts(after["batch_sizes"]).items()}
    return window(reqs, batches, after["rows"] - before["rows"], (after["queue_us"] - before["queue_us"]) / 1000,
                  (after["compute_us"] - before["compute_us"]) / 1000, sizes)


def window(requests: int, batches: int, rows: int, queue_ms: float, compute_ms: float, sizes: dict[int, int]) -> dict:
    """The server's view of a level, whichever protocol it was read over: totals in, averages out."""
    return {"requests": requests, "batches": batches,
            "avg_batch_size": rows / batches if batches else 0.0,
            "queue_ms_avg": queue_ms / max(requests, 1),
            "compute_ms_avg": compute_ms / max(batches, 1),
            "batch_sizes": {k: v for k, v in sorted(sizes.items()) if v}}
