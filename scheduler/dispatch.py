"""Batches in and out of slots: route a batch to a worker, copy it in, answer its requests."""

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from gepool.common import errors
from gepool.common.config import BACKEND_PYTHON
from gepool.ipc import dtypes, layout, protocol
from gepool.ipc.ring import MAX_REQUESTS, TensorDesc
from gepool.scheduler.arena_io import ArenaSpan, truncated
from gepool.scheduler.arenas import Arenas
from gepool.scheduler.books import Batch, Worker
from gepool.scheduler.cache import ResponseCache, entry_frames, now_ns, private_inputs, request_key
from gepool.scheduler.classify import classify
from gepool.scheduler.models import Model
from gepool.scheduler.polling import PollPolicy
from gepool.scheduler.requests import Request
from gepool.scheduler.states import WorkerState
from gepool.scheduler.stats import CANCELED, failure_reason

READY = WorkerState.READY
# reply(identity, parts, copy): the outbox's; ``copy`` says the parts point into a slot, which they may
# keep pointing into until ``settle()`` (the same outbox's), called before that slot is released
Reply = Callable[[bytes, list, bool], None]

log = logging.getLogger("gepool.dispatch")


# A lone request at least this large whose tensors lie in its client's arena runs there (a direct
# batch): the worker reads its inputs and writes its outputs in the arena, and the front copies
# neither way. Below it the copies cost less than mapping and binding arena addresses.
DIRECT_MIN_BYTES = 64 << 10


class Dispatcher:
    def __init__(self, reply: Reply, arenas: Arenas, polling: PollPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reply, self.arenas, self.clock = reply, arenas, clock
        self.polling = polling or PollPolicy()
        self.last_batch_requests = 0  # requests in the batch dispatched last, of any model
        self.cache: ResponseCache | None = None  # the pool's response cache, when it has one
        self.settle: Callable[[], None] = _nothing  # the outbox's, where replies may hold slot views (lanes)
        self._answering = False  # in complete(): its settle() comes before the slot's release

    def schedule(self, model: Model) -> None:
        """Hands out batches while a worker can take one and the batcher says go."""
        while len(model.batcher):
            worker, idle = _pick(model)
            if worker is None:
                return
            pending = model.batcher.next_batch(idle=idle)
            if pending is None:
                return
            if not idle and model.config.backend == BACKEND_PYTHON:
                pending = self._hold_calls(model, pending)
                if not pending:
                    return
            room = worker.slot_bytes - (len(model.config.inputs) + len(model.config.outputs)) * layout.ALIGN
            most = MAX_REQUESTS if worker.info.get("per_request") else len(pending)
            used = 0
            for i, p in enumerate(pending):
                # the slot may not hold them all (variable shapes), nor its request table (a per-request worker)
                if i and (used + p.item.nbytes > room or i >= most):
                    model.batcher.push_front(pending[i:])
                    pending = pending[:i]
                    break
                used += p.item.nbytes
            self._run(model, worker, [p.item for p in pending])

    @staticmethod
    def _hold_calls(model: Model, pending: list) -> list:
        """A batch for a busy python worker, cut before its first BLS call (which goes back to the queue):
        in that worker's ring a call would wait on the batch running there, which may come to wait on the
        call itself. A call waits for a worker free to run it."""
        for i, p in enumerate(pending):
            if p.item.chain:
                model.batcher.push_front(pending[i:])
                return pending[:i]
        return pending

    def _run(self, model: Model, w: Worker, reqs: list[Request]) -> None:
        reqs = self._intact(model, reqs)
        if not reqs:
            return
        now = self.clock()
        direct = self._direct(model, w, reqs[0]) if len(reqs) == 1 else None
        model.seq += 1
        rows = sum(r.rows for r in reqs)
        batch = w.take(model.seq, reqs, rows, direct is not None, now)
        slot = w.ring.slots[batch.slot]
        copy_in = 0.0
        if direct is not None:
            arena, ins, outs = direct
            slot.fill(model.seq, reqs[0].rows, ins, now, outs, arena)
        else:
            started = time.perf_counter()
            self._copy_in(model, slot, reqs, now, w.info.get("per_request", False))
            copy_in = time.perf_counter() - started
        counts = [r.count for r in reqs]
        self.last_batch_requests = requests = sum(counts)  # a group counts its members: it is not sequential traffic
        self.polling.dispatched(now, requests, model.batcher.batch_cost)
        model.stats.dispatched(rows, [now - r.arrived for r in reqs], copy_in, [r.origin for r in reqs], counts)
        w.bell.ring(batch.slot, model.seq)  # the slot's payload and state are written: now the worker may look

    def _intact(self, model: Model, reqs: list[Request]) -> list[Request]:
        """The requests whose client arena still holds their inputs and output range; the others fail here,
        before a slot or a worker (which maps the arena for a direct batch) can touch what is gone."""
        kept = reqs
        for i, r in enumerate(reqs):
            spans = [b for b in r.inputs if type(b) is ArenaSpan]
            if not spans:
                if kept is not reqs:
                    kept.append(r)
                continue
            end = max(s.end() for s in spans)
            if r.where is not None:
                end = max(end, r.out_offset + r.out_size)
            if spans[0].file.size() < end:
                if (arena := self.arenas.get(r.arena)) is not None:
                    arena.direct = False
                if kept is reqs:
                    kept = list(reqs[:i])
                self.reply_error(model, r, errors.InvalidArgument(truncated(spans[0].file.name, end)))
            elif kept is not reqs:
                kept.append(r)
        return kept

    def _direct(self, model: Model, w: Worker, req: Request) -> tuple[str, list, list] | None:
        """(arena name, input places, output places) when ``req`` can run as a direct batch."""
        if (req.where is None or req.outputs is not None or req.cache_key is not None or req.nbytes < DIRECT_MIN_BYTES
                or not model.admission.fixed_outputs or not w.info.get("arena_io")):
            return None
        arena = self.arenas.get(req.arena)
        if arena is None or not arena.direct:
            return None
        cfg = model.config
        ins = [TensorDesc(t.datatype, req.shapes[i], req.where[i], len(req.inputs[i]), True)
               for i, t in enumerate(cfg.inputs)]
        lead = (req.rows,) if cfg.max_batch_size > 0 else ()
        shapes = [lead + t.dims for t in cfg.outputs]
        sizes = [math.prod(s) * dtypes.itemsize(t.datatype) for s, t in zip(shapes, cfg.outputs, strict=True)]
        offsets, end = layout.pack(sizes, req.out_offset)
        if end > min(req.out_offset + req.out_size, arena.size):
            return None
        outs = [TensorDesc(t.datatype, s, o, n, True)
                for t, s, o, n in zip(cfg.outputs, shapes, offsets, sizes, strict=True)]
        return arena.name, ins, outs

    def _copy_in(self, model: Model, slot, reqs: list[Request], now: float, per_request: bool = False) -> None:
        """The one copy batching needs: each request's inputs, end to end, into the slot."""
        cfg = model.config
        rows = sum(r.rows for r in reqs)
        sizes = [sum(len(r.inputs[i]) for r in reqs) for i in range(len(cfg.inputs))]
        offsets, _ = layout.pack(sizes)
        descs = []
        for i, t in enumerate(cfg.inputs):
            first = reqs[0].shapes[i]
            shape = (rows,) + first[1:] if cfg.max_batch_size > 0 else first
            pos = offsets[i]
            for r in reqs:
                buf = r.inputs[i]
                if type(buf) is ArenaSpan:
                    buf.read_into(slot.data[pos:pos + len(buf)])
                else:
                    slot.data[pos:pos + len(buf)] = buf
                pos += len(buf)
            descs.append(TensorDesc(t.datatype, shape, offsets[i], sizes[i]))
        table = [(r.rows, _output_mask(cfg, r.outputs)) for r in reqs] if per_request else ()
        slot.fill(model.seq, rows, descs, now, requests=table)

    def complete(self, model: Model, w: Worker, index: int, seq: int) -> None:
        batch = w.complete(index, seq, self.clock())
        if batch is None:
            log.error("worker %d reported slot %d seq %d, which is not in flight", w.id, index, seq)
            return
        slot = w.ring.slots[index]
        seq, outs, error, (_, t_start, t_end) = slot.result()
        copy_out = 0.0
        model.batcher.observe_cost(t_end - t_start)
        failed = slot.request_errors() if seq == batch.seq else {}  # requests the model failed one by one
        if error or seq != batch.seq:
            self.fail_batch(model, batch, errors.ModelError(
                f"model '{model.name}' failed: {error or 'slot sequence mismatch'}"), failed)
        elif batch.direct:
            req = batch.requests[0]
            refs = [[t.name, d.datatype, list(d.shape), d.offset] for t, d in zip(model.config.outputs, outs)]
            try:
                if len(outs) != len(model.config.outputs) or not all(d.in_arena for d in outs):
                    raise ValueError("the worker left a direct batch's outputs outside the arena")
                reply = protocol.Result(req.req_id, refs, True, model.version)
                self.reply(req.identity, [reply.encode()], False)
                model.stats.answered(self.clock() - req.arrived, req.origin)
            except Exception as exc:
                log.exception("internal error answering request %s", req.req_id)
                self.reply_error(model, req, errors.Internal(f"internal error: {exc}"))
        else:
            started = time.perf_counter()
            arrays = {t.name: slot.array(d) for t, d in zip(model.config.outputs, outs, strict=True)}
            row = 0
            now = self.clock()
            self._answering = True
            try:
                for k, req in enumerate(batch.requests):
                    if k in failed:
                        self.reply_error(model, req, errors.model_failure(model.name, failed[k]))
                        row += req.rows
                        continue
                    try:
                        if req.sink is None:
                            self.respond(model, req, arrays, row)
                            model.stats.answered(now - req.arrived, req.origin, req.count)
                        elif req.sink.done(model, arrays, row, t_end - t_start):
                            model.stats.answered(now - req.arrived, req.origin)
                        else:
                            model.stats.failed(CANCELED, req.origin)
                    except Exception as exc:  # one bad request must not lose the others of the batch
                        log.exception("internal error answering request %s", req.req_id)
                        self.reply_error(model, req, errors.Internal(f"internal error: {exc}"))
                    row += req.rows
            finally:
                self._answering = False
                del arrays  # views into the slot: gone before the slot is reused
                self.settle()  # and the replies' views of it
            copy_out = time.perf_counter() - started
        slot.release()
        model.stats.computed(batch.rows, t_end - t_start, copy_out)
        self.polling.answered(self.clock(), sum(r.count for r in batch.requests), t_end - t_start,
                              not any(x.inflight for x in model.workers))

    def respond(self, model: Model, req: Request, arrays: dict[str, np.ndarray], row: int) -> None:
        """Answers ``req`` with its rows of ``arrays`` (its model's outputs), as frames or in its arena."""
        plan = model.admission
        names = plan.out_order if req.outputs is None else [n for n in plan.out_order if n in req.outputs]
        if plan.batched:
            end = row + req.rows
            pieces = [arrays[n][row:end] for n in names]
        else:
            pieces = [arrays[n] for n in names]
        if req.classify is not None:
            pieces = classify(model.config, names, pieces, req.classify)
        if req.cache_key is not None:
            self._keep(model, req, names, pieces)
        has_bytes = any(p.dtype.kind == "O" for p in pieces)
        arena = self.arenas.get(req.arena) if req.out_size > 0 and not has_bytes else None
        if arena is not None:
            offsets, _ = layout.pack([p.nbytes for p in pieces], req.out_offset)
            end = offsets[-1] + pieces[-1].nbytes if pieces else req.out_offset
            if 0 <= req.out_offset and end <= min(req.out_offset + req.out_size, arena.size) and all(
                    arena.file.write(off, p) for p, off in zip(pieces, offsets, strict=True)):
                refs = [[n, dtypes.from_numpy(p.dtype), list(p.shape), off]
                        for n, p, off in zip(names, pieces, offsets, strict=True)]
                reply = protocol.Result(req.req_id, refs, True, model.version)
                self.reply(req.identity, [reply.encode()], False)
                return
        refs = [[n, dtypes.from_numpy(p.dtype), list(p.shape), i] for i, (n, p) in enumerate(zip(names, pieces))]
        if has_bytes:
            pieces = [dtypes.serialize_bytes(p) if p.dtype.kind == "O" else p for p in pieces]
        # the pieces may be views of a slot that is reused as soon as its batch is answered
        self.reply(req.identity, [protocol.Result(req.req_id, refs, False, model.version, req.members).encode(),
                                  *pieces], True)
        if not self._answering:
            self.settle()

    def answer_cached(self, model: Model, req: Request) -> bool:
        """A request to a model whose responses are cached: answered here from the cache (True), or
        marked so that its response is kept when it is answered."""
        started = now_ns()
        private_inputs(req)
        key = request_key(model, req)
        entry = self.cache.get(key)
        if entry is None:
            req.cache_key = key
            model.stats.cache_missed(now_ns() - started, lookup=True)
            return False
        # the entry's frames are immutable bytes: sent without a copy
        self.reply(req.identity, [protocol.Result(req.req_id, entry.refs, False, entry.version).encode(),
                                  *entry.frames], False)
        model.stats.cache_hit(now_ns() - started)
        model.stats.answered(self.clock() - req.arrived, req.origin)
        return True

    def _keep(self, model: Model, req: Request, names: list[str], pieces: list[np.ndarray]) -> None:
        """A cache miss answered: its response goes into the cache (the miss's time includes this)."""
        started = now_ns()
        refs, frames = entry_frames(names, pieces)
        self.cache.put(req.cache_key, refs, frames, model.version)
        model.stats.cache_missed(now_ns() - started)

    def recover(self, model: Model, batch: Batch, err: errors.GepoolError, can_retry: bool) -> None:
        """A batch whose worker died: each request runs once more on another worker, or hears ``err``."""
        again = []
        for req in batch.requests:
            if batch.direct and (arena := self.arenas.get(req.arena)) is not None:
                arena.direct = False  # its client may have truncated it under the worker: never again
            if can_retry and not req.retried:
                req.retried = True
                again.append((req, req.rows, req.key, req.arrived, req.nbytes, req.priority, req.expires))
            else:
                self.reply_error(model, req, err)
        model.batcher.retry(again)

    def fail_batch(self, model: Model, batch: Batch, err: errors.GepoolError,
                   failed: dict[int, str] | None = None) -> None:
        """Every request hears ``err``, or the message the model gave for it alone (``failed``)."""
        for k, req in enumerate(batch.requests):
            if failed and k in failed:
                self.reply_error(model, req, errors.model_failure(model.name, failed[k]))
            else:
                self.reply_error(model, req, err)

    def fail_queued(self, model: Model, err: errors.GepoolError) -> None:
        for p in model.batcher.take_all():
            self.reply_error(model, p.item, err)

    def reply_error(self, model: Model, req: Request, err: errors.GepoolError, client_gone: bool = False) -> None:
        """``client_gone``: its client's deadline passed before it ran (Triton's CANCELED, and a client timeout)."""
        if client_gone:
            model.stats.client_timed_out(req.origin, req.count)
        else:
            model.stats.failed(failure_reason(err), req.origin, req.count)
        if req.sink is not None:
            req.sink.failed(model, err)
            return
        send_error(self.reply, req, err)


def send_error(reply: Reply, req: Request, err: errors.GepoolError) -> None:
    """``err`` to the client of ``req``, as its answer: every error reply to a request is this one (a group's
    goes to each of its members)."""
    if req.members is None:
        reply(req.identity, [protocol.Error(req.req_id, err.code, err.message).encode()], False)
        return
    for req_id, _ in req.members:
        reply(req.identity, [protocol.Error(req_id, err.code, err.message).encode()], False)


def _nothing() -> None:
    pass


def _output_mask(config, outputs: set[str] | None) -> int:
    """Bit i set: the request asked for config output i (all of them when it named none)."""
    return sum(1 << i for i, t in enumerate(config.outputs) if outputs is None or t.name in outputs)


def _pick(model: Model) -> tuple[Worker | None, bool]:
    """The least loaded worker (rows outstanding) with a free slot; idle workers first."""
    ready = [w for w in model.workers if w.state == READY and w.free]
    if not ready:
        return None, False
    idle = [w for w in ready if len(w.inflight) < w.concurrency]
    if idle:
        return min(idle, key=lambda w: w.rows), True
    return min(ready, key=lambda w: w.rows), False
