"""Admission: a request is checked completely before it may enter a queue."""

from __future__ import annotations

import codecs
import hmac
import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from gepool.common.config import BACKEND_ONNX, ModelConfig
from gepool.common.errors import InvalidArgument, PermissionDenied, RequestTooLarge, Timeout, Unavailable
from gepool.ipc import dtypes, layout, protocol
from gepool.scheduler.arena_io import ArenaSpan
from gepool.scheduler.arenas import Arena, Arenas
from gepool.scheduler.classify import requested_outputs

if TYPE_CHECKING:
    from gepool.scheduler.books import Workers


class Sink(Protocol):
    """Where a step request of an ensemble is answered, inside the front."""

    def done(self, model, arrays: dict, row: int, compute_s: float) -> bool:
        """Its batch ran: its outputs are rows ``row``.. of ``arrays`` (views of the slot, reused once this
        returns: what it keeps, it copies). False: its client was told it was canceled instead (nobody
        waited for the answer), and its model counts it so."""

    def failed(self, model, err) -> None:
        """It will not run, or its model failed it."""


@dataclass(slots=True, eq=False)
class Request:
    """One admitted request. ``inputs`` holds, in config order, each tensor's bytes: a view of a received
    ZMQ frame or lane record (the view keeps its owner alive), or the span of the client's arena they
    lie in (read when they are copied)."""

    identity: bytes
    req_id: int
    model: str
    shapes: list[tuple[int, ...]]
    inputs: list[memoryview | ArenaSpan]
    rows: int
    nbytes: int  # inputs plus the fixed-size outputs this request needs in a slot
    outputs: set[str] | None
    arena: int
    out_offset: int
    out_size: int
    arrived: float
    key: tuple | None = field(default=None)
    retried: bool = False  # a request runs at most twice: once more if its worker dies under it
    where: list[int] | None = None  # the inputs' offsets in the client's arena (None: they came as frames)
    classify: dict[str, int] | None = None  # outputs asked for as their top classes: name -> class count
    cache_key: bytes | None = None  # a response cache miss: its response is kept under this key
    sink: Sink | None = None  # an ensemble's step: its outputs and errors go there, not to a client
    origin: int = protocol.Origin.LIBRARY  # the surface it came by: the per-request metrics' protocol label
    chain: tuple[str, ...] = ()  # a BLS call: the models whose execute waits on it, outermost first
    caller: list[int] | None = None  # a BLS call (or a step of the ensemble it called): [worker, slot, seq] of
    # the batch that waits on it (its key checked and dropped)
    deadline: float | None = None  # when nobody waits for it any more (its timeout or its client's deadline)
    priority: int = 0  # as it asked: a retry goes back to its own level
    expires: float | None = None  # its client's deadline alone: a retry still leaves the queue at it
    count: int = 1  # the client requests it stands for: a group's members (protocol.Infer.members)
    members: list | None = None  # a group's members, echoed in its Result


# A BYTES tensor of elements of different lengths is checked element by element, in Python, in the
# front's one thread: past this many elements that walk would hold up every other client.
MAX_BYTES_ELEMENTS = 1 << 16
TEXT_CHUNK_BYTES = 1 << 20  # check_text decodes this much at a time: its memory does not grow with the tensor
BYTES_PREFIX = 4  # each serialized element starts with its uint32 length

_INT_FIELDS = ("req_id", "version", "timeout_us", "priority", "arena", "out_offset", "out_size", "deadline_us")
_NON_NEGATIVE = ("timeout_us", "priority", "out_offset", "out_size", "deadline_us")
ORIGINS = tuple(int(o) for o in protocol.Origin)
_INT_ONLY = frozenset((int,))
_ints, _non_negatives = operator.attrgetter(*_INT_FIELDS), operator.attrgetter(*_NON_NEGATIVE)


def _check_fields(msg: protocol.Infer) -> None:
    """Every header field has the type and range the protocol gives it, before anything uses it.
    (``type(v) is int``: msgpack gives plain ints, and a bool is not a count.)"""
    if (_INT_ONLY.issuperset(map(type, _ints(msg))) and min(_non_negatives(msg)) >= 0 and type(msg.inputs) is list
            and type(msg.origin) is int and msg.origin in ORIGINS):
        return  # every check of _refuse_fields passes: the usual request, in one expression
    _refuse_fields(msg)


def _refuse_fields(msg: protocol.Infer) -> None:
    """``_check_fields``, one field at a time in a fixed order: the error names the first field wrong."""
    for name in _INT_FIELDS:
        v = getattr(msg, name)
        if type(v) is not int:
            raise InvalidArgument(f"{name} must be an integer, got {v!r}")
    for name in _NON_NEGATIVE:
        if getattr(msg, name) < 0:
            raise InvalidArgument(f"{name} must be >= 0, got {getattr(msg, name)}")
    if type(msg.inputs) is not list:
        raise InvalidArgument("inputs must be a list")
    if type(msg.origin) is not int or msg.origin not in ORIGINS:
        raise InvalidArgument(f"origin must be one of {list(ORIGINS)}, got {msg.origin!r}")


def origin_of(msg: protocol.Infer) -> int:
    """The request's origin, or LIBRARY where it names none of ours (admission then refuses it)."""
    return msg.origin if type(msg.origin) is int and msg.origin in ORIGINS else protocol.Origin.LIBRARY


def _shape_of(name: str, shape: object) -> tuple[int, ...]:
    if type(shape) is list and _INT_ONLY.issuperset(map(type, shape)) and (not shape or min(shape) >= 0):
        return tuple(shape)  # every check of _checked_shape passes: the usual shape, in one expression
    return _checked_shape(name, shape)


def _checked_shape(name: str, shape: object) -> tuple[int, ...]:
    """``_shape_of``, one check at a time: the error says which failed."""
    if type(shape) is not list or not all(type(d) is int for d in shape):
        raise InvalidArgument(f"input '{name}': shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input '{name}': shape {shape} has a negative dimension")
    return tuple(shape)


class Admission:
    """What admitting a request to one model needs from its config, worked out once per model
    generation: the front admits every request, and the config does not change under it."""

    __slots__ = ("config", "slot_bytes", "batched", "inputs", "names", "out_names", "out_order", "out_row_bytes",
                 "slack", "variable", "fixed_outputs", "text")

    def __init__(self, config: ModelConfig, slot_bytes: int) -> None:
        self.config, self.slot_bytes = config, slot_bytes
        self.batched = config.max_batch_size > 0
        # per input: name, datatype, dims, itemsize (0 for BYTES)
        self.inputs = [(t.name, t.datatype, t.dims, 0 if t.datatype == dtypes.BYTES else dtypes.itemsize(t.datatype))
                       for t in config.inputs]
        self.names = {t.name for t in config.inputs}
        self.out_names = {t.name for t in config.outputs}
        self.out_order = [t.name for t in config.outputs]  # shared by every response: never changed
        self.out_row_bytes = sum(t.row_bytes() or 0 for t in config.outputs)
        self.slack = (len(config.inputs) + len(config.outputs)) * layout.ALIGN
        self.variable = not all(t.fixed for t in config.inputs)
        self.fixed_outputs = all(t.fixed for t in config.outputs)  # their places are known before running
        # BYTES inputs that must be UTF-8 text: an onnxruntime model's strings (its Python API takes str)
        self.text = frozenset(t.name for t in config.inputs if t.datatype == dtypes.BYTES) \
            if config.backend == BACKEND_ONNX else frozenset()


def admit(msg: protocol.Infer, identity: bytes, frames: list[memoryview], plan: Admission, arenas: Arenas,
          now: float) -> Request:
    """Checks one Infer against the model's config; raises a GepoolError naming what is wrong.
    ``frames``: the message's tensor parts."""
    given = check_header(msg, plan)
    config = plan.config
    arena = None
    if msg.arena != protocol.NO_ARENA:
        arena = arenas.of_client(msg.arena, identity)
        if arena is None:  # unknown, or another client's: the same words, and nothing touched
            raise InvalidArgument(f"arena {msg.arena} is not registered by this client")
    shapes, buffers, rows, total = [], [], -1, 0
    for spec in plan.inputs:
        name, _, _, itemsize = spec
        _, datatype, shape, where = given[name]
        shape = _shape_of(name, shape)
        rows = check_tensor(plan, spec, datatype, shape, rows, shapes)
        if itemsize:
            buf = _buffer(name, where, math.prod(shape) * itemsize, frames, arena)
        else:
            buf = _bytes_buffer(name, where, math.prod(shape), frames, arena)
        buffers.append(buf)
        total += len(buf)
        shapes.append(shape)
    rows, total, key = check_batch(plan, shapes, rows, total)
    check_texts(plan, shapes, buffers)
    outputs, classify = (None, None) if msg.outputs is None else requested_outputs(msg.outputs, config)
    return Request(identity, msg.req_id, config.name, shapes, buffers, rows, total, outputs,
                   msg.arena, msg.out_offset, msg.out_size, now, key,
                   where=[given[name][3] for name, *_ in plan.inputs] if arena is not None else None,
                   classify=classify, origin=msg.origin, deadline=_deadline(msg, now), priority=msg.priority,
                   expires=now + msg.deadline_us / 1e6 if msg.deadline_us else None)


def check_header(msg: protocol.Infer, plan: Admission) -> dict[str, list]:
    """An Infer's fields and input list (each input once, the model's inputs), as admission checks them first:
    its inputs by name."""
    _check_fields(msg)
    given: dict[str, list] = {}
    for ref in msg.inputs:
        if not (type(ref) is list and len(ref) == 4 and type(ref[0]) is str):
            raise InvalidArgument(f"each input must be [name, datatype, shape, where], got {ref!r}")
        if ref[0] in given:
            raise InvalidArgument(f"input '{ref[0]}' is given twice")
        given[ref[0]] = ref
    check_names(plan, given.keys())
    return given


def check_names(plan: Admission, names: Iterable[str]) -> None:
    """The inputs named (each once) are the model's inputs."""
    if names != plan.names:
        config, names = plan.config, set(names)
        if unknown := sorted(names - plan.names):
            raise InvalidArgument(f"unknown input {unknown} for model '{config.name}' (it takes {sorted(plan.names)})")
        raise InvalidArgument(f"missing input {sorted(plan.names - names)} for model '{config.name}'")


def check_tensor(plan: Admission, spec: tuple, datatype: object, shape: tuple[int, ...], rows: int,
                 shapes: list[tuple[int, ...]]) -> int:
    """Input ``spec`` (one of ``plan.inputs``) given as ``datatype`` and ``shape`` (non-negative counts),
    after the inputs of ``shapes`` whose batch size is ``rows`` (-1 before the first): the batch size."""
    name, want_type, want_dims, _ = spec
    config, batched = plan.config, plan.batched
    if datatype != want_type:
        raise InvalidArgument(f"input '{name}': datatype {datatype} does not match the model's {want_type}")
    dims = shape[1:] if batched else shape
    if dims != want_dims and (len(dims) != len(want_dims)
                              or any(c != -1 and c != d for c, d in zip(want_dims, dims, strict=True))):
        want = (["-1"] if batched else []) + [str(d) for d in want_dims]
        raise InvalidArgument(f"input '{name}': shape {list(shape)} does not match the model's "
                              f"[{', '.join(want)}]")
    if batched:
        if rows == -1:
            rows = shape[0]
            if rows > config.max_batch_size:  # before any of its data is looked at
                raise InvalidArgument(f"batch size {rows} is outside 1..max_batch_size "
                                      f"({config.max_batch_size}) of model '{config.name}'")
        elif rows != shape[0]:
            seen = sorted({s[0] for s in shapes} | {shape[0]})
            raise InvalidArgument(f"inputs disagree on the batch dimension: {seen}")
    return rows


def check_batch(plan: Admission, shapes: list[tuple[int, ...]], rows: int, total: int) -> tuple[int, int, tuple | None]:
    """All inputs checked (``total``: their bytes): (batch size, bytes in a slot with the outputs, the
    variable-shape key), once the batch size and the room in a slot are checked."""
    config, batched = plan.config, plan.batched
    if batched:
        if rows < 1 or rows > config.max_batch_size:
            raise InvalidArgument(f"batch size {rows} is outside 1..max_batch_size ({config.max_batch_size}) "
                                  f"of model '{config.name}'")
    else:
        rows = 1
    total += plan.out_row_bytes * rows
    if total + plan.slack > plan.slot_bytes:
        raise RequestTooLarge(f"the request needs {total + plan.slack} bytes in a slot; a slot of model "
                              f"'{config.name}' holds {plan.slot_bytes} (raise its 'slot_bytes' parameter)")
    key = tuple(s[1:] if batched else s for s in shapes) if plan.variable else None
    return rows, total, key


def whole_buffer(name: str, itemsize: int, shape: tuple[int, ...],
                 buf: memoryview | ArenaSpan) -> memoryview | ArenaSpan:
    """A tensor the front holds whole already (a frame's view, an arena span, a step's output), checked
    against its shape as a frame is."""
    count = math.prod(shape)
    if not itemsize:
        return _bytes_buffer(name, 0, count, [buf], None)
    if len(buf) != count * itemsize:
        raise InvalidArgument(f"input '{name}': {len(buf)} bytes sent, its shape and datatype need {count * itemsize}")
    return buf


def _deadline(msg: protocol.Infer, now: float) -> float | None:
    if not (msg.timeout_us or msg.deadline_us):  # the usual request: no list built
        return None
    limits = [us for us in (msg.timeout_us, msg.deadline_us) if us]
    return now + min(limits) / 1e6 if limits else None


_NO_WORKER = bytes(protocol.CALLER_KEY_BYTES)  # compared against when the caller names no worker
MAX_BLS_DEPTH = 8  # models in one BLS call chain, the outermost caller included


def bls_chain(msg: protocol.Infer, target: str, workers: Workers, now: float) -> tuple[str, ...]:
    """The call chain of a BLS request from ``msg.caller`` ([worker, slot, seq, key]: the batch that waits on
    it, and the key that worker's process was started with): the chains of that batch's requests, then the
    batch's model. Refused when the key is not that worker's (only its own process may name its batches),
    when ``target`` is in the chain already (its execute would wait on itself: a deadlock while its
    instances are all waiting) or it is too deep. The call's timeout becomes no later than the last of the
    calling requests' deadlines (none when one of them has none)."""
    caller = msg.caller
    if not (type(caller) is list and len(caller) == 4 and all(type(v) is int for v in caller[:3])
            and type(caller[3]) is bytes):
        raise InvalidArgument(f"caller must be [worker, slot, seq, key] (three integers and the worker's key), "
                              f"got {_shown(caller)}")
    w = workers.get(caller[0])
    # one refusal, and one comparison, whether or not the worker exists: ids do not map to models
    if not hmac.compare_digest(caller[3], _NO_WORKER if w is None else w.key) or w is None:
        raise PermissionDenied("the BLS caller names no worker of this pool, or not with that worker's key: "
                               "only a python model's own worker may make BLS calls as its batch")
    chain: dict[str, None] = {}
    if caller[1] != protocol.WARMUP_SLOT:  # the caller is warming up, with no request behind it
        batch = w.inflight.get(caller[1])
        if batch is None or batch.seq != caller[2]:
            raise Unavailable(f"the batch of model '{w.model.name}' that made this BLS call is no longer running")
        for req in batch.requests:
            chain.update(dict.fromkeys(req.chain))
        _cap_timeout(msg, [r.deadline for r in batch.requests], now)
    chain[w.model.name] = None
    if target in chain:
        names = list(chain)
        loop = " -> ".join(names[names.index(target):] + [target])
        raise InvalidArgument(f"model '{target}' calls itself through BLS: {loop}")
    if len(chain) >= MAX_BLS_DEPTH:
        raise InvalidArgument(f"BLS calls nest {len(chain) + 1} models deep, past the limit of {MAX_BLS_DEPTH}: "
                              f"{' -> '.join([*chain, target])}")
    return tuple(chain)


def _shown(caller: object) -> str:
    """A refused caller as the error quotes it: its key, if any, is not echoed."""
    if type(caller) is list and len(caller) == 4 and type(caller[3]) is bytes:
        return repr([*caller[:3], f"<{len(caller[3])} bytes>"])
    return repr(caller)[:200]


def _cap_timeout(msg: protocol.Infer, deadlines: list[float | None], now: float) -> None:
    """Nobody waits for a BLS call's answer once every request of the batch that made it is past its
    deadline: the last of them is the call's client deadline at the latest (deadline_us: dropped unrun once
    it passes). A batch's execute may make one call for all its requests, so the earliest deadline would
    fail the others' call with it; a request without a deadline leaves the call's own."""
    if not deadlines or None in deadlines or type(msg.deadline_us) is not int or msg.deadline_us < 0:
        return  # (a bad deadline is refused by admission)
    left = int((max(deadlines) - now) * 1e6)
    if left <= 0:
        raise Timeout("every request of the batch that made this BLS call is past its timeout")
    msg.deadline_us = min(msg.deadline_us, left) if msg.deadline_us > 0 else left


def _bytes_buffer(name: str, where: object, count: int, frames: list, arena: Arena | None) -> memoryview:
    """A BYTES input: always a frame, checked element by element against its shape."""
    if arena is not None:
        raise InvalidArgument(f"input '{name}': BYTES tensors travel as frames, not in an arena")
    if type(where) is not int or not 0 <= where < len(frames):
        raise InvalidArgument(f"input '{name}': frame {where!r} does not exist ({len(frames)} tensor frames sent)")
    buf = frames[where]
    buf = buf.cast("B") if buf.format != "B" else buf
    if count * BYTES_PREFIX > buf.nbytes:  # the declared count against the bytes actually sent
        raise InvalidArgument(f"input '{name}': {count} BYTES elements need at least {count * BYTES_PREFIX} "
                              f"bytes, {buf.nbytes} sent")
    if dtypes.uniform_bytes(buf, count):
        return buf
    if count > MAX_BYTES_ELEMENTS:
        raise RequestTooLarge(f"input '{name}': a BYTES tensor of elements of different lengths may hold at "
                              f"most {MAX_BYTES_ELEMENTS} elements, not {count}")
    try:
        dtypes.bytes_offsets(buf, count)
    except ValueError as exc:
        raise InvalidArgument(f"input '{name}': {exc}") from None
    return buf


class NotText(InvalidArgument):
    """An onnxruntime model's string input holding an element that is not UTF-8 text (``input``: its name)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"input '{name}': an onnxruntime model's string tensor takes UTF-8 text, and an element "
                         f"of this one is not")
        self.input = name


def check_texts(plan: Admission, shapes: list[tuple[int, ...]], buffers: list) -> None:
    """``check_text`` on each of the plan's text inputs; called after ``check_batch``, so that no more is read
    than the model's slot holds."""
    for (name, *_), shape, buf in zip(plan.inputs, shapes, buffers, strict=True):
        if name in plan.text:
            check_text(name, buf, math.prod(shape))


def check_text(name: str, buf: memoryview, count: int) -> None:
    """Each element of a BYTES input UTF-8 text (checked before it joins a batch, whose other requests would fail
    with it in the worker), read TEXT_CHUNK_BYTES at a time. Elements of one length are read in one pass: their
    bytes together decode, and none starts inside a character (so no character spans two of them)."""
    if count and not _utf8_elements(buf, count):
        raise NotText(name)


def _utf8_elements(buf: memoryview, count: int) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        if dtypes.uniform_bytes(buf, count):
            stride = len(buf) // count
            if stride == 4:
                return True
            rows = np.frombuffer(buf, np.uint8).reshape(count, stride)[:, 4:]
            if ((rows[:, 0] & 0xC0) == 0x80).any():
                return False
            step = max(1, TEXT_CHUNK_BYTES // (stride - 4))
            for at in range(0, count, step):
                decoder.decode(rows[at:at + step].tobytes())
            decoder.decode(b"", final=True)
            return True
        offsets = dtypes.bytes_offsets(buf, count)  # (at most MAX_BYTES_ELEMENTS, as its buffer's check allowed)
        for i in range(count):
            for at in range(offsets[i] + 4, offsets[i + 1], TEXT_CHUNK_BYTES):
                decoder.decode(buf[at:min(at + TEXT_CHUNK_BYTES, offsets[i + 1])])
            decoder.decode(b"", final=True)  # (and resets it for the next element)
        return True
    except UnicodeDecodeError:
        return False


def _buffer(name: str, where: object, nbytes: int, frames: list, arena: Arena | None) -> memoryview | ArenaSpan:
    if type(where) is not int:
        raise InvalidArgument(f"input '{name}': location must be an integer, got {where!r}")
    if arena is not None:
        if where < 0 or where + nbytes > arena.size:
            raise InvalidArgument(f"input '{name}': arena bytes [{where}, {where + nbytes}) lie outside the "
                                  f"arena of {arena.size} bytes")
        return ArenaSpan(arena.file, where, nbytes)
    if where < 0 or where >= len(frames):
        raise InvalidArgument(f"input '{name}': frame {where} does not exist ({len(frames)} tensor frames sent)")
    buf = frames[where]
    if buf.nbytes != nbytes:
        raise InvalidArgument(f"input '{name}': {buf.nbytes} bytes sent, its shape and datatype need {nbytes}")
    return buf.cast("B") if buf.format != "B" else buf
