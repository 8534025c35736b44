"""The front's end of the lanes (see ipc/lane.py): a listening SEQPACKET socket beside the ipc
endpoint, and one connection per client thread, all behind one epoll whose descriptor sits in the
front's poll like any socket. A lane's messages go through the same handler as the ZMQ socket's;
its identity is minted here, and replies to it go back over the lane.

Replies made in one pass of the front's loop wait in their lane's batch until the loop calls ``flush()``
before it waits again: a lane's replies of one pass go as one BATCH record (or as few as hold them)
instead of one record each. A reply that points into a slot waits uncopied, so its lane's batch goes
out at ``settle()``, which the dispatcher calls before it releases that slot: a batch's replies to one
lane still share a record. The front never blocks on a client: a record that finds the client's socket
buffer full is copied into that lane's queue and waits there until the socket drains. A client that
breaks the framing loses its lane; one that closed it loses the replies still due, as with ZMQ.
"""

import collections
import logging
import os
import resource
import select
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gepool.common import errors
from gepool.ipc import lane, protocol
from gepool.scheduler.lograte import Limited

log = logging.getLogger("gepool.lanes")
limited = Limited(log)  # what a client's bytes make the front say: bounded per client

MARK = 1  # first byte of a lane identity; ZMQ's own identities start with 0
_ID = struct.Struct("<BQ")


def is_lane_identity(identity: bytes) -> bool:
    """Shaped as the identities lanes mint (a ZMQ peer that set its own routing id may forge one)."""
    return len(identity) == _ID.size and identity[0] == MARK
_UCRED = struct.Struct("3i")  # pid, uid, gid
QUEUE_LIMIT = 1 << 30  # bytes of replies held for one lane before the front gives up on it
ACCEPT_PAUSE_S = 1.0  # after accept() failed (out of descriptors): connections wait in the backlog
# Descriptors kept for everything but lanes: past the soft limit less this, a new lane is refused
# (closed at once; its client talks ZMQ, which costs the front no descriptor per client). libzmq
# aborts the process when its ipc listener meets EMFILE, so the front must never get there.
FD_RESERVE = 1024
MIN_LANES = 64


@dataclass(eq=False)
class Lane:
    sock: socket.socket
    identity: bytes
    pid: int  # the client process, from the kernel (SO_PEERCRED)
    receiver: lane.Receiver
    queue: collections.deque = field(default_factory=collections.deque)
    queued: int = 0
    uid: int = -1  # the client's user, from the kernel too
    batch: list = field(default_factory=list)  # this pass's replies, as lane.frame() gives them
    batched: int = 0  # their bytes as batched (each with its length)
    listed: bool = False  # in Lanes.pending (its batch goes at the next flush)
    viewing: bool = False  # in Lanes.viewing (its batch points into a slot: it goes at the next settle)


class Lanes:
    def __init__(self, path: str, on_message: Callable[[bytes, list[memoryview]], None]) -> None:
        """``on_message(identity, parts)``: a message's parts as buffers, as the ZMQ channel hands them."""
        self.path, self.on_message = path, on_message
        if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)  # left by a dead pool (the ZMQ endpoint beside it was checked already)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK
                                      | socket.SOCK_CLOEXEC)
        try:
            self.listener.bind(path)
            os.chmod(path, 0o600)
            self.listener.listen(256)
        except BaseException:
            self.listener.close()
            raise
        self.epoll = select.epoll()
        self.epoll.register(self.listener.fileno(), select.EPOLLIN)
        self.by_fd: dict[int, Lane] = {}
        self.by_identity: dict[bytes, Lane] = {}
        self._minted = 0
        self.resume_at: float | None = None  # accepting paused until then
        self._scratch = bytearray(lane.RECORD_MAX)  # every lane's: one thread reads them, one record at a time
        self.limit: Callable[[], int] = lambda: lane.MAX_MESSAGE_BYTES  # the front sets its own
        self.pending: list[Lane] = []  # lanes with a batch to flush
        self.viewing: list[Lane] = []  # lanes whose batch points into a slot, to send at settle()

    def fileno(self) -> int:
        return self.epoll.fileno()

    def __len__(self) -> int:
        return len(self.by_fd)

    def pids(self) -> list[int]:
        """The processes on the other end of the lanes (what status() reports)."""
        return sorted({conn.pid for conn in self.by_fd.values()})

    def pump(self, budget: int) -> None:
        """Accepts, reads and flushes what is ready, handling at most ``budget`` messages; what is left
        keeps the epoll readable, so the front's next poll comes straight back."""
        for fd, events in self.epoll.poll(0):
            if fd == self.listener.fileno():
                self._accept()
                continue
            conn = self.by_fd.get(fd)
            if conn is None:
                continue
            if events & select.EPOLLOUT:
                self._drain(conn)
            if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and conn.sock.fileno() >= 0:
                budget -= self._read(conn, budget)
            if budget <= 0:
                return

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: stop asking (the listener would stay ready, and
                # the loop spin) until the front's timer resumes it; the connection waits in the backlog
                log.warning("cannot accept a lane, pausing for %.0f s: %s", ACCEPT_PAUSE_S, exc)
                self.epoll.unregister(self.listener.fileno())
                self.resume_at = time.monotonic() + ACCEPT_PAUSE_S
                return
            if len(self.by_fd) >= self.cap():
                sock.close()  # refused: the client's handshake sees the close and it falls back to ZMQ
                continue
            sock.setblocking(False)
            lane.tune(sock)
            try:
                sock.send(lane.ACCEPTED, socket.MSG_NOSIGNAL)
            except OSError:
                sock.close()
                continue
            self._minted += 1
            pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            conn = Lane(sock, _ID.pack(MARK, self._minted), pid, lane.Receiver(scratch=self._scratch, limit=self.limit),
                        uid=uid)
            self.by_fd[sock.fileno()] = conn
            self.by_identity[conn.identity] = conn
            self.epoll.register(sock.fileno(), select.EPOLLIN)

    @staticmethod
    def cap() -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return 1 << 20 if soft == resource.RLIM_INFINITY else max(MIN_LANES, soft - FD_RESERVE)

    def resume(self, now: float) -> None:
        if self.resume_at is not None and now >= self.resume_at:
            self.resume_at = None
            self.epoll.register(self.listener.fileno(), select.EPOLLIN)

    def _read(self, conn: Lane, budget: int) -> int:
        """Messages until the socket is empty or ``budget`` is spent (a batch counts whole)."""
        handled = 0
        take, sock, identity, on_message = conn.receiver.take, conn.sock, conn.identity, self.on_message
        while handled < budget:
            try:
                messages = take(sock)
            except (BlockingIOError, InterruptedError):
                break
            except (EOFError, ConnectionError):
                self._drop(conn)
                break
            except lane.Oversized as exc:  # its records are dropped as they come; the client hears why now
                limited.log(logging.WARNING, "oversized", conn.uid, "refusing a message on the lane of pid %d: %s",
                            conn.pid, exc)
                self.send(identity, [_too_large(exc)])
                continue
            except (lane.LaneError, MemoryError, OSError) as exc:
                limited.log(logging.WARNING, "framing", conn.uid, "closing the lane of pid %d: %s", conn.pid, exc)
                self._drop(conn)
                break
            if messages is not None:
                handled += len(messages)
                for parts in messages:
                    on_message(identity, parts)
        return handled

    def peer(self, identity: bytes) -> tuple[int, int] | None:
        """(pid, uid) of the process on an open lane, as the kernel gave them; None for any other identity."""
        conn = self.by_identity.get(identity)
        return None if conn is None else (conn.pid, conn.uid)

    def owns(self, identity: bytes) -> bool:
        """An identity minted here (its lane may be gone since): never one for the ZMQ socket."""
        if identity in self.by_identity:  # an open lane's: one lookup on the hot path
            return True
        return is_lane_identity(identity) and 0 < _ID.unpack(identity)[1] <= self._minted

    def send(self, identity: bytes, parts: list, copy: bool = False) -> None:
        """A reply that fits one record joins its lane's batch, sent by ``flush()``, or by ``settle()``
        when ``copy`` says its parts point into a slot; a longer one goes now, after the batch, or queues
        a copy. A closed lane's replies are dropped (its client is gone)."""
        conn = self.by_identity.get(identity)
        if conn is None:
            return
        one = lane.record(parts)
        if one is not None:
            size = one[1]
            if conn.batch and (conn.batched + 4 + size > lane.BATCH_ROOM or len(conn.batch) == lane.MAX_BATCH):
                self._send_batch(conn)  # full: it goes now
            if not conn.listed:
                conn.listed = True
                self.pending.append(conn)
            if copy and not conn.viewing:
                conn.viewing = True
                self.viewing.append(conn)
            conn.batch.append((one, None))
            conn.batched += 4 + size
            return
        try:
            spans = lane.spanning(parts)
        except lane.LaneError as exc:  # the client hears why instead of waiting out its timeout
            log.error("cannot send a reply over a lane: %s", exc)
            spans = lane.records([_unframeable(parts[0], exc)])
        conn.batch.append((None, spans))
        self._send_batch(conn)

    def settle(self) -> None:
        """Sends the batches that point into a slot (and what their lanes batched before): the slot is
        about to be released, and may be refilled before the next flush. A record the socket has no
        room for is queued as a copy."""
        viewing, self.viewing = self.viewing, []
        for conn in viewing:
            conn.viewing = False
            if conn.batch:
                self._send_batch(conn)

    def flush(self) -> None:
        """Sends every lane's batch: the front's loop calls it once a pass, before it waits."""
        self.settle()
        pending, self.pending = self.pending, []
        for conn in pending:
            conn.listed = False
            if conn.batch:
                self._send_batch(conn)

    def _send_batch(self, conn: Lane) -> None:
        batch, conn.batch, conn.batched = conn.batch, [], 0
        if conn.sock.fileno() >= 0:
            self._transmit(conn, lane.framed(batch))

    def _transmit(self, conn: Lane, records: list[list]) -> None:
        """Records now, in order; from the first the socket has no room for, a copy in the lane's queue."""
        if not conn.queue:
            sendmsg = conn.sock.sendmsg
            for i, record in enumerate(records):
                try:
                    sendmsg(record, (), socket.MSG_NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    records = records[i:]
                    break
                except OSError:
                    self._drop(conn)
                    return
            else:
                return
            self.epoll.modify(conn.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)
        for record in records:
            data = b"".join(record)
            conn.queue.append(data)
            conn.queued += len(data)
        if conn.queued > QUEUE_LIMIT:
            limited.log(logging.WARNING, "unread", conn.uid, "the client on the lane of pid %d has not read %d bytes "
                        "of replies; closing it", conn.pid, conn.queued)
            self._drop(conn)

    def _drain(self, conn: Lane) -> None:
        while conn.queue:
            try:
                conn.sock.send(conn.queue[0], socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(conn)
                return
            conn.queued -= len(conn.queue.popleft())
        self.epoll.modify(conn.sock.fileno(), select.EPOLLIN)

    def _drop(self, conn: Lane) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        self.by_fd.pop(fd, None)
        self.by_identity.pop(conn.identity, None)
        try:
            self.epoll.unregister(fd)
        except OSError:
            pass
        conn.sock.close()
        conn.queue.clear()
        conn.batch.clear()

    def close(self) -> None:
        self.flush()  # what the last pass answered (a stopping front answers every request in flight)
        for conn in list(self.by_fd.values()):
            self._drop(conn)
        self.epoll.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _unframeable(header, exc: lane.LaneError) -> bytes:
    """An Error for the request a reply answered (its req_id read back from the reply's header)."""
    try:
        req_id = getattr(protocol.decode(memoryview(header)), "req_id", 0)
    except protocol.ProtocolError:
        req_id = 0
    return protocol.Error(req_id if type(req_id) is int else 0, errors.Internal.code,
                          f"the reply cannot travel over this client's lane: {exc}").encode()


def _too_large(exc: lane.Oversized) -> bytes:
    """The Error for a message declared larger than the front accepts (its req_id from its header)."""
    req_id = 0
    if exc.head is not None:
        try:
            req_id = getattr(protocol.decode(memoryview(exc.head)), "req_id", 0)
        except protocol.ProtocolError:
            pass
    return protocol.Error(req_id if type(req_id) is int else 0, errors.RequestTooLarge.code, str(exc)).encode()
