"""Running one FILLED slot through a synchronous backend: inputs as views, outputs placed and checked."""

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from gepool.common.config import ModelConfig
from gepool.ipc import dtypes, layout
from gepool.ipc.ring import RUNNING, Slot, TensorDesc
from gepool.workers.arena_maps import ArenaMaps
from gepool.workers.backends.base import RequestSpan, SyncBackend

log = logging.getLogger("gepool.worker")


@dataclass(slots=True)
class _Plan:
    """A slot's batch layout worked out once: the arrays over the slot and where the outputs go."""

    n_in: int
    batch: int
    inputs: dict
    planned: dict
    views: dict
    descs: list


MAX_PLANS = 64  # (slot, layout) pairs; a model with variable dims may see many


def execute_slot(slot: Slot, backend: SyncBackend, config: ModelConfig, arenas: ArenaMaps | None = None,
                 plans: dict | None = None) -> None:
    """RUNNING, then DONE with outputs in the slot (or, for a direct batch, in the client's arena at
    the places the front gave), or FAILED with the reason; never raises.

    ``plans`` caches, per slot and layout, the arrays and output places of batches whose outputs the
    backend wrote in place: a slot mostly sees the same few batch shapes, and working the layout out
    again (tables, arrays, planning, checks) was most of a small batch's time in the worker."""
    t0 = time.monotonic()
    slot.set_state(RUNNING)
    try:
        key = (slot.index, slot.batch_key()) if plans is not None else None
        plan = plans.get(key) if key is not None else None
        if plan is not None:
            results = _run(backend, slot, config, plan.batch, plan.inputs, plan.views)
            descs = plan.descs
            if results is not plan.views and not all(results.get(n) is v for n, v in plan.views.items()):
                del plans[key]  # not written in place this time: checked and copied like any batch
                descs = _place_outputs(slot, config, plan.batch, plan.planned, plan.views, results)
            slot.finish(plan.n_in, descs, t0, time.monotonic())
            return
        _, batch, in_descs = slot.read()
        arena_name, out_descs = slot.direct()
        arena = None
        if arena_name:
            if arenas is None or len(out_descs) != len(config.outputs):
                raise ValueError(f"a direct batch this worker cannot run (arena {arena_name})")
            arena = arenas.buffer(arena_name)
        inputs = {t.name: slot.array(d, arena) for t, d in zip(config.inputs, in_descs, strict=True)}
        if arena is not None:
            planned = {t.name: d for t, d in zip(config.outputs, out_descs, strict=True)}
        else:
            start = max(d.offset + d.nbytes for d in in_descs)
            planned = plan_outputs(config, batch, start, slot.data_bytes)
        views = {name: (slot.array(d, arena) if d else None) for name, d in planned.items()}
        results = _run(backend, slot, config, batch, inputs, views)
        descs = _place_outputs(slot, config, batch, planned, views, results)
        if key is not None and arena is None and all(results.get(n) is v for n, v in views.items()):
            if len(plans) >= MAX_PLANS:
                plans.clear()
            plans[key] = _Plan(len(in_descs), batch, inputs, planned, views, descs)
        del inputs, views, results, arena  # views of the arena: gone before the arena may be dropped
        slot.finish(len(in_descs), descs, t0, time.monotonic())
    except Exception as exc:  # any model fault fails this batch only
        log.warning("batch failed: %s: %s", type(exc).__name__, exc)
        slot.fail(f"{type(exc).__name__}: {exc}", t0, time.monotonic())


def _run(backend: SyncBackend, slot: Slot, config: ModelConfig, batch: int, inputs: dict,
         views: dict) -> dict[str, np.ndarray]:
    """One batch through the backend; a per-request backend gets the slot's request table, and the
    requests it fails are marked in the slot (published by the DONE or FAILED that follows)."""
    if not type(backend).per_request:
        return backend.execute(inputs, views)
    table = described = slot.requests()
    if not table:
        table = [(batch, (1 << len(config.outputs)) - 1)]  # a batch the front did not describe: one request
    if sum(rows for rows, _ in table) != batch:
        raise ValueError(f"the slot's request table covers {sum(r for r, _ in table)} rows of a batch of {batch}")
    spans, start = [], 0
    for rows, mask in table:
        spans.append(RequestSpan(start, rows, tuple(t.name for i, t in enumerate(config.outputs) if mask >> i & 1)))
        start += rows
    results, failed = backend.execute_requests(inputs, views, spans)
    if failed and described:
        slot.fail_requests(failed)
    if len(failed) == len(spans):  # nothing to answer with outputs: the batch fails, each with its message
        raise RuntimeError(failed[0] if len(failed) == 1 else f"all {len(failed)} requests of the batch failed")
    return results


def _out_shape(config: ModelConfig, batch: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    return ((batch,) if config.max_batch_size > 0 else ()) + dims


def plan_outputs(config: ModelConfig, batch: int, start: int, capacity: int) -> dict[str, TensorDesc | None]:
    """Slot places for outputs whose shape is known before running; None for the rest."""
    fixed = [t for t in config.outputs if t.fixed]
    shapes = [_out_shape(config, batch, t.dims) for t in fixed]
    sizes = [math.prod(s) * dtypes.itemsize(t.datatype) for t, s in zip(fixed, shapes)]
    offsets, end = layout.pack(sizes, start)
    planned: dict[str, TensorDesc | None] = {t.name: None for t in config.outputs}
    if end <= capacity:
        for t, shape, off, size in zip(fixed, shapes, offsets, sizes, strict=True):
            planned[t.name] = TensorDesc(t.datatype, shape, off, size)
    return planned


def _np(datatype: str) -> np.dtype:
    return dtypes.to_numpy(datatype)


def _place_outputs(slot: Slot, config: ModelConfig, batch: int, planned: dict[str, TensorDesc | None],
                   views: dict[str, np.ndarray | None], results: dict[str, np.ndarray]) -> list[TensorDesc]:
    """Checks each output against the config and copies those not already written in place."""
    pos = max([d.offset + d.nbytes for d in planned.values() if d] or [0])
    descs = []
    for t in config.outputs:
        if t.name not in results:
            raise ValueError(f"the model returned no output '{t.name}' (it returned {sorted(results)})")
        arr = results[t.name]
        is_bytes = t.datatype == dtypes.BYTES
        if (arr.dtype.kind not in "OSU") if is_bytes else (arr.dtype != _np(t.datatype)):
            raise TypeError(f"output '{t.name}' is {arr.dtype}, config.pbtxt says TYPE_{t.datatype}")
        expect = _out_shape(config, batch, t.dims)
        if len(arr.shape) != len(expect) or any(e not in (-1, a) for e, a in zip(expect, arr.shape, strict=True)):
            raise ValueError(f"output '{t.name}' has shape {list(arr.shape)}, expected {list(expect)}")
        view = views[t.name]
        if view is not None and arr is view:
            descs.append(planned[t.name])
            continue
        if view is not None and arr.shape == view.shape:
            np.copyto(view, arr)
            descs.append(planned[t.name])
            continue
        if view is not None and planned[t.name].in_arena:
            raise ValueError(f"output '{t.name}' has shape {list(arr.shape)}, the front planned "
                             f"{list(view.shape)} in the client's arena")
        off = layout.align(pos)
        data = dtypes.serialize_bytes(arr) if is_bytes else None
        nbytes = len(data) if is_bytes else arr.nbytes
        if off + nbytes > slot.data_bytes:
            raise ValueError(f"output '{t.name}' ({nbytes} bytes) does not fit in the slot "
                             f"({slot.data_bytes} bytes); raise the model's 'slot_bytes' parameter")
        desc = TensorDesc(t.datatype, tuple(arr.shape), off, nbytes)
        if is_bytes:
            slot.data[off:off + nbytes] = data
        else:
            np.copyto(slot.array(desc), arr)
        pos = off + nbytes
        descs.append(desc)
    return descs
