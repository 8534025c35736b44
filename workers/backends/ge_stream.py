"""One ACL stream of the ge backend: its model id, buffers and datasets, and the batches it runs one at a time."""

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gepool.ipc.ring import RUNNING, Slot
from gepool.workers import aclconst as C

log = logging.getLogger("gepool.ge")


class AclError(RuntimeError):
    def __init__(self, call: str, code: int, detail: str | None = "") -> None:
        self.call, self.code = call, code
        name = C.ERROR_NAMES.get(code, "")
        super().__init__(f"acl.{call} failed with {code}{f' ({name})' if name else ''}"
                         f"{f': {detail}' if detail else ''}")


class DeviceLost(AclError):
    """The device stopped answering, or its context is gone: the worker must be replaced."""


@dataclass
class _Buffer:
    size: int
    dev: int
    host: int  # the staging buffer, 64-byte aligned inside host_base (0 for the dynamic-batch tensor)
    data: int  # the dataset's data buffer handle
    host_base: int = 0  # what malloc_host returned, for free_host


@dataclass
class _Job:
    slot: Slot
    index: int
    seq: int
    batch: int
    gear: int
    outputs: list  # TensorDesc per output, in config order
    claimed: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> bool:
        """Exactly one of the completion thread and the watchdog reports the job."""
        return self.claimed.acquire(blocking=False)


def align_up(ptr: int, align: int = C.COPY_ALIGN) -> int:
    return (ptr + align - 1) // align * align


class Stream:
    """One model id, one stream, one event, its buffers and datasets; one batch at a time."""

    def __init__(self, be, number: int) -> None:
        self.be, self.number = be, number
        self.inputs: list[_Buffer] = []
        self.outputs: list[_Buffer] = []
        self.mbatch_index = -1
        self.model_id = self.desc = self.acl_stream = self.event = self.in_ds = self.out_ds = 0
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.current: _Job | None = None  # the batch in flight, for the watchdog

    def open(self, path: str) -> None:
        acl, call = self.be.acl, self.be.call
        self.model_id = call("mdl.load_from_file", acl.mdl.load_from_file(path))
        self.desc = acl.mdl.create_desc()
        call("mdl.get_desc", acl.mdl.get_desc(self.desc, self.model_id))
        index, ret = acl.mdl.get_input_index_by_name(self.desc, C.DYNAMIC_TENSOR_NAME)
        self.mbatch_index = index if ret == C.SUCCESS else -1
        if ret != C.SUCCESS:
            acl.get_recent_err_msg()  # a static model's miss is expected: read it so it never sticks
        self.in_ds = acl.mdl.create_dataset()
        self.out_ds = acl.mdl.create_dataset()
        for i in range(acl.mdl.get_num_inputs(self.desc)):
            size = acl.mdl.get_input_size_by_index(self.desc, i)
            self._buffer(size, self.in_ds, self.inputs, staged=i != self.mbatch_index)
        for i in range(acl.mdl.get_num_outputs(self.desc)):
            size = acl.mdl.get_output_size_by_index(self.desc, i)
            self._buffer(size, self.out_ds, self.outputs, staged=True)
        self.acl_stream = call("rt.create_stream", acl.rt.create_stream())
        self.event = call("rt.create_event", acl.rt.create_event())

    def _buffer(self, size: int, dataset: int, into: list, staged: bool) -> None:
        """Device memory (from the pool), staging memory, and the data buffer in the dataset; listed
        before anything is allocated so a failure half-way is still released.

        Staging comes from malloc_host, over-allocated by 64 bytes and used from its first 64-byte
        boundary: memcpy_async wants both ends 64-byte aligned, and on a board (ACL_DEVICE) malloc_host
        returns ordinary device memory with no alignment promised."""
        acl, call = self.be.acl, self.be.call
        buf = _Buffer(size, 0, 0, 0)
        into.append(buf)
        buf.dev = self.be.pool.alloc(size)
        if staged:
            buf.host_base = call("rt.malloc_host", acl.rt.malloc_host(size + C.COPY_ALIGN))
            buf.host = align_up(buf.host_base)
        buf.data = acl.create_data_buffer(buf.dev, size)
        call("mdl.add_dataset_buffer", acl.mdl.add_dataset_buffer(dataset, buf.data))

    # -- running ---------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._complete, name=f"ge-stream-{self.number}", daemon=True)
        self.thread.start()

    def run(self, slot: Slot, index: int, seq: int, plan_outputs: Callable) -> None:
        """Main thread: stage inputs, enqueue H2D -> execute -> D2H -> event on this ACL stream."""
        be, acl, call = self.be, self.be.acl, self.be.call
        t0 = time.monotonic()
        slot.set_state(RUNNING)
        try:
            _, batch, in_descs = slot.read()
            gear = be.gear_for(batch)
            outs = plan_outputs(slot, batch, in_descs)
            real = [b for i, b in enumerate(self.inputs) if i != self.mbatch_index]
            for buf, d in zip(real, in_descs):
                row = d.nbytes // max(batch, 1)
                ctypes.memmove(buf.host, slot.array(d).ctypes.data, d.nbytes)
                ctypes.memset(buf.host + d.nbytes, 0, gear * row - d.nbytes)  # padding rows up to the gear
                call("rt.memcpy_async", acl.rt.memcpy_async(buf.dev, buf.size, buf.host, gear * row, be.h2d,
                                                            self.acl_stream))
            if self.mbatch_index >= 0:
                call("mdl.set_dynamic_batch_size",
                     acl.mdl.set_dynamic_batch_size(self.model_id, self.in_ds, self.mbatch_index, gear))
            call("mdl.execute_async", acl.mdl.execute_async(self.model_id, self.in_ds, self.out_ds, self.acl_stream))
            for buf, d in zip(self.outputs, outs):
                row = d.nbytes // max(batch, 1)
                call("rt.memcpy_async", acl.rt.memcpy_async(buf.host, buf.size, buf.dev, gear * row, be.d2h,
                                                            self.acl_stream))
            call("rt.record_event", acl.rt.record_event(self.event, self.acl_stream))
        except Exception as exc:
            if isinstance(exc, AclError) and exc.code in C.DEVICE_GONE:
                slot.fail(f"{exc}; the device is gone, its worker is replaced", t0, time.monotonic())
                be.notify(index, seq)
                be.fatal(str(exc))
                return
            # Nothing of this batch may still be queued when the stream is reused: drain it first.
            acl.rt.synchronize_stream(self.acl_stream)
            slot.fail(f"{type(exc).__name__}: {exc}", t0, time.monotonic())
            be.free.put(self)
            be.notify(index, seq)
            return
        self.jobs.put(_Job(slot, index, seq, batch, gear, outs))

    def _complete(self) -> None:
        """Completion thread: wait for the event (GIL released), copy outputs into the slot, report."""
        be, acl = self.be, self.be.acl
        ret = acl.rt.set_context(be.context)  # contexts are per thread
        while True:
            job = self.jobs.get()
            if job is None:
                return
            t0 = time.monotonic()
            try:
                if ret != C.SUCCESS:
                    raise AclError("rt.set_context", ret, acl.get_recent_err_msg())
                code = self._wait(job)
                if not job.claim():
                    return  # the watchdog reported it: the device stopped answering, the worker exits
                if code != C.SUCCESS:
                    raise be.classify("rt.synchronize_event", code, acl.get_recent_err_msg(), t0)
                for buf, d in zip(self.outputs, job.outputs):
                    ctypes.memmove(job.slot.array(d).ctypes.data, buf.host, d.nbytes)  # the first rows: n of gear
                job.slot.finish(len(be.config.inputs), job.outputs, t0, time.monotonic())
            except DeviceLost as exc:
                job.slot.fail(f"{exc}; its worker is replaced", t0, time.monotonic())
                be.notify(job.index, job.seq)
                be.fatal(str(exc))
                return
            except Exception as exc:
                job.slot.fail(f"{type(exc).__name__}: {exc}", t0, time.monotonic())
            be.free.put(self)
            be.notify(job.index, job.seq)

    def _wait(self, job: _Job) -> int:
        """The event's result: a timed wait where the SoC has one, else an untimed one under the watchdog."""
        be, acl = self.be, self.be.acl
        if be.timed_waits:
            return acl.rt.synchronize_event_with_timeout(self.event, be.timeout_ms)
        self.current = job
        be.watchdog.arm(self, be.timeout_ms / 1000)
        try:
            return acl.rt.synchronize_event(self.event)
        finally:
            be.watchdog.disarm(self)

    def expired(self) -> None:
        """Watchdog thread: the batch in flight did not finish within execution_timeout_ms."""
        job = self.current
        if job is None or not job.claim():
            return
        reason = (f"the batch on stream {self.number} did not finish within execution_timeout_ms "
                  f"({self.be.timeout_ms} ms); the device stopped answering, its worker is replaced")
        job.slot.fail(reason, time.monotonic(), time.monotonic())
        self.be.notify(job.index, job.seq)
        self.be.fatal(reason)

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout=self.be.timeout_ms / 1000)

    def release(self) -> None:
        """Only once the stream is drained: nothing queued may still use what is released here."""
        be, acl = self.be, self.be.acl
        for ds, bufs in ((self.in_ds, self.inputs), (self.out_ds, self.outputs)):
            for buf in bufs:
                if buf.data:
                    be.quiet("destroy_data_buffer", acl.destroy_data_buffer(buf.data))
                if buf.dev:
                    be.pool.free(buf.dev)
                if buf.host_base:
                    be.quiet("rt.free_host", acl.rt.free_host(buf.host_base))
            if ds:
                be.quiet("mdl.destroy_dataset", acl.mdl.destroy_dataset(ds))
        if self.model_id:
            be.quiet("mdl.unload", acl.mdl.unload(self.model_id))
        if self.desc:
            be.quiet("mdl.destroy_desc", acl.mdl.destroy_desc(self.desc))
        if self.event:
            be.quiet("rt.destroy_event", acl.rt.destroy_event(self.event))
        if self.acl_stream:
            be.quiet("rt.destroy_stream", acl.rt.destroy_stream(self.acl_stream))
