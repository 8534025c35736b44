"""Admission: a request is checked completely before it may enter a queue."""

import math
from dataclasses import dataclass, field

from gepool.config import ModelConfig
from gepool.errors import InvalidArgument, RequestTooLarge
from gepool.ipc import dtypes, layout, protocol
from gepool.scheduler.arenas import Arena, Arenas


@dataclass(slots=True, eq=False)
class Request:
    """One admitted request. ``inputs`` holds, in config order, a buffer of each tensor's bytes: a
    view of a received ZMQ frame (kept alive by this object) or of the client's arena."""

    identity: bytes
    req_id: int
    model: str
    shapes: list[tuple[int, ...]]
    inputs: list[memoryview]
    rows: int
    nbytes: int  # inputs plus the fixed-size outputs this request needs in a slot
    outputs: set[str] | None
    arena: int
    out_offset: int
    out_size: int
    arrived: float
    key: tuple | None = field(default=None)
    retried: bool = False  # a request runs at most twice: once more if its worker dies under it


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(msg: protocol.Infer) -> None:
    """Every header field has the type and range the protocol gives it, before anything uses it."""
    for name in ("req_id", "version", "timeout_us", "priority", "arena", "out_offset", "out_size"):
        if not _is_int(getattr(msg, name)):
            raise InvalidArgument(f"{name} must be an integer, got {getattr(msg, name)!r}")
    for name in ("timeout_us", "priority", "out_offset", "out_size"):
        if getattr(msg, name) < 0:
            raise InvalidArgument(f"{name} must be >= 0, got {getattr(msg, name)}")
    if not isinstance(msg.inputs, list):
        raise InvalidArgument("inputs must be a list")
    if msg.outputs is not None and not (isinstance(msg.outputs, list) and all(isinstance(o, str) for o in msg.outputs)):
        raise InvalidArgument("outputs must be null or a list of names")


def _shape_of(name: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidArgument(f"input '{name}': shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input '{name}': shape {shape} has a negative dimension")
    return tuple(shape)


def admit(msg: protocol.Infer, identity: bytes, frames: list, config: ModelConfig, slot_bytes: int,
          arenas: Arenas, now: float) -> Request:
    """Checks one Infer against the model's config; raises a GepoolError naming what is wrong."""
    _check_fields(msg)
    given: dict[str, list] = {}
    for ref in msg.inputs:
        if not (isinstance(ref, list) and len(ref) == 4 and isinstance(ref[0], str)):
            raise InvalidArgument(f"each input must be [name, datatype, shape, where], got {ref!r}")
        if ref[0] in given:
            raise InvalidArgument(f"input '{ref[0]}' is given twice")
        given[ref[0]] = ref
    expected = {t.name for t in config.inputs}
    unknown = sorted(set(given) - expected)
    if unknown:
        raise InvalidArgument(f"unknown input {unknown} for model '{config.name}' (it takes {sorted(expected)})")
    missing = sorted(expected - set(given))
    if missing:
        raise InvalidArgument(f"missing input {missing} for model '{config.name}'")
    arena = None
    if msg.arena != protocol.NO_ARENA:
        arena = arenas.get(msg.arena)
        if arena is None:
            raise InvalidArgument(f"arena {msg.arena} is not registered")
    batched = config.max_batch_size > 0
    shapes, buffers, rows_seen = [], [], set()
    for t in config.inputs:
        _, datatype, shape, where = given[t.name]
        if datatype != t.datatype:
            raise InvalidArgument(f"input '{t.name}': datatype {datatype} does not match the model's {t.datatype}")
        shape = _shape_of(t.name, shape)
        dims = shape[1:] if batched else shape
        if len(dims) != len(t.dims) or any(c != -1 and c != d for c, d in zip(t.dims, dims, strict=True)):
            want = (["-1"] if batched else []) + [str(d) for d in t.dims]
            raise InvalidArgument(f"input '{t.name}': shape {list(shape)} does not match the model's "
                                  f"[{', '.join(want)}]")
        if batched:
            rows_seen.add(shape[0])
        if datatype == dtypes.BYTES:
            buffers.append(_bytes_buffer(t.name, where, math.prod(shape), frames, arena))
        else:
            nbytes = math.prod(shape) * dtypes.itemsize(datatype)
            buffers.append(_buffer(t.name, where, nbytes, frames, arena))
        shapes.append(shape)
    rows = 1
    if batched:
        if len(rows_seen) != 1:
            raise InvalidArgument(f"inputs disagree on the batch dimension: {sorted(rows_seen)}")
        rows = rows_seen.pop()
        if rows < 1 or rows > config.max_batch_size:
            raise InvalidArgument(f"batch size {rows} is outside 1..max_batch_size ({config.max_batch_size}) "
                                  f"of model '{config.name}'")
    if msg.outputs is not None:
        names = {t.name for t in config.outputs}
        if not isinstance(msg.outputs, list) or not all(isinstance(o, str) for o in msg.outputs):
            raise InvalidArgument("outputs must be a list of names")
        bad = sorted(set(msg.outputs) - names)
        if bad:
            raise InvalidArgument(f"unknown output {bad} for model '{config.name}' (it has {sorted(names)})")
    out_bytes = sum((t.row_bytes() or 0) * rows for t in config.outputs)
    total = sum(len(b) for b in buffers) + out_bytes
    slack = (len(config.inputs) + len(config.outputs)) * layout.ALIGN
    if total + slack > slot_bytes:
        raise RequestTooLarge(f"the request needs {total + slack} bytes in a slot; a slot of model "
                              f"'{config.name}' holds {slot_bytes} (raise its 'slot_bytes' parameter)")
    key = None if all(t.fixed for t in config.inputs) else tuple(s[1:] if batched else s for s in shapes)
    return Request(identity, msg.req_id, config.name, shapes, buffers, rows, total,
                   set(msg.outputs) if msg.outputs is not None else None,
                   msg.arena, msg.out_offset, msg.out_size, now, key)


def _bytes_buffer(name: str, where: object, count: int, frames: list, arena: Arena | None) -> memoryview:
    """A BYTES input: always a frame, checked element by element against its shape."""
    if arena is not None:
        raise InvalidArgument(f"input '{name}': BYTES tensors travel as frames, not in an arena")
    if not isinstance(where, int) or isinstance(where, bool) or not 0 <= where < len(frames):
        raise InvalidArgument(f"input '{name}': frame {where!r} does not exist ({len(frames)} tensor frames sent)")
    buf = frames[where].buffer
    buf = buf.cast("B") if buf.format != "B" else buf
    try:
        dtypes.bytes_offsets(buf, count)
    except ValueError as exc:
        raise InvalidArgument(f"input '{name}': {exc}") from None
    return buf


def _buffer(name: str, where: object, nbytes: int, frames: list, arena: Arena | None) -> memoryview:
    if not isinstance(where, int) or isinstance(where, bool):
        raise InvalidArgument(f"input '{name}': location must be an integer, got {where!r}")
    if arena is not None:
        if where < 0 or where + nbytes > len(arena.view):
            raise InvalidArgument(f"input '{name}': arena bytes [{where}, {where + nbytes}) lie outside the "
                                  f"arena of {len(arena.view)} bytes")
        return arena.view[where:where + nbytes]
    if where < 0 or where >= len(frames):
        raise InvalidArgument(f"input '{name}': frame {where} does not exist ({len(frames)} tensor frames sent)")
    buf = frames[where].buffer
    if buf.nbytes != nbytes:
        raise InvalidArgument(f"input '{name}': {buf.nbytes} bytes sent, its shape and datatype need {nbytes}")
    return buf.cast("B") if buf.format != "B" else buf
