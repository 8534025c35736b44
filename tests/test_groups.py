"""Groups of requests (protocol.Infer.members): what one pass of an AsyncClient's loop submits goes as one
message, runs as one request where its model cannot tell the difference, and every member gets its own
answer and counts as a request of its own; hostile groups are refused, member by member."""

import asyncio

import msgpack
import numpy as np
import pytest
import zmq

from gepool import Pool
from gepool.aio import AsyncClient
from gepool.common import errors
from gepool.ipc import protocol
from tests import repo as test_repo

MAX_BATCH = 8


def _config(repo: str, name: str, scheduling: str, width: int = 16) -> None:
    test_repo.make_models.make_tiny(repo, name, width=width, max_batch=MAX_BATCH)
    path = f"{repo}/{name}/config.pbtxt"
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("dynamic_batching { }", scheduling))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("groups"))
    _config(repo, "tiny", "dynamic_batching { }")
    _config(repo, "plain", "")  # Triton's default scheduler: one request per execution
    _config(repo, "capped", "dynamic_batching { default_queue_policy { max_queue_size: 1000 } }")
    with Pool(repo) as p:
        yield p


def _submit_all(pool, model: str, shapes: list[int], outputs=None) -> tuple[dict, dict, dict, dict]:
    """Submits one request per entry of ``shapes`` (its rows; request i holds the value i) in one loop pass;
    returns (answers by index, the client's lane counts for them, the model's stats before, after)."""

    async def run():
        client = AsyncClient(pool.endpoint)
        await client.start()
        try:
            await client.infer(model, {"INPUT0": np.zeros((1, 16), np.float32)})  # the lane is open
            before = (await client.stats())[model]
            counts = dict(client.lane_counts)
            answers, every = {}, asyncio.Event()

            def done_for(i):
                def done(out, exc):
                    answers[i] = (out, exc)
                    if len(answers) == len(shapes):
                        every.set()
                return done

            for i, rows in enumerate(shapes):
                assert client.submit(model, {"INPUT0": np.full((rows, 16), i, np.float32)}, outputs, done_for(i),
                                     origin=protocol.Origin.HTTP)
            await asyncio.wait_for(every.wait(), 60)
            read = {k: client.lane_counts[k] - counts[k] for k in counts}
            after = (await client.stats())[model]
            return answers, read, before, after
        finally:
            await client.close()

    return asyncio.run(run())


def _check_answers(answers: dict, shapes: list[int]) -> None:
    for i, rows in enumerate(shapes):
        out, exc = answers[i]
        assert exc is None, f"request {i}: {exc}"
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((rows, 16), 2.0 * i + 1, np.float32))


def test_a_group_runs_as_one_and_each_member_gets_its_rows_and_counts(pool):
    shapes = [1, 2, 1, 3, 1]  # 8 rows: one batch of the model
    answers, read, before, after = _submit_all(pool, "tiny", shapes)
    _check_answers(answers, shapes)
    assert read["messages_sent"] == 1 and read["messages_read"] == 1  # one group, one answer
    assert after["requests"] - before["requests"] == len(shapes)  # each member counts as a request
    assert after["rows"] - before["rows"] == sum(shapes)
    assert after["batches"] - before["batches"] == 1
    assert after["histograms"]["request"]["count"] - before["histograms"]["request"]["count"] == len(shapes)
    assert after["histograms"]["queue"]["count"] - before["histograms"]["queue"]["count"] == len(shapes)
    http = after["protocols"]["http"]["requests"] - before["protocols"]["http"]["requests"]
    assert http == len(shapes)


def test_a_group_past_the_largest_batch_runs_as_runs_that_fit(pool):
    shapes = [3, 3, 3, 3, 1, 20, 2]  # 20 rows cannot run: that member alone hears why
    answers, read, before, after = _submit_all(pool, "tiny", shapes)
    _, exc = answers[5]
    assert isinstance(exc, errors.InvalidArgument) and "batch" in str(exc).lower()
    for i, rows in enumerate(shapes):
        if i != 5:
            assert answers[i][1] is None
            np.testing.assert_array_equal(answers[i][0]["OUTPUT0"], np.full((rows, 16), 2.0 * i + 1, np.float32))
    assert read["messages_sent"] == 1
    assert read["messages_read"] < len(shapes)  # runs answered together: [3, 3], [3, 3, 1], [20], [2]
    assert after["requests"] - before["requests"] == len(shapes) - 1
    assert after["failures"] - before["failures"] == 1


@pytest.mark.parametrize("model", ["plain", "capped"])
def test_a_model_that_could_tell_runs_each_member_on_its_own(pool, model):
    shapes = [1, 2, 1]
    answers, read, before, after = _submit_all(pool, model, shapes)
    _check_answers(answers, shapes)
    assert read["messages_sent"] == 1 and read["messages_read"] == len(shapes)  # one answer each
    assert after["requests"] - before["requests"] == len(shapes)
    if model == "plain":  # the default scheduler runs one request per execution
        assert after["batches"] - before["batches"] == len(shapes)


def test_outputs_asked_for_and_an_unknown_model_reach_every_member(pool):
    shapes = [1, 1, 2]
    answers, _, _, _ = _submit_all(pool, "tiny", shapes, outputs=["OUTPUT0"])
    _check_answers(answers, shapes)
    answers, _, _, _ = _submit_all(pool, "tiny", shapes, outputs=["NOPE"])
    assert all(isinstance(exc, errors.InvalidArgument) and "NOPE" in str(exc) for _, exc in answers.values())


def _ask(sock, header: list, frames: list) -> list:
    """The replies (decoded) to one raw message, until the pool stays quiet for a second."""
    sock.send_multipart([msgpack.packb([int(protocol.MsgType.INFER), *header], use_bin_type=True), *frames])
    out = []
    while sock.poll(1000):
        out.append(protocol.decode(sock.recv_multipart()[0]))
    return out


def _group(req_id: int, rows: int, members, datatype="FP32", shape=None, model="tiny") -> list:
    return [req_id, model, -1, [["INPUT0", datatype, shape or [rows, 16], 0]], None, 0, 0, protocol.NO_ARENA, 0, 0,
            0, 0, None, members]


@pytest.mark.parametrize("members, words", [
    ("x", "members must be a list"), ([[5, 1]], "members must be a list"), ([[5, 1], [6, 0]], "rows > 0"),
    ([[5, 1], ["6", 1]], "[req_id, rows > 0]"), ([[5, 1], [6, 1, 7]], "[req_id, rows > 0]"),
    ([[5, 1]] * 1025, "members must be a list"),
])
def test_a_group_whose_members_cannot_be_read_is_refused_under_its_own_id(pool, members, words):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(pool.endpoint)
        (reply,) = _ask(sock, _group(99, 2, members), [np.zeros((2, 16), np.float32).tobytes()])
        assert type(reply) is protocol.Error and reply.req_id == 99 and words in reply.message
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.parametrize("header, frame, words", [
    (_group(99, 3, [[5, 1], [6, 1]]), np.zeros((3, 16), np.float32).tobytes(), "hold 2 rows, its tensors 3"),
    (_group(99, 2, [[5, 1], [6, 1]]), np.zeros((3, 16), np.float32).tobytes(), "does not match its frame"),
    (_group(99, 2, [[5, 1], [6, 1]], "BYTES", [2]), b"\0" * 8, "fixed-size datatype"),
    (_group(99, 2, [[5, 1], [6, 1]], model="plain", shape=[3, 16]), np.zeros((3, 16), np.float32).tobytes(),
     "has 3 rows; its members 2"),
    (_group(99, 2, [[5, 1], [6, 1]], model="nope"), np.zeros((2, 16), np.float32).tobytes(), "unknown model"),
    ([*_group(99, 2, [[5, 1], [6, 1]])[:12], [1, 0, 0, b"k" * 16], [[5, 1], [6, 1]]],
     np.zeros((2, 16), np.float32).tobytes(), "cannot carry a BLS caller"),
])
def test_a_group_that_does_not_hold_together_is_refused_to_each_member(pool, header, frame, words):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(pool.endpoint)
        replies = _ask(sock, header, [frame])
        assert sorted(r.req_id for r in replies) == [5, 6], replies
        assert all(type(r) is protocol.Error and words in r.message for r in replies), replies
        # and the pool serves on
        ok = _ask(sock, [7, "tiny", -1, [["INPUT0", "FP32", [1, 16], 0]], None, 0, 0, protocol.NO_ARENA, 0, 0],
                  [np.ones((1, 16), np.float32).tobytes()])
        assert [type(r) for r in ok] == [protocol.Result]
    finally:
        sock.close(0)
        ctx.term()


def test_a_group_and_its_answer_cross_the_wire():
    infer = protocol.Infer(9, "m", -1, [], None, 0, 0, protocol.NO_ARENA, 0, 0, 0, 1, None, [[3, 1], [4, 2]])
    assert protocol.decode(infer.encode()).members == [[3, 1], [4, 2]]
    result = protocol.Result(9, [["Y", "FP32", [3, 2], 0]], False, 1, [[3, 1], [4, 2]])
    assert protocol.decode(result.encode()).members == [[3, 1], [4, 2]]
    assert protocol.decode(protocol.Result(9, [], False, 1).encode()).members is None



def test_a_group_keeps_to_the_preferred_batch_size(pool, tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("preferred"))
    _config(repo, "pref", "dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100000 }")
    with Pool(repo) as p:
        answers, read, before, after = _submit_all(p, "pref", [1] * 6)
    _check_answers(answers, [1] * 6)
    sizes = {int(k): v - before["batch_sizes"].get(k, 0) for k, v in after["batch_sizes"].items()}
    assert {k: v for k, v in sizes.items() if v} == {4: 1, 2: 1}  # as six single requests run: 4 at once, 2 later


def test_a_request_with_more_inputs_than_a_lane_message_holds_is_left_to_infer(pool):
    async def run():
        client = AsyncClient(pool.endpoint)
        await client.start()
        try:
            await client.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})
            many = {f"X{i}": np.zeros(1, np.uint8) for i in range(8191)}
            assert not client.submit("tiny", many, None, lambda out, exc: None)  # infer's task takes it
            got = asyncio.get_running_loop().create_future()
            assert client.submit("tiny", {"INPUT0": np.ones((1, 16), np.float32)}, None,
                                 lambda out, exc: got.set_result((out, exc)))
            out, exc = await asyncio.wait_for(got, 60)
            assert exc is None and (out["OUTPUT0"] == 3.0).all()
        finally:
            await client.close()

    asyncio.run(run())


def test_a_group_of_inputs_its_model_does_not_take_is_refused_before_it_is_split(pool):
    """3,000 inputs for 1,024 members would be 3 million views to cut: the names are checked first, and each
    member hears what it would hear alone."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(pool.endpoint)
        members = [[1000 + i, 1] for i in range(1024)]
        header = [99, "tiny", -1, [[f"X{i}", "FP32", [1024, 0], 0] for i in range(3000)], None, 0, 0,
                  protocol.NO_ARENA, 0, 0, 0, 0, None, members]
        replies = _ask(sock, header, [b""])
        assert sorted(r.req_id for r in replies) == [m[0] for m in members]
        assert all(type(r) is protocol.Error and "unknown input" in r.message for r in replies)
    finally:
        sock.close(0)
        ctx.term()


def _core_group(h, req_id: int, members: list, value: float = 1.0, model: str = "tiny") -> None:
    rows = sum(n for _, n in members)
    x = np.full((rows, 4), value, np.float32)
    msg = protocol.Infer(req_id, model, protocol.NO_VERSION, [["INPUT0", "FP32", [rows, 4], 0]], None, 0, 0,
                         protocol.NO_ARENA, 0, 0, 0, 0, None, members)
    h.core.on_message(b"\0client", [memoryview(msg.encode()), memoryview(x.tobytes())])


@pytest.fixture
def core(tmp_path):
    from tests.test_core import Harness

    _config(str(tmp_path), "tiny", "dynamic_batching { }", width=4)  # the width Harness.compute plays
    _config(str(tmp_path), "two", "dynamic_batching { }", width=4)
    with open(f"{tmp_path}/two/config.pbtxt") as f:
        text = f.read()
    with open(f"{tmp_path}/two/config.pbtxt", "w") as f:
        f.write(text.replace("count: 1", "count: 2"))
    h = Harness(tmp_path)
    yield h
    h.close()


def test_a_stopping_front_answers_each_member(core):
    core.ready_all()
    core.core.begin_stop()
    _core_group(core, 99, [[5, 1], [6, 2]])
    replies = [msg for _, msg, _ in core.out.take()]
    assert sorted(r.req_id for r in replies) == [5, 6]
    assert all(type(r) is protocol.Error and "shutting down" in r.message for r in replies)


def test_a_queued_group_counts_its_members_as_pending_requests(core):
    from gepool.scheduler.status import Workload

    core.ready_all()
    _core_group(core, 99, [[5, 1], [6, 2], [7, 1]])  # queued until the loop schedules its model
    model = core.core.control.group("tiny").default()
    assert len(model.batcher) == 1 and Workload.of(model).queued == 3



def test_a_group_whose_worker_dies_runs_once_more_and_each_member_is_answered_once(core):
    core.ready_all()
    _core_group(core, 99, [[5, 1], [6, 2]], value=3.0, model="two")
    core.step()
    model = core.core.control.group("two").default()
    (held,) = [w for w in model.workers if w.inflight]
    (other,) = [w for w in model.workers if w is not held]
    core.exit(held, -9)
    core.step()
    assert core.compute(other) == [3]
    replies = [msg for _, msg, _ in core.out.take() if type(msg) in (protocol.Result, protocol.Error)]
    assert len(replies) == 1 and type(replies[0]) is protocol.Result and replies[0].members == [[5, 1], [6, 2]]
    stats = model.stats
    assert stats.requests == 2 and stats.failures == 0


def test_a_bug_admitting_one_member_leaves_the_others_served(core, monkeypatch):
    import gepool.scheduler.core as front_core

    real = front_core.admit

    def admit(msg, *args):
        if msg.req_id == 5:
            raise TypeError("boom")
        return real(msg, *args)

    monkeypatch.setattr(front_core, "admit", admit)
    core.ready_all()
    _core_group(core, 99, [[5, 8], [6, 8], [7, 8]])  # a batch each: run one by one
    core.step()
    (w,) = [w for w in core.core.control.group("tiny").default().workers]
    while w.bell.rung:
        core.compute(w)
    replies = {msg.req_id: msg for _, msg, _ in core.out.take() if type(msg) in (protocol.Result, protocol.Error)}
    assert type(replies[5]) is protocol.Error and "boom" in replies[5].message
    assert type(replies[6]) is protocol.Result and type(replies[7]) is protocol.Result
