"""When the front polls its sockets instead of sleeping in poll().

Waking a sleeping process costs tens of microseconds per hop on a virtualised host (a halted vCPU has
to be woken), and a request to a tiny model makes four such hops: at concurrency 1 that is most of
gepool's latency (`benchmarks/breakdown.py`). Polling buys those wake-ups back with CPU time, so by
default the front polls only for an event it has reason to expect within microseconds, and only while
traffic is sequential (the last batch held one request: once requests batch, the cores belong to the
workers and a wake-up is shared by a whole batch):

- the completion of a lone short batch (one whose model computes in at most SHORT_BATCH_S): until its
  expected end plus a slack, since the wake-up would cost about as much as the batch;
- the next request after a lone short one was answered: for an adaptive window, the cpuidle haltpoll
  governor's rule. A request that came within WINDOW_LIMIT_S of the answer grows the window to catch
  the next like it; a window that passes empty is halved. A client sending back to back is caught
  every time; sparse traffic shrinks the window to nothing within a few requests.

A sequential request also wakes its idle worker with a PREPARE record, so that the worker's wake-up
overlaps the request's admission (it polls its doorbell briefly for the batch); so does each step of a
sequential ensemble request, its first on arrival and the next as the step before it completes. None of this happens
while another worker computes: the cores are taken then, and polling slowed the others down (three
tiny clients beside an MLP one lost 10-15% of their throughput). Both pollers yield the CPU between
polls: the process they wait for may have been woken onto their CPU.

``busy_poll_us`` > 0 swaps the adaptive window for a fixed one after any lone batch (the opt-in,
costlier knob: the front also polls once per wake when idle); -1 turns polling off, and so does a
front that may run on one CPU only (measured pinned to one here: 297 us sleeping, 304-310 polling).
"""

import os

SHORT_BATCH_S = 300e-6
COMPLETION_SLACK_S = 150e-6  # past a short batch's expected end: the worker's wake-up and its bell
WINDOW_LIMIT_S = 200e-6  # the longest adaptive window
WINDOW_MIN_S = 10e-6  # a halved window below this is none
GROW = 1.25  # a caught gap sets the window this much past it (plus WINDOW_PAD_S)
WINDOW_PAD_S = 10e-6


class PollPolicy:
    def __init__(self, busy_poll_us: int = 0, cpus: int | None = None) -> None:
        cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
        # on one CPU nothing runs while the front polls: what it waits for only comes once it yields
        self.enabled = busy_poll_us > 0 or (busy_poll_us == 0 and cpus > 1)
        self.fixed_s = max(0, busy_poll_us) / 1e6
        self.window_s = 0.0
        self.completion_due = 0.0  # a lone short batch is in flight: its completion is expected before this
        self.answered_at: float | None = None  # a lone short request was answered then; none since
        self.polls = self.misses = 0  # adaptive windows started, and those that passed empty (status)
        self.prewakes = 0  # PREPARE records the front sent (it counts them)
        self._counted: float | None = None  # the answer whose window was counted last

    def dispatched(self, now: float, requests: int, cost: float | None) -> None:
        if requests == 1 and cost is not None and cost <= SHORT_BATCH_S:
            self.completion_due = max(self.completion_due, now + cost + COMPLETION_SLACK_S)

    def answered(self, now: float, requests: int, cost: float, idle: bool) -> None:
        """A batch was answered; ``idle``: no batch of its model is in flight any more."""
        if idle:
            self.completion_due = 0.0
        self.answered_at = now if requests == 1 and cost <= SHORT_BATCH_S else None

    def arrived(self, now: float) -> None:
        """A request came in while traffic is sequential: had the window been long enough to catch it?"""
        if self.answered_at is not None:
            gap = now - self.answered_at
            self.answered_at = None
            if self.window_s < gap <= WINDOW_LIMIT_S:
                self.window_s = min(WINDOW_LIMIT_S, gap * GROW + WINDOW_PAD_S)

    def until(self, now: float, sequential: bool, busy_workers: int = 0) -> tuple[float, bool]:
        """(poll until, whether that is an adaptive window); a time not after ``now`` means sleep.
        ``busy_workers``: workers with a batch in flight. Adaptive polling waits for one batch at most:
        with another model computing, the cores are taken and polling would slow it down."""
        if not self.enabled or not sequential:
            return 0.0, False
        if self.fixed_s:
            return now + self.fixed_s, False
        if self.completion_due > now and busy_workers <= 1:
            return self.completion_due, False
        if self.answered_at is not None and self.window_s and busy_workers == 0:
            end = self.answered_at + self.window_s
            if end > now:
                if self._counted != self.answered_at:  # a window resumed after another event counts once
                    self._counted = self.answered_at
                    self.polls += 1
                return end, True
        return 0.0, False

    def missed(self) -> None:
        """An adaptive window passed with nothing in it."""
        self.misses += 1
        self.answered_at = None
        self.window_s = self.window_s / 2 if self.window_s / 2 >= WINDOW_MIN_S else 0.0

    def summary(self) -> dict:
        return {"mode": "off" if not self.enabled else "fixed" if self.fixed_s else "adaptive",
                "window_us": round((self.fixed_s or self.window_s) * 1e6, 1),
                "windows": self.polls, "empty_windows": self.misses, "prewakes": self.prewakes}
