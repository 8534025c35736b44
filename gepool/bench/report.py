"""The text report of a bench run: one row per level, then the batch sizes the server ran."""

import json
import math

from gepool.bench.results import batch_counts, level_label

BATCH_SIZES_SHOWN = 4


def format_report(report: dict) -> str:
    pool = report.get("pool")
    setup = (f"; {pool['workers']} worker(s), threads {pool['worker_threads']}, front polling {pool['polling']}"
             if pool else "")
    lines = [f"model {report['model']}, batch {report['batch_size']}, {report['seconds']:.0f}s per level{setup}",
             f"{'load':>14s} {'req/s':>9s} {'rows/s':>9s} {'p50':>8s} {'p90':>8s} {'p95':>8s} {'p99':>8s} "
             f"{'max':>8s}  {'server batch':>12s} {'queue ms':>8s} {'compute ms':>10s}  errors"]
    for lv in report["levels"]:
        lat = lv["latency_ms"] or dict.fromkeys(("p50", "p90", "p95", "p99", "max"), math.nan)
        label = level_label(lv["mode"], lv["level"])
        s = lv["server"]
        lines.append(f"{label:>14s} {lv['throughput_rps']:9.1f} {lv['rows_per_s']:9.1f} "
                     + " ".join(f"{lat[k]:8.2f}" for k in ("p50", "p90", "p95", "p99", "max"))
                     + f"  {s['avg_batch_size']:12.2f} {s['queue_ms_avg']:8.2f} {s['compute_ms_avg']:10.2f}  "
                     + (json.dumps(lv["errors"]) if lv["errors"] else "-")
                     + (f"  ({lv.get('processes', 1)} client processes)" if lv.get("processes", 1) > 1 else "")
                     + ("  (client saturated)" if lv["client_saturated"] else ""))
    shares = [(lv, batch_shares(lv["server"].get("batch_sizes", {}))) for lv in report["levels"]]
    if any(s for _, s in shares):
        lines.append("batch sizes the server ran (rows: share of batches)")
        for lv, s in shares:
            top = ", ".join(f"{size}: {share:.0%}" if share >= 0.01 else f"{size}: <1%"
                            for size, share in s[:BATCH_SIZES_SHOWN])
            more = f" and {len(s) - BATCH_SIZES_SHOWN} more" if len(s) > BATCH_SIZES_SHOWN else ""
            lines.append(f"{level_label(lv['mode'], lv['level']):>14s}  {top or '-'}{more}")
    return "\n".join(lines)


def batch_shares(sizes: dict) -> list[tuple[int, float]]:
    """(batch size, share of batches), the most frequent first, from a level's ``batch_sizes`` (a report
    made here, or read back from its JSON)."""
    counts = batch_counts(sizes)
    total = sum(counts.values())
    if not total:
        return []
    return sorted(((k, v / total) for k, v in counts.items() if v), key=lambda kv: (-kv[1], kv[0]))
