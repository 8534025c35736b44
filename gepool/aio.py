"""The asyncio client: ``await client.infer(...)``, many requests in flight on one socket."""

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from gepool import _groups, _wire
from gepool.clientcore import CONNECT_TIMEOUT_S, DEFAULT_ARENA_BYTES, DEFAULT_TIMEOUT_S, WATCH_S, ClientCore, Inflight
from gepool.common import errors
from gepool.ipc import lane as _lane
from gepool.ipc import protocol
from gepool.ipc.sockets import make_socket

log = logging.getLogger("gepool.client")


class AsyncClient(ClientCore):
    """Use ``async with AsyncClient(endpoint) as c:`` or ``await AsyncClient.connect(...)``.

    On an ipc endpoint it talks over a lane (see ``Client``) unless ``lane=False``. Requests made in
    one pass of the event loop go out together, as one lane record where they fit one, when the loop
    runs the flush they scheduled (no timer: nothing waits for a later request); the pool's replies
    come back batched the same way. One timer, not one per request, fires at the earliest deadline
    (and, while a request went over ZMQ, looks whether the pool's socket file is still there)."""

    def __init__(self, endpoint: str | None = None, *, shared_memory: bool = False,
                 arena_bytes: int = DEFAULT_ARENA_BYTES, timeout: float | None = DEFAULT_TIMEOUT_S,
                 curve_server_key: str | None = None, curve_client_key: str | None = None,
                 lane: bool = True, arena_min_bytes: int = _wire.ARENA_MIN) -> None:
        super().__init__(endpoint, shared_memory=shared_memory, arena_bytes=arena_bytes, timeout=timeout,
                         curve_server_key=curve_server_key, curve_client_key=curve_client_key, lane=lane,
                         arena_min_bytes=arena_min_bytes)
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, connect=self.endpoint, curve_client=self._curve)
        self._lane: socket.socket | None = None
        self._lane_rx: _lane.Receiver | None = None
        self._lane_lock = asyncio.Lock()  # one connection attempt at a time
        # messages for the lane, in order: (frames, req_id, its one record or None, its records or None)
        self._outq: list[tuple] = []
        self._flush_at: asyncio.Handle | None = None  # the flush the queue's first message scheduled
        # submitted requests that may go in a group, by what they share (gepool/_groups.py): made into messages
        # by the flush (or by the lane's loss) of the loop pass that submitted them
        self._groups: dict[tuple, list[_groups.Member]] = {}
        self._draining: asyncio.Task | None = None  # sending what found the socket full; the lane is busy
        self._sending: tuple[list, list] | None = None  # the queue and records a drain sends
        self._sent = 0  # of those records
        # records and messages sent and read over the lane (what coalescing saves: records per message)
        self.lane_counts = {"records_sent": 0, "messages_sent": 0, "records_read": 0, "messages_read": 0}
        self._inflight = Inflight()  # req_id -> (out or None, future of (msg, frames), deadline, sent over the lane)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._reader: asyncio.Task | None = None

    @classmethod
    async def connect(cls, endpoint: str | None = None, **kwargs) -> "AsyncClient":
        client = cls(endpoint, **kwargs)
        await client.start()
        return client

    async def start(self, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            self._check_endpoint()
            self.pool_id = (await self._call(self._hello(), connect_timeout)).pool_id
            if self._shared_memory:
                self._registered(await self._call(self._register()))
        except BaseException:
            await self.close()
            raise

    async def infer(self, model: str, inputs: dict, outputs: list[str | tuple[str, int]] | None = None, *,
                    version: int | None = None, timeout: float | None = None, priority: int = 0,
                    origin: protocol.Origin = protocol.Origin.LIBRARY, wait: float | None = None) -> dict:
        """As Client.infer, awaited. ``origin``: the surface the request came by, for the metrics'
        ``protocol`` label (the gateway's HTTP and gRPC services say theirs). ``wait``: how long to wait for
        the answer, if not as Client.infer does (the gateway waits out a batch still running past the
        request's timeout, as Triton does, whose timeout is the queue's only)."""
        _wire.check_priority(priority)  # before any metadata query
        if self.arena is not None and model not in self._meta:
            self._meta[model] = await self.model_metadata(model)
        if wait is None:
            wait = self._wait(timeout)
        for attempt in (1, 2):
            out = self._encode(model, inputs, outputs, version, timeout, priority, origin, wait)
            try:
                msg, frames = await self._exchange(out.frames, out.req_id, wait, out)
            except BaseException:  # timed out, the pool gone, or cancelled: the front may still write there
                self._orphan(out)
                raise
            try:
                return _wire.result(msg, frames, self.arena, out)
            except errors.InvalidArgument as exc:
                if attempt == 2 or not self._arena_lost(exc):
                    raise
                self._registered(await self._call(self._register()))
            finally:
                out.release(self.arena)
        raise AssertionError("unreachable")

    def submit(self, model: str, inputs: dict, outputs: list[str | tuple[str, int]] | None,
               done: Callable[[dict | None, BaseException | None], None], *, version: int | None = None,
               timeout: float | None = None, priority: int = 0, origin: protocol.Origin = protocol.Origin.LIBRARY,
               wait: float | None = None) -> bool:
        """``infer`` without a task or a future, for a request that fits one lane record: it joins this loop
        pass's flush, and ``done(outputs, None)`` or ``done(None, error)`` is called once, from the loop, when
        the answer comes, the request fails, or ``wait`` passes (as ``infer``'s). False, with nothing sent,
        where ``infer`` must serve it: no lane open yet, a shared-memory arena, a longer message. Requests of one
        pass alike but for their rows go as groups (gepool/_groups.py), encoded by the flush: ``inputs`` are
        read then, not before (the caller leaves them as they are until its pass ends)."""
        if self._lane is None or self.arena is not None:
            return False
        _wire.check_priority(priority)
        if wait is None:
            wait = self._wait(timeout)  # what the pool is told (deadline_us); the face waits self.timeout without
        grouped = None if self._draining is not None or self._closed else \
            _groups.key_of(model, inputs, outputs, version, timeout, priority, origin, wait)
        if grouped is not None:
            key, rows, size = grouped
            out = _wire.Outgoing(_wire.next_id(), [], [])
            members = self._groups.get(key)
            if members is None:
                members = self._groups[key] = []
            members.append(_groups.Member(out.req_id, inputs, rows, size))
            if self._flush_at is None:
                self._flush_at = asyncio.get_running_loop().call_soon(self._flush)
        else:
            out = self._encode(model, inputs, outputs, version, timeout, priority, origin, wait)
            if not self._queue_one(out.frames, out.req_id):
                return False
        wait = self.timeout if wait is None else wait
        now = time.monotonic()
        deadline = None if wait is None else now + wait
        # booked after it is queued, before the flush that sends it (a later pass of the loop) can be answered
        self._inflight[out.req_id] = (out, _Answer(done, out), deadline, True)
        if deadline is not None and (self._timer_at is None or deadline < self._timer_at):
            self._arm(deadline, now)
        return True

    async def model_metadata(self, model: str) -> dict:
        return await self._call(self._query("metadata", {"model": model}))

    async def status(self) -> dict:
        return await self._call(self._query("status", {}))

    async def stats(self) -> dict:
        return await self._call(self._query("stats", {}))

    async def load(self, model: str, timeout: float | None = None) -> dict:
        return await self._call(self._query("load", {"model": model}), timeout)

    async def unload(self, model: str) -> dict:
        return await self._call(self._query("unload", {"model": model}))

    async def query(self, what: str, args: dict | None = None):
        return await self._call(self._query(what, args or {}))

    async def _call(self, msg, timeout: float | None = None):
        found, frames = await self._exchange([msg.encode()], msg.req_id, timeout)
        return _wire.result(found, frames, self.arena)

    async def _exchange(self, frames: list, req_id: int, timeout: float | None, out: _wire.Outgoing | None = None):
        fut = asyncio.get_running_loop().create_future()
        wait = self.timeout if timeout is None else timeout
        now = time.monotonic()
        deadline = None if wait is None else now + wait
        entry = (out, fut, deadline, True)
        self._inflight[req_id] = entry
        try:
            if (self._lane is not None and self._queue_one(frames, req_id)) or await self._send_lane(frames, req_id):
                wake = deadline
            else:
                self._inflight[req_id] = entry[:3] + (False,)
                await self._sock.send_multipart(frames, copy=False)
                wake = now + WATCH_S if deadline is None or deadline > now + WATCH_S else deadline
            if wake is not None and (self._timer_at is None or wake < self._timer_at):
                self._arm(wake, now)
            return await fut
        finally:
            self._inflight.pop(req_id, None)

    def _arm(self, at: float, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._on_timer)

    def _on_timer(self) -> None:
        """Fails what is past its deadline, and what went over ZMQ to a pool that has stopped."""
        self._timer = self._timer_at = None
        now = time.monotonic()
        for req_id, (_, fut, _, _) in self._inflight.expired(now):
            if not fut.done():
                fut.set_exception(self._late(req_id))
        if self._stopped():
            for req_id, (_, fut, _, _) in self._inflight.carried(False):
                if not fut.done():
                    fut.set_exception(self._gone(f"request {req_id}"))
        wake = self._inflight.next_wake(now)
        if wake is not None:
            self._arm(wake, now)

    async def _send_lane(self, frames: list, req_id: int) -> bool:
        """False: no lane (ZMQ carries this one). True: the lane has it, and sends it or, if the lane dies
        first, hands it to ZMQ. A message that fits one record joins the queue that the flush it (or the
        one before it) scheduled sends; a longer one goes now, behind the queue, and its sender waits
        while the socket is full. The frames are read when sent, not before (as ZMQ's copy=False).
        With the lane open, the caller has tried ``_queue_one`` already (its ``record`` is not redone)."""
        if self._lane is None:
            if not self._dialer.due():
                return False
            async with self._lane_lock:
                if self._lane is None and self._dialer.due():
                    await self._connect_lane()
            if self._lane is None:
                return False
            if self._queue_one(frames, req_id):
                return True
        try:
            records = _lane.spanning(frames)
        except _lane.LaneError:  # more parts than a lane frames: ZMQ takes it
            return False
        self._outq.append((frames, req_id, None, records))
        if self._draining is None:
            if self._flush_at is not None:
                self._flush_at.cancel()
            self._flush()
        if self._draining is not None:
            await asyncio.wait([self._draining])  # not cancelled with this request: it owns the queue
        return True

    def _queue_one(self, frames: list, req_id: int) -> bool:
        """Queues a message that fits one record for the flush, scheduling it; False for a longer one."""
        one = _lane.record(frames)
        if one is None:
            return False
        self._outq.append((frames, req_id, one, None))
        if self._flush_at is None and self._draining is None:
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)
        return True

    def _gather(self) -> None:
        """This pass's groupable requests into the queue: each run of alike ones as a group (one alone as
        itself). A run that cannot be encoded fails its members, not the flush."""
        groups, self._groups = self._groups, {}
        for key, members in groups.items():
            for run in _groups.chunks(members):
                try:
                    if len(run) == 1:
                        (m,) = run
                        model, version, outputs, timeout, priority, origin, wait, _ = key
                        frames = _wire.encode_infer(model, m.inputs, None if outputs is None else list(outputs),
                                                    version, timeout, None, 0, self.arena_min_bytes, wait, priority,
                                                    origin, req_id=m.req_id).frames
                        req_id = m.req_id
                    else:  # its answers come under its members' ids: they are what the queue entry names
                        frames = _groups.encode(key, run, _wire.next_id())
                        req_id = tuple(m.req_id for m in run)
                    one = _lane.record(frames)
                    records = None if one is not None else _lane.spanning(frames)
                except Exception as exc:
                    for m in run:
                        entry = self._inflight.pop(m.req_id, None)
                        if entry is not None and not entry[1].done():
                            entry[1].set_exception(errors.InvalidArgument(f"the request cannot be sent: {exc}"))
                    continue
                self._outq.append((frames, req_id, one, records))

    def _flush(self) -> None:
        """Sends the queue; what finds the socket full is left to a drain task (the lane is busy until it
        ends, and what is queued meanwhile goes when it does, together)."""
        self._flush_at = None  # first: whatever follows raises, the next request schedules a flush again
        if self._groups:
            self._gather()
        queue, self._outq = self._outq, []
        sock = self._lane
        if sock is None:
            self._by_zmq(queue)
            return
        records = _framed(queue)
        sent = 0
        try:
            for record in records:
                sock.sendmsg(record)
                sent += 1
        except BlockingIOError:
            self._sending, self._sent = (queue, records), sent
            self._draining = asyncio.get_running_loop().create_task(self._drain(sock))
            return
        except OSError as exc:
            self._sending, self._sent = (queue, records), sent
            self._lose_lane(exc)
            return
        counts = self.lane_counts
        counts["records_sent"] += sent
        counts["messages_sent"] += len(queue)

    async def _drain(self, sock: socket.socket) -> None:
        """The records of ``_sending`` from ``_sent`` on, waiting for room, then what queued meanwhile; ends
        when the queue is empty or the lane is lost (``_lose_lane`` cancels it and takes what is left)."""
        loop = asyncio.get_running_loop()
        try:
            while self._sending is not None:
                queue, records = self._sending
                for record in records[self._sent:]:
                    try:
                        sock.sendmsg(record)
                    except BlockingIOError:
                        await loop.sock_sendall(sock, b"".join(record))
                    self._sent += 1
                self.lane_counts["records_sent"] += len(records)
                self.lane_counts["messages_sent"] += len(queue)
                queue, self._outq = self._outq, []
                self._sending, self._sent = ((queue, _framed(queue)) if queue else None), 0
        except OSError as exc:
            self._lose_lane(exc)
        finally:
            self._draining = self._sending = None
            if self._outq and self._flush_at is None and not self._closed:
                self._flush_at = loop.call_soon(self._flush)

    def _by_zmq(self, queue: list) -> None:
        if not queue:
            return
        now = time.monotonic()
        for frames, req_ids, _, _ in queue:
            for req_id in req_ids if type(req_ids) is tuple else (req_ids,):  # (a group's: its members')
                entry = self._inflight.get(req_id)
                if entry is not None:
                    self._inflight[req_id] = entry[:3] + (False,)
            self._sock.send_multipart(frames, copy=False).add_done_callback(_quiet)
        if self._timer_at is None or now + WATCH_S < self._timer_at:
            self._arm(now + WATCH_S, now)

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
        counts = self.lane_counts
        while self._lane is not None:
            try:
                messages = self._lane_rx.take(self._lane)
            except (BlockingIOError, InterruptedError):
                return
            except (EOFError, OSError, _lane.LaneError) as exc:
                self._lose_lane(exc)
                return
            counts["records_read"] += 1  # each take() reads one record, a message's middle ones included
            if messages is not None:
                counts["messages_read"] += len(messages)
                for parts in messages:
                    self._deliver(parts)

    def _lose_lane(self, exc: BaseException) -> None:
        """What went over the lane will hear nothing more: it fails now, not at its timeout. What the lane
        had not sent yet (queued, or behind a full socket) goes by ZMQ."""
        sock, self._lane = self._lane, None
        if sock is None:
            return
        unsent = []
        if self._sending is not None:
            queue, records = self._sending
            unsent = queue[sum(_lane.completes(r) for r in records[:self._sent]):]
            self._sending = None
        if self._draining is not None and self._draining is not asyncio.current_task():
            self._draining.cancel()
        if self._groups:
            self._gather()
        unsent += self._outq
        self._outq = []
        self._by_zmq(unsent)
        self._dialer.failed()
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        for req_id, (_, fut, _, _) in self._inflight.carried(True):
            if not fut.done():
                fut.set_exception(self._hung_up(f"request {req_id}", exc))

    def _deliver(self, frames: list) -> None:
        try:
            msg, rest = _wire.decode(frames)
        except protocol.ProtocolError:
            return
        if type(msg) is protocol.Result and msg.members is not None:
            _groups.answer(msg, rest, self._inflight)
            return
        req_id = getattr(msg, "req_id", None)
        entry = self._inflight.pop(req_id, None)
        if entry is None:
            self._late_reply(req_id)
        elif not entry[1].done():
            entry[1].set_result((msg, rest))

    async def _read(self) -> None:
        while True:
            self._deliver(await self._sock.recv_multipart(copy=False))

    async def close(self) -> None:
        unregister = None if self._closed else self._unregister()
        self._closed = True
        if unregister is not None:
            try:
                await self._call(unregister, 2.0)
            except errors.GepoolError:
                pass
        try:
            if self._reader is not None:
                self._reader.cancel()
                # wait() neither raises the reader's CancelledError nor swallows one aimed at this task
                await asyncio.wait([self._reader])
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = self._timer_at = None
            if self._flush_at is not None:
                self._flush_at.cancel()
                self._flush_at = None
            self._groups = {}
            if self._draining is not None:
                self._draining.cancel()
                await asyncio.wait([self._draining])
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            if self._lane is not None:
                asyncio.get_running_loop().remove_reader(self._lane.fileno())
                self._lane.close()
                self._lane = None
            if not self._sock.closed:
                self._sock.close(0)
                self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _Answer:
    """What a ``submit``ted request waits with in place of a future: its reply, decoded, or its failure,
    handed to the caller's callback once. A callback that raises is logged here: it runs inside the
    client's lane reader, timer or lane loss, which must go on."""

    __slots__ = ("_done", "_out", "_called")

    def __init__(self, done: Callable[[dict | None, BaseException | None], None], out: _wire.Outgoing) -> None:
        self._done, self._out, self._called = done, out, False

    def done(self) -> bool:
        return self._called

    def set_result(self, reply: tuple) -> None:
        self._called = True
        msg, frames = reply
        try:
            outputs = _wire.result(msg, frames, None, self._out)
        except Exception as exc:  # the pool's error for this request (or a reply that does not decode)
            self._call(None, exc)
            return
        self._call(outputs, None)

    def set_exception(self, exc: BaseException) -> None:
        self._called = True
        self._call(None, exc)

    def set_outputs(self, outputs: dict) -> None:
        """Its rows of its group's answer (gepool/_groups.py)."""
        self._called = True
        self._call(outputs, None)

    def _call(self, outputs: dict | None, exc: BaseException | None) -> None:
        try:
            self._done(outputs, exc)
        except Exception:
            log.exception("internal error in the answer callback of request %s", self._out.req_id)


def _framed(queue: list) -> list[list]:
    """The queue's records in order (lane.framed)."""
    return _lane.framed([(one, records) for _, _, one, records in queue])


def _quiet(fut: asyncio.Future) -> None:
    """A fire-and-forget ZMQ send's outcome, taken (the request's own deadline says if it was lost)."""
    if not fut.cancelled():
        fut.exception()
