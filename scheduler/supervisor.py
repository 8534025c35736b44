"""Worker processes as the front sees them: start, readiness, death, restart with backoff, stop."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gepool.common.config import ModelConfig
from gepool.ipc import doorbell, naming, protocol
from gepool.ipc.ring import Ring

log = logging.getLogger("gepool.supervisor")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 10.0  # a worker that served this long before dying starts its backoff afresh
STOP_GRACE_S = 5.0
TERMINATE_GRACE_S = 2.0
REAP_TIMEOUT_S = 5.0

STARTING, READY, DEAD, FAILED = "STARTING", "READY", "DEAD", "FAILED"

# start_worker(**kwargs) -> a started multiprocessing.Process; handed in by the face (gepool.pool)
StartWorker = Callable[..., Any]


@dataclass(eq=False)
class Worker:
    id: int
    model: Any  # the scheduler's Model this worker serves
    device: str
    threads: int
    slots: int
    slot_bytes: int
    state: str = STARTING
    process: Any = None
    ring: Ring | None = None
    ring_linked: bool = False
    free: list[int] = field(default_factory=list)
    inflight: dict[int, Any] = field(default_factory=dict)  # slot index -> Batch
    rows: int = 0  # rows dispatched and not yet answered: the router's measure of load
    concurrency: int = 1  # batches it runs at once (an NPU worker's lanes)
    info: dict = field(default_factory=dict)  # what the worker said about itself when ready
    progress_at: float = 0.0  # last dispatch to an idle worker or completion: the hang watchdog's clock
    retired: bool = False  # asked to stop (its model generation drained or was unloaded): never restarted
    bell: Any = None  # FrontBell: run/done records to and from this worker
    restarts: int = 0  # every restart, for metrics
    streak: int = 0  # deaths in a row without a stable run: the backoff's exponent
    ready_at: float = 0.0
    restart_at: float | None = None
    reason: str = ""
    pid: int = 0

    @property
    def sentinel(self) -> int:
        return self.process.sentinel


class Supervisor:
    def __init__(self, owner_id: str, endpoint: str, start_worker: StartWorker, log_level: int,
                 bell_dir: str) -> None:
        self.owner_id, self.endpoint, self.start_worker, self.log_level = owner_id, endpoint, start_worker, log_level
        self.bell_dir = bell_dir
        self.workers: dict[int, Worker] = {}
        self._next_id = 0

    def add(self, model: Any, device: str, threads: int, slots: int, slot_bytes: int) -> Worker:
        self._next_id += 1
        w = Worker(self._next_id, model, device, threads, slots, slot_bytes)
        self.workers[w.id] = w
        return w

    def spawn(self, w: Worker, config: ModelConfig, version_dir: str) -> None:
        """A fresh ring (a restarted worker never sees its predecessor's slots) and a new process."""
        w.ring = Ring.create(naming.segment_name(self.owner_id, f"w{w.id}.{w.restarts}"), w.slots, w.slot_bytes)
        w.ring_linked = True
        w.state, w.free, w.inflight, w.rows, w.restart_at = STARTING, [], {}, 0, None
        paths = doorbell.make(self.bell_dir, f"gepool-{self.owner_id}-w{w.id}.{w.restarts}")
        w.bell = doorbell.FrontBell(paths)
        w.process = self.start_worker(
            worker_id=w.id, config=config, version_dir=version_dir, device=w.device, threads=w.threads,
            ring=w.ring.handle(), endpoint=self.endpoint, log_level=self.log_level, bell=paths)
        log.info("worker %d (%s v%s on %s) started, pid %d", w.id, w.model.name, w.model.version, w.device,
                 w.process.pid)

    def on_ready(self, w: Worker, msg: protocol.WorkerReady) -> None:
        if msg.version != protocol.PROTOCOL_VERSION:
            w.reason = f"worker speaks protocol {msg.version}, the front {protocol.PROTOCOL_VERSION}"
            w.process.kill()
            return
        w.state, w.pid, w.info = READY, msg.pid, dict(msg.info) if isinstance(msg.info, dict) else {}
        w.ready_at = time.monotonic()
        w.free = list(range(len(w.ring.slots)))
        self._unlink(w)  # both sides have mapped it: from now on a crash of anyone leaks nothing
        w.bell.unlink()  # and both have opened their ends of the doorbells

    def on_exit(self, w: Worker, now: float, stopping: bool) -> dict[int, Any]:
        """Reaps a dead worker; returns its in-flight batches (slot -> Batch) for the caller to answer."""
        # The sentinel closes as the process exits, a moment before it can be reaped.
        w.process.join(timeout=REAP_TIMEOUT_S)
        if w.process.exitcode is None:
            w.process.kill()
            w.process.join()
        code = w.process.exitcode
        w.process.close()  # its sentinel fd and pipes now, not whenever the object is collected
        w.process = None
        lost = w.inflight
        w.inflight, w.free, w.rows = {}, [], 0
        if w.bell is not None:
            w.bell.close()
            w.bell = None
        self._unlink(w)
        w.ring.close()
        w.ring = None
        if code == protocol.EXIT_LOAD_FAILED or stopping or w.retired:
            w.state = FAILED if code == protocol.EXIT_LOAD_FAILED else DEAD
            w.reason = w.reason or f"exit code {code}"
        else:
            if w.state == READY and now - w.ready_at >= STABLE_AFTER_S:
                w.streak = 0
            w.state = DEAD
            w.reason = f"worker {w.id} died with exit code {code}"
            w.restart_at = now + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** w.streak)
            w.streak += 1
            w.restarts += 1
            log.warning("%s; restart in %.1fs", w.reason, w.restart_at - now)
        return lost

    def _unlink(self, w: Worker) -> None:
        if w.ring is not None and w.ring_linked:
            w.ring.segment.unlink()
            w.ring_linked = False

    def forget(self, w: Worker) -> None:
        """A retired worker that has exited leaves the supervisor's books."""
        self.workers.pop(w.id, None)

    def stop_all(self, send: Callable[[Worker], None]) -> None:
        """Stop messages, then terminate, then kill: each step waits on the processes' own exit."""
        live = [w for w in self.workers.values() if w.process is not None and w.process.exitcode is None]
        for w in live:
            if w.state == READY:
                send(w)
        for grace, step in ((STOP_GRACE_S, "terminate"), (TERMINATE_GRACE_S, "kill"), (TERMINATE_GRACE_S, None)):
            deadline = time.monotonic() + grace
            for w in live:
                w.process.join(max(0.0, deadline - time.monotonic()))
            live = [w for w in live if w.process.exitcode is None]
            if not live or step is None:
                break
            for w in live:
                log.warning("worker %d did not stop; %s", w.id, step)
                getattr(w.process, step)()
        for w in self.workers.values():
            self._unlink(w)
            if w.ring is not None:
                w.ring.close()
                w.ring = None
            if w.bell is not None:
                w.bell.close()
                w.bell = None
