"""Lanes: same-host clients over a Unix SEQPACKET socket beside the ipc endpoint (ipc/lane.py)."""

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from gepool import Client, _wire
from gepool.common import errors
from gepool.ipc import lane, protocol
from tests.conftest import cpu_seconds, wait_until


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lane.tune(a)
    lane.tune(b)
    return a, b


MESSAGES = [
    [b"one part"],
    [b"header", np.arange(300_000, dtype=np.float64), b"", np.array(2.5, np.float32), np.zeros((0, 3))],
    [b"x" * (lane.RECORD_MAX - 20)],  # just fits one record with its header
    [b"y" * lane.RECORD_MAX],  # just does not
    [b"z"] * lane.MAX_PARTS,  # more buffers than one sendmsg may take
    [np.arange(12, dtype=np.int32).reshape(3, 4)[:, :2].copy()],
]


def test_framing_round_trips_every_shape_of_message():
    a, b = _pair()
    rx = lane.Receiver(readonly=True)

    def send():
        for parts in MESSAGES:
            for record in lane.records(parts):
                assert sum(memoryview(x).nbytes for x in record) <= lane.RECORD_MAX
                a.sendmsg(record)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        for sent in MESSAGES:
            while (got := rx.recv(b)) is None:
                pass
            assert [bytes(p) for p in got] == [np.asarray(p).tobytes() if isinstance(p, np.ndarray) else bytes(p)
                                               for p in sent]
            assert all(p.readonly for p in got)
    finally:
        sender.join()
        a.close()
        b.close()


def test_a_message_a_lane_cannot_frame_is_refused_before_anything_is_sent():
    with pytest.raises(lane.LaneError):
        lane.records([b""] * (lane.MAX_PARTS + 1))


@pytest.mark.parametrize("record", [
    b"\x00\x01",  # too short for a header
    b"\x00" + (5).to_bytes(4, "little"),  # five parts, no lengths
    b"\x00" + (1).to_bytes(4, "little") + (10).to_bytes(8, "little") + b"abc",  # 10 bytes declared, 3 sent
    b"\x00" + (lane.MAX_PARTS + 1).to_bytes(4, "little") + bytes(8 * (lane.MAX_PARTS + 1)),
])
def test_broken_framing_is_an_error_not_a_message(record):
    a, b = _pair()
    try:
        a.send(record)
        with pytest.raises(lane.LaneError):
            lane.Receiver().recv(b)
    finally:
        a.close()
        b.close()


def test_a_send_cut_short_closes_the_lane(tmp_path):
    """The pool stops reading mid-message: the client's send times out and the lane is closed, so
    that no later message can be read as the rest of this one."""
    path = str(tmp_path / "x.lane")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    accepted = []

    def front() -> None:  # accepts and says ACCEPTED, then never reads
        sock, _ = listener.accept()
        sock.send(lane.ACCEPTED)
        accepted.append(sock)

    t = threading.Thread(target=front)
    t.start()
    conn = lane.Connection(path)
    t.join()
    try:
        with pytest.raises(TimeoutError):
            conn.send([b"header", np.zeros(4 << 20, np.uint8)], 0.5)  # far more than the socket holds
        assert conn.sock.fileno() == -1
    finally:
        conn.close()
        for sock in accepted:
            sock.close()
        listener.close()


def test_a_reply_a_lane_cannot_frame_comes_back_as_an_error(tmp_path):
    """The front's end: a reply with more parts than a lane frames is not dropped (its client would
    wait out its timeout) but answered with an error naming why, for the same request."""
    from gepool.scheduler.lanes import Lanes

    lanes = Lanes(str(tmp_path / "f.lane"), lambda identity, parts: None)
    got: list = []
    t = threading.Thread(target=lambda: got.append(lane.Connection(lanes.path)))
    t.start()
    try:
        assert wait_until(lambda: lanes.pump(10) or not t.is_alive(), 30)
        t.join()
        (conn,) = got
        (identity,) = lanes.by_identity
        reply = protocol.Result(42, [], False, 1).encode()
        lanes.send(identity, [reply, *[b"x"] * lane.MAX_PARTS])
        msg, _ = _wire.decode(conn.recv(time.monotonic() + 30))
        assert isinstance(msg, protocol.Error) and msg.req_id == 42 and msg.code == "INTERNAL"
        assert f"at most {lane.MAX_PARTS} parts" in msg.message
        lanes.send(identity, [reply])  # the lane still works
        lanes.flush()  # (the front's loop calls it once a pass)
        assert isinstance(_wire.decode(conn.recv(time.monotonic() + 30))[0], protocol.Result)
        conn.close()
    finally:
        t.join(5)
        lanes.close()


def _lanes(client) -> int:
    """Lanes open at the front, once every lane closed before this call is gone: a lane closed earlier is
    ready in the front's epoll by the time our first query arrives, so the pass that reads that
    query, or the one after, drops it."""
    client.status()
    return client.status()["lanes"]


def _raw(pool) -> lane.Connection:
    return lane.Connection(lane.path_for(pool.endpoint[len("ipc://"):]))


def test_clients_talk_over_lanes_and_get_the_same_answers(pool, client):
    x = np.random.default_rng(3).standard_normal((32, 1024)).astype(np.float32)  # 128 KiB: several records
    with Client(pool.endpoint, lane=False) as plain:
        before = _lanes(client)
        want = plain.infer("mlp", {"INPUT": x})["LOGITS"]
        assert plain.status()["lanes"] <= before  # (a lane some earlier test left may close meanwhile)
        with Client(pool.endpoint) as fast:
            got = fast.infer("mlp", {"INPUT": x})["LOGITS"]
            assert plain.status()["lanes"] >= before + 1  # the new client's thread holds one
            np.testing.assert_array_equal(got, want)
            assert not got.flags.writeable
            with pytest.raises(errors.InvalidArgument, match="INPUT"):
                fast.infer("mlp", {"WRONG": x})
        assert wait_until(lambda: plain.status()["lanes"] <= before)


def test_a_slow_reader_never_holds_up_the_front(pool, client):
    """Replies a lane's client does not read wait in the front's queue (128 KiB each, far past the
    socket buffer); meanwhile the pool serves others, and in the end every reply arrives."""
    x = np.ones((32, 1024), np.float32)
    want = client.infer("mlp", {"INPUT": x})["LOGITS"]
    answered = client.stats()["mlp"]["requests"]
    conn = _raw(pool)
    try:
        sent = []
        for _ in range(40):
            out = _wire.encode_infer("mlp", {"INPUT": x}, None, None, None, None, 0)
            conn.send(out.frames, 10)
            sent.append(out.req_id)
        assert wait_until(lambda: client.stats()["mlp"]["requests"] >= answered + len(sent), 60)
        assert client.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})["OUTPUT0"][0, 0] == 1.0
        got = {}
        for _ in sent:
            msg, frames = _wire.decode(conn.recv(None))
            got[msg.req_id] = _wire.result(msg, frames, None)["LOGITS"]
        assert sorted(got) == sorted(sent)
        for out in got.values():
            np.testing.assert_array_equal(out, want)
    finally:
        conn.close()


def test_garbage_on_a_lane_closes_that_lane_only(pool, client):
    conn = _raw(pool)
    try:
        conn.send([b"\xc1 not msgpack"], 10)  # framed well, but no protocol message
        msg, _ = _wire.decode(conn.recv(None))
        assert isinstance(msg, protocol.Error) and msg.code == errors.ProtocolMismatch.code
        conn.sock.send(b"\x00\x01")  # broken framing: the front hangs up
        with pytest.raises(EOFError):
            conn.recv(None)
    finally:
        conn.close()
    assert client.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})["OUTPUT0"][0, 0] == 1.0


def test_no_lane_without_an_ipc_endpoint(small_pool_tcp):
    with Client(small_pool_tcp.endpoint) as c:
        assert c.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})["OUTPUT0"][0, 0] == 1.0
        assert c.status()["lanes"] == 0


@pytest.fixture
def small_pool_tcp(tmp_path):
    from gepool import Pool
    from tests import repo as test_repo

    test_repo.make_models.make_tiny(str(tmp_path))
    with Pool(str(tmp_path), endpoint="tcp://127.0.0.1:*") as pool:
        yield pool


def test_lane_socket_is_owner_only_and_goes_with_the_pool(tmp_path):
    from gepool import Pool
    from tests import repo as test_repo

    test_repo.make_models.make_tiny(str(tmp_path / "m"))
    endpoint = f"ipc://{tmp_path}/p.sock"
    path = lane.path_for(str(tmp_path / "p.sock"))
    with Pool(str(tmp_path / "m"), endpoint=endpoint):
        assert os.stat(path).st_mode & 0o777 == 0o600
    assert not os.path.exists(path)


def test_futures_go_over_the_io_threads_lane(pool, client):
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    with Client(pool.endpoint, lane=False) as plain:
        before = _lanes(client)
        with Client(pool.endpoint) as fast:
            futures = [fast.infer_async("tiny", {"INPUT0": x + i}) for i in range(200)]
            for i, fut in enumerate(futures):
                np.testing.assert_array_equal(fut.result(timeout=60)["OUTPUT0"], 2 * (x + i) + 1)
            assert plain.status()["lanes"] >= before + 2  # this thread's (the client's hello) and the I/O thread's
        [fut] = [plain.infer_async("tiny", {"INPUT0": x})]
        np.testing.assert_array_equal(fut.result(timeout=60)["OUTPUT0"], 2 * x + 1)
        assert wait_until(lambda: plain.status()["lanes"] <= before)


def test_a_request_whose_lane_send_fails_goes_by_zmq_and_the_io_thread_lives_on(pool, client):
    """A lane that breaks under a send (here: its write side shut while the front is stopped, so nothing
    reads the hang-up first) is dropped and the request that found it broken goes by ZMQ instead: the
    pool never saw it. It used to fail that request with the lane's others, then send it anyway, and
    the second answer to its finished future killed the I/O thread: no later future was ever answered."""
    import signal

    x = np.arange(16, dtype=np.float32)[None]
    front = pool.process.pid
    with Client(pool.endpoint) as c:
        np.testing.assert_array_equal(c.infer_async("tiny", {"INPUT0": x}).result(60)["OUTPUT0"], 2 * x + 1)
        io = c._io
        assert io.lane is not None  # the I/O thread's lane is up
        os.kill(front, signal.SIGSTOP)
        try:
            io.lane.sock.shutdown(socket.SHUT_WR)
            fut = c.infer_async("tiny", {"INPUT0": x + 1})
            assert wait_until(lambda: io.lane is None)  # the loop found it broken on its send
        finally:
            os.kill(front, signal.SIGCONT)
        np.testing.assert_array_equal(fut.result(60)["OUTPUT0"], 2 * (x + 1) + 1)
        np.testing.assert_array_equal(c.infer_async("tiny", {"INPUT0": x + 2}).result(60)["OUTPUT0"], 2 * (x + 2) + 1)
        assert io.is_alive()


def test_futures_from_many_threads_and_callbacks_share_the_io_threads_lane(pool, client):
    """Other threads send their requests straight onto the I/O thread's lane while the I/O thread sends
    the ones its callbacks start: 128 KiB requests take three records each, and a message whose
    records interleaved with another's would come back wrong or break the lane."""
    inputs = [np.random.default_rng(i).standard_normal((32, 1024)).astype(np.float32) for i in range(4)]
    want = [client.infer("mlp", {"INPUT": x})["LOGITS"] for x in inputs]
    results, errors_seen = [], []
    with Client(pool.endpoint) as shared:
        def chain(fut, i: int, left: int) -> None:  # runs on the I/O thread
            results.append((i, fut))
            if left:
                shared.infer_async("mlp", {"INPUT": inputs[i]}).add_done_callback(
                    lambda f: chain(f, i, left - 1))

        def caller(t: int) -> None:
            try:
                for k in range(12):
                    i = (t + k) % len(inputs)
                    fut = shared.infer_async("mlp", {"INPUT": inputs[i]})
                    if k % 4 == 0:
                        fut.add_done_callback(lambda f, i=i: chain(f, i, 2))
                    else:
                        results.append((i, fut))
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors_seen.append(exc)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors_seen
        expected = 4 * (12 + 3 * 2)  # 12 each, and 3 of them start a chain of 2 more
        assert wait_until(lambda: len(results) == expected, 60), len(results)
        for i, fut in results:
            np.testing.assert_array_equal(fut.result(timeout=60)["LOGITS"], want[i])


def test_a_future_sent_straight_does_not_wake_the_io_thread(pool, client, gate_file):
    """While the I/O thread waits on an earlier request, another thread's request goes onto the lane
    without waking it; a request due before anything it waits for still wakes it, so its timeout fires
    (the gated recorder holds it)."""
    x = np.ones((1, 16), np.float32)
    with Client(pool.endpoint) as c:
        c.infer_async("tiny", {"INPUT0": x}).result(timeout=60)  # the I/O thread and its lane are up
        batches = c.stats()["recorder"]["batches"]
        open(gate_file, "w").close()
        try:
            held = c.infer_async("recorder", {"INPUT": np.full((8, 4), -1, np.float32)}, timeout=60)
            assert wait_until(lambda: c.stats()["recorder"]["batches"] == batches + 1)
            # the held request's wake-up was read and the loop's poll now waits for its deadline: until the
            # I/O thread has run once more (a loaded host may not schedule it yet), wait_until is still
            # None and a straight send cannot know that the loop wakes in time anyway
            assert wait_until(lambda: c._io.wait_until is not None)
            wakes = c._io.wakes
            futures = [c.infer_async("tiny", {"INPUT0": x + i}) for i in range(20)]
            for i, fut in enumerate(futures):
                np.testing.assert_array_equal(fut.result(timeout=60)["OUTPUT0"], 2 * (x + i) + 1)
            assert c._io.wakes == wakes, "requests sent straight still woke the I/O thread"
            late = c.infer_async("recorder", {"INPUT": np.full((1, 4), 5, np.float32)}, timeout=0.5)
            with pytest.raises(errors.PoolUnavailable, match="in time"):
                late.result(timeout=30)
        finally:
            os.unlink(gate_file)
        assert held.result(timeout=60)["BATCH"][0, 0] == 8


def test_the_asyncio_client_uses_a_lane_too(pool, client):
    import asyncio

    from gepool import AsyncClient

    x = np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)
    before = _lanes(client)

    async def run(lane: bool) -> int:
        async with AsyncClient(pool.endpoint, lane=lane) as c:
            outs = await asyncio.gather(*(c.infer("tiny", {"INPUT0": x + i}) for i in range(100)))
            for i, out in enumerate(outs):
                np.testing.assert_array_equal(out["OUTPUT0"], 2 * (x + i) + 1)
            return (await c.status())["lanes"]

    assert asyncio.run(run(True)) >= before + 1
    before = _lanes(client)
    assert asyncio.run(run(False)) <= before


def test_more_lanes_than_select_can_watch(pool, client):
    """Over a thousand lanes: the front's descriptors pass FD_SETSIZE, and it still answers on each."""
    import resource

    want = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want + 200:
        pytest.skip(f"the hard descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want + 200), hard))
    conns = []
    try:
        for _ in range(want):
            conns.append(_raw(pool))
        assert wait_until(lambda: client.status()["lanes"] >= want)
        x = np.arange(16, dtype=np.float32)[None]
        for conn in (conns[0], conns[-1]):
            out = _wire.encode_infer("tiny", {"INPUT0": x}, None, None, None, None, 0)
            conn.send(out.frames, 10)
            msg, frames = _wire.decode(conn.recv(None))
            np.testing.assert_array_equal(_wire.result(msg, frames, None)["OUTPUT0"], 2 * x + 1)
    finally:
        for conn in conns:
            conn.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert wait_until(lambda: client.status()["lanes"] < want)


def test_out_of_descriptors_the_front_pauses_accepting_and_catches_up(pool, client):
    """With the front at its descriptor limit, new lanes wait in the backlog: the front neither spins
    on a listener it cannot accept from nor drops their requests; once descriptors are free again,
    every one is answered. (No ZMQ client may connect meanwhile: libzmq aborts a process whose ipc
    listener meets EMFILE, which is why the front caps its lanes well below the limit.)"""
    import resource
    import time

    front = pool.process.pid
    soft, hard = resource.prlimit(front, resource.RLIMIT_NOFILE)
    x = np.arange(16, dtype=np.float32)[None]
    socks, accepted = [], []
    path = lane.path_for(pool.endpoint[len("ipc://"):])
    try:
        resource.prlimit(front, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{front}/fd")) + 4, hard))
        for _ in range(30):  # raw sockets: a lane.Connection would wait for the front's ACCEPTED
            socks.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            socks[-1].connect(path)
            out = _wire.encode_infer("tiny", {"INPUT0": x}, None, None, None, None, 0)
            for record in lane.records(out.frames):
                socks[-1].sendmsg(record)
        cpu = cpu_seconds(front)
        time.sleep(2.0)
        assert cpu_seconds(front) - cpu < 0.5, "the front spun on a listener it could not accept from"
    finally:
        resource.prlimit(front, resource.RLIMIT_NOFILE, (soft, hard))
    try:
        for sock in socks:
            sock.settimeout(30)
            rx = lane.Receiver()
            while (first := rx.recv(sock)) is None:
                pass
            assert first == []  # ACCEPTED
            while (parts := rx.recv(sock)) is None:
                pass
            msg, frames = _wire.decode(parts)
            np.testing.assert_array_equal(_wire.result(msg, frames, None)["OUTPUT0"], 2 * x + 1)
            accepted.append(sock)
    finally:
        for sock in socks:
            sock.close()
    assert len(accepted) == 30


def test_past_its_lane_cap_the_front_refuses_and_clients_fall_back_to_zmq(pool, client):
    import resource

    from gepool.scheduler import lanes

    front = pool.process.pid
    soft, hard = resource.prlimit(front, resource.RLIMIT_NOFILE)
    open_now = _lanes(client)
    x = np.arange(16, dtype=np.float32)[None]
    conns = []
    try:
        resource.prlimit(front, resource.RLIMIT_NOFILE, (lanes.FD_RESERVE + lanes.MIN_LANES, hard))
        for _ in range(lanes.MIN_LANES - open_now):
            conns.append(_raw(pool))
        with pytest.raises(ConnectionRefusedError):
            _raw(pool)
        with Client(pool.endpoint) as c:  # its lane is refused: ZMQ serves it
            np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
            assert c.status()["lanes"] == lanes.MIN_LANES
    finally:
        resource.prlimit(front, resource.RLIMIT_NOFILE, (soft, hard))
        for conn in conns:
            conn.close()



def test_a_thread_that_ends_takes_its_lane_with_it(pool, client):
    """Each thread gets its own lane; one that ends must not leave it (and a descriptor in the front)."""
    x = np.zeros((1, 16), np.float32)
    with Client(pool.endpoint) as c:
        base = _lanes(client)
        seen = []

        def work() -> None:
            c.infer("tiny", {"INPUT0": x})
            seen.append(c.status()["lanes"])

        for _ in range(3):
            t = threading.Thread(target=work)
            t.start()
            t.join()
        assert seen and all(n >= base + 1 for n in seen), seen
        assert wait_until(lambda: client.status()["lanes"] <= base)
        assert c.infer("tiny", {"INPUT0": x})["OUTPUT0"][0, 0] == 1.0


def test_a_declared_size_over_the_limit_is_refused_and_its_records_dropped():
    a, b = _pair()
    rx = lane.Receiver(limit=lambda: 100_000)
    try:
        big = [b"head", b"\1" * 150_000]  # over the limit: three records
        for record in lane.records(big):
            a.sendmsg(record)
        with pytest.raises(lane.Oversized) as caught:
            rx.recv(b)
        assert caught.value.head == b"head" and caught.value.limit == 100_000
        assert "larger than the 100000" in str(caught.value)
        while rx.skip:  # the rest of it is read and thrown away
            assert rx.recv(b) is None
        small = [b"next", b"\2" * 80_000]  # under the limit: the lane carries on
        for record in lane.records(small):
            a.sendmsg(record)
        while (got := rx.recv(b)) is None:
            pass
        assert [bytes(p) for p in got] == small
    finally:
        a.close()
        b.close()


def test_a_declared_size_costs_no_memory_until_its_bytes_arrive():
    from tests.conftest import rss_kb

    a, b = _pair()
    rx = lane.Receiver(limit=lambda: 4 << 30)
    try:
        before = rss_kb(os.getpid())
        receivers = []
        for _ in range(2):  # 1 GiB declared, 100 bytes sent, twice
            a.send(b"\x01" + struct.pack("<I2Q", 2, 4, 1 << 30) + b"head" + b"\0" * 64)
            r = lane.Receiver(limit=lambda: 4 << 30)
            assert r.recv(b) is None and r.body is not None
            receivers.append(r)
        assert rss_kb(os.getpid()) - before < 50 * 1024
        del receivers, rx
    finally:
        a.close()
        b.close()


def test_asyncio_sends_that_fill_the_lane_keep_each_message_whole(tmp_path):
    """Many messages of several records each, sent at once from one event loop into a lane that is read
    slowly: a send that finds the socket full waits under the lane's lock, and the sends that come
    meanwhile queue behind it, so every message arrives whole and none is interleaved with another."""
    import asyncio

    from gepool import AsyncClient

    ours, theirs = _pair()
    ours.setblocking(False)
    messages = [[f"message {i}".encode(), np.full(3 * lane.RECORD_MAX // 8 + i, i, np.float64)] for i in range(40)]
    got, broken = [], []

    def read_slowly():
        rx = lane.Receiver()
        try:
            while len(got) < len(messages):
                parts = rx.recv(theirs)
                if parts is not None:
                    got.append([bytes(p) for p in parts])
                time.sleep(0.0005)
        except (lane.LaneError, OSError) as exc:  # interleaved records: the senders hear the lane close
            broken.append(exc)
            theirs.close()

    async def send_all() -> list[bool]:
        client = AsyncClient(f"ipc://{tmp_path}/none.sock")
        client._lane, client._dialer.retry_at = ours, float("inf")

        async def send(i: int) -> bool:  # staggered: some start while another waits mid-message
            await asyncio.sleep(i * 0.002)
            return await client._send_lane(messages[i], i)

        try:
            return await asyncio.wait_for(asyncio.gather(*(send(i) for i in range(len(messages)))), 60)
        finally:
            client._lane = None
            await client.close()

    reader = threading.Thread(target=read_slowly)
    reader.start()
    try:
        sent = asyncio.run(send_all())
    finally:
        reader.join(60)
        ours.close()
        theirs.close()
    assert not broken and sent == [True] * len(messages)
    assert sorted(got) == sorted([[m[0], m[1].tobytes()] for m in messages])
    assert all(len(g[1]) == messages[int(g[0].split()[1])][1].nbytes for g in got)


def test_owns_answers_as_the_identity_test_does_for_open_closed_foreign_and_unminted_identities(tmp_path):
    """``owns`` answers an open lane's identity from the lane map before its test of the bytes: True for every
    identity minted here, a lane closed since included (its replies are dropped, never sent over ZMQ), and
    False for any other (unminted, the never-minted 0, ZMQ's own, any other length or first byte)."""
    from gepool.scheduler.lanes import _ID, MARK, Lanes

    lanes = Lanes(str(tmp_path / "o.lane"), lambda identity, parts: None)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(lane.Connection(lanes.path))) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        assert wait_until(lambda: (lanes.pump(10), len(lanes.by_identity) == 2)[1], 30)
        for t in threads:
            t.join()
        open_one, closed_one = sorted(lanes.by_identity)
        lanes._drop(lanes.by_identity[closed_one])
        assert open_one in lanes.by_identity and closed_one not in lanes.by_identity

        expected = [(open_one, True), (closed_one, True), (_ID.pack(MARK, lanes._minted + 1), False),
                    (_ID.pack(MARK, 0), False), (b"\0client", False), (b"\x00" + open_one[1:], False),
                    (open_one + b"x", False), (open_one[:-1], False), (b"", False), (b"\x01", False),
                    (bytes(9), False)]
        assert [(identity, lanes.owns(identity)) for identity, _ in expected] == expected
        assert lanes.owns(open_one) and lanes.owns(closed_one) and not lanes.owns(b"\0client")
    finally:
        for c in got:
            c.close()
        lanes.close()
