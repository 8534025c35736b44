"""Prometheus text for /metrics: Triton's metric names and labels, plus the histograms users ask for.

Triton prints its counters without a ``_total`` suffix (prometheus-cpp); those are written here in
exactly that form so existing dashboards keep working. The histograms (request, queue, compute
time, batch size) and gepool's own gauges go through prometheus_client.
"""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gepool.http.statistics import duration, failures

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WORKER_LABELS = ["model", "worker", "device"]
# a worker's DeviceStats reading -> (family, help): Triton's nv_gpu_* names with gepool's prefix
_DEVICE = (
    ("memory_used_bytes", "gepool_device_memory_used_bytes",
     "Device used memory, in bytes, as the device reports it (all processes on the device)"),
    ("memory_total_bytes", "gepool_device_memory_total_bytes", "Device total memory, in bytes"),
    ("utilization_ratio", "gepool_device_utilization_ratio", "Device (AI Core) utilization rate [0.0 - 1.0]"),
    ("rss_bytes", "gepool_worker_resident_memory_bytes", "Resident memory of the worker process, in bytes"),
)

_TRITON = (  # name, help, (count, microseconds) or a count from one model's stats
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     lambda s: s["requests"]),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", lambda s: s["rows"]),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     lambda s: s["batches"]),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes cached "
     "requests)", lambda s: s["request_us"]),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached "
     "requests)", lambda s: s["queue_us"]),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not "
     "include cached requests)", lambda s: duration(s, "compute_input")[1] // 1000),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not "
     "include cached requests)", lambda s: s["compute_us"]),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds "
     "(does not include cached requests)", lambda s: duration(s, "compute_output")[1] // 1000),
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", lambda s: duration(s, "cache_hit", False)[0]),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     lambda s: duration(s, "cache_hit", False)[1] // 1000),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model",
     lambda s: duration(s, "cache_miss", False)[0]),
    ("nv_cache_miss_duration_per_model", "Total cache miss (insert+lookup) duration per model, in microseconds",
     lambda s: duration(s, "cache_miss", False)[1] // 1000),
)


# Triton's per-request series, and nv_inference_request_failure, carry a ``protocol`` label: the surface
# the requests came by (library, http, grpc); the rest count batches, which may mix them.
PER_REQUEST = ("nv_inference_request_success", "nv_inference_request_duration_us", "nv_inference_queue_duration_us")


def _protocols(stats: dict) -> list[tuple[dict, dict]]:
    """[(the protocol label, that protocol's counters)], or the model's own under no label where the
    front reports none by protocol."""
    by = stats.get("protocols")
    if not isinstance(by, dict):
        return [({}, stats)]
    return [({"protocol": name}, p) for name, p in by.items()]


def _labels(**kv) -> str:
    return ",".join(f'{k}="{v}"' for k, v in kv.items())


def render(status: dict, stats: dict, host: tuple[float, int, int] | None = None) -> bytes:
    """The /metrics text; ``host`` is (CPU utilization, RAM total bytes, RAM used bytes) for Triton's
    nv_cpu_* gauges."""
    lines = []
    models = status.get("models", {})
    versions = {model: str(models.get(model, {}).get("version") or 1) for model in stats}
    for name, help_text, value in _TRITON:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        for model, s in stats.items():
            if name in PER_REQUEST:
                for protocol, p in _protocols(s):
                    lines.append(f"{name}{{{_labels(model=model, **protocol, version=versions[model])}}} {value(p)}")
            else:
                lines.append(f"{name}{{{_labels(model=model, version=versions[model])}}} {value(s)}")
    lines += ["# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes",
              "# TYPE nv_inference_request_failure counter"]
    for model, s in stats.items():
        for protocol, p in _protocols(s):
            for reason, count in failures(p).items():
                labels = _labels(model=model, **protocol, reason=reason, version=versions[model])
                lines.append(f"nv_inference_request_failure{{{labels}}} {count}")
    lines += ["# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting "
              "execution per-model.", "# TYPE nv_inference_pending_request_count gauge"]
    for model, m in models.items():
        lines.append(f"nv_inference_pending_request_count{{{_labels(model=model, version=str(m.get('version') or 1))}}}"
                     f" {m.get('queued', 0)}")
    if host is not None:
        for name, help_text, value in (("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", host[0]),
                                       ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", host[1]),
                                       ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", host[2])):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
    registry = CollectorRegistry()
    registry.register(_Collector(status, stats))
    return ("\n".join(lines) + "\n").encode() + generate_latest(registry)


class _Collector:
    def __init__(self, status: dict, stats: dict) -> None:
        self.status, self.stats = status, stats

    def collect(self):
        models = self.status.get("models", {})
        hist = {k: HistogramMetricFamily(f"gepool_{k}_duration_seconds", f"{k} time per {unit}",
                                         labels=["model", "version"])
                for k, unit in (("request", "request"), ("queue", "request"), ("compute", "batch"))}
        batch = HistogramMetricFamily("gepool_batch_size", "rows per executed batch", labels=["model", "version"])
        for model, s in self.stats.items():
            labels = [model, str(models.get(model, {}).get("version") or 1)]
            for key, family in hist.items():
                h = s["histograms"][key]
                cumulative, buckets = 0, []
                for bound, count in zip([*h["buckets"], float("inf")], h["counts"]):
                    cumulative += count
                    buckets.append((_le(bound), cumulative))
                family.add_metric(labels, buckets, h["sum"])
            sizes = {int(k): v for k, v in s["batch_sizes"].items()}
            cumulative, buckets = 0, []
            for bound in [*BATCH_BUCKETS, float("inf")]:
                cumulative = sum(v for k, v in sizes.items() if k <= bound)
                buckets.append((_le(bound), cumulative))
            batch.add_metric(labels, buckets, float(sum(k * v for k, v in sizes.items())))
        yield from hist.values()
        yield batch
        occupancy = GaugeMetricFamily("gepool_slot_occupancy", "slots holding a batch / slots", labels=["model"])
        restarts = GaugeMetricFamily("gepool_worker_restarts", "worker restarts since the pool started",
                                     labels=["model"])
        memory = GaugeMetricFamily("gepool_device_memory_bytes", "device memory held by workers",
                                   labels=["model", "device"])
        for model, m in models.items():
            total = m.get("slots", 0)
            occupancy.add_metric([model], (m.get("slots_busy", 0) / total) if total else 0.0)
            restarts.add_metric([model], m.get("restarts", 0))
            for device, held in m.get("device_memory", {}).items():
                memory.add_metric([model, device], held)
        yield occupancy
        yield restarts
        yield memory
        yield from _device_families(models)


def _device_families(models: dict):
    """The readings of each ready worker's latest DeviceStats: a worker that is gone has no series."""
    gauges = {key: GaugeMetricFamily(name, text, labels=WORKER_LABELS) for key, name, text in _DEVICE}
    cpu = CounterMetricFamily("gepool_worker_cpu_seconds", "CPU time the worker process has used, in seconds",
                              labels=WORKER_LABELS)
    for model, m in models.items():
        for d in m.get("devices", []):
            labels = [model, str(d.get("worker")), str(d.get("device"))]
            for key, family in gauges.items():
                if key in d:
                    family.add_metric(labels, d[key])
            if "cpu_seconds" in d:
                cpu.add_metric(labels, d["cpu_seconds"])
    yield from gauges.values()
    yield cpu


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
