"""The dynamic batcher: Triton's rules as a pure policy object (no I/O, an injectable clock).

The front feeds it arrivals and asks it, whenever a worker can take a batch, what to dispatch.
Rules (Triton's ``dynamic_batch_scheduler.cc``, see shared/reference/triton.md §2.1):

* requests are never split; each counts its rows (its batch dimension), at least 1;
* a walk in arrival order stops before a request that would pass ``max_batch_size`` or whose
  non-batch shapes differ from the first one's ("send now");
* if a preferred size was reached and the oldest request has not waited ``max_queue_delay``,
  send exactly the largest reachable preferred size;
* else if "send now" was hit or the walk reached the largest preferred size, send the walk;
* else if the delay is 0 or has passed, send whatever is pending;
* else wait until the oldest request has aged by the delay.

A batch keeps growing until it can run (Triton server PR #3789): when the chosen worker is busy
(``idle=False``), only a batch that cannot grow any more is handed out early, to be copied in while
the worker computes; a request past its delay waits for the worker like the rest.
"""

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from gepool.scheduler.queues import PolicyQueues


@dataclass(slots=True)
class Pending:
    item: Any
    rows: int
    key: Hashable
    enqueued: float
    deadline: float | None = None  # set by the queue policy
    level: int = 1


class DynamicBatcher:
    def __init__(self, max_batch_size: int, preferred: tuple[int, ...] = (), max_queue_delay_us: int = 0,
                 *, enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 queues: PolicyQueues | None = None) -> None:
        """``enabled=False`` is Triton's default scheduler: one request per execution (and no queue policy)."""
        self.max_rows = max(1, max_batch_size)
        self.set_preferred(preferred)
        self.delay = max_queue_delay_us / 1e6
        self.batching = enabled and max_batch_size > 0
        self.clock = clock
        self.queue = queues if queues is not None and self.batching else PolicyQueues()
        self.rows = 0

    def set_preferred(self, preferred: tuple[int, ...]) -> None:
        self.preferred = tuple(sorted({p for p in preferred if 0 < p <= self.max_rows}))
        self.max_preferred = self.preferred[-1] if self.preferred else self.max_rows

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, item: Any, rows: int = 1, key: Hashable = None, priority: int = 0, timeout_us: int = 0) -> bool:
        """Queues a request; False when its priority level's queue is full (answer it UNAVAILABLE)."""
        if not self.queue.admit(Pending(item, max(1, rows), key, self.clock()), priority, timeout_us):
            return False
        self.rows += max(1, rows)
        return True

    def retry(self, items: list[tuple[Any, int, Hashable, float]]) -> None:
        """Puts (item, rows, key, arrival) back at the head of the queue, in order: requests whose worker
        died get their one more try before anything that arrived after them."""
        for item, rows, key, arrived in reversed(items):
            p = Pending(item, max(1, rows), key, arrived, level=self.queue.default_level)
            self.queue.appendleft(p)
            self.rows += p.rows

    def expire(self) -> list[Pending]:
        """Requests whose queue timeout passed and whose policy rejects them; they leave the queue."""
        gone = self.queue.expire(self.clock())
        self.rows -= sum(p.rows for p in gone)
        return gone

    def timeout_deadline(self) -> float | None:
        return self.queue.next_deadline()

    def push_front(self, pendings: list[Pending]) -> None:
        """Returns requests taken by next_batch that could not be placed, keeping their age."""
        for p in reversed(pendings):
            self.queue.appendleft(p)
            self.rows += p.rows

    def next_batch(self, idle: bool = True) -> list[Pending] | None:
        """The requests to dispatch now (removed from the queue), or None to keep waiting."""
        if not self.queue:
            return None
        if not self.batching:
            return self._take(1)
        count, total, best, send_now = self._walk()
        exceeded = self.delay > 0 and self.clock() - self._first().enqueued >= self.delay
        saturated = send_now or total >= self.max_preferred
        if not idle and not saturated:
            return None  # it keeps growing until the worker can run it (even past its delay)
        if best and not exceeded:
            return self._take(best)
        if saturated or exceeded or self.delay == 0:
            return self._take(count)
        return None

    def take_all(self) -> list[Pending]:
        """Empties the queue (to fail what it held)."""
        return self._take(len(self.queue))

    def deadline(self) -> float | None:
        """When the oldest request's delay runs out (clock time), if waiting is what the rules say."""
        if not self.queue or not self.batching or self.delay == 0:
            return None
        return self._first().enqueued + self.delay

    def _walk(self) -> tuple[int, int, int, bool]:
        """(requests walked, their rows, requests up to the largest preferred size reached, send now)."""
        first_key = self._first().key
        total = best = count = 0
        for p in self.queue:
            if p.key != first_key or total + p.rows > self.max_rows:
                return count, total, best, True
            total += p.rows
            count += 1
            if total in self.preferred:
                best = count
        return count, total, best, total >= self.max_rows

    def _first(self) -> Pending:
        return next(iter(self.queue))

    def _take(self, n: int) -> list[Pending]:
        out = [self.queue.popleft() for _ in range(n)]
        self.rows -= sum(p.rows for p in out)
        return out
