"""The gateway's gRPC port on a bare asyncio protocol: HTTP/2 (RFC 9113) and gRPC's framing, on the gateway's loop.

grpc.aio hands each call between its reader thread, its polling thread and the event loop (9-10 context
switches a request); here a call costs the handler's task and nothing else: frames are parsed where they
arrive, a repeated header block that changes no HPACK table (as clients send them) is looked up instead of
decoded, and an answer goes out in one write. The handlers are the ones grpc.aio serves (``grpc.RpcMethodHandler``).
A unary method may also have a fast path (``Listener.fast``) that takes a call with no deadline from the
frame parser's callback and answers it through a callback, with no task at all.

Every byte is hostile: a frame over our MAX_FRAME_SIZE, a header block over MAX_HEADER_BLOCK, a message
declaring more than the body limit (RESOURCE_EXHAUSTED, before it is read), more than MAX_STREAMS calls at
once (REFUSED_STREAM), requests still arriving past ``Listener.max_partial`` (RESOURCE_EXHAUSTED), floods
of frames that carry no request (GOAWAY), a unary request that does not arrive within BODY_TIMEOUT_S; flow
control bounds what a stream may send ahead of its handler and what we send ahead of the client, and a
client that does not read what it is sent stops being read, then is cut off after STALL_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
import socket
import struct
import zlib
from collections import deque
from collections.abc import Callable

import grpc
from hpack import Decoder, HPACKDecodingError, HPACKError
from hpack.hpack import decode_integer, encode_integer

from gepool.grpc.access import GrpcRestrictions
from gepool.http import listen
from gepool.http.limits import BODY_TIMEOUT_S, INLINE_PARSE_BYTES, BodyLimit

log = logging.getLogger("gepool.grpc")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 5, 6, 7, 8, 9, 11
MAX_WINDOW = (1 << 31) - 1

MAX_STREAMS = 128  # calls open at once on a connection (SETTINGS_MAX_CONCURRENT_STREAMS); clients queue the rest
MAX_FRAME_SIZE = 1 << 20  # the largest frame a client may send us: big tensors in few frames
MAX_HEADER_BLOCK = 64 << 10  # a header block, with its CONTINUATION frames, encoded and decoded
STREAM_WINDOW = 1 << 20  # what a stream may send ahead of being read
CONNECTION_WINDOW = 16 << 20  # ... and all of a connection's streams
QUEUED_BYTES = 1 << 20  # whole messages a streaming call holds unread before its window stops opening
PREFACE_TIMEOUT_S = 10.0  # the client preface and its SETTINGS must come within this
MAX_CONTROL_FRAMES = 2000  # frames carrying no call or request bytes a connection may cause per sweep
MIN_CREDITED = 8  # request messages shorter than this earn no credit: they count as control frames
CALL_CREDIT = 2  # ... and per request message in that time, for the client's WINDOW_UPDATEs about its answer
SWEEP_S = 1.0
IDLE_TIMEOUT_S = 300.0  # a connection with no call this long is sent GOAWAY (grpc's max_connection_idle)
STALL_TIMEOUT_S = 30.0  # an answer the client's window has let nothing of through this long is reset
MAX_PENDING_WRITE = 64 << 10  # frames gathered before they are handed to the transport (which may then pause us)
MAX_KEPT_BLOCK = 256  # header blocks kept with what they say, at most KEPT_BLOCKS of them per connection
KEPT_BLOCKS = 32
STOP_GRACE_S = 5.0  # calls in flight when the gateway stops get this long to finish
MAX_MESSAGE_TEXT = 1024  # the longest grpc-message sent (before percent-encoding): a trailers frame fits one frame
MAX_ECHO = 200  # the most of a client's own text (a path, a header) repeated in an answer

_HEADER = struct.Struct(">BHBBL")  # length (24 bits, split), type, flags, stream id
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_PREFIX = struct.Struct(">BL")  # a gRPC message's compressed flag and length
_TIMEOUT = re.compile(rb"(\d{1,8})([HMSmun])")
_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_ENCODINGS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
OK = grpc.StatusCode.OK


class ConnectionError_(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY with ``code``, then the connection closes."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text


class Abort(grpc.aio.AbortError):
    """What ``context.abort`` raises (a grpc.aio AbortError, so the handlers' wrappers pass it through)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, sid) + payload


def _string(value: bytes) -> bytes:
    return bytes(encode_integer(len(value), 7)) + value


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field, literal without indexing, new name (RFC 7541 6.2.2): the client's table is untouched."""
    return b"\x00" + _string(name) + _string(value)


_RESPONSE_HEAD = b"\x88" + _literal(b"content-type", b"application/grpc")  # :status 200 is static index 8
_TRAILERS_OK = _literal(b"grpc-status", b"0")


def _percent(text: str) -> bytes:
    """grpc-message's percent-encoding (gRPC's PROTOCOL-HTTP2): UTF-8, every byte outside 0x20-0x7E and '%'."""
    raw = text.encode("utf-8", "replace")[:MAX_MESSAGE_TEXT]
    return b"".join(bytes((c,)) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c for c in raw)


def _status_block(code: grpc.StatusCode, details: str) -> bytes:
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    return block + _literal(b"grpc-message", _percent(details)) if details else block


def _echo(value: bytes | None) -> str:
    """A client's header value, as an answer may name it: ASCII-escaped, and cut short."""
    if value is None:
        return "none"
    text = value[:MAX_ECHO].decode("ascii", "backslashreplace")
    return f"'{text}...'" if len(value) > MAX_ECHO else f"'{text}'"


def _changes_no_table(block: bytes) -> bool:
    """Whether a header block holds only indexed fields and literals without indexing or never indexed
    (RFC 7541 6.1, 6.2.2, 6.2.3): no literal with incremental indexing, no table size update. A block that does
    not parse as such is not (the decoder then says what is wrong with it)."""
    view, at, end = memoryview(block), 0, len(block)
    try:
        while at < end:
            first = block[at]
            if first & 0x80:
                at += decode_integer(view[at:], 7)[1]
            elif first & 0xE0:  # 01xxxxxx adds to the table, 001xxxxx resizes it
                return False
            else:
                name, used = decode_integer(view[at:], 4)
                at += used
                for _ in range(1 if name else 2):  # the name's string (index 0), then the value's
                    length, used = decode_integer(view[at:], 7)  # (past the end: the decoder's error)
                    at += used + length
    except HPACKDecodingError:
        return False
    return at == end


def _read_head(fields: list[tuple[bytes, bytes]], wanted: frozenset[bytes]) -> tuple:
    """(method, path, content-type, grpc-timeout, grpc-encoding, metadata): the metadata is the first value of
    each key in ``wanted`` (the restricted APIs' keys) that the call carries."""
    method = path = ctype = timeout = encoding = None
    for name, value in fields:
        if name == b":path":
            path = value
        elif name == b":method":
            method = value
        elif name == b"content-type":
            ctype = value
        elif name == b"grpc-timeout":
            timeout = value
        elif name == b"grpc-encoding":
            encoding = value
    metadata = {}
    if wanted:
        for name, value in fields:
            if name in wanted and name not in metadata:
                metadata[name] = value
    return method, path, ctype, timeout, encoding, metadata


class Context:
    """What the handlers use of grpc.aio's ServicerContext: peer(), abort(), write(); and write_now()."""

    __slots__ = ("_stream",)

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def peer(self) -> str:
        return self._stream.conn.peer

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Abort(code, details)

    async def write(self, reply) -> None:
        s = self._stream
        await s.conn.send_message(s, s.serialize(reply))

    def write_now(self, reply) -> bool:
        """``write`` without waiting: True once the reply is queued (or dropped, the call being over); False,
        with nothing done, while what the call has queued waits for the client's window (``write`` waits)."""
        s = self._stream
        if s.done or s.ending:
            return True
        if s.out_bytes > QUEUED_BYTES:
            return False
        s.conn._queue_message(s, s.serialize(reply))
        return True


class Messages:
    """A streaming call's request messages, as an async iterator; reading one opens the stream's window."""

    __slots__ = ("_stream", "_items", "_waiter", "_ended")

    def __init__(self, stream: Stream) -> None:
        self._stream, self._items, self._waiter, self._ended = stream, deque(), None, False

    def put(self, message, size: int) -> None:
        self._items.append((message, size))
        self._wake()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def drop(self) -> None:
        """The call is over: what its handler has not read goes (a callback may hold the call a while yet)."""
        self._items.clear()
        self.end()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> Messages:
        return self

    async def __anext__(self) -> bytes:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            self._waiter = self._stream.conn.loop.create_future()
            await self._waiter
        message, size = self._items.popleft()
        self._stream.conn.consumed(self._stream, size)
        return message


class Stream:
    """One call: its request messages as they arrive, its handler's task, its answer waiting for window."""

    __slots__ = ("conn", "sid", "handler", "serialize", "encoding", "deadline", "opened", "buf", "messages",
                 "inbox", "queued", "unacked", "remote_ended", "task", "send_window", "out", "out_bytes",
                 "drained", "head_sent", "ending", "done", "error", "stalled_since", "started", "fast", "held_fast")

    def __init__(self, conn: Connection, sid: int, now: float) -> None:
        self.conn, self.sid, self.opened = conn, sid, now
        self.handler: grpc.RpcMethodHandler | None = None
        self.serialize = None
        self.encoding: int | None = None  # zlib wbits of grpc-encoding; None: identity
        self.deadline: float | None = None  # the loop time grpc-timeout ends at
        self.buf = bytearray()  # a message's bytes not yet whole
        self.messages: list[bytes] = []  # a unary call's whole messages
        self.inbox: Messages | None = None  # a streaming call's
        self.queued = 0  # bytes of whole messages its handler has not taken
        self.unacked = 0  # bytes received and not yet given back to the stream's window
        self.remote_ended = False
        self.task: asyncio.Task | None = None
        self.send_window = conn.peer_window
        self.out: deque = deque()  # (bytes, end) to send: DATA payload, or b"" with a trailers block in end
        self.out_bytes = 0
        self.drained: asyncio.Future | None = None
        self.head_sent = False
        self.ending = False  # its trailers are written or queued
        self.stalled_since = 0.0  # when its queued answer last found no window (0: not stalled)
        self.started = False  # a unary call whose request has ended: its task is made
        self.done = False  # its answer has ended (or it was reset)
        self.error: tuple[grpc.StatusCode, str] | None = None  # a refusal found while its request arrived
        self.fast = None  # the method's fast path (Listener.fast), for a unary call with no deadline
        self.held_fast = False  # its fast path took the call and has not answered: it counts as running


class Connection(asyncio.Protocol):
    """One client connection: frames parsed as they arrive, calls run as tasks, answers written under flow control."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.loop = listener.loop
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buf = bytearray()
        self.preface = False
        self.settings_seen = False
        self.opened_at = 0.0
        self.decoder = Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_BLOCK
        self._kept: dict[bytes, tuple] = {}  # what blocks that change no table say, until the table changes
        self.streams: dict[int, Stream] = {}
        self.last_sid = 0
        self.peer_window = 65535  # the client's SETTINGS_INITIAL_WINDOW_SIZE
        self.peer_frame = 16384  # the client's SETTINGS_MAX_FRAME_SIZE
        self.send_window = 65535  # the connection's window for what we send
        self.recv_unacked = 0  # DATA bytes received and not yet given back to the connection window
        self.held = 0  # bytes of messages not yet handed to handlers, on every stream
        self.whole = 0  # ... of them whole, of unary calls whose task has not taken them yet
        self.inboxed = 0  # ... of them whole, in streaming calls' inboxes (bounded by each stream's window)
        self.blocked: dict[int, Stream] = {}  # streams with an answer waiting for window
        self.control = 0  # control frames since the last sweep
        self.continuing: tuple[int, int, bytearray] | None = None  # (stream id, flags, block) until END_HEADERS
        self.writes: list[bytes] = []  # frames to send, joined into one write at the end of this loop iteration
        self._writing = False
        self.pending = 0  # bytes in writes
        self.unsent = 0  # bytes of answers waiting for the client's window, on every stream
        self.running = 0  # calls whose task has not finished (a reset call's task still counts until it ends)
        self.last_active = 0.0  # when a call last ended or opened
        self.block_started = 0.0  # when the header block in continuing began
        self.paused = False
        self.paused_since = 0.0
        self.held_back = False  # reading stopped because whole requests wait for their tasks past max_held
        self.closing = False
        self.draining = False  # GOAWAY sent or received: no new calls, closed once its calls end
        self.goaway_sent = False

    # -- asyncio --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.opened_at = self.last_active = self.loop.time()
        addr = transport.get_extra_info("peername")
        if isinstance(addr, tuple) and len(addr) == 4:
            self.peer = f"ipv6:[{addr[0]}]:{addr[1]}"
        elif isinstance(addr, tuple):
            self.peer = f"ipv4:{addr[0]}:{addr[1]}"
        else:
            self.peer = f"unix:{addr}"
        self.listener.connections.add(self)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (2, 0), (3, MAX_STREAMS), (4, STREAM_WINDOW), (5, MAX_FRAME_SIZE), (6, MAX_HEADER_BLOCK)))
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.listener.connections.discard(self)
        for s in list(self.streams.values()):
            self._forget(s, cancel=True)
        self.blocked.clear()
        # a fast path's answer still to come holds this connection until it does: nothing big may stay with it
        self.buf, self.writes, self.pending, self._kept = bytearray(), [], 0, {}

    def pause_writing(self) -> None:
        # a client that does not read its answers is not read either: its PINGs and calls wait
        self.paused = True
        self.paused_since = self.loop.time()
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if not self.closing:
            self._flush_blocked()
            self._go_on()

    def _stopped(self) -> bool:
        """Whether reading waits: for the client to read what it is sent, or for the handlers' tasks to take
        the requests that arrived together (flow control, not refusals). Answers waiting for the client's
        window never stop reading: its WINDOW_UPDATEs are what lets them go."""
        return self.paused or self.whole > self.listener.max_held

    def _go_on(self) -> None:
        """Reads again once nothing makes it wait; frames read before the wait are parsed first."""
        if self.closing or self._stopped():
            return
        self.held_back = False
        self.transport.resume_reading()
        if self.buf:
            self.loop.call_soon(self.data_received, b"")

    def eof_received(self) -> bool | None:
        return None  # a half-closed HTTP/2 connection is over: close it

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self._receive(data)
        except ConnectionError_ as exc:
            self.goaway(exc.code, exc.text)
        except HPACKError as exc:
            self.goaway(COMPRESSION_ERROR, f"malformed header block: {exc}")
        except Exception:
            log.exception("internal error reading a gRPC connection from %s", self.peer)
            self.goaway(INTERNAL_ERROR, "internal error")
        self._send_writes()

    # -- receiving --------------------------------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        if not self.preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 client preface (gRPC needs HTTP/2)")
                return
            if buf[:len(PREFACE)] != PREFACE:
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 client preface (gRPC needs HTTP/2)")
            self.preface, pos = True, len(PREFACE)
        n = len(buf)
        view = memoryview(buf)
        payload = None
        # parsing stops while the client does not read what it has caused us to write (resume_writing goes on)
        while n - pos >= 9 and not self.closing and not self._stopped():
            hi, lo, kind, flags, sid = _HEADER.unpack_from(buf, pos)
            length = hi << 16 | lo
            if length > MAX_FRAME_SIZE:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes is over SETTINGS_MAX_FRAME_SIZE "
                                                         f"({MAX_FRAME_SIZE})")
            if n - pos - 9 < length:
                break
            payload = view[pos + 9:pos + 9 + length]
            pos += 9 + length
            self._frame(kind, flags, sid & 0x7FFFFFFF, payload)
        # no view of buf may outlive this, or it cannot be resized (after an exception the connection is closed)
        payload = None
        view.release()
        try:
            del buf[:pos]
        except BufferError:  # a write that failed inside _frame keeps its exception, and the frame's view
            self.buf = bytearray(buf[pos:])
        if self._stopped() and not self.paused and not self.closing:
            self.held_back = True
            self.transport.pause_reading()

    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if not self.settings_seen:
            if kind != SETTINGS or flags & ACK:
                raise ConnectionError_(PROTOCOL_ERROR, "the client preface must end with a SETTINGS frame")
            self.settings_seen = True
        if kind != DATA and kind != HEADERS:  # each of these costs us work and carries no request
            self._count_control()
        if self.continuing is not None:
            if kind != CONTINUATION or sid != self.continuing[0]:
                raise ConnectionError_(PROTOCOL_ERROR, "a header block was interrupted by another frame")
            block = self.continuing[2]
            if len(block) + len(payload) > MAX_HEADER_BLOCK:
                raise ConnectionError_(ENHANCE_YOUR_CALM, f"a header block is over {MAX_HEADER_BLOCK} bytes")
            block += payload
            if flags & END_HEADERS:
                sid, flags, _ = self.continuing
                self.continuing = None
                self._headers(sid, flags, bytes(block))
            return
        if kind == DATA:
            self._data(sid, flags, payload)
        elif kind == HEADERS:
            self._headers_frame(sid, flags, payload)
        elif kind == SETTINGS:
            self._settings(sid, flags, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if sid:
                raise ConnectionError_(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a PING frame must hold 8 bytes")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, bytes(payload)))
        elif kind == RST_STREAM:
            if not sid or len(payload) != 4:
                raise ConnectionError_(PROTOCOL_ERROR if not sid else FRAME_SIZE_ERROR, "a malformed RST_STREAM")
            self._idle_check(sid)
            s = self.streams.get(sid)
            if s is not None:
                self._forget(s, cancel=True)
        elif kind == PRIORITY:
            if not sid or len(payload) != 5:
                raise ConnectionError_(PROTOCOL_ERROR if not sid else FRAME_SIZE_ERROR, "a malformed PRIORITY")
        elif kind == GOAWAY:
            if sid:
                raise ConnectionError_(PROTOCOL_ERROR, "GOAWAY on a stream")
            self.draining = True  # the client opens no more calls: the connection closes when its calls end
            self._close_if_done()
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "a client may not push")
        elif kind == CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without a header block")
        # other frame types are ignored (RFC 9113 5.5)

    def _count_control(self) -> None:
        self.control += 1
        if self.control > MAX_CONTROL_FRAMES:
            raise ConnectionError_(ENHANCE_YOUR_CALM, f"over {MAX_CONTROL_FRAMES} frames that carry no call in "
                                                      f"{SWEEP_S:g} s")

    def _idle_check(self, sid: int) -> None:
        if sid > self.last_sid:
            raise ConnectionError_(PROTOCOL_ERROR, f"a frame on stream {sid}, which was never opened")

    @staticmethod
    def _unpad(flags: int, payload: memoryview) -> memoryview:
        if not flags & PADDED:
            return payload
        if not payload:
            raise ConnectionError_(PROTOCOL_ERROR, "a padded frame with no pad length")
        pad = payload[0]
        if pad >= len(payload):
            raise ConnectionError_(PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1:len(payload) - pad]

    def _settings(self, sid: int, flags: int, payload: memoryview) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "a SETTINGS frame's length is not a multiple of 6")
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == 2 and value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH must be 0 or 1")
            if key == 4:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
                delta, self.peer_window = value - self.peer_window, value
                for s in self.streams.values():
                    s.send_window += delta
                    if s.send_window > MAX_WINDOW:
                        raise ConnectionError_(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE takes a stream's "
                                                                   "window over 2^31-1")
            elif key == 5:
                if not 16384 <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame must hold 4 bytes")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                raise ConnectionError_(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            self._flush_blocked()
            return
        self._idle_check(sid)
        s = self.streams.get(sid)
        if s is None:
            return
        if not increment or s.send_window + increment > MAX_WINDOW:
            self._reset(s, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
            return
        s.send_window += increment
        self._flush(s)

    def _headers_frame(self, sid: int, flags: int, payload: memoryview) -> None:
        if not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a HEADERS frame too short for its priority")
            payload = payload[5:]
        if len(payload) > MAX_HEADER_BLOCK:
            raise ConnectionError_(ENHANCE_YOUR_CALM, f"a header block is over {MAX_HEADER_BLOCK} bytes")
        if flags & END_HEADERS:
            self._headers(sid, flags, bytes(payload))
        else:
            self.continuing = (sid, flags, bytearray(payload))
            self.block_started = self.loop.time()

    def _head(self, block: bytes) -> tuple:
        """What a call's headers say (``_read_head``). A block of indexed fields and literals not indexed only
        (a client's repeated call: gRPC's encoders index everything, nghttp2's never the :path) changes no
        table, so what it says is kept until a block that may change the table is decoded."""
        head = self._kept.get(block)
        if head is not None:
            return head
        keep = len(block) <= MAX_KEPT_BLOCK and _changes_no_table(block)
        if not keep:
            self._kept.clear()
        head = _read_head(self.decoder.decode(block, raw=True), self.listener.restrictions.keys)
        if keep and len(self._kept) < KEPT_BLOCKS:
            self._kept[block] = head
        return head

    def _headers(self, sid: int, flags: int, block: bytes) -> None:
        head = self._head(block)  # always decoded, so that the decoder's table stays the client's
        s = self.streams.get(sid)
        if s is not None:  # trailers: nothing in them is read
            self._count_control()
            if not flags & END_STREAM:
                self._reset(s, PROTOCOL_ERROR)
            elif s.remote_ended:
                self._reset(s, STREAM_CLOSED)
            else:
                self._remote_end(s)
            return
        if sid <= self.last_sid:  # a stream closed (or skipped): nothing on it is served
            self._count_control()
            if not flags & END_STREAM:  # a call on it would wait for ever: tell its client
                self._write(frame(RST_STREAM, 0, sid, _U32.pack(STREAM_CLOSED)))
            return
        if sid % 2 == 0:
            raise ConnectionError_(PROTOCOL_ERROR, f"stream {sid}: a client's streams are odd-numbered")
        self.last_sid = sid
        if self.draining:
            return  # after GOAWAY, new streams are ignored (RFC 9113 6.8)
        if len(self.streams) >= MAX_STREAMS or self.running >= MAX_STREAMS:
            self._write(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            self._count_control()
            return
        self.last_active = self.loop.time()
        s = Stream(self, sid, self.last_active)
        self.streams[sid] = s
        self._open(s, head)
        if s.error is not None:
            s.remote_ended = s.remote_ended or bool(flags & END_STREAM)
            self._trailers(s, *s.error)
        elif flags & END_STREAM:
            self._remote_end(s)

    def _open(self, s: Stream, head: tuple) -> None:
        method, path, ctype, timeout, encoding, metadata = head
        if method != b"POST":
            s.error = (grpc.StatusCode.UNIMPLEMENTED, f"gRPC calls are POST requests, not {_echo(method)}")
            return
        if ctype is None or not (ctype == b"application/grpc" or ctype.startswith((b"application/grpc+",
                                                                                   b"application/grpc;"))):
            s.error = (grpc.StatusCode.INVALID_ARGUMENT, f"the content-type {_echo(ctype)} is not application/grpc")
            return
        handler = self.listener.methods.get(path)
        if handler is None:
            shown = _echo(path)[1:-1] if path is not None else ""
            s.error = (grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {shown}")
            return
        if encoding is not None and encoding != b"identity":
            if encoding not in _ENCODINGS:
                s.error = (grpc.StatusCode.UNIMPLEMENTED, f"the grpc-encoding {_echo(encoding)} is not supported "
                                                          f"(identity, gzip, deflate)")
                return
            s.encoding = _ENCODINGS[encoding]
        if timeout is not None:
            m = _TIMEOUT.fullmatch(timeout)
            if m is None:
                s.error = (grpc.StatusCode.INVALID_ARGUMENT, f"the grpc-timeout {_echo(timeout)} is malformed")
                return
            s.deadline = s.opened + int(m[1]) * _UNITS[m[2]]
        if self.listener.restrictions.by_path:
            refusal = self.listener.restrictions.refusal(path, metadata)
            if refusal is not None:  # before the request: it is neither read nor run
                s.error = (grpc.StatusCode.UNAVAILABLE, refusal)
                return
        s.handler, s.serialize = handler, handler.response_serializer or bytes
        if handler.request_streaming:
            s.inbox = Messages(s)
            self._start(s, self._run(s))
        elif s.deadline is None:
            s.fast = self.listener.fast.get(path)

    def _data(self, sid: int, flags: int, payload: memoryview) -> None:
        if not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        self._idle_check(sid)
        length = len(payload)
        self.recv_unacked += length
        if self.recv_unacked > CONNECTION_WINDOW:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        if self.recv_unacked >= CONNECTION_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked)))
            self.recv_unacked = 0
        data = self._unpad(flags, payload)
        s = self.streams.get(sid)
        if s is None or not data and not flags & END_STREAM:  # no request bytes for a call: counted
            self._count_control()
        if s is None:
            return  # a stream already closed: the connection's window was given back above
        if s.remote_ended:
            self._reset(s, STREAM_CLOSED)
            return
        s.unacked += length
        if s.unacked > STREAM_WINDOW:
            self._reset(s, FLOW_CONTROL_ERROR)
            return
        if s.error is None and data:
            self._take(s, data)
        if flags & END_STREAM:
            self._remote_end(s)
        elif s.queued <= QUEUED_BYTES and s.unacked >= STREAM_WINDOW // 2 and not s.done:
            self._write(frame(WINDOW_UPDATE, 0, sid, _U32.pack(s.unacked)))
            s.unacked = 0

    def _take(self, s: Stream, data: memoryview) -> None:
        """Whole messages out of a stream's bytes; a declared length over the limit refuses the call unread.
        What a stream holds (its partial message, its whole ones not yet handed over) counts in ``held``."""
        max_body = self.listener.max_body
        self.held += len(data)
        if not s.buf and len(data) >= 5:  # the usual case: one whole message in one frame
            compressed, length = _PREFIX.unpack_from(data)
            if length + 5 == len(data) and length <= max_body and compressed == 0:
                refusal = self._whole(s, bytes(data[5:]), length + 5)
                if refusal:
                    self._refuse(s, *refusal)
                else:
                    self._check_held(s)
                return
        buf = s.buf
        buf += data
        pos, refusal = 0, None
        while len(buf) - pos >= 5:
            compressed, length = _PREFIX.unpack_from(buf, pos)
            if length > max_body:
                refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"Received message larger than max ({length} vs. {max_body})")
                break
            if len(buf) - pos - 5 < length:
                break
            if compressed > 1:
                refusal = (grpc.StatusCode.INTERNAL, f"a message's compressed flag is {compressed}, not 0 or 1")
                break
            if compressed and s.encoding is None:
                refusal = (grpc.StatusCode.INTERNAL, "a message marked compressed without a grpc-encoding")
                break
            with memoryview(buf) as view:
                message = bytes(view[pos + 5:pos + 5 + length])
            pos += 5 + length
            refusal = self._whole(s, (message, s.encoding) if compressed else message, length + 5)
            if refusal:
                break
        # what was taken out leaves the buffer before any refusal counts what the stream holds
        del buf[:pos]
        if refusal:
            self._refuse(s, *refusal)
        else:
            self._check_held(s)

    def _whole(self, s: Stream, message, size: int) -> tuple | None:
        """Hands a whole message on (held until its handler takes it); a refusal when the call cannot take it."""
        if size >= MIN_CREDITED:  # a request earns room for the frames a client sends about it (grpc's C core:
            self.control = max(self.control - CALL_CREDIT, -MAX_CONTROL_FRAMES)  # a WINDOW_UPDATE per answer)
        else:
            self._count_control()  # empty messages cost a call's work, and carry nothing
        s.queued += size
        if s.inbox is not None:
            self.inboxed += size
            s.inbox.put(message, size)
        elif s.messages:
            return grpc.StatusCode.UNIMPLEMENTED, "a unary call carries one request message, and this one has more"
        else:
            s.messages.append(message)
        return None

    def _check_held(self, s: Stream) -> None:
        limit = self.listener.max_partial
        if self.held - self.whole - self.inboxed > limit:  # what is still arriving
            self._refuse(s, grpc.StatusCode.RESOURCE_EXHAUSTED, f"this connection's calls hold over {limit} bytes "
                                                                f"of requests still arriving")

    def _release(self, s: Stream) -> None:
        """Drops what a stream holds of its request."""
        self.held -= len(s.buf) + s.queued
        if s.inbox is not None:
            self.inboxed -= s.queued
        elif s.started:
            self.whole -= s.queued
        s.buf, s.queued = bytearray(), 0
        s.messages.clear()

    def _refuse(self, s: Stream, code: grpc.StatusCode, text: str) -> None:
        """Answers a call refused while its request arrives; what more comes of it is dropped."""
        self._release(s)
        if s.task is not None:
            s.task.cancel()
            s.task = None
        s.error = (code, text)
        self._trailers(s, *s.error)

    def _remote_end(self, s: Stream) -> None:
        s.remote_ended = True
        if s.error is not None:
            return
        if s.buf:
            self._refuse(s, grpc.StatusCode.INTERNAL, "the request ended inside a message")
            return
        if s.inbox is not None:
            s.inbox.end()
        elif s.task is None:
            s.started = True
            self.whole += s.queued
            if s.fast is None or not self._start_fast(s):
                self._start(s, self._run(s))

    def consumed(self, s: Stream, size: int) -> None:
        """A handler took a message: what it held is freed, and a stream may send again."""
        if self.streams.get(s.sid) is not s:
            return
        s.queued -= size
        self.held -= size
        if s.inbox is not None:
            self.inboxed -= size
        else:
            self.whole -= size
        if self.held_back:
            self._go_on()
        if not s.remote_ended and s.queued <= QUEUED_BYTES and s.unacked >= STREAM_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, s.sid, _U32.pack(s.unacked)))
            s.unacked = 0

    # -- running calls -----------------------------------------------------------------------------
    def _start(self, s: Stream, coro) -> None:
        s.task = self.loop.create_task(coro)
        self.running += 1
        s.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self.running -= 1

    def _start_fast(self, s: Stream) -> bool:
        """Hands a unary call's request to its method's fast path: ``now(request, peer, done) -> bool``, which
        takes it (True) and calls ``done(reply, None)`` (the reply's message, or its serialized bytes) or
        ``done(None, exc)`` once, later or at once, or declines it (False) having done nothing. A taken call
        counts as running until it is answered or forgotten (reset, its connection lost), as a task does until
        it ends or is cancelled."""
        if len(s.messages) != 1 or isinstance(s.messages[0], tuple):  # none, or compressed: the task says why
            return False
        done = functools.partial(self._fast_done, s)  # (answers once: the first call clears held_fast)
        s.held_fast = True
        self.running += 1
        try:
            taken = s.fast(s.messages[0], self.peer, done)
        except Exception as exc:  # the fast path's own failure, answered as a handler's is
            taken = True
            done(None, exc)
        if not taken and s.held_fast:
            s.held_fast = False
            self.running -= 1
            return False
        if not taken:  # answered, then declined: the answer stands alone (no task runs the call again)
            log.error("the fast path of %s answered a call and then declined it", s.handler)
        if s.messages:  # not answered yet: the request is the fast path's now
            s.messages.pop()
            self.consumed(s, s.queued)
        return True

    def _fast_done(self, s: Stream, reply, exc: BaseException | None) -> None:
        if not s.held_fast:  # reset, or the connection went, while it ran (_forget counted it out)
            return
        s.held_fast = False
        self.running -= 1
        if s.done or s.ending:
            return
        if exc is None:
            try:
                self._queue_message(s, reply if type(reply) is bytes else s.serialize(reply))
            except Exception as failed:  # (not kept in exc: its traceback holds this frame, and the reply)
                self._failed(s, failed)
                return
            self._trailers(s, OK, "")
        else:
            self._failed(s, exc)

    async def _message(self, raw) -> bytes:
        if not isinstance(raw, tuple):
            return raw
        data, wbits = raw
        max_body = self.listener.max_body

        def inflate() -> bytes:
            d = zlib.decompressobj(wbits)
            try:
                out = d.decompress(data, max_body + 1)
            except zlib.error as exc:
                raise Abort(grpc.StatusCode.INTERNAL, f"a compressed message that cannot be decompressed: {exc}") \
                    from None
            if len(out) > max_body or d.unconsumed_tail:
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Received message larger than max (over {max_body} once decompressed)")
            if not d.eof or d.unused_data:
                raise Abort(grpc.StatusCode.INTERNAL, "a compressed message that cannot be decompressed: it "
                                                      + ("ends inside its stream" if not d.eof else
                                                         "has data after the end of its stream"))
            return out
        return await asyncio.to_thread(inflate) if len(data) > INLINE_PARSE_BYTES else inflate()

    async def _run(self, s: Stream) -> None:
        """A call's handler, of any of the four shapes, from its request(s) to its trailers."""
        h = s.handler
        try:
            if h.request_streaming:
                request = self._requests(s)
            else:
                if len(s.messages) != 1:
                    raise Abort(grpc.StatusCode.UNIMPLEMENTED, "a unary call carries one request message, and this "
                                                               "one has none")
                raw = s.messages.pop()
                self.consumed(s, s.queued)
                request = await self._message(raw)
                if h.request_deserializer is not None:
                    request = h.request_deserializer(request)
            method = h.unary_unary or h.unary_stream or h.stream_unary or h.stream_stream
            if h.response_streaming:
                await self._within(s, self._replies(s, method(request, Context(s))))
            else:
                reply = await self._within(s, method(request, Context(s)))
                await self.send_message(s, s.serialize(reply))
            self._trailers(s, OK, "")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(s, exc)
        finally:
            s.task = None

    async def _requests(self, s: Stream):
        deserialize = s.handler.request_deserializer
        async for raw in s.inbox:
            request = await self._message(raw)
            yield deserialize(request) if deserialize is not None else request

    async def _replies(self, s: Stream, result) -> None:
        if inspect.isasyncgen(result):
            async for reply in result:
                await self.send_message(s, s.serialize(reply))
        elif inspect.isawaitable(result):
            await result

    async def _within(self, s: Stream, awaitable):
        if s.deadline is None:
            return await awaitable
        try:
            async with asyncio.timeout_at(s.deadline):
                return await awaitable
        except TimeoutError:
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    def _failed(self, s: Stream, exc: Exception) -> None:
        if isinstance(exc, Abort):
            self._trailers(s, exc.code, exc.details)
        else:
            log.error("internal error on %s", s.handler, exc_info=exc)
            self._trailers(s, grpc.StatusCode.UNKNOWN, "Unexpected error in the gRPC handler")

    # -- sending ----------------------------------------------------------------------------------
    async def send_message(self, s: Stream, payload: bytes) -> None:
        """Queues one message on the call and sends what the windows allow; waits while much is unsent."""
        if s.done or s.ending:
            return  # reset, or its answer ended: the handler's task is cancelled
        self._queue_message(s, payload)
        while s.out_bytes > QUEUED_BYTES and not s.done:
            s.drained = self.loop.create_future()
            await s.drained

    def _queue_message(self, s: Stream, payload: bytes) -> None:
        size = len(payload) + 5
        now = not s.out and size <= min(s.send_window, self.send_window, self.peer_frame) and not self.paused
        if not s.head_sent:
            s.head_sent = True
            self._write(frame(HEADERS, END_HEADERS, s.sid, _RESPONSE_HEAD))
        message = _PREFIX.pack(0, len(payload)) + payload
        if now:
            s.send_window -= size
            self.send_window -= size
            self._write(frame(DATA, 0, s.sid, message))
            return
        s.out.append((memoryview(message), None))  # sent in slices, never copied again
        s.out_bytes += size
        self.unsent += size
        self._flush(s)

    def _trailers(self, s: Stream, code: grpc.StatusCode, details: str) -> None:
        if s.done or s.ending:
            return
        s.ending = True
        if not s.head_sent:  # trailers only
            self._end(s, frame(HEADERS, END_HEADERS | END_STREAM, s.sid, _RESPONSE_HEAD + _status_block(code, details)))
            return
        block = _TRAILERS_OK if code is OK else _status_block(code, details)
        if not s.out:
            self._end(s, frame(HEADERS, END_HEADERS | END_STREAM, s.sid, block))
        else:
            s.out.append((b"", block))
            self._flush(s)

    def _end(self, s: Stream, last: bytes) -> None:
        """The answer's last frame: the stream is over on our side, and (once the client's side is) forgotten."""
        self._write(last)
        s.done = True
        if not s.remote_ended:
            # the client may still be sending: RST_STREAM NO_ERROR tells it to stop (RFC 9113 8.1)
            self._write(frame(RST_STREAM, 0, s.sid, _U32.pack(NO_ERROR)))
        self._forget(s, cancel=False)

    def _flush(self, s: Stream) -> None:
        if self.paused or self.closing:
            self.blocked[s.sid] = s
            return
        parts = []
        while s.out:
            data, block = s.out[0]
            if block is not None:
                s.out.popleft()
                self._write(b"".join(parts))
                self._end(s, frame(HEADERS, END_HEADERS | END_STREAM, s.sid, block))
                return
            n = min(len(data), s.send_window, self.send_window, self.peer_frame)
            if n <= 0:
                self.blocked[s.sid] = s
                if not parts and not s.stalled_since:
                    s.stalled_since = self.loop.time()
                break
            parts.append(frame(DATA, 0, s.sid, data[:n]))
            s.stalled_since = 0.0
            s.send_window -= n
            self.send_window -= n
            s.out_bytes -= n
            self.unsent -= n
            if n == len(data):
                s.out.popleft()
            else:
                s.out[0] = (data[n:], None)
        else:
            self.blocked.pop(s.sid, None)
        if parts:
            self._write(b"".join(parts))
        if s.drained is not None and s.out_bytes <= QUEUED_BYTES and not s.drained.done():
            s.drained.set_result(None)

    def _flush_blocked(self) -> None:
        for s in list(self.blocked.values()):
            if self.send_window <= 0 or self.paused:
                break
            self.blocked.pop(s.sid, None)
            self._flush(s)

    def _write(self, data: bytes) -> None:
        if data and not self.closing:
            self.writes.append(data)
            self.pending += len(data)
            if self.pending > MAX_PENDING_WRITE:
                self._send_writes()  # the transport may pause us now, which stops the parsing
            elif not self._writing:
                self._writing = True
                self.loop.call_soon(self._send_writes)

    def _send_writes(self) -> None:
        self._writing = False
        if self.writes and not self.closing:
            data = b"".join(self.writes) if len(self.writes) > 1 else self.writes[0]
            self.writes.clear()
            self.pending = 0
            self.transport.write(data)

    def _reset(self, s: Stream, code: int) -> None:
        """Resets a stream the client got wrong; counted as its frames are, since it costs us a call's work."""
        self._write(frame(RST_STREAM, 0, s.sid, _U32.pack(code)))
        self._forget(s, cancel=True)
        self._count_control()

    def _forget(self, s: Stream, cancel: bool) -> None:
        s.done = True
        if s.held_fast:  # its answer, when it comes, is dropped; a reset call does not hold a stream's place
            s.held_fast = False
            self.running -= 1
        if self.streams.get(s.sid) is not s:
            return
        self._release(s)
        self.unsent -= s.out_bytes
        s.out.clear()
        s.out_bytes = 0
        del self.streams[s.sid]
        self.last_active = self.loop.time()
        self.blocked.pop(s.sid, None)
        if s.drained is not None and not s.drained.done():
            s.drained.set_result(None)
        if cancel and s.task is not None:
            s.task.cancel()
        if s.inbox is not None:
            s.inbox.drop()
        self._close_if_done()

    # -- closing ------------------------------------------------------------------------------------
    def goaway(self, code: int, text: str) -> None:
        """Tells the client no stream after the last one will be served, and why; an error closes at once."""
        if self.closing:
            return
        self.draining = True
        if not self.goaway_sent or code != NO_ERROR:
            self.goaway_sent = True
            reason = text.encode()[:MAX_MESSAGE_TEXT]
            self._write(frame(GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(code) + reason))
            self._send_writes()
        if code != NO_ERROR:
            log.info("gRPC connection from %s closed: %s", self.peer, text)
            self._close()
            for s in list(self.streams.values()):
                self._forget(s, cancel=True)
        else:
            self._close_if_done()

    def _close_if_done(self) -> None:
        if self.draining and not self.streams:
            self._close()

    def _close(self) -> None:
        if not self.closing:
            self._send_writes()
            self.closing = True
            self.transport.close()

    def sweep(self, now: float) -> None:
        self.control = 0
        if self.paused and now - self.paused_since >= STALL_TIMEOUT_S and self.transport is not None:
            # its client has read nothing of what it was sent for this long: what the connection holds goes now
            log.info("gRPC connection from %s aborted: it read nothing for %g s", self.peer, STALL_TIMEOUT_S)
            self.closing = True
            self.transport.abort()
            return
        if self.closing:
            return
        if not self.settings_seen and now - self.opened_at >= PREFACE_TIMEOUT_S:
            self._close()
            return
        if self.continuing is not None and now - self.block_started >= PREFACE_TIMEOUT_S:
            self.goaway(PROTOCOL_ERROR, f"a header block not finished within {PREFACE_TIMEOUT_S:g} s")
            return
        if not self.streams and not self.draining and now - self.last_active >= IDLE_TIMEOUT_S:
            self.goaway(NO_ERROR, f"no call for {IDLE_TIMEOUT_S:g} s")
            return
        for s in list(self.streams.values()):
            if s.stalled_since and now - s.stalled_since >= STALL_TIMEOUT_S:
                # the client's window let nothing of its answer through: it is not reading this call
                self._write(frame(RST_STREAM, 0, s.sid, _U32.pack(CANCEL)))
                self._forget(s, cancel=True)
            elif s.done or s.ending:
                continue
            elif s.inbox is None and not s.remote_ended and now - s.opened >= BODY_TIMEOUT_S:
                self._refuse(s, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"the request message did not arrive within {BODY_TIMEOUT_S:g} s")
            elif s.deadline is not None and s.task is None and now >= s.deadline:
                self._refuse(s, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class Listener(listen.Listening):
    """The gRPC server on one address: ``methods`` maps each RPC's path to its ``grpc.RpcMethodHandler``."""

    sweep_s = SWEEP_S
    partial_floor = 64 << 20  # max_partial is at least this

    def __init__(self, methods: dict[str, grpc.RpcMethodHandler], host: str, port: int, max_body: int | BodyLimit,
                 socks: list[socket.socket] | None = None, restrictions: GrpcRestrictions | None = None) -> None:
        super().__init__(host, port, socks)
        self.methods = {path.encode(): h for path, h in methods.items()}
        self.restrictions = restrictions or GrpcRestrictions()  # refused at the call's headers, before its request
        # a method's path -> its fast path for unary calls without a deadline (Connection._start_fast)
        self.fast: dict[bytes, Callable[[bytes, str, Callable], bool]] = {}
        self.body_limit = max_body if isinstance(max_body, BodyLimit) else BodyLimit(max_body)

    @property
    def max_body(self) -> int:
        return self.body_limit()

    @property
    def max_held(self) -> int:
        """Whole requests waiting for their calls' tasks a connection may hold before it is read no more."""
        return 4 * self.body_limit() + MAX_FRAME_SIZE

    @property
    def max_partial(self) -> int:
        """Requests still arriving a connection may hold: past it, the call that went over is refused."""
        return max(4 * self.body_limit(), self.partial_floor) + MAX_FRAME_SIZE

    def connection(self) -> Connection:
        return Connection(self)

    def swept(self, now: float) -> None:
        for conn in list(self.connections):
            conn.sweep(now)

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stops accepting; every connection hears GOAWAY, its calls get ``grace`` seconds to finish, then it closes."""
        await super().stop(grace)

    def stopping_now(self, conn: Connection) -> None:
        conn.goaway(NO_ERROR, "the server is stopping")

    def busy(self, conn: Connection) -> bool:
        return bool(conn.streams) and not conn.closing

    def cut(self, conn: Connection) -> None:
        conn.closing = True
        conn.transport.abort()
        for s in list(conn.streams.values()):
            conn._forget(s, cancel=True)
