"""The client core's in-flight book, alone: deadlines, the endpoint watch, and what each carrier took."""

from gepool.clientcore import WATCH_S, Inflight


def test_the_book_wakes_for_the_earliest_deadline_and_watches_only_zmq():
    book = Inflight()
    assert book.next_wake(100.0) is None
    book[1] = (None, "a", None, True)  # over a lane, no deadline: nothing to wake for (a dead lane is seen)
    assert book.next_wake(100.0) is None
    book[2] = (None, "b", 130.0, True)
    assert book.next_wake(100.0) == 130.0
    book[3] = (None, "c", None, False)  # over ZMQ: look at the endpoint soon
    assert book.next_wake(100.0) == 100.0 + WATCH_S
    book[4] = (None, "d", 100.1, False)
    assert book.next_wake(100.0) == 100.1


def test_the_book_hands_out_what_expired_or_what_a_carrier_took():
    book = Inflight({1: (None, "a", 5.0, True), 2: (None, "b", 9.0, False), 3: (None, "c", None, False),
                     4: (None, "d", None, True)})
    assert [req_id for req_id, _ in book.expired(6.0)] == [1]
    assert [(req_id, e[1]) for req_id, e in book.carried(False)] == [(2, "b"), (3, "c")]
    assert list(book) == [4]
    assert [req_id for req_id, _ in book.carried(True)] == [4] and not book


def test_both_faces_send_their_wait_as_the_deadline_and_a_timeout_only_when_given():
    """deadline_us is what the face will wait (its infer timeout and ANSWER_GRACE_S more, for the pool's own
    answer to a timeout that ran out, else the client's, else what the caller says); timeout_us, Triton's
    override of the queue policy, only what infer(timeout=) asked. Both faces encode through the core."""
    import numpy as np

    from gepool import AsyncClient, Client
    from gepool.clientcore import ANSWER_GRACE_S, ClientCore
    from gepool.ipc import protocol

    assert Client._encode is ClientCore._encode and AsyncClient._encode is ClientCore._encode
    core = ClientCore("ipc:///nowhere", shared_memory=False, arena_bytes=0, timeout=7.5, curve_server_key=None,
                      curve_client_key=None, lane=False, arena_min_bytes=0)
    x = {"X": np.ones((1, 1), np.float32)}
    default = protocol.decode(core._encode("m", x, None, None, None).frames[0])
    given = protocol.decode(core._encode("m", x, None, None, 0.25).frames[0])
    assert (default.timeout_us, default.deadline_us) == (0, 7_500_000)
    assert (given.timeout_us, given.deadline_us) == (250_000, 250_000 + ANSWER_GRACE_S * 1_000_000)
    waited = protocol.decode(core._encode("m", x, None, None, 0.25, wait=300.0).frames[0])
    assert (waited.timeout_us, waited.deadline_us) == (250_000, 300_000_000)


def test_an_infer_header_is_the_bytes_protocol_infer_encodes_and_its_frames_the_inputs_bytes():
    """encode_infer packs the header itself (a Packer per thread, no message object); it must stay the
    message protocol.Infer encodes, field for field, for every tail (origin an IntEnum, a BLS caller);
    small inputs travel as copies, large ones as the array, both in C order."""
    import threading

    import numpy as np

    from gepool import _wire
    from gepool.arena import ClientArena
    from gepool.ipc import dtypes, layout, protocol

    small = np.arange(12, dtype=np.float16).reshape(3, 4).T  # not C-contiguous
    large = np.arange(_wire.FRAME_COPY_MAX, dtype=np.int64).reshape(2, -1)  # over FRAME_COPY_MAX bytes
    names = np.array([b"a", b"bc"], dtype=object)
    for outputs, timeout, origin, caller in ((None, None, protocol.Origin.LIBRARY, None),
                                             (["Y", ["Z", 3]], 0.25, protocol.Origin.HTTP, [1, 2, 3, b"k"])):
        sent = _wire.encode_infer("m", {"A": small, "B": large, "C": names}, outputs, 4, timeout, None, 0,
                                  deadline=7.5, priority=9, origin=origin, caller=caller)
        want = protocol.Infer(sent.req_id, "m", 4, [["A", "FP16", [4, 3], 0], ["B", "INT64", [2, 2048], 1],
                                                    ["C", "BYTES", [2], 2]], outputs, _wire._timeout_us(timeout), 9,
                              protocol.NO_ARENA, 0, 0, 7_500_000, int(origin), caller)
        assert sent.frames[0] == want.encode()
        assert sent.frames[1] == small.tobytes() and type(sent.frames[1]) is bytes
        assert type(sent.frames[2]) is np.ndarray and sent.frames[2].tobytes() == large.tobytes()
        assert sent.frames[3] == dtypes.serialize_bytes(names)
    heads = []
    threads = [threading.Thread(target=lambda: heads.append(
        [_wire.encode_infer("m", {"A": small}, None, None, None, None, 0) for _ in range(200)])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for batch in heads:
        for sent in batch:
            assert protocol.decode(sent.frames[0]).req_id == sent.req_id
    arena = ClientArena(1 << 20)
    try:
        sent = _wire.encode_infer("m", {"A": small, "B": large}, ["Y"], None, None, (arena, 5), 256, arena_min=0,
                                  deadline=None, priority=0, origin=protocol.Origin.GRPC)
        (base, total), = sent.ranges
        refs = [["A", "FP16", [4, 3], base], ["B", "INT64", [2, 2048], base + layout.align(24)]]
        want = protocol.Infer(sent.req_id, "m", protocol.NO_VERSION, refs, ["Y"], 0, 0, 5, base + total, 256, 0,
                              int(protocol.Origin.GRPC), None)
        assert sent.frames == [want.encode()] and sent.out_range == (base + total, 256)
        assert bytes(arena.buf[base:base + 24]) == small.tobytes()
        sent.release(arena)
    finally:
        arena.close()


def test_a_reply_frame_that_does_not_hold_its_declared_tensor_is_an_error_naming_it():
    """Outputs are read-only views of their frames, of exactly the declared shape; a frame of any other
    size (a shorter one, or one longer than the shape, which a view would silently cut) is refused."""
    import numpy as np
    import pytest

    from gepool import _wire
    from gepool.common import errors
    from gepool.ipc import protocol

    data = np.arange(6, dtype=np.int32).reshape(2, 3)
    head = protocol.Result(1, [["Y", "INT32", [2, 3], 0], ["E", "FP32", [0, 4], 1]], False, 3).encode()
    out = _wire.result(*_wire.decode([head, memoryview(data.tobytes()), b""]), None)
    np.testing.assert_array_equal(out["Y"], data)
    assert not out["Y"].flags.writeable and out["E"].shape == (0, 4) and out.model_version == 3
    for frame in (data.tobytes()[:-4], data.tobytes() + b"\0" * 4):
        with pytest.raises(errors.Internal, match="output 'Y': a reply frame of .* INT32 tensor of shape"):
            _wire.result(*_wire.decode([head, memoryview(frame), b""]), None)


def test_a_large_header_leaves_no_grown_packer_behind():
    """A thread's Packer keeps the largest buffer it ever grew: after a header over PACKER_KEEP bytes (a
    long outputs list, say) the thread packs with a fresh one, and the next small header is still exact."""
    import numpy as np

    from gepool import _wire
    from gepool.ipc import protocol

    x = {"X": np.ones((1, 2), np.float32)}
    _wire.encode_infer("m", x, None, None, None, None, 0)
    kept = _wire._local.packer
    _wire.encode_infer("m", x, None, None, None, None, 0)
    assert _wire._local.packer is kept  # reused while headers are small
    names = [f"output-{i:06d}" for i in range(_wire.PACKER_KEEP // 8)]
    big = _wire.encode_infer("m", x, names, None, None, None, 0)
    assert len(big.frames[0]) > _wire.PACKER_KEEP and protocol.decode(big.frames[0]).outputs == names
    assert getattr(_wire._local, "packer", None) is None
    small = _wire.encode_infer("m", x, None, None, None, None, 0)
    assert protocol.decode(small.frames[0]).req_id == small.req_id and _wire._local.packer is not kept
