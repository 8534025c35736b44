"""Triton's priority levels and queue policies (shared/reference/triton.md §2.2), pure like the batcher.

Levels run 1 (highest) to N; each keeps a FIFO, and a policy: ``max_queue_size`` (a full level
refuses at once), ``default_timeout_microseconds`` (a request not started in time is answered, not
forgotten), ``timeout_action`` (REJECT answers it; DELAY moves it behind every live request of its
level), and ``allow_timeout_override`` (a request's own timeout may only shorten the default, and
is ignored when the default is 0, as Triton's PolicyQueue::Enqueue does).

Apart from the policy, a request carries its client's deadline (``deadline_us``, not the timeout that
overrides the policy): once it passes, nobody waits for the answer, so the request leaves its queue
(whatever ``timeout_action`` says) and never runs.
"""

import collections
import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from gepool.common.config import QueuePolicy

REJECT, DELAY = "REJECT", "DELAY"


Policy = QueuePolicy  # the config's plain object is the policy

class PolicyQueues:
    def __init__(self, levels: int = 1, default_level: int = 1, default_policy: Policy = Policy(),
                 per_level: dict[int, Policy] | None = None) -> None:
        self.levels = max(1, levels)
        self.default_level = default_level if 1 <= default_level <= self.levels else 1
        self.policies = [(per_level or {}).get(i + 1, default_policy) for i in range(self.levels)]
        self.live: list[collections.deque] = [collections.deque() for _ in range(self.levels)]
        self.delayed: list[collections.deque] = [collections.deque() for _ in range(self.levels)]
        self._deadlines: list[tuple[float, int, Any]] = []  # heap; entries of taken requests are skipped
        self._tie = itertools.count()
        self.size = 0

    def level_of(self, priority: int) -> int:
        return priority if 1 <= priority <= self.levels else self.default_level

    def admit(self, pending: Any, priority: int, timeout_us: int, deadline_us: int = 0) -> bool:
        """Queues it, or returns False when its level is full. Sets ``pending.level``, ``.deadline`` and
        ``.expires`` (``timeout_us``: the request's timeout, which only the policy's override looks at;
        ``deadline_us``: how long its client waits; 0 for none)."""
        level = self.level_of(priority)
        policy = self.policies[level - 1]
        if policy.max_queue_size and len(self.live[level - 1]) + len(self.delayed[level - 1]) >= policy.max_queue_size:
            return False
        timeout = policy.default_timeout_us
        if policy.allow_timeout_override and 0 < timeout_us < timeout:
            timeout = timeout_us
        pending.level = level
        deadline = pending.policy_at = pending.enqueued + timeout / 1e6 if timeout else None
        if deadline_us > 0:
            pending.expires = pending.enqueued + deadline_us / 1e6
            if deadline is None or pending.expires < deadline:
                deadline = pending.expires
        pending.deadline = pending.due = deadline
        self.live[level - 1].append(pending)
        self.size += 1
        if pending.deadline is not None:
            heapq.heappush(self._deadlines, (pending.deadline, next(self._tie), pending))
        return True

    def __iter__(self) -> Iterator[Any]:
        for live, delayed in zip(self.live, self.delayed):
            yield from live
            yield from delayed

    def __len__(self) -> int:
        return self.size

    def popleft(self) -> Any:
        for q in itertools.chain.from_iterable(zip(self.live, self.delayed)):
            if q:
                self.size -= 1
                p = q.popleft()
                p.deadline = None  # taken: its timeout no longer applies
                return p
        raise IndexError("pop from empty queues")

    def remove(self, item: Any) -> Any | None:
        """Takes the request holding ``item`` out of its queue unrun; None when none is queued."""
        for q in itertools.chain(self.live, self.delayed):
            for i, p in enumerate(q):
                if p.item is item:
                    del q[i]
                    self.size -= 1
                    p.deadline = None  # its entry in the deadline heap is skipped from now on
                    return p
        return None

    def appendleft(self, pending: Any) -> None:
        """Back at the head of its level (a request that could not be placed, or a retry)."""
        self.live[pending.level - 1].appendleft(pending)
        self.size += 1
        pending.delayed, pending.deadline = False, pending.due
        if pending.deadline is not None:
            heapq.heappush(self._deadlines, (pending.deadline, next(self._tie), pending))

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].deadline != self._deadlines[0][0]:
            heapq.heappop(self._deadlines)  # taken or moved since
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> list[Any]:
        """Requests whose timeout passed: REJECT ones, and those whose client's timeout passed, are
        removed and returned; DELAY ones move back (until their client's timeout)."""
        rejected = []
        while (deadline := self.next_deadline()) is not None and deadline <= now:
            _, _, p = heapq.heappop(self._deadlines)
            p.deadline = None
            i = p.level - 1
            (self.delayed[i] if p.delayed else self.live[i]).remove(p)
            if self.policies[i].timeout_action == DELAY and (p.expires is None or p.expires > now):
                p.delayed, p.due, p.policy_at = True, p.expires, None  # the policy is done with it
                self.delayed[i].append(p)
                if p.expires is not None:
                    p.deadline = p.expires
                    heapq.heappush(self._deadlines, (p.deadline, next(self._tie), p))
            else:
                self.size -= 1
                rejected.append(p)
        return rejected
