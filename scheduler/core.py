"""The front's core: models, admission, dispatch, recovery and the worker books, driven by events."""

import logging
import os
import time
from collections.abc import Callable, Iterable

from gepool.common import errors
from gepool.ipc import naming, protocol
from gepool.scheduler import grouping
from gepool.scheduler.arenas import Arenas
from gepool.scheduler.books import Worker, Workers
from gepool.scheduler.cache import ResponseCache
from gepool.scheduler.calls import Calls
from gepool.scheduler.control import ModelControl
from gepool.scheduler.dispatch import Dispatcher
from gepool.scheduler.ensemble import Ensembles
from gepool.scheduler.lograte import Limited
from gepool.scheduler.models import Model
from gepool.scheduler.options import FrontOptions
from gepool.scheduler.outbox import Outbox
from gepool.scheduler.polling import PollPolicy
from gepool.scheduler.recovery import Recovery
from gepool.scheduler.regions import RegionBook
from gepool.scheduler.requests import admit, bls_chain, check_header, origin_of
from gepool.scheduler.states import ModelState, WorkerState
from gepool.scheduler.stats import failure_reason
from gepool.scheduler.status import Peers, answer_query, pool_status

log = logging.getLogger("gepool.front")
limited = Limited(log)  # what a client's bytes make the front say: bounded per client

SERVER_NAME = "gepool"
MAX_HEADER_BYTES = 256 << 10  # a message's msgpack header (names, shapes, fields): far more than any request needs
MESSAGE_HEADROOM = 1 << 20  # what a request may carry beside its tensors: its header, and room to spare
READY = WorkerState.READY


class Core:
    """Does no I/O of its own. The loop hands it events (a client's message, a worker's message, the
    completions a doorbell carried, a worker's exit, a tick) and it acts through its outbox (reply,
    spawn, stop, kill), ringing a worker's doorbell to hand over a batch; time comes from its clock."""

    def __init__(self, opts: FrontOptions, out: Outbox, clock: Callable[[], float] = time.monotonic) -> None:
        self.opts, self.out, self.clock = opts, out, clock
        self.workers = Workers()
        self.control = ModelControl(opts, self.workers, out, clock)
        self.arenas = Arenas(self._drop_arena, naming.segment_name(opts.owner_id, ""))
        self.regions = RegionBook(opts.sidecar_token, opts.regions_fd)
        self.control.changed = self._models_changed
        self.polling = PollPolicy(opts.busy_poll_us)
        self.dispatch = Dispatcher(out.reply, self.arenas, self.polling, clock)
        if opts.cache_size > 0:
            self.dispatch.cache = ResponseCache(opts.cache_size)
        self.recovery = Recovery(self.workers, self.dispatch, out, opts.model_load_timeout_s)
        self.calls = Calls(self.workers, self.dispatch.respond, out.reply, self.dispatch.reply_error)
        self.peers = Peers()  # the loop fills in what its channels know (lanes, their pids)
        self.stopping = False
        self.drain_deadline: float | None = None
        self.grace_until: float | None = None
        self.wake_at: float | None = None  # the nearest timer outside the models' queues
        self._announced = False
        self.dirty: set[Model] = set()  # models a request or a completion touched since the last schedule
        self.queued: set[Model] = set()  # models left with queued requests after their last scheduling
        self._refused: set[str] = set()  # models whose last prewoken request failed admission
        self.ensembles = Ensembles(self.control, self.arenas, self.dispatch.respond, out.reply, self._enqueue, clock,
                                   self._prepare_worker, self.dispatch.schedule, self.calls, self._may_prewake)
        self.logging = opts.log_settings()

    def start(self) -> None:
        self.control.start()
        self.ensembles.refresh()

    # -- events: clients -------------------------------------------------------------------
    def on_message(self, identity: bytes, parts: list) -> None:
        """A client's message, whichever channel carried it: the payload, then its tensor parts."""
        if not parts:
            return
        if parts[0].nbytes > MAX_HEADER_BYTES:  # before msgpack makes an object of every byte of it
            self.out.reply(identity, [protocol.Error(0, errors.RequestTooLarge.code, f"a message header of "
                                                     f"{parts[0].nbytes} bytes is larger than the "
                                                     f"{MAX_HEADER_BYTES} this pool accepts").encode()])
            return
        try:
            msg = protocol.decode(parts[0])
        except protocol.ProtocolError as exc:
            limited.log(logging.WARNING, "bad", identity, "dropping a bad message: %s", exc)
            self.out.reply(identity, [protocol.Error(0, errors.ProtocolMismatch.code, str(exc)).encode()])
            return
        req_id = getattr(msg, "req_id", 0)
        try:
            if type(msg) is protocol.Infer:  # the hot path: an admitted request is answered later
                prepared = False
                if self.polling.enabled and self.dispatch.last_batch_requests <= 1:  # sequential traffic
                    self.polling.arrived(self.clock())
                    prepared = not self.workers.busy() and self._prepare_worker(msg.model)
                try:
                    return self._infer(identity, msg, parts)
                except errors.GepoolError:
                    if prepared:  # no batch follows: stop waking this worker for nothing until one is admitted
                        self._refused.add(msg.model)
                    raise
            reply = self._handle(identity, msg)
        except errors.GepoolError as exc:
            reply = protocol.Error(req_id, exc.code, exc.message)
        except Exception as exc:  # a bug must not take the pool down; the client hears INTERNAL
            log.exception("internal error handling %s", type(msg).__name__)
            reply = protocol.Error(req_id if isinstance(req_id, int) else 0, "INTERNAL", f"internal error: {exc}")
        if reply is not None:
            try:
                encoded = reply.encode()
            except Exception as exc:  # (a string msgpack cannot encode): the client hears INTERNAL, the loop goes on
                log.exception("internal error encoding the reply to %s", type(msg).__name__)
                encoded = protocol.Error(req_id if isinstance(req_id, int) else 0, "INTERNAL",
                                         f"internal error: the reply could not be encoded ({type(exc).__name__})"
                                         ).encode()
            self.out.reply(identity, [encoded])

    def _handle(self, identity: bytes, msg):
        if isinstance(msg, protocol.Hello):
            if msg.version != protocol.PROTOCOL_VERSION:
                raise errors.ProtocolMismatch(f"client speaks protocol {msg.version}, "
                                              f"this pool {protocol.PROTOCOL_VERSION}")
            return protocol.Welcome(msg.req_id, protocol.PROTOCOL_VERSION, self.opts.owner_id, SERVER_NAME)
        if isinstance(msg, protocol.Query):
            if msg.what in ("load", "unload"):
                name = msg.args.get("model") if isinstance(msg.args, dict) else None
                try:
                    body = self.control.request(msg.what, name, (identity, msg.req_id))
                finally:
                    self.ensembles.refresh()
                return None if body is None else protocol.Reply(msg.req_id, body)
            if msg.what == "logging":
                return protocol.Reply(msg.req_id, self.log_settings(msg.args))
            if msg.what == "regions":
                return protocol.Reply(msg.req_id, self.regions.answer(msg.args))
            return protocol.Reply(msg.req_id, answer_query(self, msg.what, msg.args))
        if isinstance(msg, protocol.RegisterArena):
            return protocol.Reply(msg.req_id, {"arena": self.arenas.register(identity, msg.name, msg.size,
                                                                             msg.token)})
        if isinstance(msg, protocol.UnregisterArena):
            return protocol.Reply(msg.req_id, {"unregistered": self.arenas.unregister(msg.arena, identity)})
        raise errors.InvalidArgument(f"{type(msg).__name__} is not a request a client may send")

    def log_settings(self, args: object) -> dict:
        """The 'logging' query: the front's and its workers' log settings, first changed by Triton's
        settings in ``args["update"]`` when given."""
        update = args.get("update") if isinstance(args, dict) else None
        if update is not None:
            self.logging = self.logging.updated(update)
            self.out.log_settings(self.logging)
        return self.logging.as_wire()

    def _infer(self, identity: bytes, msg: protocol.Infer, parts: list) -> None:
        if type(msg.req_id) is not int or type(msg.model) is not str:
            raise errors.InvalidArgument("req_id must be an integer and model a string")
        if msg.members is not None:
            return self._infer_group(identity, msg, parts)
        if self.stopping:
            raise errors.Unavailable("the pool is shutting down")
        group = self.control.group(msg.model)
        model = group.route(msg.version if type(msg.version) is int else protocol.NO_VERSION)
        try:
            # a call on itself is refused even while the model loads (its warmup would wait for itself)
            chain = () if msg.caller is None else bls_chain(msg, model.name, self.workers, self.clock())
            # a warmup's call into a model still loading waits in its queue, where the BLS books see the wait
            self.calls.check_servable(model, msg.caller)
            req = admit(msg, identity, parts[1:], model.admission, self.arenas, self.clock())  # checks every field
            if msg.caller is not None:  # else the request's defaults: no chain, no caller
                req.chain, req.caller = chain, msg.caller[:3]
            if model.config.ensemble is not None:  # its steps are booked as the caller's calls
                self.ensembles.start(model, req)
                group.version_requests[model.version] = group.version_requests.get(model.version, 0) + 1
                return
            if self.dispatch.cache is not None and model.config.response_cache \
                    and self.dispatch.answer_cached(model, req):
                return  # answered from the cache: no worker runs it
            self._enqueue(group, model, req, msg.priority, msg.timeout_us, msg.deadline_us, counted=True)
        except errors.GepoolError as exc:  # refused by admission: a failure of this model, by Triton's reason
            model.stats.failed(failure_reason(exc), origin_of(msg))
            raise
        self._refused.discard(msg.model)

    def _infer_group(self, identity: bytes, msg: protocol.Infer, parts: list) -> None:
        """A group of requests (protocol.Infer.members): queued as one request (or as runs that each fit a batch)
        where its model cannot tell the difference, else each member admitted on its own. Every answer, an
        error included, goes to each member (a group whose members cannot be read hears it under its own id)."""
        members = grouping.members(msg)
        model = None
        try:
            if self.stopping:
                raise errors.Unavailable("the pool is shutting down")
            group = self.control.group(msg.model)
            model = group.route(msg.version if type(msg.version) is int else protocol.NO_VERSION)
            if msg.caller is not None:  # no client of ours groups BLS calls
                raise errors.InvalidArgument("a group of requests cannot carry a BLS caller")
            # what every member would be refused for alone, in the order it would be, before any work per member
            # (a split costs inputs x runs)
            self.calls.check_servable(model, None)
            if getattr(model, "admission", None) is not None:
                check_header(msg, model.admission)
            runs = [[m] for m in members]
            if model.groupable and grouping.runs_as_one(msg):
                # runs of the smallest preferred size at most: the batcher can still make each preferred size
                # from them as it would from the members sent alone
                preferred = model.batcher.preferred
                runs = grouping.runs(members, preferred[0] if preferred else model.batcher.max_rows)
                if len(runs) == 1 and self._admit_group(identity, msg, parts, group, model, members):
                    return
                if len(runs) == 1:  # it fits a batch, yet its model refused it: each member hears its own words
                    runs = [[m] for m in members]
            split = grouping.split(msg, parts[1:], runs)
        except errors.GepoolError as exc:
            if model is not None:
                model.stats.failed(failure_reason(exc), origin_of(msg), len(members))
            self._tell_members(identity, members, exc)
            return
        except Exception as exc:  # a bug must not leave the members unanswered
            log.exception("internal error handling a group of %d requests", len(members))
            self._tell_members(identity, members, errors.Internal(f"internal error: {exc}"))
            return
        for one, frames in split:
            whom = [(one.req_id, 0)] if one.members is None else one.members
            try:
                self._infer(identity, one, frames)
            except errors.GepoolError as exc:
                self._tell_members(identity, whom, exc)
            except Exception as exc:  # a bug in one member's admission: the others still run
                log.exception("internal error handling request %s of a group", one.req_id)
                self._tell_members(identity, whom, errors.Internal(f"internal error: {exc}"))

    def _admit_group(self, identity: bytes, msg: protocol.Infer, parts: list, group, model: Model,
                     members: list[tuple[int, int]]) -> bool:
        """Queues a group as one request; False where admission refused it (nothing queued, nothing counted)."""
        try:
            req = admit(msg, identity, parts[1:], model.admission, self.arenas, self.clock())
        except errors.GepoolError:
            return False
        total = sum(rows for _, rows in members)
        if req.rows != total:
            raise errors.InvalidArgument(f"a group's members hold {total} rows, its tensors {req.rows}")
        req.count, req.members = len(members), msg.members
        self._enqueue(group, model, req, msg.priority, msg.timeout_us, msg.deadline_us, counted=True)
        self._refused.discard(msg.model)
        return True

    def _tell_members(self, identity: bytes, members: list, err: errors.GepoolError) -> None:
        encoded = [protocol.Error(req_id, err.code, err.message).encode() for req_id, _ in members]
        for one in encoded:
            self.out.reply(identity, [one])

    def _enqueue(self, group, model: Model, req, priority: int, timeout_us: int, deadline_us: int = 0,
                 counted: bool = False) -> None:
        """An admitted request into its model's queue, or Unavailable (the pool's or the model's queue is
        full); ``counted``: the caller counts a refusal in the model's stats (else it is counted here). A BLS
        call (``req.caller``: a client's or an ensemble step's) is booked under the batch that waits on it, or
        refused (Unavailable) if it could never run."""
        call = None
        try:
            budget = self.control.budget
            if budget.used + req.nbytes > budget.limit:
                raise errors.Unavailable(f"the pool's queues hold {budget.used} bytes of requests; this one's "
                                         f"{req.nbytes} would pass max_queued_bytes ({budget.limit})")
            if req.caller is not None:  # after the cheap check: entering walks the wait-for graph
                call = self.calls.enter(req, model, req.caller)
            busy = any(w.inflight for w in model.workers)
            if not model.batcher.add(req, req.rows, req.key, priority, timeout_us, busy, req.nbytes, deadline_us):
                raise errors.Unavailable(f"Exceeds maximum queue size (model '{model.name}')")
        except errors.GepoolError as exc:
            if call is not None:
                self.calls.forget(call)
            if not counted:
                model.stats.failed(failure_reason(exc), req.origin, req.count)
            raise
        group.version_requests[model.version] = group.version_requests.get(model.version, 0) + req.count
        self.dirty.add(model)

    def _prepare_worker(self, name: object) -> bool:
        """Sequential traffic: wakes the idle worker that will run this request now, so its wake-up
        overlaps admission (the worker polls its doorbell briefly for the batch). Not for a model whose
        last prewoken request was refused: a client repeating a bad request would keep it polling."""
        group = self.control.groups.get(name) if type(name) is str else None
        if group is None or len(group.serving) != 1 or name in self._refused:
            return False
        (model,) = group.serving.values()
        if len(model.batcher):
            return False
        for w in model.workers:
            if w.state == READY and not w.inflight and w.info.get("prewake"):
                w.bell.prepare()
                self.polling.prewakes += 1
                return True
        return False

    def _may_prewake(self) -> bool:
        """Traffic is sequential and no worker computes: an ensemble step's worker may be prewoken (by
        ``_prepare_worker``, as a client's request's is)."""
        return self.polling.enabled and self.dispatch.last_batch_requests <= 1 and not self.workers.busy()

    def _largest_slot(self) -> int:
        return max((m.slot_bytes for m in self.control.models()), default=0)

    def _models_changed(self) -> None:
        self.regions.publish_largest_slot(self._largest_slot())

    def message_limit(self) -> int:
        """The most bytes one client message may declare: the largest slot of any model, plus headers."""
        return self._largest_slot() + MESSAGE_HEADROOM

    def _drop_arena(self, name: str) -> None:
        for w in self.workers.values():
            if w.state == READY and w.info.get("arena_io"):
                self.out.drop_arena(w, name)

    # -- events: workers -------------------------------------------------------------------
    def on_worker_message(self, msg) -> None:
        w = self.workers.get(getattr(msg, "worker", None))
        if w is None:
            return
        if isinstance(msg, protocol.WorkerReady):
            if msg.version != protocol.PROTOCOL_VERSION:
                w.reason = f"worker speaks protocol {msg.version}, the front {protocol.PROTOCOL_VERSION}"
                self.out.kill(w)
                return
            w.ready(msg, self.clock())
            if self.calls.by_worker:
                self.calls.sweep(w, "its warmup ended")
            w.model.worker_info(msg.info)
            self._refresh(w.model)
            log.info("worker %d (%s v%s) ready", w.id, w.model.name, w.model.version)
            if w.retired:  # its generation was replaced or unloaded while it loaded
                self.out.stop(w)
        elif isinstance(msg, protocol.WorkerFailed):
            w.cannot_load(msg.reason if type(msg.reason) is str else "its model cannot load")
            self._refresh(w.model)
        elif isinstance(msg, protocol.DeviceStats):
            w.sampled(msg)

    def on_completions(self, w: Worker, records: Iterable[tuple[int, int]]) -> None:
        """What a worker's doorbell carried: each (slot, seq) is a batch done (or failed) in its slot."""
        self.dirty.add(w.model)
        for slot, seq in records:
            try:
                self.dispatch.complete(w.model, w, slot, seq)
            except Exception:  # a bug here must not take every model down; the log keeps the traceback
                log.exception("internal error completing slot %d of worker %d", slot, w.id)
            finally:  # ensemble steps' outputs still view that slot: before any batch can refill it
                self.ensembles.hand_over()
        if self.calls.by_worker:
            self.calls.sweep(w, "it finished")

    def on_worker_exit(self, w: Worker, code: int | None) -> None:
        """Its process is reaped (the loop fed what its doorbell still held first)."""
        self.recovery.on_exit(w, code, self.clock(), self.stopping)
        if self.calls.by_worker:
            self.calls.sweep(w, w.reason or "its worker exited")
        if self.calls.orphans:
            self.calls.requeued()
        self._refresh(w.model)

    def _refresh(self, model: Model) -> None:
        model.refresh_state()
        if self.calls.by_worker:  # a worker that stopped for good may leave a queued call nothing can ever run
            self.calls.recheck()
        self.control.on_refresh(model)
        self.ensembles.refresh()
        if model.state == ModelState.UNAVAILABLE and len(model.batcher):
            reason = f"model '{model.name}' is unavailable: {model.reason}"
            self.dispatch.fail_queued(model, errors.ModelNotReady(reason))

    # -- events: time ----------------------------------------------------------------------
    def tick(self, now: float) -> bool:
        """Housekeeping and every model's timers; True once a stop has drained."""
        self.recovery.watchdog(now)
        self.recovery.load_watch(now)
        self.arenas.reap(now)
        if not self.stopping:
            self.recovery.restart_due(now)
            self.control.poll(now)
            self.control.drain()
            self.ensembles.refresh()
        self.dirty.clear()
        self.schedule(self.control.models())
        self._announce_ready()
        if self.grace_until is not None and now >= self.grace_until:
            self.begin_stop()
        self.wake_at = self._housekeeping_deadline()
        return self.stopping and self._drained(now)

    def schedule(self, models: Iterable[Model]) -> None:
        queued = set()
        for model in models:
            if len(model.batcher):
                expired = model.batcher.expire()  # a timer, not the end of a running batch
                for p in expired:
                    if p.client_gone(model.batcher.clock()):
                        # the client's own word for its deadline, so it raises the same either way; it
                        # is still sent, so that a client that gave up frees its arena range on it
                        err = errors.PoolUnavailable("no answer in time: the client's deadline passed while the "
                                                     "request was queued, and it never ran")
                        self.dispatch.reply_error(model, p.item, err, client_gone=True)
                    else:
                        self.dispatch.reply_error(model, p.item, errors.Timeout("Request timeout expired"))
                self.dispatch.schedule(model)
                if len(model.batcher):
                    queued.add(model)
        self.queued = queued

    def next_deadline(self, *others: float | None) -> float | None:
        """When the loop must tick or schedule again at the latest, ``others`` being the loop's own
        timers (None: only an event matters). Between ticks the loop schedules the models in
        ``dirty | queued``, and clears ``dirty``."""
        deadlines = [m.deadline() for m in self.queued]
        deadlines += [self.wake_at, *others]
        deadlines = [d for d in deadlines if d is not None]
        return min(deadlines) if deadlines else None

    def _housekeeping_deadline(self) -> float | None:
        deadlines = [self.recovery.next_deadline(), self.control.poll_at, self.drain_deadline, self.grace_until]
        if len(self.arenas):
            deadlines.append(self.arenas.check_at)
        deadlines = [d for d in deadlines if d is not None]
        return min(deadlines) if deadlines else None

    def _announce_ready(self) -> None:
        if self._announced or any(w.state == WorkerState.STARTING for w in self.workers.values()):
            return
        self._announced = True
        self.out.ready(self.status())

    def status(self) -> dict:
        return pool_status(self, os.getpid())

    # -- stopping --------------------------------------------------------------------------
    def begin_grace(self) -> None:
        """Not ready at once (load balancers move away), still serving until the grace ends."""
        if self.grace_until is None and not self.stopping:
            log.info("SIGTERM: not ready; serving for %.1fs more, then draining", self.opts.exit_grace_s)
            self.grace_until = self.clock() + self.opts.exit_grace_s

    def begin_stop(self) -> None:
        if not self.stopping:
            log.info("stopping: draining requests in flight")
            self.stopping = True
            self.drain_deadline = self.clock() + self.opts.drain_timeout_s

    def _drained(self, now: float) -> bool:
        busy = any(len(m.batcher) for m in self.control.models()) or self.workers.busy()
        return not (busy and now < self.drain_deadline and self.workers.any_ready())

    def close(self) -> None:
        """Fails what is still queued or in flight, then asks every ready worker to stop."""
        unavailable = errors.Unavailable("the pool stopped before this request ran")
        for model in self.control.models():
            self.dispatch.fail_queued(model, unavailable)
            for w in model.workers:
                for batch in w.fail_all():
                    self.dispatch.fail_batch(model, batch, unavailable)
        self.arenas.close()
        self.regions.close()
