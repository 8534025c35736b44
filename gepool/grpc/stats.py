"""ModelStatistics rows in Triton's shape from the front's per-model counters (as the HTTP gateway answers)."""

from gepool.http.statistics import compute_count

NS_PER_US = 1000
NS_PER_S = 1_000_000_000


def _duration(count: int, ns: int = 0) -> dict:
    return {"count": count, "ns": int(ns)}


def rows(stats: dict, status: dict, wanted: str | None = None) -> list[dict]:
    """One ModelStatistics (as a dict for json_format) per model, or only ``wanted``'s."""
    out = []
    for name, s in stats.items():
        if wanted is not None and name != wanted:
            continue
        sizes, compute = s["batch_sizes"], s["batch_compute_s"]
        out.append({
            "name": name, "version": str(status["models"].get(name, {}).get("version") or ""),
            "last_inference": int(s["last_inference"] * 1000), "inference_count": s["rows"],
            "execution_count": s["batches"],
            "inference_stats": {
                "success": _duration(s["requests"], s["request_us"] * NS_PER_US),
                "fail": _duration(s["failures"]),
                "queue": _duration(s["histograms"]["queue"]["count"], s["queue_us"] * NS_PER_US),
                "compute_input": _duration(s["batches"]),
                "compute_infer": _duration(compute_count(s), s["compute_us"] * NS_PER_US),
                "compute_output": _duration(s["batches"]),
                "cache_hit": _duration(0), "cache_miss": _duration(0)},
            "batch_stats": [{"batch_size": int(size), "compute_input": _duration(n),
                             "compute_infer": _duration(n, compute.get(size, 0) * NS_PER_S),
                             "compute_output": _duration(n)} for size, n in sizes.items()],
        })
    return out
