"""Per-model counters the front keeps and reports through the 'stats' query."""

import collections
from dataclasses import dataclass, field


@dataclass
class ModelStats:
    requests: int = 0
    failures: int = 0
    batches: int = 0
    rows: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
    queue_us: float = 0.0  # summed over requests: arrival -> slot filled
    compute_us: float = 0.0  # summed over batches: worker start -> finish

    def as_dict(self) -> dict:
        return {
            "requests": self.requests, "failures": self.failures, "batches": self.batches, "rows": self.rows,
            "batch_sizes": {int(k): v for k, v in sorted(self.batch_sizes.items())},
            "queue_us": round(self.queue_us), "compute_us": round(self.compute_us),
        }
