"""Many messages in one lane record (ipc/lane.py's BATCH): the framing, hostile batches, the front's replies
of one pass, the asyncio client's sends of one loop pass, and a real sidecar under many connections."""

import asyncio
import http.client
import json
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest

from gepool import AsyncClient, Pool, _wire
from gepool.ipc import lane, protocol
from tests import repo as test_repo
from tests.conftest import free_port, wait_until


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lane.tune(a)
    lane.tune(b)
    return a, b


def _bytes(parts) -> list[bytes]:
    return [np.asarray(p).tobytes() if isinstance(p, np.ndarray) else bytes(p) for p in parts]


def _read_all(rx: lane.Receiver, sock, want: int) -> tuple[list[list[bytes]], int]:
    """``want`` messages off ``sock`` and how many records carried them."""
    got, records = [], 0
    while len(got) < want:
        messages = rx.take(sock)
        records += 1
        if messages is not None:
            got += [[bytes(p) for p in m] for m in messages]
    return got, records


SMALL = [[b"h%d" % i, np.arange(i % 7, dtype=np.int32), b"", b"t" * (i * 37 % 500)] for i in range(300)]


def test_messages_ready_together_travel_in_few_records_and_come_back_whole_in_order():
    a, b = _pair()
    try:
        records = lane.batched([lane.record(m) for m in SMALL])
        assert 1 < len(records) < len(SMALL) // 10
        assert all(sum(memoryview(x).nbytes for x in r) <= lane.RECORD_MAX for r in records)
        assert sum(lane.completes(r) for r in records) == len(SMALL)
        for r in records:
            a.sendmsg(r)
        got, read = _read_all(lane.Receiver(), b, len(SMALL))
        assert read == len(records)
        assert got == [_bytes(m) for m in SMALL]
        for r in records:  # recv() hands the same messages one at a time
            a.sendmsg(r)
        rx = lane.Receiver()
        assert [[bytes(p) for p in rx.recv(b)] for _ in SMALL] == [_bytes(m) for m in SMALL]
        assert not rx.backlog
    finally:
        a.close()
        b.close()


def test_a_lone_message_keeps_its_own_framing_and_batches_respect_their_limits():
    one = [b"header", np.arange(5, dtype=np.float64)]
    joined = lambda r: b"".join(bytes(memoryview(x)) for x in r)  # noqa: E731
    assert [joined(r) for r in lane.batched([lane.record(one)])] == [joined(r) for r in lane.records(one)]
    empties = lane.batched([lane.record([b""]) for _ in range(3 * lane.MAX_BATCH)])
    assert [lane.completes(r) for r in empties] == [lane.MAX_BATCH] * 3
    wide = lane.batched([lane.record([bytes(20_000)]) for _ in range(7)])
    assert [lane.completes(r) for r in wide] == [3, 3, 1]  # 3 x 20 KiB fit under RECORD_MAX, 4 do not
    assert lane.record([bytes(lane.RECORD_MAX)]) is None  # needs two records: never batched


def _count_framings(monkeypatch) -> list[int]:
    """lane.record counted from now on: [calls so far] (the test may reset it)."""
    calls = [0]
    record = lane.record

    def counted(parts):
        calls[0] += 1
        return record(parts)

    monkeypatch.setattr(lane, "record", counted)
    return calls


def test_framed_keeps_order_across_runs_and_long_messages_and_frames_each_once(monkeypatch):
    """lane.framed (what all three senders use): runs of one-record messages batched, longer ones as their
    own records, in order; lane.frame calls record() once per message, long ones included."""
    calls = _count_framings(monkeypatch)
    messages = [[b"long %d" % i, np.full(lane.RECORD_MAX + i, i, np.uint8)] if i % 7 == 3 else m
                for i, m in enumerate(SMALL[:60])]
    items = [lane.frame(m) for m in messages]
    assert calls[0] == len(messages)
    records = lane.framed(items)
    assert sum(lane.completes(r) for r in records) == len(messages)
    assert len(records) < len(messages)
    a, b = _pair()
    try:
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(_read_all(lane.Receiver(), b, len(messages))[0]))
        reader.start()
        for r in records:
            a.sendmsg(r)
        reader.join(60)
        assert got == [_bytes(m) for m in messages]
    finally:
        a.close()
        b.close()


def test_a_long_reply_from_the_front_is_framed_once(tmp_path, monkeypatch):
    lanes, conn, identity = _front_lanes(tmp_path)
    calls = _count_framings(monkeypatch)
    try:
        parts = [b"long reply", np.full(2 * lane.RECORD_MAX, 3, np.uint8)]
        lanes.send(identity, parts, copy=True)
        assert calls[0] == 1
        lanes.flush()
        assert _read_all(conn.receiver, conn.sock, 1)[0] == [_bytes(parts)]
    finally:
        conn.close()
        lanes.close()


def _inner(parts: list[bytes], flag: int = 0) -> bytes:
    return bytes([flag]) + struct.pack(f"<I{len(parts)}Q", len(parts), *map(len, parts)) + b"".join(parts)


def _batch(inners: list[bytes], count: int | None = None, flag: int = lane.BATCH) -> bytes:
    body = b"".join(struct.pack("<I", len(m)) + m for m in inners)
    return struct.pack("<BI", flag, len(inners) if count is None else count) + body


GOOD = _inner([b"fine"])
HOSTILE = {
    "no-messages": _batch([]),
    "too-many": struct.pack("<BI", lane.BATCH, lane.MAX_BATCH + 1) + _inner([b""]) * 4,
    "count-over-what-it-carries": _batch([GOOD, GOOD], count=3),
    "count-under-what-it-carries": _batch([GOOD, GOOD, GOOD], count=2),
    "length-past-the-record": struct.pack("<BII", lane.BATCH, 1, 1000) + GOOD,
    "nested-batch": _batch([GOOD, _batch([GOOD, GOOD])]),
    "inner-continues": _batch([GOOD, _inner([b"more"], flag=lane.MORE)]),
    "inner-sizes-disagree": _batch([GOOD, bytes([0]) + struct.pack("<IQ", 1, 10) + b"abc"]),
    "inner-too-short": _batch([GOOD, b"\x00\x01"]),
    "batch-spanning-records": _batch([GOOD, GOOD], flag=lane.BATCH | lane.MORE),
    "unknown-flag": b"\x04" + _inner([b"x"])[1:],
}


@pytest.mark.parametrize("record", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_batch_is_a_lane_error_and_delivers_nothing(record):
    a, b = _pair()
    try:
        a.send(record)
        rx = lane.Receiver()
        with pytest.raises(lane.LaneError):
            rx.recv(b)
        assert not rx.backlog
    finally:
        a.close()
        b.close()


def test_a_batch_inside_a_long_message_is_a_lane_error():
    a, b = _pair()
    try:
        first, *_ = lane.records([bytes(3 * lane.RECORD_MAX)])
        a.sendmsg(first)
        a.send(_batch([GOOD, GOOD]))  # where the message's next record belongs
        rx = lane.Receiver()
        assert rx.take(b) is None
        with pytest.raises(lane.LaneError, match="inside a message"):
            rx.take(b)
    finally:
        a.close()
        b.close()


def _raw(pool) -> lane.Connection:
    return lane.Connection(lane.path_for(pool.endpoint[len("ipc://"):]))


def _query(req_id: int) -> bytes:
    return _inner([protocol.Query(req_id, "status", {}).encode()])


def test_the_front_takes_a_batch_whole_and_a_hostile_one_closes_only_that_lane(pool, client):
    bad, good = _raw(pool), _raw(pool)
    try:
        bad.sock.send(_batch([_query(1), _query(2)]))
        replies = [_wire.decode(bad.recv(time.monotonic() + 60))[0] for _ in range(2)]
        assert sorted(r.req_id for r in replies) == [1, 2] and all(isinstance(r, protocol.Reply) for r in replies)
        # a good query first, then a nested batch: nothing of the record is handled, the lane closes
        bad.sock.send(_batch([_query(3), _batch([_query(4), _query(5)])]))
        with pytest.raises(EOFError):
            bad.recv(time.monotonic() + 60)
        good.sock.send(_batch([_query(6), _query(7)]))
        assert sorted(_wire.decode(good.recv(time.monotonic() + 60))[0].req_id for _ in range(2)) == [6, 7]
    finally:
        bad.close()
        good.close()
    assert client.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})["OUTPUT0"][0, 0] == 1.0


def _front_lanes(tmp_path, limit: int | None = None):
    from gepool.scheduler.lanes import Lanes

    lanes = Lanes(str(tmp_path / "f.lane"), lambda identity, parts: None)
    if limit is not None:
        lanes.limit = lambda: limit
    got: list = []
    t = threading.Thread(target=lambda: got.append(lane.Connection(lanes.path)))
    t.start()
    assert wait_until(lambda: lanes.pump(10) or not t.is_alive(), 30)
    t.join()
    (conn,) = got
    (identity,) = lanes.by_identity
    return lanes, conn, identity


def test_the_fronts_replies_of_one_pass_go_as_few_records_in_order_and_survive_their_slot(tmp_path):
    """Replies made before a flush arrive as few records as hold them, in the order made; replies viewing a
    slot (``copy``) go at settle(), with what their lane batched before them, and arrive as they were
    though the slot is refilled right after; a long reply keeps its place; the rest waits for the flush."""
    lanes, conn, identity = _front_lanes(tmp_path)
    try:
        slot = bytearray(64 * 10)
        sent = []
        for i in range(10):
            parts = [b"reply %d" % i, bytes([i]) * 64]
            lanes.send(identity, parts)
            sent.append(_bytes(parts))
        assert not _readable(conn.sock)  # they wait for the flush
        for i in range(10):  # a completion's replies, each viewing its rows of the slot
            slot[64 * i:64 * i + 64] = bytes([100 + i]) * 64
            parts = [b"view %d" % i, memoryview(slot)[64 * i:64 * i + 64]]
            lanes.send(identity, parts, copy=True)
            sent.append(_bytes(parts))
        lanes.settle()  # before the slot is released: these 20 go now, in one record
        assert _readable(conn.sock)
        slot[:] = bytes(len(slot))  # the slot refilled before the pass ends
        parts = [b"long reply", np.full(lane.RECORD_MAX, 7, np.uint8)]
        lanes.send(identity, parts)
        sent.append(_bytes(parts))
        for i in range(10):
            parts = [b"after %d" % i, bytes([200 + i]) * 64]
            lanes.send(identity, parts)
            sent.append(_bytes(parts))
        lanes.flush()
        got, records = _read_all(conn.receiver, conn.sock, len(sent))
        assert got == sent
        assert records == 1 + 2 + 1  # a batch at settle, the long reply's two records, a batch at the flush
    finally:
        conn.close()
        lanes.close()


def _readable(sock) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_replies_that_find_the_socket_full_wait_as_copies_and_arrive_in_order(tmp_path):
    """~3 MiB of replies, far past the socket buffer: what finds it full waits in the lane's queue, each a
    copy of what the reply viewed at settle() (the slot is rewritten by the next completion)."""
    lanes, conn, identity = _front_lanes(tmp_path)
    try:
        sent = []
        slot = bytearray(10 * 1050)
        for i in range(3000):
            k = i % 10
            n = 1000 + i % 50
            slot[1050 * k:1050 * k + n] = bytes([i % 251]) * n
            parts = [b"reply %d" % i, memoryview(slot)[1050 * k:1050 * k + n]]
            if i % 500 == 250:
                parts.append(np.full(3 * lane.RECORD_MAX, i % 7, np.uint8))
            lanes.send(identity, parts, copy=True)
            sent.append(_bytes(parts))
            if k == 9:
                lanes.settle()  # a completion's replies, before its slot is refilled
            if i % 100 == 99:
                lanes.flush()  # a pass of the front's loop
        lanes.flush()
        slot[:] = bytes(len(slot))
        (front,) = lanes.by_fd.values()
        assert front.queue  # the socket is full: the rest waits in the lane's queue
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(_read_all(conn.receiver, conn.sock, len(sent))[0]))
        reader.start()
        assert wait_until(lambda: lanes.pump(10) or not reader.is_alive(), 60)
        reader.join(60)
        assert got == sent
    finally:
        conn.close()
        lanes.close()


def test_asyncio_requests_of_one_pass_share_records_both_ways_and_each_gets_its_own_answer(pool):
    """Many infers at once from one event loop, small ones (tiny) and ones of several records (mlp, 128
    KiB) mixed: every answer is its own request's, and the lane carried fewer records than messages
    each way (the front answers a batch of tiny's requests in one pass)."""
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((1 + i % 8, 16)).astype(np.float32) for i in range(240)]
    big = rng.standard_normal((32, 1024)).astype(np.float32)

    async def run():
        async with AsyncClient(pool.endpoint) as c:
            want = (await c.infer("mlp", {"INPUT": big}))["LOGITS"]
            before = dict(c.lane_counts)
            calls = [c.infer("mlp", {"INPUT": big}) if i % 40 == 0 else c.infer("tiny", {"INPUT0": x})
                     for i, x in enumerate(xs)]
            outs = await asyncio.gather(*calls)
            counts = {k: v - before[k] for k, v in c.lane_counts.items()}
            return want, outs, counts

    want, outs, counts = asyncio.run(run())
    for i, (x, out) in enumerate(zip(xs, outs)):
        if i % 40 == 0:
            np.testing.assert_array_equal(out["LOGITS"], want)
        else:
            np.testing.assert_array_equal(out["OUTPUT0"], 2 * x + 1)
    assert counts["messages_sent"] == counts["messages_read"] == len(xs)
    assert counts["records_sent"] < counts["messages_sent"] // 4, counts
    assert counts["records_read"] < counts["messages_read"], counts


def test_replies_viewing_a_slot_survive_its_refill_before_the_pass_ends(pool):
    """Hundreds of requests of 1-8 rows at once on one lane, to tiny (max_batch 8, one worker, 2 slots): a
    completion's replies view its slot, which the same pass releases and refills with the next batch (of
    another size, so its inputs cover where the last outputs were) before the loop's flush. Every answer
    is 2x + 1 of its own input, bit for bit."""
    xs = [(np.arange(16 * (1 + i % 8), dtype=np.float32).reshape(-1, 16) + 1000 * i) for i in range(600)]

    async def run():
        async with AsyncClient(pool.endpoint) as c:
            await c.infer("tiny", {"INPUT0": xs[0]})
            assert c._lane is not None
            before = dict(c.lane_counts)
            outs = await asyncio.gather(*[c.infer("tiny", {"INPUT0": x}) for x in xs])
            return outs, {k: v - before[k] for k, v in c.lane_counts.items()}

    outs, counts = asyncio.run(run())
    bad = [i for i, (x, out) in enumerate(zip(xs, outs)) if out["OUTPUT0"].tobytes() != (2 * x + 1).tobytes()]
    assert not bad, f"{len(bad)} of {len(xs)} answers changed, the first {bad[:5]}"
    assert counts["messages_read"] == len(xs) and counts["records_read"] < len(xs), counts


def test_asyncio_and_io_thread_frame_a_long_request_once(pool, monkeypatch):
    from gepool import Client

    big = np.ones((32, 1024), np.float32)  # 128 KiB: several records
    calls = _count_framings(monkeypatch)

    async def run():
        async with AsyncClient(pool.endpoint) as c:
            await c.infer("mlp", {"INPUT": big})
            assert c._lane is not None
            calls[0] = 0
            out = await c.infer("mlp", {"INPUT": big})
            return out, calls[0]

    first, framings = asyncio.run(run())
    assert framings == 1
    with Client(pool.endpoint) as c:
        c.infer_async("mlp", {"INPUT": big}).result(60)
        calls[0] = 0
        futs = [c.infer_async("mlp", {"INPUT": big}) for _ in range(4)]
        outs = [f.result(60) for f in futs]
    assert calls[0] == len(futs)
    for out in outs:
        np.testing.assert_array_equal(out["LOGITS"], first["LOGITS"])


def test_asyncio_lane_counts_count_records_of_long_messages_each(pool):
    """One mlp request of 128 KiB (three records) and its 125 KiB answer (two): the counters say so."""
    big = np.ones((32, 1024), np.float32)

    async def run():
        async with AsyncClient(pool.endpoint) as c:
            await c.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})
            before = dict(c.lane_counts)
            await c.infer("mlp", {"INPUT": big})
            return {k: v - before[k] for k, v in c.lane_counts.items()}

    counts = asyncio.run(run())
    assert counts == {"records_sent": 3, "messages_sent": 1, "records_read": 2, "messages_read": 1}


def test_asyncio_sends_queued_when_the_lane_dies_go_by_zmq(pool):
    x = np.arange(16, dtype=np.float32).reshape(1, 16)

    async def run():
        async with AsyncClient(pool.endpoint) as c:
            await c.infer("tiny", {"INPUT0": x})
            assert c._lane is not None
            tasks = [asyncio.ensure_future(c.infer("tiny", {"INPUT0": x + i})) for i in range(20)]
            while len(c._outq) < len(tasks):  # each task's first step queues its request
                await asyncio.sleep(0)
            assert c._flush_at is not None  # and the flush that sends them has not run yet
            c._lane.shutdown(socket.SHUT_WR)  # the flush's sendmsg fails: the lane is lost
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return outs, c._lane

    outs, lane_after = asyncio.run(run())
    assert lane_after is None
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * (x + i) + 1)


def test_the_io_threads_callbacks_send_what_a_batch_of_replies_started_together(pool):
    """Closed loops on one sync client's futures: each answer's callback (on the I/O thread) sends the
    next request. The replies of a pass arrive in one record, every callback runs, and the requests they
    queued go out sharing records; every chain still gets its own answers."""
    from gepool import Client

    xs = [np.full((1, 16), i, np.float32) for i in range(48)]
    got: dict[int, list] = {i: [] for i in range(len(xs))}
    done = threading.Event()
    left = [len(xs)]
    lock = threading.Lock()

    with Client(pool.endpoint) as c:
        c.infer("tiny", {"INPUT0": xs[0]})

        def step(fut, i: int, k: int) -> None:
            got[i].append(fut.result()["OUTPUT0"])
            if k:
                c.infer_async("tiny", {"INPUT0": xs[i] + k}).add_done_callback(lambda f: step(f, i, k - 1))
                return
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        for i, x in enumerate(xs):
            c.infer_async("tiny", {"INPUT0": x}).add_done_callback(lambda f, i=i: step(f, i, 10))
        assert done.wait(120)
        batched = c._io.batched
    for i, x in enumerate(xs):
        want = [2 * x + 1] + [2 * (x + k) + 1 for k in range(10, 0, -1)]
        assert len(got[i]) == len(want)
        for a, b in zip(got[i], want):
            np.testing.assert_array_equal(a, b)
    assert batched > 0


WIDE = 8192  # floats per row: 32 KiB, so 3 rows need several lane records


@pytest.fixture(scope="module")
def http_pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("batch-models"))
    test_repo.make_models.make_tiny(repo)
    test_repo.make_models.make_tiny(repo, name="wide", width=WIDE, max_batch=4)
    with Pool(repo, http_port=free_port(), metrics_port=0) as pool:
        yield pool


def test_many_connections_through_the_sidecar_each_get_their_own_answer(http_pool):
    """48 connections at once, small JSON requests and binary ones of several lane records mixed on each:
    every answer is 2x + 1 of what that connection sent in that request."""
    failures: list[str] = []

    def one(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", http_pool.http_port, timeout=120)
        try:
            for j in range(8):
                rng = np.random.default_rng(i * 100 + j)
                if (i + j) % 4 == 0:
                    model, x = "wide", rng.standard_normal((1 + j % 3, WIDE)).astype(np.float32)
                    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape),
                                                     "parameters": {"binary_data_size": x.nbytes}}],
                                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]})
                    body = header.encode() + x.tobytes()
                    headers = {"Inference-Header-Content-Length": str(len(header))}
                else:
                    model, x = "tiny", rng.standard_normal((1, 16)).astype(np.float32)
                    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                                   "data": x.ravel().tolist()}]}).encode()
                    headers = {}
                conn.request("POST", f"/v2/models/{model}/infer", body, headers)
                resp = conn.getresponse()
                raw = resp.read()
                if resp.status != 200:
                    failures.append(f"{i}/{j}: {resp.status} {raw[:200]!r}")
                    return
                hlen = resp.getheader("Inference-Header-Content-Length")
                if hlen is not None:
                    got = np.frombuffer(raw[int(hlen):], np.float32)
                else:
                    got = np.array(json.loads(raw)["outputs"][0]["data"], dtype=np.float32)
                if got.tobytes() != (x * np.float32(2) + np.float32(1)).ravel().tobytes():
                    failures.append(f"{i}/{j}: not its own answer")
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures[:5]

