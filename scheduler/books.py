"""The front's books on its workers: state, free slots, batches in flight, restarts (no I/O here)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gepool.ipc import protocol
from gepool.scheduler.states import WorkerState, check_worker

if TYPE_CHECKING:
    from gepool.ipc.doorbell import FrontBell
    from gepool.ipc.ring import Ring
    from gepool.scheduler.models import Model
    from gepool.scheduler.requests import Request

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 10.0  # a worker that served this long before dying starts its backoff afresh
SAMPLE_NUMBERS = ("rss_bytes", "cpu_seconds", "memory_used_bytes", "memory_total_bytes", "utilization_ratio")
HEALTH_WORDS = ("HEALTHY", "ABNORMAL", "LOST")


def _mint_key() -> bytes:
    """A worker process's BLS caller key: fresh for each process the front starts."""
    return secrets.token_bytes(protocol.CALLER_KEY_BYTES)


def placements(model: Model) -> dict[int, tuple[Worker, int, Batch, int]]:
    """id(request) -> (worker, slot index, batch, place in it) of each request in a batch of ``model`` in
    flight."""
    return {id(r): (w, index, batch, k) for w in model.workers for index, batch in w.inflight.items()
            for k, r in enumerate(batch.requests)}


def dispatched(model: Model, req: Request) -> tuple[Worker, int, Batch, int] | None:
    """(worker, slot index, batch, place in it) of the batch of ``model`` that ``req`` was dispatched in;
    None while it is queued (or once it is answered)."""
    return placements(model).get(id(req))


def device_sample(raw: object) -> dict:
    """What the front keeps of a worker's DeviceStats sample: the known readings, each a finite number
    >= 0 (a ratio at most 1), and a known health word; anything else is dropped, never passed on."""
    if not isinstance(raw, dict):
        return {}
    out: dict = {}
    for key in SAMPLE_NUMBERS:
        v = raw.get(key)
        if type(v) in (int, float) and math.isfinite(v) and v >= 0 and (key != "utilization_ratio" or v <= 1):
            out[key] = v
    if raw.get("health") in HEALTH_WORDS:
        out["health"] = raw["health"]
    return out


@dataclass(slots=True)
class Batch:
    slot: int
    seq: int
    requests: list[Request]
    rows: int
    direct: bool = False


@dataclass(eq=False)
class Worker:
    """One worker process slot in the books. The core owns every field but three, which the loop's
    spawn action sets and its reap clears: ``process``, ``ring`` and ``bell`` (its doorbell: ringing
    it is how a batch is handed over)."""

    id: int
    model: Model
    device: str
    threads: int
    slots: int
    slot_bytes: int
    concurrency: int = 1  # batches it runs at once (an NPU worker's lanes)
    state: WorkerState = WorkerState.STARTING
    process: Any = None  # multiprocessing.Process, or what a test's outbox hands out
    ring: Ring | None = None
    bell: FrontBell | None = None
    free: list[int] = field(default_factory=list)
    inflight: dict[int, Batch] = field(default_factory=dict)  # slot index -> Batch
    rows: int = 0  # rows dispatched and not yet answered: the router's measure of load
    info: dict = field(default_factory=dict)  # what the worker said about itself when ready
    progress_at: float = 0.0  # last dispatch to an idle worker or completion: the hang watchdog's clock
    retired: bool = False  # asked to stop (its model generation drained or was unloaded): never restarted
    restarts: int = 0  # every restart, for metrics
    streak: int = 0  # deaths in a row without a stable run: the backoff's exponent
    ready_at: float = 0.0
    restart_at: float | None = None
    reason: str = ""
    pid: int = 0
    spawned_at: float = 0.0  # when its process was started: the load timeout's clock
    load_failed: bool = False  # it reported that its model cannot load, or did not load in time
    sample: dict = field(default_factory=dict)  # its process's latest DeviceStats (device_sample); {} when none
    # handed to its process at spawn, fresh for each process: a BLS call naming one of its batches carries it
    key: bytes = field(default_factory=_mint_key, repr=False)

    def move(self, state: WorkerState) -> None:
        self.state = check_worker(self.state, state)

    # -- slots and batches in flight: the only writers of free, inflight and rows ---------------
    def started(self, now: float) -> None:
        """A fresh process: no slot is free until it says it is ready."""
        self.move(WorkerState.STARTING)
        self.free, self.inflight, self.rows, self.restart_at = [], {}, 0, None
        self.spawned_at, self.sample = now, {}
        self.key = _mint_key()

    def ready(self, msg: protocol.WorkerReady, now: float) -> None:
        self.move(WorkerState.READY)
        self.pid, self.info = msg.pid, dict(msg.info) if isinstance(msg.info, dict) else {}
        self.sample, self.ready_at = device_sample(self.info.pop("stats", None)), now
        self.free = list(range(self.slots))

    def sampled(self, msg: protocol.DeviceStats) -> None:
        """A DeviceStats: kept while this process serves (one from a predecessor, or sent before its ready
        message arrived on the other socket, is dropped)."""
        if self.state == WorkerState.READY and msg.pid == self.pid:
            self.sample = device_sample(msg.sample)

    def take(self, seq: int, requests: list, rows: int, direct: bool, now: float) -> Batch:
        """A free slot for a batch, now in flight (the caller fills it, then rings the bell)."""
        if not self.inflight:
            self.progress_at = now  # the watchdog's clock starts when the worker gets work
        batch = Batch(self.free.pop(), seq, requests, rows, direct)
        self.inflight[batch.slot] = batch
        self.rows += rows
        return batch

    def complete(self, slot: int, seq: int, now: float) -> Batch | None:
        """The batch a done record names, out of flight, its slot free again; None if that slot holds no
        such batch. The caller reads the slot's outputs before it schedules anything (one thread), so the
        slot is never refilled under them."""
        batch = self.inflight.pop(slot, None)
        if batch is None:
            return None
        if batch.seq != seq:
            self.inflight[slot] = batch
            return None
        self.rows -= batch.rows
        self.progress_at = now
        self.free.append(slot)
        return batch

    def cannot_load(self, reason: str) -> None:
        """Its model cannot load (its own report). A report that comes after its exit was taken for a
        crash turns the pending restart into FAILED."""
        self.load_failed, self.reason = True, reason
        if self.state == WorkerState.DEAD and self.process is None:
            self.move(WorkerState.FAILED)
            self.restart_at = None

    def retire(self) -> None:
        """Its generation drained or was unloaded: never restarted (not even one waiting out its backoff)."""
        self.retired, self.restart_at = True, None

    def hung(self, now: float, timeout_s: float) -> Batch | None:
        """The oldest batch, taken out of flight, if it has run past ``timeout_s`` (its slot is not
        freed: the worker is about to be killed)."""
        if self.state != WorkerState.READY or not self.inflight or now - self.progress_at < timeout_s:
            return None
        head = min(self.inflight.values(), key=lambda b: b.seq)
        del self.inflight[head.slot]
        self.rows -= head.rows
        return head

    def fail_all(self) -> list[Batch]:
        """Every batch in flight, oldest first, out of the books (the worker is gone or stopping)."""
        lost = sorted(self.inflight.values(), key=lambda b: b.seq)
        self.inflight, self.free, self.rows = {}, [], 0
        return lost

    def exited(self, code: int | None, now: float, stopping: bool) -> None:
        """Its process is reaped: FAILED for good after a failed load (its WorkerFailed message, or the
        load timeout, said so: never its exit code, which a model's own code may produce), else DEAD,
        with a restart time unless it was retired or the pool stops."""
        if self.load_failed or stopping or self.retired:
            self.move(WorkerState.FAILED if self.load_failed else WorkerState.DEAD)
            self.reason = self.reason or f"exit code {code}"
            return
        if self.state == WorkerState.READY and now - self.ready_at >= STABLE_AFTER_S:
            self.streak = 0
        self.move(WorkerState.DEAD)
        self.reason = f"worker {self.id} died with exit code {code}"
        self.restart_at = now + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** self.streak)
        self.streak += 1
        self.restarts += 1


class Workers:
    """Every worker the front has, by id."""

    def __init__(self) -> None:
        self.by_id: dict[int, Worker] = {}
        self._next_id = 0

    def add(self, model: Model, device: str, threads: int, slots: int, slot_bytes: int) -> Worker:
        self._next_id += 1
        w = Worker(self._next_id, model, device, threads, slots, slot_bytes)
        self.by_id[w.id] = w
        return w

    def get(self, worker_id: object) -> Worker | None:
        return self.by_id.get(worker_id) if type(worker_id) is int else None

    def forget(self, w: Worker) -> None:
        """A retired worker that has exited leaves the books."""
        self.by_id.pop(w.id, None)

    def values(self):
        return self.by_id.values()

    def busy(self) -> int:
        return sum(1 for w in self.by_id.values() if w.inflight)

    def any_ready(self) -> bool:
        return any(w.state == WorkerState.READY for w in self.by_id.values())
