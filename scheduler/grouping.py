"""A group of requests in one Infer (protocol.Infer.members): its members checked, and split where it must be."""

from __future__ import annotations

import math

from gepool.common.errors import InvalidArgument
from gepool.ipc import dtypes, protocol

MAX_MEMBERS = 1024  # members in one group (a client groups what one pass of its loop sends)


def members(msg: protocol.Infer) -> list[tuple[int, int]]:
    """The group's members as (req_id, rows), each checked, or InvalidArgument naming what is wrong."""
    given = msg.members
    if type(given) is not list or not 2 <= len(given) <= MAX_MEMBERS:
        raise InvalidArgument(f"a group's members must be a list of 2 to {MAX_MEMBERS} [req_id, rows]")
    out = []
    for m in given:
        if not (type(m) is list and len(m) == 2 and type(m[0]) is int and type(m[1]) is int and m[1] > 0):
            raise InvalidArgument(f"each member of a group must be [req_id, rows > 0], got {m!r}"[:200])
        out.append((m[0], m[1]))
    return out


def runs_as_one(msg: protocol.Infer) -> bool:
    """Whether the group's own fields let it run as one request: tensors as frames, all outputs by name (a BLS
    caller is refused before; the model decides the rest: ``Model.groupable``)."""
    return (msg.arena == protocol.NO_ARENA
            and (msg.outputs is None or type(msg.outputs) is list and all(type(o) is str for o in msg.outputs)))


def runs(group: list[tuple[int, int]], max_rows: int) -> list[list[tuple[int, int]]]:
    """The members in order, cut into runs of at most ``max_rows`` rows (a member with more runs alone)."""
    out, run, rows = [], [], 0
    for m in group:
        if run and rows + m[1] > max_rows:
            out.append(run)
            run, rows = [], 0
        run.append(m)
        rows += m[1]
    out.append(run)
    return out


def split(msg: protocol.Infer, frames: list, runs: list[list[tuple[int, int]]]) -> list[tuple[protocol.Infer, list]]:
    """Each run of members as an Infer of its own with their rows of every tensor (views of the group's frames),
    for ``Core._infer``: a member alone under its own req_id, a longer run as a group under the group's;
    InvalidArgument where the group's tensors cannot be split as its members say."""
    if msg.arena != protocol.NO_ARENA or type(msg.inputs) is not list:
        raise InvalidArgument("a group's tensors must travel as frames")
    total = sum(rows for run in runs for _, rows in run)
    cuts = []  # per input: its name, datatype, dims past the batch, frame and bytes per row
    for ref in msg.inputs:
        if not (type(ref) is list and len(ref) == 4 and type(ref[0]) is str and type(ref[2]) is list
                and ref[2] and all(type(d) is int and d >= 0 for d in ref[2]) and type(ref[3]) is int):
            raise InvalidArgument(f"each input of a group must be [name, datatype, shape, frame], got {ref!r}"[:200])
        name, datatype, shape, where = ref
        if type(datatype) is not str or datatype == dtypes.BYTES or not dtypes.is_supported(datatype):
            raise InvalidArgument(f"a group's input '{name[:64]}' must have a fixed-size datatype, not "
                                  f"{str(datatype)[:32]!r}")
        if shape[0] != total:
            raise InvalidArgument(f"a group's input '{name[:64]}' has {shape[0]} rows; its members {total}")
        row_bytes = math.prod(shape[1:]) * dtypes.itemsize(datatype)
        if not 0 <= where < len(frames) or frames[where].nbytes != total * row_bytes:
            raise InvalidArgument(f"a group's input '{name[:64]}' does not match its frame")
        frame = frames[where]
        cuts.append((name, datatype, shape[1:], frame.cast("B") if frame.format != "B" else frame, row_bytes))
    out, row = [], 0
    for run in runs:
        rows = sum(n for _, n in run)
        refs, parts = [], [None]  # parts[0] stands for the header, as Core._infer takes them
        for i, (name, datatype, dims, frame, row_bytes) in enumerate(cuts):
            refs.append([name, datatype, [rows, *dims], i])
            parts.append(frame[row * row_bytes:(row + rows) * row_bytes])
        row += rows
        alone = len(run) == 1
        out.append((protocol.Infer(run[0][0] if alone else msg.req_id, msg.model, msg.version, refs, msg.outputs,
                                   msg.timeout_us, msg.priority, protocol.NO_ARENA, 0, 0, msg.deadline_us, msg.origin,
                                   msg.caller, None if alone else [list(m) for m in run]), parts))
    return out
