"""The GE backend: `.om` models on an Ascend NPU through pyACL, several batches in flight.

Stream design: one worker process owns one NPU and one explicit context. Concurrency comes from
*streams* (instances x stream_num): each loads the `.om` once (its own model id: one model id must
never execute on two ACL streams at once), owns one ACL stream, one event, device buffers from the
memory pool, staging buffers and its own datasets (so `set_dynamic_batch_size` never touches a
dataset another batch is using). A batch is three tasks on its ACL stream, H2D copy ->
execute_async -> D2H copy, then an event; stream order makes them sequential for that batch while
other streams' copies and executions overlap with it. Each stream has a completion thread that waits
on its event (synchronize_event releases the GIL), copies the outputs into the slot and reports the
slot done, so completions come back in submission order per stream (ge_stream.py).

Threads: the worker's main thread makes every ACL call that enqueues work (its context is current
since create_context); every completion thread, the health thread and the close-time drain threads
call set_context first, as pyACL requires. Async copies read and write only malloc_host memory: the
slot's bytes are staged through it.

Waiting: where the SoC takes a timed event wait (probed once at load), a completion thread waits at
most execution_timeout_ms; elsewhere (Ascend 310, older CANN) it waits untimed and a watchdog thread
fails the batch and the worker when the deadline passes (ge_wait.py).
"""

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from gepool.common.config import BACKEND_GE, KIND_ASCEND, ModelConfig, streams_per_worker
from gepool.ipc.ring import Slot
from gepool.workers import aclconst as C
from gepool.workers.backends import register
from gepool.workers.backends.base import AsyncBackend, Placement, PlanOutputs, check_kinds
from gepool.workers.backends.ge_describe import check_model
from gepool.workers.backends.ge_device import ABNORMAL, LOST, device_status
from gepool.workers.backends.ge_stream import AclError, DeviceLost, Stream
from gepool.workers.backends.ge_wait import Watchdog, probe_timed_waits
from gepool.workers.devmem import DeviceMemoryPool

__all__ = ["AclError", "DeviceLost", "GeBackend"]

log = logging.getLogger("gepool.ge")

DEFAULT_EXECUTION_TIMEOUT_MS = 60_000  # a batch that takes longer means the device stopped answering
CLOSE_DRAIN_MIN_S = 5.0  # close() waits this long at least for the batches in flight to drain
HEALTH_POLL_S = 2.0  # how often the worker reads its device's status, utilisation and memory
PYACL_MISSING = ("CANN's pyACL (the 'acl' module of the CANN toolkit) was not found on this host: install "
                 "CANN and source its set_env.sh. Never 'pip install acl': that PyPI package is unrelated")


@register
class GeBackend(AsyncBackend):
    name = BACKEND_GE
    kinds = (KIND_ASCEND,)

    @classmethod
    def placements(cls, config: ModelConfig) -> list[Placement]:
        """One worker per NPU; the instances and streams on it are the batches it runs at once."""
        check_kinds(cls, config)
        streams = streams_per_worker(config)
        return [(f"ascend:{d}", streams) for d in sorted({d for g in config.instance_groups for d in g.devices})]

    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int) -> None:
        super().__init__(config, version_dir, device, threads)
        try:
            import acl
        except ImportError as exc:
            raise RuntimeError(f"{PYACL_MISSING} ({exc})") from None
        self.acl = acl
        self.device_id = int(device.split(":", 1)[1]) if ":" in device else 0
        self.timeout_ms = int(config.parameters.get("execution_timeout_ms", DEFAULT_EXECUTION_TIMEOUT_MS))
        if self.timeout_ms <= 0:
            raise ValueError(f"execution_timeout_ms must be > 0 milliseconds, got {self.timeout_ms}")
        self.stream_count = streams_per_worker(config)
        self.streams: list[Stream] = []
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: list[tuple] = []
        self.notify: Callable[[int, int], None] | None = None
        self.fatal: Callable[[str], None] | None = None
        self.context = self.probe_stream = self.probe_event = 0
        self.pool: DeviceMemoryPool | None = None
        self.watchdog: Watchdog | None = None
        self.timed_waits = False
        self.lost = ""
        self.probe_lock = threading.Lock()
        self._health_stop = threading.Event()
        self._health: threading.Thread | None = None
        self._initialized = self._device_set = False
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -- set-up ----------------------------------------------------------------------------
    def call(self, name: str, result):
        """Checks one pyACL result: a bare ret, or a tuple with ret last; returns the value(s)."""
        ret = result[-1] if isinstance(result, tuple) else result
        if ret != C.SUCCESS:
            raise AclError(name, ret, self.acl.get_recent_err_msg())
        if isinstance(result, tuple):
            return result[0] if len(result) == 2 else result[:-1]
        return None

    def _open(self) -> None:
        acl = self.acl
        ret = acl.init()
        if ret not in (C.SUCCESS, C.REPEAT_INITIALIZE):
            raise AclError("init", ret, acl.get_recent_err_msg())
        self._initialized = True
        self.call("rt.set_device", acl.rt.set_device(self.device_id))
        self._device_set = True
        self.context = self.call("rt.create_context", acl.rt.create_context(self.device_id))
        run_mode = self.call("rt.get_run_mode", acl.rt.get_run_mode())
        # ACL_DEVICE (the app runs on the board's CPU): host and device share DDR, so both copies are
        # device-to-device (CANN 8.0 pyACL guide, memcpy_async; acllite does the same).
        self.device_mode = run_mode == C.RUN_MODE_DEVICE
        self.h2d = C.MEMCPY_DEVICE_TO_DEVICE if self.device_mode else C.MEMCPY_HOST_TO_DEVICE
        self.d2h = C.MEMCPY_DEVICE_TO_DEVICE if self.device_mode else C.MEMCPY_DEVICE_TO_HOST
        self.probe_stream = self.call("rt.create_stream", acl.rt.create_stream())
        self.probe_event = self.call("rt.create_event", acl.rt.create_event())
        self.timed_waits, why = probe_timed_waits(acl, self.probe_stream, self.probe_event)
        if not self.timed_waits:
            log.info("timed event waits unavailable (%s): execution_timeout_ms is kept by a host watchdog", why)
            self.watchdog = Watchdog(lambda stream: stream.expired())
        self.pool = DeviceMemoryPool(
            lambda n: self.call("rt.malloc", acl.rt.malloc(n, C.MALLOC_HUGE_FIRST)),
            lambda p: self.call("rt.free", acl.rt.free(p)),
            self.config.memory_pool_size, label=f"ascend:{self.device_id}")
        path = os.path.join(self.version_dir, self.config.model_filename)
        for i in range(self.stream_count):
            stream = Stream(self, i)
            self.streams.append(stream)  # before it holds anything, so close() releases a half-opened stream
            stream.open(path)
            if i == 0:
                self.gears = check_model(acl, self.call, self.config, stream.desc, stream.mbatch_index,
                                         len(stream.inputs), len(stream.outputs))
            self.free.put(stream)
        self.info = {"gears": self.gears, "streams": self.stream_count, "device_memory": self.pool.held,
                     "soc": acl.get_soc_name() or "", "run_mode": "ACL_DEVICE" if self.device_mode else "ACL_HOST",
                     "timed_waits": self.timed_waits, "device": self.device_status()}

    def warmup(self) -> int:
        """Not yet: the ge backend runs batches through slots, so its warm-up belongs in the worker loop
        (the first batch of each gear is slow on a real card)."""
        return 0

    # -- device ----------------------------------------------------------------------------
    def device_status(self) -> dict:
        """The device's health, utilisation and memory (see ge_device.device_status); LOST once this
        worker saw its device or context go. Callable from any thread that has set the context."""
        status = device_status(self.acl, self.device_id)
        if self.lost:
            status["health"] = LOST
        return status

    def device_stats(self) -> dict:
        """The health thread's latest reading (that thread holds the context; the stats thread need not).
        ``utilization`` per unit stays in the ready info: the sample carries the AI Core ratio."""
        status = self.info.get("device") or {}
        return {k: v for k, v in status.items() if k != "utilization"}

    def context_alive(self) -> str:
        """After a failed batch: "" if the context still runs work, else why not. A device exception
        aborts the context, and every later task fails with ordinary-looking errors."""
        acl = self.acl
        with self.probe_lock:
            ret = acl.rt.record_event(self.probe_event, self.probe_stream)
            if ret == C.SUCCESS:
                ret = (acl.rt.synchronize_event_with_timeout(self.probe_event, self.timeout_ms) if self.timed_waits
                       else acl.rt.synchronize_event(self.probe_event))
            if ret != C.SUCCESS:
                return f"an empty task on the context failed with {ret} ({C.ERROR_NAMES.get(ret, 'unknown')})"
        if device_status(acl, self.device_id).get("health") == ABNORMAL:
            return "the device reports an abnormal status"
        return ""

    def classify(self, call: str, code: int, detail: str | None, t0: float) -> AclError:
        """The error a failed wait becomes: DeviceLost (the worker is replaced) when the wait timed out,
        the code means the device or context is gone, or the context no longer runs an empty task."""
        waited = (time.monotonic() - t0) * 1000
        if code == C.EVENT_SYNC_TIMEOUT or (self.timed_waits and waited >= self.timeout_ms):
            return DeviceLost(call, code, f"the device stopped answering within execution_timeout_ms "
                                          f"({self.timeout_ms} ms)")
        if code in C.DEVICE_GONE:
            return DeviceLost(call, code, detail)
        gone = self.context_alive()
        if gone:
            return DeviceLost(call, code, f"{detail or 'batch failed'}; {gone}")
        return AclError(call, code, detail)

    def _watch_health(self) -> None:
        """Health thread: reads the device's status; an ABNORMAL device fails the worker (its restart
        resets the device) and makes its models unavailable until then."""
        ret = self.acl.rt.set_context(self.context)
        while ret == C.SUCCESS and not self._health_stop.wait(HEALTH_POLL_S):
            try:
                status = self.device_status()
            except Exception:  # a reading that fails must not end the worker: log it and stop reading
                log.exception("reading the device status failed; no more readings")
                return
            self.info["device"] = status
            if status.get("health") == ABNORMAL:
                self._lose(f"ascend:{self.device_id} reports an abnormal device status")
                return

    def _lose(self, reason: str) -> None:
        if self.fatal is not None:
            self.fatal(reason)
        else:
            self.lost = reason

    # -- batches ---------------------------------------------------------------------------
    def start(self, notify: Callable[[int, int], None], fatal: Callable[[str], None]) -> None:
        self.notify = notify

        def lost(reason: str) -> None:
            self.lost = self.lost or reason
            fatal(reason)

        self.fatal = lost
        for stream in self.streams:
            stream.start()
        self._health = threading.Thread(target=self._watch_health, name="ge-health", daemon=True)
        self._health.start()

    def submit(self, slot: Slot, index: int, seq: int, outputs: PlanOutputs) -> None:
        """Queues a FILLED slot; it starts on the next free stream (pump runs again as streams free up)."""
        self.pending.append((slot, index, seq, outputs))
        self.pump()

    def pump(self) -> None:
        while self.pending:
            try:
                stream = self.free.get_nowait()
            except queue.Empty:
                return
            slot, index, seq, outputs = self.pending.pop(0)
            stream.run(slot, index, seq, outputs)

    def gear_for(self, batch: int) -> int:
        fits = [g for g in self.gears if g >= batch]
        if not fits:
            raise ValueError(f"batch of {batch} exceeds the largest batch the .om was compiled for ({self.gears[-1]})")
        return fits[0]

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Drains every stream (aclrtDestroyStream wants aclrtSynchronizeStream first), then releases in the
        documented order: buffers, models, events and streams, context, device, acl. A stream that does
        not drain within execution_timeout_ms (CLOSE_DRAIN_MIN_S at least) keeps what it holds, and so do
        the context and the device: the process exits right after and the driver reclaims them."""
        self._health_stop.set()
        for stream in self.streams:
            stream.stop()
        stuck = self._drain()
        for stream in self.streams:
            if stream not in stuck:
                stream.release()
        if self.watchdog is not None:
            self.watchdog.close()
        acl = self.acl
        if stuck:
            log.warning("%d stream(s) still busy at close: their buffers, models and the context are left to the "
                        "process exit", len(stuck))
            return
        if self.pool is not None:
            self.pool.close()
        if self.probe_event:
            self.quiet("rt.destroy_event", acl.rt.destroy_event(self.probe_event))
        if self.probe_stream:
            self.quiet("rt.destroy_stream", acl.rt.destroy_stream(self.probe_stream))
        if self.context:
            self.quiet("rt.destroy_context", acl.rt.destroy_context(self.context))
        if self._device_set:
            self.quiet("rt.reset_device", acl.rt.reset_device(self.device_id))
        if self._initialized:
            self.quiet("finalize", acl.finalize())

    def _drain(self) -> set:
        """Synchronizes every stream at once, each on a helper thread, all within one deadline; returns
        the streams that did not drain (an untimed wait is the only one every SoC takes)."""
        acl, context = self.acl, self.context
        results: dict[Stream, list] = {}
        threads = []
        for stream in self.streams:
            if not stream.acl_stream:
                continue
            results[stream] = []

            def sync(s=stream, out=results[stream]) -> None:
                out.append(acl.rt.set_context(context) or acl.rt.synchronize_stream(s.acl_stream))

            threads.append(threading.Thread(target=sync, name=f"ge-drain-{stream.number}", daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + max(self.timeout_ms / 1000, CLOSE_DRAIN_MIN_S)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return {s for s, out in results.items() if not out}

    def quiet(self, name: str, ret) -> None:
        ret = ret[-1] if isinstance(ret, tuple) else ret
        if ret not in (C.SUCCESS, None):
            log.warning("acl.%s returned %s during release", name, ret)

