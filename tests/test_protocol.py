"""Every message type survives encode/decode; garbage is refused with a ProtocolError."""

import dataclasses

import msgpack
import pytest

from gepool.ipc import protocol

SAMPLES = [
    protocol.Hello(1, protocol.PROTOCOL_VERSION, "pid1"),
    protocol.Welcome(1, protocol.PROTOCOL_VERSION, "123xabc", "gepool"),
    protocol.Infer(7, "mlp", -1, [["INPUT", "FP32", [2, 4], 0]], ["OUT"], 0, 0, protocol.NO_ARENA, 0, 0, 5_000_000),
    protocol.Result(7, [["OUT", "FP32", [2, 4], 0]], False, 1),
    protocol.Error(7, "INVALID_ARGUMENT", "bad shape"),
    protocol.RegisterArena(8, "/gepool.1x2.arena", 4096, b"t" * 32),
    protocol.UnregisterArena(9, 3),
    protocol.Query(10, "metadata", {"model": "mlp"}),
    protocol.Reply(10, {"name": "mlp", "inputs": []}),
    protocol.WorkerReady(3, protocol.PROTOCOL_VERSION, 999, {}),
    protocol.WorkerFailed(3, "no weights"),
    protocol.Stop(),
    protocol.DropArena("/gepool.1x2.arena"),
    protocol.SetLogging(10, 1, "ISO8601"),
    protocol.DeviceStats(3, 999, {"rss_bytes": 1 << 20, "cpu_seconds": 0.5, "health": "HEALTHY"}),
]


def test_every_message_type_is_sampled():
    assert {type(m).TYPE for m in SAMPLES} == set(protocol.MsgType)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    back = protocol.decode(msg.encode())
    assert type(back) is type(msg)
    assert dataclasses.astuple(back) == dataclasses.astuple(msg)


@pytest.mark.parametrize("frame, why", [
    (b"\xc1garbage", "not msgpack"),
    (msgpack.packb({"a": 1}), "array"),
    (msgpack.packb([]), "array"),
    (msgpack.packb([999, 1]), "unknown message type"),
    (msgpack.packb([int(protocol.MsgType.WORKER_FAILED), 1]), "needs 2 fields"),
    (msgpack.packb(["3", 1]), "array"),
])
def test_garbage_is_refused(frame, why):
    with pytest.raises(protocol.ProtocolError, match=why):
        protocol.decode(frame)


def test_trailing_optional_fields_may_be_left_out_and_no_more_added():
    """A sender that predates deadline_us, origin, caller, members or the arena token is understood; one more field
    is not."""
    infer = protocol.Infer(7, "mlp", -1, [], None, 0, 0, protocol.NO_ARENA, 0, 0, 5, protocol.Origin.GRPC)
    short = msgpack.packb(list(msgpack.unpackb(infer.encode()))[:-4])
    assert protocol.decode(short).deadline_us == 0 and protocol.decode(short).origin == protocol.Origin.LIBRARY
    assert type(protocol.decode(short).origin) is int  # as a sender's would be: admission takes ints only
    reg = msgpack.packb([int(protocol.MsgType.REGISTER_ARENA), 8, "/gepool.1x2.arena", 4096])
    assert protocol.decode(reg).token == b""
    with pytest.raises(protocol.ProtocolError, match="needs 3 to 4 fields, got 5"):
        protocol.decode(msgpack.packb([int(protocol.MsgType.REGISTER_ARENA), 8, "/a", 1, b"", 0]))
    with pytest.raises(protocol.ProtocolError, match="needs 10 to 14 fields, got 9"):
        protocol.decode(msgpack.packb(list(msgpack.unpackb(short))[:-1]))
