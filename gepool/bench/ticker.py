"""The thread that reports a running level's counts to a Display every PROGRESS_EVERY_S."""

import threading
import time

import numpy as np

from gepool.bench.display import Display, Progress
from gepool.bench.results import Level
from gepool.common import errors

PROGRESS_EVERY_S = 0.5
LATEST = 2000  # answers the live percentiles look at


def counts_in_order(level: Level, latencies: list[float]) -> tuple:
    """(sent, answered, failed, latest latencies) of a level another thread is running, read answered
    first and latencies last: counts only grow and a latency is recorded before its answer is counted,
    so what this returns never has more answered than sent, nor answers without a latency."""
    ok = level.ok
    failed = sum(level.errors.values())
    return level.sent, ok, failed, latencies[-LATEST:]


class Ticker:
    """Reports a running level to a Display from a thread of its own, out of ``counts()``:
    (sent or None, answered, failed, latest latencies in seconds or None). No display, no thread."""

    def __init__(self, display: Display | None, mode: str, value: float, seconds: float, processes: int,
                 counts) -> None:
        self.display, self.counts = display, counts
        self.mode, self.value, self.seconds, self.processes = mode, value, seconds, processes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="gepool-bench-progress", daemon=True)

    def __enter__(self) -> "Ticker":
        self.start = self.last_t = time.perf_counter()
        self.last_ok = 0
        if self.display is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _loop(self) -> None:
        while not self.stop.wait(PROGRESS_EVERY_S):
            try:
                progress = self.snapshot()
            except errors.GepoolError:  # the server's counts, from a pool that stopped answering: the
                continue  # level itself reports that
            self.display.tick(progress)

    def snapshot(self) -> Progress:
        sent, ok, failed, latest = self.counts()
        now = time.perf_counter()
        rps = (ok - self.last_ok) / max(now - self.last_t, 1e-9)
        self.last_ok, self.last_t = ok, now
        p50 = p99 = None
        if latest:
            arr = np.asarray(latest) * 1000
            p50, p99 = float(np.percentile(arr, 50)), float(np.percentile(arr, 99))
        return Progress(self.mode, self.value, self.seconds, now - self.start, sent, ok, failed, rps, p50, p99,
                        self.processes)
