"""The infer route's fast path on the native server (``Gateway.infer_now``): what takes it, what it leaves to the
handler, and that both answer byte for byte alike; the connection's handling of an answer that comes later."""

import asyncio
import contextlib
import gc
import json
import socket
import struct

import numpy as np
import pytest
from aiohttp import web

from gepool import Pool
from gepool.http import kserve, native, rsgi, server
from tests import repo as test_repo
from tests.conftest import cyclic_garbage, free_port

TINY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                               "data": [float(i) for i in range(16)]}]}).encode()


def _post(path: str, body: bytes, headers: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n" % (path.encode(), headers, len(body)) + body


async def _responses(reader: asyncio.StreamReader, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` answers as (head without its Date line, body)."""
    out = []
    for _ in range(count):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
        length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
        out.append((b"\r\n".join(lines), await asyncio.wait_for(reader.readexactly(length), 60)))
    return out


# -- the gateway on a real pool ---------------------------------------------------------------------------

ECHO_PY = """
class Model:
    def execute(self, inputs):
        return {"OUT": inputs["IN"]}
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("fast-models"))
    test_repo.make_models.make_tiny(repo)
    test_repo.write(f"{repo}/echo/1/model.py", ECHO_PY)
    test_repo.write(f"{repo}/echo/config.pbtxt", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
        parameters { key: "slot_bytes" value: { string_value: "1M" } }
    """)
    with Pool(repo, http_port=0, metrics_port=0) as pool:
        yield pool


@contextlib.asynccontextmanager
async def _gateway(pool: Pool):
    """This process's own gateway on ``pool`` (its client a real one, over a lane), served by the native
    server, and the fast path's verdicts: True where it took a request, False where the handler did."""
    gw = server.Gateway(pool.endpoint)
    await gw.connect()
    taken: list[bool] = []

    def infer_now(request, done) -> bool:
        taken.append(gw.infer_now(request, done))
        return taken[-1]

    router = rsgi.Router()
    server.add_routes(gw, router)
    listener = native.Listener(router, "127.0.0.1", free_port(), 30.0, 1 << 20)
    listener.fast[gw.infer] = infer_now
    await listener.start()
    for _ in range(500):  # the client's lane: until it is open, the fast path leaves requests to the handler
        if gw.client._lane is not None:
            break
        await gw.client.status()
        await asyncio.sleep(0.01)
    try:
        yield listener, taken
    finally:
        await listener.stop()
        await gw.client.close()


BINARY_OUT = json.dumps({"inputs": [{"name": "INPUT0", "shape": [2, 16], "datatype": "FP32",
                                     "data": [[float(i) for i in range(16)], [0.5] * 16]}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
CASES = {
    "json": ("/v2/models/tiny/infer", TINY),
    "versioned": ("/v2/models/tiny/versions/1/infer", TINY),
    "binary output": ("/v2/models/tiny/infer", BINARY_OUT),
    "unknown model": ("/v2/models/nope/infer", TINY),
    "wrong input name": ("/v2/models/tiny/infer", TINY.replace(b"INPUT0", b"INPUTX")),
    "wrong shape": ("/v2/models/tiny/infer", TINY.replace(b"[1, 16]", b"[2, 8]")),
    "unknown version": ("/v2/models/tiny/versions/9/infer", TINY),
    # what did not parse, or has no inputs: answered by a task after the model is looked up, never parsed again
    "not json": ("/v2/models/tiny/infer", b"{not json"),
    "not json, unknown model": ("/v2/models/nope/infer", b"{not json"),
    "no inputs": ("/v2/models/tiny/infer", b'{"inputs": []}'),
    "bad priority": ("/v2/models/tiny/infer", TINY[:-1] + b', "parameters": {"priority": -1}}'),
    # longer than one lane record once encoded (80 KB of float32 from a 40 KB body): sent by a task
    "past a lane record": ("/v2/models/echo/infer", json.dumps({"inputs": [
        {"name": "IN", "shape": [20000], "datatype": "FP32", "data": [0] * 20000}]}).encode()),
    # left to the handler before parsing
    "header length past the body": ("/v2/models/tiny/infer", TINY, b"Inference-Header-Content-Length: 99999\r\n"),
    "shared memory": ("/v2/models/tiny/infer", json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
         "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64}}]}).encode()),
    "bad version": ("/v2/models/tiny/versions/x1/infer", TINY),
    "compressed": ("/v2/models/tiny/infer", TINY, b"Content-Encoding: identity\r\n"),
}
TAKEN = {"header length past the body": False, "shared memory": False, "bad version": False, "compressed": False}


def test_the_fast_path_answers_byte_for_byte_as_the_handler(pool, monkeypatch):
    """Each request twice on one connection, with the fast path on and off: the same bytes but for the Date,
    each body parsed once; what the fast path leaves to the handler, it leaves before parsing."""
    parsed: list[bytes] = []
    parse = kserve.parse_request

    def counted(body, *args, **kwargs):
        parsed.append(body)
        return parse(body, *args, **kwargs)

    monkeypatch.setattr(kserve, "parse_request", counted)

    async def main() -> None:
        async with _gateway(pool) as (listener, taken):
            fast = listener.fast
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            for name, (path, body, *headers) in CASES.items():
                answers = []
                taken.clear()
                for listener.fast in (fast, {}):
                    parsed.clear()
                    writer.write(_post(path, body, *headers))
                    answers += await _responses(reader, 1)
                    assert len(parsed) <= 1, (name, len(parsed))
                assert taken == [TAKEN.get(name, True)], (name, taken)
                assert answers[0] == answers[1], (name, answers)
                status = int(answers[0][0].split()[1])
                ok = name in ("json", "versioned", "binary output", "past a lane record", "compressed")
                assert status == 200 if ok else 400 <= status < 500, (name, answers[0])
            writer.close()

    asyncio.run(main())


def test_a_body_that_does_not_parse_is_not_kept_in_a_cycle(pool):
    """The sidecar's collector runs seldom (gc_policy): a request's path must leave no cycle holding its body,
    on the fast path and through the handler, for a body that did not parse (its error is raised again after
    the model lookup, with a traceback over the frames that held the body)."""
    pad = "x" * (40 << 10)
    bad = json.dumps({"inputs": 5, "pad": pad}).encode()

    async def main() -> None:
        async with _gateway(pool) as (listener, taken):
            fast = listener.fast
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            for listener.fast in (fast, {}):
                writer.write(_post("/v2/models/tiny/infer", bad))
                ((head, _),) = await _responses(reader, 1)
                assert head.startswith(b"HTTP/1.1 400"), head
            writer.close()
            assert taken == [True]

    held = [r for o in cyclic_garbage(lambda: asyncio.run(main())) for r in gc.get_referents(o)  # the body, its
            if (isinstance(r, bytes | bytearray) and pad.encode() in r) or (isinstance(r, str) and pad in r)]  # text
    assert not held, [type(r).__name__ for r in held]


def test_many_connections_on_the_fast_path_each_get_their_own_answer(pool):
    """64 connections, 10 requests each, all in flight at once: every answer is 2x + 1 of its own rows."""

    async def one(port: int, i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for j in range(10):
            x = np.random.default_rng(i * 100 + j).standard_normal(16).astype(np.float32)
            writer.write(_post("/v2/models/tiny/infer", json.dumps({"inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": x.tolist()}]}).encode()))
            ((head, body),) = await _responses(reader, 1)
            assert head.startswith(b"HTTP/1.1 200"), body
            got = np.array(json.loads(body)["outputs"][0]["data"], np.float32)
            assert got.tobytes() == (x * np.float32(2) + np.float32(1)).tobytes(), (i, j)
        writer.close()

    async def main() -> None:
        async with _gateway(pool) as (listener, taken):
            await asyncio.gather(*(one(listener.port, i) for i in range(64)))
            assert taken.count(True) == 640

    asyncio.run(main())


# -- the connection's side, with a fast path standing in for the gateway's ----------------------------------

class Later:
    """A fast path that answers each request it takes when the test says, or declines, or fails."""

    def __init__(self) -> None:
        self.mode = "take"
        self.waiting: list[tuple[object, object]] = []
        self.handled = 0

    def now(self, request, done) -> bool:
        if self.mode == "raise":
            raise RuntimeError("a bug in a fast path")
        if self.mode == "decline":
            return False
        self.waiting.append((request, done))
        if self.mode in ("at once", "answer and decline"):  # answered before it returns, inside the parser's callback
            self.answer(b'{"at once": true}')
        return self.mode != "answer and decline"

    def answer(self, body: bytes = b'{"fast": true}', close: bool = False) -> None:
        request, done = self.waiting.pop(0)
        response = rsgi.Reply(200, {"Content-Type": "application/json"}, body)
        if close:
            response = web.Response(body=body, content_type="application/json")
            response.force_close()
        done(request, response)

    async def handler(self, request) -> web.Response:
        self.handled += 1
        body = await request.read_body(1 << 20, 30)
        return web.Response(body=b'{"handled": %d}' % len(body), content_type="application/json")


@contextlib.asynccontextmanager
async def _listener():
    later = Later()
    router = rsgi.Router()
    router.add_post("/x", later.handler)
    listener = native.Listener(router, "127.0.0.1", free_port(), 30.0, 1 << 20)
    listener.fast[later.handler] = later.now
    await listener.start()
    try:
        yield listener, later
    finally:
        await listener.stop()


async def _until(predicate) -> None:
    for _ in range(3000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached in 30 s")


def test_a_body_that_comes_with_its_head_takes_the_fast_path_and_one_in_pieces_the_handler():
    async def main() -> None:
        async with _listener() as (listener, later):
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(_post("/x", b"{}"))
            await _until(lambda: later.waiting)
            later.answer()
            ((head, body),) = await _responses(reader, 1)
            assert head.startswith(b"HTTP/1.1 200") and body == b'{"fast": true}'
            request = _post("/x", b"0123456789")
            writer.write(request[:-4])
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(request[-4:])
            ((head, body),) = await _responses(reader, 1)
            assert body == b'{"handled": 10}' and later.handled == 1 and not later.waiting
            writer.close()

    asyncio.run(main())


def test_a_fast_path_that_declines_or_fails_leaves_the_request_to_the_handler(caplog):
    async def main() -> None:
        async with _listener() as (listener, later):
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            for mode in ("decline", "raise"):
                later.mode = mode
                writer.write(_post("/x", b"abc"))
                ((head, body),) = await _responses(reader, 1)
                assert head.startswith(b"HTTP/1.1 200") and body == b'{"handled": 3}', (mode, head, body)
            assert later.handled == 2
            writer.close()

    asyncio.run(main())
    assert "a bug in a fast path" in caplog.text


def test_a_fast_path_answering_before_it_returns_is_written_after_the_parser_is_done():
    async def main() -> None:
        async with _listener() as (listener, later):
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            # "answer and decline" is a broken fast path: its answer stands, and the handler never runs
            for later.mode in ("at once", "answer and decline"):
                writer.write(_post("/x", b"1") + _post("/x", b"22"))
                answers = await _responses(reader, 2)
                assert [body for _, body in answers] == [b'{"at once": true}', b'{"handled": 2}']  # (pipelined: a task)
            assert later.handled == 2
            writer.close()

    asyncio.run(main())


def test_requests_pipelined_behind_a_fast_one_are_answered_after_it_in_order():
    async def main() -> None:
        async with _listener() as (listener, later):
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(_post("/x", b"1") + _post("/x", b"22") + _post("/x", b"333"))
            await _until(lambda: later.waiting)
            await asyncio.sleep(0.1)  # the two behind it wait for its answer
            assert later.handled == 0
            later.answer(b'{"first": 1}')
            answers = await _responses(reader, 3)
            assert [body for _, body in answers] == [b'{"first": 1}', b'{"handled": 2}', b'{"handled": 3}']
            writer.close()

    asyncio.run(main())


def test_a_fast_answer_its_client_does_not_read_holds_the_next_request_until_it_is_read():
    big = b'{"x": "' + b"y" * (8 << 20) + b'"}'

    async def main() -> None:
        async with _listener() as (listener, later):
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)  # reads 128 KiB, then stops
            writer.write(_post("/x", b"1") + _post("/x", b"22"))
            await _until(lambda: later.waiting)
            later.answer(big)  # more than the transport buffers: writing pauses until the client reads
            (conn,) = listener.connections
            assert conn.writable is not None and not conn.writable.done()
            await asyncio.sleep(0.2)
            assert later.handled == 0  # the one behind it waits for the answer to be read
            answers = await _responses(reader, 2)
            assert [body for _, body in answers] == [big, b'{"handled": 2}']
            writer.close()

    asyncio.run(main())


def test_an_answer_after_its_client_left_is_dropped_and_one_with_close_closes():
    async def main() -> None:
        async with _listener() as (listener, later):
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(_post("/x", b"{}"))
            await _until(lambda: later.waiting)
            # a reset: the connection is lost (a client that only half-closes is still answered)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            await _until(lambda: not listener.connections)
            later.answer()  # nothing to write to, nothing raised
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(_post("/x", b"{}") + _post("/x", b"never"))
            await _until(lambda: later.waiting)
            later.answer(close=True)
            ((head, body),) = await _responses(reader, 1)
            assert b"Connection: close" in head and body == b'{"fast": true}'
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed; the one behind it never ran
            assert later.handled == 0
            writer.close()

    asyncio.run(main())


# -- the client's submit -------------------------------------------------------------------------------------

def test_submit_answers_once_as_infer_would(pool):
    """``AsyncClient.submit`` calls back once with what ``infer`` returns, or raises; without a lane it sends
    nothing and says so."""
    from gepool.aio import AsyncClient

    x = np.arange(16, dtype=np.float32).reshape(1, 16)

    async def main() -> None:
        client = await AsyncClient.connect(pool.endpoint)
        try:
            heard: list[tuple] = []
            done = lambda outputs, exc: heard.append((outputs, exc))  # noqa: E731
            expected = await client.infer("tiny", {"INPUT0": x})
            assert client.submit("tiny", {"INPUT0": x}, None, done)
            await _until(lambda: heard)
            (outputs, exc), = heard
            assert exc is None and outputs.keys() == expected.keys()
            assert outputs["OUTPUT0"].tobytes() == expected["OUTPUT0"].tobytes()
            assert outputs.model_version == expected.model_version
            heard.clear()
            with pytest.raises(Exception) as direct:
                await client.infer("nope", {"INPUT0": x})
            assert client.submit("nope", {"INPUT0": x}, None, done)
            await _until(lambda: heard)
            assert heard[0][0] is None and type(heard[0][1]) is type(direct.value)
            assert str(heard[0][1]) == str(direct.value)
            heard.clear()
            assert client.submit("tiny", {"INPUT0": x}, None, done, wait=0.0)  # its wait passes before the answer
            await _until(lambda: heard)
            await asyncio.sleep(0.2)  # the late answer is dropped: no second call
            assert len(heard) == 1 and heard[0][0] is None and heard[0][1] is not None, heard
        finally:
            await client.close()
        async with AsyncClient(pool.endpoint, lane=False) as zmq_only:
            assert zmq_only.submit("tiny", {"INPUT0": x}, None, lambda *a: None) is False

    asyncio.run(main())
