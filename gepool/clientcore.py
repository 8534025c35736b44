"""The client core under Client and AsyncClient: requests, arena books, lane dialing, deadlines, a stopped pool."""

import os
import socket
import threading

from gepool import _wire
from gepool.arena import ClientArena
from gepool.common import errors
from gepool.ipc import lane as _lane
from gepool.ipc import protocol
from gepool.ipc.sockets import default_endpoint, ipc_path

DEFAULT_TIMEOUT_S = 120.0  # never wait forever on a pool that vanished
ANSWER_GRACE_S = 2.0  # a request whose own timeout ran out: its client waits this long more for the pool's answer
CONNECT_TIMEOUT_S = 10.0
DEFAULT_ARENA_BYTES = 64 << 20
# A request sent over ZMQ and unanswered this long looks whether its pool's socket file is still there: a
# pool that stopped cleanly removed it, and a DEALER would otherwise wait for a reconnect until the timeout.
WATCH_S = 0.25


class ClientCore:
    """What both faces hold and decide: the endpoint and its lane dialer, the arena and its registration,
    model metadata for sizing arena outputs, requests encoded, timed-out requests' arena ranges (kept
    until their late reply), and the errors a client raises. Sockets and waiting are the faces' own."""

    def __init__(self, endpoint: str | None, *, shared_memory: bool, arena_bytes: int, timeout: float | None,
                 curve_server_key: str | None, curve_client_key: str | None, lane: bool,
                 arena_min_bytes: int) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self.arena_min_bytes = arena_min_bytes
        self.pool_id: str | None = None
        self._curve = _wire.curve_client(curve_server_key, curve_client_key)
        self._path = ipc_path(self.endpoint)
        self._dialer = _lane.Dialer(self._path, lane and self._curve is None)
        self._shared_memory, self._arena_bytes = shared_memory, arena_bytes
        self._meta: dict[str, dict] = {}
        self._orphans: dict[int, _wire.Outgoing] = {}
        self._stale: list[int] = []  # orphans of an earlier pool, freed once a new one registers the arena
        self._lock = threading.Lock()
        self._closed = False
        self.arena: ClientArena | None = None
        self._arena_id = protocol.NO_ARENA

    # -- the endpoint --------------------------------------------------------------------
    def _check_endpoint(self) -> None:
        """An ipc endpoint with no socket file, or one nobody listens on, fails at once (a DEALER would
        wait for a pool to appear until its connect timeout)."""
        if self._path is None:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC) as probe:
            try:
                probe.connect(self._path)
            except FileNotFoundError:
                raise errors.PoolUnavailable(f"no pool at {self.endpoint}: its socket file does not exist") from None
            except ConnectionRefusedError:
                raise errors.PoolUnavailable(f"no pool at {self.endpoint}: nobody listens on its socket file "
                                             "(a pool that was killed?)") from None
            except OSError:  # a full backlog (EAGAIN), say: a live pool; the handshake decides
                pass

    def _stopped(self) -> bool:
        """The pool's socket file is gone: it stopped (and removed it). Only for waits that run long."""
        return self._path is not None and not os.path.exists(self._path)

    def _no_answer(self, timeout: float | None, what: str) -> errors.PoolUnavailable:
        return errors.PoolUnavailable(f"no answer from the pool at {self.endpoint} within {timeout}s ({what})")

    def _late(self, req_id: int) -> errors.PoolUnavailable:
        return errors.PoolUnavailable(f"no answer from the pool at {self.endpoint} in time (request {req_id})")

    def _hung_up(self, what: str, exc: BaseException) -> errors.PoolUnavailable:
        return errors.PoolUnavailable(f"the pool at {self.endpoint} closed the connection ({what}): {exc}")

    def _gone(self, what: str) -> errors.PoolUnavailable:
        return errors.PoolUnavailable(f"the pool at {self.endpoint} has stopped: its socket file is gone ({what})")

    # -- messages ------------------------------------------------------------------------
    def _hello(self) -> protocol.Hello:
        return protocol.Hello(_wire.next_id(), protocol.PROTOCOL_VERSION, f"pid{os.getpid()}")

    def _register(self) -> protocol.RegisterArena:
        """The arena's registration (made on first use): at start, and again for a new pool on the endpoint."""
        if self.arena is None:
            self.arena = ClientArena(self._arena_bytes)
        elif self._arena_id != protocol.NO_ARENA:
            # a pool that never knew the arena answered: what timed out before now went to an earlier
            # pool, gone for good, and is freed once this one has the arena
            with self._lock:
                self._stale = list(self._orphans)
        return protocol.RegisterArena(_wire.next_id(), self.arena.segment.name, self.arena.size, self.arena.token)

    def _registered(self, body: dict) -> None:
        self._arena_id = body["arena"]
        with self._lock:
            stale = [self._orphans.pop(req_id) for req_id in self._stale if req_id in self._orphans]
            self._stale = []
        for out in stale:
            out.release(self.arena)

    def _unregister(self) -> protocol.UnregisterArena | None:
        if self.arena is None or self._arena_id == protocol.NO_ARENA:
            return None
        return protocol.UnregisterArena(_wire.next_id(), self._arena_id)

    @staticmethod
    def _query(what: str, args: dict) -> protocol.Query:
        return protocol.Query(_wire.next_id(), what, args)

    def _metadata(self, model: str) -> dict:
        """A face's blocking metadata query, for sizing arena outputs (the asyncio face fetches it first)."""
        raise NotImplementedError

    def _encode(self, model: str, inputs: dict, outputs: list[str] | None, version: int | None,
                timeout: float | None, priority: int = 0, origin: int = protocol.Origin.LIBRARY,
                wait: float | None = None) -> _wire.Outgoing:
        if self._closed:
            raise errors.InvalidArgument("the client is closed")
        if wait is None:
            wait = self._wait(timeout)  # what the face waits: the front drops it after
        arena = self.arena
        if arena is None:
            return _wire.encode_infer(model, inputs, outputs, version, timeout, None, 0, self.arena_min_bytes,
                                      wait, priority, origin)
        meta = self._meta.get(model)
        if meta is None:
            meta = self._meta[model] = self._metadata(model)
        return _wire.encode_infer(model, inputs, outputs, version, timeout, (arena, self._arena_id),
                                  _wire.output_bytes(meta, inputs), self.arena_min_bytes, wait, priority, origin)

    def _wait(self, timeout: float | None) -> float | None:
        """How long the face waits for a request's answer: the client's own wait, or the request's timeout
        and ANSWER_GRACE_S more, so that the pool's answer to a timeout that ran out (Timeout, "Request
        timeout expired") is what the caller hears, not the face's own "no answer in time"."""
        return self.timeout if timeout is None else timeout + ANSWER_GRACE_S

    def _arena_lost(self, exc: errors.InvalidArgument) -> bool:
        """A new pool came up on the endpoint (ZMQ reconnected by itself) and does not know our arena:
        the face registers it again, once, and retries."""
        return self.arena is not None and _wire.ARENA_UNKNOWN in exc.message

    # -- arena ranges of requests that timed out ------------------------------------------
    def _orphan(self, out: _wire.Outgoing) -> None:
        """A request that timed out keeps its arena range: the front may still write its outputs there.
        The range is freed when the late reply arrives (or when a new pool registers the arena)."""
        if out.ranges or out.out_range:
            with self._lock:
                self._orphans[out.req_id] = out

    def _late_reply(self, req_id: object) -> None:
        """A reply nobody waits for: its request timed out here, and what it held is free now."""
        with self._lock:
            out = self._orphans.pop(req_id, None)
        if out is not None:
            out.release(self.arena)


class Inflight(dict):
    """Requests sent and not yet answered, by req_id: (outgoing or None, waiter, deadline or None, sent over
    the lane). A plain dict to the hot path (set, pop); the scans below are for the rare wake-ups. Its
    owner (the client's I/O thread, or its event loop) is the only one to take entries out."""

    def next_wake(self, now: float) -> float | None:
        """The earliest deadline, or sooner, while a request went over ZMQ, the next look at the endpoint."""
        wake, watch = None, False
        for _, _, deadline, via_lane in list(self.values()):  # a snapshot: other threads may add meanwhile
            if deadline is not None and (wake is None or deadline < wake):
                wake = deadline
            watch = watch or not via_lane
        if watch and (wake is None or now + WATCH_S < wake):
            wake = now + WATCH_S
        return wake

    def expired(self, now: float) -> list[tuple[int, tuple]]:
        """Takes out the requests past their deadline."""
        return self._take([req_id for req_id, e in list(self.items())
                           if e[2] is not None and e[2] <= now])

    def carried(self, via_lane: bool) -> list[tuple[int, tuple]]:
        """Takes out the requests one carrier took: a lane that died, or ZMQ to a pool that stopped."""
        return self._take([req_id for req_id, e in list(self.items()) if e[3] == via_lane])

    def _take(self, ids: list[int]) -> list[tuple[int, tuple]]:
        return [(req_id, self.pop(req_id)) for req_id in ids]
