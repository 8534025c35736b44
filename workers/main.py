"""The worker process: map the ring, load the model, then execute each slot the front names."""

import logging
import os
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq

from gepool.common.config import BACKEND_PYTHON, ModelConfig
from gepool.common.logsettings import LogSettings
from gepool.ipc import protocol
from gepool.ipc.doorbell import PREPARE, BellPaths, WorkerBell
from gepool.ipc.ring import Ring, RingHandle, Slot, TensorDesc
from gepool.ipc.sockets import make_socket
from gepool.workers.arena_maps import ArenaMaps
from gepool.workers.backends import create_backend
from gepool.workers.backends.base import AsyncBackend, Backend, SyncBackend
from gepool.workers.execute import execute_slot, plan_outputs
from gepool.workers.stats import StatsReporter

LOAD_FAILED_EXIT = protocol.EXIT_LOAD_FAILED  # for people reading exit codes: the front goes by WorkerFailed
PARENT_CHECK_MS = 500
FAREWELL_LINGER_MS = 2000
EXIT_ORPHANED = 5  # let the load-failure message reach the front before exiting

log = logging.getLogger("gepool.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker is started with: plain values and handles, never live objects."""

    worker_id: int
    config: ModelConfig
    version_dir: str
    device: str
    threads: int
    ring: RingHandle
    endpoint: str
    parent_pid: int
    log_level: int = logging.INFO
    log_format: str = "default"  # Triton's log_format
    bell: BellPaths | None = None
    pool_endpoint: str = ""  # the pool's client endpoint, for a python model's BLS calls
    pool_curve_key: str | None = None  # the pool's CURVE certificate, when its endpoint needs one
    # what this process's BLS calls carry to name its batches (Infer.caller)
    bls_key: bytes = field(default=b"", repr=False)


def run_worker(spec: WorkerSpec) -> None:
    """Entry point of a spawned worker process; exits with 0, or LOAD_FAILED_EXIT after telling the front
    (WorkerFailed) that its model cannot load: the message, not the code, is what the front believes."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s worker{spec.worker_id} %(levelname)s %(message)s")
    LogSettings.of_level(spec.log_level, spec.log_format).apply()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front stops us
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), name="parent-watch", daemon=True).start()
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=spec.endpoint, identity=worker_identity(spec.worker_id))
    ring = Ring.attach(spec.ring)
    bell = WorkerBell(spec.bell)
    handle = _pool_handle(spec)
    try:
        backend = create_backend(spec.config, spec.version_dir, spec.device, spec.threads)
        warmup_runs = backend.warmup()
    except (Exception, SystemExit) as exc:  # a model's initialize() calling sys.exit() cannot load either
        log.exception("model %s failed to load", spec.config.name)
        sock.setsockopt(zmq.LINGER, FAREWELL_LINGER_MS)
        sock.send(protocol.WorkerFailed(spec.worker_id, f"{type(exc).__name__}: {exc}").encode())
        if handle is not None:
            handle.close()
        sock.close()
        ctx.term()
        sys.exit(LOAD_FAILED_EXIT)
    asynchronous = type(backend).asynchronous
    reporter = StatsReporter(ctx, spec.endpoint, spec.worker_id, backend)
    info = dict(ready_info(backend, warmup_runs), stats=reporter.sample())
    sock.send(protocol.WorkerReady(spec.worker_id, protocol.PROTOCOL_VERSION, os.getpid(), info).encode())
    reporter.start()
    lost = None
    try:
        if asynchronous:
            lost = _serve_async(spec, sock, ring, backend, bell)
        else:
            _serve(spec, sock, ring, backend, bell, handle)
    finally:
        reporter.close()
        if lost is None:
            backend.close()
            ring.close()
        if handle is not None:
            handle.close()
        bell.close()
        sock.setsockopt(zmq.LINGER, FAREWELL_LINGER_MS if lost else 0)
        sock.close()
        ctx.term()
    if lost is not None:
        # A hung device cannot be released in order (its stream never drains): leave it to the OS.
        log.error("device lost: %s; exiting so the worker is replaced", lost)
        os._exit(protocol.EXIT_DEVICE_LOST)


def _pool_handle(spec: WorkerSpec):
    """A python model's pool handle (gepool.bls), installed before the model loads; None for other backends."""
    if spec.config.backend != BACKEND_PYTHON:
        return None
    from gepool import bls  # the client face, imported only by python workers

    handle = bls.PoolHandle(spec.pool_endpoint, spec.worker_id, spec.pool_curve_key, key=spec.bls_key)
    bls.install(handle)
    return handle


def ready_info(backend: Backend, warmup_runs: int) -> dict:
    """What the worker tells the front when ready: the backend's info and its declared capabilities.

    arena_io: this worker runs direct batches (tensors in a client's arena): a backend that reads and
    writes through pointers, on the synchronous loop (the asynchronous one stages slots to device memory
    itself). prewake: its loop answers a PREPARE record by polling for the batch. per_request: the front
    describes each batch request by request in the slot's request table."""
    cls = type(backend)
    return dict(backend.info, warmup_runs=warmup_runs or 0, arena_io=not cls.asynchronous and cls.arena_io,
                prewake=not cls.asynchronous, per_request=cls.per_request)


def _watch_parent(parent_pid: int) -> None:
    """Exits the process when the front is gone, even if the main thread is stuck in a model: a worker
    must never outlive its front (its segments are already unlinked, so nothing is left behind)."""
    while True:
        time.sleep(PARENT_CHECK_MS / 1000)
        if os.getppid() != parent_pid:
            log.warning("the front (pid %d) is gone; exiting", parent_pid)
            os._exit(EXIT_ORPHANED)


def worker_identity(worker_id: int) -> bytes:
    return b"w%d" % worker_id


def _serve(spec: WorkerSpec, sock: zmq.Socket, ring: Ring, backend: SyncBackend, bell: WorkerBell,
           handle=None) -> None:
    """Batches arrive on the doorbell and are answered on it; the socket carries DropArena and Stop.
    ``handle``: a python model's pool handle, told which batch runs (its BLS calls name it)."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(bell.run_fd, zmq.POLLIN)
    arenas = ArenaMaps()
    plans: dict = {}
    try:
        while True:
            events = dict(poller.poll(PARENT_CHECK_MS))
            if not events and os.getppid() != spec.parent_pid:
                log.warning("the front (pid %d) is gone; exiting", spec.parent_pid)
                return
            if bell.run_fd in events:
                records = bell.runs()
                while records:
                    for index, seq in records:
                        if index != PREPARE:
                            if handle is not None:
                                handle.running(index, seq)
                            execute_slot(ring.slots[index], backend, spec.config, arenas, plans)
                            if handle is not None:
                                handle.running(None)
                            bell.done(index, seq)
                    records = _await_batch(bell) if records[-1][0] == PREPARE else None
            if sock in events and _stop_asked(sock, arenas):
                return
    finally:
        arenas.close()


def _await_batch(bell: WorkerBell) -> list:
    """After a PREPARE: poll the doorbell for the batch the front is admitting, for a while."""
    until = time.monotonic() + PREPARE_POLL_S
    while time.monotonic() < until:
        records = bell.runs()
        if records:
            return records
        os.sched_yield()  # woken onto the front's CPU, the worker must not hold up the batch it waits for
    return []


def _stop_asked(sock: zmq.Socket, arenas: ArenaMaps | None) -> bool:
    """Handles the front's control messages waiting on the socket; True once one is Stop."""
    while True:
        try:
            msg = protocol.decode(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return False
        if isinstance(msg, protocol.Stop):
            return True
        if isinstance(msg, protocol.DropArena) and arenas is not None:
            arenas.drop(msg.name)
        if isinstance(msg, protocol.SetLogging):
            LogSettings(msg.level, msg.verbose, msg.format).apply()


PREPARE_POLL_S = 200e-6  # how long a prepared worker polls for its batch before it sleeps again
_DONE = struct.Struct("<IQ")  # slot index, seq: what a completion thread reports through the pipe
_FATAL = 0xFFFFFFFF


def _serve_async(spec: WorkerSpec, sock: zmq.Socket, ring: Ring, backend: AsyncBackend,
                 bell: WorkerBell) -> str | None:
    """For backends that complete on their own threads: completions come back through a pipe whose
    read end sits in the same poller as the front's socket (ZMQ sockets stay in this thread)."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    lost: list[str] = []

    def notify(index: int, seq: int) -> None:
        os.write(write_fd, _DONE.pack(index, seq))  # one write below PIPE_BUF: atomic across threads

    def fatal(reason: str) -> None:
        lost.append(reason)
        os.write(write_fd, _DONE.pack(_FATAL, 0))

    def plan(slot: Slot, batch: int, in_descs: list) -> list[TensorDesc]:
        start = max(d.offset + d.nbytes for d in in_descs)
        planned = plan_outputs(spec.config, batch, start, slot.data_bytes)
        if any(d is None for d in planned.values()):
            raise ValueError("outputs need fixed dims that fit in the slot")
        return list(planned.values())

    backend.start(notify, fatal)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(read_fd, zmq.POLLIN)
    poller.register(bell.run_fd, zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll(PARENT_CHECK_MS))
            if not events and os.getppid() != spec.parent_pid:
                log.warning("the front (pid %d) is gone; exiting", spec.parent_pid)
                return None
            if read_fd in events:
                data = os.read(read_fd, _DONE.size * 256)
                for index, seq in _DONE.iter_unpack(data):
                    if index == _FATAL:
                        return lost[0] if lost else "device lost"
                    bell.done(index, seq)
                backend.pump()
            if bell.run_fd in events:
                for index, seq in bell.runs():
                    if index != PREPARE:
                        backend.submit(ring.slots[index], index, seq, plan)
            if sock in events and _stop_asked(sock, None):
                return None
    finally:
        os.close(read_fd)
        os.close(write_fd)
