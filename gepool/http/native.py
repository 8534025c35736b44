"""The sidecar's KServe port on a bare asyncio protocol: HTTP/1.1 parsed by httptools (llhttp, in C).

The handlers in ``server.py`` are written against aiohttp's ``web.Request``; a request here has the
part of it they read (as ``rsgi.Request`` has for granian), and the ``web.Response`` a handler
returns is written straight to the transport. No task, timer or stream object is made per request
beyond the handler's own task: a body that came with its headers is handed over as it is, the
connections' timeouts are kept by one sweep. A route may also have a fast path (``Listener.fast``), which
serves a request whose body came in the same read as its head without even that task (the infer route's,
``Gateway.infer_now``): it answers later through a callback, written as the handler's answer would be. A
connection keeps the head of its last request to take a fast path (``Head``): a read that is the same head
around other Content-Length digits, and then exactly that many bytes of body, is taken without the parser.

A connection answers its requests one at a time, in order (pipelined ones wait, with reading paused);
its headers must come within the idle timeout and fit ``MAX_HEAD_BYTES`` and ``MAX_HEADERS`` (431);
a body is bounded as it arrives (413) and read within the body timeout (408); a request the parser
refuses is a 400, and the connection is then closed, as it is after trailers (refused: nothing
would bound them) and after a request asking to upgrade (answered as HTTP/1.1, its body read by a new
parser, since llhttp reads nothing past such a head). A response written before its body has all
arrived closes the connection once the rest has been read and dropped (``LINGER_S`` at most), so
that the client still sending it hears the answer instead of a reset. A client that half-closes is
still answered. On stop, idle connections close at once and running requests are answered first.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import httptools
from aiohttp import web

from gepool.common import errors
from gepool.http import limits, listen, rsgi
from gepool.http.kserve import FixedHeaders
from gepool.http.limits import BodyLimit, BodyTimeout, BodyTooLarge, ClientGone

log = logging.getLogger("gepool.http")
MAX_HEAD_BYTES = 64 << 10  # a request line and headers, as hyper's read buffer under granian
MAX_HEADERS = 100  # hyper's bound
LINGER_S = 5.0  # the most a refused body's rest is read (and dropped) before its connection closes
LINGER_IDLE_S = 1.0  # ... or until it pauses this long
SWEEP_S = 0.25  # how often the connections' timeouts are looked at
STOP_GRACE_S = 5.0  # requests running when the server stops get this long to be answered
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_DROPPED = frozenset(("content-length", "transfer-encoding", "connection", "date", "server"))
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
MAX_TRAILER_BYTES = 8 << 10  # bytes read past a chunk size line with no data after it (a last chunk's trailers)
TRAILERS = "trailers after a chunked body are not accepted"
_WAIT = object()  # _answered: the next request waits for the client to read what was written
_OK = b"HTTP/1.1 200 OK\r\n"
MAX_KNOWN_HEAD_BYTES = 4096  # the most of a head a connection keeps to know the next one by (see Head)
_LENGTH_KEY = b"\r\ncontent-length:"


class Headers(dict):
    """A request's headers by lower-cased name, looked up case-insensitively as aiohttp's are; of a repeated
    one, the first copy."""

    __slots__ = ()

    def get(self, key: str, default=None):
        return dict.get(self, key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())


class Request:
    """One request, as the handlers use an aiohttp one; its body as it arrives."""

    __slots__ = ("method", "path", "match_info", "headers", "transport", "keep_alive", "http_10", "_conn",
                 "_parts", "_size", "_limit", "done", "_error", "_waiter", "_continue", "_linger_until")

    def __init__(self, conn: Connection, method: str, path: str, headers: Headers, keep_alive: bool,
                 http_10: bool) -> None:
        self.method, self.path, self.headers, self.keep_alive, self.http_10 = method, path, headers, keep_alive, \
            http_10
        self.match_info: dict[str, str] = {}
        self.transport = conn.transport
        self._conn = conn
        self._parts: deque[bytes] = deque()
        self._size = 0
        self._limit = conn.listener.body_limit()  # until the handler names its own: nothing is held past it
        self.done = False  # the whole body has arrived
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        expect = dict.get(headers, "expect")  # (its keys are lower-cased)
        self._continue = expect is not None and expect.lower() == "100-continue"
        self._linger_until: float | None = None  # dropping what still comes of the body, until then

    # -- fed by the connection ------------------------------------------------------------------
    def _body(self, chunk: bytes) -> None:
        if self._error is not None or self._linger_until is not None:
            return  # refused, or answered: what still comes is dropped
        self._size += len(chunk)
        if self._size > self._limit:
            self._fail(BodyTooLarge(limits.too_large(self._limit)))
            return
        self._parts.append(chunk)
        self._wake()

    def _complete(self) -> None:
        self.done = True
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if self._error is None and not self.done:
            self._error = exc
            self._parts.clear()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the handler --------------------------------------------------------------------
    def body_now(self) -> bytes | None:
        """The whole body if it has all arrived, unencoded and unrefused, else None; ``read_body`` still reads it."""
        if not self.done or self._error is not None or dict.__contains__(self.headers, "content-encoding"):
            return None
        parts = self._parts
        if len(parts) > 1:
            joined = b"".join(parts)
            parts.clear()
            parts.append(joined)
        return parts[0] if parts else b""

    async def read_body(self, max_body: int, timeout: float) -> bytes:
        """The whole body, decompressed as its Content-Encoding says; 413 by its declared size before a byte is
        read and as it arrives past ``max_body``; 408 when it is not all here within ``timeout`` seconds."""
        declared = self.headers.get("content-length")
        length = int(declared) if declared is not None and declared.isdecimal() else None  # llhttp checked it
        if length is not None and length > max_body:
            raise BodyTooLarge(limits.too_large(max_body, length))
        encoding = limits.content_encoding(self.headers)
        if self._size > max_body:  # more than this handler takes came already (the listener's bound is larger)
            self._fail(BodyTooLarge(limits.too_large(max_body)))
            raise BodyTooLarge(limits.too_large(max_body))
        self._limit = max_body
        if encoding == "identity" and self.done and self._error is None:  # came with its headers: no timer
            return self._joined()
        try:
            async with asyncio.timeout(timeout):
                if encoding != "identity":
                    return await limits.decode(self._chunks(), max_body, encoding)
                while not self.done:
                    await self._next()
                return self._joined()
        except TimeoutError:
            raise BodyTimeout(limits.too_slow(timeout, length)) from None

    def _joined(self) -> bytes:
        if self._error is not None:
            raise self._error
        parts = self._parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return body

    async def _next(self) -> None:
        """Waits for more of the body (its end, or its failure, which is raised)."""
        if self._error is not None:
            raise self._error
        if self._continue:  # the client waits for this before it sends the body
            self._continue = False
            self._conn.write(_CONTINUE)
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def _chunks(self) -> AsyncIterator[bytes]:
        parts = self._parts
        while True:
            while parts:
                yield parts.popleft()
            if self.done and self._error is None:
                return
            await self._next()

    async def discard_body(self, timeout: float) -> None:
        """Nothing to do before the answer: an answer written before its body has arrived drops the rest as
        it comes and then closes the connection."""


class Head:
    """What the parser made of a head a connection sent, to know the same head again without it: a client
    sends the same request line and headers every time, but for the Content-Length. ``before`` and ``after``
    are the head's bytes around that length's digits; ``length`` what they said."""

    __slots__ = ("before", "after", "length", "headers", "path", "match_info", "handler")

    def __init__(self, before: bytes, after: bytes, length: int, headers: Headers, path: str,
                 match_info: dict[str, str], handler) -> None:
        self.before, self.after, self.length, self.headers = before, after, length, headers
        self.path, self.match_info, self.handler = path, match_info, handler

    def body_at(self, data: bytes) -> tuple[int, int] | None:
        """(where the body starts, its length) if ``data`` is this head around other digits and then exactly
        that many bytes of body (one whole request, nothing after it); else None."""
        if not data.startswith(self.before):
            return None
        start = len(self.before)
        end = data.find(b"\r\n", start, start + 16)
        digits = data[start:end]
        # digits as the parser reads them: at most 14, no sign, no leading zero
        if end <= start or not digits.isdigit() or (digits[0] == 48 and end - start > 1) \
                or not data.startswith(self.after, end):
            return None
        body = end + len(self.after)
        length = int(digits)
        return (body, length) if len(data) - body == length else None


def known_head(data: bytes, body_size: int) -> tuple[bytes, bytes, int] | None:
    """Where the Content-Length digits lie in a chunk that held exactly one request (a POST) and its body of
    ``body_size`` bytes: (the head's bytes before them, after them, the length), or None where the head is
    not such (no single plain Content-Length, or too long to keep)."""
    head_end = data.find(b"\r\n\r\n") + 4
    if head_end < 4 or head_end + body_size != len(data) or head_end > MAX_KNOWN_HEAD_BYTES \
            or not data.startswith(b"POST "):
        return None
    head = data[:head_end]
    low = head.lower()
    at = low.find(_LENGTH_KEY)
    if at < 0 or low.find(_LENGTH_KEY, at + 1) >= 0:
        return None
    start = at + len(_LENGTH_KEY)
    while head[start:start + 1] in (b" ", b"\t"):
        start += 1
    end = start
    while head[end:end + 1].isdigit():
        end += 1
    # (a length with a leading zero is not kept: a later request's own spelling of it would be lost)
    if end == start or head[end:end + 2] != b"\r\n" or head[start:start + 1] == b"0" and end - start > 1 \
            or int(head[start:end]) != body_size:
        return None
    return head[:start], head[end:], body_size


def _framing(headers: Headers) -> bytes | str:
    """The header that frames a request's body as the parser read it (b"" for none), or why it cannot be
    given to a new parser."""
    te = headers.get("transfer-encoding")
    if te is not None:
        if te.strip().lower() != "chunked":
            return f"Transfer-Encoding {te[:100]!r} with an Upgrade header is not supported"
        return b"Transfer-Encoding: chunked\r\n"
    length = headers.get("content-length", "0").strip()
    if not length.isdecimal():  # (the parser has refused such a head already)
        return f"Content-Length {length[:100]!r} is not a number"
    return b"Content-Length: %d\r\n" % int(length) if int(length) else b""


class Connection(asyncio.Protocol):
    """One client connection: the parser's callbacks build requests, which are answered one at a time."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()  # requests headed, not yet answered; the first one runs
        self.arriving: Request | None = None  # the request whose body the parser is reading
        self.idle_since = 0.0
        self.closing = False
        self.reading = True
        self.writable: asyncio.Future | None = None  # set while the transport's buffer is over its mark
        self._url = b""
        self._raw: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._in_head = True
        self._ended_here = False  # a message ended in the chunk being parsed
        self._chunk_open = False  # past a chunk size line, with none of its data yet
        self._chunks_seen = 0  # chunk size lines parsed on this connection
        self._trailer_bytes = 0  # bytes read in whole while _chunk_open
        self._reattach: Request | None = None  # the request whose body a new parser reads (see _upgraded)
        self._upgrade_framing: bytes | None = None  # that body's framing, for the new parser's head (b"": none)
        self._refusal: tuple[int, str] | None = None  # a request refused by the parser, answered in turn
        self.finishing = False  # answered with close: what still comes of the body is dropped, then it closes
        self.last_data = 0.0  # while finishing: when data last came
        self.ended = False  # the client half-closed: nothing more will come
        # a request whose route has a fast path, headed in the chunk being parsed: it takes the fast path if its
        # body ends in the same chunk, else data_received gives it a task as any other
        self._fast: tuple[Request, object, object] | None = None  # (the request, its fast path, its handler)
        self._starting: Request | None = None  # the request whose fast path is running (see _fast_done)
        self._called_back = False  # ... and whether it has called back already
        self._mid_message = False  # the parser has begun a request it has not ended
        self._feeding: bytes | None = None  # the chunk being parsed, when the parser began it between requests
        self._begun = 0  # requests the parser has begun on this connection
        self._begun_before = 0  # ... before the chunk being parsed
        self.head: Head | None = None  # the last head of this connection whose request took a fast path

    # -- asyncio --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.idle_since = self.listener.loop.time()
        self.listener.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.listener.connections.discard(self)
        gone = ClientGone(limits.CLIENT_GONE)
        for req in self.queue:
            req._fail(gone)
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        # the parser holds this protocol's methods, the queued requests hold it: without these cycles what a
        # closed connection held goes now, not at a full collection (rare once start-up is frozen)
        self.parser, self.arriving, self._raw = None, None, []
        self.queue.clear()

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.listener.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self._received(data)
        finally:
            self._feeding = None  # (the chunk is not held past its parsing)
            if self._fast is not None:  # its body is still to come (or the chunk was refused): a task serves it
                req, self._fast = self._fast[0], None
                self.listener.loop.create_task(self._serve(req))

    def _received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        if self.finishing:
            self.last_data = self.listener.loop.time()
        head = self.head
        if head is not None and not self.queue and not self._mid_message and not self.finishing \
                and not self.closing and not self.listener.stopping:
            # between requests, with nothing running: the head this connection sent last, around another
            # length, needs no parser (it would make of the same bytes what it made before)
            at = head.body_at(data)
            now = self.listener.fast.get(head.handler) if at is not None else None
            if now is not None:
                self._head_bytes = 0  # a request ended in this chunk, as the parser's accounting below says
                self._known(head, data, *at, now)
                return
        self._ended_here = False
        chunks_before = self._chunks_seen
        self._feeding, self._begun_before = None if self._mid_message else data, self._begun
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded(data, exc)
            return
        except httptools.HttpParserCallbackError as exc:  # a bug in a callback below, not the client's bytes
            log.error("internal error parsing a request", exc_info=exc.__context__ or exc)
            self._refuse(500, errors.INTERNAL_MESSAGE)
            return
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")
            return
        if self._in_head and self._refusal is None:
            # bounded before the parser holds more of a head than this (one read past it at most)
            self._head_bytes = 0 if self._ended_here else self._head_bytes + len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request's headers are over {MAX_HEAD_BYTES} bytes")
        elif self._chunk_open and self._chunks_seen == chunks_before:
            # this whole read came past a chunk size line that no data has followed: a last chunk's trailers
            # (a chunk's data starts at the next byte), which the parser grows a header value of with each read
            self._trailer_bytes += len(data)
            if self._trailer_bytes > MAX_TRAILER_BYTES:
                self._refuse(400, TRAILERS)

    def _upgraded(self, data: bytes, exc: httptools.HttpParserUpgrade) -> None:
        """The parser stopped after the head of a request asking to upgrade (queued by on_headers_complete): one
        with a body gets a new parser, fed a head of the body's framing alone and then what followed the
        original head, which reads the body as that request's; the connection closes after its answer."""
        framing, self._upgrade_framing = self._upgrade_framing, None
        offset = exc.args[0] if exc.args else None
        if framing and self.arriving is not None and type(offset) is int and 0 <= offset <= len(data):
            self._reattach = self.arriving
            self.parser = httptools.HttpRequestParser(self)
            self.data_received(b"POST / HTTP/1.1\r\n" + framing + b"\r\n" + data[offset:])
            return
        if framing:
            self._refuse(400, "the body of a request asking to upgrade the connection could not be read")
        elif self.reading:  # nothing more is read: what follows such a request is not HTTP/1.1
            self.transport.pause_reading()
            self.reading = False

    def eof_received(self) -> bool | None:
        """The client has sent all it will (a half-close): the requests it sent are still answered, the last
        one with close; one whose body did not all come fails. Nothing queued: the connection closes."""
        self.ended = True
        if not self.queue or self.closing:
            return None
        self.queue[-1].keep_alive = False
        if self.arriving is not None:
            self.arriving._fail(ClientGone(limits.CLIENT_GONE))
        return True

    # -- the parser's callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._in_head = b"", True
        self._raw = []
        self._mid_message = True
        self._begun += 1

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refusal is not None:
            return
        if self.arriving is not None and self._reattach is None:  # after the headers: a chunked body's trailer
            self._refuse(400, TRAILERS)
            return
        if len(self._raw) >= MAX_HEADERS:  # refused now, not held (each costs ~100 bytes of objects)
            self._refuse(431, f"the request has more than the {MAX_HEADERS} header fields allowed")
            return
        self._raw.append((name, value))

    def on_chunk_header(self) -> None:
        self._chunk_open, self._trailer_bytes = True, 0
        self._chunks_seen += 1

    def on_chunk_complete(self) -> None:
        self._chunk_open = False

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._chunk_open = False, 0, False
        if self._reattach is not None:  # the framing head _upgraded gave a new parser: the body is this request's
            self.arriving, self._reattach = self._reattach, None
            return
        if self.finishing or self._refusal is not None:  # past a close announced, or a refusal: never run
            return
        if self.listener.stopping:
            self._refuse(503, "the HTTP server is stopping")
            return
        # the first copy of a repeated header wins: the dict keeps the value it is given last; white space around a
        # value is not part of it (RFC 9110 5.5; llhttp strips only what leads)
        headers = Headers()
        for name, value in reversed(self._raw):
            headers[name.decode("latin-1").lower()] = value.decode("utf-8", "replace").rstrip(" \t")
        try:
            path = httptools.parse_url(self._url).path or b"/"  # (none in an absolute URL without one)
        except httptools.HttpParserInvalidURLError:
            self._refuse(400, f"malformed request target {self._url[:200]!r}")
            return
        parser = self.parser
        method = parser.get_method().decode("ascii", "replace")
        keep_alive = parser.should_keep_alive()
        if parser.should_upgrade():
            # answered as HTTP/1.1, ignoring the Upgrade as aiohttp does (Java's HttpClient asks for h2c on its
            # first request), and the connection closed after it: the parser reads nothing past such a head, so
            # a body is read by a new parser (_upgraded)
            if method == "CONNECT":
                self._refuse(405, "the method CONNECT is not supported")
                return
            framing = _framing(headers)
            if isinstance(framing, str):
                self._refuse(400, framing)
                return
            self._upgrade_framing = framing
            keep_alive = False
        req = Request(self, method, unquote(path.decode("utf-8", "replace"), errors="replace"), headers, keep_alive,
                      parser.get_http_version() == "1.0")
        self.arriving = req
        self.queue.append(req)
        if len(self.queue) == 1:
            fast = self.listener.fast
            if fast and method == "POST" and keep_alive:
                handler, match_info, _ = self.listener.router.resolve(method, req.path)
                now = fast.get(handler)
                if now is not None:
                    req.match_info = match_info
                    self._fast = (req, now, handler)
                    return
            self.listener.loop.create_task(self._serve(req))
        elif self.reading:  # a pipelined request waits: read no further until it runs
            self.transport.pause_reading()
            self.reading = False

    def on_body(self, body: bytes) -> None:
        self._chunk_open = False
        if self.arriving is not None:
            self.arriving._body(body)

    def on_message_complete(self) -> None:
        if self._upgrade_framing:  # the parser skipped the body of a request asking to upgrade: not its end
            return
        self._ended_here, self._in_head, self._chunk_open = True, True, False
        self._mid_message = False
        req, self.arriving = self.arriving, None
        if req is None:
            return
        req._complete()
        if self.finishing:  # the rest of an answered request's body has been dropped
            self._close()
        elif self._fast is not None and self._fast[0] is req:
            _, now, handler = self._fast
            self._fast = None
            if self._feeding is not None and self._begun == self._begun_before + 1 and req._error is None:
                self._learn(req, handler)  # the chunk began with this request: it may be all of it
            self._start_fast(req, now)

    def _learn(self, req: Request, handler) -> None:
        """Keeps the head of ``req`` (a keep-alive HTTP/1.1 request to a fast path, framed by Content-Length) if
        the chunk being parsed held it and its body, nothing else."""
        if req.http_10 or not req.keep_alive or "transfer-encoding" in req.headers or "expect" in req.headers:
            return
        found = known_head(self._feeding, req._size)
        if found is not None:
            self.head = Head(*found, req.headers, req.path, req.match_info, handler)

    def _known(self, head: Head, data: bytes, start: int, length: int, now) -> None:
        """A request whose head is ``head`` around ``length``, its body at ``start``: as the parser's callbacks
        would have taken it."""
        headers = head.headers
        if length != head.length:
            headers = Headers(headers)
            headers["content-length"] = str(length)
        req = Request(self, "POST", head.path, headers, True, False)
        req.match_info = head.match_info
        if length > req._limit:
            req._body(data[start:])  # (refused by its size, as the parser's callback would have)
        elif length:  # as _body and _complete take it, with no one waiting for it yet
            req._parts.append(data[start:])
            req._size = length
        req.done = True
        self.queue.append(req)
        self._start_fast(req, now)

    # -- answering ------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str) -> None:
        """The parser refused what came: read no more; the requests before it are answered, then this."""
        self._refusal = (status, message)
        if self.finishing:  # the last answer said it closes: nothing more is written
            self._close()
            return
        if self.arriving is not None:
            self.arriving.keep_alive = False
            reason = message if message == TRAILERS else f"{limits.NOT_FRAMED}: {message}"
            self.arriving._fail(web.HTTPBadRequest(reason=reason))
        if self.reading and self.transport is not None:
            self.transport.pause_reading()
            self.reading = False
        if not self.queue:
            self._answer_refusal()

    def _answer_refusal(self) -> None:
        status, message = self._refusal
        self._write_response(None, web.json_response({"error": message}, status=status), close=True)
        self._close()

    def write(self, data: bytes) -> None:
        if not self.closing:
            self.transport.write(data)

    async def _serve(self, req: Request, answered: bool = False) -> None:
        """Answers ``req`` and the requests pipelined behind it (see _run); a bug here closes only this connection."""
        try:
            await self._run(req, answered)
        except Exception:
            log.exception("internal error answering %s %s", req.method, req.path)
            self._abort()

    async def _run(self, req: Request, answered: bool = False) -> None:
        """Answers ``req`` (``answered``: already answered, its answer waiting for the client to read it) and
        the requests behind it."""
        while True:
            nxt = _WAIT if answered else self._answered(req, await self.listener.answer(req))
            answered = False
            if nxt is _WAIT:
                nxt = await self._drained()
            if nxt is None:
                return
            req = nxt

    def _start_fast(self, req: Request, now) -> None:
        """Runs the route's fast path for ``req``, whose body has all come; where it declines, a task serves it."""
        self._starting, self._called_back = req, False
        try:
            started = now(req, self._fast_done)
        except Exception:
            log.exception("internal error in the fast path of %s %s", req.method, req.path)
            started = False
        finally:
            self._starting = None
        if self._called_back and not started:  # it answered, then declined: the answer stands, alone
            log.error("the fast path of %s %s answered the request and then declined it", req.method, req.path)
            started = True
        if not started:
            self.listener.loop.create_task(self._serve(req))
        else:
            req._parts.clear()  # the fast path has read the body: it is not held while the answer waits

    def _fast_done(self, req: Request, response: web.StreamResponse | rsgi.Reply) -> None:
        """A fast path's answer to ``req`` (called once, from the loop): written as ``_run`` writes one."""
        if req is self._starting:  # called back before it returned, inside the parser: written on the next pass
            self._called_back = True
            self.listener.loop.call_soon(self._fast_done, req, response)
            return
        if not self.queue or self.queue[0] is not req:  # the connection is gone (or this one was answered already)
            return
        try:
            nxt = self._answered(req, response)
            if nxt is _WAIT:
                self.listener.loop.create_task(self._serve(req, answered=True))
            elif nxt is not None:
                self.listener.loop.create_task(self._serve(nxt))
        except Exception:
            log.exception("internal error answering %s %s", req.method, req.path)
            self._abort()

    def _answered(self, req: Request, response: web.StreamResponse | rsgi.Reply) -> Request | None | object:
        """Writes ``req``'s answer; then the next request to run, None if none is to run now, or _WAIT while
        the client's buffer is full (``_drained`` then gives the next)."""
        listener = self.listener
        close = not req.done or not req.keep_alive or response.keep_alive is False \
            or self._refusal is not None or listener.stopping
        self._write_response(req, response, close)
        self.idle_since = listener.loop.time()
        if self.closing:
            return None
        if close:
            self.queue.clear()  # requests pipelined after one answered with close never run
            if req.done or self._refusal is not None or self.ended:
                self._close()
            else:  # the client may still be sending the body: drop it as it comes, then close
                self.finishing, self.last_data = True, self.idle_since
                req._linger_until = self.idle_since + LINGER_S
                if not self.reading:
                    self.transport.resume_reading()
                    self.reading = True
            return None
        if self.writable is not None and not self.writable.done():
            # one answer at most waits in the buffer of a client that does not read; the request stays
            # first in the queue meanwhile, so one that comes waits behind it (the next step runs it)
            return _WAIT
        return self._next()

    async def _drained(self) -> Request | None:
        await self.writable
        return None if self.closing else self._next()

    def _next(self) -> Request | None:
        """The answered request leaves the queue: the one behind it, if it is to run now."""
        self.queue.popleft()
        if not self.queue and self._refusal is not None:
            self._answer_refusal()
            return None
        if len(self.queue) <= 1 and not self.reading and self._refusal is None:
            self.transport.resume_reading()  # the next one's body may not all be here yet
            self.reading = True
        return self.queue[0] if self.queue else None

    def _write_response(self, req: Request | None, response: web.StreamResponse, close: bool) -> None:
        if self.closing:
            return
        # (the fast path's Reply first: aiohttp's Response is a mapping, whose isinstance goes through abc)
        body = response.body if type(response) is rsgi.Reply or isinstance(response, web.Response) else None
        if body is None:
            body = b""
        elif type(body) is not bytes and not isinstance(body, bytearray | memoryview):
            raise TypeError(f"a response body of type {type(body).__name__} cannot be written")
        status = response.status
        headers = response.headers
        if type(headers) is FixedHeaders:  # the infer route's answer: its headers' text made once
            lines = [_OK if status == 200 else b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")),
                     headers.lines]
            typed = True
        else:
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
            typed = False
            for key, value in headers.items():
                low = key.lower()
                if low in _DROPPED:
                    continue
                typed = typed or low == "content-type"
                lines.append(f"{key}: {value}\r\n".encode("latin-1"))
        if body and not typed:
            lines.append(b"Content-Type: application/octet-stream\r\n")
        lines.append(self.listener.date)
        if close:
            lines.append(b"Connection: close\r\n")
        elif req is not None and req.http_10:
            lines.append(b"Connection: keep-alive\r\n")
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        if req is not None and req.method == "HEAD" or not body:
            self.transport.write(b"".join(lines))
        elif len(body) <= 16384:
            lines.append(body)
            self.transport.write(b"".join(lines))
        else:
            self.transport.writelines([b"".join(lines), body])

    def _close(self) -> None:
        if not self.closing:
            self.closing = True
            self.transport.close()

    def _abort(self) -> None:
        """Closes at once, dropping what the transport still holds to write."""
        if not self.closing:
            self.closing = True
            self.transport.abort()

    def sweep(self, now: float, idle_timeout: float) -> None:
        """Closes the connection when it waits for a request's headers (or for its client to read an answer)
        past the idle timeout, or has lingered long enough on a refused body."""
        if self.closing:
            return
        if self.queue and (self.writable is None or self.writable.done()):
            return
        if self.finishing:
            if now >= self.arriving._linger_until or now - self.last_data >= LINGER_IDLE_S:
                self._close()
        elif now - self.idle_since >= idle_timeout:
            if self.transport.get_write_buffer_size():
                self._abort()
            else:
                self._close()


def _date() -> bytes:
    """The Date header an HTTP/1.1 server with a clock sends (RFC 9110 6.6.1), renewed by each sweep."""
    return f"Date: {formatdate(usegmt=True)}\r\n".encode()


class Listener(listen.Listening):
    """The server on one address: connections on this loop, each request routed by ``rsgi.Router``.

    ``idle_timeout_s`` bounds how long a connection may take to send a request's headers, counted from
    its opening or its previous answer, and how long a body may take to arrive (408)."""

    sweep_s = SWEEP_S

    def __init__(self, router: rsgi.Router, host: str, port: int, idle_timeout_s: float, max_body: int | BodyLimit,
                 socks: list[socket.socket] | None = None) -> None:
        super().__init__(host, port, socks)
        self.router, self.idle_timeout_s = router, idle_timeout_s
        self.body_limit = max_body if isinstance(max_body, BodyLimit) else BodyLimit(max_body)
        self.stopping = False
        self.date = _date()
        # route handler -> its fast path: now(request, done) -> bool, False where the handler must answer; else it
        # calls done(request, response) once, later, from the loop
        self.fast: dict[object, object] = {}

    def connection(self) -> Connection:
        return Connection(self)

    def swept(self, now: float) -> None:
        self.date = _date()
        for conn in list(self.connections):
            conn.sweep(now, self.idle_timeout_s)

    async def answer(self, req: Request) -> web.StreamResponse:
        def routed(match_info: dict[str, str]) -> Request:
            req.match_info = match_info
            return req

        return await rsgi.respond(self.router, req.method, req.path, routed)

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stops accepting; idle connections close now, and each running request is answered (with close) within
        ``grace``; a request that comes meanwhile is answered 503. Then every connection is closed."""
        self.stopping = True
        await super().stop(grace)

    def stopping_now(self, conn: Connection) -> None:
        if not conn.queue:
            conn._close()

    def busy(self, conn: Connection) -> bool:
        return bool(conn.queue) and not conn.closing

    def cut(self, conn: Connection) -> None:
        conn._abort()
