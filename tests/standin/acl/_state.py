"""Process-wide state of the pyACL stand-in: handles, per-thread context, streams, memory, report.

Handles are ints; device and pinned memory are real ctypes buffers, so pointers are real addresses
and a copy moves real bytes. Each stream runs its operations on its own thread, in order, so
nothing enqueued takes effect before the stream gets to it: a missing synchronize shows up as a
wrong answer, as on an NPU.

Switches (environment, read at import): ACL_STANDIN_SOC (the SoC name; "Ascend310..." takes only -1 as a
timed-wait timeout), ACL_STANDIN_RUN_MODE ("host" or "device"), ACL_STANDIN_ABSENT (comma-separated
functions this CANN release lacks, e.g. "rt.synchronize_event_with_timeout"), ACL_STANDIN_CONTROL_DIR
(a folder whose device<N>.json the stand-in reads for each device's utilisation and status).
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
RT_PARAM_INVALID = 107000
ADDR_UNALIGNED = 107008
DEVICE_TASK_ABORT = 107022
AICORE_EXCEPTION = 507015
GE_PARAM_INVALID = 145000
DYNAMIC_INPUT_LENGTH_INVALID = 145012
EVENT_SYNC_TIMEOUT = 507047
STREAM_SYNC_TIMEOUT = 507046
DYNAMIC_BATCH_SIZE_INVALID = 145013
EXEC_MODEL_DATA_SIZE_INVALID = 145006

DEVICES = int(os.environ.get("ACL_STANDIN_DEVICES", "2"))
DEVICE_MEMORY = int(os.environ.get("ACL_STANDIN_DEVICE_MEMORY", str(1 << 30)))
REPORT_DIR = os.environ.get("ACL_STANDIN_REPORT_DIR", "")
SOC = os.environ.get("ACL_STANDIN_SOC", "Ascend910B3")
DEVICE_MODE = os.environ.get("ACL_STANDIN_RUN_MODE", "host") == "device"
ABSENT = {name.strip() for name in os.environ.get("ACL_STANDIN_ABSENT", "").split(",") if name.strip()}
CONTROL_DIR = os.environ.get("ACL_STANDIN_CONTROL_DIR", "")
COPY_ALIGN = 64
DEVICE_ALIGN = 512

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


def control(device: int) -> dict:
    """What a test says device ``device`` reports now (utilisation, status), from the control folder."""
    if not CONTROL_DIR:
        return {}
    try:
        with open(os.path.join(CONTROL_DIR, f"device{device}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def drop_absent(module, prefix: str) -> None:
    """Removes the functions ACL_STANDIN_ABSENT names: a CANN release without them has no attribute."""
    for name in list(vars(module)):
        if f"{prefix}{name}" in ABSENT:
            delattr(module, name)


def current_context():
    return getattr(local, "context", None)


class Context:
    def __init__(self, device: int, default: bool) -> None:
        self.id, self.device, self.default, self.refs = new_id(), device, default, 1
        self.aborted = False  # after a device exception every later task of the context fails


class Memory:
    """A real buffer standing for device or pinned memory, its address ``offset`` bytes past an
    ``align``-byte boundary (pyACL's malloc_host on a board gives no alignment guarantee)."""

    def __init__(self, size: int, device: int | None, pinned: bool, align: int = DEVICE_ALIGN,
                 offset: int = 0) -> None:
        self.buf = ctypes.create_string_buffer(size + align + offset)
        base = ctypes.addressof(self.buf)
        self.size, self.device, self.pinned = size, device, pinned
        self.ptr = (base + align - 1) // align * align + offset
        self.host_api = False  # from malloc_host (device memory on a board, pinned memory on a host)


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

    def submit(self, op, refs: tuple = ()) -> None:
        """Queues ``op``; ``refs`` are the memory addresses and model ids it uses until it has run."""
        with lock:
            self.pending += 1
            self.idle.clear()
            for r in refs:
                in_use[r] = in_use.get(r, 0) + 1
        self.ops.put((op, refs))

    def _run(self) -> None:
        while True:
            item = self.ops.get()
            if item is None:
                return
            op, refs = item
            try:
                code = op()
            except Exception as exc:  # a stand-in bug must surface as a failure, not vanish
                code = set_error(MODEL_EXECUTE, f"stand-in op raised {exc!r}")
            if code and not self.error:
                self.error = code
            with lock:
                for r in refs:
                    in_use[r] -= 1
                    if not in_use[r]:
                        del in_use[r]
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
in_use: dict[int, int] = {}  # memory address or model id -> queued tasks that still use it

stats = {"executes": 0, "executes_per_device": [0] * DEVICES, "active_executes": 0, "max_concurrent_executes": 0,
         "active_ops": 0, "max_concurrent_ops": 0, "unpinned_async_copies": 0, "init_calls": 0,
         "released_while_queued": 0, "busy_stream_destroys": 0}


def still_queued(handle: int, what: str) -> bool:
    """True (and counted) when a queued task still uses ``handle``: releasing it now is the bug CANN
    turns into a crash or garbage, so the caller refuses."""
    with lock:
        if handle in in_use:
            stats["released_while_queued"] += 1
            set_error(RT_PARAM_INVALID, f"{what} {handle:#x} is used by a task still queued on a stream")
            return True
    return False


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
