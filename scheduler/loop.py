"""The front's loop: the wait (an epoll, wait.py), signals and the stop sequence, around the core."""

import logging
import os
import signal
import time
from collections.abc import Callable

import zmq

from gepool.common import errors
from gepool.common.config import ModelConfig
from gepool.common.logsettings import LogSettings
from gepool.ipc import protocol
from gepool.ipc.sockets import make_socket, runtime_dir
from gepool.scheduler.books import Worker
from gepool.scheduler.channels import Channels, ZmqChannel, open_lanes
from gepool.scheduler.core import MESSAGE_HEADROOM, Core
from gepool.scheduler.lograte import Limited
from gepool.scheduler.options import FrontOptions, queued_bytes_limit
from gepool.scheduler.status import Peers
from gepool.scheduler.supervisor import StartWorker, Supervisor
from gepool.scheduler.wait import Waiter

log = logging.getLogger("gepool.front")
limited = Limited(log)  # what another process's bytes make the front say

MAX_MESSAGES_PER_WAKE = 256  # so a flood of clients cannot starve the workers' completions
TICK_S = 0.05  # housekeeping cadence while requests and completions keep the loop busy (how late, at most,
# a hung batch is noticed or a replaced generation stopped under load)


class Loop:
    """One wait (``wait.py``: an epoll) over the channels, the workers' socket, sentinels and doorbells,
    and signals. Every blocking wait is that one, until the core's nearest deadline. Signal handlers only
    write to a wake-up pipe. The loop feeds the core its events, performs the core's actions (it is the
    core's outbox), and runs the sequence running -> draining -> stopping."""

    def __init__(self, options: FrontOptions, start_worker: StartWorker,
                 on_ready: Callable[[dict], None] | None = None, *,
                 place: Callable[[ModelConfig], list[tuple[str, int]]]) -> None:
        """``start_worker`` spawns a worker, ``place(config)`` says which workers a model needs: both come
        from the face, which knows the backends."""
        self.opts, self.on_ready, self.place = options, on_ready, place
        self.ctx = zmq.Context()
        self.worker_endpoint = f"ipc://{runtime_dir()}/gepool-{options.owner_id}.workers"
        self.supervisor = Supervisor(options.owner_id, self.worker_endpoint, start_worker, options.log_settings(),
                                     runtime_dir())
        self.by_sentinel: dict[int, Worker] = {}
        self.by_bell: dict[int, Worker] = {}
        # opened by run(), closed by _shutdown() (None: not opened)
        self.channels: Channels | None = None
        self.workers: zmq.Socket | None = None
        self.worker_channel: ZmqChannel | None = None  # the workers' socket, read and written as a channel
        self.core: Core | None = None
        self.auth = None
        self.waiter = Waiter()
        self.log_changed: LogSettings | None = None  # log settings changed at run time (None: as started)
        self.reply: Callable[..., None]  # the outbox's reply: the channels' own, bound once they are open

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> int:
        """Serves until SIGINT/SIGTERM; returns the process exit code."""
        _refuse_live_pool(self.ctx, self.opts.endpoint)
        _raise_fd_limit()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_fd = signal.set_wakeup_fd(wake_w)
        old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._open(wake_r)
            self.core.start()
            self._loop(wake_r)
        finally:
            self._shutdown()
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
        return 0

    def _open(self, wake_r: int) -> None:
        """The sockets, then the core that answers through them."""
        # libzmq allocates a frame as its header declares, before its bytes arrive: a frame larger than all
        # queues may hold could never be admitted, and is refused (its peer disconnected) at its header
        most = queued_bytes_limit(self.opts.max_queued_bytes) + MESSAGE_HEADROOM
        clients = make_socket(self.ctx, zmq.ROUTER, bind=self.opts.endpoint, curve_server=self._curve(),
                              max_frame=most)
        zmq_channel = ZmqChannel(clients, None)
        try:
            # tcp://HOST:* binds a free port; from here on the endpoint is the one actually bound
            self.opts.endpoint = clients.getsockopt_string(zmq.LAST_ENDPOINT)
            lanes = open_lanes(self.opts.endpoint, bool(self.opts.curve_secret_key), None)
        except BaseException:
            zmq_channel.close()  # an open socket would keep the context's term() waiting
            raise
        self.channels = Channels(zmq_channel, lanes)
        self.workers = make_socket(self.ctx, zmq.ROUTER, bind=self.worker_endpoint)
        self.worker_channel = ZmqChannel(self.workers, self._on_worker_message, "a worker")
        self.reply = self.channels.reply  # the outbox's reply, one call on the hot path
        self.core = Core(self.opts, self)
        if lanes is not None:
            self.core.peers = Peers(lanes.__len__, lanes.pids)
            self.core.arenas.peer = lanes.peer
            lanes.limit = self.core.message_limit
            self.core.dispatch.settle = lanes.settle  # a lane's reply may view a slot until then
        for ch in self.channels.all:
            ch.on_message = self.core.on_message
        self.clients_fd = self.waiter.add_zmq(zmq_channel)
        if lanes is not None:
            self.waiter.add(lanes.fileno())
        self.workers_fd = self.waiter.add_zmq(self.worker_channel)
        self.waiter.add(wake_r)

    def _curve(self) -> tuple[bytes, bytes] | None:
        if not self.opts.curve_secret_key:
            return None
        from gepool.scheduler.curve import start_curve

        self.auth, keys = start_curve(self.ctx, self.opts.curve_secret_key, self.opts.curve_authorized_keys)
        return keys

    def _loop(self, wake_r: int) -> None:
        """Requests and completions (the hot events) only schedule the models they touched; everything
        else (watchdog, restarts, arenas, model control, readiness, timers) runs in the core's tick,
        after any other event, when a housekeeping deadline passes, and at least every TICK_S while hot
        events keep coming. A wait that ended for a model's queue timer only schedules the queued models."""
        core, zmq_channel, lanes = self.core, self.channels.zmq, self.channels.lanes
        clients, lanes_fd = self.clients_fd, lanes.fileno() if lanes is not None else -1
        by_bell, dirty, schedule = self.by_bell, core.dirty, core.schedule
        next_tick, dirty_since_tick = 0.0, False
        if self._tick(time.monotonic()):  # once before any event: with no worker to wait for, ready now
            return
        while True:
            if lanes is not None:
                lanes.flush()  # the replies this pass made, one record per lane, before any wait
            events = self._wait(next_tick if dirty_since_tick else None)
            tick = False
            for fd, _ in events:
                if fd == lanes_fd:
                    lanes.receive(MAX_MESSAGES_PER_WAKE)
                elif fd == clients:
                    zmq_channel.receive(MAX_MESSAGES_PER_WAKE)
                elif fd in by_bell:
                    w = by_bell[fd]
                    records = w.bell.completions()
                    if records is None:  # the worker closed its end: it is exiting, and its sentinel will say so
                        self._forget_bell(w)
                    else:
                        core.on_completions(w, records)
                else:
                    tick = True
                    if fd == self.workers_fd:
                        self.worker_channel.receive(MAX_MESSAGES_PER_WAKE)
                    elif fd == wake_r:
                        self._on_signals(_read_all(wake_r))
                    elif fd in self.by_sentinel:
                        self._on_exit(fd, self.by_sentinel.pop(fd))
            now = time.monotonic()
            if tick or now >= next_tick or not events and self._housekeeping_due(now):
                next_tick, dirty_since_tick = now + TICK_S, False
                if self._tick(now):
                    return
            else:
                dirty_since_tick = True
                schedule(dirty | core.queued)
                dirty.clear()

    def _housekeeping_due(self, now: float) -> bool:
        """A deadline of the tick's has passed (the core's housekeeping, or the lanes' paused accepting)."""
        lanes, wake_at = self.channels.lanes, self.core.wake_at
        resume_at = lanes.resume_at if lanes is not None else None
        return (wake_at is not None and now >= wake_at) or (resume_at is not None and now >= resume_at)

    def _tick(self, now: float) -> bool:
        if self.channels.lanes is not None:
            self.channels.lanes.resume(now)
        return self.core.tick(now)

    # -- waiting ---------------------------------------------------------------------------
    def _wait(self, next_tick: float | None) -> list:
        """The next events, polled for while one is expected within microseconds (``polling.py`` says
        when), slept for otherwise."""
        core, lanes, waiter = self.core, self.channels.lanes, self.waiter
        events = waiter.stale()
        if events:
            return events
        at = core.next_deadline(next_tick, lanes.resume_at if lanes is not None else None)
        now = time.monotonic()
        sequential = core.polling.enabled and core.dispatch.last_batch_requests <= 1  # the last batch: one request
        until, window = core.polling.until(now, sequential, core.workers.busy() if sequential else 0)
        if until > now and (at is None or at > now):
            until = until if at is None else min(until, at)
            poll = waiter.ready
            while time.monotonic() < until:
                events = poll(0)
                if events:
                    return events
                os.sched_yield()  # sharing a CPU with the worker or client it waits for, let it run
            if window:
                core.polling.missed()
        return waiter.sleep(at)

    # -- events from workers ---------------------------------------------------------------
    def _on_worker_message(self, identity: bytes, parts: list) -> None:
        try:
            msg = protocol.decode(parts[0])
        except protocol.ProtocolError as exc:
            limited.log(logging.ERROR, "bad", identity, "bad message from a worker: %s", exc)
            return
        try:
            w = self.core.workers.get(getattr(msg, "worker", None))
            if w is not None and isinstance(msg, protocol.WorkerReady):
                self.supervisor.mapped(w)
                if self.log_changed is not None:  # spawned before the change reached it, perhaps
                    self._send_logging(w, self.log_changed)
            self.core.on_worker_message(msg)
        except Exception:  # a bug here must not take every model down; the log keeps the traceback
            log.exception("internal error handling %s from a worker", type(msg).__name__)

    def _on_bell(self, w: Worker) -> None:
        records = w.bell.completions() if w.bell is not None else None
        if records is None:  # the worker closed its end: it is exiting, and its sentinel will say so
            self._forget_bell(w)
            return
        self.core.on_completions(w, records)

    def _forget_bell(self, w: Worker) -> None:
        for fd in [fd for fd, o in self.by_bell.items() if o is w]:
            self.waiter.remove(fd)
            del self.by_bell[fd]

    def _on_exit(self, sentinel: int, w: Worker) -> None:
        # what it said before dying (a "cannot load" report) counts first
        self.worker_channel.receive(MAX_MESSAGES_PER_WAKE)
        self._on_bell(w)  # and what it finished
        self._forget_bell(w)
        self.waiter.remove(sentinel)
        self.core.on_worker_exit(w, self.supervisor.reap(w))

    def _on_signals(self, received: bytes) -> None:
        """SIGTERM with a grace period: not ready at once, still serving until the grace ends, then the
        drain. SIGINT, or no grace: the drain at once."""
        if signal.SIGTERM in received and self.opts.exit_grace_s > 0 and not self.core.stopping:
            self.core.begin_grace()
            return
        self.core.begin_stop()

    # -- the outbox: what the core asks for ------------------------------------------------
    def spawn(self, w: Worker) -> None:
        self.supervisor.spawn(w)
        sentinel = w.process.sentinel
        self.by_sentinel[sentinel] = w
        self.waiter.add(sentinel)
        self.by_bell[w.bell.done_fd] = w
        self.waiter.add(w.bell.done_fd)

    def stop(self, w: Worker) -> None:
        self._send_worker(w, protocol.Stop())

    def kill(self, w: Worker) -> None:
        if w.process is not None:
            w.process.kill()

    def drop_arena(self, w: Worker, name: str) -> None:
        self._send_worker(w, protocol.DropArena(name))

    def log_settings(self, settings: LogSettings) -> None:
        settings.apply()
        self.supervisor.log = settings
        self.log_changed = settings
        for w in self.core.workers.values():
            if w.process is not None:  # one still loading reads it once it serves; one not yet connected, on ready
                self._send_logging(w, settings)

    def _send_logging(self, w: Worker, settings: LogSettings) -> None:
        self._send_worker(w, protocol.SetLogging(settings.level, settings.verbose, settings.format))

    def ready(self, status: dict) -> None:
        if self.on_ready is not None:
            self.on_ready(status)

    def _send_worker(self, w: Worker, msg) -> None:
        self.worker_channel.send(b"w%d" % w.id, [msg.encode()])

    # -- shutdown --------------------------------------------------------------------------
    def _shutdown(self) -> None:
        if self.core is not None:
            self.core.close()
            self.supervisor.stop_all(self.core.workers.values(), self.stop)
        if self.channels is not None:
            self.channels.close()
        if self.workers is not None:
            self.workers.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.waiter.close()
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
