"""gRPC ModelInferRequests known again by everything but their raw_input_contents (``grpc/calls.Calls``): each
gives exactly what ``tensors.parse`` gives, or its error, and what might not goes the full way."""

import numpy as np
import pytest

from gepool.common.errors import InvalidArgument
from gepool.grpc import calls, tensors
from gepool.grpc import grpc_service_pb2 as pb
from gepool.http import templates

MAX_INPUT = 1 << 20
RNG = np.random.default_rng(24)


def _no_regions(*args):
    raise AssertionError("no shared memory here")


def request(inputs: list[tuple[str, str, list[int]]], contents: list[bytes], **fields) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(**{"model_name": "tiny", **fields})
    for name, datatype, shape in inputs:
        item = req.inputs.add()
        item.name, item.datatype = name, datatype
        item.shape.extend(shape)
    req.outputs.add().name = "OUTPUT0"
    req.raw_input_contents.extend(contents)
    return req


def outcome(parse, req: pb.ModelInferRequest):
    try:
        call = parse(req)
    except InvalidArgument as exc:
        return ("refused", exc.message)
    arrays = {k: (v.dtype.str, v.shape, v.tobytes() if v.dtype != object else list(v.ravel()))
              for k, v in call.inputs.items()}
    return ("read", call.model, call.version, arrays, call.outputs, call.timeout_s, call.mark_final, call.priority)


def full(req):
    return tensors.parse(req, _no_regions, MAX_INPUT)


@pytest.fixture
def full_reads(monkeypatch):
    seen = []
    parse = tensors.parse

    def counted(req, *args, **kwargs):
        seen.append(req.SerializeToString())
        return parse(req, *args, **kwargs)

    monkeypatch.setattr(tensors, "parse", counted)
    return seen


def strings(*items: bytes) -> bytes:
    return b"".join(len(x).to_bytes(4, "little") + x for x in items)


SHAPE = [("IN0", "FP32", [1, 16]), ("IN1", "INT64", [1, 3]), ("IN2", "BYTES", [2])]


def learnt(book: calls.Calls, **fields) -> None:
    for _ in range(2):
        book.parse(request(SHAPE, [RNG.bytes(64), RNG.bytes(24), strings(b"ab", b"cd")], **fields), _no_regions,
                   MAX_INPUT)
    assert len(book._known) == 1


CASES = {
    "other bytes": [RNG.bytes(64), RNG.bytes(24), strings(b"xy", b"zw")],
    "other strings": [RNG.bytes(64), RNG.bytes(24), strings(b"", b"abcdef")],
    "more strings than the shape holds": [RNG.bytes(64), RNG.bytes(24), strings(b"", b"abcdef", b"")],
    "a string's length past its data": [RNG.bytes(64), RNG.bytes(24), strings(b"ab") + b"\xff\x00\x00\x00"],
    "a tensor a byte short": [RNG.bytes(63), RNG.bytes(24), strings(b"ab", b"cd")],
    "one contents too few": [RNG.bytes(64), RNG.bytes(24)],
    "one contents too many": [RNG.bytes(64), RNG.bytes(24), strings(b"ab", b"cd"), b"x"],
}


@pytest.mark.parametrize("case", CASES)
def test_a_learnt_request_reads_each_call_as_the_full_reading_does(case, full_reads):
    book = calls.Calls()
    learnt(book)
    req = request(SHAPE, CASES[case])
    before = req.SerializeToString()
    full_reads.clear()
    got = outcome(lambda r: book.parse(r, _no_regions, MAX_INPUT), req)
    in_full = len(full_reads)
    assert req.SerializeToString() == before  # the request is whole again
    assert got == outcome(full, req), case
    assert in_full == (got[0] == "refused"), case  # what reads is read by its shape alone


@pytest.mark.parametrize("fields", [{"id": "a-1"}, {"model_version": "1"}], ids=str)
def test_what_surrounds_the_contents_is_the_full_readings(fields, full_reads):
    book = calls.Calls()
    req = request(SHAPE, CASES["other bytes"], **fields)
    req.parameters["priority"].int64_param = 2
    req.parameters["timeout"].int64_param = 5_000_000
    for _ in range(2):
        book.parse(req, _no_regions, MAX_INPUT)
    other = request(SHAPE, [RNG.bytes(64), RNG.bytes(24), strings(b"q", b"rs")], **fields)
    other.parameters["timeout"].int64_param = 5_000_000  # (another order of the same map)
    other.parameters["priority"].int64_param = 2
    full_reads.clear()
    got = outcome(lambda r: book.parse(r, _no_regions, MAX_INPUT), other)
    assert not full_reads
    assert got == outcome(full, other) and got[0] == "read" and got[7] == 2


@pytest.mark.parametrize("case", ["typed contents", "shared memory", "another shape", "another limit"])
def test_what_might_read_otherwise_is_read_in_full(case, full_reads):
    book = calls.Calls()
    learnt(book)
    req = request(SHAPE, CASES["other bytes"])
    limit = MAX_INPUT
    if case == "typed contents":
        req.inputs[0].contents.fp32_contents.extend([1.0] * 16)
    elif case == "shared memory":
        req.inputs[0].parameters["shared_memory_region"].string_param = "r"
    elif case == "another shape":
        req.inputs[0].shape[0] = 2
    else:
        limit = 32
    full_reads.clear()
    got = outcome(lambda r: book.parse(r, _no_regions if case != "shared memory" else _refuse_region, limit), req)
    assert len(full_reads) == 1, case
    assert got == outcome(lambda r: tensors.parse(r, _refuse_region, limit), req), case


def _refuse_region(*args):
    raise InvalidArgument("no such region")


def test_a_request_whose_inputs_do_not_all_come_as_contents_is_never_learnt():
    book = calls.Calls()
    req = request(SHAPE[:1] + [("T", "FP32", [2])], [RNG.bytes(64)])
    req.inputs[1].contents.fp32_contents.extend([1.0, 2.0])  # refused in full (raw and typed together) ...
    for _ in range(3):
        assert outcome(lambda r: book.parse(r, _no_regions, MAX_INPUT), req) == outcome(full, req)
    assert not book._known


def test_the_book_is_bounded():
    book = calls.Calls()
    for i in range(templates.MAX_SEEN + 20):  # a new version each time: seen once each, never learnt
        book.parse(request(SHAPE, CASES["other bytes"], model_version=str(i + 1)), _no_regions, MAX_INPUT)
        assert len(book._seen) <= templates.MAX_SEEN
    assert not book._known
    for i in range(calls.MAX_CALLS + 10):
        for _ in range(2):
            book.parse(request(SHAPE, CASES["other bytes"], model_version=f"{i + 1}0"), _no_regions, MAX_INPUT)
        assert len(book._known) <= calls.MAX_CALLS
    (known, *_) = book._known.values()
    assert known.call.inputs == {}  # no caller's tensors are kept


# -- known by their bytes ------------------------------------------------------------------------------------
def learnt_raw(book: calls.Calls, **fields) -> None:
    for _ in range(2):
        req = request(SHAPE, [RNG.bytes(64), RNG.bytes(24), strings(b"ab", b"cd")], **fields)
        book.parse(req, _no_regions, MAX_INPUT, req.SerializeToString())
    assert len(book._prefixes) == 1


def known_outcome(book: calls.Calls, raw: bytes, limit: int = MAX_INPUT):
    """What ``known`` makes of the bytes (None where it leaves them to the full reading), with the id it gives
    (and the model name and version it gives checked against the request's own)."""
    found = book.known(raw, limit)
    if found is None:
        return None
    call, less, (request_id, model_name, model_version) = found
    assert less.inputs == {} and less.model == call.model and less.outputs == call.outputs
    req = pb.ModelInferRequest.FromString(raw)
    assert (request_id, model_name, model_version) == (req.id, req.model_name, req.model_version)
    return outcome(lambda r: call, None), request_id


@pytest.mark.parametrize("case", CASES)
def test_a_request_known_by_its_bytes_reads_as_the_full_reading_does(case, full_reads):
    book = calls.Calls()
    learnt_raw(book, id="a-1")
    req = request(SHAPE, CASES[case], id="a-1")
    full_reads.clear()
    got = known_outcome(book, req.SerializeToString())
    assert not full_reads
    want = outcome(full, req)
    if want[0] == "refused":  # left to the full reading, which names what is wrong
        assert got is None, case
    else:
        assert got == (want, "a-1"), case


def _field(number: int, data: bytes) -> bytes:
    return tensors.varint(number << 3 | 2) + tensors.varint(len(data)) + data


@pytest.mark.parametrize("case", ["a field after the contents", "a field between them", "another model",
                                  "cut short", "a length past the end", "another limit", "contents alone",
                                  "an id twice", "an id of bytes that are not UTF-8"])
def test_bytes_that_are_not_a_learnt_request_around_contents_are_not_known(case):
    book = calls.Calls()
    learnt_raw(book)
    req = request(SHAPE, CASES["other bytes"])
    raw = req.SerializeToString()
    head = raw[:calls.layout(raw, 3)[2]]
    contents = [_field(7, c) for c in req.raw_input_contents]
    limit = MAX_INPUT
    if case == "a field after the contents":
        raw += _field(3, b"late-id")  # the id, which the full reading takes (the last of a field wins)
    elif case == "a field between them":
        raw = head + contents[0] + _field(3, b"id") + contents[1] + contents[2]
    elif case == "an id twice":
        raw = _field(1, b"tiny") + _field(3, b"first") + _field(3, b"second") + raw[len(_field(1, b"tiny")):]
        assert pb.ModelInferRequest.FromString(raw).id == "second"
    elif case == "an id of bytes that are not UTF-8":
        raw = _field(1, b"tiny") + _field(3, b"\xff") + raw[len(_field(1, b"tiny")):]
    elif case == "another model":
        raw = _field(1, b"other") + raw
    elif case == "cut short":
        raw = raw[:-1]
    elif case == "a length past the end":
        raw = head + contents[0] + contents[1] + b"\x3a\x7f" + contents[2][2:]
    elif case == "another limit":
        limit = 32
    else:
        raw = b"".join(contents)
    assert book.known(raw, limit) is None, case


@pytest.mark.parametrize("case", ["contents not last", "typed contents", "contents alone"])
def test_only_requests_whose_contents_come_last_are_kept_by_their_bytes(case):
    req = request(SHAPE, CASES["other bytes"])
    raw = req.SerializeToString()
    if case == "contents not last":
        raw += _field(3, b"")  # an empty id after them: the same request, but its bytes are not head + contents
        assert pb.ModelInferRequest.FromString(raw) == req
    elif case == "typed contents":
        req.inputs[0].contents.fp32_contents.extend([1.0] * 16)
        raw = req.SerializeToString()
    else:
        raw = b"".join(_field(7, c) for c in req.raw_input_contents)
        req = pb.ModelInferRequest.FromString(raw)
    book = calls.Calls()
    for _ in range(3):
        try:
            book.parse(pb.ModelInferRequest.FromString(raw), _no_regions, MAX_INPUT, raw)
        except InvalidArgument:
            pass
    assert not book._prefixes, case
    if case != "contents not last":
        return
    assert len(book._known) == 1  # still known by its key


@pytest.mark.parametrize("raw, count, found", [
    (b"", 0, None),
    (b"\x0a\x01a\x3a\x00", 1, (3, 3, 3)),
    (b"\x0a\x01a\x3a\x00\x3a\x02xy", 2, (3, 3, 3)),
    (b"\x0a\x01a\x3a\x00\x3a\x02xy", 1, None),  # as many as said, no fewer
    (b"\x3a\x00\x0a\x01a", 1, None),  # another field after them
    (b"\x08\x96\x01\x11" + bytes(8) + b"\x25" + bytes(4) + b"\x3a\x00", 1, (12, 12, 17)),  # varint, fixed64, fixed32
    (b"\x1d" + bytes(4) + b"\x3a\x00", 1, None),  # an id as a fixed32
    (b"\x38\x01", 1, None),  # field 7 as a varint
    (b"\x0b\x0c\x3a\x00", 1, None),  # a group
    (b"\x0a\x05a", 0, None),  # a length past the end
    (b"\x0a" + b"\xff" * 11, 0, None),  # a varint over 64 bits
    (b"\x0a\x01a\x1a\x02id\x2a\x00\x3a\x00", 1, (3, 7, 9)),  # an id, between fields 1 and 5
    (b"\x0a\x01a\x1a\x00\x3a\x00", 1, (3, 5, 5)),  # an empty id
    (b"\x0a\x01a\x2a\x00\x3a\x00", 1, (3, 3, 5)),  # none: where it would be, before field 5
    (b"\x0a\x01a\x1a\x01x\x1a\x01y\x3a\x00", 1, None),  # an id twice
    (b"\x0a\x01a\x2a\x00\x1a\x01x\x3a\x00", 1, None),  # an id after a field past it
    (b"\x0a\x01a\x18\x01\x3a\x00", 1, None),  # an id as a varint
])
def test_where_the_id_and_contents_lie(raw, count, found):
    assert calls.layout(raw, count) == found


def test_a_request_is_known_by_its_bytes_whatever_its_id(full_reads):
    """Learnt from two requests of other ids; then each of the ids a client may give (none, empty, long, not
    ASCII) is known, and given back as the full reading gives it."""
    book = calls.Calls()
    for rid in ("first", "second"):
        req = request(SHAPE, CASES["other bytes"], id=rid)
        book.parse(req, _no_regions, MAX_INPUT, req.SerializeToString())
    assert len(book._known) == 1 and len(book._prefixes) == 1
    full_reads.clear()
    for rid in ("", "a-1", "x" * 300, "é-ü-≈"):
        req = request(SHAPE, [RNG.bytes(64), RNG.bytes(24), strings(b"q", b"")], id=rid)
        got = known_outcome(book, req.SerializeToString())
        assert got == (outcome(full, req), rid), rid
    assert len(full_reads) == 4  # (the outcomes compared against, not known's)


def test_a_learnt_request_whose_bytes_start_another_ones_leaves_it_known():
    """A request without outputs is, byte for byte, the start of the same request with them (fields go in order):
    each is known by its own bytes, whichever was learnt first."""
    book = calls.Calls()
    fuller = request(SHAPE, CASES["other bytes"])
    shorter = request(SHAPE, CASES["other bytes"])
    shorter.ClearField("outputs")
    for req in (fuller, fuller, shorter, shorter):
        book.parse(req, _no_regions, MAX_INPUT, req.SerializeToString())
    assert len(book._prefixes) == 2
    assert fuller.SerializeToString().startswith(book._prefixes[0].head + book._prefixes[0].tail)
    for req in (fuller, shorter):
        req.raw_input_contents[0] = RNG.bytes(64)
        assert known_outcome(book, req.SerializeToString()) == (outcome(full, req), "")


def test_the_bytes_kept_are_bounded():
    book = calls.Calls()
    for i in range(calls.MAX_PREFIXES + 5):
        for _ in range(2):
            req = request(SHAPE, CASES["other bytes"], model_version=f"{i + 1}")
            book.parse(req, _no_regions, MAX_INPUT, req.SerializeToString())
        assert len(book._prefixes) <= calls.MAX_PREFIXES
    newest = request(SHAPE, CASES["other strings"], model_version=f"{calls.MAX_PREFIXES + 5}", id="n")
    assert known_outcome(book, newest.SerializeToString())[1] == "n"
    long = request(SHAPE, CASES["other bytes"], model_name="y" * calls.MAX_PREFIX_BYTES)
    for _ in range(2):
        book.parse(long, _no_regions, MAX_INPUT, long.SerializeToString())
    assert all(len(p.head) + len(p.tail) <= calls.MAX_PREFIX_BYTES for p in book._prefixes)
    assert book.known(long.SerializeToString(), MAX_INPUT) is None


# -- answers written around their contents ---------------------------------------------------------------------
ANSWER_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                 np.uint32, np.uint64, np.bool_]


class Outputs(dict):
    model_version = 3


def _answer_call(outputs=None, mark_final=False) -> tensors.InferCall:
    return tensors.InferCall("tiny", None, {}, outputs, None, mark_final)


@pytest.mark.parametrize("dtype", ANSWER_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("how", ["every output", "asked by name", "final flag"])
def test_an_answer_written_around_its_contents_is_the_messages_bytes(dtype, how):
    tensors._answer_heads.clear()
    wanted = [tensors.OutputRequest("OUT")] if how == "asked by name" else None
    call = _answer_call(wanted, how == "final flag")
    shapes = [(1, 16), (1, 16), (2, 300), (1, 0), (1, 16)]  # (2, 300) past a one-byte length; (1, 0) empty
    for shape, rid in zip(shapes, ["", "r-1", "", "é" * 200, "x"]):  # (200 characters: a two-byte length)
        arr = (RNG.standard_normal(shape) * 100).astype(dtype)
        outputs = Outputs(OUT=arr)
        want = tensors.response(rid, call, "3", outputs, _no_regions).SerializeToString()
        assert tensors.response_bytes(rid, call, "3", outputs) == want, (shape, rid)
    assert all(head is not None for head in tensors._answer_heads.values())


@pytest.mark.parametrize("case", ["two outputs", "strings", "fixed-width bytes", "fixed-width text",
                                  "another output asked", "a region"])
def test_answers_the_bytes_do_not_cover_go_the_full_way(case):
    arr = np.ones((1, 4), np.float32)
    outputs, call, request_id = Outputs(OUT=arr), _answer_call(), ""
    if case == "two outputs":
        outputs["OTHER"] = arr
    elif case == "strings":
        outputs["OUT"] = np.array([b"a", b"b"], dtype=object)
    elif case == "fixed-width bytes":  # (empty first: its four length bytes alone would pass a check of the head)
        outputs["OUT"] = np.array([b""], "S4")
        tensors.response_bytes(request_id, call, "3", outputs)
        outputs["OUT"] = np.array([b"abcd"], "S4")
    elif case == "fixed-width text":
        outputs["OUT"] = np.array(["é"], "U1")
    elif case == "another output asked":
        call = _answer_call([tensors.OutputRequest("OUT"), tensors.OutputRequest("OTHER")])
    else:
        call = _answer_call([tensors.OutputRequest("OUT", "region", 16)])
    assert tensors.response_bytes(request_id, call, "3", outputs) is None
