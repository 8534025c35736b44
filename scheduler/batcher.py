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

``adaptive=True`` (config parameter ``batch_policy: "adaptive"``) only ever shortens the wait; the
static rules above stay the caps. A static delay is a guess about traffic: too long and a lone request
pays all of it, too short and a burst is cut in two. For a queue that formed while every worker was
idle, the batcher looks at the gaps between recent arrivals instead. Gaps longer than what waiting may
cost (QUIET_SHARE of the model's measured batch time, at most the delay) are lulls; if most gaps are
lulls, traffic is too sparse for waiting to pay and the batch goes at once (a single client, light
Poisson traffic). Otherwise requests come in bursts (closed-loop clients answering a batch's replies)
and the batch goes once the line has been quiet for QUIET_FACTOR times the 90th percentile of the
short gaps (at least QUIET_FLOOR_S), i.e. when the burst is complete. A queue that built up while a
batch ran keeps the static rules: its requests' clients may be waiting on the running batch, and
sending the rest as soon as the worker frees would lock closed-loop traffic into two smaller batches
taking turns.
"""

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from gepool.scheduler.queues import PolicyQueues

GAP_WINDOW = 32  # arrivals whose gaps the adaptive policy looks at
MIN_GAPS = 4  # before this many, it waits like the static policy
QUIET_FACTOR = 3.0  # the burst is over after this many times its 90th-percentile gap without an arrival
# The quiet time is never shorter than this. Inside a closed-loop burst (replies in, the next requests
# out) gaps are ~15 us, with a client's scheduling hiccup of 100-400 us now and then: a shorter window
# sends part of the burst and locks the rest into a second batch that takes turns with it (MLP at
# c=16: batches of 13 + 3). Timers used to round up to a whole millisecond, which hid this.
QUIET_FLOOR_S = 1e-3
QUIET_SHARE = 0.1  # waiting may cost at most this share of a batch's compute time
COST_ALPHA = 0.2  # EWMA weight of the newest batch's compute time


@dataclass(slots=True)
class Pending:
    item: Any
    rows: int
    key: Hashable
    enqueued: float
    deadline: float | None = None  # set by the queue policy
    level: int = 1
    idle: bool = True  # no batch of the model was running when it arrived
    nbytes: int = 0  # what it holds of the pool's queue budget
    expires: float | None = None  # its client's deadline: past it, nobody waits for the answer
    delayed: bool = False  # moved behind its level's live requests (timeout_action DELAY)
    due: float | None = None  # its deadline while queued, kept when it is taken and put back
    policy_at: float | None = None  # when its queue policy's timeout (after any override) passes

    def client_gone(self, now: float) -> bool:
        """Its client's timeout has passed, and its queue policy's has not: nobody waits for it."""
        return self.expires is not None and self.expires <= now and (self.policy_at is None or self.policy_at > now)


class QueueBudget:
    """Bytes held by queued requests, pool-wide: every model's batcher adds to and takes from one, and
    the front refuses a request that would take ``used`` past ``limit``."""

    __slots__ = ("used", "limit")

    def __init__(self, limit: int) -> None:
        self.used, self.limit = 0, limit


class DynamicBatcher:
    def __init__(self, max_batch_size: int, preferred: tuple[int, ...] = (), max_queue_delay_us: int = 0,
                 *, enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 queues: PolicyQueues | None = None, adaptive: bool = False, budget: QueueBudget | None = None) -> None:
        """``enabled=False`` is Triton's default scheduler: one request per execution (and no queue policy).
        ``budget``: the pool's, which this batcher's queued bytes count against."""
        self.budget = budget if budget is not None else QueueBudget(0)
        self.max_rows = max(1, max_batch_size)
        self.set_preferred(preferred)
        self.delay = max_queue_delay_us / 1e6
        self.batching = enabled and max_batch_size > 0
        self.clock = clock
        self.queue = queues if queues is not None and self.batching else PolicyQueues()
        self.rows = 0
        self.adaptive = adaptive
        self.gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self.last_arrival: float | None = None
        self.batch_cost: float | None = None  # EWMA of batch compute seconds
        self._quiet: tuple[float | None] | None = None  # quiet_time() until the next arrival or cost

    def set_preferred(self, preferred: tuple[int, ...]) -> None:
        self.preferred = tuple(sorted({p for p in preferred if 0 < p <= self.max_rows}))
        self.max_preferred = self.preferred[-1] if self.preferred else self.max_rows

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, item: Any, rows: int = 1, key: Hashable = None, priority: int = 0, timeout_us: int = 0,
            busy: bool = False, nbytes: int = 0, deadline_us: int = 0) -> bool:
        """Queues a request (``busy``: a batch of the model is running; ``timeout_us``: its own timeout for
        the queue policy; ``deadline_us``: how long its client waits; 0 for none); False when its priority
        level's queue is full (answer it UNAVAILABLE)."""
        now = self.clock()
        if not self.queue.admit(Pending(item, max(1, rows), key, now, idle=not busy, nbytes=nbytes), priority,
                                timeout_us, deadline_us):
            return False
        self.rows += max(1, rows)
        self.budget.used += nbytes
        if self.last_arrival is not None:
            self.gaps.append(now - self.last_arrival)
        self.last_arrival = now
        self._quiet = None
        return True

    def observe_cost(self, seconds: float) -> None:
        """A batch's compute time, which bounds what waiting for company may cost."""
        self.batch_cost = seconds if self.batch_cost is None else (
            COST_ALPHA * seconds + (1 - COST_ALPHA) * self.batch_cost)
        self._quiet = None


    def quiet_time(self) -> float | None:
        """Adaptive policy: how long after the last arrival a burst counts as complete; 0 means send at
        once (arrivals are too sparse for waiting to pay). None: not adaptive, or too little history
        yet (wait like the static policy). Cached: the front asks on every pass of its loop."""
        if self._quiet is None:
            self._quiet = (self._compute_quiet(),)
        return self._quiet[0]

    def _compute_quiet(self) -> float | None:
        if not self.adaptive or len(self.gaps) < MIN_GAPS:
            return None
        cap = self._wait_cap()
        short = sorted(g for g in self.gaps if g <= cap)
        if 2 * len(short) < len(self.gaps):
            return 0.0
        p90 = short[min(len(short) - 1, int(0.9 * len(short)))]
        return min(cap, max(QUIET_FLOOR_S, QUIET_FACTOR * p90))

    def _wait_cap(self) -> float:
        return self.delay if self.batch_cost is None else min(self.delay, QUIET_SHARE * self.batch_cost)

    def _early_at(self) -> float | None:
        """Adaptive policy: when an idle worker may take the queue before the static rules say so."""
        quiet = self.quiet_time()
        if quiet is None or not self._first().idle:  # built up during a batch: the static rules
            return None
        if quiet == 0:
            return self._first().enqueued
        return self.last_arrival + quiet

    def retry(self, items: list[tuple[Any, int, Hashable, float, int, int, float | None]]) -> None:
        """Puts (item, rows, key, arrival, nbytes, priority, expires) back at the head of their priority
        level, in order: requests whose worker died get their one more try before anything that arrived
        after them. The queue policy is done with them (they were taken once); their client's deadline
        (``expires``) still takes them out unrun."""
        for item, rows, key, arrived, nbytes, priority, expires in reversed(items):
            p = Pending(item, max(1, rows), key, arrived, level=self.queue.level_of(priority), nbytes=nbytes,
                        expires=expires, due=expires)
            self.queue.appendleft(p)
            self.rows += p.rows
            self.budget.used += nbytes

    def expire(self) -> list[Pending]:
        """Requests whose queue timeout (or their client's) passed and whose policy rejects them; they
        leave the queue."""
        gone = self.queue.expire(self.clock())
        if gone:
            self._left(gone)
        return gone

    def _left(self, pendings: list[Pending]) -> None:
        rows = nbytes = 0
        for p in pendings:
            rows += p.rows
            nbytes += p.nbytes
        self.rows -= rows
        self.budget.used -= nbytes

    def withdraw(self, item: Any) -> bool:
        """Takes ``item``'s request out of the queue unrun (nobody waits for it any more); False if it is
        not queued (running, or answered)."""
        p = self.queue.remove(item)
        if p is None:
            return False
        self._left([p])
        return True

    def timeout_deadline(self) -> float | None:
        return self.queue.next_deadline()

    def push_front(self, pendings: list[Pending]) -> None:
        """Returns requests taken by next_batch that could not be placed, keeping their age."""
        for p in reversed(pendings):
            self.queue.appendleft(p)
            self.rows += p.rows
            self.budget.used += p.nbytes

    def next_batch(self, idle: bool = True) -> list[Pending] | None:
        """The requests to dispatch now (removed from the queue), or None to keep waiting."""
        if not self.queue:
            return None
        if not self.batching:
            return self._take(1)
        count, total, best, send_now = self._walk()
        now = self.clock()
        exceeded = self.delay > 0 and now - self._first().enqueued >= self.delay
        if idle and not exceeded and self.delay > 0:
            early = self._early_at()
            exceeded = early is not None and now >= early
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
        cap = self._first().enqueued + self.delay
        early = self._early_at()
        return cap if early is None else min(cap, early)

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
        rows = nbytes = 0
        for p in out:  # inline, not _left(): this runs for every batch
            rows += p.rows
            nbytes += p.nbytes
        self.rows -= rows
        self.budget.used -= nbytes
        return out
