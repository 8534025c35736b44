"""Per-model counters and latency histograms the front keeps and reports through the 'stats' query.

Triton has only counters and summaries for latency; gepool keeps real histograms (fixed buckets, so
they aggregate across replicas) of request, queue and compute time, and the batch-size histogram.
"""

import bisect
import collections
import time
from dataclasses import dataclass, field

# seconds; the same bounds for request, queue and compute time
BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.total += seconds
        self.n += 1

    def as_dict(self) -> dict:
        return {"buckets": list(BUCKETS_S), "counts": list(self.counts), "sum": self.total, "count": self.n}


@dataclass
class ModelStats:
    requests: int = 0  # answered with outputs
    failures: int = 0
    batches: int = 0
    rows: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
    batch_compute_s: collections.Counter = field(default_factory=collections.Counter)  # batch size -> seconds
    request: Histogram = field(default_factory=Histogram)  # arrival -> answer, successful requests
    queue: Histogram = field(default_factory=Histogram)  # arrival -> copied into a slot
    compute: Histogram = field(default_factory=Histogram)  # worker start -> finish, per batch
    last_inference: float = 0.0  # wall clock of the last answer

    def dispatched(self, rows: int, waits: list[float]) -> None:
        self.batches += 1
        self.rows += rows
        self.batch_sizes[rows] += 1
        for w in waits:
            self.queue.observe(w)

    def computed(self, rows: int, seconds: float) -> None:
        self.compute.observe(seconds)
        self.batch_compute_s[rows] += seconds

    def answered(self, seconds: float) -> None:
        self.requests += 1
        self.request.observe(seconds)
        self.last_inference = time.time()

    def failed(self) -> None:
        self.failures += 1

    def as_dict(self) -> dict:
        return {
            "requests": self.requests, "failures": self.failures, "batches": self.batches, "rows": self.rows,
            "batch_sizes": {int(k): v for k, v in sorted(self.batch_sizes.items())},
            "batch_compute_s": {int(k): v for k, v in sorted(self.batch_compute_s.items())},
            "queue_us": round(self.queue.total * 1e6), "compute_us": round(self.compute.total * 1e6),
            "request_us": round(self.request.total * 1e6), "last_inference": self.last_inference,
            "histograms": {"request": self.request.as_dict(), "queue": self.queue.as_dict(),
                           "compute": self.compute.as_dict()},
        }


class Tee:
    """Records into several ModelStats at once: a model version's own, and its name's across versions
    (so a candidate version in a gray release can be compared with the one it may replace)."""

    def __init__(self, *stats: ModelStats) -> None:
        self.parts = stats

    def dispatched(self, rows: int, waits: list[float]) -> None:
        for s in self.parts:
            s.dispatched(rows, waits)

    def computed(self, rows: int, seconds: float) -> None:
        for s in self.parts:
            s.computed(rows, seconds)

    def answered(self, seconds: float) -> None:
        for s in self.parts:
            s.answered(seconds)

    def failed(self) -> None:
        for s in self.parts:
            s.failed()
