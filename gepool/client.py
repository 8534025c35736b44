"""The synchronous library client: blocking ``infer`` per thread, and futures for many in flight."""

import concurrent.futures
import threading
import time
import weakref

import numpy as np
import zmq

from gepool import _wire
from gepool.arena import ArenaFull
from gepool.clientcore import CONNECT_TIMEOUT_S, DEFAULT_ARENA_BYTES, DEFAULT_TIMEOUT_S, WATCH_S, ClientCore
from gepool.common import errors
from gepool.iothread import IoThread
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
        self._io: IoThread | None = None
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
    def infer(self, model: str, inputs: dict, outputs: list[str | tuple[str, int]] | None = None, *,
              version: int | None = None, timeout: float | None = None, priority: int = 0) -> dict:
        """Runs one request and returns {output name: ndarray} (its ``model_version`` attribute: the version
        that ran the request); raises a GepoolError subclass on failure. ``outputs`` names the outputs wanted
        (None: all); an item ``(name, class_count)`` returns that output as its top classes instead, BYTES
        "value:index[:label]" per row (Triton's classification extension). ``priority``: Triton's request
        priority, for a model with dynamic_batching priority_levels: 1 is the highest level, 0 (and a
        level past priority_levels) the model's default_priority_level."""
        wait = self._wait(timeout)
        for attempt in (1, 2):
            arena_id = self._arena_id
            out = self._encode(model, inputs, outputs, version, timeout, priority)
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

    def infer_async(self, model: str, inputs: dict, outputs: list[str | tuple[str, int]] | None = None, *,
                    version: int | None = None, timeout: float | None = None,
                    priority: int = 0) -> concurrent.futures.Future:
        """Sends at once; the Future resolves to the outputs or to the error."""
        out = self._encode(model, inputs, outputs, version, timeout, priority)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        io = self._io or self._io_thread()
        io.submit(out, fut, self._wait(timeout))
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

    def _io_thread(self) -> "IoThread":
        with self._lock:
            if self._io is None:
                if self._closed:
                    raise errors.InvalidArgument("the client is closed")
                self._io = IoThread(self)
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
