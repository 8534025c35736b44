"""Lanes: a same-host client's messages over a Unix SEQPACKET socket beside the pool's ipc endpoint.

ZMQ hands every message to an I/O thread on each side, so one hop wakes three threads. On a 2-vCPU
host a bare pyzmq REQ/REP round trip over ipc took 87-106 us where a SEQPACKET round trip took
10 us (both cross-process, in Python). A lane carries exactly what the ZMQ socket carries (the
protocol's msgpack payload, then tensor parts), framed as below. SEQPACKET keeps record boundaries
and queues a record whole or not at all, so a non-blocking sender never holds half a record.

Framing: a message is one or more records. A record is one flag byte (MORE: records follow) and at
most RECORD_MAX - 1 bytes of the message's body. The body is a header (``<I`` part count, ``<Q``
per part length), then the parts back to back. The header always fits in the first record.

A BATCH record carries several one-record messages that were ready together, so that they cost one
``sendmsg`` and one ``recvmsg`` instead of one each: after its flag, ``<I`` message count, then per
message ``<I`` length and the message's own record (its flag 0). A batch never spans records and
never nests; it is taken whole or, if anything in it disagrees, not at all (LaneError).
"""

import collections
import mmap
import socket
import struct
import time
from collections.abc import Callable, Iterable

RECORD_MAX = 64 * 1024  # fits the default socket buffer (212992 bytes) on any Linux host
SOCKET_BUFFER = 1 << 20  # asked for; the kernel caps it at net.core.[rw]mem_max
MAX_PARTS = (RECORD_MAX - 1 - 4) // 8  # 8191: the header must fit in the first record
MAX_BUFFERS = 512  # per sendmsg, well under IOV_MAX (1024); a record with more parts is joined first
MAX_MESSAGE_BYTES = 1 << 34  # a receiver's default limit; the front's is its largest slot plus headroom
MORE = 1
BATCH = 2
MAX_BATCH = 1024  # messages in one batch record
BATCH_ROOM = RECORD_MAX - 1 - 4  # a batch record's bytes after its flag and count
_LAST, _MORE = b"\x00", b"\x01"
_TRUNC = int(socket.MSG_TRUNC)  # an IntFlag: `int & IntFlag` goes through enum's Python code, per record
_COUNT = struct.Struct("<I")
_BATCH_HEAD = struct.Struct("<BI")
SUFFIX = ".lane"
# The front's first message on a lane it keeps: a message of no parts. It refuses one by closing it
# instead (at its lane cap), and the client then talks ZMQ.
ACCEPTED = _LAST + _COUNT.pack(0)
HANDSHAKE_TIMEOUT_S = 2.0
RETRY_S = 1.0  # after a lane could not connect (or died), a client talks ZMQ alone this long


class LaneError(ValueError):
    """The peer broke the framing: the connection cannot be trusted any further."""


class Oversized(Exception):
    """A message declared more bytes than the receiver's limit: it is read and thrown away record by
    record (the lane stays usable); ``head`` is its first part when that fits in its first record."""

    def __init__(self, total: int, limit: int, head: bytes | None) -> None:
        super().__init__(f"a message of {total} bytes is larger than the {limit} this pool accepts")
        self.total, self.limit, self.head = total, limit, head


def path_for(ipc_path: str) -> str:
    return ipc_path + SUFFIX


class Dialer:
    """Where a client's lanes connect (None: it has none, e.g. tcp or CURVE), and when it may try
    again after one failed to connect or died; the client talks ZMQ meanwhile."""

    def __init__(self, ipc_path: str | None, wanted: bool = True) -> None:
        self.path = path_for(ipc_path) if wanted and ipc_path else None
        self.retry_at = 0.0

    def due(self) -> bool:
        return self.path is not None and time.monotonic() >= self.retry_at

    def failed(self) -> None:
        self.retry_at = time.monotonic() + RETRY_S

    def connect(self) -> "Connection | None":
        if not self.due():
            return None
        try:
            return Connection(self.path)
        except OSError:  # no pool there yet, one without lanes, or a refusal
            self.failed()
            return None


def tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def _flat(part) -> memoryview:
    view = part if type(part) is memoryview else memoryview(part)
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B") if view.nbytes else memoryview(b"")


def record(parts: list) -> tuple[list, int] | None:
    """The message as one record (its buffers, and its length) when it fits in one, else None."""
    count = len(parts)
    if count > MAX_PARTS:
        return None
    buffers, sizes, size = [_LAST, b""], [], 0
    for part in parts:
        if type(part) is not bytes:
            part = _flat(part)
        buffers.append(part)
        n = len(part)  # a flat view's len is its bytes
        sizes.append(n)
        size += n
    buffers[1] = _sizes(count).pack(count, *sizes)
    size += 1 + 4 + 8 * count
    return (buffers, size) if size <= RECORD_MAX else None


def records(parts: list) -> list[list]:
    """The message as records, each a list of buffers for one ``sendmsg`` (nothing is joined)."""
    one = record(parts)
    if one is not None:
        return [_joined(one[0])]
    return spanning(parts)


def frame(parts: list) -> tuple[tuple[list, int] | None, list[list] | None]:
    """What ``framed`` takes: (``record(parts)``, None) for a message that fits one record, else (None, its
    records); ``record`` runs once either way."""
    one = record(parts)
    return (one, None) if one is not None else (None, spanning(parts))


def spanning(parts: list) -> list[list]:
    """``records`` for a message ``record`` found too long for one record (one that fits comes out as one
    record too, framed as ``record`` frames it)."""
    if len(parts) > MAX_PARTS:
        raise LaneError(f"a message has at most {MAX_PARTS} parts, not {len(parts)}")
    views = [_flat(p) for p in parts]
    header = struct.pack(f"<I{len(views)}Q", len(views), *[v.nbytes for v in views])
    out, rec, room = [], [_MORE, header], RECORD_MAX - 1 - len(header)
    for view in views:
        while view.nbytes:
            if room == 0:
                out.append(rec)
                rec, room = [_MORE], RECORD_MAX - 1
            piece = view[:room]
            rec.append(piece)
            room -= piece.nbytes
            view = view[piece.nbytes:]
    out.append(rec)
    out[-1][0] = _LAST
    return [_joined(r) for r in out]


def batched(messages: list[tuple[list, int]]) -> list[list]:
    """One-record messages (``record``'s results), in order, as few records as hold them: a BATCH record
    for each run that fits one, a message on its own in its own framing."""
    out: list[list] = []
    run: list = []
    used = count = 0
    for buffers, size in messages:
        if count and (used + 4 + size > BATCH_ROOM or count == MAX_BATCH):
            out.append(_batch(run, count))
            run, used, count = [], 0, 0
        run.append((buffers, size))
        used += 4 + size
        count += 1
    if count:
        out.append(_batch(run, count))
    return out


def framed(messages: Iterable[tuple[tuple[list, int] | None, list[list] | None]]) -> list[list]:
    """Messages (``frame``'s results), in order, as records: each run of one-record messages ``batched``, a
    longer message's records as they are."""
    out: list[list] = []
    run: list = []
    for one, spans in messages:
        if one is not None:
            run.append(one)
            continue
        if run:
            out += batched(run)
            run = []
        out += spans
    if run:
        out += batched(run)
    return out


def completes(record: list) -> int:
    """How many messages a record from ``records`` or ``batched`` ends (0: one continues past it)."""
    flag = memoryview(record[0])[0]
    return _BATCH_HEAD.unpack_from(record[0])[1] if flag == BATCH else 0 if flag & MORE else 1


def _batch(run: list, count: int) -> list:
    if count == 1:
        return _joined(run[0][0])
    rec = [_BATCH_HEAD.pack(BATCH, count)]
    pack = _COUNT.pack
    for buffers, size in run:
        rec.append(pack(size))
        rec += buffers
    return _joined(rec)


def _joined(record: list) -> list:
    return record if len(record) <= MAX_BUFFERS else [record[0], b"".join(record[1:])]


class Receiver:
    """One connection's incoming messages, a record at a time. A single-record message (or batch) is
    copied out of a scratch buffer; a longer message is received straight into its own buffer.
    Receivers used by one thread may share a scratch buffer (the front's do: 64 KiB per lane adds up)."""

    def __init__(self, readonly: bool = False, scratch: bytearray | None = None,
                 limit: Callable[[], int] | None = None) -> None:
        """``limit()``: the most bytes a message may declare, asked when a message spans records."""
        self.scratch = bytearray(RECORD_MAX) if scratch is None else scratch
        self.flag = bytearray(1)
        self.readonly = readonly
        self.limit = limit
        self.body: mmap.mmap | None = None
        self.sizes: tuple = ()
        self.filled = 0
        self.skip = 0  # bytes of an oversized message still to throw away
        self.backlog: collections.deque = collections.deque()  # a batch's messages that recv() has not returned

    def recv(self, sock: socket.socket, flags: int = 0) -> list[memoryview] | None:
        """One message at a time: what ``take`` says, a batch's messages returned by the calls that follow
        (before any other record is read)."""
        if self.backlog:
            return self.backlog.popleft()
        messages = self.take(sock, flags)
        if messages is None:
            return None
        if len(messages) > 1:
            self.backlog.extend(messages[1:])
        return messages[0]

    def take(self, sock: socket.socket, flags: int = 0) -> list[list[memoryview]] | None:
        """Takes one record (BlockingIOError or TimeoutError pass through); returns the parts of the
        messages it completed: one message, or a batch's. None while a message spanning records is still
        arriving. EOFError when the peer closed, LaneError on broken framing. ``flags``: MSG_DONTWAIT
        reads a blocking socket without waiting. Oversized when a message declares more than
        ``limit()``: its records are then read and dropped by the calls that follow."""
        if self.skip:
            return self._discard(sock, flags)
        if self.body is None:
            n, _, got, _ = sock.recvmsg_into([self.scratch], 0, flags)
            if n == 0:
                raise EOFError("the peer closed the lane")
            if got & _TRUNC:
                raise LaneError(f"a record longer than {RECORD_MAX} bytes")
            scratch = memoryview(self.scratch)[:n]
            flag = scratch[0]
            if flag == BATCH:
                return _unbatch(scratch)
            if flag > MORE:
                raise LaneError(f"a record with flags {flag:#x}")
            sizes, at = _header(scratch)
            total = sum(sizes)
            if not flag:
                if n - at != total:
                    raise LaneError(f"a one-record message declares {total} bytes and carries {n - at}")
                return [_split(bytes(scratch[at:]), sizes, False)]
            if total == 0 or n - at > total:
                raise LaneError(f"a message declares {total} bytes")
            limit = self.limit() if self.limit is not None else MAX_MESSAGE_BYTES
            if total > limit:
                self.skip = total - (n - at)
                head = bytes(scratch[at:at + sizes[0]]) if sizes and at + sizes[0] <= n else None
                raise Oversized(total, limit, head)
            # An anonymous map, not a bytearray (which zero-fills every page at once): memory is taken
            # only as the bytes arrive, so a declared size costs nothing until it is sent.
            self.body = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE)
            self.sizes, self.filled = sizes, n - at
            self.body[:n - at] = scratch[at:]
            return None
        room = memoryview(self.body)[self.filled:self.filled + RECORD_MAX - 1]
        n, _, got, _ = sock.recvmsg_into([self.flag, room], 0, flags)
        if n == 0:
            raise EOFError("the peer closed the lane")
        if got & _TRUNC or n == 1 and room.nbytes:
            raise LaneError("a record overflows its message")
        if self.flag[0] > MORE:
            raise LaneError(f"a record with flags {self.flag[0]:#x} inside a message")
        self.filled += n - 1
        if self.flag[0] & MORE:
            if self.filled >= len(self.body):
                raise LaneError("a message runs past its declared length")
            return None
        body, sizes = self.body, self.sizes
        self.body, self.sizes = None, ()
        if self.filled != len(body):
            raise LaneError(f"a message declares {len(body)} bytes and carries {self.filled}")
        return [_split(body, sizes, self.readonly)]

    def _discard(self, sock: socket.socket, flags: int) -> None:
        n, _, got, _ = sock.recvmsg_into([self.scratch], 0, flags)
        if n == 0:
            raise EOFError("the peer closed the lane")
        if got & _TRUNC or n == 1 or n - 1 > self.skip or self.scratch[0] > MORE:
            raise LaneError("a record overflows its message")
        self.skip -= n - 1
        if not self.scratch[0] & MORE:
            if self.skip:
                raise LaneError(f"a message ends {self.skip} bytes short of its declared length")
            return None
        if not self.skip:
            raise LaneError("a message runs past its declared length")
        return None


def _unbatch(record: memoryview) -> list[list[memoryview]]:
    """A BATCH record's messages; each message's lengths are checked against the record before its parts
    are cut, and nothing is returned unless all of them agree."""
    if record.nbytes < _BATCH_HEAD.size:
        raise LaneError("a record too short for a batch header")
    _, count = _BATCH_HEAD.unpack_from(record)
    if not 0 < count <= MAX_BATCH:
        raise LaneError(f"a batch of {count} messages (at most {MAX_BATCH})")
    body = bytes(record[_BATCH_HEAD.size:])  # one copy for all its messages' parts
    view = memoryview(body)
    end, at, unpack, messages = len(body), 0, _COUNT.unpack_from, []
    for _ in range(count):
        if at + 4 > end:
            raise LaneError(f"a batch declares {count} messages and carries fewer")
        (size,) = unpack(body, at)
        at += 4
        stop = at + size
        if stop > end:
            raise LaneError(f"a batched message of {size} bytes runs past its batch")
        if size < 1 + _COUNT.size:
            raise LaneError("a batched message too short for a message header")
        if body[at]:
            raise LaneError(f"a batched message with flags {body[at]:#x} (batches do not nest or span records)")
        (n,) = unpack(body, at + 1)
        head = at + 1 + 4 + 8 * n
        if n > MAX_PARTS or head > stop:
            raise LaneError(f"a batched message header of {n} parts")
        sizes = _sizes(n).unpack_from(body, at + 1)
        if head + sum(sizes) - sizes[0] != stop:
            raise LaneError(f"a batched message declares {head - at + sum(sizes) - sizes[0]} bytes and "
                            f"carries {size}")
        parts = []
        for k in sizes[1:]:
            parts.append(view[head:head + k])
            head += k
        messages.append(parts)
        at = stop
    if at != end:
        raise LaneError(f"a batch carries {end - at} bytes after its last message")
    return messages


def _sizes(count: int) -> struct.Struct:
    """A message header's struct: ``<I`` count, then ``count`` ``<Q`` lengths."""
    return _SIZES[count] if count < len(_SIZES) else struct.Struct(f"<I{count}Q")


_SIZES = [struct.Struct(f"<I{n}Q") for n in range(16)]


def _header(record: memoryview) -> tuple[tuple, int]:
    if record.nbytes < 1 + _COUNT.size:
        raise LaneError("a record too short for a message header")
    (count,) = _COUNT.unpack_from(record, 1)
    at = 1 + _COUNT.size + 8 * count
    if count > MAX_PARTS or at > record.nbytes:
        raise LaneError(f"a message header of {count} parts")
    return struct.unpack_from(f"<{count}Q", record, 1 + _COUNT.size), at


def _split(body, sizes: tuple, readonly: bool) -> list[memoryview]:
    view = memoryview(body)
    if readonly:
        view = view.toreadonly()
    parts, at = [], 0
    for size in sizes:
        parts.append(view[at:at + size])
        at += size
    return parts


class Connection:
    """A client thread's end of a lane: blocking sends and receives, with a deadline. Connecting waits
    for the front's ACCEPTED (OSError if it refuses or does not answer: the caller then uses ZMQ)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.receiver = Receiver(readonly=True)
        try:
            tune(self.sock)
            self.sock.connect(path)
            self.sock.settimeout(HANDSHAKE_TIMEOUT_S)
            if self.receiver.recv(self.sock) != []:
                raise ConnectionRefusedError("the pool did not accept the lane")
        except (EOFError, LaneError, TimeoutError) as exc:
            self.sock.close()
            raise ConnectionRefusedError(f"the pool did not accept the lane: {exc}") from None
        except BaseException:
            self.sock.close()
            raise

    def send(self, parts: list, timeout: float | None) -> None:
        """TimeoutError if the pool stops reading. Whatever stops a send after its first record (a
        timeout, KeyboardInterrupt) closes the lane: the rest of the message would never follow, and
        the next message's records would be read as this one's."""
        self.sock.settimeout(timeout)
        sent = 0
        try:
            for record in records(parts):
                self.sock.sendmsg(record)
                sent += 1
        except BaseException:
            if sent:
                self.sock.close()
            raise

    def recv(self, deadline: float | None) -> list[memoryview]:
        """One whole message; TimeoutError at ``deadline`` (time.monotonic), EOFError if the pool closed."""
        while True:
            if deadline is None:
                self.sock.settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no message before the deadline")
                self.sock.settimeout(left)
            parts = self.receiver.recv(self.sock)
            if parts is not None:
                return parts

    def close(self) -> None:
        self.sock.close()

    def __del__(self) -> None:  # a thread that ended took its lane with it: close, without a warning
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close()
