"""Prometheus text for /metrics: Triton's metric names and labels, plus the histograms users ask for.

Triton prints its counters without a ``_total`` suffix (prometheus-cpp); those are written here in
exactly that form so existing dashboards keep working. The histograms (request, queue, compute
time, batch size) and gepool's own gauges go through prometheus_client.
"""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

_TRITON = (  # name, type, help, stats key (or callable)
    ("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes",
     "requests"),
    ("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)", "rows"),
    ("nv_inference_exec_count", "counter", "Number of model executions performed", "batches"),
    ("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in microseconds",
     "request_us"),
    ("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in microseconds",
     "queue_us"),
    ("nv_inference_compute_input_duration_us", "counter", "Cumulative compute input duration in microseconds",
     None),
    ("nv_inference_compute_infer_duration_us", "counter", "Cumulative compute inference duration in microseconds",
     "compute_us"),
    ("nv_inference_compute_output_duration_us", "counter", "Cumulative inference compute output duration in "
     "microseconds", None),
)


def _labels(**kv) -> str:
    return ",".join(f'{k}="{v}"' for k, v in kv.items())


def render(status: dict, stats: dict) -> bytes:
    lines = []
    models = status.get("models", {})
    for name, kind, help_text, key in _TRITON:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for model, s in stats.items():
            version = str(models.get(model, {}).get("version") or 1)
            lines.append(f"{name}{{{_labels(model=model, version=version)}}} {s.get(key, 0) if key else 0}")
    lines += ["# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes",
              "# TYPE nv_inference_request_failure counter"]
    for model, s in stats.items():
        version = str(models.get(model, {}).get("version") or 1)
        lines.append(f"nv_inference_request_failure{{{_labels(model=model, reason='OTHER', version=version)}}} "
                     f"{s.get('failures', 0)}")
    lines += ["# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting "
              "execution per-model.", "# TYPE nv_inference_pending_request_count gauge"]
    for model, m in models.items():
        lines.append(f"nv_inference_pending_request_count{{{_labels(model=model, version=str(m.get('version') or 1))}}}"
                     f" {m.get('queued', 0)}")
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


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
