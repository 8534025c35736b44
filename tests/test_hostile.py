"""Hostile input on the ZMQ endpoint and the lanes: random messages and framing never take the front down."""

import socket
import struct

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gepool import Client
from gepool.ipc import lane, protocol

VALID = protocol.Infer(1, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, protocol.NO_ARENA, 0, 0)
values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
shapes = st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=4)


@st.composite
def messages(draw) -> list[bytes]:
    kind = draw(st.sampled_from(["garbage", "random_fields", "mutated_infer", "bad_tensor", "truncated"]))
    if kind == "garbage":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
    if kind == "random_fields":
        mtype = draw(st.sampled_from([int(t) for t in protocol.MsgType]) | st.integers(-(2**63), 2**63 - 1))
        fields = draw(st.lists(values, max_size=11))
        return [msgpack.packb([mtype, *fields], use_bin_type=True)]
    if kind == "mutated_infer":
        items = [int(protocol.MsgType.INFER), *(getattr(VALID, f) for f in VALID._FIELDS)]
        i = draw(st.integers(min_value=1, max_value=len(items) - 1))
        items[i] = draw(values)
        return [msgpack.packb(items, use_bin_type=True), b"\0" * 64]
    if kind == "bad_tensor":
        ref = [draw(st.sampled_from(["INPUT0", "X"])), draw(st.sampled_from(["FP32", "FP64", "BYTES", "NOPE", ""])),
               draw(shapes), draw(st.integers(min_value=-5, max_value=5))]
        arena = draw(st.sampled_from([protocol.NO_ARENA, 0, 1, 99]))
        msg = protocol.Infer(2, "tiny", -1, [ref], None, 0, 0, arena, draw(st.integers(-10, 2**40)), 64)
        return [msg.encode(), *draw(st.lists(st.binary(max_size=80), max_size=2))]
    valid = VALID.encode()
    cut = draw(st.integers(min_value=0, max_value=len(valid) - 1))
    return [valid[:cut], b"\0" * draw(st.integers(0, 64))]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=messages())
def test_front_survives_and_answers(raw, frames):
    raw.send_multipart(frames)
    if raw.poll(5000):  # an error reply, or (for what is not ours to answer) nothing and a log line
        reply = protocol.decode(raw.recv_multipart()[0])
        assert isinstance(reply, protocol.Error | protocol.Reply | protocol.Welcome | protocol.Result), reply


def test_valid_request_after_the_storm(client, pool):
    x = np.arange(16, dtype=np.float32)[None]
    np.testing.assert_array_equal(client.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
    assert client.status()["models"]["tiny"]["state"] == "READY"


SIZES = st.sampled_from([0, 1, 7, 64, lane.RECORD_MAX, 2**31, 2**40, 2**63, 2**64 - 1]) | st.integers(0, 4096)


@st.composite
def lane_records(draw) -> list[bytes]:
    """One lane's worth of records: garbage, or headers whose flag, part count and sizes lie."""
    kind = draw(st.sampled_from(["garbage", "one", "many"]))
    if kind == "garbage":
        return draw(st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=3))
    sizes = draw(st.lists(SIZES, max_size=6))
    count = draw(st.sampled_from([len(sizes)]) | st.integers(0, 2**32 - 1))
    flag = draw(st.sampled_from([0, 1, 2, 255]))
    head = bytes([flag]) + struct.pack("<I", count) + struct.pack(f"<{len(sizes)}Q", *sizes)
    body = draw(st.sampled_from([VALID.encode(), b""]) | st.binary(max_size=300))
    records = [head + body]
    if kind == "many":
        records += [bytes([draw(st.sampled_from([0, 1]))]) + draw(st.binary(max_size=300))
                    for _ in range(draw(st.integers(1, 3)))]
    return records


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=lane_records())
def test_lane_framing_fuzz_never_takes_the_front_down(pool, records):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    try:
        sock.connect(lane.path_for(pool.endpoint[len("ipc://"):]))
        assert sock.recv(lane.RECORD_MAX) == lane.ACCEPTED
        for record in records:
            try:
                sock.send(record)
            except OSError:  # the front already hung up on an earlier record
                break
        sock.settimeout(0.2)
        try:
            reply = sock.recv(lane.RECORD_MAX)
        except (TimeoutError, ConnectionError):
            reply = b""  # waiting for the rest of a message, or hung up
        if len(reply) > 13 and reply[0] == 0 and reply[1:5] == b"\x01\0\0\0":  # a one-part reply
            msg = protocol.decode(reply[13:])
            assert isinstance(msg, protocol.Error | protocol.Reply | protocol.Welcome | protocol.Result), msg
    finally:
        sock.close()
    with Client(pool.endpoint, timeout=30) as c:  # over a lane of its own: the front still answers
        assert c.status()["pool_id"]
