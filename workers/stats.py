"""The worker's stats thread: its process's and device's readings, sent to the front every few seconds."""

import logging
import os
import threading

import zmq

from gepool.ipc import protocol
from gepool.ipc.sockets import make_socket
from gepool.workers.backends.base import Backend

log = logging.getLogger("gepool.worker")

# Triton's default --metrics-interval-ms (2000): a Prometheus scrape (15 s by default) always finds a
# sample younger than its own interval, at one small message per worker every two seconds.
STATS_INTERVAL_S = 2.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


def process_stats() -> dict:
    """This process's resident memory (/proc/self/statm) and the CPU seconds it has used (user + system)."""
    out: dict = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):  # no procfs: left out, not reported as zero
        pass
    t = os.times()
    out["cpu_seconds"] = t.user + t.system
    return out


class StatsReporter:
    """A daemon thread with a DEALER socket of its own (a ZMQ socket belongs to one thread; the worker's
    main socket stays with its loop). It reads only the process and ``backend.device_stats()``, never
    a stream or a slot. A send that would block (the front not reading) drops that sample."""

    def __init__(self, ctx: zmq.Context, endpoint: str, worker_id: int, backend: Backend,
                 interval_s: float = STATS_INTERVAL_S) -> None:
        self.ctx, self.endpoint, self.worker_id, self.backend = ctx, endpoint, worker_id, backend
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> dict:
        out = process_stats()
        try:
            out.update(self.backend.device_stats())
        except Exception:  # a device reading that fails must not end the thread; the process stats still go
            log.exception("reading the device stats failed")
        return out

    def _run(self) -> None:
        # The socket is made, used and closed in this thread; close() only sets the event and joins.
        sock = make_socket(self.ctx, zmq.DEALER, connect=self.endpoint)
        sock.setsockopt(zmq.LINGER, 0)
        pid = os.getpid()
        try:
            # the first sample went with WorkerReady; this socket's messages may overtake that one's
            while not self._stop.wait(self.interval_s):
                try:
                    sock.send(protocol.DeviceStats(self.worker_id, pid, self.sample()).encode(), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close()

    def close(self) -> None:
        """Stops the thread (before the worker terminates its ZMQ context, which waits for every socket)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
