"""The native gRPC server's HTTP/2 and gRPC framing, on the wire: a Listener in this process serving test
methods, called by grpcio clients and by a raw socket writing hand-made (and hostile) frames."""

import asyncio
import gzip
import socket
import threading
import time

import grpc
import hpack
import pytest

from gepool.grpc import native
from tests.conftest import free_port, wait_until

MAX_BODY = 1 << 20
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED = 0, 1, 2, 3, 4
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 8, 12, 13


class Methods:
    """Test methods; what the slow ones saw is recorded in threading events."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.release: asyncio.Event | None = None
        self.produced = 0

    async def echo(self, request: bytes, context) -> bytes:
        return request

    async def slow(self, request: bytes, context) -> bytes:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b"released"

    async def blob(self, request: bytes, context) -> bytes:
        return bytes(int(request))

    async def boom(self, request: bytes, context) -> bytes:
        raise RuntimeError("a secret path /etc/shadow")

    async def chat(self, requests, context):
        async for r in requests:
            yield r[::-1]

    async def total(self, requests, context) -> bytes:
        return str(sum([len(r) async for r in requests])).encode()

    async def count(self, request: bytes, context):
        for i in range(int(request)):
            self.produced += 1
            yield str(i).encode()

    async def big(self, request: bytes, context):
        for _ in range(int(request)):
            self.produced += 1
            yield bytes(MAX_BODY // 2)

    def table(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"/t.S/Echo": grpc.unary_unary_rpc_method_handler(self.echo),
                "/t.S/Slow": grpc.unary_unary_rpc_method_handler(self.slow),
                "/t.S/Boom": grpc.unary_unary_rpc_method_handler(self.boom),
                "/t.S/Blob": grpc.unary_unary_rpc_method_handler(self.blob),
                "/t.S/Chat": grpc.stream_stream_rpc_method_handler(self.chat),
                "/t.S/Total": grpc.stream_unary_rpc_method_handler(self.total),
                "/t.S/Count": grpc.unary_stream_rpc_method_handler(self.count),
                "/t.S/Big": grpc.unary_stream_rpc_method_handler(self.big)}


class Served:
    """A native.Listener on an event loop in a thread."""

    def __init__(self) -> None:
        self.methods = Methods()
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.listener = native.Listener(self.methods.table(), "127.0.0.1", self.port, MAX_BODY)
        self.call(self._start())

    async def _start(self) -> None:
        self.methods.release = asyncio.Event()
        await self.listener.start()

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def held(self) -> int:
        """Bytes of requests the connections hold; never below 0, whatever was refused."""
        async def total() -> list[int]:
            return [c.held for c in self.listener.connections]
        held = self.call(total())
        assert all(h >= 0 for h in held), held
        return sum(held)

    def connections(self, *names: str) -> list[tuple]:
        async def read() -> list[tuple]:
            return [tuple(getattr(c, n) for n in names) for c in self.listener.connections]
        return self.call(read())

    def echo_works(self) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            return ch.unary_unary("/t.S/Echo")(b"still here", timeout=10) == b"still here"

    def close(self) -> None:
        self.call(self.listener.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


class Raw:
    """A client writing frames by hand, reading the server's frames back."""

    def __init__(self, port: int, preface: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.enc, self.dec, self.buf = hpack.Encoder(), hpack.Decoder(), b""
        if preface:
            self.send(native.PREFACE + native.frame(native.SETTINGS, 0, 0))

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def headers(self, sid: int, path: str = "/t.S/Echo", end: bool = False, ctype: str = "application/grpc",
                extra: tuple = ()) -> bytes:
        block = self.enc.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "t"),
                                 ("content-type", ctype), ("te", "trailers"), *extra])
        return native.frame(native.HEADERS, native.END_HEADERS | (native.END_STREAM if end else 0), sid, block)

    @staticmethod
    def data(sid: int, message: bytes, end: bool = True, compressed: int = 0, declared: int | None = None) -> bytes:
        prefix = bytes([compressed]) + (len(message) if declared is None else declared).to_bytes(4, "big")
        return native.frame(native.DATA, native.END_STREAM if end else 0, sid, prefix + message)

    def frame(self) -> tuple[int, int, int, bytes] | None:
        """The next frame, or None at EOF."""
        while len(self.buf) < 9 or len(self.buf) < 9 + int.from_bytes(self.buf[:3], "big"):
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        n = int.from_bytes(self.buf[:3], "big")
        kind, flags, sid = self.buf[3], self.buf[4], int.from_bytes(self.buf[5:9], "big")
        payload, self.buf = self.buf[9:9 + n], self.buf[9 + n:]
        return kind, flags, sid, payload

    def result(self, sid: int) -> tuple[int | str, str, list[bytes]]:
        """A call's grpc-status (or "RST n" when reset) and grpc-message, and its messages."""
        messages, status, text = [], None, ""
        while True:
            f = self.frame()
            assert f is not None, "the connection closed before the call ended"
            kind, flags, fsid, payload = f
            if kind == native.HEADERS:
                fields = dict(self.dec.decode(payload))
                if fsid == sid and "grpc-status" in fields:
                    status, text = int(fields["grpc-status"]), fields.get("grpc-message", "")
            elif kind == native.DATA and fsid == sid:
                messages.append(payload[5:])
            elif kind == native.RST_STREAM and fsid == sid:
                return f"RST {int.from_bytes(payload, 'big')}", "", messages
            if fsid == sid and kind in (native.HEADERS, native.DATA) and flags & native.END_STREAM:
                return status, text, messages

    def goaway(self) -> tuple[int, str]:
        """The GOAWAY's error code and text; the connection must close after it."""
        while True:
            f = self.frame()
            assert f is not None, "the connection closed without GOAWAY"
            if f[0] == native.GOAWAY:
                return int.from_bytes(f[3][4:8], "big"), f[3][8:].decode()

    def closed(self) -> bool:
        """Whether the server closes the connection (a reset, when it closed with our bytes unread)."""
        try:
            while self.frame() is not None:
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


# -- through grpcio's client ---------------------------------------------------------------------------
def test_large_messages_both_ways_under_the_clients_default_windows(served):
    """Sixteen calls at once on one connection, each near the body limit both ways (past four times the limit
    together): the answers wait for the client's window (64 KiB at first) and arrive whole, none refused."""
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        echo = ch.unary_unary("/t.S/Echo")
        payloads = [bytes([i]) * (MAX_BODY - 100) for i in range(16)]
        calls = [echo.future(p, timeout=60) for p in payloads]
        assert [c.result() for c in calls] == payloads
    assert wait_until(lambda: served.held() == 0, 10)


def test_streaming_methods_of_every_shape(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        sent = [f"message {i}".encode() for i in range(300)]
        assert list(ch.stream_stream("/t.S/Chat")(iter(sent), timeout=30)) == [m[::-1] for m in sent]
        assert ch.stream_unary("/t.S/Total")(iter(sent), timeout=30) == str(sum(map(len, sent))).encode()
        assert list(ch.unary_stream("/t.S/Count")(b"50", timeout=30)) == [str(i).encode() for i in range(50)]


def test_a_deadline_answers_deadline_exceeded_and_cancels_the_handler(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch, pytest.raises(grpc.RpcError) as info:
        ch.unary_unary("/t.S/Slow")(b"", timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert served.methods.cancelled.wait(15)


def test_a_call_the_client_cancels_cancels_its_handler(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        call = ch.unary_unary("/t.S/Slow").future(b"", timeout=60)
        assert served.methods.started.wait(15)
        call.cancel()
        assert served.methods.cancelled.wait(15)
        assert ch.unary_unary("/t.S/Echo")(b"after", timeout=10) == b"after"


def test_compressed_requests_are_inflated_within_the_limit(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        payload = b"compressible " * 20000
        assert ch.unary_unary("/t.S/Echo")(payload, timeout=30, compression=grpc.Compression.Gzip) == payload
        assert ch.unary_unary("/t.S/Echo")(payload, timeout=30, compression=grpc.Compression.Deflate) == payload
    raw = Raw(served.port)
    bomb = gzip.compress(bytes(8 * MAX_BODY))  # a few KiB that would inflate to 8 MiB
    raw.send(raw.headers(1, extra=(("grpc-encoding", "gzip"),)), raw.data(1, bomb, compressed=1))
    status, text, _ = raw.result(1)
    assert status == RESOURCE_EXHAUSTED and "larger than max" in text
    raw.send(raw.headers(3, extra=(("grpc-encoding", "gzip"),)), raw.data(3, b"not gzip", compressed=1))
    status, text, _ = raw.result(3)
    assert status == INTERNAL and "cannot be decompressed" in text
    whole = gzip.compress(b"abc" * 1000)
    for sid, cut, why in ((5, whole[:-9], "ends inside its stream"), (7, whole + b"more", "data after the end")):
        raw.send(raw.headers(sid, extra=(("grpc-encoding", "gzip"),)), raw.data(sid, cut, compressed=1))
        status, text, _ = raw.result(sid)
        assert status == INTERNAL and why in text, (status, text)
    raw.close()


# -- calls refused, the connection kept ---------------------------------------------------------------
CALL_ERRORS = {
    "unknown method": (dict(path="/t.S/Nope"), [b""], UNIMPLEMENTED, "Method not found: /t.S/Nope"),
    "not grpc": (dict(ctype="text/plain"), [b""], INVALID_ARGUMENT, "is not application/grpc"),
    "bad timeout": (dict(extra=(("grpc-timeout", "soon"),)), [b""], INVALID_ARGUMENT, "grpc-timeout"),
    "unknown encoding": (dict(extra=(("grpc-encoding", "br"),)), [b""], UNIMPLEMENTED, "grpc-encoding"),
    "compressed, no encoding": ({}, [("c", b"x")], INTERNAL, "compressed without a grpc-encoding"),
    "two messages in a unary call": ({}, [b"one", b"two"], UNIMPLEMENTED, "carries one request message"),
    "no message in a unary call": ({}, [], UNIMPLEMENTED, "carries one request message"),
    "ends inside a message": ({}, [("cut", b"abc")], INTERNAL, "ended inside a message"),
    "declares more than the limit": ({}, [("huge", b"")], RESOURCE_EXHAUSTED, f"larger than max ({1 << 30} vs."),
    "a handler raising": (dict(path="/t.S/Boom"), [b""], UNKNOWN, "Unexpected error"),
}


@pytest.mark.parametrize("case", list(CALL_ERRORS))
def test_a_refused_call_gets_its_status_and_the_connection_serves_on(served, case):
    how, messages, want, text = CALL_ERRORS[case]
    raw = Raw(served.port)
    frames = [raw.headers(1, end=not messages, **how)]
    for i, m in enumerate(messages):
        end = i == len(messages) - 1
        if isinstance(m, tuple) and m[0] == "c":
            frames.append(raw.data(1, m[1], end=end, compressed=1))
        elif isinstance(m, tuple) and m[0] == "cut":
            frames.append(raw.data(1, m[1], end=end, declared=10))
        elif isinstance(m, tuple):
            frames.append(raw.data(1, m[1], end=False, declared=1 << 30))
        else:
            frames.append(raw.data(1, m, end=end))
    raw.send(*frames)
    status, message, _ = raw.result(1)
    assert status == want and text in message, (status, message)
    assert "Traceback" not in message and "shadow" not in message
    raw.send(raw.headers(3), raw.data(3, b"next"))
    assert raw.result(3) == (OK, "", [b"next"])
    assert served.held() == 0
    raw.close()


def _call(raw: Raw, sid: int, block: bytes, message: bytes) -> tuple:
    raw.send(native.frame(native.HEADERS, native.END_HEADERS, sid, block), raw.data(sid, message))
    return raw.result(sid)


# hand-made header fields (RFC 7541 6): :method POST and :scheme http indexed (static 3 and 6), then the rest
_STATIC = b"\x83\x86" + native._literal(b"content-type", b"application/grpc") + native._literal(b"te", b"trailers")
_AUTHORITY = b"\x01" + native._string(b"t")  # :authority (static name 1), literal without indexing


def test_a_block_of_literals_not_indexed_is_known_again_until_the_table_changes(served):
    """nghttp2's clients (curl, h2load, Envoy) never index the :path, so their repeated call is a block of
    indexed fields and literals not indexed: it changes no table and is read once; a block that adds to the
    table moves the dynamic indices, and the same bytes then name another method."""
    raw = Raw(served.port)
    insert_echo = _STATIC + _AUTHORITY + b"\x44" + native._string(b"/t.S/Echo")  # :path, incremental indexing
    assert _call(raw, 1, insert_echo, b"one") == (OK, "", [b"one"])
    # the dynamic entry 62 (":path", "/t.S/Echo") and a never indexed field (0x10, a new name)
    repeated = _STATIC + b"\xbe" + _AUTHORITY + b"\x10" + native._string(b"x-token") + native._string(b"secret")
    assert native._changes_no_table(repeated)
    for sid in (3, 5, 7):
        assert _call(raw, sid, repeated, b"again") == (OK, "", [b"again"])
    (kept,) = served.connections("_kept")
    assert repeated in kept[0]
    insert_blob = _STATIC + _AUTHORITY + b"\x44" + native._string(b"/t.S/Blob")  # now entry 62; Echo's is 63
    assert _call(raw, 9, insert_blob, b"3") == (OK, "", [bytes(3)])
    assert _call(raw, 11, repeated, b"5") == (OK, "", [bytes(5)])
    nghttp2_like = _STATIC + _AUTHORITY + b"\x04" + native._string(b"/t.S/Echo")  # :path not indexed
    for sid in (13, 15):
        assert _call(raw, sid, nghttp2_like, b"path") == (OK, "", [b"path"])
    raw.close()


@pytest.mark.parametrize("block, neutral", [
    (b"\x83\x86\xbe", True),  # indexed only
    (b"\x04\x05/t.S/", True),  # literal without indexing, indexed name
    (b"\x00\x01a\x01b", True),  # literal without indexing, new name
    (b"\x10\x01a\x81\xff", True),  # never indexed, new name, a Huffman value (its bytes not decoded here)
    (b"\x0f\x10\x01a", True),  # a name index past the 4-bit prefix (31: content-type)
    (b"\xff\x80\x01", True),  # an index past the 7-bit prefix (127 + 128)
    (b"\x44\x01a", False),  # literal with incremental indexing
    (b"\x83\x40\x01a\x01b", False),  # the same, new name, after an indexed field
    (b"\x3f\xe1\x1f", False),  # a table size update
    (b"\x20\x83", False),  # a table size update to 0
    (b"\x04\x05/t.S", False),  # a value shorter than its length
    (b"\x00\x01a", False),  # a name without its value
    (b"\xff", False),  # an integer cut short
    (b"\xff" + b"\x80" * 10 + b"\x01", False),  # an integer past 28 bits of continuation
])
def test_which_header_blocks_change_no_table(block, neutral):
    assert native._changes_no_table(block) is neutral


def test_more_calls_than_max_streams_are_refused_and_the_rest_run(served):
    raw = Raw(served.port)
    frames = []
    for i in range(native.MAX_STREAMS + 1):
        sid = 2 * i + 1
        frames += [raw.headers(sid, path="/t.S/Slow"), raw.data(sid, b"")]
    raw.send(*frames)
    refused = 2 * native.MAX_STREAMS + 1
    assert raw.result(refused)[0] == f"RST {native.REFUSED_STREAM}"
    served.loop.call_soon_threadsafe(served.methods.release.set)
    assert raw.result(1) == (OK, "", [b"released"])
    raw.close()


def test_a_second_call_on_a_finished_stream_is_reset_not_left_waiting(served):
    raw = Raw(served.port)
    raw.send(raw.headers(1), raw.data(1, b"first"))
    assert raw.result(1) == (OK, "", [b"first"])
    raw.send(raw.headers(1), raw.data(1, b"again"))
    assert raw.result(1)[0] == f"RST {native.STREAM_CLOSED}"
    raw.send(raw.headers(3), raw.data(3, b"next"))
    assert raw.result(3) == (OK, "", [b"next"])
    raw.close()


def test_a_client_that_does_not_read_its_refusals_stops_being_read(served):
    """Each small request is refused with a longer answer (its path named): once the transport's buffer is
    full, the server stops parsing, so what it holds to write stays bounded however much is sent."""
    raw = Raw(served.port)
    path = "/\xff" + "\xff" * 1000  # indexed by the client after the first call: a 12-byte request each
    first = raw.headers(1, path=path, end=True)
    raw.send(first + b"".join(raw.headers(2 * i + 1, path=path, end=True) for i in range(1, 20000)))
    assert wait_until(lambda: any(paused for paused, in served.connections("paused")), 15)
    for transport, pending in served.connections("transport", "pending"):
        assert served.call(_buffered(transport)) + pending <= 4 * native.MAX_PENDING_WRITE
    raw.close()


async def _buffered(transport) -> int:
    return transport.get_write_buffer_size()


def test_answers_the_client_does_not_read_are_reset_once_stalled(monkeypatch):
    """The client reads its socket but never opens its window: each answer waits, and is reset (CANCEL) once
    nothing of it has gone through for STALL_TIMEOUT_S; what they held is let go."""
    monkeypatch.setattr(native, "STALL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(native, "SWEEP_S", 0.1)
    served = Served()
    try:
        raw = Raw(served.port)
        size = MAX_BODY - 100
        calls = 8
        raw.send(*(raw.headers(2 * i + 1, path="/t.S/Blob") + raw.data(2 * i + 1, str(size).encode())
                   for i in range(calls)))
        outcomes = {}
        while len(outcomes) < calls:
            kind, flags, sid, payload = raw.frame()
            if kind == native.HEADERS:
                fields = dict(raw.dec.decode(payload))
                if "grpc-status" in fields:
                    outcomes[sid] = (fields["grpc-status"], fields.get("grpc-message", ""))
            elif kind == native.RST_STREAM:
                outcomes[sid] = ("RST", int.from_bytes(payload, "big"))
        assert all(o == ("RST", native.CANCEL) for o in outcomes.values()), outcomes
        assert served.connections("unsent") == [(0,)]
        raw.close()
    finally:
        served.close()


def test_a_client_that_reads_nothing_is_cut_off_once_stalled(monkeypatch):
    """Windows wide open, the socket never read: once the transport has been paused for STALL_TIMEOUT_S the
    connection is aborted, and what it held goes with it."""
    monkeypatch.setattr(native, "STALL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(native, "SWEEP_S", 0.1)
    served = Served()
    try:
        raw = Raw(served.port)
        wide = native._SETTING.pack(4, native.MAX_WINDOW)
        raw.send(native.frame(native.SETTINGS, 0, 0, wide),
                 native.frame(native.WINDOW_UPDATE, 0, 0, (native.MAX_WINDOW - 65535).to_bytes(4, "big")),
                 *(raw.headers(2 * i + 1, path="/t.S/Blob") + raw.data(2 * i + 1, str(MAX_BODY - 100).encode())
                   for i in range(60)))
        assert wait_until(lambda: any(paused for paused, in served.connections("paused")), 15)
        assert wait_until(lambda: not served.listener.connections, 15)
        raw.close()
    finally:
        served.close()


def test_a_connection_holding_too_many_bytes_of_requests_is_refused_more(served):
    """Partial messages on many streams: the stream whose bytes take the connection past its bound of requests
    still arriving (here lowered to 4x the body limit and a frame) is answered RESOURCE_EXHAUSTED, and what it held
    goes."""
    served.listener.partial_floor = 0
    raw = Raw(served.port)
    statuses = []
    for i in range(6):
        sid = 2 * i + 1
        raw.send(raw.headers(sid), raw.data(sid, bytes(MAX_BODY - 64), end=False, declared=MAX_BODY))
    raw.send(native.frame(native.PING, 0, 0, b"12345678"))
    while True:  # the PING's answer comes after every refusal the data above caused
        kind, flags, sid, payload = raw.frame()
        if kind == native.HEADERS and flags & native.END_STREAM:
            statuses.append(dict(raw.dec.decode(payload)))
        elif kind == native.HEADERS:
            raw.dec.decode(payload)
        if kind == native.PING and flags & native.ACK:
            break
    assert statuses and all(s["grpc-status"] == str(RESOURCE_EXHAUSTED) for s in statuses)
    assert "requests still arriving" in statuses[0]["grpc-message"]
    assert served.held() <= served.listener.max_partial == 4 * MAX_BODY + native.MAX_FRAME_SIZE
    raw.close()
    assert wait_until(lambda: served.held() == 0, 10)


def test_an_answer_the_client_does_not_read_pauses_its_handler(served):
    """The client's window (64 KiB) is never opened: the handler stops producing once about QUEUED_BYTES wait."""
    raw = Raw(served.port)
    raw.send(raw.headers(1, path="/t.S/Big"), raw.data(1, b"100"))
    time.sleep(1)  # let the handler run as far as it can
    produced = served.methods.produced
    assert 1 <= produced <= native.QUEUED_BYTES // (MAX_BODY // 2) + 2, produced
    raw.send(native.frame(native.RST_STREAM, 0, 1, (native.CANCEL).to_bytes(4, "big")))
    assert wait_until(lambda: served.echo_works(), 10)
    raw.close()


# -- connection errors ---------------------------------------------------------------------------------
def _big_block(raw: Raw) -> bytes:
    block = raw.enc.encode([(":path", "/t.S/Echo"), ("x-pad", "v" * 100000)])
    return native.frame(native.HEADERS, 0, 1, block[:60000]) \
        + native.frame(native.CONTINUATION, native.END_HEADERS, 1, block[60000:])


def _made_you_reset(raw: Raw) -> bytes:
    """DATA after END_STREAM: the server resets each stream itself (CVE-2025-8671's pattern)."""
    return b"".join(raw.headers(2 * i + 1) + raw.data(2 * i + 1, b"x") + raw.data(2 * i + 1, b"y")
                    for i in range(native.MAX_CONTROL_FRAMES + 1))


def _rapid_reset(raw: Raw) -> bytes:
    return b"".join(raw.headers(2 * i + 1) + native.frame(native.RST_STREAM, 0, 2 * i + 1, bytes(4))
                    for i in range(native.MAX_CONTROL_FRAMES + 1))


CONNECTION_ERRORS = {  # what is sent (made with the connection's own encoder), and the GOAWAY's code
    "a frame over the maximum size": (lambda raw: native._HEADER.pack(0x20, 0, native.DATA, 0, 1),
                                      native.FRAME_SIZE_ERROR),
    "an interrupted header block": (lambda raw: native.frame(native.HEADERS, 0, 1, b"\x83")
                                    + native.frame(native.PING, 0, 0, bytes(8)), native.PROTOCOL_ERROR),
    "a header block over the limit": (_big_block, native.ENHANCE_YOUR_CALM),
    "a malformed header block": (lambda raw: native.frame(native.HEADERS, native.END_HEADERS, 1, b"\xff\xff\xff\xff"),
                                 native.COMPRESSION_ERROR),
    "an even stream": (lambda raw: raw.headers(2, end=True), native.PROTOCOL_ERROR),
    "DATA on stream 0": (lambda raw: native.frame(native.DATA, 0, 0, b"x"), native.PROTOCOL_ERROR),
    "DATA on a stream never opened": (lambda raw: native.frame(native.DATA, 0, 9, b"x"), native.PROTOCOL_ERROR),
    "a short PING": (lambda raw: native.frame(native.PING, 0, 0, bytes(7)), native.FRAME_SIZE_ERROR),
    "a WINDOW_UPDATE of 0": (lambda raw: native.frame(native.WINDOW_UPDATE, 0, 0, bytes(4)), native.PROTOCOL_ERROR),
    "a SETTINGS frame of 5 bytes": (lambda raw: native.frame(native.SETTINGS, 0, 0, bytes(5)), native.FRAME_SIZE_ERROR),
    "a push": (lambda raw: native.frame(native.PUSH_PROMISE, native.END_HEADERS, 1, bytes(4)), native.PROTOCOL_ERROR),
    "a PING flood": (lambda raw: native.frame(native.PING, 0, 0, bytes(8)) * (native.MAX_CONTROL_FRAMES + 1),
                     native.ENHANCE_YOUR_CALM),
    "a rapid reset flood": (_rapid_reset, native.ENHANCE_YOUR_CALM),
    "a made-you-reset flood": (_made_you_reset, native.ENHANCE_YOUR_CALM),
    "an empty message flood": (lambda raw: raw.headers(1, path="/t.S/Chat") + native.frame(
        native.DATA, 0, 1, bytes(5) * (native.MAX_CONTROL_FRAMES + 1)), native.ENHANCE_YOUR_CALM),
    "a PRIORITY flood": (lambda raw: native.frame(native.PRIORITY, 0, 1, bytes(5)) * (native.MAX_CONTROL_FRAMES + 1),
                         native.ENHANCE_YOUR_CALM),
    "an unknown frame flood": (lambda raw: native.frame(0x20, 0, 0, b"?") * (native.MAX_CONTROL_FRAMES + 1),
                               native.ENHANCE_YOUR_CALM),
    "an empty padded DATA flood": (lambda raw: raw.headers(1) + native.frame(native.DATA, native.PADDED, 1, b"\x00")
                                   * (native.MAX_CONTROL_FRAMES + 1), native.ENHANCE_YOUR_CALM),
}


@pytest.mark.parametrize("case", CONNECTION_ERRORS)
def test_a_protocol_error_closes_the_connection_with_goaway_naming_it(served, case):
    raw = Raw(served.port)
    make, code = CONNECTION_ERRORS[case]
    raw.send(make(raw))
    got, text = raw.goaway()
    assert got == code and text, (got, text)
    assert raw.closed()
    raw.close()
    assert served.echo_works()
    assert wait_until(lambda: not served.listener.connections, 10)


def test_a_client_that_does_not_speak_http2_is_closed(served):
    raw = Raw(served.port, preface=False)
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.goaway()[0] == native.PROTOCOL_ERROR
    assert raw.closed()
    raw.close()


def test_a_ping_is_answered_with_its_payload(served):
    raw = Raw(served.port)
    raw.send(native.frame(native.PING, 0, 0, b"abcdefgh"))
    while (f := raw.frame())[0] != native.PING:
        pass
    assert f[1] & native.ACK and f[3] == b"abcdefgh"
    raw.close()


# -- time ----------------------------------------------------------------------------------------------
def test_slow_requests_and_silent_connections_time_out(monkeypatch):
    monkeypatch.setattr(native, "BODY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(native, "PREFACE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(native, "SWEEP_S", 0.1)
    monkeypatch.setattr(native, "IDLE_TIMEOUT_S", 1.0)
    served = Served()
    try:
        idle = Raw(served.port)
        assert idle.goaway() == (native.NO_ERROR, "no call for 1 s") and idle.closed()
        idle.close()
        unfinished = Raw(served.port)
        unfinished.send(native.frame(native.HEADERS, 0, 1, b"\x83"))
        assert unfinished.goaway()[0] == native.PROTOCOL_ERROR and unfinished.closed()
        unfinished.close()
        silent = Raw(served.port, preface=False)
        raw = Raw(served.port)
        raw.send(raw.headers(1), raw.data(1, b"part", end=False, declared=10))
        status, text, _ = raw.result(1)
        assert status == DEADLINE_EXCEEDED and "did not arrive within 0.5 s" in text
        assert silent.closed()
        silent.close()
        raw.send(raw.headers(3), raw.data(3, b"on time"))
        assert raw.result(3) == (OK, "", [b"on time"])
        raw.close()
    finally:
        served.close()


def test_stop_lets_calls_in_flight_finish_and_refuses_new_ones(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        call = ch.unary_unary("/t.S/Slow").future(b"", timeout=60)
        assert served.methods.started.wait(15)
        stopping = asyncio.run_coroutine_threadsafe(served.listener.stop(), served.loop)
        assert wait_until(lambda: all(c.goaway_sent for c in list(served.listener.connections)), 10)
        served.loop.call_soon_threadsafe(served.methods.release.set)
        assert call.result(30) == b"released"
        stopping.result(30)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", served.port), timeout=5)
