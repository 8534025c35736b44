"""Requests one pass of an AsyncClient's loop submits, alike but for their rows, sent as one Infer (its
``members``), and that group's answer split among them. The front runs a group as one request where its
model cannot tell the difference (scheduler/grouping.py), else each member on its own."""

from __future__ import annotations

import numpy as np

from gepool import _wire
from gepool.common import errors
from gepool.ipc import protocol

MEMBER_MAX_BYTES = 16 << 10  # a request whose inputs hold more goes on its own
GROUP_MAX_BYTES = 48 << 10  # a group's tensors: with its header it stays one lane record (ipc/lane.RECORD_MAX)
MAX_MEMBERS = 256  # per group (the front takes up to scheduler/grouping.MAX_MEMBERS)
MAX_INPUTS = 64  # a request with more inputs goes on its own (a lane message has at most lane.MAX_PARTS parts)
_INFER = int(protocol.MsgType.INFER)


class Member:
    __slots__ = ("req_id", "inputs", "rows", "size")

    def __init__(self, req_id: int, inputs: dict, rows: int, size: int) -> None:
        self.req_id, self.inputs, self.rows, self.size = req_id, inputs, rows, size


def key_of(model: str, inputs: dict, outputs: list | None, version: int | None, timeout: float | None,
           priority: int, origin: int, wait: float | None) -> tuple[tuple, int, int] | None:
    """(what a request must share with the others of its group, its rows, its input bytes), or None where it
    goes on its own: inputs are arrays of fixed-size types with one row count and at most MEMBER_MAX_BYTES in
    all, and outputs are asked for by name."""
    if outputs is not None and not (type(outputs) is list and all(type(o) is str for o in outputs)):
        return None
    if type(inputs) is not dict or not inputs or len(inputs) > MAX_INPUTS or type(model) is not str:
        return None
    spec, rows, size = [], -1, 0
    for name, arr in inputs.items():
        if type(arr) is not np.ndarray or type(name) is not str or not arr.ndim:
            return None
        datatype = _wire._DATATYPE.get(arr.dtype)
        if datatype is None or (rows >= 0 and arr.shape[0] != rows):
            return None
        rows = arr.shape[0]
        size += arr.nbytes
        spec.append((name, datatype, arr.shape[1:]))
    if rows < 1 or size > MEMBER_MAX_BYTES:
        return None
    return (model, version, None if outputs is None else tuple(outputs), timeout, priority, int(origin), wait,
            tuple(spec)), rows, size


def chunks(members: list[Member]) -> list[list[Member]]:
    """The members in order, cut into groups of at most MAX_MEMBERS and GROUP_MAX_BYTES."""
    out, run, size = [], [], 0
    for m in members:
        if run and (len(run) == MAX_MEMBERS or size + m.size > GROUP_MAX_BYTES):
            out.append(run)
            run, size = [], 0
        run.append(m)
        size += m.size
    out.append(run)
    return out


def encode(key: tuple, members: list[Member], group_id: int) -> list:
    """The group's Infer: each input the members' rows stacked, in their order."""
    model, version, outputs, timeout, priority, origin, wait, spec = key
    refs, frames = [], [b""]
    for i, (name, datatype, dims) in enumerate(spec):
        stacked = np.concatenate([m.inputs[name] for m in members])
        refs.append([name, datatype, [stacked.shape[0], *dims], i])
        frames.append(stacked.tobytes() if stacked.nbytes <= _wire.FRAME_COPY_MAX else stacked)
    frames[0] = _wire._pack([_INFER, group_id, model, _wire._version(version), refs,
                             None if outputs is None else list(outputs), _wire._timeout_us(timeout), priority,
                             protocol.NO_ARENA, 0, 0, _wire._timeout_us(wait), origin, None,
                             [[m.req_id, m.rows] for m in members]])
    return frames


def answer(msg: protocol.Result, frames: list, inflight: dict) -> None:
    """A group's answer (``msg.members``: the members it covers, in order): each member still waiting in
    ``inflight`` gets its rows of every output."""
    members = msg.members
    try:
        if not (type(members) is list and all(type(m) is list and len(m) == 2 for m in members)):
            raise errors.Internal("a group's answer names its members wrongly")
        outputs = _wire.result(msg, frames, None)
        total = sum(rows for _, rows in members)
        if any(np.ndim(a) == 0 or len(a) != total for a in outputs.values()):
            raise errors.Internal(f"a group's outputs do not hold its {total} rows")
    except Exception as exc:  # an answer that does not decode: each member it names hears it
        text = exc.message if isinstance(exc, errors.GepoolError) else f"a group's answer does not decode: {exc}"
        for m in members if type(members) is list else ():
            entry = inflight.pop(m[0], None) if type(m) is list and m and type(m[0]) is int else None
            if entry is not None and not entry[1].done():
                entry[1].set_exception(errors.Internal(text))
        return
    row = 0
    for req_id, rows in members:
        entry = inflight.pop(req_id, None)
        if entry is not None and not entry[1].done():
            part = _wire.Outputs({name: a[row:row + rows] for name, a in outputs.items()})
            part.model_version = outputs.model_version
            entry[1].set_outputs(part)
        row += rows
