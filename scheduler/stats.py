"""Per-model counters and latency histograms the front keeps and reports through the 'stats' query.

Triton has only counters and summaries for latency; gepool keeps real histograms (fixed buckets, so
they aggregate across replicas) of request, queue and compute time, and the batch-size histogram.
"""

import bisect
import collections
import itertools
import time
from dataclasses import dataclass, field, fields

from gepool.common import errors
from gepool.ipc.protocol import Origin

# Triton's reason label of nv_inference_request_failure
REJECTED, CANCELED, BACKEND, OTHER = "REJECTED", "CANCELED", "BACKEND", "OTHER"
FAILURE_REASONS = (REJECTED, CANCELED, BACKEND, OTHER)
# seconds; the same bounds for request, queue and compute time
BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, seconds: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += count
        self.total += seconds * count
        self.n += count

    def add(self, other: "Histogram") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.n += other.n

    def as_dict(self) -> dict:
        return {"buckets": list(BUCKETS_S), "counts": list(self.counts), "sum": self.total, "count": self.n}


@dataclass(slots=True)
class OriginStats:
    """The per-request counters of the requests of one origin (the ``protocol`` label of Triton's
    per-request series); the batch counters have no origin (a batch may mix them)."""

    requests: int = 0
    request_s: float = 0.0
    queue_s: float = 0.0
    failure_reasons: collections.Counter = field(default_factory=collections.Counter)

    def add(self, other: "OriginStats") -> None:
        self.requests += other.requests
        self.request_s += other.request_s
        self.queue_s += other.queue_s
        self.failure_reasons.update(other.failure_reasons)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "request_us": round(self.request_s * 1e6),
                "queue_us": round(self.queue_s * 1e6), "failures": sum(self.failure_reasons.values()),
                "failure_reasons": {r: self.failure_reasons.get(r, 0) for r in FAILURE_REASONS}}


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
    failure_reasons: collections.Counter = field(default_factory=collections.Counter)
    compute_input_s: float = 0.0  # the front's copy of a batch's inputs into its slot
    compute_output_s: float = 0.0  # the front's slicing of a batch's outputs into its responses
    batch_compute_input_s: collections.Counter = field(default_factory=collections.Counter)
    batch_compute_output_s: collections.Counter = field(default_factory=collections.Counter)
    cache_hits: int = 0
    cache_hit_ns: int = 0  # lookups that hit
    cache_misses: int = 0
    cache_miss_ns: int = 0  # lookups that missed, and the insertion of their responses
    client_timeouts: int = 0  # dropped unrun from a queue: the client's deadline had passed
    by_origin: list[OriginStats] = field(default_factory=lambda: [OriginStats() for _ in Origin])

    def dispatched(self, rows: int, waits: list[float], copy_in_s: float = 0.0,
                   origins: list[int] | None = None, counts: list[int] | None = None) -> None:
        """A batch handed to a worker, ``copy_in_s`` the front's copy of its inputs (Triton's compute_input),
        ``origins`` its requests' origins (in the order of ``waits``; None: all LIBRARY), ``counts`` the client
        requests each stands for (a group stands for its members; None: one each)."""
        self.batches += 1
        self.rows += rows
        self.batch_sizes[rows] += 1
        observe, by_origin = self.queue.observe, self.by_origin
        for w, o, n in zip(waits, origins or itertools.repeat(Origin.LIBRARY), counts or itertools.repeat(1)):
            observe(w, n)
            by_origin[o].queue_s += w * n
        self.compute_input_s += copy_in_s
        self.batch_compute_input_s[rows] += copy_in_s

    def computed(self, rows: int, seconds: float, copy_out_s: float = 0.0) -> None:
        """A batch done: ``seconds`` its run, ``copy_out_s`` the front's slicing of its outputs into its
        responses (Triton's compute_output)."""
        self.compute.observe(seconds)
        self.batch_compute_s[rows] += seconds
        self.compute_output_s += copy_out_s
        self.batch_compute_output_s[rows] += copy_out_s

    def answered(self, seconds: float, origin: int = Origin.LIBRARY, count: int = 1) -> None:
        """``count`` requests answered after ``seconds`` (a group's members)."""
        self.requests += count
        self.request.observe(seconds, count)
        self.last_inference = time.time()
        o = self.by_origin[origin]
        o.requests += count
        o.request_s += seconds * count

    def ensemble_answered(self, rows: int, seconds: float, queue_s: float, compute_s: float,
                          origin: int = Origin.LIBRARY) -> None:
        """An ensemble request of ``rows`` answered: its queue and compute time are those of its steps,
        summed (Triton's ensemble statistics); it runs no batch of its own."""
        self.rows += rows
        self.answered(seconds, origin)
        self.queue.observe(queue_s)
        self.compute.observe(compute_s)

    def failed(self, reason: str = OTHER, origin: int = Origin.LIBRARY, count: int = 1) -> None:
        self.failures += count
        self.failure_reasons[reason] += count
        self.by_origin[origin].failure_reasons[reason] += count

    def client_timed_out(self, origin: int = Origin.LIBRARY, count: int = 1) -> None:
        self.failed(CANCELED, origin, count)
        self.client_timeouts += count

    def cache_hit(self, ns: int) -> None:
        self.cache_hits += 1
        self.cache_hit_ns += ns

    def cache_missed(self, ns: int, lookup: bool = False) -> None:
        """A miss's time: its lookup (``lookup``: counted once), then the insertion of its response."""
        self.cache_misses += lookup
        self.cache_miss_ns += ns

    @classmethod
    def summed(cls, parts) -> "ModelStats":
        """The statistics of several (a model name's, from those of its versions): counted once per request,
        in its version's, and added up only when asked for."""
        out = cls()
        for s in parts:
            for f in fields(cls):
                mine, theirs = getattr(out, f.name), getattr(s, f.name)
                if f.name == "last_inference":
                    out.last_inference = max(mine, theirs)
                elif isinstance(mine, collections.Counter):
                    mine.update(theirs)
                elif isinstance(mine, Histogram):
                    mine.add(theirs)
                elif isinstance(mine, list):
                    for a, b in zip(mine, theirs):
                        a.add(b)
                else:
                    setattr(out, f.name, mine + theirs)
        return out

    def as_dict(self) -> dict:
        return {
            "requests": self.requests, "failures": self.failures, "batches": self.batches, "rows": self.rows,
            "batch_sizes": {int(k): v for k, v in sorted(self.batch_sizes.items())},
            "batch_compute_s": {int(k): v for k, v in sorted(self.batch_compute_s.items())},
            "queue_us": round(self.queue.total * 1e6), "compute_us": round(self.compute.total * 1e6),
            "request_us": round(self.request.total * 1e6), "last_inference": self.last_inference,
            "failure_reasons": {r: self.failure_reasons.get(r, 0) for r in FAILURE_REASONS},
            "compute_input_us": round(self.compute_input_s * 1e6),
            "compute_output_us": round(self.compute_output_s * 1e6),
            "batch_compute_input_s": {int(k): v for k, v in sorted(self.batch_compute_input_s.items())},
            "batch_compute_output_s": {int(k): v for k, v in sorted(self.batch_compute_output_s.items())},
            "cache_hit": {"count": self.cache_hits, "ns": self.cache_hit_ns},
            "cache_miss": {"count": self.cache_misses, "ns": self.cache_miss_ns},
            "client_timeouts": self.client_timeouts,
            "histograms": {"request": self.request.as_dict(), "queue": self.queue.as_dict(),
                           "compute": self.compute.as_dict()},
            "protocols": {Origin(i).label: o.as_dict() for i, o in enumerate(self.by_origin)},
        }


def failure_reason(err: Exception) -> str:
    """Triton's reason for a failed request: REJECTED by the scheduler (a full queue, a queue timeout, a
    model that cannot take it), BACKEND (the model failed it, or its worker died under it), OTHER."""
    if isinstance(err, (errors.Unavailable, errors.Timeout, errors.ModelNotReady)):
        return REJECTED
    if isinstance(err, (errors.ModelError, errors.WorkerDied)):
        return BACKEND
    return OTHER
