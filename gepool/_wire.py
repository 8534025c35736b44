"""What the sync and asyncio clients share: turning numpy inputs into a request and replies into arrays."""

import itertools
import math
import threading
import weakref

import msgpack
import numpy as np

from gepool.arena import ArenaFull, ClientArena
from gepool.common import errors, request_parameters
from gepool.ipc import dtypes, layout, protocol

_ids = itertools.count(1)
ARENA_UNKNOWN = "is not registered"  # the front's words for an arena id it does not know
ZERO_COPY_MIN = 64 << 10  # smaller arena outputs are copied out: cheaper than a finalizer per reply
# A request whose inputs and outputs total less than this travels as frames even from a shared-memory
# client (unless an input already lies in the arena): for small tensors the arena's bookkeeping on both
# sides costs more than the copies it saves (1 KiB: 275 us as frames against 298-366 through the
# arena; 16 KiB: 334-372 against 391-403; they meet near 64 KiB, where the front's direct batches start).
ARENA_MIN = 64 << 10
MAX_PRIORITY = request_parameters.MAX_UINT64  # Triton's priority is a uint64
# An input of at most this many bytes travels as a copy (bytes): a copy this small costs less than the
# buffer views a frame of the array itself takes to send; a larger one travels as the array, uncopied.
FRAME_COPY_MAX = 4096
_NUMPY = {name: dtypes.to_numpy(name) for name in dtypes.DATATYPES if name != dtypes.BYTES}
_DATATYPE = {dtype: name for name, dtype in _NUMPY.items()}
_INFER = int(protocol.MsgType.INFER)
PACKER_KEEP = 64 << 10  # a thread's Packer is dropped after a header larger than this
_local = threading.local()  # a Packer per thread: one is not safe to share between threads


def next_id() -> int:
    return next(_ids)


class Outputs(dict):
    """A reply's output arrays by name, and ``model_version``: the version of the model that ran the
    request (what KServe v2 reports as model_version; a request may name none and get the default)."""

    __slots__ = ("model_version",)


class Outgoing:
    """One encoded Infer and the arena ranges it holds until its reply arrives (``out_range`` passes to
    the output arrays of a reply that left them in the arena)."""

    __slots__ = ("req_id", "frames", "ranges", "out_range")

    def __init__(self, req_id: int, frames: list, ranges: list[tuple[int, int]],
                 out_range: tuple[int, int] | None = None) -> None:
        self.req_id, self.frames, self.ranges = req_id, frames, ranges
        self.out_range = out_range

    def release(self, arena: ClientArena | None) -> None:
        """Gives back what the request still holds."""
        if arena is None:
            return
        for off, size in self.ranges + ([self.out_range] if self.out_range else []):
            arena.free(off, size)
        self.ranges, self.out_range = [], None


def encode_infer(model: str, inputs: dict, outputs: list[str] | None, version: int | None,
                 timeout: float | None, arena: tuple[ClientArena, int] | None, out_bytes: int,
                 arena_min: int = ARENA_MIN, deadline: float | None = None, priority: int = 0,
                 origin: int = protocol.Origin.LIBRARY, caller: list | None = None,
                 req_id: int | None = None) -> Outgoing:
    """Tensors go into the arena when one is registered and has room, else as raw frames; so does a
    request under ``arena_min`` bytes in all whose inputs are outside the arena. ``timeout``: the
    request's own (Triton's, for the queue policy); ``deadline``: how long the client waits for it;
    ``caller``: a BLS call's batch (protocol.Infer.caller); ``req_id``: one taken already (else a new one)."""
    priority = check_priority(priority)
    if not isinstance(inputs, dict) or not inputs:
        raise errors.InvalidArgument("inputs must be a non-empty dict of name -> numpy array")
    arrays, types = {}, []
    for name, value in inputs.items():
        arr = np.asarray(value)
        datatype = _DATATYPE.get(arr.dtype)
        if datatype is None:
            try:
                datatype = dtypes.from_numpy(arr.dtype)
            except ValueError as exc:
                raise errors.InvalidArgument(f"input '{name}': {exc}") from None
        types.append(datatype)
        arrays[name] = arr
    if req_id is None:
        req_id = next_id()
    ranges: list[tuple[int, int]] = []
    if dtypes.BYTES in types:
        arena = None  # BYTES travel as frames
    if arena is not None:
        seg, arena_id = arena
        placed = {name: seg.offset_of(arr) for name, arr in arrays.items()}  # already in the arena: no copy
        total = sum(layout.align(a.nbytes) for name, a in arrays.items() if placed[name] is None)
        small = all(p is None for p in placed.values()) and total + out_bytes < arena_min
        try:
            base = None if small else seg.alloc(total + out_bytes)
        except ArenaFull:
            base = None
        if base is None:
            arena = None
        else:
            if total or not out_bytes:
                ranges.append((base, total))
            refs, pos = [], base
            for (name, arr), datatype in zip(arrays.items(), types):
                where = placed[name]
                if where is None:
                    np.copyto(np.frombuffer(seg.buf, arr.dtype, arr.size, pos).reshape(arr.shape), arr)
                    where, pos = pos, pos + layout.align(arr.nbytes)
                refs.append([name, datatype, list(arr.shape), where])
            head = _pack([_INFER, req_id, model, _version(version), refs, outputs, _timeout_us(timeout), priority,
                          arena_id, base + total, out_bytes, _timeout_us(deadline), int(origin), caller, None])
            return Outgoing(req_id, [head], ranges, (base + total, out_bytes) if out_bytes else None)
    refs, frames = [], [b""]
    for (name, arr), datatype in zip(arrays.items(), types):
        refs.append([name, datatype, list(arr.shape), len(refs)])
        if datatype == dtypes.BYTES:
            frames.append(dtypes.serialize_bytes(arr))
        else:
            frames.append(arr.tobytes() if arr.nbytes <= FRAME_COPY_MAX else np.ascontiguousarray(arr))
    frames[0] = _pack([_INFER, req_id, model, _version(version), refs, outputs, _timeout_us(timeout), priority,
                       protocol.NO_ARENA, 0, 0, _timeout_us(deadline), int(origin), caller, None])
    return Outgoing(req_id, frames, ranges)


def _pack(items: list) -> bytes:
    """An Infer's header as protocol.Infer(*items[1:]).encode() writes it, with this thread's Packer."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack(items)
    if len(head) > PACKER_KEEP:  # a Packer keeps the buffer it grew: a large header's goes with this one
        _local.packer = None
    return head


def check_priority(priority: object) -> int:
    """A request's priority as Triton takes it (uint64): 0 is the model's default level, 1 the highest;
    a level past the model's priority_levels runs at its default level (the front applies both)."""
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        raise errors.InvalidArgument(f"priority must be an integer in 0..{MAX_PRIORITY} (0: the model's default "
                                     f"level, 1: the highest), got {priority!r}")
    return priority


def _version(version: int | None) -> int:
    return protocol.NO_VERSION if version is None else int(version)


def _timeout_us(timeout: float | None) -> int:
    return 0 if timeout is None else max(1, int(timeout * 1e6))


def output_bytes(metadata: dict, inputs: dict) -> int:
    """Arena room for a request's outputs, when the model's metadata fixes their size (else 0)."""
    rows = 1
    if metadata.get("max_batch_size", 0) > 0:
        first = next(iter(inputs.values()))
        rows = int(np.shape(first)[0]) if np.ndim(first) else 1
    total = 0
    for out in metadata.get("outputs", []):
        dims = out["shape"][1:] if metadata.get("max_batch_size", 0) > 0 else out["shape"]
        if any(d < 0 for d in dims) or not dtypes.is_supported(out["datatype"]) or out["datatype"] == dtypes.BYTES:
            return 0
        total += layout.align(rows * math.prod(dims) * dtypes.itemsize(out["datatype"]))
    return total


def decode(frames: list) -> tuple[object, list]:
    """(message, tensor frames) of one reply."""
    return protocol.decode(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]), frames[1:]


def result(msg: object, frames: list, arena: ClientArena | None, sent: Outgoing | None = None) -> object:
    """The value a reply stands for: output arrays, a query's body, or the error it carries, raised.

    Outputs the front wrote into the arena (from ZERO_COPY_MIN bytes) come back as read-only views of it: the
    request's output range then belongs to the arrays and returns to the arena when the last view of
    them is collected (``sent`` gives up that range)."""
    if type(msg) is not protocol.Result:
        if isinstance(msg, protocol.Error):
            raise errors.from_code(msg.code, msg.message)
        if isinstance(msg, protocol.Reply):
            return msg.body
        if isinstance(msg, protocol.Welcome):
            return msg
        if not isinstance(msg, protocol.Result):
            raise errors.Internal(f"unexpected reply {type(msg).__name__}")
    out = Outputs()
    out.model_version = msg.version
    in_arena, region = msg.in_arena, None
    if in_arena and sent is not None and sent.out_range is not None and sent.out_range[1] >= ZERO_COPY_MIN:
        (start, size), sent.out_range = sent.out_range, None
        region = np.frombuffer(arena.buf, np.uint8, size, start)
        region.flags.writeable = False
        weakref.finalize(region, arena.give_back, start, size)
    for name, datatype, shape, where in msg.outputs:
        dtype = _NUMPY.get(datatype)
        if dtype is None:
            if datatype == dtypes.BYTES:
                frame = frames[where]
                out[name] = dtypes.deserialize_bytes(frame.buffer if hasattr(frame, "buffer") else frame,
                                                     tuple(shape))
                continue
            dtype = dtypes.to_numpy(datatype)
        if in_arena:
            count = math.prod(shape)
            if region is not None and start <= where and where + count * dtype.itemsize <= start + size:
                out[name] = region[where - start:where - start + count * dtype.itemsize].view(dtype).reshape(shape)
            else:
                out[name] = np.frombuffer(arena.buf, dtype, count, where).reshape(shape).copy()
        else:
            # Zero-copy: the array is a read-only view that keeps the received frame alive.
            frame = frames[where]
            if hasattr(frame, "buffer"):
                frame = frame.buffer
            if len(frame) != math.prod(shape) * dtype.itemsize:
                raise errors.Internal(f"output '{name}': a reply frame of {len(frame)} bytes for a {datatype} "
                                      f"tensor of shape {shape}")
            out[name] = np.ndarray(shape, dtype, frame)
    return out


def curve_client(server_key: str | None, client_key: str | None) -> tuple[bytes, bytes, bytes] | None:
    """(server public, client public, client secret) for CURVE, from certificate files; without a client
    certificate an ephemeral key pair is made (enough for a pool that admits any key)."""
    if server_key is None:
        return None
    import zmq

    from gepool.ipc.sockets import load_keys

    server_public, _ = load_keys(server_key)
    if client_key is None:
        public, secret = zmq.curve_keypair()
    else:
        public, secret = load_keys(client_key)
        if secret is None:
            raise errors.InvalidArgument(f"{client_key} holds no secret key")
    return server_public, public, secret
