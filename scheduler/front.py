"""The front process: one zmq.Poller loop over clients, workers, worker sentinels and signals.

Every blocking wait is that one poll; its timeout is the nearest batch deadline or restart time.
Signal handlers only write to a wake-up pipe; the loop does the work, including the shutdown
sequence (running -> draining -> stopping) with a deadline.
"""

import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from gepool.common import errors
from gepool.common.render import render
from gepool.ipc import lane, protocol, zmqio
from gepool.ipc.sockets import ipc_path, make_socket, runtime_dir
from gepool.scheduler.arenas import Arenas
from gepool.scheduler.control import ModelControl
from gepool.scheduler.dispatch import Dispatcher
from gepool.scheduler.lanes import Lanes
from gepool.scheduler.models import Model
from gepool.scheduler.polling import PollPolicy
from gepool.scheduler.requests import admit
from gepool.scheduler.supervisor import READY, STARTING, Supervisor, Worker

log = logging.getLogger("gepool.front")

DRAIN_TIMEOUT_S = 30.0
MAX_MESSAGES_PER_WAKE = 256  # so a flood of clients cannot starve the workers' completions
TICK_S = 0.01  # housekeeping cadence while requests and completions keep the loop busy
SERVER_NAME = "gepool"
FD_SETSIZE = 1024  # select()'s limit on Linux


@dataclass
class FrontOptions:
    repository: str
    endpoint: str
    owner_id: str
    cpu_threads: int = 0  # threads per CPU model, split among its instances; 0 = every core
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    log_level: int = logging.INFO
    exit_grace_s: float = 0.0  # after SIGTERM: report not ready but keep serving this long, then drain
    model_control_mode: str = "none"  # none | explicit | poll (Triton's names)
    load_models: tuple[str, ...] = ()  # explicit mode: what to load at start
    poll_secs: float = 15.0
    curve_secret_key: str | None = None  # a certificate file: turns CURVE on for the client endpoint
    curve_authorized_keys: str | None = None  # a folder of client public keys; none: any key may connect
    busy_poll_us: int = 0  # 0: poll only for what is due within microseconds; N > 0: also N us when idle; -1: never
    auto_complete_config: bool = True  # Triton's config auto-complete (off: --disable-auto-complete-config)


class Front:
    def __init__(self, options: FrontOptions, start_worker: Callable, on_ready: Callable[[dict], None] | None = None):
        self.opts = options
        self.on_ready = on_ready
        self.control = ModelControl(self)
        self.arenas = Arenas(on_drop=self._drop_arena)
        self.ctx = zmq.Context()
        self.worker_endpoint = f"ipc://{runtime_dir()}/gepool-{options.owner_id}.workers"
        self.supervisor = Supervisor(options.owner_id, self.worker_endpoint, start_worker, options.log_level,
                                     runtime_dir())
        self.by_sentinel: dict[int, Worker] = {}
        self.by_bell: dict[int, Worker] = {}
        self.stopping = False
        self.drain_deadline: float | None = None
        self.grace_until: float | None = None
        self._announced = False
        self._dirty: set[Model] = set()  # models a request or a completion touched since the last poll
        self._queued: set[Model] = set()  # models left with queued requests after their last scheduling
        self._dirty_since_tick = False
        self._wake_at: float | None = None
        self.polling = PollPolicy(options.busy_poll_us)
        self._refused: set[str] = set()  # models whose last prewoken request failed admission
        self.lanes: Lanes | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def run(self) -> int:
        """Serves until SIGINT/SIGTERM; returns the process exit code."""
        _refuse_live_pool(self.ctx, self.opts.endpoint)
        _raise_fd_limit()
        self.clients = make_socket(self.ctx, zmq.ROUTER, bind=self.opts.endpoint, curve_server=self._curve())
        # tcp://HOST:* binds a free port; from here on the endpoint is the one actually bound
        self.opts.endpoint = self.clients.getsockopt_string(zmq.LAST_ENDPOINT)
        self.workers = make_socket(self.ctx, zmq.ROUTER, bind=self.worker_endpoint)
        self.lanes = self._open_lanes()
        self.dispatch = Dispatcher(self.clients, self.workers, self.arenas, self.lanes, self.polling)
        self.poller = zmq.Poller()
        self.poller.register(self.clients, zmq.POLLIN)
        self.poller.register(self.workers, zmq.POLLIN)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(wake_r, zmq.POLLIN)
        self._clients_fd, self._workers_fd, self._wake_r = self.clients.FD, self.workers.FD, wake_r
        self._lanes_fd = self.lanes.fileno() if self.lanes is not None else -1
        if self.lanes is not None:
            self.poller.register(self._lanes_fd, zmq.POLLIN)
        old_fd = signal.set_wakeup_fd(wake_w)
        old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.control.start()
            self._loop(wake_r)
        finally:
            self._shutdown()
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
        return 0

    def _open_lanes(self) -> Lanes | None:
        """Same-host clients' fast path beside an ipc endpoint (not with CURVE: a lane is not authenticated)."""
        path = ipc_path(self.opts.endpoint)
        if path is None or self.opts.curve_secret_key:
            return None
        try:
            return Lanes(lane.path_for(path), self._on_message)
        except OSError as exc:  # a path too long for a Unix socket, say: clients keep to ZMQ
            log.warning("no lanes beside %s: %s", self.opts.endpoint, exc)
            return None

    def _curve(self) -> tuple[bytes, bytes] | None:
        if not self.opts.curve_secret_key:
            return None
        from gepool.scheduler.curve import start_curve

        self.auth, keys = start_curve(self.ctx, self.opts.curve_secret_key, self.opts.curve_authorized_keys)
        return keys

    def spawn(self, w: Worker) -> None:
        self.supervisor.spawn(w, w.model.config, w.model.source.version_dir)
        self.by_sentinel[w.sentinel] = w
        self.poller.register(w.sentinel, zmq.POLLIN)
        self.by_bell[w.bell.done_fd] = w
        self.poller.register(w.bell.done_fd, zmq.POLLIN)

    def _loop(self, wake_r: int) -> None:
        """Requests and completions (the hot events) only schedule the models they touched; everything
        else (watchdog, restarts, arenas, model control, readiness, timers) runs in ``_tick``, after any
        other event, when the poll times out, and at least every TICK_S while hot events keep coming."""
        next_tick = 0.0
        if self._tick(time.monotonic()):  # once before any event: with no worker to wait for, ready now
            return
        while True:
            events = self._wait(next_tick if self._dirty_since_tick else None)
            tick = not events
            for sock, _ in events:
                if sock is self.clients:
                    self._drain(self.clients, self._on_client)
                elif sock == self._lanes_fd:
                    self.lanes.pump(MAX_MESSAGES_PER_WAKE)
                elif sock in self.by_bell:
                    self._on_bell(self.by_bell[sock])
                else:
                    tick = True
                    if sock is self.workers:
                        self._drain(self.workers, self._on_worker)
                    elif sock == wake_r:
                        self._on_signals(_read_all(wake_r))
                    elif sock in self.by_sentinel:
                        self._on_worker_exit(self.by_sentinel.pop(sock))
            now = time.monotonic()
            if tick or now >= next_tick:
                next_tick = now + TICK_S
                self._dirty_since_tick = False
                self._dirty.clear()
                if self._tick(now):
                    return
            else:
                self._dirty_since_tick = True
                self._schedule(self._dirty | self._queued)
                self._dirty.clear()

    def _tick(self, now: float) -> bool:
        """Housekeeping and every model's timers; True once a stop has drained."""
        self._watchdog(now)
        self.arenas.reap(now)
        if self.lanes is not None:
            self.lanes.resume(now)
        self._restart_due(now)
        if not self.stopping:
            self.control.poll(now)
            self.control.drain()
        self._schedule(self.control.models())
        self._announce_ready()
        if self.grace_until is not None and now >= self.grace_until:
            self._begin_stop()
        self._wake_at = self._housekeeping_deadline()
        return self.stopping and self._drained(now)

    def _schedule(self, models) -> None:
        queued = set()
        for model in models:
            if len(model.batcher):
                for p in model.batcher.expire():  # a timer, not the end of a running batch
                    self.dispatch.reply_error(model, p.item, errors.Timeout("Request timeout expired"))
                self.dispatch.schedule(model)
                if len(model.batcher):
                    queued.add(model)
        self._queued = queued

    def _wait(self, next_tick: float | None) -> list:
        """The next events, polled for while one is expected within microseconds (``polling.py`` says
        when), slept for otherwise."""
        at = self._next_deadline(next_tick)
        now = time.monotonic()
        sequential = self._sequential()
        until, window = self.polling.until(now, sequential, self._busy_workers() if sequential else 0)
        if until > now and (at is None or at > now):
            until = until if at is None else min(until, at)
            poll = self.poller.poll
            while time.monotonic() < until:
                events = poll(0)
                if events:
                    return events
                os.sched_yield()  # sharing a CPU with the worker or client it waits for, let it run
            if window:
                self.polling.missed()
            now = time.monotonic()
        if at is None:
            return self.poller.poll(-1)
        remaining = at - now
        if remaining <= 0:  # overdue: the tick after this poll handles it (at most a 1 ms poll, as ever)
            return self.poller.poll(max(0, int(remaining * 1000) + 1))
        if remaining < 1e-3:
            return self._wait_until(at)
        return self.poller.poll(int(remaining * 1000))  # whole ms, rounded down: the rest in _wait_until

    def _sequential(self) -> bool:
        """Polling is on and the last batch held one request (what every poll and prewake needs)."""
        return self.polling.enabled and self.dispatch.last_batch_requests <= 1

    def _busy_workers(self) -> int:
        return sum(1 for w in self.supervisor.workers.values() if w.inflight)

    def _wait_until(self, at: float) -> list:
        """Events before ``at``, sleeping in select(), whose timeout has microseconds. zmq_poll counts whole
        milliseconds, so a deadline under a millisecond away (a max_queue_delay_microseconds of 200, say)
        used to fire up to a millisecond late. The ZMQ sockets' FDs only say "look"; poll(0) says what
        is there. select() cannot take a descriptor past FD_SETSIZE (a worker restarted while a
        thousand lanes are open may get one): such a descriptor waits out the rest of the sub-ms wait."""
        fds = [self._clients_fd, self._workers_fd, self._wake_r, *self.by_sentinel, *self.by_bell]
        if self._lanes_fd >= 0:
            fds.append(self._lanes_fd)
        fds = [fd for fd in fds if fd < FD_SETSIZE]
        while True:
            events = self.poller.poll(0)
            remaining = at - time.monotonic()
            if events or remaining <= 0:
                return events
            select.select(fds, [], [], remaining)

    def _next_deadline(self, next_tick: float | None) -> float | None:
        deadlines = [m.deadline() for m in self._queued]
        deadlines += [self._wake_at, next_tick]
        deadlines = [d for d in deadlines if d is not None]
        return min(deadlines) if deadlines else None

    def _housekeeping_deadline(self) -> float | None:
        """The nearest timer outside the models' queues (restarts, watchdog, polling, arenas, shutdown)."""
        workers = self.supervisor.workers.values()
        deadlines = [w.restart_at for w in workers if w.restart_at is not None]
        deadlines += [w.progress_at + w.model.exec_timeout_s for w in workers if w.inflight and w.state == READY]
        if self.control.poll_at is not None:
            deadlines.append(self.control.poll_at)
        if len(self.arenas):
            deadlines.append(self.arenas.check_at)
        if self.lanes is not None and self.lanes.resume_at is not None:
            deadlines.append(self.lanes.resume_at)
        if self.drain_deadline is not None:
            deadlines.append(self.drain_deadline)
        if self.grace_until is not None:
            deadlines.append(self.grace_until)
        deadlines = [d for d in deadlines if d is not None]
        return min(deadlines) if deadlines else None

    def _drain(self, sock: zmq.Socket, handle: Callable[[list], None]) -> None:
        for _ in range(MAX_MESSAGES_PER_WAKE):
            if not zmqio.readable(sock):
                return
            handle(zmqio.recv_parts(sock, zmqio.NOBLOCK))

    # -- clients -------------------------------------------------------------------------
    def _on_client(self, frames: list) -> None:
        if len(frames) >= 2:
            self._on_message(frames[0].bytes, frames[1:])

    def _on_message(self, identity: bytes, parts: list) -> None:
        """A client's message, from the ZMQ socket or a lane: the payload, then its tensor parts."""
        if not parts:
            return
        try:
            msg = protocol.decode(parts[0].buffer)
        except protocol.ProtocolError as exc:
            log.warning("dropping a bad message: %s", exc)
            self.send(identity, protocol.Error(0, errors.ProtocolMismatch.code, str(exc)))
            return
        req_id = getattr(msg, "req_id", 0)
        try:
            if type(msg) is protocol.Infer:  # the hot path: an admitted request is answered later
                prepared = False
                if self._sequential():
                    self.polling.arrived(time.monotonic())
                    prepared = not self._busy_workers() and self._prepare_worker(msg.model)
                try:
                    return self._infer(identity, msg, parts[1:])
                except errors.GepoolError:
                    if prepared:  # no batch follows: stop waking this worker for nothing until one is admitted
                        self._refused.add(msg.model)
                    raise
            reply = self._handle(identity, msg, parts[1:])
        except errors.GepoolError as exc:
            reply = protocol.Error(req_id, exc.code, exc.message)
        except Exception as exc:  # a bug must not take the pool down; the client hears INTERNAL
            log.exception("internal error handling %s", type(msg).__name__)
            reply = protocol.Error(req_id if isinstance(req_id, int) else 0, "INTERNAL", f"internal error: {exc}")
        if reply is not None:
            self.send(identity, reply)

    def _handle(self, identity: bytes, msg, frames: list):
        if isinstance(msg, protocol.Hello):
            if msg.version != protocol.PROTOCOL_VERSION:
                raise errors.ProtocolMismatch(f"client speaks protocol {msg.version}, "
                                              f"this pool {protocol.PROTOCOL_VERSION}")
            return protocol.Welcome(msg.req_id, protocol.PROTOCOL_VERSION, self.opts.owner_id, SERVER_NAME)
        if isinstance(msg, protocol.Query):
            if msg.what in ("load", "unload"):
                name = msg.args.get("model") if isinstance(msg.args, dict) else None
                body = self.control.request(msg.what, name, (identity, msg.req_id))
                return None if body is None else protocol.Reply(msg.req_id, body)
            return protocol.Reply(msg.req_id, self._query(msg.what, msg.args))
        if isinstance(msg, protocol.RegisterArena):
            return protocol.Reply(msg.req_id, {"arena": self.arenas.register(identity, msg.name, msg.size)})
        if isinstance(msg, protocol.UnregisterArena):
            return protocol.Reply(msg.req_id, {"unregistered": self.arenas.unregister(msg.arena)})
        raise errors.InvalidArgument(f"{type(msg).__name__} is not a request a client may send")

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

    def _infer(self, identity: bytes, msg: protocol.Infer, frames: list) -> None:
        if type(msg.req_id) is not int or type(msg.model) is not str:
            raise errors.InvalidArgument("req_id must be an integer and model a string")
        if self.stopping:
            raise errors.Unavailable("the pool is shutting down")
        group = self.control.group(msg.model)
        model = group.route(msg.version if type(msg.version) is int else protocol.NO_VERSION)
        model.check_servable()
        req = admit(msg, identity, frames, model.admission, self.arenas, time.monotonic())  # checks every field
        busy = any(w.inflight for w in model.workers)
        if not model.batcher.add(req, req.rows, req.key, msg.priority, msg.timeout_us, busy):
            raise errors.Unavailable(f"Exceeds maximum queue size (model '{model.name}')")
        group.version_requests[model.version] = group.version_requests.get(model.version, 0) + 1
        self._dirty.add(model)
        self._refused.discard(msg.model)
        return None

    def _query(self, what: str, args: dict) -> dict:
        if what == "status":
            return self.status()
        if what == "stats":
            return {name: g.stats_dict() for name, g in self.control.groups.items()}
        if what in ("metadata", "config"):
            group = self.control.group(args.get("model") if isinstance(args, dict) else None)
            if what == "metadata":
                return group.metadata()
            model = group.default() or next(iter(group.loading + group.failed), None)
            if model is None or model.config is None:
                raise errors.ModelNotReady(f"model '{group.name}' has no valid config: {group.error}")
            return render(model.config)
        raise errors.InvalidArgument(f"unknown query '{what}' (status, stats, metadata, config, load, unload)")

    def status(self) -> dict:
        return {"pool_id": self.opts.owner_id, "endpoint": self.opts.endpoint,
                "stopping": self.stopping or self.grace_until is not None,
                "arenas": len(self.arenas), "lanes": len(self.lanes) if self.lanes is not None else 0,
                "lane_pids": self.lanes.pids() if self.lanes is not None else [],
                "pid": os.getpid(), "polling": self.polling.summary(),
                "model_control_mode": self.opts.model_control_mode,
                "models": {name: g.summary() for name, g in self.control.groups.items()}}

    def send(self, identity: bytes, msg, frames: list = ()) -> None:
        self.dispatch.reply(identity, [msg.encode(), *frames])

    def send_worker(self, w: Worker, msg) -> None:
        self.workers.send_multipart([b"w%d" % w.id, msg.encode()])

    def _drop_arena(self, name: str) -> None:
        for w in self.supervisor.workers.values():
            if w.state == READY and w.info.get("arena_io"):
                self.send_worker(w, protocol.DropArena(name))

    # -- workers -------------------------------------------------------------------------
    def _on_worker(self, frames: list) -> None:
        try:
            msg = protocol.decode(frames[1].buffer)
        except (protocol.ProtocolError, IndexError) as exc:
            log.error("bad message from a worker: %s", exc)
            return
        try:
            self._on_worker_message(msg)
        except Exception:  # a bug here must not take every model down; the log keeps the traceback
            log.exception("internal error handling %s from a worker", type(msg).__name__)

    def _on_worker_message(self, msg) -> None:
        w = self.supervisor.workers.get(getattr(msg, "worker", -1))
        if w is None:
            return
        if isinstance(msg, protocol.WorkerReady):
            self.supervisor.on_ready(w, msg)
            w.model.worker_info(msg.info)
            self._refresh(w.model)
            log.info("worker %d (%s v%s) ready", w.id, w.model.name, w.model.version)
            if w.retired:  # its generation was replaced or unloaded while it loaded
                self.send_worker(w, protocol.Stop())
        elif isinstance(msg, protocol.WorkerFailed):
            w.reason = msg.reason

    def _on_bell(self, w: Worker) -> None:
        """Completions rung by a worker: each (slot, seq) is a batch done (or failed) in its slot."""
        records = w.bell.completions() if w.bell is not None else None
        if records is None:  # the worker closed its end: it is exiting, and its sentinel will say so
            fd = next((fd for fd, o in self.by_bell.items() if o is w), None)
            if fd is not None:
                self.poller.unregister(fd)
                del self.by_bell[fd]
            return
        self._dirty.add(w.model)
        for slot, seq in records:
            try:
                self.dispatch.complete(w.model, w, slot, seq)
            except Exception:  # a bug here must not take every model down; the log keeps the traceback
                log.exception("internal error completing slot %d of worker %d", slot, w.id)

    def _on_worker_exit(self, w: Worker) -> None:
        self._on_bell(w)  # what it finished before dying counts
        for fd in [fd for fd, o in self.by_bell.items() if o is w]:
            self.poller.unregister(fd)
            del self.by_bell[fd]
        self.poller.unregister(w.sentinel)
        model = w.model
        lost = self.supervisor.on_exit(w, time.monotonic(), self.stopping)
        can_retry = not self.stopping and any(o.state == READY for o in model.workers if o is not w)
        err = errors.WorkerDied(f"the worker running model '{model.name}' died ({w.reason}) while executing "
                                f"this request")
        for batch in sorted(lost.values(), key=lambda b: b.seq, reverse=True):  # oldest ends up first
            self.dispatch.recover(model, batch, err, can_retry)
        if w.retired:
            self.supervisor.forget(w)
        self._refresh(model)

    def _watchdog(self, now: float) -> None:
        """A worker that has held a batch past its model's execution timeout is hung: that batch is
        answered now, the worker is killed, and its death path replaces it and retries the rest."""
        for w in self.supervisor.workers.values():
            model = w.model
            if w.state != READY or not w.inflight or now - w.progress_at < model.exec_timeout_s:
                continue
            head = min(w.inflight.values(), key=lambda b: b.seq)
            del w.inflight[head.slot]
            w.rows -= head.rows
            timeout_ms = round((model.exec_timeout_s) * 1000)
            self.dispatch.fail_batch(model, head, errors.WorkerDied(
                f"model '{model.name}' did not finish a batch within {timeout_ms} ms (execution_timeout_ms); "
                f"its worker was killed and is being replaced"))
            w.reason = "hung: killed by the watchdog"
            log.error("worker %d (%s) hung; killing it", w.id, model.name)
            w.process.kill()

    def _restart_due(self, now: float) -> None:
        if self.stopping:
            return
        for w in list(self.supervisor.workers.values()):
            if w.restart_at is not None and w.restart_at <= now and not w.retired:
                self.spawn(w)

    def _announce_ready(self) -> None:
        if self._announced or any(w.state == STARTING for w in self.supervisor.workers.values()):
            return
        self._announced = True
        if self.on_ready is not None:
            self.on_ready(self.status())

    def _refresh(self, model: Model) -> None:
        model.refresh_state()
        self.control.on_refresh(model)
        if model.state == "UNAVAILABLE" and len(model.batcher):
            reason = f"model '{model.name}' is unavailable: {model.reason}"
            self.dispatch.fail_queued(model, errors.ModelNotReady(reason))

    # -- shutdown ------------------------------------------------------------------------
    def _on_signals(self, received: bytes) -> None:
        """SIGTERM with a grace period: not ready at once (load balancers move away), still serving until
        the grace ends, then the drain. SIGINT, or no grace: the drain at once."""
        if signal.SIGTERM in received and self.opts.exit_grace_s > 0 and not self.stopping:
            if self.grace_until is None:
                log.info("SIGTERM: not ready; serving for %.1fs more, then draining", self.opts.exit_grace_s)
                self.grace_until = time.monotonic() + self.opts.exit_grace_s
            return
        self._begin_stop()

    def _begin_stop(self) -> None:
        if not self.stopping:
            log.info("stopping: draining requests in flight")
            self.stopping = True
            self.drain_deadline = time.monotonic() + self.opts.drain_timeout_s

    def _drained(self, now: float) -> bool:
        busy = any(len(m.batcher) for m in self.control.models()) or any(
            w.inflight for w in self.supervisor.workers.values())
        if busy and now < self.drain_deadline and any(w.state == READY for w in self.supervisor.workers.values()):
            return False
        return True

    def _shutdown(self) -> None:
        unavailable = errors.Unavailable("the pool stopped before this request ran")
        for model in self.control.models():
            if not hasattr(self, "dispatch"):
                break
            self.dispatch.fail_queued(model, unavailable)
            for w in model.workers:
                for batch in list(w.inflight.values()):
                    self.dispatch.fail_batch(model, batch, unavailable)
                w.inflight.clear()
        self.supervisor.stop_all(lambda w: self.send_worker(w, protocol.Stop()))
        self.arenas.close()
        for sock in (getattr(self, "clients", None), getattr(self, "workers", None)):
            if sock is not None:
                sock.close(0)
        if getattr(self, "lanes", None) is not None:
            self.lanes.close()
        if getattr(self, "auth", None) is not None:
            self.auth.stop()
        self.ctx.term()
        for endpoint in (self.opts.endpoint, self.worker_endpoint):
            if endpoint.startswith("ipc://"):
                try:
                    os.unlink(endpoint[len("ipc://"):])
                except FileNotFoundError:
                    pass


def _raise_fd_limit() -> None:
    """Every lane is a descriptor in the front: lift the soft limit (often 1024) to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20),
                                                        hard))
        except (ValueError, OSError):
            pass


def _read_all(fd: int) -> bytes:
    """What the signal wake-up pipe holds: one byte per signal, its number."""
    data = b""
    try:
        while chunk := os.read(fd, 512):
            data += chunk
    except BlockingIOError:
        pass
    return data


def _refuse_live_pool(ctx: zmq.Context, endpoint: str) -> None:
    """An ipc socket file may be a dead pool's leftover or a live pool: ask before replacing it."""
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    if not path or not os.path.exists(path):
        return
    probe = make_socket(ctx, zmq.DEALER, connect=endpoint)
    try:
        probe.send(protocol.Hello(0, protocol.PROTOCOL_VERSION, "probe").encode())
        if probe.poll(500):
            raise errors.Unavailable(f"a pool is already serving on {endpoint}")
    finally:
        probe.close(0)
