"""ModelInfer's fast path on the native gRPC server (``InferenceService.infer_now``): what takes it, what it
leaves to the handler's task, and that both answer byte for byte alike; the connection's handling of an
answer that comes later, at once, twice, or after its call was reset."""

import asyncio
import contextlib
import gc
import gzip
import logging
import os
import weakref

import grpc
import hpack
import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.grpc import grpc_service_pb2 as pb
from gepool.grpc import native, tensors
from gepool.grpc import server as grpc_server
from gepool.grpc.calls import Calls
from gepool.grpc.service import SERVICE, InferenceService
from gepool.http import server
from tests import repo as test_repo
from tests.conftest import cyclic_garbage, free_port, wait_until
from tests.test_grpc_wire import OK, UNKNOWN, Raw, Served

INFER = f"/{SERVICE}/ModelInfer"
ECHO_PY = """
class Model:
    def execute(self, inputs):
        return {"OUT": inputs["IN"]}
"""

GATE_PY = """
import os, time

class Model:
    def execute(self, inputs):
        while not os.path.exists(GATE_PATH):  # opened by the test
            time.sleep(0.005)
        return {"OUT": inputs["IN"]}
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("grpc-fast-models"))
    test_repo.make_models.make_tiny(repo)
    for name, dtype in (("echo", "FP32"), ("echo64", "INT64")):
        test_repo.write(f"{repo}/{name}/1/model.py", ECHO_PY)
        test_repo.write(f"{repo}/{name}/config.pbtxt", f"""
            backend: "python"
            max_batch_size: 0
            input [ {{ name: "IN" data_type: TYPE_{dtype} dims: [ -1 ] }} ]
            output [ {{ name: "OUT" data_type: TYPE_{dtype} dims: [ -1 ] }} ]
            parameters {{ key: "slot_bytes" value: {{ string_value: "1M" }} }}
        """)
    test_repo.write(f"{repo}/gate/1/model.py", GATE_PY.replace("GATE_PATH", repr(f"{repo}/gate-open")))
    test_repo.write(f"{repo}/gate/config.pbtxt", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """)
    with Pool(repo, metrics_port=0) as pool:
        pool.gate = f"{repo}/gate-open"
        yield pool


def _gated(rid: str = "") -> pb.ModelInferRequest:
    """A request to the model that waits for the test to open its gate."""
    r = pb.ModelInferRequest(model_name="gate", id=rid)
    r.inputs.add(name="IN", datatype="FP32", shape=[4])
    r.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    return r


def _shut(pool: Pool) -> None:
    """Shuts the gate (the tests leave it open, so that no model is left waiting)."""
    if os.path.exists(pool.gate):
        os.unlink(pool.gate)


@contextlib.asynccontextmanager
async def _gateway(pool: Pool):
    """This process's own gateway on ``pool`` (its client a real one, over a lane), its gRPC port on the native
    server, a grpc.aio channel to it, the fast path's verdicts (True where it took a call, False where it left
    it to the handler's task) and the gateway."""
    gw = server.Gateway(pool.endpoint)
    await gw.connect()
    port = free_port()
    listener = await grpc_server.start(gw, "127.0.0.1", port, "native")
    fast = listener.fast[INFER.encode()]
    taken: list[bool] = []

    def infer_now(raw: bytes, peer: str, done) -> bool:
        taken.append(fast(raw, peer, done))
        return taken[-1]

    listener.fast[INFER.encode()] = infer_now
    for _ in range(500):  # the client's lane: until it is open, the fast path leaves calls to the handler
        if gw.client._lane is not None:
            break
        await gw.client.status()
        await asyncio.sleep(0.01)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield listener, channel.unary_unary(INFER), taken, gw
    finally:
        await channel.close()
        await grpc_server.stop(listener)
        await gw.client.close()


def _request(model: str = "tiny", rows: int = 1, **fields) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model, **fields)
    if model in ("tiny", "nope"):
        r.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 16])
        r.raw_input_contents.append(np.arange(16 * rows, dtype=np.float32).tobytes())
    return r


def _tiny_typed() -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="tiny")
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend(range(16))
    return r


def _named_outputs() -> pb.ModelInferRequest:
    r = _request(rows=2, id="call-7")
    r.outputs.add(name="OUTPUT0")
    return r


def _classes() -> pb.ModelInferRequest:
    r = _request()
    r.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 3
    return r


def _priority() -> pb.ModelInferRequest:
    r = _request(id="p")
    r.parameters["priority"].int64_param = 1
    return r


def _unsupported() -> pb.ModelInferRequest:
    r = _request()
    r.parameters["colour"].string_param = "blue"
    return r


def _short_raw() -> pb.ModelInferRequest:
    r = _request()
    r.raw_input_contents[0] = bytes(60)
    return r


def _wrong_shape() -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="tiny")
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 8])
    r.raw_input_contents.append(np.arange(16, dtype=np.float32).tobytes())
    return r


def _with_output(name: str, region: str | None = None) -> pb.ModelInferRequest:
    r = _request()
    o = r.outputs.add(name=name)
    if region is not None:
        o.parameters["shared_memory_region"].string_param = region
        o.parameters["shared_memory_byte_size"].int64_param = 64
    return r


def _wrong_datatype() -> pb.ModelInferRequest:
    r = _request()
    r.inputs[0].datatype = "INT32"
    return r


def _with_parameter(key: str, **value) -> pb.ModelInferRequest:
    r = _request()
    r.parameters[key].MergeFrom(pb.InferParameter(**value))
    return r


def _echo64() -> pb.ModelInferRequest:
    # 20,000 zeros: 20 KB as varints, 160 KB as int64, past one lane record
    r = pb.ModelInferRequest(model_name="echo64")
    r.inputs.add(name="IN", datatype="INT64", shape=[20000]).contents.int64_contents.extend([0] * 20000)
    return r


def _echo_large() -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="echo")  # an 80 KB message: over what is parsed on the loop
    r.inputs.add(name="IN", datatype="FP32", shape=[20000])
    r.raw_input_contents.append(np.ones(20000, np.float32).tobytes())
    return r


def _shared_memory() -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="tiny")
    t = r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    t.parameters["shared_memory_region"].string_param = "not-registered"
    t.parameters["shared_memory_byte_size"].int64_param = 64
    return r


def _no_inputs() -> pb.ModelInferRequest:
    return pb.ModelInferRequest(model_name="tiny")


# name -> (the request's bytes, call options); every one of them is served by either path alike
CASES = {
    "raw contents": (_request(), {}),
    "typed contents": (_tiny_typed(), {}),
    "two rows, an output named, an id": (_named_outputs(), {}),
    "versioned": (_request(model_version="1"), {}),
    "a priority": (_priority(), {}),
    "classification": (_classes(), {}),
    "past a lane record": (_echo64(), {}),
    "unknown model": (_request("nope"), {}),
    "unknown version": (_request(model_version="9"), {}),
    "bad version": (_request(model_version="x1"), {}),
    "wrong shape": (_wrong_shape(), {}),
    "raw contents too short": (_short_raw(), {}),
    "an unsupported parameter": (_unsupported(), {}),
    "no inputs": (_no_inputs(), {}),
    "no model name": (pb.ModelInferRequest(), {}),
    "not protobuf": (b"\xff\xff\xff", {}),
    "shared memory, unregistered": (_shared_memory(), {}),
    "an unknown output": (_with_output("NOPE"), {}),
    "an output in shared memory, unregistered": (_with_output("OUTPUT0", region="nowhere"), {}),
    "a wrong datatype": (_wrong_datatype(), {}),
    "a sequence id": (_with_parameter("sequence_id", int64_param=1), {}),
    "the final-response flag": (_with_parameter("triton_enable_empty_final_response", bool_param=True), {}),
    "priority 2^63": (_with_parameter("priority", uint64_param=1 << 63), {}),
    # left to the handler's task: by the fast path, or before it is asked
    "over the inline size": (_echo_large(), {}),
    "compressed": (_request(), {"compression": grpc.Compression.Gzip}),
    "a deadline": (_request(), {"timeout": 60}),
}
TAKEN = {"over the inline size": [False], "compressed": [], "a deadline": []}
SERVED = {"raw contents", "typed contents", "two rows, an output named, an id", "versioned", "a priority",
          "classification", "past a lane record", "over the inline size", "compressed", "a deadline",
          "the final-response flag", "priority 2^63"}


async def _answer(call, message, options: dict):
    """A call's reply bytes, or its status and details."""
    raw = message if isinstance(message, bytes) else message.SerializeToString()
    try:
        return await call(raw, **options)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()


def _full_reads(monkeypatch) -> list[object]:
    """The requests ``tensors.parse`` reads in full, in order."""
    parsed: list[object] = []
    parse = tensors.parse

    def counted(request, *args, **kwargs):
        parsed.append(request)
        return parse(request, *args, **kwargs)

    monkeypatch.setattr(tensors, "parse", counted)
    return parsed


def test_the_fast_path_answers_byte_for_byte_as_the_handler(pool, monkeypatch):
    """Each call twice, with the fast path on and off: the same reply bytes (or the same status and details),
    each request parsed once; what the fast path leaves to the handler, it leaves before parsing."""
    parsed = _full_reads(monkeypatch)

    async def main() -> None:
        async with _gateway(pool) as (listener, call, taken, gw):
            fast = listener.fast
            for name, (message, options) in CASES.items():
                answers = []
                taken.clear()
                for listener.fast in (fast, {}):
                    parsed.clear()
                    answers.append(await _answer(call, message, options))
                    assert len(parsed) <= 1, (name, len(parsed))
                assert taken == TAKEN.get(name, [True]), (name, taken)
                assert answers[0] == answers[1], (name, answers)
                if name in SERVED:
                    assert isinstance(answers[0], bytes), (name, answers[0])
                    assert pb.ModelInferResponse.FromString(answers[0]).raw_output_contents, name
                else:
                    assert isinstance(answers[0], tuple) and answers[0][0] != grpc.StatusCode.OK, (name, answers)
                    assert answers[0][0] not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (name, answers)

    asyncio.run(main())


def _known_hits(monkeypatch) -> list[bool]:
    """Whether each request ``Calls.known`` is asked about was known by its bytes, in order."""
    known: list[bool] = []
    by_bytes = Calls.known

    def noted(self, raw, max_input):
        found = by_bytes(self, raw, max_input)
        known.append(found is not None)
        return found

    monkeypatch.setattr(Calls, "known", noted)
    return known


REPEATED = ["raw contents", "two rows, an output named, an id", "versioned", "a priority", "the final-response flag",
            "raw contents too short", "a wrong datatype", "wrong shape"]


def test_a_call_known_again_answers_byte_for_byte_as_the_handler(pool, monkeypatch):
    """The same call four times around other tensor bytes: from the third on, known by its bytes (no protobuf
    parse, its answer written around its output's bytes) and answered, byte for byte, as the handler answers
    it; what is refused (by the parse, or by the pool) is refused alike."""
    parsed = _full_reads(monkeypatch)
    known = _known_hits(monkeypatch)
    heads = []
    monkeypatch.setattr(tensors, "_answer_heads", _Noted(heads))

    async def main() -> None:
        async with _gateway(pool) as (listener, call, taken, gw):
            fast = listener.fast
            for name in REPEATED:
                message = CASES[name][0]
                refused = name not in SERVED
                for i in range(4):
                    m = pb.ModelInferRequest()
                    m.CopyFrom(message)
                    m.raw_input_contents[0] = np.random.default_rng(i).bytes(len(m.raw_input_contents[0]))
                    parsed.clear()
                    known.clear()
                    listener.fast = fast
                    got = await _answer(call, m, {})
                    # (of these, only "raw contents too short" does not parse: the rest is learnt, refused or not)
                    assert known == [i >= 2 and name != "raw contents too short"], (name, i)
                    assert len(parsed) == (0 if known[0] else 1), (name, i)
                    listener.fast = {}
                    assert got == await _answer(call, m, {}), (name, i)
                    assert isinstance(got, tuple) == refused, (name, got)
                    if not refused and m.model_name == "tiny" and not m.outputs:
                        x = np.frombuffer(m.raw_input_contents[0], np.float32)
                        out = pb.ModelInferResponse.FromString(got).raw_output_contents[0]
                        assert out == (x * np.float32(2) + np.float32(1)).tobytes(), name
            assert taken.count(True) == 4 * len(REPEATED)
        assert heads and all(head is not None for head in heads)  # answers written around their contents

    asyncio.run(main())


class _Noted(dict):
    """A book of answer heads that notes what is put in it."""

    def __init__(self, noted: list) -> None:
        super().__init__()
        self.noted = noted

    def __setitem__(self, key, value) -> None:
        self.noted.append(value)
        super().__setitem__(key, value)


def test_the_fast_path_serves_what_the_model_computes(pool, monkeypatch):
    """64 calls in flight at once on one connection, 5 each: every answer is 2x + 1 of its own rows, under its own
    id (all but the first two known by their bytes, whatever their ids)."""
    known = _known_hits(monkeypatch)

    async def one(call, i: int) -> None:
        for j in range(5):
            x = np.random.default_rng(i * 100 + j).standard_normal((1, 16)).astype(np.float32)
            r = pb.ModelInferRequest(model_name="tiny", id=f"{i}-{j}")
            r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
            r.raw_input_contents.append(x.tobytes())
            reply = pb.ModelInferResponse.FromString(await call(r.SerializeToString()))
            assert reply.id == f"{i}-{j}"
            got = np.frombuffer(reply.raw_output_contents[0], np.float32)
            assert got.tobytes() == (x * np.float32(2) + np.float32(1)).tobytes(), (i, j)

    async def main() -> None:
        async with _gateway(pool) as (listener, call, taken, gw):
            await asyncio.gather(*(one(call, i) for i in range(64)))
            assert taken.count(True) == 320
            assert known.count(True) >= 320 - 64 * 2, known.count(True)  # (learnt once the second has parsed)
            (conn,) = listener.connections
            for _ in range(1000):  # the last calls' streams end once their trailers are written
                if conn.running == 0 and not conn.streams:
                    break
                await asyncio.sleep(0.01)
            assert (conn.running, len(conn.streams)) == (0, 0)

    asyncio.run(main())


def test_calls_cancelled_or_cut_off_while_the_model_runs_hold_nothing(pool, caplog):
    """Calls the fast path sent, to a model that waits for the test: one cancelled by its client, two whose
    connection closes. The cancelled call frees its place at once (another call is served meanwhile), the lost
    connection's buffers go, and when the model answers at last, the answers are dropped without an error."""

    def gated() -> bytes:
        return _gated().SerializeToString()

    async def main() -> None:
        async with _gateway(pool) as (listener, call, taken, gw):
            cancelled = asyncio.ensure_future(call(gated()))
            while len(taken) < 1:
                await asyncio.sleep(0.01)
            (conn,) = listener.connections
            assert conn.running == 1
            cancelled.cancel()
            for _ in range(1000):
                if conn.running == 0:
                    break
                await asyncio.sleep(0.01)
            assert (conn.running, len(conn.streams)) == (0, 0)
            assert pb.ModelInferResponse.FromString(await call(_request().SerializeToString())).raw_output_contents
            # a connection of its own, by hand: two calls, then most of a 1 MiB DATA frame, then it closes
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            head = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", INFER),
                                           (":authority", "t"), ("content-type", "application/grpc")])
            message = native._PREFIX.pack(0, len(gated())) + gated()
            writer.write(native.PREFACE + native.frame(native.SETTINGS, 0, 0) + b"".join(
                native.frame(native.HEADERS, native.END_HEADERS, sid, head)
                + native.frame(native.DATA, native.END_STREAM, sid, message) for sid in (1, 3))
                + native.frame(native.HEADERS, native.END_HEADERS, 5, head)
                + native._HEADER.pack(16, 0, native.DATA, 0, 5) + bytes(900_000))
            while len(taken) < 4:
                await asyncio.sleep(0.01)
            (second,) = listener.connections - {conn}
            for _ in range(1000):
                if len(second.buf) >= 900_000:
                    break
                await asyncio.sleep(0.01)
            assert second.running == 2 and len(second.buf) >= 900_000
            writer.close()
            for _ in range(1000):
                if second.closing and second not in listener.connections:
                    break
                await asyncio.sleep(0.01)
            assert second not in listener.connections
            assert (second.running, len(second.buf), second.writes, len(second.streams)) == (0, 0, [], 0)
            open(pool.gate, "w").close()
            for _ in range(3000):  # the three answers come, and are dropped
                if not gw.client._inflight:
                    break
                await asyncio.sleep(0.01)
            assert not gw.client._inflight
            assert taken == [True, True, True, True]  # the gated three and the tiny call

    try:
        asyncio.run(main())
    finally:
        open(pool.gate, "w").close()  # (again, should the test have failed before: the model must not wait on)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


STREAM = f"/{SERVICE}/ModelStreamInfer"
STREAM_CASES = [name for name, (_, options) in CASES.items() if not options]  # (call options: not per message)
# sent from the stream's loop: all but what does not parse, what is parsed off the loop, and shared memory (a task
# of the stream's, so that it is cancelled with it)
STREAM_SENT = [name for name in STREAM_CASES
               if name not in ("not protobuf", "over the inline size") and "shared memory" not in name]


def test_a_stream_answers_byte_for_byte_as_with_a_task_each(pool, monkeypatch):
    """Every case as a message on one ModelStreamInfer call, with the stream's fast path on and off: the same
    answers, byte for byte (errors in error_message, naming the request), STREAM_SENT's from the stream's
    loop."""
    sent: list[object] = []
    send_now = InferenceService._send_now

    def counted(self, request, *args, **kwargs):
        sent.append(request)
        return send_now(self, request, *args, **kwargs)

    monkeypatch.setattr(InferenceService, "_send_now", counted)

    async def answers(channel) -> list[bytes]:
        call = channel.stream_stream(STREAM)()
        for name in STREAM_CASES:
            message = CASES[name][0]
            await call.write(message if isinstance(message, bytes) else message.SerializeToString())
        await call.done_writing()
        out = [answer async for answer in call]
        assert await call.code() == grpc.StatusCode.OK
        return out

    def counted_out(on: bool) -> None:
        assert len(sent) == (len(STREAM_SENT) if on else 0)
        sent.clear()

    got = _on_and_off(pool, monkeypatch, answers, counted_out)
    assert len(got[True]) == len(STREAM_CASES)
    by_text = {on: sorted(got[on]) for on in got}  # answered as each finishes: compared as sets
    assert by_text[True] == by_text[False]
    replies = [pb.ModelStreamInferResponse.FromString(a) for a in got[True]]
    assert sum(not r.error_message for r in replies) == len([n for n in STREAM_CASES if n in SERVED])


def _on_and_off(pool: Pool, monkeypatch, answers, after=None) -> dict[bool, list]:
    """What ``answers(channel)`` returns with the stream's fast path on, then off, on this process's gateway;
    ``after(on)`` runs after each."""

    async def main() -> dict[bool, list]:
        async with _gateway(pool) as (listener, _, taken, gw):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}")
            try:
                got = {}
                for on in (True, False):
                    monkeypatch.setattr(InferenceService, "stream_now", on)
                    got[on] = await answers(channel)
                    if after is not None:
                        after(on)
                return got
            finally:
                await channel.close()

    return asyncio.run(main())


def test_a_stream_of_requests_known_again_answers_byte_for_byte_as_with_a_task_each(pool, monkeypatch):
    """REPEATED's cases four times each on one ModelStreamInfer call, around other tensor bytes and under other ids,
    with the stream's fast path on and off: the same answers, byte for byte (errors naming their request); on, the
    later ones are known by their bytes."""
    known = _known_hits(monkeypatch)
    messages = []
    for name in REPEATED:
        for i, rid in enumerate(["", f"{name}-1", f"{name}-é", "x" * 200]):  # an id of its own each, as clients give
            m = pb.ModelInferRequest()
            m.CopyFrom(CASES[name][0])
            m.id = rid
            m.raw_input_contents[0] = np.random.default_rng(i).bytes(len(m.raw_input_contents[0]))
            messages.append(m.SerializeToString())

    async def answers(channel) -> list[bytes]:
        call = channel.stream_stream(STREAM)()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        out = [answer async for answer in call]
        assert await call.code() == grpc.StatusCode.OK
        return out

    def after(on: bool) -> None:
        # learnt on a second sight, known from the third: two of each case but the one that does not parse
        assert known.count(True) == (2 * (len(REPEATED) - 1) if on else 0), known
        known.clear()

    got = _on_and_off(pool, monkeypatch, answers, after)
    assert len(got[True]) == len(messages)
    assert sorted(got[True]) == sorted(got[False])
    replies = [pb.ModelStreamInferResponse.FromString(a) for a in got[True]]
    assert sum(not r.error_message for r in replies) == 4 * len(set(REPEATED) & SERVED)
    sent = [pb.ModelInferRequest.FromString(m) for m in messages]
    assert sorted(r.infer_response.id for r in replies) == sorted(m.id for m in sent)  # errors named too


def test_an_internal_failure_in_a_stream_is_that_requests_answer_on_either_path(pool, monkeypatch, caplog):
    """A request whose handling fails inside the gateway (an internal error, not a bad request) is answered in
    its error_message, named, and the stream goes on: alike with the stream's fast path and without."""
    parse = tensors.parse

    def failing(request, *args, **kwargs):
        if request.id == "boom":
            raise RuntimeError("a bug")
        return parse(request, *args, **kwargs)

    monkeypatch.setattr(tensors, "parse", failing)

    async def answers(channel) -> list[tuple[str, str]]:
        call = channel.stream_stream(STREAM)()
        for rid in ("boom", "fine"):
            await call.write(_request(id=rid).SerializeToString())
        await call.done_writing()
        out = sorted((r.infer_response.id, r.error_message)
                     for r in [pb.ModelStreamInferResponse.FromString(a) async for a in call])
        assert await call.code() == grpc.StatusCode.OK
        return out

    got = _on_and_off(pool, monkeypatch, answers)
    assert got[True] == got[False] == [("boom", errors.INTERNAL_MESSAGE), ("fine", "")]
    assert sum("a bug" in r.getMessage() or (r.exc_info and "a bug" in str(r.exc_info[1])) for r in caplog.records) == 2


def test_a_stream_waits_for_its_answers_and_lets_large_ones_wait_for_the_client(pool, monkeypatch):
    """A stream whose requests are all sent before a model answers any, then half-closed: every answer comes
    before the call's status. Answers larger than the client reads at once queue past what write_now takes
    (it declines, and a task writes them in turn), and all come, each to its own request."""
    declined: list[bool] = []
    write_now = native.Context.write_now

    def counted(self, reply) -> bool:
        declined.append(not write_now(self, reply))
        return not declined[-1]

    monkeypatch.setattr(native.Context, "write_now", counted)
    xs = {str(i): np.full(16000, i, np.float32) for i in range(40)}  # 64 KB answers, 2.5 MB in all
    _shut(pool)

    async def main() -> None:
        async with _gateway(pool) as (listener, _, taken, gw):
            # by hand, so that the client's window stays shut until the test opens it
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            head = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", STREAM),
                                           (":authority", "t"), ("content-type", "application/grpc")])
            frames = [native.PREFACE, native.frame(native.SETTINGS, 0, 0),
                      native.frame(native.HEADERS, native.END_HEADERS, 1, head)]
            for rid, x in xs.items():
                r = pb.ModelInferRequest(model_name="gate", id=rid)
                r.inputs.add(name="IN", datatype="FP32", shape=[x.size])
                r.raw_input_contents.append(x.tobytes())
                message = r.SerializeToString()
                frames.append(native.frame(native.DATA, 0, 1, native._PREFIX.pack(0, len(message)) + message))
            writer.write(b"".join(frames) + native.frame(native.DATA, native.END_STREAM, 1))
            open(pool.gate, "w").close()
            for _ in range(3000):
                if any(declined):
                    break
                await asyncio.sleep(0.01)
            assert any(declined)
            writer.write(native.frame(native.WINDOW_UPDATE, 0, 0, native._U32.pack(64 << 20))
                         + native.frame(native.WINDOW_UPDATE, 0, 1, native._U32.pack(64 << 20)))
            data, status, decoder = b"", None, hpack.Decoder()
            while status is None:
                length, kind = await reader.readexactly(9), None
                n, kind, sid = int.from_bytes(length[:3], "big"), length[3], int.from_bytes(length[5:], "big")
                payload = await asyncio.wait_for(reader.readexactly(n), 60)
                if kind == native.DATA and sid == 1:
                    data += payload
                elif kind == native.HEADERS:
                    status = dict(decoder.decode(payload)).get("grpc-status")
                assert kind != native.RST_STREAM and kind != native.GOAWAY, payload
            writer.close()
            assert status == "0"
            pos = 0
            while pos < len(data):
                size = int.from_bytes(data[pos + 1:pos + 5], "big")
                reply = pb.ModelStreamInferResponse.FromString(data[pos + 5:pos + 5 + size])
                pos += 5 + size
                assert not reply.error_message, reply.error_message
                got[reply.infer_response.id] = np.frombuffer(reply.infer_response.raw_output_contents[0], np.float32)

    got: dict[str, np.ndarray] = {}
    try:
        asyncio.run(main())
    finally:
        open(pool.gate, "w").close()  # (again, should the test have failed before: the model must not wait on)
    assert set(got) == set(xs)
    for rid, x in xs.items():
        assert got[rid].tobytes() == x.tobytes(), rid


def test_a_half_closed_stream_ends_only_once_its_requests_are_answered(pool):
    """The client half-closes a stream while the model still holds its request: the answer comes, then the
    call's status."""
    _shut(pool)
    r = _gated("held")

    async def main() -> list:
        async with _gateway(pool) as (listener, _, taken, gw):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}")
            try:
                call = channel.stream_stream(STREAM)()
                await call.write(r.SerializeToString())
                await call.done_writing()
                for _ in range(3000):  # the request is with the front, and the stream's end has been read
                    (conn,) = listener.connections
                    if gw.client._inflight and all(s.remote_ended for s in conn.streams.values()):
                        break
                    await asyncio.sleep(0.01)
                assert gw.client._inflight and conn.streams
                open(pool.gate, "w").close()
                out = [pb.ModelStreamInferResponse.FromString(a).infer_response.id async for a in call]
                assert await call.code() == grpc.StatusCode.OK
                return out
            finally:
                await channel.close()

    try:
        assert asyncio.run(main()) == ["held"]
    finally:
        open(pool.gate, "w").close()


def test_a_stream_cancelled_while_its_requests_are_with_the_model_holds_nothing(pool, caplog):
    """The client cancels a stream whose requests the model holds: the call ends at once, and the answers,
    when they come, are dropped without an error."""
    _shut(pool)
    r = _gated()

    async def main() -> None:
        async with _gateway(pool) as (listener, _, taken, gw):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}")
            try:
                call = channel.stream_stream(STREAM)()
                for _ in range(3):
                    await call.write(r.SerializeToString())
                for _ in range(3000):
                    if len(gw.client._inflight) == 3:
                        break
                    await asyncio.sleep(0.01)
                assert len(gw.client._inflight) == 3
                (conn,) = listener.connections
                call.cancel()
                for _ in range(3000):
                    if not conn.streams and conn.running == 0:
                        break
                    await asyncio.sleep(0.01)
                assert (len(conn.streams), conn.running) == (0, 0)
                # what waits for the front's answers keeps neither the requests nor the stream's unread messages
                held = [o for _, answer, _, _ in gw.client._inflight.values() for o in _closed_over(answer._done)]
                assert not [o for o in held if isinstance(o, pb.ModelInferRequest)], held
                open(pool.gate, "w").close()
                for _ in range(3000):
                    if not gw.client._inflight:
                        break
                    await asyncio.sleep(0.01)
                assert not gw.client._inflight
                answer = await channel.unary_unary(INFER)(_request().SerializeToString())
                assert pb.ModelInferResponse.FromString(answer).raw_output_contents
            finally:
                await channel.close()

    try:
        asyncio.run(main())
    finally:
        open(pool.gate, "w").close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _closed_over(fn, depth: int = 6) -> list:
    """The objects a callback reaches through its closures and default arguments, and theirs in turn."""
    out, todo = [], [(fn, depth)]
    while todo:
        f, d = todo.pop()
        values = list(getattr(f, "__defaults__", None) or ())
        for cell in getattr(f, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        out += values
        todo += [(getattr(v, "__func__", v), d - 1) for v in values if d and callable(v)]
    return out


def test_a_request_that_does_not_parse_is_not_kept_in_a_cycle(pool):
    """The sidecar's collector runs seldom: a call that did not parse (its error raised again after the model
    lookup, with a traceback over the frames that held the request) must leave no cycle holding it."""
    pad = "x" * (40 << 10)
    r = _request()
    r.parameters["colour"].string_param = pad

    async def main() -> None:
        async with _gateway(pool) as (listener, call, taken, gw):
            fast = listener.fast
            for listener.fast in (fast, {}):
                code, _ = await _answer(call, r, {})
                assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert taken == [True]

    held = [o for o in cyclic_garbage(lambda: asyncio.run(main())) for o in (o, *gc.get_referents(o))
            if (isinstance(o, bytes | bytearray) and pad.encode() in o) or (isinstance(o, str) and pad in o)
            or isinstance(o, pb.ModelInferRequest)]
    assert not held, [type(o).__name__ for o in held]


# -- the connection's side, with stand-in fast paths on test_grpc_wire's listener -------------------------------

@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def _fast(served, path: str, now) -> None:
    async def put() -> None:
        served.listener.fast[path.encode()] = now
    served.call(put())


def _holding(served) -> list:
    """A fast path on /t.S/Echo that takes every call and holds its ``done``, in the list returned."""
    held: list = []

    def now(raw: bytes, peer: str, done) -> bool:
        held.append(done)
        return True

    _fast(served, "/t.S/Echo", now)
    return held


def _running(served) -> list[int]:
    return [r for (r,) in served.connections("running")]


def test_an_answer_given_at_once_twice_or_as_an_abort(served):
    """``done`` called inside the fast path answers the call; a second ``done`` is ignored; an Abort is the
    call's status; a fast path that raises is answered as a handler that raises; one that declines leaves
    the call to its handler's task."""
    verdicts = {b"now": True, b"twice": True, b"abort": True, b"raise": True, b"decline": False}

    def now(raw: bytes, peer: str, done) -> bool:
        if raw == b"raise":
            raise RuntimeError("a secret path /etc/shadow")
        if raw == b"abort":
            done(None, native.Abort(grpc.StatusCode.FAILED_PRECONDITION, "not now"))
        elif raw != b"decline":
            done(raw.upper(), None)
            if raw == b"twice":
                done(b"again", None)
        return verdicts[raw]

    _fast(served, "/t.S/Echo", now)
    raw = Raw(served.port)
    expected = {b"now": (OK, "", [b"NOW"]), b"twice": (OK, "", [b"TWICE"]), b"abort": (9, "not now", []),
                b"raise": (UNKNOWN, "Unexpected error in the gRPC handler", []),
                b"decline": (OK, "", [b"decline"])}  # the handler echoes
    for i, (message, want) in enumerate(expected.items()):
        sid = 2 * i + 1
        raw.send(raw.headers(sid), raw.data(sid, message))
        assert raw.result(sid) == want, message
    assert wait_until(lambda: _running(served) == [0], 10)
    assert served.echo_works()


def test_an_answer_after_its_call_was_reset_is_dropped(served):
    """A call reset by its client while the fast path holds it: the later answer writes nothing, the call
    stops counting as running, and the connection goes on serving."""
    held = _holding(served)
    raw = Raw(served.port)
    raw.send(raw.headers(1), raw.data(1, b"first"), raw.headers(3), raw.data(3, b"second"))
    assert wait_until(lambda: len(held) == 2, 10)
    assert _running(served) == [2]
    raw.send(native.frame(native.RST_STREAM, 0, 1, native._U32.pack(native.CANCEL)))
    assert wait_until(lambda: served.connections("streams")[0][0].keys() == {3}, 10)
    assert _running(served) == [1]  # as a reset call's task is cancelled: it holds no place among MAX_STREAMS
    served.loop.call_soon_threadsafe(held[0], b"late", None)
    served.loop.call_soon_threadsafe(held[1], b"on time", None)
    assert raw.result(3) == (OK, "", [b"on time"])
    assert wait_until(lambda: _running(served) == [0], 10)
    raw.send(raw.headers(5), raw.data(5, b"third"))
    assert wait_until(lambda: len(held) == 3, 10)
    served.loop.call_soon_threadsafe(held[2], b"3", None)
    assert raw.result(5) == (OK, "", [b"3"])


def test_reset_calls_the_fast_path_still_holds_do_not_refuse_new_ones(served):
    """A client that resets as many calls as a connection may hold, while the fast path holds them all, may
    open as many again: each new call is served, none refused (REFUSED_STREAM)."""
    held: list = []

    def now(raw: bytes, peer: str, done) -> bool:
        if raw == b"hold":
            held.append(done)
        else:
            done(raw, None)
        return True

    _fast(served, "/t.S/Echo", now)
    raw = Raw(served.port)
    sids = range(1, 2 * native.MAX_STREAMS, 2)
    raw.send(*(f for sid in sids for f in (raw.headers(sid), raw.data(sid, b"hold"))))
    assert wait_until(lambda: len(held) == native.MAX_STREAMS, 10)
    raw.send(*(native.frame(native.RST_STREAM, 0, sid, native._U32.pack(native.CANCEL)) for sid in sids))
    assert wait_until(lambda: _running(served) == [0], 10)
    base = 2 * native.MAX_STREAMS + 1
    raw.send(*(f for i in range(native.MAX_STREAMS) for f in (raw.headers(base + 2 * i), raw.data(base + 2 * i, b"x"))))
    for i in range(native.MAX_STREAMS):
        assert raw.result(base + 2 * i) == (OK, "", [b"x"]), i
    for done in held:  # the front's answers, at last: dropped
        served.loop.call_soon_threadsafe(done, b"late", None)
    raw.send(raw.headers(base + 2 * native.MAX_STREAMS), raw.data(base + 2 * native.MAX_STREAMS, b"y"))
    assert raw.result(base + 2 * native.MAX_STREAMS) == (OK, "", [b"y"])


def test_a_lost_connection_keeps_nothing_big_while_its_answers_are_awaited(served):
    """The connection's buffers go when it is lost, although the callbacks of the calls the fast path holds
    reach it until the answers come; once they came, nothing holds it."""
    held = _holding(served)
    raw = Raw(served.port)
    raw.send(raw.headers(1), raw.data(1, b"held"), raw.headers(3))
    assert wait_until(lambda: len(held) == 1, 10)

    async def conn():
        (c,) = served.listener.connections
        return weakref.ref(c)

    ref = served.call(conn())
    # a DATA frame of 1 MiB, 900 KB of it sent: the connection buffers it whole before reading it
    raw.send(native._HEADER.pack(16, 0, native.DATA, 0, 3) + bytes(900_000))
    assert wait_until(lambda: len(ref().buf) >= 900_000, 10)
    raw.sock.close()
    assert wait_until(lambda: not served.listener.connections, 10)
    assert (len(ref().buf), ref().writes, ref().running) == (0, [], 0)
    served.loop.call_soon_threadsafe(held.pop(), b"late", None)
    served.call(asyncio.sleep(0))
    gc.collect()
    assert ref() is None


def test_a_reply_that_cannot_be_serialised_is_unknown_and_kept_in_no_cycle(served):
    """A reply whose serialiser raises: the call ends UNKNOWN, as a handler's does, and nothing keeps the reply."""

    class Unsendable:
        def __init__(self) -> None:
            self.payload = b"p" * (1 << 20)

        def __bytes__(self) -> bytes:
            raise ValueError("cannot")

    def now(raw: bytes, peer: str, done) -> bool:
        done(Unsendable(), None)
        return True

    _fast(served, "/t.S/Echo", now)

    def call() -> None:
        raw = Raw(served.port)
        raw.send(raw.headers(1), raw.data(1, b"x"))
        assert raw.result(1) == (UNKNOWN, "Unexpected error in the gRPC handler", [])
        raw.sock.close()

    logging.disable(logging.ERROR)  # else the captured log record keeps the error, and with it the reply
    try:
        kept = [o for o in cyclic_garbage(call) if isinstance(o, Unsendable)]
    finally:
        logging.disable(logging.NOTSET)
    assert not kept


def test_a_fast_answer_larger_than_the_clients_window_goes_out_under_flow_control(served):
    """An answer over the connection's window and the client's frame size is sent, in frames, as the client
    opens its window, and its trailers after it."""
    def now(raw: bytes, peer: str, done) -> bool:
        served.loop.call_soon(done, bytes(200_000), None)
        return True

    _fast(served, "/t.S/Echo", now)
    raw = Raw(served.port)
    raw.send(raw.headers(1), raw.data(1, b"x"))
    body, status = b"", None
    while status is None:
        f = raw.frame()
        assert f is not None, "the connection closed before the call ended"
        kind, _, sid, payload = f
        if kind == native.DATA:
            body += payload
            if len(body) == 65535:  # the connection's window, spent: opened for the rest
                raw.send(native.frame(native.WINDOW_UPDATE, 0, 0, native._U32.pack(1 << 20)),
                         native.frame(native.WINDOW_UPDATE, 0, 1, native._U32.pack(1 << 20)))
        elif kind == native.HEADERS:
            status = dict(raw.dec.decode(payload)).get("grpc-status")
        assert kind != native.RST_STREAM, payload
    assert (status, len(body), body[5:]) == ("0", 200_005, bytes(200_000))
    assert wait_until(lambda: _running(served) == [0], 10)


def test_a_compressed_request_is_not_offered_to_the_fast_path(served):
    offered: list[bytes] = []

    def now(raw: bytes, peer: str, done) -> bool:
        offered.append(raw)
        return False

    _fast(served, "/t.S/Echo", now)
    raw = Raw(served.port)
    raw.send(raw.headers(1, extra=(("grpc-encoding", "gzip"),)), raw.data(1, gzip.compress(b"zipped"), compressed=1))
    assert raw.result(1) == (OK, "", [b"zipped"])
    raw.send(raw.headers(3), raw.data(3, b"plain"))
    assert raw.result(3) == (OK, "", [b"plain"])
    assert offered == [b"plain"]


def test_a_failure_reading_a_call_by_its_bytes_leaves_it_to_the_full_reading(pool, monkeypatch, caplog):
    """A bug in ``Calls.known`` (here: it raises) costs the unary call nothing but the full reading, as it
    costs a stream's request: the same answer as with the fast path off, and the failure logged."""

    def broken(self, raw, max_input):
        raise RuntimeError("known broke")

    monkeypatch.setattr(Calls, "known", broken)

    async def main() -> None:
        async with _gateway(pool) as (listener, call, taken, gw):
            fast = listener.fast
            m = CASES["raw contents"][0]
            for _ in range(3):  # (a third time: the request would be known by its bytes)
                listener.fast = fast
                got = await _answer(call, m, {})
                listener.fast = {}
                assert got == await _answer(call, m, {})
                x = np.frombuffer(m.raw_input_contents[0], np.float32)
                assert pb.ModelInferResponse.FromString(got).raw_output_contents[0] == \
                    (x * np.float32(2) + np.float32(1)).tobytes()
            assert taken == [True] * 3

    with caplog.at_level(logging.ERROR, logger="gepool"):
        asyncio.run(main())
    assert sum("reading a ModelInfer request by its bytes" in r.getMessage() for r in caplog.records) == 3
