"""HTTP/1.1 on the wire, the same on every sidecar server: pipelining, bodies split across writes, 100-continue,
HTTP/1.0, HEAD, an answer given before its body has arrived."""

import asyncio
import contextlib
import gc
import json
import socket
import time

import numpy as np
import pytest

from gepool import Pool
from tests import repo as test_repo
from tests.conftest import SIDECAR_SERVERS, free_port, rss_kb, sidecar_pid

GOOD = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                               "data": list(range(16))}]}).encode()
INFER = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(GOOD)


@pytest.fixture(scope="module", params=SIDECAR_SERVERS)
def served(tmp_path_factory, request):
    repo = str(tmp_path_factory.mktemp("wire-models"))
    test_repo.make_models.make_tiny(repo)
    # one sidecar whatever the host's cores: the tests watch its process
    with Pool(repo, http_port=free_port(), metrics_port=0, http_server=request.param, sidecars=1) as pool:
        yield pool, request.param


@pytest.fixture
def port(served):
    return served[0].http_port


class Reader:
    """Responses read off one socket, one at a time (Content-Length framed, as every gepool answer is)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""

    def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.data:
            self._more()
        head, self.data = self.data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = 0 if head_only else int(headers.get("content-length", 0))
        while len(self.data) < length:
            self._more()
        body, self.data = self.data[:length], self.data[length:]
        return int(lines[0].split()[1]), headers, body

    def closed(self) -> bool:
        """Whether the server closes the connection (within the socket's timeout) with nothing more sent."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"closed with {self.data[:200]!r} unread"
        self.data += chunk


def _connect(port: int) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock, Reader(sock)


def _answer(body: bytes) -> list[float]:
    return json.loads(body)["outputs"][0]["data"]


def test_many_pipelined_requests_are_answered_in_order(port):
    """Fifty requests in one write, each with its own input: fifty answers, each to its own request."""
    sock, reader = _connect(port)
    with sock:
        bodies = [json.dumps({"id": str(i), "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                                         "data": [i] * 16}]}).encode() for i in range(50)]
        sock.sendall(b"".join(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                              % (len(b), b) for b in bodies))
        for i in range(50):
            status, _, body = reader.response()
            assert status == 200 and json.loads(body)["id"] == str(i), body[:200]
            assert _answer(body) == [2.0 * i + 1] * 16


def test_a_pipelined_requests_body_may_come_after_the_answer_before_it(port):
    """The second request's head and half its body come with the first request; the rest only once the first
    is answered: the second is still read and answered."""
    sock, reader = _connect(port)
    with sock:
        half = len(GOOD) // 2
        sock.sendall(INFER + GOOD + INFER + GOOD[:half])
        assert reader.response()[0] == 200
        time.sleep(0.2)
        sock.sendall(GOOD[half:])
        status, _, body = reader.response()
        assert status == 200 and _answer(body) == [2.0 * i + 1 for i in range(16)]


def test_a_body_sent_in_pieces_is_read_whole(port):
    sock, reader = _connect(port)
    with sock:
        sock.sendall(INFER)
        for i in range(0, len(GOOD), 40):
            time.sleep(0.02)
            sock.sendall(GOOD[i:i + 40])
        assert reader.response()[0] == 200
        sock.sendall(INFER + GOOD)  # and the connection serves the next one
        assert reader.response()[0] == 200


def test_expect_100_continue_is_answered_before_the_body_is_sent(port):
    sock, reader = _connect(port)
    with sock:
        sock.sendall(INFER[:-2] + b"Expect: 100-continue\r\n\r\n")
        assert reader.response(head_only=True)[0] == 100
        sock.sendall(GOOD)
        assert reader.response()[0] == 200


def test_http_10_closes_unless_asked_to_keep_alive(port):
    head = b"POST /v2/models/tiny/infer HTTP/1.0\r\nContent-Length: %d\r\n" % len(GOOD)
    sock, reader = _connect(port)
    with sock:
        sock.sendall(head + b"\r\n" + GOOD)
        assert reader.response()[0] == 200
        assert reader.closed()
    sock, reader = _connect(port)
    with sock:
        for _ in range(2):
            sock.sendall(head + b"Connection: keep-alive\r\n\r\n" + GOOD)
            status, headers, _ = reader.response()
            assert status == 200 and headers.get("connection", "").lower() == "keep-alive", headers


def test_head_answers_the_headers_of_get_without_a_body(port):
    sock, reader = _connect(port)
    with sock:
        sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = reader.response()
        assert status == 200 and body
        sock.sendall(b"HEAD /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, head_headers, _ = reader.response(head_only=True)
        assert status == 200 and head_headers["content-length"] == str(len(body))
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # nothing of a body came in between
        assert reader.response()[0] == 200


def test_an_answer_before_the_body_reaches_the_client_still_sending_it(port):
    """A request refused by its route before its body is read (no such model: 400 or 404) while the client
    is still sending: the client hears the answer, not a reset, and every answer carries a Date."""
    sock, reader = _connect(port)
    with sock:
        body = b" " * (256 << 10)
        sock.sendall(b"POST /v2/nothing/here HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.sendall(body[:1000])
        status, headers, _ = reader.response()
        assert status in (404, 405) and "date" in headers, headers
        try:
            sock.sendall(body[1000:])
        except (BrokenPipeError, ConnectionResetError):
            pass
    sock, reader = _connect(port)  # and the server serves on
    with sock:
        sock.sendall(INFER + GOOD)
        assert reader.response()[0] == 200


def _rest(sock: socket.socket, wait: float = 2.0) -> bytes:
    """Whatever the server sends until it closes, or ``wait`` seconds pass without a byte."""
    sock.settimeout(wait)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


@pytest.mark.parametrize("kind", ["many", "endless"])
def test_trailers_of_a_chunked_body_cannot_grow_the_server(served, kind):
    """After a chunked body's last chunk, trailer lines (or one trailer value that never ends) are not held
    without bound: 64 MiB of them leave the sidecar's memory under 48 MiB larger, and it refuses them (or closes)."""
    pool, server = served
    if server == "aiohttp":
        pytest.skip("aiohttp may stop reading the trailers and answer 408 at the body timeout (30 s here)")
    pid = sidecar_pid(pool)
    before = rss_kb(pid)
    piece = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 50) for i in range(1000)) if kind == "many" else b"v" * (64 << 10)
    head = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", pool.http_port), timeout=60) as sock:
        sock.sendall(head + b"%x\r\n%s\r\n0\r\n" % (len(GOOD), GOOD) + (b"X-T: " if kind == "endless" else b""))
        sent = 0
        try:
            while sent < 64 << 20:
                sock.sendall(piece)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = _rest(sock)
    assert rss_kb(pid) - before < 48 << 10, (before, rss_kb(pid))
    assert reply == b"" or reply.split()[1] in (b"400", b"431"), reply[:300]
    sock, reader = _connect(pool.http_port)  # and it serves on
    with sock:
        sock.sendall(INFER + GOOD)
        assert reader.response()[0] == 200


def test_a_request_asking_to_upgrade_is_answered_once_as_http_11(port):
    """The Upgrade is ignored, as aiohttp does: one answer to one request, with or without a body (Java's
    HttpClient asks for h2c on the first request of each connection, a POST with its body)."""
    h2c = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
    chunked = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)
    cases = [(b"GET /v2/health/live", b"Upgrade: websocket\r\nConnection: Upgrade\r\nContent-Length: 0\r\n\r\n"),
             (b"POST /v2/models/tiny/infer", h2c + b"Content-Length: %d\r\n\r\n%s" % (len(GOOD), GOOD)),
             (b"POST /v2/models/tiny/infer", h2c + chunked)]
    for line, rest in cases:
        sock, _ = _connect(port)
        with sock:
            sock.sendall(line + b" HTTP/1.1\r\nHost: x\r\n" + rest)
            data = _rest(sock)
        assert data.count(b"HTTP/1.1 ") == 1 and data.split()[1] == b"200", (line, data[:600])
        if line.startswith(b"POST"):
            assert b"OUTPUT0" in data
    sock, reader = _connect(port)  # the body sent only once asked for
    with sock:
        sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n" + h2c
                     + b"Content-Length: %d\r\n\r\n" % len(GOOD))
        assert reader.response(head_only=True)[0] == 100
        sock.sendall(GOOD)
        assert reader.response()[0] == 200


def test_trailers_get_one_answer(port):
    """A chunked body with a trailer in the same write as its last chunk: one answer (served, or refused
    naming the trailers), never a second one that a next request would read as its own."""
    sock, _ = _connect(port)
    with sock:
        sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n0\r\nX-T: a\r\n\r\n" % (len(GOOD), GOOD))
        data = _rest(sock)
    assert data.count(b"HTTP/1.1 ") == 1, data[:600]
    assert data.split()[1] == b"200" or b"trailers" in data, data[:300]


def test_a_chunked_body_split_at_every_byte_is_read(port):
    """Chunk size lines and the last chunk's CRLF split over writes are framing, not trailers."""
    sock, reader = _connect(port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"%x" % len(GOOD), b"\r", b"\n", GOOD[:10], GOOD[10:], b"\r\n", b"0\r\n", b"\r", b"\n"):
            sock.sendall(piece)
            time.sleep(0.05)
        assert reader.response()[0] == 200


def test_a_head_of_endless_header_fields_is_refused_before_it_ends(port):
    """15,000 empty header fields (60 KB, under the head's byte bound) are refused as they come, not held
    until the head ends or the idle timeout closes the connection."""
    sock, _ = _connect(port)
    with sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"a:\r\n" * 15000)
        data = _rest(sock, wait=10)
    assert data.split()[1] in (b"400", b"431"), data[:300]


def test_a_half_closed_client_is_answered(served):
    """httptools: a client that sends its request and shuts down its side still hears the answer."""
    pool, server = served
    if server != "httptools":
        pytest.skip("aiohttp and granian close a half-closed connection unanswered")
    sock, reader = _connect(pool.http_port)
    with sock:
        sock.sendall(INFER + GOOD)
        sock.shutdown(socket.SHUT_WR)
        status, headers, _ = reader.response()
        # the server may read the request and answer before the FIN reaches it (then it does not yet know to say
        # close, and closes once it reads the FIN): only a header that says otherwise would be wrong
        assert status == 200 and headers.get("connection", "close").lower() == "close", headers
        assert reader.closed()


def test_nothing_is_written_after_an_answer_that_closes(port):
    """An answer written before its (chunked) body has all come says it closes; framing that breaks after it
    gets no second answer."""
    sock, reader = _connect(port)
    with sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
        status, headers, _ = reader.response()
        assert status == 200
        time.sleep(0.3)
        try:
            sock.sendall(b"lo\r\nZZZ\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert b"HTTP/1.1 " not in reader.data + _rest(sock)


def test_an_absolute_url_without_a_path_is_not_found(port):
    sock, reader = _connect(port)
    with sock:
        sock.sendall(b"GET http://example HTTP/1.1\r\nHost: example\r\n\r\n")
        assert reader.response()[0] == 404


def test_white_space_around_a_header_value_is_not_part_of_it(port):
    """RFC 9110 5.5: spaces and tabs around a field value are not the value (aiohttp strips both sides, llhttp only
    the leading): a binary header's length with them is read as its digits, on every server."""
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 64}}]}).encode()
    body = header + np.arange(16, dtype=np.float32).tobytes()
    sock, reader = _connect(port)
    with sock:
        for around in (b" %d \t", b"\t%d  ", b"%d"):
            sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length:"
                         + around % len(header) + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            status, _, answer = reader.response()
            assert status == 200, (around, answer)
            assert _answer(answer) == [float(2 * v + 1) for v in range(16)], around


def test_requests_pipelined_after_a_refused_one_never_run(served):
    """httptools: a request the server refuses (101 headers) ends the connection; the infer sent after it in
    the same write is neither run nor answered."""
    pool, server = served
    if server != "httptools":
        pytest.skip("the bound on header fields is httptools' (aiohttp has none of 100)")
    client = pool.client()
    before = client.stats()["tiny"]["requests"]
    sock, _ = _connect(pool.http_port)
    with sock:
        fields = b"".join(b"X-%d: v\r\n" % i for i in range(101))
        sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n" + INFER + GOOD)
        data = _rest(sock)
    assert data.count(b"HTTP/1.1 ") == 1 and data.split()[1] == b"431", data[:300]
    time.sleep(0.5)
    assert client.stats()["tiny"]["requests"] == before


@contextlib.asynccontextmanager
async def _native_post(port: int, handler):
    """The native server on 127.0.0.1:``port`` answering POST /x with ``handler``, stopped afterwards."""
    from gepool.http import native, rsgi

    router = rsgi.Router()
    router.add_post("/x", handler)
    listener = native.Listener(router, "127.0.0.1", port, 30.0, 1 << 20)
    await listener.start()
    try:
        yield listener
    finally:
        await listener.stop()


def test_a_closed_connection_is_freed_without_the_cyclic_collector():
    """The parser holds the connection's callbacks and its requests hold the connection: those cycles are
    broken when it closes, so what it held goes at once, even with the collector off."""
    from gepool.http import native

    async def hello(request):
        from aiohttp import web

        await request.read_body(1 << 20, 5)
        return web.Response(body=b"{}", content_type="application/json")

    async def main(port: int) -> int:
        async with _native_post(port, hello) as listener:
            for _ in range(20):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
                assert (await reader.readuntil(b"{}")).startswith(b"HTTP/1.1 200")
                writer.close()
                await writer.wait_closed()
            for _ in range(100):  # until the server has seen every close
                if not listener.connections:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(native.SWEEP_S * 2)
            return sum(isinstance(o, native.Connection) for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        assert asyncio.run(main(free_port())) == 0
    finally:
        gc.enable()


def test_a_body_cut_short_by_a_half_close_is_answered_and_closed_without_lingering(monkeypatch):
    """A client that half-closes before its body has all come can send nothing more: its request fails, is
    answered, and the connection closes at once instead of waiting for the rest of a body that cannot come
    (a flood of such clients would otherwise hold a descriptor each for the linger)."""
    from aiohttp import web

    from gepool.http import limits, native

    monkeypatch.setattr(native, "LINGER_S", 3600.0)
    monkeypatch.setattr(native, "LINGER_IDLE_S", 3600.0)

    async def upload(request):
        try:
            await request.read_body(1 << 20, 30)
        except limits.ClientGone:
            return web.Response(status=400, body=b"{}", content_type="application/json")
        return web.Response(body=b"{}", content_type="application/json")

    async def main(port: int) -> bytes:
        async with _native_post(port, upload):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b" " * 10)
            await writer.drain()
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 30)  # to the end: the server closed
            writer.close()
            return answer

    answer = asyncio.run(main(free_port()))
    assert answer.startswith(b"HTTP/1.1 400") and b"Connection: close" in answer, answer


def test_stopping_closes_idle_connections_and_answers_running_requests():
    """On stop, an idle keep-alive connection closes at once; a running request is answered, with close, and
    stop returns without waiting out its grace."""
    from aiohttp import web

    from gepool.http import native, rsgi

    async def main(port: int) -> None:
        release = asyncio.Event()

        async def slow(request):
            await release.wait()
            return web.Response(body=b"{}", content_type="application/json")

        async def fast(request):
            return web.Response(body=b"{}", content_type="application/json")

        router = rsgi.Router()
        router.add_get("/slow", slow)
        router.add_get("/fast", fast)
        listener = native.Listener(router, "127.0.0.1", port, 30.0, 1 << 20)
        await listener.start()
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        idle_w.write(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await idle_r.readuntil(b"{}")).startswith(b"HTTP/1.1 200")
        busy_r, busy_w = await asyncio.open_connection("127.0.0.1", port)
        busy_w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(200):
            if any(c.queue for c in listener.connections):
                break
            await asyncio.sleep(0.01)
        start = asyncio.get_running_loop().time()
        stopping = asyncio.create_task(listener.stop())
        assert await asyncio.wait_for(idle_r.read(), 2) == b""  # closed now, not after the grace
        release.set()
        answer = await asyncio.wait_for(busy_r.read(), 5)
        assert answer.startswith(b"HTTP/1.1 200") and b"Connection: close" in answer, answer
        await stopping
        assert asyncio.get_running_loop().time() - start < native.STOP_GRACE_S
        for w in (idle_w, busy_w):
            w.close()

    asyncio.run(main(free_port()))
