"""The wire types, and nothing else: one dataclass per message, msgpack arrays in field order.

Client <-> front: a multipart message whose first frame is the encoded header; an ``Infer`` may be
followed by one raw frame per tensor (``TensorRef.where`` is the frame index), or name a registered
arena (``where`` is a byte offset into it) so that no tensor crosses the socket. Front <-> worker:
readiness, DeviceStats and Stop here; which slot to run and which is done ride the doorbells (ipc/doorbell.py).
The protocol version is checked once, in Hello/Welcome and WorkerReady.
"""

import enum
import operator
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 4  # 2: Result names the model version that ran the request; 3: Infer names its origin;
# 4: an Infer may carry a group of requests (Infer.members), answered together (Result.members)
NO_VERSION = -1  # Infer.version: serve the default version
NO_ARENA = -1  # Infer.arena: tensors ride as frames
EXIT_LOAD_FAILED = 3  # a worker's exit code after its WorkerFailed; the front goes by the message
EXIT_DEVICE_LOST = 4  # a worker whose device stopped answering: restarted like a crash
WARMUP_SLOT = -1  # Infer.caller's slot while the calling worker runs no batch (its warmup)
CALLER_KEY_BYTES = 16  # Infer.caller's key: minted by the front for each worker process it starts


class ModelState(enum.StrEnum):
    """A model's state as the status reply carries it (the front's transitions: scheduler/states.py).
    AVAILABLE travels as "READY", Triton's word for a model that serves."""

    LOADING = "LOADING"
    AVAILABLE = "READY"
    UNAVAILABLE = "UNAVAILABLE"


class Origin(enum.IntEnum):
    """The surface a request came by (Infer.origin): the ``protocol`` label of the per-request metrics."""

    LIBRARY = 0
    HTTP = 1
    GRPC = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class MsgType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    INFER = 3
    RESULT = 4
    ERROR = 5
    REGISTER_ARENA = 6
    UNREGISTER_ARENA = 7
    QUERY = 8
    REPLY = 9
    WORKER_READY = 20
    WORKER_FAILED = 21
    STOP = 24  # 22 and 23 (run, done) moved to the doorbells (gepool.ipc.doorbell)
    DROP_ARENA = 25
    SET_LOGGING = 26
    DEVICE_STATS = 27


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol."""


_BY_TYPE: dict[int, type] = {}


def _message(cls: type) -> type:
    # Not frozen: a frozen dataclass sets each field through object.__setattr__, and the front makes
    # and reads several messages per request. Nothing keeps or hashes a message after handling it.
    cls = dataclass(slots=True)(cls)
    cls._FIELDS = tuple(f.name for f in fields(cls))
    cls._REQUIRED = sum(f.default is MISSING for f in fields(cls))  # the trailing rest are optional
    get = operator.attrgetter(*cls._FIELDS) if cls._FIELDS else (lambda _: ())
    cls._values = staticmethod(get if len(cls._FIELDS) != 1 else (lambda m, g=get: (g(m),)))
    cls._TYPE = int(cls.TYPE)
    _BY_TYPE[cls._TYPE] = cls
    return cls


class _Base:
    TYPE: ClassVar[MsgType]
    _FIELDS: ClassVar[tuple[str, ...]]
    _REQUIRED: ClassVar[int]
    _TYPE: ClassVar[int]

    def encode(self) -> bytes:
        return msgpack.packb([self._TYPE, *self._values(self)], use_bin_type=True)


def decode(frame: bytes | memoryview) -> Any:
    """The message in one header frame, or ProtocolError saying what is wrong with it."""
    try:
        items = msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"header is not msgpack: {exc}") from None
    if not isinstance(items, list) or not items or not isinstance(items[0], int):
        raise ProtocolError("header must be a msgpack array starting with a message type")
    cls = _BY_TYPE.get(items[0])
    if cls is None:
        raise ProtocolError(f"unknown message type {items[0]}")
    if not cls._REQUIRED <= len(items) - 1 <= len(cls._FIELDS):
        wanted = len(cls._FIELDS) if cls._REQUIRED == len(cls._FIELDS) else f"{cls._REQUIRED} to {len(cls._FIELDS)}"
        raise ProtocolError(f"{cls.__name__} needs {wanted} fields, got {len(items) - 1}")
    return cls(*items[1:])


# A tensor on the wire: [name, datatype, shape, where]; `where` is a frame index or an arena offset.
TensorRef = list


@_message
class Hello(_Base):
    TYPE = MsgType.HELLO
    req_id: int
    version: int
    client: str


@_message
class Welcome(_Base):
    TYPE = MsgType.WELCOME
    req_id: int
    version: int
    pool_id: str
    server: str


@_message
class Infer(_Base):
    TYPE = MsgType.INFER
    req_id: int
    model: str
    version: int
    inputs: list  # [TensorRef]
    outputs: list | None  # names wanted; None = all
    timeout_us: int  # 0 = none
    priority: int  # 0 = model default
    arena: int  # NO_ARENA or an id from REGISTER_ARENA
    out_offset: int  # where in the arena the front may write outputs
    out_size: int  # how many bytes it may use there (0 = send outputs as frames)
    # how long its client waits for the answer (0 = no limit): past it the request is dropped unrun;
    # unlike timeout_us it never changes the queue policy's timeout
    deadline_us: int = 0
    origin: int = int(Origin.LIBRARY)  # the surface it came by (the gateway sets HTTP or GRPC); a plain int, as decoded
    # A BLS call (a python model calling another model): [worker id, slot, seq, key]: the batch whose execute
    # waits on it (slot WARMUP_SLOT: the worker's warmup), and the key the front started that worker with
    # (CALLER_KEY_BYTES). The front derives the call chain from that batch.
    caller: list | None = None
    # A group: several requests of one client, alike but for their rows, whose tensors are stacked along the
    # batch dimension: [[req_id, rows], ...] in that order (req_id, above, is the group's own). The front runs
    # it as one request where that cannot be told apart from running each (Result.members answers it), else
    # as each member on its own, answered under the member's req_id; an Error under the group's req_id is
    # every member's answer.
    members: list | None = None


@_message
class Result(_Base):
    TYPE = MsgType.RESULT
    req_id: int
    outputs: list  # [TensorRef]; `where` indexes frames, or the arena when in_arena
    in_arena: bool
    version: int  # the model version that ran it (KServe's model_version)
    members: list | None = None  # a group's answer: its Infer.members; each member's outputs are its rows


@_message
class Error(_Base):
    TYPE = MsgType.ERROR
    req_id: int
    code: str
    message: str


@_message
class RegisterArena(_Base):
    TYPE = MsgType.REGISTER_ARENA
    req_id: int
    name: str
    size: int
    token: bytes = b""  # the arena's first ARENA_TOKEN_BYTES bytes (gepool.ipc.layout): proof of access


@_message
class UnregisterArena(_Base):
    TYPE = MsgType.UNREGISTER_ARENA
    req_id: int
    arena: int


@_message
class Query(_Base):
    """Metadata and state: what is 'status', 'metadata' (args: model) or 'stats'."""

    TYPE = MsgType.QUERY
    req_id: int
    what: str
    args: dict


@_message
class Reply(_Base):
    TYPE = MsgType.REPLY
    req_id: int
    body: Any


@_message
class WorkerReady(_Base):
    TYPE = MsgType.WORKER_READY
    worker: int
    version: int
    pid: int
    info: dict


@_message
class WorkerFailed(_Base):
    """Sent by a worker whose model could not load, just before it exits."""

    TYPE = MsgType.WORKER_FAILED
    worker: int
    reason: str


@_message
class Stop(_Base):
    TYPE = MsgType.STOP


@_message
class DropArena(_Base):
    """Front -> worker: a client released this arena; unmap it (the next direct batch maps anew)."""

    TYPE = MsgType.DROP_ARENA
    name: str


@_message
class SetLogging(_Base):
    """Front -> worker: log from now on at this level (Triton's verbose level, date format)."""

    TYPE = MsgType.SET_LOGGING
    level: int
    verbose: int
    format: str


@_message
class DeviceStats(_Base):
    """Worker -> front, every few seconds from a thread of its own: what its process and device report
    now. ``sample`` holds numbers only, each key absent where the backend cannot read it: rss_bytes,
    cpu_seconds (the process); memory_used_bytes, memory_total_bytes, utilization_ratio (the device);
    health (a word: HEALTHY, ABNORMAL, LOST)."""

    TYPE = MsgType.DEVICE_STATS
    worker: int
    pid: int  # the front keeps a sample only from the process it knows as this worker
    sample: dict
