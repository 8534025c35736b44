"""The front's per-model stats in Triton's terms: the statistics extension's JSON, and what /metrics reads.

One place reads the front's stats dicts, so that /v2/models/stats and the Prometheus series agree; a
figure a front does not report reads as 0.
"""

NS = 1_000_000_000
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")  # Triton's nv_inference_request_failure reasons


def duration(stats: dict, name: str, per_batch: bool = True) -> tuple[int, int]:
    """(count, ns) of one of Triton's duration statistics: ``name`` as ``{"count", "ns"}`` (Triton's
    form), else (``per_batch``) ``<name>_us`` (0 when absent) over the batches; else (0, 0)."""
    value = stats.get(name)
    if isinstance(value, dict):
        return int(value.get("count", 0)), int(value.get("ns", 0))
    if not per_batch:
        return 0, 0
    # counted per batch even while unmeasured, as before: perf_analyzer divides these times by the count
    return int(stats.get("batches", 0)), int(stats.get(f"{name}_us", 0)) * 1000


def failures(stats: dict) -> dict[str, int]:
    """Failed requests by Triton's reason: the front's ``failure_reasons`` when it reports them, else
    every failure as OTHER."""
    by_reason = stats.get("failure_reasons")
    if isinstance(by_reason, dict):
        return {reason: int(by_reason.get(reason, 0)) for reason in FAILURE_REASONS}
    return {reason: int(stats.get("failures", 0)) if reason == "OTHER" else 0 for reason in FAILURE_REASONS}


def _by_size(seconds: dict | None) -> dict[int, float]:
    """A per-batch-size figure with its keys as ints (msgpack may hand them over as either)."""
    return {int(k): v for k, v in (seconds or {}).items()}


def compute_count(s: dict) -> int:
    """compute_infer's count: a model's batches, the same count as compute_input's and compute_output's
    (perf_analyzer refuses stats where they differ, and a batch in flight is counted at dispatch); an
    ensemble runs no batch, and counts the requests whose steps it summed."""
    return s["batches"] or s["histograms"]["compute"]["count"]


def _pair(count: int, ns: int) -> dict:
    return {"count": count, "ns": ns}


def model_statistics(name: str, version: str, s: dict) -> dict:
    """One entry of Triton's ``model_stats`` from the front's stats of one model."""
    sizes, compute = s["batch_sizes"], s["batch_compute_s"]
    inputs, outputs = _by_size(s.get("batch_compute_input_s")), _by_size(s.get("batch_compute_output_s"))
    return {
        "name": name, "version": version, "last_inference": int(s["last_inference"] * 1000),
        "inference_count": s["rows"], "execution_count": s["batches"],
        "inference_stats": {
            "success": _pair(s["requests"], s["request_us"] * 1000),
            "fail": _pair(s["failures"], 0),
            "queue": _pair(s["histograms"]["queue"]["count"], s["queue_us"] * 1000),
            "compute_input": _pair(*duration(s, "compute_input")),
            "compute_infer": _pair(compute_count(s), s["compute_us"] * 1000),
            "compute_output": _pair(*duration(s, "compute_output")),
            "cache_hit": _pair(*duration(s, "cache_hit", False)),
            "cache_miss": _pair(*duration(s, "cache_miss", False))},
        "response_stats": {},
        "batch_stats": [{"batch_size": int(size), "compute_input": _pair(n, int(inputs.get(int(size), 0) * NS)),
                         "compute_infer": _pair(n, int(compute.get(size, 0) * NS)),
                         "compute_output": _pair(n, int(outputs.get(int(size), 0) * NS))}
                        for size, n in sizes.items()],
        "memory_usage": [],
    }
