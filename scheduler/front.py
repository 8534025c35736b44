"""The front process: one zmq.Poller loop over clients, workers, worker sentinels and signals.

Every blocking wait is that one poll; its timeout is the nearest batch deadline or restart time.
Signal handlers only write to a wake-up pipe; the loop does the work, including the shutdown
sequence (running -> draining -> stopping) with a deadline.
"""

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from gepool import errors
from gepool.config import BACKEND_GE, lanes_per_worker
from gepool.config_json import render_config
from gepool.ipc import protocol
from gepool.ipc.sockets import make_socket
from gepool.repository import ModelSource, scan
from gepool.scheduler.arenas import Arenas
from gepool.scheduler.dispatch import Dispatcher
from gepool.scheduler.models import Model
from gepool.scheduler.requests import admit
from gepool.scheduler.supervisor import READY, STARTING, Supervisor, Worker

log = logging.getLogger("gepool.front")

DRAIN_TIMEOUT_S = 30.0
MAX_MESSAGES_PER_WAKE = 256  # so a flood of clients cannot starve the workers' completions
SERVER_NAME = "gepool"


@dataclass
class FrontOptions:
    repository: str
    endpoint: str
    owner_id: str
    cpu_threads: int = 0  # the CPU thread budget shared by CPU workers; 0 = every core
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    log_level: int = logging.INFO
    exit_grace_s: float = 0.0  # after SIGTERM: report not ready but keep serving this long, then drain
    curve_secret_key: str | None = None  # a certificate file: turns CURVE on for the client endpoint
    curve_authorized_keys: str | None = None  # a folder of client public keys; none: any key may connect


class Front:
    def __init__(self, options: FrontOptions, start_worker: Callable, on_ready: Callable[[dict], None] | None = None):
        self.opts = options
        self.on_ready = on_ready
        self.models: dict[str, Model] = {}
        self.arenas = Arenas()
        self.ctx = zmq.Context()
        self.worker_endpoint = f"ipc://{_runtime_dir()}/gepool-{options.owner_id}.workers"
        self.supervisor = Supervisor(options.owner_id, self.worker_endpoint, start_worker, options.log_level)
        self.by_sentinel: dict[int, Worker] = {}
        self.stopping = False
        self.drain_deadline: float | None = None
        self.grace_until: float | None = None
        self._announced = False

    # -- lifecycle -----------------------------------------------------------------------
    def run(self) -> int:
        """Serves until SIGINT/SIGTERM; returns the process exit code."""
        _refuse_live_pool(self.ctx, self.opts.endpoint)
        self.clients = make_socket(self.ctx, zmq.ROUTER, bind=self.opts.endpoint, curve_server=self._curve())
        # tcp://HOST:* binds a free port; from here on the endpoint is the one actually bound
        self.opts.endpoint = self.clients.getsockopt_string(zmq.LAST_ENDPOINT)
        self.workers = make_socket(self.ctx, zmq.ROUTER, bind=self.worker_endpoint)
        self.dispatch = Dispatcher(self.clients, self.workers, self.arenas)
        self.poller = zmq.Poller()
        self.poller.register(self.clients, zmq.POLLIN)
        self.poller.register(self.workers, zmq.POLLIN)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(wake_r, zmq.POLLIN)
        old_fd = signal.set_wakeup_fd(wake_w)
        old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._load_all()
            self._loop(wake_r)
        finally:
            self._shutdown()
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
        return 0

    def _curve(self) -> tuple[bytes, bytes] | None:
        if not self.opts.curve_secret_key:
            return None
        from gepool.scheduler.curve import start_curve

        self.auth, keys = start_curve(self.ctx, self.opts.curve_secret_key, self.opts.curve_authorized_keys)
        return keys

    def _load_all(self) -> None:
        sources = scan(self.opts.repository)
        cpu_instances = sum(s.config.instance_count for s in sources
                            if s.config and not s.error and s.config.backend != BACKEND_GE)
        threads = max(1, (self.opts.cpu_threads or os.cpu_count() or 1) // max(1, cpu_instances))
        for src in sources:
            self._load(src, threads)

    def _load(self, src: ModelSource, threads: int) -> None:
        model = Model(src)
        self.models[src.name] = model
        if src.error:
            log.error("model %s unavailable: %s", src.name, src.error)
            return
        if src.config.backend == BACKEND_GE:
            # One worker per NPU; the instances and streams on it are its lanes (batches in flight).
            lanes = lanes_per_worker(src.config)
            devices = sorted({d for g in src.config.instance_groups for d in g.devices})
            placements = [(f"ascend:{d}", lanes) for d in devices]
        else:
            placements = [(f"cpu:{d}" if g.devices else "cpu", 1) for g in src.config.instance_groups
                          for d in (g.devices or (None,)) for _ in range(g.count)]
        for device, lanes in placements:
            w = self.supervisor.add(src.name, device, threads, model.slots_per_worker * lanes, model.slot_bytes)
            w.concurrency = lanes
            model.workers.append(w)
            self._spawn(w)

    def _spawn(self, w: Worker) -> None:
        model = self.models[w.model]
        self.supervisor.spawn(w, model.config, model.source.version_dir)
        self.by_sentinel[w.sentinel] = w
        self.poller.register(w.sentinel, zmq.POLLIN)

    def _loop(self, wake_r: int) -> None:
        while True:
            for sock, _ in self.poller.poll(self._timeout_ms()):
                if sock is self.clients:
                    self._drain(self.clients, self._on_client)
                elif sock is self.workers:
                    self._drain(self.workers, self._on_worker)
                elif sock == wake_r:
                    self._on_signals(_read_all(wake_r))
                elif sock in self.by_sentinel:
                    self._on_worker_exit(self.by_sentinel.pop(sock))
            now = time.monotonic()
            self._watchdog(now)
            self.arenas.reap(now)
            self._restart_due(now)
            for model in self.models.values():
                if len(model.batcher):
                    for p in model.batcher.expire():  # a timer, not the end of a running batch
                        self.dispatch.reply_error(model, p.item, errors.Timeout("Request timeout expired"))
                    self.dispatch.schedule(model)
            self._announce_ready()
            if self.grace_until is not None and now >= self.grace_until:
                self._begin_stop()
            if self.stopping and self._drained(now):
                return

    def _timeout_ms(self) -> int:
        deadlines = [m.deadline() for m in self.models.values()]
        workers = self.supervisor.workers.values()
        deadlines += [w.restart_at for w in workers if w.restart_at is not None]
        deadlines += [w.progress_at + self.models[w.model].exec_timeout_s for w in workers
                      if w.inflight and w.state == READY]
        if len(self.arenas):
            deadlines.append(self.arenas.check_at)
        if self.drain_deadline is not None:
            deadlines.append(self.drain_deadline)
        if self.grace_until is not None:
            deadlines.append(self.grace_until)
        deadlines = [d for d in deadlines if d is not None]
        if not deadlines:
            return -1
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _drain(self, sock: zmq.Socket, handle: Callable[[list], None]) -> None:
        for _ in range(MAX_MESSAGES_PER_WAKE):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    # -- clients -------------------------------------------------------------------------
    def _on_client(self, frames: list) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            return
        try:
            msg = protocol.decode(frames[1].buffer)
        except protocol.ProtocolError as exc:
            log.warning("dropping a bad message: %s", exc)
            self._send(identity, protocol.Error(0, errors.ProtocolMismatch.code, str(exc)))
            return
        req_id = getattr(msg, "req_id", 0)
        try:
            reply = self._handle(identity, msg, frames[2:])
        except errors.GepoolError as exc:
            reply = protocol.Error(req_id, exc.code, exc.message)
        except Exception as exc:  # a bug must not take the pool down; the client hears INTERNAL
            log.exception("internal error handling %s", type(msg).__name__)
            reply = protocol.Error(req_id if isinstance(req_id, int) else 0, "INTERNAL", f"internal error: {exc}")
        if reply is not None:
            self._send(identity, reply)

    def _handle(self, identity: bytes, msg, frames: list):
        if isinstance(msg, protocol.Infer):
            return self._infer(identity, msg, frames)
        if isinstance(msg, protocol.Hello):
            if msg.version != protocol.PROTOCOL_VERSION:
                raise errors.ProtocolMismatch(f"client speaks protocol {msg.version}, "
                                              f"this pool {protocol.PROTOCOL_VERSION}")
            return protocol.Welcome(msg.req_id, protocol.PROTOCOL_VERSION, self.opts.owner_id, SERVER_NAME)
        if isinstance(msg, protocol.Query):
            return protocol.Reply(msg.req_id, self._query(msg.what, msg.args))
        if isinstance(msg, protocol.RegisterArena):
            return protocol.Reply(msg.req_id, {"arena": self.arenas.register(identity, msg.name, msg.size)})
        if isinstance(msg, protocol.UnregisterArena):
            return protocol.Reply(msg.req_id, {"unregistered": self.arenas.unregister(msg.arena)})
        raise errors.InvalidArgument(f"{type(msg).__name__} is not a request a client may send")

    def _infer(self, identity: bytes, msg: protocol.Infer, frames: list) -> None:
        if not isinstance(msg.req_id, int) or not isinstance(msg.model, str):
            raise errors.InvalidArgument("req_id must be an integer and model a string")
        if self.stopping:
            raise errors.Unavailable("the pool is shutting down")
        model = self.models.get(msg.model)
        if model is None:
            raise errors.ModelNotFound(f"Request for unknown model: '{msg.model}' is not found "
                                       f"(this pool serves {sorted(self.models)})")
        model.check_servable(msg.version)
        req = admit(msg, identity, frames, model.config, model.slot_bytes, self.arenas, time.monotonic())
        priority = msg.priority if isinstance(msg.priority, int) else 0
        timeout_us = msg.timeout_us if isinstance(msg.timeout_us, int) else 0
        if not model.batcher.add(req, req.rows, req.key, priority, timeout_us):
            raise errors.Unavailable(f"Exceeds maximum queue size (model '{model.name}')")
        return None

    def _query(self, what: str, args: dict) -> dict:
        if what == "status":
            return self.status()
        if what == "stats":
            return {name: m.stats.as_dict() for name, m in self.models.items()}
        if what in ("metadata", "config"):
            name = args.get("model") if isinstance(args, dict) else None
            model = self.models.get(name)
            if model is None:
                raise errors.ModelNotFound(f"Request for unknown model: '{name}' is not found")
            if what == "metadata":
                return model.metadata()
            if model.config is None:
                raise errors.ModelNotReady(f"model '{name}' has no valid config: {model.reason}")
            return render_config(model.config.source, name)
        raise errors.InvalidArgument(f"unknown query '{what}' (status, stats, metadata, config)")

    def status(self) -> dict:
        return {"pool_id": self.opts.owner_id, "endpoint": self.opts.endpoint,
                "stopping": self.stopping or self.grace_until is not None,
                "arenas": len(self.arenas), "pid": os.getpid(),
                "models": {name: m.summary() for name, m in self.models.items()}}

    def _send(self, identity: bytes, msg, frames: list = ()) -> None:
        self.clients.send_multipart([identity, msg.encode(), *frames], copy=False)

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
        if isinstance(msg, protocol.Done):
            self.dispatch.complete(self.models[w.model], w, msg)
        elif isinstance(msg, protocol.WorkerReady):
            self.supervisor.on_ready(w, msg)
            self.models[w.model].worker_info(msg.info)
            self._refresh(self.models[w.model])
            log.info("worker %d (%s) ready", w.id, w.model)
        elif isinstance(msg, protocol.WorkerFailed):
            w.reason = msg.reason

    def _on_worker_exit(self, w: Worker) -> None:
        self.poller.unregister(w.sentinel)
        model = self.models[w.model]
        lost = self.supervisor.on_exit(w, time.monotonic(), self.stopping)
        can_retry = not self.stopping and any(o.state == READY for o in model.workers if o is not w)
        err = errors.WorkerDied(f"the worker running model '{w.model}' died ({w.reason}) while executing "
                                f"this request")
        for batch in sorted(lost.values(), key=lambda b: b.seq, reverse=True):  # oldest ends up first
            self.dispatch.recover(model, batch, err, can_retry)
        self._refresh(model)

    def _watchdog(self, now: float) -> None:
        """A worker that has held a batch past its model's execution timeout is hung: that batch is
        answered now, the worker is killed, and its death path replaces it and retries the rest."""
        for w in self.supervisor.workers.values():
            model = self.models[w.model]
            if w.state != READY or not w.inflight or now - w.progress_at < model.exec_timeout_s:
                continue
            head = min(w.inflight.values(), key=lambda b: b.seq)
            del w.inflight[head.slot]
            w.rows -= head.rows
            timeout_ms = round((model.exec_timeout_s) * 1000)
            self.dispatch.fail_batch(model, head, errors.WorkerDied(
                f"model '{w.model}' did not finish a batch within {timeout_ms} ms (execution_timeout_ms); "
                f"its worker was killed and is being replaced"))
            w.reason = "hung: killed by the watchdog"
            log.error("worker %d (%s) hung; killing it", w.id, w.model)
            w.process.kill()

    def _restart_due(self, now: float) -> None:
        if self.stopping:
            return
        for w in list(self.supervisor.workers.values()):
            if w.restart_at is not None and w.restart_at <= now:
                self._spawn(w)

    def _announce_ready(self) -> None:
        if self._announced or any(w.state == STARTING for w in self.supervisor.workers.values()):
            return
        self._announced = True
        if self.on_ready is not None:
            self.on_ready(self.status())

    def _refresh(self, model: Model) -> None:
        model.refresh_state()
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
        busy = any(len(m.batcher) for m in self.models.values()) or any(
            w.inflight for w in self.supervisor.workers.values())
        if busy and now < self.drain_deadline and any(w.state == READY for w in self.supervisor.workers.values()):
            return False
        return True

    def _shutdown(self) -> None:
        unavailable = errors.Unavailable("the pool stopped before this request ran")
        for model in self.models.values():
            if not hasattr(self, "dispatch"):
                break
            self.dispatch.fail_queued(model, unavailable)
            for w in model.workers:
                for batch in list(w.inflight.values()):
                    self.dispatch.fail_batch(model, batch, unavailable)
                w.inflight.clear()
        self.supervisor.stop_all(lambda w: self.workers.send_multipart(
            [b"w%d" % w.id, protocol.Stop().encode()]))
        self.arenas.close()
        for sock in (getattr(self, "clients", None), getattr(self, "workers", None)):
            if sock is not None:
                sock.close(0)
        if getattr(self, "auth", None) is not None:
            self.auth.stop()
        self.ctx.term()
        for endpoint in (self.opts.endpoint, self.worker_endpoint):
            if endpoint.startswith("ipc://"):
                try:
                    os.unlink(endpoint[len("ipc://"):])
                except FileNotFoundError:
                    pass


def _runtime_dir() -> str:
    from gepool.ipc.sockets import default_endpoint

    return os.path.dirname(default_endpoint()[len("ipc://"):])


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
