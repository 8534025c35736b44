"""Admission's one-expression checks against the field-by-field checks they stand in front of: the same
verdict, and the same error, for every header field and shape a client can send."""

import itertools

import pytest

from gepool.common.errors import InvalidArgument
from gepool.ipc import protocol
from gepool.scheduler import requests
from gepool.scheduler.requests import _check_fields, _checked_shape, _refuse_fields, _shape_of

# what msgpack can hand the front for a field meant to be a non-negative integer
VALUES = [0, 1, 7, 2**63, -1, -(2**63), True, False, None, 1.0, "1", b"1", [1], {}]
ORIGIN_VALUES = [int(o) for o in protocol.Origin] + [-1, 99, True, None, "http", 1.0]
INPUTS_VALUES = [[], [["INPUT", "FP32", [1, 4], 0]], None, {}, "x", (1,)]
SHAPES = [[], [1], [1, 4], [0], [0, 0], [3, 2**40], [-1], [1, -4], [True], [1, False], [1.0], ["1"], [None],
          [[1]], None, (1, 4), "1,4", {1: 4}, 4, [1, 4, 2**70], [-(2**70)]]


def verdict(check, *args):
    """What ``check`` says: its result, or the type and message of what it raised."""
    try:
        return ("ok", check(*args))
    except InvalidArgument as exc:
        return ("refused", exc.message)


def infer(**fields) -> protocol.Infer:
    """An Infer as the front decodes it (msgpack gives plain ints, never an IntEnum), then ``fields``."""
    msg = protocol.decode(protocol.Infer(1, "m", protocol.NO_VERSION, [["INPUT", "FP32", [1, 4], 0]], None, 0, 0,
                                         protocol.NO_ARENA, 0, 0).encode())
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


def cases():
    """Each field alone through every value, then pairs of bad fields (which one the error names)."""
    for name in requests._INT_FIELDS:
        for v in VALUES:
            yield {name: v}
    for v in ORIGIN_VALUES:
        yield {"origin": v}
    for v in INPUTS_VALUES:
        yield {"inputs": v}
    bad = {"req_id": None, "version": 1.5, "timeout_us": -1, "priority": True, "arena": "a", "out_offset": -3,
           "out_size": [], "deadline_us": -(2**63), "origin": 99, "inputs": None}
    for a, b in itertools.combinations(bad, 2):
        yield {a: bad[a], b: bad[b]}


@pytest.mark.parametrize("fields", list(cases()), ids=repr)
def test_header_checks_agree_with_the_field_by_field_checks(fields):
    msg = infer(**fields)
    assert verdict(_check_fields, msg) == verdict(_refuse_fields, msg)


def test_a_usual_header_passes_without_the_field_by_field_checks(monkeypatch):
    """The fast path is taken: were it never, the agreement above would prove nothing."""
    def slow(msg):
        raise AssertionError("the one-expression check sent a valid header to the slow path")

    monkeypatch.setattr(requests, "_refuse_fields", slow)
    for origin in protocol.Origin:
        _check_fields(infer(origin=int(origin), req_id=2**40, timeout_us=5, priority=3, deadline_us=9))


@pytest.mark.parametrize("shape", SHAPES, ids=repr)
def test_shape_checks_agree_with_the_one_by_one_checks(shape):
    fast, slow = verdict(_shape_of, "INPUT", shape), verdict(_checked_shape, "INPUT", shape)
    assert fast == slow
    if fast[0] == "ok":
        assert type(fast[1]) is tuple and all(type(d) is int for d in fast[1])
