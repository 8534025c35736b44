"""What the gateway knows again instead of reading again: a connection's last head (``native.Head``), a body's
shape less its data (``templates.Templates``), an answer's text less its data (``kserve._one_json``). Each must
give exactly what the full reading or writing gives, and step aside for anything else."""

import asyncio
import dataclasses
import json

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gepool.common.errors import InvalidArgument
from gepool.grpc import tensors
from gepool.http import kserve, templates
from gepool.http.jsonfast import FAST_MIN_BYTES
from gepool.http.limits import BodyLimit
from tests.test_gateway_fast import NUMERIC, random_tensor
from tests.test_infer_now import _listener, _post, _responses, _until

MAX_JSON, MAX_INPUT = 1 << 20, 1 << 20


def tiny_body(data, *, shape=(1, 16), datatype="FP32", extra: str = "", name: str = "INPUT0") -> bytes:
    head = f'{{"inputs": [{{"name": "{name}", "shape": {json.dumps(list(shape))}, "datatype": "{datatype}", "data": '
    return (head + (data if isinstance(data, str) else json.dumps(data)) + "}]" + extra + "}").encode()


BASE = tiny_body([float(i) / 7 for i in range(16)])


def outcome(parse, body: bytes):
    """What a reading gives: the request's every field, each array's dtype, shape and bytes; or the error."""
    try:
        req = parse(body)
    except InvalidArgument as exc:
        return ("refused", type(exc).__name__, exc.message)
    arrays = {k: (v.dtype.str, v.shape, v.tobytes() if v.dtype != object else list(v.ravel()))
              for k, v in req.inputs.items()}
    return ("read", arrays, req.outputs, req.binary_output, req.id, req.parameters, req.priority, req.timeout_s)


def full(body: bytes):
    return kserve.parse_request(body, None, None, MAX_JSON, MAX_INPUT)


def learnt(body: bytes = BASE) -> templates.Templates:
    """A book that has learnt ``body``'s shape (seen twice)."""
    book = templates.Templates()
    for _ in range(2):
        book.parse(body, None, MAX_JSON, MAX_INPUT)
    assert len(book._known) == 1
    return book


@pytest.fixture
def full_reads(monkeypatch):
    """The bodies the full reading was given."""
    seen: list[bytes] = []
    parse = kserve.parse_request

    def counted(body, *args, **kwargs):
        seen.append(body)
        return parse(body, *args, **kwargs)

    monkeypatch.setattr(kserve, "parse_request", counted)
    return seen


# -- request bodies: templates.Templates --------------------------------------------------------------------

DATA = {
    "floats": [0.5 * i - 3 for i in range(16)],
    "negative zero and extremes": [-0.0, 0.0, 3.4028234663852886e38, -1.17549435e-38, 5e-324, 1e-45] + [1.0] * 10,
    "past float32's range": [1e39, -1e300] + [2.0] * 14,
    "ints among floats": [1, 2.5, -0] + [0.25] * 13,
    "only ints": list(range(16)),
    "an int past a double": [10 ** 400] + [1.0] * 15,
    "a bool": [True] + [1.0] * 15,
    "a null": [None] + [1.0] * 15,
    "a string": ["1.5"] + [1.0] * 15,
    "too few": [1.0] * 15,
    "too many": [1.0] * 17,
    "none at all": [],
}
TEXTS = {
    "NaN and Infinity": "[NaN, Infinity, -Infinity" + ", 1.0" * 13 + "]",
    "not JSON": "[1.0, 2.0,, 3.0]",
    "a number with a leading zero": "[01" + ", 1.0" * 15 + "]",
    "spaces and newlines": "[ 1.0 ,\n\t2.0\r\n" + ", 3" * 14 + " ]",
}


LONG = 300  # values in a long body's list: past jsonfast.FAST_MIN_BYTES, read by simdjson in full and by shape


@pytest.mark.parametrize("width", [16, LONG])
@pytest.mark.parametrize("case", list(DATA) + list(TEXTS))
def test_a_learnt_shape_reads_each_body_as_the_full_reading_does(case, width, full_reads):
    pad = [1.0] * (width - 16)
    book = learnt(tiny_body([float(i) / 7 for i in range(width)], shape=(1, width)))
    text = TEXTS[case] if case in TEXTS else json.dumps(DATA[case])
    if pad:
        text = text[:-1] + ("," if text.strip() != "[]" else "") + json.dumps(pad)[1:]
    body = tiny_body(text, shape=(1, width))
    assert (len(body) >= FAST_MIN_BYTES) == (width == LONG)
    full_reads.clear()
    got = outcome(lambda b: book.parse(b, None, MAX_JSON, MAX_INPUT), body)
    in_full = len(full_reads)
    assert got == outcome(full, body), case
    if got[0] == "read" and case not in ("NaN and Infinity",):
        assert not in_full, f"{case}: read in full, not by its shape"


@pytest.mark.parametrize("datatype", ["FP64", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "FP16"])
def test_other_datatypes_read_as_the_full_reading_does(datatype):
    values = {"BOOL": [True, False] * 8, "BYTES": ["a", "é"] * 8}.get(datatype, [i * 3 for i in range(16)])
    base = tiny_body(values, datatype=datatype)
    book = learnt(base) if datatype != "FP16" else templates.Templates()  # (FP16 in JSON is refused)
    for other in ([v for v in reversed(values)], [1.5] * 16, [300] * 16, [-1] * 16):
        body = tiny_body(other, datatype=datatype)
        assert outcome(lambda b: book.parse(b, None, MAX_JSON, MAX_INPUT), body) == outcome(full, body), other


@pytest.mark.parametrize("extra", ['', ', "id": "a-1"', ', "outputs": [{"name": "OUTPUT0"}]',
                                   ', "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": true}}]',
                                   ', "parameters": {"priority": 2, "timeout": 5000000}'])
def test_what_surrounds_the_data_is_the_full_readings(extra, full_reads):
    body = tiny_body([1.0] * 16, extra=extra)
    book = learnt(body)
    other = tiny_body([2.0] * 16, extra=extra)
    full_reads.clear()
    got = outcome(lambda b: book.parse(b, None, MAX_JSON, MAX_INPUT), other)
    assert not full_reads
    assert got == outcome(full, other) and got[0] == "read"
    first, second = (book.parse(other, None, MAX_JSON, MAX_INPUT) for _ in range(2))
    assert first.parameters is not second.parameters  # each request its own (a handler may add to them)


NOT_LEARNT = {
    # the one "data" key is not an input's: the input comes as (empty) binary data
    "data outside the inputs": b'{"data": [1.0, 2.0], "inputs": [{"name": "INPUT0", "shape": [0, 16], '
                               b'"datatype": "FP32", "parameters": {"binary_data_size": 0}}]}',
    "two inputs": b'{"inputs": [{"name": "A", "shape": [1], "datatype": "FP32", "data": [1.0]}, '
                  b'{"name": "B", "shape": [1], "datatype": "FP32", "data": [2.0]}]}',
    # the list found is the first data key's, but an escaped one after it is the data orjson reads
    "an escaped data key after": tiny_body([1.0] * 16, extra="")[:-3] + b', "d\\u0061ta": ' + json.dumps(
        [2.0] * 16).encode() + b"}]}",
    # the first "data" in the text ends a key that is not data's ('x "data')
    "another key ending in data": tiny_body([1.0] * 16).replace(b'{"inputs"', b'{"x \\"data": [5], "inputs"', 1),
    "nested data": tiny_body([[1.0] * 8, [2.0] * 8]),
    "a repeated inputs key": b'{"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}], '
                             b'"inputs": [{"name": "Y", "shape": [0], "datatype": "FP32", '
                             b'"parameters": {"binary_data_size": 0}}]}',
    "read only by the json module": tiny_body("[NaN" + ", 1.0" * 15 + "]"),
}


@pytest.mark.parametrize("case", NOT_LEARNT)
def test_a_body_whose_reading_might_differ_is_never_learnt(case):
    book = templates.Templates()
    body = NOT_LEARNT[case]
    for _ in range(3):
        assert outcome(lambda b: book.parse(b, None, MAX_JSON, MAX_INPUT), body) == outcome(full, body)
    assert not book._known, case


def test_a_body_is_learnt_when_its_shape_comes_again_and_the_book_is_bounded():
    book = templates.Templates()
    book.parse(BASE, None, MAX_JSON, MAX_INPUT)
    assert not book._known
    book.parse(BASE, None, MAX_JSON, MAX_INPUT)
    assert len(book._known) == 1
    for i in range(templates.MAX_SEEN + 50):  # a new id every time: seen once each, never learnt
        book.parse(tiny_body([1.0] * 16, extra=f', "id": "{i}"'), None, MAX_JSON, MAX_INPUT)
        assert len(book._seen) <= templates.MAX_SEEN
    assert len(book._known) == 1
    for i in range(templates.MAX_TEMPLATES + 10):  # many shapes, each twice
        for _ in range(2):
            book.parse(tiny_body([1.0] * 16, extra=f', "id": "x{i}"'), None, MAX_JSON, MAX_INPUT)
        assert len(book._known) <= templates.MAX_TEMPLATES


def test_a_shape_learnt_under_one_limit_is_read_in_full_under_another():
    book = learnt()
    small = tiny_body([1.0] * 16)
    assert outcome(lambda b: book.parse(b, None, MAX_JSON, 32), small) == outcome(
        lambda b: kserve.parse_request(b, None, None, MAX_JSON, 32), small)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=16, max_size=16).map(json.dumps),
    st.lists(st.one_of(st.floats(allow_nan=False, width=64), st.integers(-2 ** 70, 2 ** 70)), min_size=16,
             max_size=16).map(json.dumps),
    st.lists(st.one_of(st.floats(allow_nan=False, width=64), st.integers(-2 ** 70, 2 ** 70), st.booleans(),
                       st.none(), st.text(max_size=3)), max_size=20).map(json.dumps),
    st.binary(max_size=40).map(lambda b: "[" + b.decode("latin-1").replace("[", "").replace("]", "") + "]")))
def test_any_data_reads_as_the_full_reading_does(text):
    body = tiny_body(text)
    book = _LEARNT
    assert outcome(lambda b: book.parse(b, None, MAX_JSON, MAX_INPUT), body) == outcome(full, body)


_LEARNT = templates.Templates()
for _ in range(2):
    _LEARNT.parse(BASE, None, MAX_JSON, MAX_INPUT)


# -- binary bodies: templates.Templates.parse_binary --------------------------------------------------------

def binary_body(inputs: list[tuple[str, str, list[int], bytes]], extra: str = "") -> tuple[bytes, int]:
    """A body of a JSON header naming each input's binary data, then the data; and the header's length."""
    header = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
                                    for n, d, s, b in inputs]})[:-1] + extra + "}"
    return header.encode() + b"".join(b for *_, b in inputs), len(header.encode())


def binary_outcome(book, body: bytes, hlen: int):
    return (outcome(lambda b: book.parse_binary(b, str(hlen), hlen, None, MAX_JSON, MAX_INPUT), body),
            outcome(lambda b: kserve.parse_request(b, str(hlen), None, MAX_JSON, MAX_INPUT), body))


def test_a_learnt_binary_header_reads_each_body_as_the_full_reading_does(full_reads):
    rng = np.random.default_rng(7)
    shape = ["FP32", [1, 16]], ["INT64", [1, 3]], ["BYTES", [2]]

    def body(blobs: list[bytes], extra: str = "") -> tuple[bytes, int]:
        return binary_body([(f"IN{i}", d, s, b) for i, ((d, s), b) in enumerate(zip(shape, blobs))], extra)

    def strings(*items: bytes) -> bytes:
        return b"".join(len(x).to_bytes(4, "little") + x for x in items)

    book = templates.Templates()
    first, hlen = body([rng.bytes(64), rng.bytes(24), strings(b"ab", b"cd")])
    for _ in range(2):
        book.parse_binary(first, str(hlen), hlen, None, MAX_JSON, MAX_INPUT)
    assert len(book._binary) == 1
    tail = rng.bytes(64) + rng.bytes(24) + strings(b"xy", b"zw")
    cases = {
        "other bytes": tail,
        "other strings, as long in all": tail[:88] + strings(b"", b"abcd"),
        "a string's length past its data": tail[:88] + strings(b"ab", b"c") + b"\xff",
        "a byte too few": tail[:-1],
        "a byte too many": tail + b"!",
    }
    read_by_header = lambda b: book.parse_binary(b, str(hlen), hlen, None, MAX_JSON, MAX_INPUT)  # noqa: E731
    read_in_full = lambda b: kserve.parse_request(b, str(hlen), None, MAX_JSON, MAX_INPUT)  # noqa: E731
    for case, rest in cases.items():
        data = first[:hlen] + rest
        full_reads.clear()
        fast = outcome(read_by_header, data)
        in_full = len(full_reads)
        assert fast == outcome(read_in_full, data), case
        assert in_full == (fast[0] == "refused"), case  # what reads is read by its header alone


@pytest.mark.parametrize("extra", ['', ', "id": "r"',
                                   ', "outputs": [{"name": "OUT", "parameters": {"binary_data": true}}]'])
def test_what_surrounds_binary_data_is_the_full_readings(extra, full_reads):
    data, hlen = binary_body([("IN", "FP16", [2, 2], bytes(8))], extra)
    book = templates.Templates()
    for _ in range(2):
        book.parse_binary(data, str(hlen), hlen, None, MAX_JSON, MAX_INPUT)
    other = data[:hlen] + bytes(range(8))
    full_reads.clear()
    fast, slow = binary_outcome(book, other, hlen)
    assert fast == slow and fast[0] == "read" and len(full_reads) == 1  # (binary_outcome's own full reading)


@pytest.mark.parametrize("case", ["json data beside", "shared memory", "a repeated key"])
def test_a_binary_header_whose_reading_might_differ_is_never_learnt(case):
    inputs = {
        "json data beside": b'{"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "data": [1.0]}, '
                            b'{"name": "B", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}]}',
        "shared memory": b'{"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "parameters": '
                         b'{"shared_memory_region": "r", "shared_memory_byte_size": 4}}]}',
        "a repeated key": b'{"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "parameters": '
                          b'{"binary_data_size": 8, "binary_data_size": 4}}]}',
    }[case]
    data = inputs + bytes(4)
    book = templates.Templates()
    for _ in range(3):
        fast, slow = binary_outcome(book, data, len(inputs))
        assert fast == slow
    assert bool(book._binary) == (case == "a repeated key"), case  # (orjson's reading, the full path's: the last)


# -- answers: kserve._one_json --------------------------------------------------------------------------------

def _both(model, version, req, outputs, monkeypatch):
    kserve._answer_heads.clear()
    fast = kserve.encode_response(model, version, req, outputs)
    taken = bool(kserve._answer_heads)
    with monkeypatch.context() as m:
        m.setattr(kserve, "_one_json", lambda *a: None)
        slow = kserve.encode_response(model, version, req, outputs)
    return fast, slow, taken


@pytest.mark.parametrize("datatype", NUMERIC + ["BYTES"])
@pytest.mark.parametrize("shape", [(1,), (1, 16), (3, 5), (0, 4), (300,), (2, 200)], ids=str)
def test_one_json_output_is_written_byte_for_byte_as_the_full_writer(datatype, shape, monkeypatch):
    arr = random_tensor(datatype, shape)
    for req in (kserve.InferRequest({}, None, False), kserve.InferRequest({}, [kserve.OutputRequest("OUT", False)],
                                                                         False)):
        fast, slow, taken = _both("tiny", "1", req, {"OUT": arr}, monkeypatch)
        assert fast[0] == slow[0] and dict(fast[1]) == dict(slow[1]), (datatype, shape)
        assert taken == (datatype not in ("BOOL", "FP16", "BYTES")), datatype


@pytest.mark.parametrize("datatype", NUMERIC + ["BYTES"])
@pytest.mark.parametrize("shape", [(1,), (1, 16), (3, 5), (0, 4), (2, 200)], ids=str)
def test_one_binary_output_is_written_byte_for_byte_as_the_full_writer(datatype, shape, monkeypatch):
    arr = random_tensor(datatype, shape)
    for req in (kserve.InferRequest({}, None, True), kserve.InferRequest({}, [kserve.OutputRequest("OUT", True)],
                                                                        False)):
        kserve._binary_heads.clear()
        fast = kserve.encode_response("tiny", "1", req, {"OUT": arr})
        taken = bool(kserve._binary_heads)
        with monkeypatch.context() as m:
            m.setattr(kserve, "_one_binary", lambda *a: None)
            slow = kserve.encode_response("tiny", "1", req, {"OUT": arr})
        assert fast[0] == slow[0] and fast[1] == slow[1], (datatype, shape)
        assert taken == (datatype != "BYTES"), datatype


IDS = {"none": None, "empty": "", "ascii": "req-17", "not ascii": "é-ü", "a quote": 'a"b\\c', "control": "a\nb",
       "null in it": "nullable", "a lone surrogate": "\ud800", "long": "x" * 300}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("rid", IDS)
def test_an_answer_with_an_id_is_written_byte_for_byte_as_the_full_writer(rid, binary, monkeypatch):
    """perf_analyzer sends "id": "" with every request; others an id of their own each time: the answer's text
    is kept without it, and the id written after the outputs, as the full writer writes it (one with null in it,
    or that orjson refuses, is the full writer's)."""
    arr = random_tensor("FP32", (1, 16))
    req = kserve.InferRequest({}, [kserve.OutputRequest("OUT", binary)], False, IDS[rid])
    kserve._answer_heads.clear()
    kserve._binary_heads.clear()
    fast = [kserve.encode_response("tiny", "1", req, {"OUT": arr}) for _ in range(2)]
    taken = bool(kserve._answer_heads or kserve._binary_heads)
    with monkeypatch.context() as m:
        m.setattr(kserve, "_one_json", lambda *a: None)
        m.setattr(kserve, "_one_binary", lambda *a: None)
        slow = kserve.encode_response("tiny", "1", req, {"OUT": arr})
    for answer in fast:
        assert answer[0] == slow[0] and dict(answer[1]) == dict(slow[1]), rid
    assert taken == (rid not in ("null in it", "a lone surrogate")), rid


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_answers_under_ids_that_change_each_take_their_own(binary, monkeypatch):
    """The last id's text is kept for the next answer: one under another id (or none) writes its own."""
    arr = random_tensor("FP32", (1, 16))
    for rid in ["a", "a", "bb", None, "a", "", "", "é", "bb"]:
        req = kserve.InferRequest({}, [kserve.OutputRequest("OUT", binary)], False, rid)
        fast = kserve.encode_response("tiny", "1", req, {"OUT": arr})
        with monkeypatch.context() as m:
            m.setattr(kserve, "_one_json", lambda *a: None)
            m.setattr(kserve, "_one_binary", lambda *a: None)
            slow = kserve.encode_response("tiny", "1", req, {"OUT": arr})
        assert fast[0] == slow[0] and dict(fast[1]) == dict(slow[1]), rid


def test_shared_headers_cannot_be_changed():
    with pytest.raises(TypeError):
        kserve.JSON_HEADERS["X"] = "1"
    with pytest.raises(TypeError):
        kserve.JSON_HEADERS.update({"X": "1"})
    with pytest.raises(ValueError):
        kserve.FixedHeaders({"Content-Type": "a", "Content-Length": "3"})


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_nan_and_infinity_are_left_to_the_full_writer(special, monkeypatch):
    arr = np.ones((1, 200 if special is np.inf else 4), np.float32)
    arr[0, 1] = special
    fast, slow, _ = _both("tiny", "1", kserve.InferRequest({}, None, False), {"OUT": arr}, monkeypatch)
    assert fast == slow and b"null" not in fast[0]


@pytest.mark.parametrize("model", ["nullable", "é-model", "\ud800", "a\"quote"])
def test_a_name_the_full_writer_writes_otherwise_is_left_to_it(model, monkeypatch):
    arr = np.arange(4, dtype=np.float32).reshape(1, 4)
    fast, slow, _ = _both(model, "", kserve.InferRequest({}, None, False), {"OUT": arr}, monkeypatch)
    assert fast[0] == slow[0]


@pytest.mark.parametrize("req", [
    kserve.InferRequest({}, None, True),
    kserve.InferRequest({}, [kserve.OutputRequest("OUT", True)], False),
    kserve.InferRequest({}, [kserve.OutputRequest("OUT", False, class_count=2)], False),
    kserve.InferRequest({}, [kserve.OutputRequest("OTHER", False)], False),
], ids=["binary", "binary output", "classification", "another output"])
def test_answers_of_another_kind_are_left_to_the_full_writer(req, monkeypatch):
    arr = np.arange(4, dtype=np.float32).reshape(1, 4)
    assert kserve._one_json("m", "1", req, {"OUT": arr}) is None


# -- heads: native.Head ---------------------------------------------------------------------------------------

class CountedParser:
    """The connection's parser, counting what it is fed."""

    def __init__(self, parser) -> None:
        self.parser, self.fed = parser, 0

    def feed_data(self, data: bytes) -> None:
        self.fed += 1
        self.parser.feed_data(data)

    def __getattr__(self, name: str):
        return getattr(self.parser, name)


async def _connection(listener):
    """A connection to ``listener`` and the server's side of it, its parser counted; the fast path notes each
    request's body as it takes it (the connection lets go of it after)."""
    later = listener.later
    if not hasattr(later, "bodies"):
        later.bodies = {}
        take = listener.fast[later.handler]

        def noted(request, done) -> bool:
            later.bodies[id(request)] = request.body_now()
            return take(request, done)

        listener.fast[later.handler] = noted
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    await _until(lambda: listener.connections)
    (conn,) = listener.connections
    conn.parser = conn.counted = CountedParser(conn.parser)
    return reader, writer, conn


async def _ask(later, reader, writer, data: bytes, bodies: int = 1) -> list[tuple[bytes, bytes]]:
    """Sends ``data``; answers what the fast path takes with its body and headers, until ``bodies`` answers
    have come; the answers."""
    writer.write(data)
    answers = []
    for _ in range(bodies):
        reading = asyncio.ensure_future(_responses(reader, 1))
        for _ in range(3000):
            if later.waiting:
                req = later.waiting[0][0]
                later.answer(json.dumps({"fast": later.bodies.pop(id(req)).decode(),
                                         "length": req.headers["Content-Length"], "path": req.path}).encode())
            if reading.done():
                break
            await asyncio.sleep(0.01)
        answers += await reading
    return answers


def test_a_head_sent_again_around_another_length_is_known_without_the_parser():
    async def main() -> None:
        async with _listener() as (listener, later):
            listener.later = later
            reader, writer, conn = await _connection(listener)
            for i, body in enumerate([b"abc", b"12345", b"", b"x" * 10000, b"abc"]):
                ((head, answer),) = await _ask(later, reader, writer, _post("/x", body))
                assert head.startswith(b"HTTP/1.1 200"), head
                assert json.loads(answer) == {"fast": body.decode(), "length": str(len(body)), "path": "/x"}
                assert conn.counted.fed == 1, (i, conn.counted.fed)  # only the first went through the parser
            assert conn.head is not None and later.handled == 0
            writer.close()

    asyncio.run(main())


def test_what_is_not_the_same_head_alone_goes_to_the_parser():
    async def main() -> None:
        async with _listener() as (listener, later):
            listener.later = later
            reader, writer, conn = await _connection(listener)
            await _ask(later, reader, writer, _post("/x", b"abc"))
            fed = conn.counted.fed
            # two requests in one chunk: the parser reads them (the second waits for the first, then a task)
            answers = await _ask(later, reader, writer, _post("/x", b"1") + _post("/x", b"22"), 2)
            assert [b for _, b in answers] == [b'{"fast": "1", "length": "1", "path": "/x"}', b'{"handled": 2}']
            assert conn.counted.fed == fed + 1
            # another header, a length with a leading zero or a sign, a body short of its length
            for data in (_post("/x", b"abc", b"X-Other: 1\r\n"), _post("/x", b"abc").replace(b": 3\r\n", b": 03\r\n"),
                         _post("/x", b"abc").replace(b": 3\r\n", b": +3\r\n")):
                await _ask(later, reader, writer, _post("/x", b"abcd"))  # the plain head, known again
                fed = conn.counted.fed
                ((head, _),) = await _ask(later, reader, writer, data)
                assert conn.counted.fed == fed + 1, data
                if head.startswith(b"HTTP/1.1 400"):  # the parser refused it, and the connection is closed
                    reader, writer, conn = await _connection_after(listener, later, reader, writer)
            fed = conn.counted.fed
            request = _post("/x", b"0123456789")
            writer.write(request[:-4])
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(request[-4:])
            ((_, body),) = await _responses(reader, 1)
            assert body == b'{"handled": 10}' and conn.counted.fed == fed + 2
            writer.close()

    asyncio.run(main())


async def _connection_after(listener, later, reader, writer):
    writer.close()
    await _until(lambda: not listener.connections)
    reader, writer, conn = await _connection(listener)
    await _ask(later, reader, writer, _post("/x", b"abc"))
    return reader, writer, conn


def test_a_known_head_over_the_body_limit_is_answered_as_through_the_parser():
    big = _post("/x", b"y" * 100)

    async def main() -> None:
        async with _listener() as (listener, later):
            listener.later = later
            answers = []
            for learn in (False, True):
                later.mode = "take"
                listener.body_limit = BodyLimit(1 << 20)
                reader, writer, conn = await _connection(listener)
                if learn:
                    await _ask(later, reader, writer, _post("/x", b"abc"))
                later.mode, listener.body_limit = "decline", BodyLimit(64)
                writer.write(big)
                answers += await _responses(reader, 1)
                assert conn.counted.fed == 1 and (conn.head is not None) == learn
                writer.close()
                await _until(lambda: not listener.connections)
            assert answers[0] == answers[1] and not answers[0][0].startswith(b"HTTP/1.1 2"), answers

    asyncio.run(main())


def test_a_known_head_whose_route_has_lost_its_fast_path_goes_to_the_parser():
    async def main() -> None:
        async with _listener() as (listener, later):
            listener.later = later
            reader, writer, conn = await _connection(listener)
            await _ask(later, reader, writer, _post("/x", b"abc"))
            assert conn.head is not None
            fast, listener.fast = listener.fast, {}
            ((_, body),) = await _ask(later, reader, writer, _post("/x", b"abcd"))
            assert body == b'{"handled": 4}' and conn.counted.fed == 2
            listener.fast = fast
            writer.close()

    asyncio.run(main())


@pytest.mark.parametrize("strings", [False, True], ids=["the markers", "markers a BYTES input may hold"])
def test_data_that_is_a_marker_is_not_taken_for_the_list_found(strings, monkeypatch):
    """The first list is not the input's data, and the input's data is what one marker reads as: the other
    marker tells them apart. (The markers mix a string and a number, which no input's data may; with markers
    a BYTES input may hold, the second marker still does.)"""
    if strings:
        marks = (["\x00gepool"], ["\x00gepool!"])
        monkeypatch.setattr(templates, "_MARKS", marks)
        monkeypatch.setattr(templates, "_MARK_TEXTS", tuple(orjson.dumps(m) for m in marks))
    for mark in templates._MARK_TEXTS:
        def body(first: bytes) -> bytes:
            return (b'{"data": ' + first + b', "inputs": [{"name": "x", "datatype": "BYTES", "shape": [%d], '
                    b'"data": ' % len(orjson.loads(mark)) + mark + b"}]}")  # noqa: B023

        book = templates.Templates()
        for first in (b"[5]", b"[5]", b'["evil", "x"]'):
            data = body(first)
            assert outcome(lambda b, book=book: book.parse(b, None, MAX_JSON, MAX_INPUT), data) == \
                outcome(full, data), first
        assert not book._known


def test_a_learnt_shape_keeps_no_tensor():
    book = learnt()
    (known,) = book._known.values()
    assert known.request.inputs == {}


def test_the_same_bytes_parted_elsewhere_are_another_shape(full_reads):
    book = learnt(tiny_body([1.0] * 16))
    moved = tiny_body([2.0] * 16).replace(b'"data": [', b'"data":[').replace(b"]}]}", b"] }]}")
    start, end = templates._hole(moved)
    assert moved[:start] + moved[end:] in book._known  # the same bytes in all, the list one byte sooner
    full_reads.clear()
    got = outcome(lambda b: book.parse(b, None, MAX_JSON, MAX_INPUT), moved)
    assert full_reads == [moved] and got == outcome(full, moved) and got[0] == "read"


def test_empty_lines_around_a_known_head_count_as_around_any_other():
    """Blank lines between requests count toward the head's bound until a request ends: one taken by its
    known head ends them as one read by the parser does."""
    async def main() -> None:
        async with _listener() as (listener, later):
            listener.later = later
            statuses = []
            for known in (True, False):
                reader, writer, conn = await _connection(listener)
                await _ask(later, reader, writer, _post("/x", b"abc"))
                writer.write(b"\r\n" * 20000)  # 40 KB: under MAX_HEAD_BYTES
                await writer.drain()
                await asyncio.sleep(0.2)
                if not known:
                    conn.head = None
                await _ask(later, reader, writer, _post("/x", b"abcd"))
                writer.write(b"\r\n" * 15000)  # 30 KB more: over it only if the 40 KB still count
                await writer.drain()
                await asyncio.sleep(0.2)
                ((head, _),) = await _ask(later, reader, writer, _post("/x", b"abcde"))
                statuses.append(head.split(b"\r\n")[0])
                writer.close()
                await _until(lambda: not listener.connections)
            assert statuses == [b"HTTP/1.1 200 OK"] * 2, statuses

    asyncio.run(main())


def test_a_length_spelled_with_a_leading_zero_is_not_kept():
    async def main() -> None:
        async with _listener() as (listener, later):
            listener.later = later
            reader, writer, conn = await _connection(listener)
            ((_, body),) = await _ask(later, reader, writer, _post("/x", b"abcde").replace(b": 5\r\n", b": 05\r\n"))
            assert json.loads(body)["length"] == "05" and conn.head is None
            ((_, body),) = await _ask(later, reader, writer, _post("/x", b"abcde"))
            ((_, again),) = await _ask(later, reader, writer, _post("/x", b"vwxyz"))
            assert json.loads(body)["length"] == json.loads(again)["length"] == "5"
            assert conn.counted.fed == 2  # the last was known by its head
            writer.close()

    asyncio.run(main())


def test_data_holding_an_object_is_read_in_full(full_reads):
    book = learnt()
    body = tiny_body('[{"a": {"b": 1}}' + ", 1.0" * 15 + "]")
    full_reads.clear()
    assert outcome(lambda b: book.parse(b, None, MAX_JSON, MAX_INPUT), body) == outcome(full, body)
    assert full_reads and full_reads[0] == body


@pytest.mark.parametrize("cls", [kserve.InferRequest, tensors.InferCall], ids=lambda c: c.__name__)
def test_a_copy_with_changes_is_what_dataclasses_replace_gives(cls):
    """``templates.copied`` stands for ``dataclasses.replace`` on the classes it copies: plain dataclasses,
    whose fields are their instance dict."""
    params = cls.__dataclass_params__
    assert not params.frozen and not hasattr(cls, "__slots__") and not hasattr(cls, "__post_init__")
    fields = [f.name for f in dataclasses.fields(cls)]
    original = cls(**{name: [name] for name in fields})
    for name in fields:
        changes = {name: {"new": name}}
        got, want = templates.copied(original, **changes), dataclasses.replace(original, **changes)
        assert type(got) is cls and got == want and got is not original
        assert vars(got) == vars(want)
    assert vars(original) == {name: [name] for name in fields}  # the original is untouched
