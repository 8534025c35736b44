"""The synchronous client's I/O thread: the Futures of ``Client.infer_async``, many in flight on one lane or socket."""

import collections
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

import zmq

from gepool import _wire
from gepool.clientcore import Inflight
from gepool.common import errors
from gepool.ipc import lane as _lane
from gepool.ipc import zmqio
from gepool.ipc.sockets import make_socket

if TYPE_CHECKING:
    from gepool.client import Client


class IoThread(threading.Thread):
    """Owns one ZMQ socket and, beside an ipc endpoint, a lane (preferred while it works). Another
    thread's request goes straight onto the lane when nothing waits to go before it: waking this
    thread through the pipe to send it cost a second wake-up per request (an open-loop sender paid
    two per arrival). Otherwise callers hand it requests through a deque and a wake-up pipe, and what
    waits there goes out as few lane records as hold it (a BATCH record, ipc/lane.py).
    ``send_lock`` keeps one message's records together on the lane and orders the two paths."""

    def __init__(self, core: "Client") -> None:
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
        self.batched = 0  # requests that shared a lane record with others

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
        """The outbox, over the lane as few records as hold it (lane.framed), or by ZMQ: with no lane,
        for a message of more parts than a lane frames, and for what a lost lane did not send."""
        if not self.outbox:
            return
        with self.send_lock:
            if self.lane is None:
                self._connect_lane(poller)
            pending, outbox, run, framed = self.pending, self.outbox, [], []
            while outbox:
                out, fut, deadline = outbox.popleft()
                if self.lane is not None:
                    try:
                        framed.append(_lane.frame(out.frames))
                        pending[out.req_id] = (out, fut, deadline, True)
                        run.append(out)
                        continue
                    except _lane.LaneError:
                        pass
                pending[out.req_id] = (out, fut, deadline, False)
                zmqio.send_parts(sock, out.frames)  # the next poll's wait includes a look at the endpoint
            if run:
                self._send_run(sock, poller, run, _lane.framed(framed))

    def _send_run(self, sock: zmq.Socket, poller: zmq.Poller, run: list, records: list[list]) -> None:
        """``run``'s requests, as ``records``, over the lane; those a lost lane did not send go by ZMQ.
        Called holding ``send_lock``."""
        pending, lane_sock, sent = self.pending, self.lane.sock, 0
        try:
            lane_sock.settimeout(None)
            for record in records:
                lane_sock.sendmsg(record)
                n = _lane.completes(record)
                sent += n
                self.batched += n if n > 1 else 0
        except OSError as exc:  # the pool behind it is gone, or a record cut: the lane cannot go on
            unsent = [pending.pop(out.req_id) for out in run[sent:]]
            self._lose_lane(poller, exc)
            for out, fut, deadline, _ in unsent:
                pending[out.req_id] = (out, fut, deadline, False)
                zmqio.send_parts(sock, out.frames)

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
    # record is read, so the front gets the first of them while it is still sending the rest; a batch's
    # replies are all delivered first, and what their callbacks sent goes out together.
    def _receive_lane(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        while self.lane is not None:
            try:
                messages = self.lane.receiver.take(self.lane.sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except (EOFError, OSError, _lane.LaneError) as exc:
                with self.send_lock:
                    self._lose_lane(poller, exc)
                return
            if messages is not None:
                for parts in messages:
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
