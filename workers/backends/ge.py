"""The GE backend: `.om` models on an Ascend NPU through pyACL, several batches in flight.

Stream design: one worker process owns one NPU and one explicit context. Concurrency comes from
*streams* (instances x stream_num): each loads the `.om` once (its own model id: one model id must
never execute on two ACL streams at once), owns one ACL stream, one event, device buffers from the
memory pool, pinned host buffers and its own datasets (so `set_dynamic_batch_size` never touches a
dataset another batch is using). A batch is three tasks on its ACL stream, H2D copy ->
execute_async -> D2H copy, then an event; stream order makes them sequential for that batch while
other streams' copies and executions overlap with it, so the host->device copy of one batch, the
execution of another and the device->host copy of a third can all be in flight. Each stream has a
completion thread that waits on its event (synchronize_event releases the GIL), copies the outputs
into the slot and reports the slot done, so completions come back in submission order per stream.

Threads: the worker's main thread makes every ACL call that enqueues work (its context is current
since create_context); every completion thread calls set_context first, as pyACL requires.
Async copies read and write only malloc_host memory: the slot's bytes are staged through it.
"""

import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gepool.common.config import BACKEND_GE, KIND_ASCEND, ModelConfig, streams_per_worker
from gepool.ipc.ring import RUNNING, Slot
from gepool.workers import aclconst as C
from gepool.workers.backends import register
from gepool.workers.backends.base import AsyncBackend, Placement, PlanOutputs, check_kinds
from gepool.workers.devmem import DeviceMemoryPool

log = logging.getLogger("gepool.ge")

DEFAULT_EXECUTION_TIMEOUT_MS = 60_000  # a batch that takes longer means the device stopped answering
PYACL_MISSING = ("CANN's pyACL (the 'acl' module of the CANN toolkit) was not found on this host: install "
                 "CANN and source its set_env.sh. Never 'pip install acl': that PyPI package is unrelated")


class AclError(RuntimeError):
    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call, self.code = call, code
        name = C.ERROR_NAMES.get(code, "")
        super().__init__(f"acl.{call} failed with {code}{f' ({name})' if name else ''}"
                         f"{f': {detail}' if detail else ''}")


class DeviceLost(AclError):
    """The device stopped answering within the execution timeout: the worker must be replaced."""


@dataclass
class _Buffer:
    size: int
    dev: int
    host: int  # pinned staging buffer (0 for the dynamic-batch tensor)
    data: int  # the dataset's data buffer handle


@dataclass
class _Job:
    slot: Slot
    index: int
    seq: int
    batch: int
    gear: int
    outputs: list  # TensorDesc per output, in config order


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
        self.stream_count = streams_per_worker(config)
        self.streams: list[_Stream] = []
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: list[tuple] = []
        self.notify: Callable[[int, int], None] | None = None
        self.fatal: Callable[[str], None] | None = None
        self.context = 0
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
        device_mode = run_mode == C.RUN_MODE_DEVICE  # host and device share DDR: copies are device-to-device
        self.h2d = C.MEMCPY_DEVICE_TO_DEVICE if device_mode else C.MEMCPY_HOST_TO_DEVICE
        self.d2h = C.MEMCPY_DEVICE_TO_DEVICE if device_mode else C.MEMCPY_DEVICE_TO_HOST
        self.pool = DeviceMemoryPool(
            lambda n: self.call("rt.malloc", acl.rt.malloc(n, C.MALLOC_HUGE_FIRST)),
            lambda p: self.call("rt.free", acl.rt.free(p)),
            self.config.memory_pool_size, label=f"ascend:{self.device_id}")
        path = os.path.join(self.version_dir, self.config.model_filename)
        for i in range(self.stream_count):
            stream = _Stream(self, i)
            self.streams.append(stream)  # before it holds anything, so close() releases a half-opened stream
            stream.open(path)
            if i == 0:
                self.gears = stream.describe_and_check()
            self.free.put(stream)
        self.info = {"gears": self.gears, "streams": self.stream_count, "device_memory": self.pool.held}

    def warmup(self) -> int:
        """Not yet: the ge backend runs batches through slots, so its warm-up belongs in the worker loop
        (the first batch of each gear is slow on a real card)."""
        return 0

    # -- batches ---------------------------------------------------------------------------
    def start(self, notify: Callable[[int, int], None], fatal: Callable[[str], None]) -> None:
        self.notify, self.fatal = notify, fatal
        for stream in self.streams:
            stream.start()

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

    def close(self) -> None:
        """Releases in the documented order: buffers, models, events and streams, context, device, acl."""
        for stream in self.streams:
            stream.stop()
        for stream in self.streams:
            stream.release()
        if getattr(self, "pool", None) is not None:
            self.pool.close()
        acl = self.acl
        if self.context:
            self._quiet("rt.destroy_context", acl.rt.destroy_context(self.context))
        if self._device_set:
            self._quiet("rt.reset_device", acl.rt.reset_device(self.device_id))
        if self._initialized:
            self._quiet("finalize", acl.finalize())

    def _quiet(self, name: str, ret) -> None:
        ret = ret[-1] if isinstance(ret, tuple) else ret
        if ret not in (C.SUCCESS, None):
            log.warning("acl.%s returned %s during release", name, ret)


class _Stream:
    """One model id, one stream, one event, its buffers and datasets; one batch at a time."""

    def __init__(self, be: GeBackend, number: int) -> None:
        self.be, self.number = be, number
        self.inputs: list[_Buffer] = []
        self.outputs: list[_Buffer] = []
        self.mbatch_index = -1
        self.model_id = self.desc = self.acl_stream = self.event = self.in_ds = self.out_ds = 0
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def open(self, path: str) -> None:
        acl, call = self.be.acl, self.be.call
        self.model_id = call("mdl.load_from_file", acl.mdl.load_from_file(path))
        self.desc = acl.mdl.create_desc()
        call("mdl.get_desc", acl.mdl.get_desc(self.desc, self.model_id))
        index, ret = acl.mdl.get_input_index_by_name(self.desc, C.DYNAMIC_TENSOR_NAME)
        self.mbatch_index = index if ret == C.SUCCESS else -1
        self.in_ds = acl.mdl.create_dataset()
        self.out_ds = acl.mdl.create_dataset()
        for i in range(acl.mdl.get_num_inputs(self.desc)):
            size = acl.mdl.get_input_size_by_index(self.desc, i)
            self._buffer(size, self.in_ds, self.inputs, pinned=i != self.mbatch_index)
        for i in range(acl.mdl.get_num_outputs(self.desc)):
            size = acl.mdl.get_output_size_by_index(self.desc, i)
            self._buffer(size, self.out_ds, self.outputs, pinned=True)
        self.acl_stream = call("rt.create_stream", acl.rt.create_stream())
        self.event = call("rt.create_event", acl.rt.create_event())

    def _buffer(self, size: int, dataset: int, into: list, pinned: bool) -> None:
        """Device memory (from the pool), pinned staging memory, and the data buffer in the dataset;
        listed before anything is allocated so a failure half-way is still released."""
        acl, call = self.be.acl, self.be.call
        buf = _Buffer(size, 0, 0, 0)
        into.append(buf)
        buf.dev = self.be.pool.alloc(size)
        if pinned:
            buf.host = call("rt.malloc_host", acl.rt.malloc_host(size))
        buf.data = acl.create_data_buffer(buf.dev, size)
        call("mdl.add_dataset_buffer", acl.mdl.add_dataset_buffer(dataset, buf.data))

    def describe_and_check(self) -> list[int]:
        """Reads the model description and checks it against config.pbtxt; returns the batch gears."""
        acl, cfg, desc = self.be.acl, self.be.config, self.desc
        real = [i for i in range(len(self.inputs)) if i != self.mbatch_index]
        names = [acl.mdl.get_input_name_by_index(desc, i) for i in real]
        if len(real) != len(cfg.inputs) or len(self.outputs) != len(cfg.outputs):
            raise ValueError(f"the .om has {len(real)} inputs and {len(self.outputs)} outputs, config.pbtxt "
                             f"declares {len(cfg.inputs)} and {len(cfg.outputs)}")
        if self.mbatch_index >= 0:
            info = self.be.call("mdl.get_dynamic_batch", acl.mdl.get_dynamic_batch(desc))
            gears = sorted(info["batch"])
        else:
            dims = self.be.call("mdl.get_input_dims", acl.mdl.get_input_dims(desc, real[0]))["dims"]
            gears = [dims[0]] if cfg.max_batch_size > 0 else [1]
        for t, i in zip(cfg.inputs, real):
            if acl.mdl.get_input_name_by_index(desc, i) != t.name:
                raise ValueError(f"config input '{t.name}' is not the .om's input {i} (the .om has {names})")
            self._check(t, acl.mdl.get_input_data_type(desc, i), acl.mdl.get_input_dims(desc, i), "input")
        for j, t in enumerate(cfg.outputs):
            self._check(t, acl.mdl.get_output_data_type(desc, j), acl.mdl.get_output_dims(desc, j), "output")
        if cfg.max_batch_size > gears[-1]:
            raise ValueError(f"max_batch_size {cfg.max_batch_size} exceeds the largest batch the .om was "
                             f"compiled for ({gears[-1]}; gears {gears})")
        return gears

    def _check(self, t, acl_type: int, dims_ret, kind: str) -> None:
        cfg = self.be.config
        datatype = C.DATATYPES.get(acl_type)
        if datatype != t.datatype:
            raise ValueError(f"{kind} '{t.name}': config says TYPE_{t.datatype}, the .om has aclDataType {acl_type}")
        dims = self.be.call(f"mdl.get_{kind}_dims", dims_ret)["dims"]
        want = list(t.dims) if cfg.max_batch_size == 0 else list(t.dims)
        have = dims if cfg.max_batch_size == 0 else dims[1:]
        if len(have) != len(want) or any(w != -1 and w != h for w, h in zip(want, have)):
            raise ValueError(f"{kind} '{t.name}': config dims {list(t.dims)} do not match the .om's {dims}")

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
                src = slot.array(d).ctypes.data
                ctypes.memmove(buf.host, src, d.nbytes)
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
                code = acl.rt.synchronize_event_with_timeout(self.event, be.timeout_ms)
                if code != C.SUCCESS:
                    waited = (time.monotonic() - t0) * 1000
                    cls = DeviceLost if waited >= be.timeout_ms or code == C.EVENT_SYNC_TIMEOUT else AclError
                    raise cls("rt.synchronize_event_with_timeout", code, acl.get_recent_err_msg())
                for buf, d in zip(self.outputs, job.outputs):
                    ctypes.memmove(job.slot.array(d).ctypes.data, buf.host, d.nbytes)  # the first rows: n of gear
                job.slot.finish(len(be.config.inputs), job.outputs, t0, time.monotonic())
            except DeviceLost as exc:
                job.slot.fail(f"{exc}; the device stopped answering, its worker is replaced", t0, time.monotonic())
                be.notify(job.index, job.seq)
                be.fatal(str(exc))
                return
            except Exception as exc:
                job.slot.fail(f"{type(exc).__name__}: {exc}", t0, time.monotonic())
            be.free.put(self)
            be.notify(job.index, job.seq)

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout=self.be.timeout_ms / 1000)

    def release(self) -> None:
        be, acl = self.be, self.be.acl
        for ds, bufs in ((self.in_ds, self.inputs), (self.out_ds, self.outputs)):
            for buf in bufs:
                if buf.data:
                    be._quiet("destroy_data_buffer", acl.destroy_data_buffer(buf.data))
                if buf.dev:
                    be.pool.free(buf.dev)
                if buf.host:
                    be._quiet("rt.free_host", acl.rt.free_host(buf.host))
            if ds:
                be._quiet("mdl.destroy_dataset", acl.mdl.destroy_dataset(ds))
        if self.model_id:
            be._quiet("mdl.unload", acl.mdl.unload(self.model_id))
        if self.desc:
            be._quiet("mdl.destroy_desc", acl.mdl.destroy_desc(self.desc))
        if self.event:
            be._quiet("rt.destroy_event", acl.rt.destroy_event(self.event))
        if self.acl_stream:
            be._quiet("rt.destroy_stream", acl.rt.destroy_stream(self.acl_stream))

