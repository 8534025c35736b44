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
from gepool.arena import ArenaFull, ClientArena
from gepool.common import errors
from gepool.ipc import lane as _lane
from gepool.ipc import protocol, zmqio
from gepool.ipc.sockets import default_endpoint, ipc_path, make_socket

DEFAULT_TIMEOUT_S = 120.0  # never wait forever on a pool that vanished
CONNECT_TIMEOUT_S = 10.0
DEFAULT_ARENA_BYTES = 64 << 20


class Client:
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
        self.arena_min_bytes = arena_min_bytes
        self.endpoint = endpoint or default_endpoint()
        self._curve = _wire.curve_client(curve_server_key, curve_client_key)
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._dialer = _lane.Dialer(ipc_path(self.endpoint), lane and self._curve is None)
        # a thread's lane lives in its thread-local: when the thread ends the lane closes, and the
        # front's descriptor with it (a client shared by short-lived threads would pile them up)
        self._lanes: weakref.WeakSet[_lane.Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._io: _IoThread | None = None
        self._meta: dict[str, dict] = {}
        self._orphans: dict[int, _wire.Outgoing] = {}
        self._closed = False
        self.arena: ClientArena | None = None
        self._arena_id = protocol.NO_ARENA
        try:
            welcome = self._call(protocol.Hello(_wire.next_id(), protocol.PROTOCOL_VERSION, f"pid{os.getpid()}"),
                                 connect_timeout, what="connecting")
            self.pool_id = welcome.pool_id
            if shared_memory:
                self.arena = ClientArena(arena_bytes)
                body = self._call(protocol.RegisterArena(_wire.next_id(), self.arena.segment.name, self.arena.size))
                self._arena_id = body["arena"]
        except BaseException:
            self.close()
            raise

    # -- requests ------------------------------------------------------------------------
    def infer(self, model: str, inputs: dict, outputs: list[str] | None = None, *, version: int | None = None,
              timeout: float | None = None) -> dict:
        """Runs one request and returns {output name: ndarray} (its ``model_version`` attribute: the version
        that ran the request); raises a GepoolError subclass on failure."""
        for attempt in (1, 2):
            out = self._encode(model, inputs, outputs, version, timeout)
            try:
                msg, frames = self._exchange(out.frames, out.req_id, self._timeout(timeout), f"model '{model}'")
            except errors.PoolUnavailable:
                self._orphan(out)
                raise
            try:
                return _wire.result(msg, frames, self.arena, out)
            except errors.InvalidArgument as exc:
                if attempt == 1 and self._arena_lost(exc):
                    continue
                raise
            finally:
                self._release(out)
        raise AssertionError("unreachable")

    def _arena_lost(self, exc: errors.InvalidArgument) -> bool:
        """A new pool came up on the endpoint (ZMQ reconnected by itself) and does not know our arena:
        register it again, once, and let the caller retry."""
        if self.arena is None or _wire.ARENA_UNKNOWN not in exc.message:
            return False
        with self._lock:
            body = self._call(protocol.RegisterArena(_wire.next_id(), self.arena.segment.name, self.arena.size))
            self._arena_id = body["arena"]
        return True

    def infer_async(self, model: str, inputs: dict, outputs: list[str] | None = None, *,
                    version: int | None = None, timeout: float | None = None) -> concurrent.futures.Future:
        """Sends at once; the Future resolves to the outputs or to the error."""
        out = self._encode(model, inputs, outputs, version, timeout)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._io_thread().submit(out, fut, self._timeout(timeout), self)
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
        return self._call(protocol.Query(_wire.next_id(), "metadata", {"model": model}))

    def status(self) -> dict:
        return self._call(protocol.Query(_wire.next_id(), "status", {}))

    def stats(self) -> dict:
        return self._call(protocol.Query(_wire.next_id(), "stats", {}))

    # -- plumbing ------------------------------------------------------------------------
    def load(self, model: str, timeout: float | None = None) -> dict:
        """Loads or reloads a model and returns once the new generation serves (or raises why it could not);
        requests keep flowing to the old one meanwhile."""
        return self._call(protocol.Query(_wire.next_id(), "load", {"model": model}), timeout)

    def unload(self, model: str) -> dict:
        """Stops routing to the model; what it has queued or running finishes, then its workers stop."""
        return self._call(protocol.Query(_wire.next_id(), "unload", {"model": model}))

    def query(self, what: str, args: dict | None = None):
        """A front query by name: status, stats, metadata or config (args: {"model": name})."""
        return self._call(protocol.Query(_wire.next_id(), what, args or {}))

    def _encode(self, model, inputs, outputs, version, timeout) -> _wire.Outgoing:
        if self._closed:
            raise errors.InvalidArgument("the client is closed")
        arena, out_bytes = None, 0
        if self.arena is not None:
            meta = self._meta.get(model)
            if meta is None:
                meta = self._meta[model] = self.model_metadata(model)
            arena, out_bytes = (self.arena, self._arena_id), _wire.output_bytes(meta, inputs)
        return _wire.encode_infer(model, inputs, outputs, version, timeout, arena, out_bytes, self.arena_min_bytes)

    def _release(self, out: _wire.Outgoing) -> None:
        out.release(self.arena)

    def _orphan(self, out: _wire.Outgoing) -> None:
        """A request that timed out keeps its arena range: the front may still write its outputs
        there. The range is freed when the late reply arrives (or never, if it never does)."""
        if out.ranges or out.out_range:
            with self._lock:
                self._orphans[out.req_id] = out

    def _late_reply(self, req_id: object) -> None:
        with self._lock:
            out = self._orphans.pop(req_id, None)
        if out is not None:
            self._release(out)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _call(self, msg, timeout: float | None = None, what: str = "request"):
        found, frames = self._exchange([msg.encode()], msg.req_id, self._timeout(timeout), what)
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
            except OSError:  # the pool behind this lane is gone and never saw the request: over ZMQ
                self._drop_lane(conn)
                return self._exchange(frames, req_id, timeout, what, lane=False)
            except _lane.LaneError:  # more parts than a lane frames: nothing went, ZMQ takes it
                return self._exchange(frames, req_id, timeout, what, lane=False)
            while True:  # a receive that times out keeps its place: the lane stays usable
                msg, rest = _wire.decode(conn.recv(deadline))
                if getattr(msg, "req_id", None) == req_id:
                    return msg, rest
                self._late_reply(getattr(msg, "req_id", None))
        except TimeoutError:
            raise errors.PoolUnavailable(
                f"no answer from the pool at {self.endpoint} within {timeout}s ({what})") from None
        except (EOFError, OSError, _lane.LaneError) as exc:
            self._drop_lane(conn)
            raise errors.PoolUnavailable(f"the pool at {self.endpoint} closed the connection ({what}): "
                                         f"{exc}") from None

    def _exchange(self, frames: list, req_id: int, timeout: float | None, what: str, lane: bool = True):
        conn = self._lane_conn() if lane else None
        if conn is not None:
            return self._exchange_lane(conn, frames, req_id, timeout, what)
        sock = self._socket()
        zmqio.send_parts(sock, frames)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            sock.setsockopt(zmq.RCVTIMEO, wait)
            try:
                parts = zmqio.recv_parts(sock)  # a blocking receive: one call where poll + recv took two
            except zmq.Again:
                raise errors.PoolUnavailable(
                    f"no answer from the pool at {self.endpoint} within {timeout}s ({what})") from None
            msg, rest = _wire.decode(parts)
            if getattr(msg, "req_id", None) == req_id:
                return msg, rest
            self._late_reply(getattr(msg, "req_id", None))  # to a request that timed out here

    def _io_thread(self) -> "_IoThread":
        with self._lock:
            if self._io is None:
                self._io = _IoThread(self._ctx, self.endpoint, self._curve, self._dialer)
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
            if self._arena_id != protocol.NO_ARENA:
                try:
                    self._call(protocol.UnregisterArena(_wire.next_id(), self._arena_id), 2.0)
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

    def __init__(self, ctx: zmq.Context, endpoint: str, curve: tuple | None = None,
                 dialer: _lane.Dialer | None = None) -> None:
        super().__init__(name="gepool-client-io", daemon=True)
        self.ctx, self.endpoint, self.curve = ctx, endpoint, curve
        self.dialer = dialer or _lane.Dialer(None)
        self.outbox: collections.deque = collections.deque()
        self.pending: dict[int, tuple] = {}  # req_id -> (out, fut, deadline, client, sent over the lane)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stopping = False
        self.clients: set = set()  # clients with orphaned requests
        self.lane: _lane.Connection | None = None
        self.lane_fd = -1
        self.send_lock = threading.Lock()
        self.ended = False  # the loop has failed what it held: nothing may be added to pending now
        self.wait_until: float | None = None  # the earliest request deadline the loop's poll wakes for
        self.wakes = 0  # pipe writes for requests: what straight sends save

    def submit(self, out: _wire.Outgoing, fut, timeout: float | None, client: Client) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if threading.get_ident() == self.ident:  # a future's callback runs here: the loop sends it
            self.outbox.append((out, fut, deadline, client))
            return
        with self.send_lock:
            if self.ended:
                client._release(out)
                fut.set_exception(errors.Unavailable("the client is closed"))
                return
            if self._send_now(out, fut, deadline, client):
                if deadline is None or (self.wait_until is not None and deadline >= self.wait_until):
                    return  # the loop's poll wakes for an earlier deadline anyway
            else:
                self.outbox.append((out, fut, deadline, client))
            self.wakes += 1
        os.write(self.wake_w, b"x")

    def _send_now(self, out: _wire.Outgoing, fut, deadline: float | None, client: Client) -> bool:
        """Another thread's request onto the lane, under ``send_lock``: False leaves it to the loop (no
        lane yet, requests queued before it, or a send that failed, which the loop then handles)."""
        lane = self.lane
        if lane is None or self.outbox or self.stopping:
            return False
        self.pending[out.req_id] = (out, fut, deadline, client, True)
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
        sock = make_socket(self.ctx, zmq.DEALER, connect=self.endpoint, curve_client=self.curve)
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
                self._expire()
        finally:
            with self.send_lock:
                self.ended = True
            for out, fut, _, client, _ in list(self.pending.values()):
                client._release(out)
                fut.set_exception(errors.Unavailable("the client was closed before the reply arrived"))
            while self.outbox:  # never sent, some by the callbacks just run: they fail too, not hang
                out, fut, _, client = self.outbox.popleft()
                client._release(out)
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
            while self.outbox:
                out, fut, deadline, client = self.outbox.popleft()
                self.pending[out.req_id] = (out, fut, deadline, client, self.lane is not None)
                if self.lane is not None:
                    try:
                        self.lane.send(out.frames, None)
                        continue
                    except OSError as exc:  # the pool behind it is gone and never saw this one
                        self._lose_lane(poller, exc)
                        self.pending[out.req_id] = (out, fut, deadline, client, False)
                    except _lane.LaneError:  # more parts than a lane frames: nothing went
                        self.pending[out.req_id] = (out, fut, deadline, client, False)
                zmqio.send_parts(sock, out.frames)

    def _connect_lane(self, poller: zmq.Poller) -> None:
        self.lane = self.dialer.connect()
        if self.lane is not None:
            self.lane_fd = self.lane.sock.fileno()  # kept: a send cut short closes the socket (fileno -1)
            poller.register(self.lane_fd, zmq.POLLIN)

    def _lose_lane(self, poller: zmq.Poller, exc: BaseException) -> None:
        """Requests that went over the lane will hear nothing more: they fail now, not at their deadline.
        Called holding ``send_lock``."""
        poller.unregister(self.lane_fd)
        self.lane.close()
        self.lane = None
        self.dialer.failed()
        for req_id, (out, fut, _, client, via_lane) in list(self.pending.items()):
            if via_lane:
                del self.pending[req_id]
                client._orphan(out)
                fut.set_exception(errors.PoolUnavailable(
                    f"the pool at {self.endpoint} closed the connection (request {req_id}): {exc}"))

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
        entry = self.pending.pop(getattr(msg, "req_id", None), None)
        if entry is None:
            for client in self.clients:
                client._late_reply(getattr(msg, "req_id", None))
            return
        out, fut, _, client, _ = entry
        try:
            fut.set_result(_wire.result(msg, rest, client.arena, out))
        except Exception as exc:
            fut.set_exception(exc)
        finally:
            client._release(out)

    def _wait_ms(self) -> int:
        with self.send_lock:  # a straight send then either is in pending here or sees what this waits for
            deadlines = [entry[2] for entry in self.pending.values() if entry[2] is not None]
            self.wait_until = min(deadlines) if deadlines else None
        if self.wait_until is None:
            return -1
        return max(0, int((self.wait_until - time.monotonic()) * 1000) + 1)

    def _expire(self) -> None:
        now = time.monotonic()
        for req_id, (out, fut, deadline, client, _) in list(self.pending.items()):
            if deadline is not None and deadline <= now:
                del self.pending[req_id]
                client._orphan(out)
                self.clients.add(client)
                fut.set_exception(errors.PoolUnavailable(
                    f"no answer from the pool at {self.endpoint} in time (request {req_id})"))
