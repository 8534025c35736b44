"""acl.rt: devices, contexts, streams, events, memory (stand-in)."""

import ctypes
import time

from acl import _state as S
from acl._args import checked

HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 0, 1, 2, 3
ACL_HOST = 1  # run mode: the stand-in is a host talking to a PCIe card


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
    return ACL_HOST, S.SUCCESS


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


@checked("rt.destroy_stream", int)
def destroy_stream(stream_id: int) -> int:
    stream, ret = _stream(stream_id)
    if ret:
        return ret
    stream.idle.wait()  # the real call waits for pending tasks
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
    return code


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
    event.done.clear()

    def record():
        event.status, stream.error = stream.error, S.SUCCESS  # errors so far surface at this event
        event.done.set()
        return S.SUCCESS

    stream.submit(record)
    return S.SUCCESS


@checked("rt.synchronize_event", int)
def synchronize_event(event_id: int) -> int:
    return synchronize_event_with_timeout(event_id, -1)


@checked("rt.synchronize_event_with_timeout", int, int)
def synchronize_event_with_timeout(event_id: int, timeout_ms: int) -> int:
    event = S.events.get(event_id)
    if event is None:
        return S.set_error(S.INVALID_RESOURCE_HANDLE, f"event {event_id:#x} does not exist")
    if not event.done.wait(None if timeout_ms < 0 else timeout_ms / 1000):
        return S.set_error(S.EVENT_SYNC_TIMEOUT, f"event wait timed out after {timeout_ms} ms")
    if event.status:
        S.set_error(event.status, "a task recorded before this event failed")
    return event.status


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
    if mem is None or mem.pinned:
        return S.set_error(S.INVALID_PARAM, f"{ptr:#x} is not device memory")
    with S.lock:
        S.device_used[mem.device] -= mem.size
    del S.memory[ptr]
    return S.SUCCESS


@checked("rt.malloc_host", int)
def malloc_host(size: int):
    if size <= 0:
        return 0, S.set_error(S.INVALID_PARAM, "size must be > 0")
    mem = S.Memory(size, None, pinned=True)
    S.memory[mem.ptr] = mem
    return mem.ptr, S.SUCCESS


@checked("rt.free_host", int)
def free_host(ptr: int) -> int:
    mem = S.memory.get(ptr)
    if mem is None or not mem.pinned:
        return S.set_error(S.INVALID_PARAM, f"{ptr:#x} is not host memory from malloc_host")
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
    ret = _check_copy(dst, dest_max, src, count, kind)
    if ret:
        return ret
    host = {1: src, 2: dst}.get(kind)
    if host is not None:
        mem = S.find_memory(host, count)
        if mem is None or not mem.pinned:
            with S.lock:
                S.stats["unpinned_async_copies"] += 1  # "unpredictable errors may occur" on a real card

    def copy():
        if kind == HOST_TO_HOST:
            return S.set_error(S.INVALID_PARAM, "memcpy_async does not support HOST_TO_HOST")
        S.op_started("copy")
        try:
            ctypes.memmove(dst, src, count)
        finally:
            S.op_finished("copy")
        return S.SUCCESS

    stream.submit(copy)
    return S.SUCCESS


@checked("rt.get_mem_info", int)
def get_mem_info(attr: int):
    ctx, ret = _need_context()
    if ret:
        return 0, 0, ret
    return S.DEVICE_MEMORY - S.device_used[ctx.device], S.DEVICE_MEMORY, S.SUCCESS


def _sleep_until_stopped(stream, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stream.stopped:
        time.sleep(0.01)
