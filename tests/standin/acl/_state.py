"""Process-wide state of the pyACL stand-in: handles, per-thread context, streams, memory, report.

Handles are ints; device and pinned memory are real ctypes buffers, so pointers are real addresses
and a copy moves real bytes. Each stream runs its operations on its own thread, in order, so
nothing enqueued takes effect before the stream gets to it: a missing synchronize shows up as a
wrong answer, as on an NPU.
"""

import ctypes
import itertools
import json
import os
import queue
import threading
import time

SUCCESS = 0
INVALID_PARAM = 100000
REPEAT_INITIALIZE = 100002
INVALID_FILE = 100003
INVALID_MODEL_ID = 100011
REPEAT_FINALIZE = 100037
UNINITIALIZE = 100001
RESOURCE_NOT_MATCH = 200004
INVALID_RESOURCE_HANDLE = 200005
CONTEXT_NULL = 107002
STREAM_CONTEXT = 107003
MODEL_CONTEXT = 107004
INVALID_DEVICEID = 107001
MEMORY_ALLOCATION = 207001
MODEL_EXECUTE = 507011
EVENT_SYNC_TIMEOUT = 507047
DYNAMIC_BATCH_SIZE_INVALID = 145013
EXEC_MODEL_DATA_SIZE_INVALID = 145006

DEVICES = int(os.environ.get("ACL_STANDIN_DEVICES", "2"))
DEVICE_MEMORY = int(os.environ.get("ACL_STANDIN_DEVICE_MEMORY", str(1 << 30)))
REPORT_DIR = os.environ.get("ACL_STANDIN_REPORT_DIR", "")

lock = threading.RLock()
_ids = itertools.count(0x1000)
local = threading.local()
initialized = False
finalized = False


def new_id() -> int:
    return next(_ids)


def set_error(code: int, text: str) -> int:
    local.err = f"EZ9999: {text} (error code {code})"
    return code


def current_context():
    return getattr(local, "context", None)


class Context:
    def __init__(self, device: int, default: bool) -> None:
        self.id, self.device, self.default, self.refs = new_id(), device, default, 1


class Memory:
    """A real buffer standing for device or pinned memory."""

    def __init__(self, size: int, device: int | None, pinned: bool) -> None:
        self.buf = ctypes.create_string_buffer(size)
        self.size, self.device, self.pinned = size, device, pinned
        self.ptr = ctypes.addressof(self.buf)


class Event:
    def __init__(self, context: Context) -> None:
        self.id, self.context = new_id(), context
        self.done = threading.Event()
        self.done.set()  # an event never recorded counts as complete
        self.status = SUCCESS


class Stream:
    """FIFO of operations run by one thread; errors stick until a record or a synchronize reads them."""

    def __init__(self, context: Context) -> None:
        self.id, self.context = new_id(), context
        self.ops: queue.Queue = queue.Queue()
        self.error = SUCCESS
        self.idle = threading.Event()
        self.idle.set()
        self.pending = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=f"acl-stream-{self.id:x}", daemon=True)
        self.thread.start()

    def submit(self, op) -> None:
        with lock:
            self.pending += 1
            self.idle.clear()
        self.ops.put(op)

    def _run(self) -> None:
        while True:
            op = self.ops.get()
            if op is None:
                return
            try:
                code = op()
            except Exception as exc:  # a stand-in bug must surface as a failure, not vanish
                code = set_error(MODEL_EXECUTE, f"stand-in op raised {exc!r}")
            if code and not self.error:
                self.error = code
            with lock:
                self.pending -= 1
                if not self.pending:
                    self.idle.set()

    def stop(self) -> None:
        self.stopped = True
        self.ops.put(None)


contexts: dict[int, Context] = {}
default_contexts: dict[int, Context] = {}
streams: dict[int, Stream] = {}
events: dict[int, Event] = {}
memory: dict[int, Memory] = {}
data_buffers: dict[int, list] = {}  # id -> [ptr, size]
datasets: dict[int, list] = {}  # id -> [buffer ids]
models: dict[int, object] = {}
descs: dict[int, object] = {}
device_used = [0] * DEVICES

stats = {"executes": 0, "executes_per_device": [0] * DEVICES, "active_executes": 0, "max_concurrent_executes": 0,
         "active_ops": 0, "max_concurrent_ops": 0, "unpinned_async_copies": 0, "init_calls": 0}


def op_started(kind: str) -> None:
    with lock:
        stats["active_ops"] += 1
        stats["max_concurrent_ops"] = max(stats["max_concurrent_ops"], stats["active_ops"])
        if kind == "execute":
            stats["active_executes"] += 1
            stats["max_concurrent_executes"] = max(stats["max_concurrent_executes"], stats["active_executes"])


def op_finished(kind: str) -> None:
    with lock:
        stats["active_ops"] -= 1
        if kind == "execute":
            stats["active_executes"] -= 1


def find_memory(ptr: int, size: int) -> Memory | None:
    """The allocation that holds [ptr, ptr + size), if the stand-in made it."""
    for m in memory.values():
        if m.ptr <= ptr and ptr + size <= m.ptr + m.size:
            return m
    return None


def leaks() -> dict:
    explicit = [c for c in contexts.values() if not c.default]
    return {k: v for k, v in {
        "contexts": len(explicit), "default_contexts": len(default_contexts), "streams": len(streams),
        "events": len(events), "device_memory": sum(1 for m in memory.values() if not m.pinned),
        "host_memory": sum(1 for m in memory.values() if m.pinned), "models": len(models), "descs": len(descs),
        "datasets": len(datasets), "data_buffers": len(data_buffers),
    }.items() if v}


def write_report(finalized_ok: bool) -> None:
    if not REPORT_DIR:
        return
    report = dict(stats, pid=os.getpid(), finalized=finalized_ok, leaks=leaks(), time=time.time())
    path = os.path.join(REPORT_DIR, f"acl-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
