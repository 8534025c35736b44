"""acl.rt: devices, contexts, streams, events, memory (stand-in).

Sources of the rules, cited beside each: the pyACL wrappers (hicann/runtime python/pyACL/rt/*.cpp), the
runtime API reference (hicann/runtime docs/zh/api_ref/*.md), the CANN 8.0 pyACL guide (aclpythondevg).
"""

import ctypes
import sys
import time

from acl import _state as S
from acl._args import checked

HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 0, 1, 2, 3
ACL_DEVICE, ACL_HOST = 0, 1  # aclrtRunMode


def _need_context():
    ctx = S.current_context()
    if ctx is None or ctx.id not in S.contexts:
        return None, S.set_error(S.CONTEXT_NULL, "no current context in this thread")
    return ctx, S.SUCCESS


@checked("rt.set_device", int)
def set_device(device_id: int) -> int:
    if not 0 <= device_id < S.DEVICES:
        return S.set_error(S.INVALID_DEVICEID, f"device {device_id} does not exist")
    with S.lock:
        ctx = S.default_contexts.get(device_id)
        if ctx is None:
            ctx = S.default_contexts[device_id] = S.Context(device_id, default=True)
            S.contexts[ctx.id] = ctx
        else:
            ctx.refs += 1
    S.local.context = ctx
    return S.SUCCESS


@checked("rt.reset_device", int)
def reset_device(device_id: int) -> int:
    with S.lock:
        ctx = S.default_contexts.get(device_id)
        if ctx is None:
            return S.set_error(S.INVALID_DEVICEID, f"device {device_id} was not set")
        ctx.refs -= 1
        if ctx.refs == 0:
            del S.default_contexts[device_id]
            del S.contexts[ctx.id]
    return S.SUCCESS


@checked("rt.get_device_count")
def get_device_count():
    return S.DEVICES, S.SUCCESS


@checked("rt.get_run_mode")
def get_run_mode():
    return (ACL_DEVICE if S.DEVICE_MODE else ACL_HOST), S.SUCCESS


@checked("rt.create_context", int)
def create_context(device_id: int):
    if not 0 <= device_id < S.DEVICES:
        return 0, S.set_error(S.INVALID_DEVICEID, f"device {device_id} does not exist")
    ctx = S.Context(device_id, default=False)
    S.contexts[ctx.id] = ctx
    S.local.context = ctx
    return ctx.id, S.SUCCESS


@checked("rt.set_context", int)
def set_context(context: int) -> int:
    ctx = S.contexts.get(context)
    if ctx is None:
        return S.set_error(S.INVALID_RESOURCE_HANDLE, f"context {context:#x} does not exist")
    S.local.context = ctx
    return S.SUCCESS


@checked("rt.get_context")
def get_context():
    ctx = S.current_context()
    return (ctx.id, S.SUCCESS) if ctx else (0, S.set_error(S.CONTEXT_NULL, "no current context"))


@checked("rt.destroy_context", int)
def destroy_context(context: int) -> int:
    ctx = S.contexts.get(context)
    if ctx is None or ctx.default:
        return S.set_error(S.INVALID_PARAM, f"context {context:#x} cannot be destroyed")
    del S.contexts[context]
    if S.current_context() is ctx:
        S.local.context = None
    return S.SUCCESS


# -- streams and events ---------------------------------------------------------------------
@checked("rt.create_stream")
def create_stream():
    ctx, ret = _need_context()
    if ret:
        return 0, ret
    stream = S.Stream(ctx)
    S.streams[stream.id] = stream
    return stream.id, S.SUCCESS


def _stream(stream_id: int):
    stream = S.streams.get(stream_id)
    if stream is None:
        return None, S.set_error(S.INVALID_RESOURCE_HANDLE, f"stream {stream_id:#x} does not exist")
    if S.current_context() is not stream.context:
        return None, S.set_error(S.STREAM_CONTEXT, "the stream is not in the calling thread's context")
    return stream, S.SUCCESS


def aborted(ctx) -> int:
    """Once a device exception aborted a context, every task on it fails (the context is gone until
    the device is reset: rt_error_codes.h ACL_ERROR_RT_DEVICE_TASK_ABORT)."""
    if ctx is not None and ctx.aborted:
        return S.set_error(S.DEVICE_TASK_ABORT, "device task aborting: the context hit a device exception")
    return S.SUCCESS


@checked("rt.destroy_stream", int)
def destroy_stream(stream_id: int) -> int:
    stream, ret = _stream(stream_id)
    if ret:
        return ret
    # "Before aclrtDestroyStream, call aclrtSynchronizeStream so that every task of the stream is done"
    # (docs/zh/api_ref/06_stream_management.md): destroying a busy stream is refused and counted.
    if not stream.idle.is_set():
        with S.lock:
            S.stats["busy_stream_destroys"] += 1
        return S.set_error(S.RT_PARAM_INVALID, "the stream still has tasks: synchronize it before destroying it")
    stream.stop()
    del S.streams[stream_id]
    return S.SUCCESS


@checked("rt.synchronize_stream", int)
def synchronize_stream(stream_id: int) -> int:
    stream, ret = _stream(stream_id)
    if ret:
        return ret
    stream.idle.wait()
    code, stream.error = stream.error, S.SUCCESS
    return code or aborted(stream.context)


@checked("rt.synchronize_stream_with_timeout", int, int)
def synchronize_stream_with_timeout(stream_id: int, timeout_ms: int) -> int:
    stream, ret = _stream(stream_id)
    if ret:
        return ret
    ret = _check_timeout(timeout_ms)
    if ret:
        return ret
    if not stream.idle.wait(None if timeout_ms < 0 else timeout_ms / 1000):
        return S.set_error(S.STREAM_SYNC_TIMEOUT, f"stream wait timed out after {timeout_ms} ms")
    code, stream.error = stream.error, S.SUCCESS
    return code or aborted(stream.context)


def _check_timeout(timeout_ms: int) -> int:
    """A timed wait takes -1 (forever) or > 0 ms (docs/zh/api_ref/07_event_management.md,
    aclrtSynchronizeEventWithTimeout); the CANN 8.0 pyACL guide (synchronize_event_with_timeout) says
    Atlas 200/300/500 (Ascend 310) accept only -1. Anything else is ACL_ERROR_RT_PARAM_INVALID."""
    if timeout_ms == -1:
        return S.SUCCESS
    if timeout_ms <= 0 or timeout_ms < -1:
        return S.set_error(S.RT_PARAM_INVALID, f"timeout {timeout_ms} must be -1 or > 0")
    if S.SOC.startswith("Ascend310") and not S.SOC.startswith(("Ascend310P", "Ascend310B")):
        return S.set_error(S.RT_PARAM_INVALID, f"{S.SOC} supports only -1 (wait forever) as a timeout")
    return S.SUCCESS


@checked("rt.create_event")
def create_event():
    ctx, ret = _need_context()
    if ret:
        return 0, ret
    event = S.Event(ctx)
    S.events[event.id] = event
    return event.id, S.SUCCESS


@checked("rt.destroy_event", int)
def destroy_event(event_id: int) -> int:
    if S.events.pop(event_id, None) is None:
        return S.set_error(S.INVALID_RESOURCE_HANDLE, f"event {event_id:#x} does not exist")
    return S.SUCCESS


@checked("rt.record_event", int, int)
def record_event(event_id: int, stream_id: int) -> int:
    event = S.events.get(event_id)
    stream, ret = _stream(stream_id)
    if ret:
        return ret
    if event is None:
        return S.set_error(S.INVALID_RESOURCE_HANDLE, f"event {event_id:#x} does not exist")
    ret = aborted(stream.context)
    if ret:
        return ret
    event.done.clear()

    def record():
        event.status, stream.error = stream.error, S.SUCCESS  # errors so far surface at this event
        event.done.set()
        return S.SUCCESS

    stream.submit(record)
    return S.SUCCESS


def _wait_event(event_id: int, timeout_ms: int) -> int:
    event = S.events.get(event_id)
    if event is None:
        return S.set_error(S.INVALID_RESOURCE_HANDLE, f"event {event_id:#x} does not exist")
    if not event.done.wait(None if timeout_ms < 0 else timeout_ms / 1000):
        return S.set_error(S.EVENT_SYNC_TIMEOUT, f"event wait timed out after {timeout_ms} ms")
    if event.status:
        S.set_error(event.status, "a task recorded before this event failed")
    return event.status


@checked("rt.synchronize_event", int)
def synchronize_event(event_id: int) -> int:
    return _wait_event(event_id, -1)


@checked("rt.synchronize_event_with_timeout", int, int)
def synchronize_event_with_timeout(event_id: int, timeout_ms: int) -> int:
    ret = _check_timeout(timeout_ms)
    return ret or _wait_event(event_id, timeout_ms)


@checked("rt.query_event_status", int)
def query_event_status(event_id: int):
    event = S.events.get(event_id)
    if event is None:
        return 0, S.set_error(S.INVALID_RESOURCE_HANDLE, f"event {event_id:#x} does not exist")
    return (1 if event.done.is_set() else 0), S.SUCCESS


# -- memory ---------------------------------------------------------------------------------
@checked("rt.malloc", int, int)
def malloc(size: int, policy: int):
    ctx, ret = _need_context()
    if ret:
        return 0, ret
    if size <= 0:
        return 0, S.set_error(S.INVALID_PARAM, "size must be > 0")
    with S.lock:
        if S.device_used[ctx.device] + size > S.DEVICE_MEMORY:
            return 0, S.set_error(S.MEMORY_ALLOCATION, f"device {ctx.device} out of memory ({size} bytes asked)")
        S.device_used[ctx.device] += size
    mem = S.Memory(size, ctx.device, pinned=False)
    S.memory[mem.ptr] = mem
    return mem.ptr, S.SUCCESS


@checked("rt.free", int)
def free(ptr: int) -> int:
    mem = S.memory.get(ptr)
    if mem is None or mem.pinned or mem.host_api:
        return S.set_error(S.INVALID_PARAM, f"{ptr:#x} is not device memory from malloc")
    if S.still_queued(ptr, "device memory"):
        return S.RT_PARAM_INVALID
    with S.lock:
        S.device_used[mem.device] -= mem.size
    del S.memory[ptr]
    return S.SUCCESS


@checked("rt.malloc_host", int)
def malloc_host(size: int):
    if size <= 0:
        return 0, S.set_error(S.INVALID_PARAM, "size must be > 0")
    if S.DEVICE_MODE:
        # ACL_DEVICE: "malloc_host returns device memory ... alignment not guaranteed" (CANN 8.0 pyACL
        # guide, malloc_host): ordinary device memory, here 32 bytes off a 64-byte boundary on purpose.
        ctx = S.current_context()
        mem = S.Memory(size, ctx.device if ctx else 0, pinned=False, align=S.COPY_ALIGN, offset=32)
    else:
        mem = S.Memory(size, None, pinned=True, align=S.COPY_ALIGN)  # page-locked, 64-byte aligned
    mem.host_api = True
    S.memory[mem.ptr] = mem
    return mem.ptr, S.SUCCESS


@checked("rt.free_host", int)
def free_host(ptr: int) -> int:
    mem = S.memory.get(ptr)
    if mem is None or not mem.host_api:
        return S.set_error(S.INVALID_PARAM, f"{ptr:#x} is not host memory from malloc_host")
    if S.still_queued(ptr, "host memory"):
        return S.RT_PARAM_INVALID
    del S.memory[ptr]
    return S.SUCCESS


def _check_copy(dst: int, dest_max: int, src: int, count: int, kind: int) -> int:
    if count > dest_max:
        return S.set_error(S.INVALID_PARAM, f"count {count} exceeds dest_max {dest_max}")
    if kind not in (0, 1, 2, 3):
        return S.set_error(S.INVALID_PARAM, f"memcpy kind {kind} is not supported")
    dev_side = {1: (dst,), 2: (src,), 3: (dst, src)}.get(kind, ())
    for ptr, size in ((p, count) for p in dev_side):
        mem = S.find_memory(ptr, size)
        if mem is None or mem.pinned:
            return S.set_error(S.INVALID_PARAM, f"{ptr:#x} (+{size}) is not device memory")
    return S.SUCCESS


@checked("rt.memcpy", int, int, int, int, int)
def memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> int:
    ret = _check_copy(dst, dest_max, src, count, kind)
    if ret:
        return ret
    ctypes.memmove(dst, src, count)
    return S.SUCCESS


@checked("rt.memcpy_async", int, int, int, int, int, int)
def memcpy_async(dst: int, dest_max: int, src: int, count: int, kind: int, stream_id: int) -> int:
    stream, ret = _stream(stream_id)
    if ret:
        return ret
    ret = aborted(stream.context)
    if ret:
        return ret
    # "src and dst must be 64-byte aligned" (CANN 8.0 pyACL guide, memcpy_async): the caller's job.
    for name, ptr in (("dst", dst), ("src", src)):
        if ptr % S.COPY_ALIGN:
            return S.set_error(S.ADDR_UNALIGNED, f"memcpy_async {name} {ptr:#x} is not 64-byte aligned")
    ret = _check_copy(dst, dest_max, src, count, kind)
    if ret:
        return ret
    host = {1: src, 2: dst}.get(kind)
    if host is not None and not S.DEVICE_MODE:
        mem = S.find_memory(host, count)
        if mem is None or not mem.pinned:
            with S.lock:
                S.stats["unpinned_async_copies"] += 1  # "unpredictable errors may occur" on a real card
    refs = tuple(m.ptr for m in (S.find_memory(dst, count), S.find_memory(src, count)) if m is not None)

    def copy():
        if kind == HOST_TO_HOST:
            return S.set_error(S.INVALID_PARAM, "memcpy_async does not support HOST_TO_HOST")
        S.op_started("copy")
        try:
            ctypes.memmove(dst, src, count)
        finally:
            S.op_finished("copy")
        return S.SUCCESS

    stream.submit(copy, refs)
    return S.SUCCESS


MEM_ATTRS = range(10)  # aclrtMemAttr: DDR_MEM 0 ... HBM_P2P_NORMAL 9 (acl_rt.h [S2]; get_mem_info [S5])


@checked("rt.get_mem_info", int)
def get_mem_info(attr: int):
    """(free, total, ret) of the current device ("needs a current device" [S5 get_mem_info]). The
    figures are the device's memory open to applications, system reserve excluded (hicann/runtime
    docs/api_docs/aclrtGetMemInfo.md), not this process's: what other processes hold on the device
    is not free (a test sets it as ``other_bytes`` in the control folder)."""
    ctx, ret = _need_context()
    if ret:
        return 0, 0, ret
    if attr not in MEM_ATTRS:
        return 0, 0, S.set_error(S.INVALID_PARAM, f"get_mem_info attr {attr} is not an aclrtMemAttr")
    other = int(S.control(ctx.device).get("other_bytes", 0))
    return max(0, S.DEVICE_MEMORY - S.device_used[ctx.device] - other), S.DEVICE_MEMORY, S.SUCCESS


@checked("rt.get_device_utilization_rate", int)
def get_device_utilization_rate(device_id: int):
    """(dict, ret) with cube/vector/aicpu/memory utilisation in percent (rt/rt_device.cpp
    GetPyDictFromUtilizationInfo); the values come from the control folder."""
    if not 0 <= device_id < S.DEVICES:
        return {}, S.set_error(S.INVALID_DEVICEID, f"device {device_id} does not exist")
    c = S.control(device_id)
    return {"cube_utilization": int(c.get("cube", 0)), "vector_utilization": int(c.get("vector", 0)),
            "aicpu_utilization": int(c.get("aicpu", 0)), "memory_utilization": int(c.get("memory", 0)),
            "utilization_extend": 0}, S.SUCCESS


@checked("rt.query_device_status", int)
def query_device_status(device_id: int):
    """(status, ret): 0 ACL_RT_DEVICE_STATUS_NORMAL, 1 ABNORMAL (acl_rt.h aclrtDeviceStatus; rt/rt_device.cpp)."""
    if not 0 <= device_id < S.DEVICES:
        return 0xFFFF, S.set_error(S.INVALID_DEVICEID, f"device {device_id} does not exist")
    return int(S.control(device_id).get("status", 0)), S.SUCCESS


def _sleep_until_stopped(stream, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stream.stopped:
        time.sleep(0.01)


S.drop_absent(sys.modules[__name__], "rt.")
