"""The synchronous library client: blocking ``infer`` per thread, and futures for many in flight."""

import collections
import concurrent.futures
import os
import socket
import threading
import time
import weakref

import numpy as np
import zmq

from gepool import _wire
from gepool.arena import ArenaFull
from gepool.clientcore import CONNECT_TIMEOUT_S, DEFAULT_ARENA_BYTES, DEFAULT_TIMEOUT_S, WATCH_S, ClientCore, Inflight
from gepool.common import errors
from gepool.ipc import lane as _lane
from gepool.ipc import zmqio
from gepool.ipc.sockets import make_socket

__all__ = ["CONNECT_TIMEOUT_S", "DEFAULT_ARENA_BYTES", "DEFAULT_TIMEOUT_S", "Client"]
WATCH_MS = int(WATCH_S * 1000)


class Client(ClientCore):
    """Talks to a pool over ZMQ. ``infer`` blocks its calling thread (each thread gets its own socket,
    so threads never wait on each other); ``infer_async`` returns a Future served by one I/O thread.

    With ``shared_memory=True`` the client registers an arena with the front and places tensors
    there, so only offsets cross the socket (same host only); an input made with ``empty`` is not
    even copied. Output arrays are read-only views, never copies: of the received message, or of the
    arena where the front wrote them (their arena bytes are reused once the arrays are collected).

    With an ipc endpoint, ``infer`` and the queries go over a lane (ipc/lane.py: a Unix socket beside
    the endpoint, one per thread) unless ``lane=False``; ZMQ serves whatever a lane cannot.
    """

    def __init__(self, endpoint: str | None = None, *, shared_memory: bool = False,
                 arena_bytes: int = DEFAULT_ARENA_BYTES, timeout: float | None = DEFAULT_TIMEOUT_S,
                 connect_timeout: float = CONNECT_TIMEOUT_S, curve_server_key: str | None = None,
                 curve_client_key: str | None = None, lane: bool = True,
                 arena_min_bytes: int = _wire.ARENA_MIN) -> None:
        """``curve_server_key``: the pool's certificate (public part is enough) to talk CURVE over tcp;
        ``curve_client_key``: this client's certificate when the pool only admits known keys.
        ``arena_min_bytes``: with ``shared_memory``, smaller requests travel as frames (faster for them)."""
        super().__init__(endpoint, shared_memory=shared_memory, arena_bytes=arena_bytes, timeout=timeout,
                         curve_server_key=curve_server_key, curve_client_key=curve_client_key, lane=lane,
                         arena_min_bytes=arena_min_bytes)
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        # a thread's lane lives in its thread-local: when the thread ends the lane closes, and the
        # front's descriptor with it (a client shared by short-lived threads would pile them up)
        self._lanes: weakref.WeakSet[_lane.Connection] = weakref.WeakSet()
        self._io: _IoThread | None = None
        self._register_lock = threading.Lock()
        try:
            self._check_endpoint()
            self.pool_id = self._call(self._hello(), connect_timeout, what="connecting").pool_id
            if shared_memory:
                self._registered(self._call(self._register()))
        except BaseException:
            self.close()
            raise

    # -- requests ------------------------------------------------------------------------
    def infer(self, model: str, inputs: dict, outputs: list[str] | None = None, *, version: int | None = None,
              timeout: float | None = None) -> dict:
        """Runs one request and returns {output name: ndarray} (its ``model_version`` attribute: the version
        that ran the request); raises a GepoolError subclass on failure."""
        wait = self.timeout if timeout is None else timeout
        for attempt in (1, 2):
            arena_id = self._arena_id
            out = self._encode(model, inputs, outputs, version, timeout)
            try:
                msg, frames = self._exchange(out.frames, out.req_id, wait, model)
            except BaseException:
                self._orphan(out)
                raise
            try:
                return _wire.result(msg, frames, self.arena, out)
            except errors.InvalidArgument as exc:
                if attempt == 2 or not self._arena_lost(exc):
                    raise
                with self._register_lock:  # one thread registers again; the others find it done
                    if self._arena_id == arena_id:
                        self._registered(self._call(self._register()))
            finally:
                out.release(self.arena)
        raise AssertionError("unreachable")

    def infer_async(self, model: str, inputs: dict, outputs: list[str] | None = None, *,
                    version: int | None = None, timeout: float | None = None) -> concurrent.futures.Future:
        """Sends at once; the Future resolves to the outputs or to the error."""
        out = self._encode(model, inputs, outputs, version, timeout)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        io = self._io or self._io_thread()
        io.submit(out, fut, self.timeout if timeout is None else timeout)
        return fut

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised array in this client's shared-memory arena: fill it and pass it as an input,
        and the request carries its offset instead of a copy (the large-tensor path). Its bytes return
        to the arena when the array is collected."""
        if self.arena is None:
            raise errors.InvalidArgument("empty() needs a client made with shared_memory=True")
        try:
            return self.arena.empty(shape, dtype)
        except ArenaFull as exc:
            raise errors.InvalidArgument(str(exc)) from None

    def model_metadata(self, model: str) -> dict:
        return self._call(self._query("metadata", {"model": model}))

    _metadata = model_metadata

    def status(self) -> dict:
        return self._call(self._query("status", {}))

    def stats(self) -> dict:
        return self._call(self._query("stats", {}))

    # -- plumbing ------------------------------------------------------------------------
    def load(self, model: str, timeout: float | None = None) -> dict:
        """Loads or reloads a model and returns once the new generation serves (or raises why it could not);
        requests keep flowing to the old one meanwhile."""
        return self._call(self._query("load", {"model": model}), timeout)

    def unload(self, model: str) -> dict:
        """Stops routing to the model; what it has queued or running finishes, then its workers stop."""
        return self._call(self._query("unload", {"model": model}))

    def query(self, what: str, args: dict | None = None):
        """A front query by name: status, stats, metadata or config (args: {"model": name})."""
        return self._call(self._query(what, args or {}))

    def _call(self, msg, timeout: float | None = None, what: str = "request"):
        found, frames = self._exchange([msg.encode()], msg.req_id, self.timeout if timeout is None else timeout,
                                       what)
        return _wire.result(found, frames, self.arena)

    def _socket(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = make_socket(self._ctx, zmq.DEALER, connect=self.endpoint, curve_client=self._curve)
            with self._lock:
                self._sockets.append(sock)
            self._local.sock = sock
        return sock

    def _lane_conn(self) -> _lane.Connection | None:
        conn = getattr(self._local, "lane", None)
        if conn is not None:
            return conn
        conn = self._dialer.connect()
        if conn is None:  # no pool there yet, or one without lanes: ZMQ, which also waits for a pool
            return None
        with self._lock:
            self._lanes.add(conn)
        self._local.lane = conn
        return conn

    def _drop_lane(self, conn: _lane.Connection) -> None:
        self._local.lane = None
        with self._lock:
            self._lanes.discard(conn)
        conn.close()

    def _exchange_lane(self, conn: _lane.Connection, frames: list, req_id: int, timeout: float | None, what: str):
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            try:
                conn.send(frames, timeout)
            except TimeoutError:
                self._drop_lane(conn)  # the pool stopped reading, maybe mid-message: the framing is lost
                raise
            except OSError:  # the pool behind this lane is gone and never saw the request
                self._drop_lane(conn)
                if self._stopped():
                    raise self._gone(what) from None
                return self._exchange(frames, req_id, timeout, what, lane=False)  # ZMQ, to a new pool maybe
            except _lane.LaneError:  # more parts than a lane frames: nothing went, ZMQ takes it
                return self._exchange(frames, req_id, timeout, what, lane=False)
            while True:  # a receive that times out keeps its place: the lane stays usable
                msg, rest = _wire.decode(conn.recv(deadline))
                if getattr(msg, "req_id", None) == req_id:
                    return msg, rest
                self._late_reply(getattr(msg, "req_id", None))
        except TimeoutError:
            raise self._no_answer(timeout, what) from None
        except (EOFError, OSError, _lane.LaneError) as exc:
            self._drop_lane(conn)
            raise self._hung_up(what, exc) from None

    def _exchange(self, frames: list, req_id: int, timeout: float | None, what: str, lane: bool = True):
        conn = self._lane_conn() if lane else None
        if conn is not None:
            return self._exchange_lane(conn, frames, req_id, timeout, what)
        sock = self._socket()
        zmqio.send_parts(sock, frames)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = WATCH_MS if deadline is None else int((deadline - time.monotonic()) * 1000)
            if wait > WATCH_MS or wait < 0:
                wait = WATCH_MS if wait > 0 else 0
            sock.setsockopt(zmq.RCVTIMEO, wait)
            try:
                parts = zmqio.recv_parts(sock)  # a blocking receive: one call where poll + recv took two
            except zmq.Again:
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._no_answer(timeout, what) from None
                if self._stopped():
                    raise self._gone(what) from None
                continue
            msg, rest = _wire.decode(parts)
            if getattr(msg, "req_id", None) == req_id:
                return msg, rest
            self._late_reply(getattr(msg, "req_id", None))  # to a request that timed out here

    def _io_thread(self) -> "_IoThread":
        with self._lock:
            if self._io is None:
                if self._closed:
                    raise errors.InvalidArgument("the client is closed")
                self._io = _IoThread(self)
                self._io.start()
            return self._io

    def close(self) -> None:
        """Stops the I/O thread, closes every socket and unmaps the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._io is not None:
            self._io.stop()
        if self.arena is not None:
            unregister = self._unregister()
            if unregister is not None:
                try:
                    self._call(unregister, 2.0)
                except errors.GepoolError:
                    pass
            self.arena.close()
        with self._lock:
            for sock in self._sockets:
                sock.close(0)
            self._sockets.clear()
            for conn in list(self._lanes):
                conn.close()
            self._lanes.clear()
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _IoThread(threading.Thread):
    """Owns one ZMQ socket and, beside an ipc endpoint, a lane (preferred while it works). Another
    thread's request goes straight onto the lane when nothing waits to go before it: waking this
    thread through the pipe to send it cost a second wake-up per request (an open-loop sender paid
    two per arrival). Otherwise callers hand it requests through a deque and a wake-up pipe.
    ``send_lock`` keeps one message's records together on the lane and orders the two paths."""

    def __init__(self, core: Client) -> None:
        super().__init__(name="gepool-client-io", daemon=True)
        self.core = core
        self.outbox: collections.deque = collections.deque()
        self.pending = Inflight()  # req_id -> (out, fut, deadline, sent over the lane)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stopping = False
        self.lane: _lane.Connection | None = None
        self.lane_fd = -1
        self.send_lock = threading.Lock()
        self.ended = False  # the loop has failed what it held: nothing may be added to pending now
        self.wait_until: float | None = None  # the earliest deadline (or endpoint look) the loop's poll wakes for
        self.wakes = 0  # pipe writes for requests: what straight sends save

    def submit(self, out: _wire.Outgoing, fut, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if threading.get_ident() == self.ident:  # a future's callback runs here: the loop sends it
            self.outbox.append((out, fut, deadline))
            return
        with self.send_lock:
            if self.ended:
                out.release(self.core.arena)
                fut.set_exception(errors.Unavailable("the client is closed"))
                return
            if self._send_now(out, fut, deadline):
                if deadline is None or (self.wait_until is not None and deadline >= self.wait_until):
                    return  # the loop's poll wakes for an earlier deadline anyway
            else:
                self.outbox.append((out, fut, deadline))
            self.wakes += 1
        os.write(self.wake_w, b"x")

    def _send_now(self, out: _wire.Outgoing, fut, deadline: float | None) -> bool:
        """Another thread's request onto the lane, under ``send_lock``: False leaves it to the loop (no
        lane yet, requests queued before it, or a send that failed, which the loop then handles)."""
        lane = self.lane
        if lane is None or self.outbox or self.stopping:
            return False
        self.pending[out.req_id] = (out, fut, deadline, True)
        try:
            lane.send(out.frames, None)
            return True
        except (OSError, _lane.LaneError):
            del self.pending[out.req_id]
            return False

    def stop(self) -> None:
        self.stopping = True
        os.write(self.wake_w, b"x")
        self.join()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def run(self) -> None:
        core = self.core
        sock = make_socket(core._ctx, zmq.DEALER, connect=core.endpoint, curve_client=core._curve)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        try:
            while not self.stopping:
                events = dict(poller.poll(0 if self.outbox else self._wait_ms()))
                if self.wake_r in events:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                self._flush(sock, poller)
                if sock in events:
                    self._receive(sock, poller)
                if self.lane is not None and self.lane_fd in events:
                    self._receive_lane(sock, poller)
                if self.wait_until is not None and time.monotonic() >= self.wait_until:
                    self._expire()
        finally:
            with self.send_lock:
                self.ended = True
            for out, fut, _, _ in list(self.pending.values()):
                out.release(core.arena)
                fut.set_exception(errors.Unavailable("the client was closed before the reply arrived"))
            while self.outbox:  # never sent, some by the callbacks just run: they fail too, not hang
                out, fut, _ = self.outbox.popleft()
                out.release(core.arena)
                fut.set_exception(errors.Unavailable("the client was closed before the request was sent"))
            sock.close(0)
            if self.lane is not None:
                self.lane.close()

    def _flush(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        if not self.outbox:
            return
        with self.send_lock:
            if self.lane is None:
                self._connect_lane(poller)
            pending, outbox = self.pending, self.outbox
            while outbox:
                out, fut, deadline = outbox.popleft()
                if self.lane is not None:
                    pending[out.req_id] = (out, fut, deadline, True)
                    try:
                        self.lane.send(out.frames, None)
                        continue
                    except OSError as exc:  # the pool behind it is gone and never saw this one
                        self._lose_lane(poller, exc)
                    except _lane.LaneError:  # more parts than a lane frames: nothing went
                        pass
                pending[out.req_id] = (out, fut, deadline, False)
                zmqio.send_parts(sock, out.frames)  # the next poll's wait includes a look at the endpoint

    def _connect_lane(self, poller: zmq.Poller) -> None:
        self.lane = self.core._dialer.connect()
        if self.lane is not None:
            self.lane_fd = self.lane.sock.fileno()  # kept: a send cut short closes the socket (fileno -1)
            poller.register(self.lane_fd, zmq.POLLIN)

    def _lose_lane(self, poller: zmq.Poller, exc: BaseException) -> None:
        """Requests that went over the lane will hear nothing more: they fail now, not at their deadline.
        Called holding ``send_lock``."""
        poller.unregister(self.lane_fd)
        self.lane.close()
        self.lane = None
        self.core._dialer.failed()
        for req_id, (out, fut, _, _) in self.pending.carried(True):
            self.core._orphan(out)
            fut.set_exception(self.core._hung_up(f"request {req_id}", exc))

    # Each reply's callbacks may send the next requests (a closed loop): they go out before the next
    # reply is read, so the front gets the first of them while it is still sending the rest.
    def _receive_lane(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        while self.lane is not None:
            try:
                parts = self.lane.receiver.recv(self.lane.sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except (EOFError, OSError, _lane.LaneError) as exc:
                with self.send_lock:
                    self._lose_lane(poller, exc)
                return
            if parts is not None:
                self._deliver(parts)
                self._flush(sock, poller)

    def _receive(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        while True:
            try:
                frames = zmqio.recv_parts(sock, zmqio.NOBLOCK)
            except zmq.Again:
                return
            self._deliver(frames)
            self._flush(sock, poller)

    def _deliver(self, frames: list) -> None:
        msg, rest = _wire.decode(frames)
        req_id = getattr(msg, "req_id", None)
        entry = self.pending.pop(req_id, None)
        if entry is None:
            self.core._late_reply(req_id)
            return
        out, fut, _, _ = entry
        arena = self.core.arena
        try:
            fut.set_result(_wire.result(msg, rest, arena, out))
        except Exception as exc:
            fut.set_exception(exc)
        finally:
            out.release(arena)

    def _wait_ms(self) -> int:
        with self.send_lock:  # a straight send then either is in pending here or sees what this waits for
            self.wait_until = self.pending.next_wake(time.monotonic()) if self.pending else None
        if self.wait_until is None:
            return -1
        return max(0, int((self.wait_until - time.monotonic()) * 1000) + 1)

    def _expire(self) -> None:
        core, now = self.core, time.monotonic()
        for req_id, (out, fut, _, _) in self.pending.expired(now):
            core._orphan(out)
            fut.set_exception(core._late(req_id))
        if core._stopped():
            for req_id, (out, fut, _, _) in self.pending.carried(False):
                core._orphan(out)
                fut.set_exception(core._gone(f"request {req_id}"))
