"""The asyncio client: ``await client.infer(...)``, many requests in flight on one socket."""

import asyncio
import os
import socket

import zmq
import zmq.asyncio

from gepool import _wire
from gepool.arena import ClientArena
from gepool.client import CONNECT_TIMEOUT_S, DEFAULT_ARENA_BYTES, DEFAULT_TIMEOUT_S
from gepool.common import errors
from gepool.ipc import lane as _lane
from gepool.ipc import protocol
from gepool.ipc.sockets import default_endpoint, ipc_path, make_socket


class AsyncClient:
    """Use ``async with AsyncClient(endpoint) as c:`` or ``await AsyncClient.connect(...)``.

    On an ipc endpoint it talks over a lane (see ``Client``) unless ``lane=False``."""

    def __init__(self, endpoint: str | None = None, *, shared_memory: bool = False,
                 arena_bytes: int = DEFAULT_ARENA_BYTES, timeout: float | None = DEFAULT_TIMEOUT_S,
                 curve_server_key: str | None = None, curve_client_key: str | None = None,
                 lane: bool = True, arena_min_bytes: int = _wire.ARENA_MIN) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.arena_min_bytes = arena_min_bytes  # as Client's
        self.timeout = timeout
        self._shared_memory, self._arena_bytes = shared_memory, arena_bytes
        self._ctx = zmq.asyncio.Context()
        curve = _wire.curve_client(curve_server_key, curve_client_key)
        self._sock = make_socket(self._ctx, zmq.DEALER, connect=self.endpoint, curve_client=curve)
        self._dialer = _lane.Dialer(ipc_path(self.endpoint), lane and curve is None)
        self._lane: socket.socket | None = None
        self._lane_rx: _lane.Receiver | None = None
        self._lane_lock = asyncio.Lock()
        self._on_lane: set[int] = set()  # pending requests sent over the lane
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._meta: dict[str, dict] = {}
        self.arena: ClientArena | None = None
        self._arena_id = protocol.NO_ARENA

    @classmethod
    async def connect(cls, endpoint: str | None = None, **kwargs) -> "AsyncClient":
        client = cls(endpoint, **kwargs)
        await client.start()
        return client

    async def start(self, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            welcome = await self._call(protocol.Hello(_wire.next_id(), protocol.PROTOCOL_VERSION,
                                                      f"pid{os.getpid()}"), connect_timeout)
            self.pool_id = welcome.pool_id
            if self._shared_memory:
                self.arena = ClientArena(self._arena_bytes)
                body = await self._call(protocol.RegisterArena(_wire.next_id(), self.arena.segment.name,
                                                               self.arena.size))
                self._arena_id = body["arena"]
        except BaseException:
            await self.close()
            raise

    async def infer(self, model: str, inputs: dict, outputs: list[str] | None = None, *,
                    version: int | None = None, timeout: float | None = None) -> dict:
        arena, out_bytes = None, 0
        if self.arena is not None:
            if model not in self._meta:
                self._meta[model] = await self.model_metadata(model)
            arena, out_bytes = (self.arena, self._arena_id), _wire.output_bytes(self._meta[model], inputs)
        for attempt in (1, 2):
            if self.arena is not None:
                arena = (self.arena, self._arena_id)
            out = _wire.encode_infer(model, inputs, outputs, version, timeout, arena, out_bytes,
                                     self.arena_min_bytes)
            try:
                msg, frames = await self._exchange(out.frames, out.req_id, timeout)
            except errors.PoolUnavailable:
                return self._orphaned(out)
            try:
                return _wire.result(msg, frames, self.arena, out)
            except errors.InvalidArgument as exc:
                if attempt == 2 or self.arena is None or _wire.ARENA_UNKNOWN not in exc.message:
                    raise
                # a new pool on the endpoint: register the arena again and retry once
                body = await self._call(protocol.RegisterArena(_wire.next_id(), self.arena.segment.name,
                                                               self.arena.size))
                self._arena_id = body["arena"]
            finally:
                out.release(self.arena)
        raise AssertionError("unreachable")

    def _orphaned(self, out: _wire.Outgoing):
        # The front may still write this request's outputs into its arena range: never reuse it.
        raise errors.PoolUnavailable(f"no answer from the pool at {self.endpoint} in time (request {out.req_id})")

    async def model_metadata(self, model: str) -> dict:
        return await self._call(protocol.Query(_wire.next_id(), "metadata", {"model": model}))

    async def status(self) -> dict:
        return await self._call(protocol.Query(_wire.next_id(), "status", {}))

    async def stats(self) -> dict:
        return await self._call(protocol.Query(_wire.next_id(), "stats", {}))

    async def load(self, model: str, timeout: float | None = None) -> dict:
        return await self._call(protocol.Query(_wire.next_id(), "load", {"model": model}), timeout)

    async def unload(self, model: str) -> dict:
        return await self._call(protocol.Query(_wire.next_id(), "unload", {"model": model}))

    async def query(self, what: str, args: dict | None = None):
        return await self._call(protocol.Query(_wire.next_id(), what, args or {}))

    async def _call(self, msg, timeout: float | None = None):
        found, frames = await self._exchange([msg.encode()], msg.req_id, timeout)
        return _wire.result(found, frames, self.arena)

    async def _exchange(self, frames: list, req_id: int, timeout: float | None):
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        wait = self.timeout if timeout is None else timeout
        try:
            if not await self._send_lane(frames, req_id):
                await self._sock.send_multipart(frames, copy=False)
            return await asyncio.wait_for(fut, wait)
        except TimeoutError:
            raise errors.PoolUnavailable(f"no answer from the pool at {self.endpoint} within {wait}s") from None
        finally:
            self._pending.pop(req_id, None)
            self._on_lane.discard(req_id)

    async def _send_lane(self, frames: list, req_id: int) -> bool:
        """False: no lane, or it died before the pool read this request (then ZMQ carries it).
        A lock keeps one message's records together; a record that finds the socket full waits."""
        if self._lane is None:
            if not self._dialer.due():
                return False
            async with self._lane_lock:  # one connection attempt at a time
                if self._lane is None and self._dialer.due():
                    await self._connect_lane()
        loop = asyncio.get_running_loop()
        async with self._lane_lock:
            sock = self._lane
            if sock is None:
                return False
            try:
                records = _lane.records(frames)
            except _lane.LaneError:  # more parts than a lane frames: ZMQ takes it
                return False
            sent = 0
            try:
                for record in records:
                    try:
                        sock.sendmsg(record)
                    except BlockingIOError:
                        await loop.sock_sendall(sock, b"".join(record))
                    sent += 1
            except OSError as exc:
                self._lose_lane(exc)
                return False
            except asyncio.CancelledError:  # mid-message, the rest would never follow: close the lane
                if sent:
                    self._lose_lane(ConnectionAbortedError("a send was cancelled mid-message"))
                raise
            self._on_lane.add(req_id)
            return True

    async def _connect_lane(self) -> None:
        """Waits for the front's ACCEPTED without blocking the loop (the front may be busy, or be the
        one that started this process and waits on it); until then, and if refused, ZMQ serves."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            _lane.tune(sock)
            sock.connect(self._dialer.path)  # never waits: a full backlog is EAGAIN
            first = await asyncio.wait_for(loop.sock_recv(sock, _lane.RECORD_MAX), _lane.HANDSHAKE_TIMEOUT_S)
            if first != _lane.ACCEPTED:
                raise ConnectionRefusedError("the pool did not accept the lane")
        except OSError:  # TimeoutError included
            sock.close()
            self._dialer.failed()
            return
        self._lane, self._lane_rx = sock, _lane.Receiver(readonly=True)
        loop.add_reader(sock.fileno(), self._read_lane)

    def _read_lane(self) -> None:
        while self._lane is not None:
            try:
                parts = self._lane_rx.recv(self._lane)
            except (BlockingIOError, InterruptedError):
                return
            except (EOFError, OSError, _lane.LaneError) as exc:
                self._lose_lane(exc)
                return
            if parts is not None:
                self._deliver(parts)

    def _lose_lane(self, exc: BaseException) -> None:
        """What went over the lane will hear nothing more: it fails now, not at its timeout."""
        sock, self._lane = self._lane, None
        if sock is None:
            return
        self._dialer.failed()
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        for req_id in self._on_lane:
            fut = self._pending.get(req_id)
            if fut is not None and not fut.done():
                fut.set_exception(errors.PoolUnavailable(
                    f"the pool at {self.endpoint} closed the connection (request {req_id}): {exc}"))
        self._on_lane.clear()

    def _deliver(self, frames: list) -> None:
        try:
            msg, rest = _wire.decode(frames)
        except protocol.ProtocolError:
            return
        fut = self._pending.get(getattr(msg, "req_id", None))
        if fut is not None and not fut.done():
            fut.set_result((msg, rest))

    async def _read(self) -> None:
        while True:
            self._deliver(await self._sock.recv_multipart(copy=False))

    async def close(self) -> None:
        if self.arena is not None and self._arena_id != protocol.NO_ARENA:
            try:
                await self._call(protocol.UnregisterArena(_wire.next_id(), self._arena_id), 2.0)
            except errors.GepoolError:
                pass
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self._lane is not None:
            asyncio.get_running_loop().remove_reader(self._lane.fileno())
            self._lane.close()
            self._lane = None
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
