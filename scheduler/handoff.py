"""An ensemble step's outputs handed from its slot into the next step's slot, or copied out to wait.

When a step's batch completes, each of its outputs that a later step reads starts as a view of the
step's slot: valid only until the completion that carries it has been handled, since the slot is then
released and refilled. Before that happens, each step request that reads a view is either already in
its own model's slot (its batch went out in the same completion: the batch's copy was the only one)
and is rebound to its copy there, or it waits in a queue and is rebound to a copy the run owns; a view
still needed by a step that has not started, or by the ensemble's answer, is copied out likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gepool.ipc import layout
from gepool.scheduler import books

if TYPE_CHECKING:
    from gepool.scheduler.arena_io import ArenaSpan
    from gepool.scheduler.models import Model
    from gepool.scheduler.requests import Request

EMPTY = memoryview(b"")


@dataclass(slots=True)
class Tensor:
    datatype: str
    shape: tuple[int, ...]
    buf: memoryview | ArenaSpan  # its bytes as a step's input (BYTES: serialized); keeps its owner alive. An
    # ensemble request's input in its client's arena is a span, never a view (``own``/``drop`` leave it be)
    array: np.ndarray | None = None  # a step's output
    view: bool = False  # buf and array are views of the slot of the step that produced it


@dataclass(slots=True)
class Copies:
    """Where the bytes of ensemble steps' outputs went, counted in the front (a test reads them)."""

    out_bytes: int = 0  # copied out of a step's slot into buffers a run owns (the second copy of a hop)
    handed_bytes: int = 0  # read by the next step's batch straight from the producing slot (its one copy)
    answered_bytes: int = 0  # answered to the client straight from the last step's slot


@dataclass(slots=True)
class Link:
    """A step request submitted in a completion: its input ``k`` (config order) reads ``tensor``."""

    req: Request
    model: Model
    inputs: list[tuple[int, Tensor]]


def own(t: Tensor, copies: Copies) -> None:
    """A view of a slot becomes the run's own copy (the run may keep it past the completion)."""
    if t.view:
        t.array = np.array(t.array, copy=True, order="C")
        t.buf = memoryview(t.array).cast("B")
        t.view = False
        copies.out_bytes += t.array.nbytes


def drop(t: Tensor) -> None:
    """A view nobody reads any more: let the slot go."""
    if t.view:
        t.buf, t.array, t.view = EMPTY, None, False


class Placements:
    """Where the requests of the batches in flight for some models sit: looked up once per model and per
    batch for one hand-over (nothing is dispatched or completed while it runs), not per request."""

    def __init__(self) -> None:
        self._of: dict[int, tuple] = {}  # id(request) -> (slot, batch, place in it), of the models looked at
        self._models: set[int] = set()
        self._starts: dict[tuple[int, int], list[int]] = {}  # (id(batch), input) -> each request's offset

    def of(self, model: Model, req: Request):
        """(slot, batch, place in it) of the batch ``req`` was dispatched in, or None while it is queued."""
        if id(model) not in self._models:
            self._models.add(id(model))
            for rid, (w, index, batch, k) in books.placements(model).items():
                if w.ring is not None:  # else gone: its batches are being failed or retried, not in a slot
                    self._of[rid] = (w.ring.slots[index], batch, k)
        return self._of.get(id(req))

    def start(self, batch, i: int, k: int) -> int:
        """Where request ``k``'s input ``i`` starts in its batch's slot: the layout the batch was copied in
        with (each input's requests end to end), worked out from the requests, not read from the slot's
        table, which its worker can write."""
        starts = self._starts.get((id(batch), i))
        if starts is None:
            reqs = batch.requests
            offsets, _ = layout.pack([sum(len(r.inputs[j]) for r in reqs) for j in range(len(reqs[0].inputs))])
            pos, starts = offsets[i], []
            for r in batch.requests:
                starts.append(pos)
                pos += len(r.inputs[i])
            self._starts[(id(batch), i)] = starts
        return starts[k]


def rebind_to_slot(link: Link, placed, places: Placements, copies: Copies) -> None:
    """A dispatched step request's view inputs become views of its own slot, where the batch copied them:
    a retry (its worker died) copies them from there, and that mapping outlives the worker's ring while
    these views live; the slot is not refilled while the batch is in flight."""
    slot, batch, k = placed
    for i, _t in link.inputs:
        pos = places.start(batch, i, k)
        n = len(link.req.inputs[i])
        link.req.inputs[i] = slot.data[pos:pos + n]
        copies.handed_bytes += n


def rebind_to_own(link: Link, copies: Copies) -> None:
    """A queued step request's view inputs become the run's own copies."""
    for i, t in link.inputs:
        own(t, copies)
        link.req.inputs[i] = t.buf
