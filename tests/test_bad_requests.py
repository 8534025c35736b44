"""Bad requests get an error naming what was wrong, and the pool serves the next request."""

import numpy as np
import pytest

from gepool.common import errors
from gepool.ipc import protocol

GOOD = {"INPUT0": np.ones((1, 16), np.float32)}


def still_serves(client) -> None:
    np.testing.assert_array_equal(client.infer("tiny", GOOD)["OUTPUT0"], np.full((1, 16), 3, np.float32))


@pytest.mark.parametrize("model, inputs, exc, words", [
    ("nosuch", GOOD, errors.ModelNotFound, "unknown model: 'nosuch'"),
    ("tiny", {"INPUT9": np.ones((1, 16), np.float32)}, errors.InvalidArgument, "unknown input ['INPUT9']"),
    ("tiny", {"INPUT0": np.ones((1, 16), np.float64)}, errors.InvalidArgument, "datatype FP64 does not match"),
    ("tiny", {"INPUT0": np.ones((1, 15), np.float32)}, errors.InvalidArgument, "shape [1, 15] does not match"),
    ("tiny", {"INPUT0": np.ones(16, np.float32)}, errors.InvalidArgument, "does not match the model's [-1, 16]"),
    ("tiny", {"INPUT0": np.ones((9, 16), np.float32)}, errors.InvalidArgument, "outside 1..max_batch_size (8)"),
    ("tiny", {"INPUT0": np.ones((0, 16), np.float32)}, errors.InvalidArgument, "batch size 0"),
    ("varlen", {"INPUT": np.ones((1, 20_000), np.float32)}, errors.RequestTooLarge, "slot of model 'varlen' holds"),
    ("cannot_load", {"X": np.ones((1, 1), np.float32)}, errors.ModelNotReady, "UNAVAILABLE"),
])
@pytest.mark.parametrize("shared", [False, True], ids=["frames", "shm"])
def test_bad_request_is_named_and_pool_serves_on(pool, model, inputs, exc, words, shared):
    with pool.client(shared_memory=shared, arena_min_bytes=0) as c:
        with pytest.raises(exc) as info:
            c.infer(model, inputs)
        assert words in str(info.value)
        still_serves(c)


def test_unknown_output_is_named(client):
    with pytest.raises(errors.InvalidArgument, match=r"unknown output \['NOPE'\]"):
        client.infer("tiny", GOOD, outputs=["NOPE"])
    still_serves(client)


def test_variable_length_requests_batch_by_shape(client):
    xs = [np.full((1, n), n, np.float32) for n in (3, 5, 3, 5, 7)]
    futures = [client.infer_async("varlen", {"INPUT": x}) for x in xs]
    for x, fut in zip(xs, futures):
        np.testing.assert_array_equal(fut.result(timeout=60)["OUTPUT"], x)


def exchange(sock, frames) -> object:
    sock.send_multipart(frames)
    assert sock.poll(30_000), "the front did not answer"
    return protocol.decode(sock.recv_multipart()[0])


def infer_header(inputs, req_id=5, model="tiny") -> bytes:
    return protocol.Infer(req_id, model, -1, inputs, None, 0, 0, protocol.NO_ARENA, 0, 0).encode()


@pytest.mark.parametrize("frames, words", [
    ([infer_header([["INPUT0", "FP32", [1, 16], 0]]), b"\0" * 60], "60 bytes sent"),
    ([infer_header([["INPUT0", "FP32", [1, 16], 0]])], "frame 0 does not exist"),
    ([infer_header([["INPUT0", "FP32", [1, 16], -3]]), b"\0" * 64], "frame -3 does not exist"),
    ([infer_header([["INPUT0", "FP32", [1, 16], 0]], model=7), b"\0" * 64], "model a string"),
    ([infer_header([["INPUT0", "FP32", "1x16", 0]]), b"\0" * 64], "shape must be a list"),
    ([infer_header([["INPUT0", "FP32", [1, -16], 0]]), b"\0" * 64], "negative"),
    ([infer_header(["INPUT0"])], "must be [name, datatype, shape, where]"),
    ([b"\x93\x01garbage"], "not msgpack"),
    ([protocol.Hello(5, 99, "old").encode()], "protocol 99"),
    ([protocol.Stop().encode()], "not a request a client may send"),
    ([protocol.Query(5, "everything", {}).encode()], "unknown query"),
    ([protocol.Infer(5, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, 42, 0, 0).encode()],
     "arena 42 is not registered"),
    ([protocol.RegisterArena(5, "/etc/passwd", 10).encode()], "arena name must start"),
    # found by tests/test_hostile.py: a list where out_size belongs once crashed the front after the batch ran
    ([protocol.Infer(5, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, -1, 0, ["x"]).encode(),
      b"\0" * 64], "out_size must be an integer"),
    ([protocol.Infer(5, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, -1, 0, -1, 0, 0).encode(),
      b"\0" * 64], "timeout_us must be >= 0"),
])
def test_malformed_messages_get_errors(raw, client, frames, words):
    reply = exchange(raw, frames)
    assert isinstance(reply, protocol.Error), reply
    assert words in reply.message
    still_serves(client)


def test_arena_offsets_are_checked(pool):
    with pool.client(shared_memory=True, arena_min_bytes=0) as c:
        header = protocol.Infer(5, "tiny", -1, [["INPUT0", "FP32", [1, 16], c.arena.size - 8]], None, 0, 0,
                                c._arena_id, 0, 0).encode()
        reply = c._exchange([header], 5, 30, "raw")[0]
        assert isinstance(reply, protocol.Error) and "outside the arena" in reply.message
        still_serves(c)
