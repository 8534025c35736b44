"""The sidecar's routes on granian (RSGI): the part of aiohttp's request the handlers read, and their answers.

The handlers in ``server.py`` are written against aiohttp's ``web.Request``; here a request from
granian gets the same ``method``, ``path``, ``match_info``, ``headers`` (case-insensitive), the
connection's two addresses (``transport.get_extra_info``) and a bounded body read, and the
``web.Response`` a handler returns is written back through granian's protocol object.
"""

import asyncio
import logging
import re
import resource
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gepool.common import errors
from gepool.http import limits, listen
from gepool.http.limits import BodyTimeout, BodyTooLarge, ClientGone

log = logging.getLogger("gepool.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CLOSE = ("connection", "close")
MAX_CONNECTIONS = 1 << 20
# hyper's read buffer per connection, which a request's headers must fit (431 above it; one read may
# overshoot it, so the bound is a few times this, not exactly it)
READ_BUFFER_BYTES = 64 << 10
NOT_UTF8 = "\ufffd"
_DROPPED = frozenset(("content-length", "transfer-encoding", "connection", "date", "server"))


def _address(text: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` as granian gives it, as the tuple a socket's getpeername gives."""
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdecimal():
        return None
    return host.strip("[]"), int(port)


class Headers:
    """The request's headers, looked up case-insensitively as aiohttp's are; of a repeated one, the first copy
    (granian's own get gives the last)."""

    __slots__ = ("_raw",)

    def __init__(self, raw) -> None:
        self._raw = raw

    def get(self, key: str, default=None):
        name = key.lower()
        values = self._raw.get_all(name)
        if values:
            return values[0]
        # granian leaves out a value that is not UTF-8 (get_all gives none, though the name is there): it
        # reads as present and matching nothing, as aiohttp's surrogate-escaped value does
        return NOT_UTF8 if name in self._raw else default

    def __contains__(self, key: str) -> bool:
        return key.lower() in self._raw

    def __getitem__(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value


class Transport:
    """What ``_caller`` asks of a transport: the connection's two ends."""

    __slots__ = ("_extra",)

    def __init__(self, peername, sockname) -> None:
        self._extra = {"peername": peername, "sockname": sockname}

    def get_extra_info(self, name: str, default=None):
        return self._extra.get(name, default)


class Deadlines:
    """Body reads that must end by a deadline: one timer cancels those past it every ``SWEEP_S``, instead of
    a timer armed and disarmed for every request (as asyncio.timeout would, at a cost per request)."""

    SWEEP_S = 0.25

    def __init__(self) -> None:
        self._due: dict[asyncio.Task, float] = {}
        self._expired: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    async def run(self, awaitable: Awaitable[bytes], timeout: float) -> bytes:
        """What ``awaitable`` gives, or TimeoutError once ``timeout`` seconds (and up to SWEEP_S more) pass."""
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())
        self._due[task] = loop.time() + timeout
        try:
            return await awaitable
        except asyncio.CancelledError:
            if task not in self._expired:
                raise
            task.uncancel()  # the cancellation was this deadline's, not the task's owner's
            raise TimeoutError from None
        finally:
            # the sweeper cancels only tasks still listed here, so none is cancelled after this point
            del self._due[task]
            self._expired.discard(task)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.SWEEP_S)
            now = loop.time()
            for task, due in list(self._due.items()):
                if due <= now and task not in self._expired:
                    self._expired.add(task)
                    task.cancel()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


class Request:
    """One granian request, as the handlers use an aiohttp one."""

    __slots__ = ("_scope", "_proto", "_deadlines", "method", "path", "match_info", "headers", "_transport")

    def __init__(self, scope, proto, match_info: dict[str, str], deadlines: Deadlines) -> None:
        self._scope, self._proto, self._deadlines = scope, proto, deadlines
        self.method, self.path, self.match_info = scope.method, scope.path, match_info
        self.headers = Headers(scope.headers)
        self._transport: Transport | None = None

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            self._transport = Transport(_address(self._scope.client), _address(self._scope.server))
        return self._transport

    async def read_body(self, max_body: int, timeout: float) -> bytes:
        """The whole body, decompressed as its Content-Encoding says; 413 by its declared size before a byte is
        read and as it arrives past ``max_body``; 408 when it is not all here within ``timeout`` seconds."""
        headers = self.headers
        declared = headers.get("content-length")
        # granian's HTTP/1 parser refuses a Content-Length that is not a number before the app is called
        length = int(declared) if declared is not None and declared.isdecimal() else None
        if length is not None and length > max_body:
            raise BodyTooLarge(limits.too_large(max_body, length))
        encoding = limits.content_encoding(headers)
        if length is not None and encoding == "identity":
            reading = self._proto()
        else:
            reading = limits.decode(self._chunks(), max_body, encoding)
        try:
            return await self._deadlines.run(reading, timeout)
        except TimeoutError:
            raise BodyTimeout(limits.too_slow(timeout, length)) from None
        except RuntimeError as exc:
            from granian.rsgi import ProtocolClosed  # loaded: granian raised this

            if isinstance(exc, ProtocolClosed):
                raise ClientGone(limits.CLIENT_GONE) from None
            raise

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive. granian hands on a framing error (a bad chunk size, a body cut
        short) as an empty chunk, where the stream's end is one empty chunk and then no more: an empty chunk
        with another after it is that error (or trailers, which no KServe client sends), and a 400."""
        ended = False
        async for chunk in self._proto:
            if ended:
                raise web.HTTPBadRequest(reason=f"{limits.NOT_FRAMED} (or it has trailers, which are refused)")
            if chunk:
                yield chunk
            else:
                ended = True

    async def discard_body(self, timeout: float, idle: float = 1.0) -> None:
        """Drops what the client still sends of a body refused unread, until it ends, pauses ``idle`` seconds
        or ``timeout`` passes: granian closes a connection whose body is left unread, so a client still
        sending would hear a broken pipe, not the refusal (aiohttp lingers on such a body the same way)."""
        chunks = self._chunks()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await asyncio.wait_for(anext(chunks), idle)
        except (StopAsyncIteration, TimeoutError):
            pass
        except Exception:  # the client went away: the refusal has no one to reach, and is answered anyway
            pass


class Reply:
    """A handler's answer without aiohttp's response object (the infer route's answer on the native server's
    fast path, ``Gateway.infer_now``)."""

    __slots__ = ("status", "headers", "body")
    keep_alive = None

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


class Router:
    """aiohttp's route patterns (``{name}``, ``{name:regex}``), each path tried in the order added."""

    def __init__(self) -> None:
        self._routes: list[tuple[re.Pattern, dict[str, Handler]]] = []
        self._by_path: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        if path not in self._by_path:
            pattern = re.sub(r"\{(\w+)(?::([^}]+))?\}", lambda m: f"(?P<{m[1]}>{m[2] or '[^{}/]+'})", path)
            self._by_path[path] = {}
            self._routes.append((re.compile(pattern), self._by_path[path]))
        self._by_path[path][method] = handler

    def add_get(self, path: str, handler: Handler) -> None:
        self.add("GET", path, handler)
        self.add("HEAD", path, handler)

    def add_post(self, path: str, handler: Handler) -> None:
        self.add("POST", path, handler)

    def resolve(self, method: str, path: str) -> tuple[Handler | None, dict[str, str], int]:
        """The handler and its match_info, or None and the status to answer (404 or 405). ``path`` is
        granian's, already percent-decoded: it must not be decoded again."""
        status = 404
        for pattern, methods in self._routes:
            m = pattern.fullmatch(path)
            if m is None:
                continue
            handler = methods.get(method)
            if handler is None:
                status = 405
                continue
            return handler, m.groupdict(), 200
        return None, {}, status


def _answer(proto, response: web.StreamResponse) -> None:
    """The handler's response, written; granian sends no body to a HEAD request."""
    headers = [(k, v) for k, v in response.headers.items() if k.lower() not in _DROPPED]
    body = response.body if isinstance(response, web.Response) else None
    if body is None:
        body = b""
    elif isinstance(body, bytearray | memoryview):
        body = bytes(body)
    elif not isinstance(body, bytes):
        raise TypeError(f"a response body of type {type(body).__name__} cannot be written")
    if body and "Content-Type" not in response.headers:
        headers.append(("content-type", "application/octet-stream"))
    if response.keep_alive is False:
        headers.append(_CLOSE)
    proto.response_bytes(response.status, headers, body)


class App:
    """The RSGI application: routes each request to its handler and writes what it answers."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.deadlines = Deadlines()

    async def __rsgi__(self, scope, proto) -> None:
        if scope.proto != "http":
            return
        _answer(proto, await respond(self.router, scope.method, scope.path,
                                     lambda match_info: Request(scope, proto, match_info, self.deadlines)))


async def respond(router: Router, method: str, path: str,
                  request_for: Callable[[dict[str, str]], object]) -> web.StreamResponse:
    """What a request is answered, on granian and on ``native``: its route's handler's response, given the
    request ``request_for(match_info)`` makes, or an error in JSON: 404 or 405 without a route, an
    HTTPException's status, or 500 for a bug (logged; the connection then closes)."""
    handler, match_info, status = router.resolve(method, path)
    if handler is None:
        return web.json_response({"error": "Not Found" if status == 404 else "Method Not Allowed"}, status=status)
    try:
        return await handler(request_for(match_info))
    except web.HTTPException as exc:  # the sidecar's routes answer these themselves; another app may not
        return web.json_response({"error": exc.reason}, status=exc.status)
    except Exception:  # the handlers answer their own errors: this is a bug, and the server lives on
        log.exception("internal error on %s %s", method, path)
        response = web.json_response({"error": errors.INTERNAL_MESSAGE}, status=500)
        response.force_close()
        return response


def connection_limit() -> int:
    """The most connections this process can hold open: its soft limit on file descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(1, min(soft, MAX_CONNECTIONS))


def _check_free(host: str, port: int) -> None:
    """OSError (address already in use) when something listens on ``host:port``. granian binds with
    SO_REUSEPORT, which would let a second sidecar of the same user share a port that is taken and serve
    half its connections; a bind without it fails where any socket is bound, as aiohttp's does."""
    for probe in listen.bind(host, port):
        probe.close()


class Listener:
    """granian's embedded server on one address: one Rust I/O thread, HTTP/1.1, the app on this loop.

    ``idle_timeout_s`` bounds how long a connection may take to send a request's headers, counted from
    its opening or its previous response (hyper's header read timeout): a slow-loris connection or an
    idle keep-alive one is closed after it. Headers must fit about ``READ_BUFFER_BYTES`` and number at
    most 100 (hyper's bound), else 431; a request hyper cannot parse is a 400 with no body; pipelined requests
    are read into that same buffer and answered one at a time, in order. granian serves at most
    ``backpressure`` connections at once and leaves the rest unaccepted, so with a small one a few silent
    connections would keep every new client out until the timeout closed them; here it is the process's
    file limit, the bound aiohttp has too. Each request must run as its own asyncio task (``task_impl``
    asyncio, named, not left to granian's default): Deadlines ends a body read by cancelling that task,
    which under granian's rust tasks is one shared object whose cancel() does nothing.
    """

    def __init__(self, app: App, host: str, port: int, idle_timeout_s: float) -> None:
        from granian.constants import HTTPModes, Interfaces, TaskImpl
        from granian.http import HTTP1Settings
        from granian.server.embed import Server

        self.host, self.port, self.app = host, port, app
        settings = HTTP1Settings(header_read_timeout=max(1, round(idle_timeout_s * 1000)),
                                 max_buffer_size=READ_BUFFER_BYTES)
        self.server = Server(app, address=host, port=port, interface=Interfaces.RSGI, runtime_threads=1,
                             http=HTTPModes.http1, websockets=False, log_enabled=False, http1_settings=settings,
                             backpressure=connection_limit(), task_impl=TaskImpl.asyncio, backlog=listen.BACKLOG)
        self._serving: asyncio.Task | None = None

    async def start(self, timeout: float = 30.0) -> None:
        """Returns once the port accepts connections; raises what stopped the server from listening."""
        _check_free(self.host, self.port)
        self._serving = asyncio.get_running_loop().create_task(self.server.serve())
        probe = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        async with asyncio.timeout(timeout):
            while True:
                if self._serving.done():
                    self._serving.result()
                    raise OSError(f"granian stopped before listening on {self.host}:{self.port}")
                try:
                    _, writer = await asyncio.open_connection(probe, self.port)
                except OSError:
                    await asyncio.sleep(0.02)
                    continue
                writer.close()
                return

    async def stop(self) -> None:
        self.app.deadlines.close()
        if self._serving is None:
            return
        if not self._serving.done():
            self.server.stop()
        try:
            await self._serving
        except Exception as exc:
            log.warning("granian stopped with an error: %s", exc)
