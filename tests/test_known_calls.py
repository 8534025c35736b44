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
    req = pb.ModelInferRequest(model_name="tiny", **fields)
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
    for i in range(templates.MAX_SEEN + 20):  # a new id each time: seen once each, never learnt
        book.parse(request(SHAPE, CASES["other bytes"], id=str(i)), _no_regions, MAX_INPUT)
        assert len(book._seen) <= templates.MAX_SEEN
    assert not book._known
    for i in range(calls.MAX_CALLS + 10):
        for _ in range(2):
            book.parse(request(SHAPE, CASES["other bytes"], id=f"x{i}"), _no_regions, MAX_INPUT)
        assert len(book._known) <= calls.MAX_CALLS
    (known, *_) = book._known.values()
    assert known.call.inputs == {}  # no caller's tensors are kept
