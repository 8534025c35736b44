"""The front's core in-process: events in, actions out, a fake clock; no process, no socket.

The rings are real shared memory (the core copies batches into them); the workers' side is played
here: a test reads a slot the core filled, writes its outputs as a worker would, and reports it done.
"""

import numpy as np
import pytest

from gepool.common import errors
from gepool.ipc import layout, naming, protocol
from gepool.ipc.ring import Ring, TensorDesc
from gepool.scheduler.core import Core
from gepool.scheduler.options import FrontOptions
from gepool.scheduler.states import ModelState, TransitionError, WorkerState
from tests.repo import write

MODEL_PY = """
class Model:
    def execute(self, inputs):
        return {}
"""


def echo_model(repo, name="echo", *, count=1, extra_db="", params=""):
    write(f"{repo}/{name}/1/model.py", MODEL_PY)
    write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
        dynamic_batching {{ max_queue_delay_microseconds: 0 {extra_db} }}
        {params}
    """)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Bell:
    def __init__(self) -> None:
        self.rung: list[tuple[int, int]] = []

    def ring(self, slot: int, seq: int) -> None:
        self.rung.append((slot, seq))

    def prepare(self) -> None:
        pass


class Process:
    def __init__(self, pid: int) -> None:
        self.pid, self.killed = pid, False

    def kill(self) -> None:
        self.killed = True


class Outbox:
    """Records what the core asks for; spawn hands out a real ring, a recording bell, a fake process."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.replies: list[tuple[bytes, object, list[bytes]]] = []
        self.spawned, self.stopped, self.killed, self.rings = [], [], [], []
        self.status: dict | None = None

    def reply(self, identity: bytes, parts: list, copy: bool = False) -> None:
        self.replies.append((identity, protocol.decode(parts[0]), [bytes(p) for p in parts[1:]]))

    def spawn(self, w) -> None:
        assert w.state == WorkerState.STARTING
        w.ring = Ring.create(naming.segment_name(self.owner, f"w{w.id}.{w.restarts}"), w.slots, w.slot_bytes)
        self.rings.append(w.ring)
        w.bell, w.process = Bell(), Process(10_000 + w.id)
        self.spawned.append(w)

    def stop(self, w) -> None:
        self.stopped.append(w)

    def place(self, config):
        from gepool.workers.backends import placements

        return placements(config)

    def kill(self, w) -> None:
        self.killed.append(w)
        w.process.kill()

    def drop_arena(self, w, name: str) -> None:
        pass

    def ready(self, status: dict) -> None:
        self.status = status

    def take(self) -> list:
        out, self.replies = self.replies, []
        return out


class Harness:
    def __init__(self, repo, **opts) -> None:
        self.owner = naming.new_owner_id()
        self.clock = Clock()
        self.out = Outbox(self.owner)
        options = FrontOptions(repository=str(repo), endpoint="ipc:///nowhere", owner_id=self.owner,
                               busy_poll_us=-1, **opts)
        self.core = Core(options, self.out, self.clock)
        self.core.start()
        self.next_id = 0

    def close(self) -> None:
        self.core.close()
        for ring in self.out.rings:
            ring.segment.unlink()
            ring.close()

    def ready(self, w) -> None:
        self.core.on_worker_message(protocol.WorkerReady(w.id, protocol.PROTOCOL_VERSION, w.process.pid, {}))

    def ready_all(self) -> None:
        for w in list(self.out.spawned):
            if w.state == WorkerState.STARTING:
                self.ready(w)
        self.tick()

    def send(self, msg) -> None:
        self.core.on_message(b"\0client", [memoryview(msg.encode()), *getattr(msg, "_frames", [])])

    def infer(self, value: float, model: str = "echo", rows: int = 1, timeout_us: int = 0, **kw) -> int:
        self.next_id += 1
        x = np.full((rows, 4), value, np.float32)
        msg = protocol.Infer(self.next_id, model, protocol.NO_VERSION, [["INPUT", "FP32", [rows, 4], 0]], None,
                             timeout_us, 0, protocol.NO_ARENA, 0, 0)
        for k, v in kw.items():
            setattr(msg, k, v)
        self.core.on_message(b"\0client", [memoryview(msg.encode()), memoryview(x.tobytes())])
        return self.next_id

    def step(self) -> None:
        """What the loop does after a hot event: schedule what the event touched."""
        self.core.schedule(self.core.dirty | self.core.queued)
        self.core.dirty.clear()

    def tick(self, seconds: float = 0.0) -> bool:
        self.clock.now += seconds
        return self.core.tick(self.clock.now)

    def compute(self, w, scale: float = 2.0) -> list[int]:
        """Plays the worker: every batch rung since the last call runs (OUTPUT = scale * INPUT) and is
        reported done. Returns the batches' sizes."""
        sizes = []
        rung, w.bell.rung = w.bell.rung, []
        for index, seq in rung:
            slot = w.ring.slots[index]
            got_seq, rows, (desc,) = slot.read()
            assert got_seq == seq
            y = slot.array(desc) * scale
            (offset,), _ = layout.pack([y.nbytes], desc.offset + desc.nbytes)
            slot.data[offset:offset + y.nbytes] = y.tobytes()
            del y
            slot.finish(1, [TensorDesc("FP32", (rows, 4), offset, rows * 16)], self.clock.now, self.clock.now)
            sizes.append(rows)
        self.core.on_completions(w, rung)
        self.step()
        return sizes

    def exit(self, w, code: int) -> None:
        """Plays the loop's reap: the process is gone, its ring and bell closed."""
        w.ring.segment.unlink()
        w.ring.close()
        w.ring = w.bell = w.process = None
        self.core.on_worker_exit(w, code)
        self.tick()  # an exit is not a hot event: the loop ticks after it


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**opts) -> Harness:
        h = Harness(tmp_path, **opts)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def results(replies) -> dict[int, object]:
    """req_id -> the OUTPUT array of a Result, or the Error."""
    out = {}
    for _, msg, frames in replies:
        if isinstance(msg, protocol.Result):
            out[msg.req_id] = np.frombuffer(frames[0], np.float32).reshape(msg.outputs[0][2])
        else:
            out[msg.req_id] = msg
    return out


def test_admission_errors_are_answered_and_nothing_is_queued(tmp_path, harness):
    echo_model(tmp_path)
    h = harness()
    (w,) = h.out.spawned
    h.infer(1.0)
    (reply,) = results(h.out.take()).values()
    assert reply.code == errors.ModelNotReady.code and "LOADING" in reply.message  # no worker ready yet
    h.ready_all()
    assert h.out.status is not None and h.out.status["models"]["echo"]["state"] == ModelState.AVAILABLE

    bad = {
        "unknown model": dict(model="nope"),
        "wrong datatype": dict(inputs=[["INPUT", "INT32", [1, 4], 0]]),
        "wrong shape": dict(inputs=[["INPUT", "FP32", [1, 5], 0]]),
        "too many rows": dict(rows=9),
        "unknown input": dict(inputs=[["OTHER", "FP32", [1, 4], 0]]),
        "missing frame": dict(inputs=[["INPUT", "FP32", [1, 4], 3]]),
        "req_id not an int": dict(req_id="x"),
        "negative timeout": dict(timeout_us=-1),
    }
    for kw in bad.values():
        h.infer(1.0, **kw)
    replies = [msg for _, msg, _ in h.out.take()]
    assert [type(m) for m in replies] == [protocol.Error] * len(bad)
    codes = [m.code for m in replies]
    assert codes[0] == errors.ModelNotFound.code
    assert codes[1:] == [errors.InvalidArgument.code] * (len(bad) - 1)
    assert "datatype INT32" in replies[1].message and "[1, 5]" in replies[2].message
    assert "batch size 9" in replies[3].message and "frame 3" in replies[5].message
    model = h.core.control.group("echo").default()
    assert len(model.batcher) == 0 and w.bell.rung == [] and not w.inflight

    h.send(protocol.Query(77, "nonsense", {}))
    (_, msg, _), = h.out.take()
    assert isinstance(msg, protocol.Error) and msg.req_id == 77 and msg.code == errors.InvalidArgument.code

    h.core.on_message(b"\0client", [memoryview(b"\xc1garbage")])
    (_, msg, _), = h.out.take()
    assert isinstance(msg, protocol.Error) and msg.code == errors.ProtocolMismatch.code


def test_requests_are_routed_across_instances_least_loaded_first(tmp_path, harness):
    echo_model(tmp_path, count=2)
    h = harness()
    w1, w2 = h.out.spawned
    h.ready_all()
    a = h.infer(1.0, rows=3)
    h.step()
    b = h.infer(2.0)
    h.step()
    # each went to an idle instance: one batch per worker
    assert len(w1.bell.rung) == 1 and len(w2.bell.rung) == 1
    assert (w1.rows, w2.rows) == (3, 1)
    assert h.compute(w1) == [3] and h.compute(w2) == [1]
    got = results(h.out.take())
    np.testing.assert_array_equal(got[a], np.full((3, 4), 2.0, np.float32))
    np.testing.assert_array_equal(got[b], np.full((1, 4), 4.0, np.float32))
    assert not w1.inflight and not w2.inflight and sorted(w1.free) == [0, 1]


def test_a_dead_workers_batch_runs_once_more_elsewhere_then_fails(tmp_path, harness):
    echo_model(tmp_path, count=2)
    h = harness()
    w1, w2 = h.out.spawned
    h.ready_all()
    a = h.infer(5.0)
    h.step()
    victim, other = (w1, w2) if w1.inflight else (w2, w1)
    h.exit(victim, -9)
    assert h.out.take() == []  # retried, not failed
    assert victim.state == WorkerState.DEAD and victim.restart_at is not None and victim.restarts == 1
    assert len(other.bell.rung) == 1  # the same request, on the other worker
    h.exit(other, -9)  # a second death: it ran twice, and now hears why
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == a and reply.code == errors.WorkerDied.code and "died" in reply.message

    spawned = len(h.out.spawned)
    h.tick(0.1)
    assert len(h.out.spawned) == spawned  # still in its backoff
    h.tick(1.0)
    assert set(h.out.spawned[spawned:]) == {w1, w2}  # restarted after it
    assert w1.state == WorkerState.STARTING and w2.state == WorkerState.STARTING
    assert h.core.control.group("echo").default().state == ModelState.LOADING
    h.ready_all()
    b = h.infer(1.0)
    h.step()
    busy = w1 if w1.bell.rung else w2
    h.compute(busy)
    assert isinstance(results(h.out.take())[b], np.ndarray)


def test_the_watchdog_answers_a_hung_batch_and_kills_its_worker(tmp_path, harness):
    echo_model(tmp_path, params='parameters { key: "execution_timeout_ms" value: { string_value: "1000" } }')
    h = harness()
    (w,) = h.out.spawned
    h.ready_all()
    a = h.infer(1.0)
    h.step()
    h.tick(0.9)
    assert h.out.take() == [] and h.out.killed == []
    h.tick(0.2)
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == a and reply.code == errors.WorkerDied.code and "within 1000 ms" in reply.message
    assert h.out.killed == [w] and w.process.killed and not w.inflight
    h.exit(w, -9)
    assert h.out.take() == []  # the hung batch was answered once, not retried
    assert w.reason.startswith("worker") and w.restart_at is not None


def test_a_reload_drains_the_old_generation_before_stopping_it(tmp_path, harness):
    echo_model(tmp_path)
    h = harness(model_control_mode="explicit", load_models=("echo",))
    (old,) = h.out.spawned
    h.ready_all()
    a = h.infer(1.0)
    h.step()
    assert old.inflight
    h.send(protocol.Query(50, "load", {"model": "echo"}))
    (new,) = h.out.spawned[1:]
    assert h.out.take() == []  # the load is answered when it settles
    h.ready(new)
    (_, loaded, _), = h.out.take()
    assert isinstance(loaded, protocol.Reply) and loaded.req_id == 50 and loaded.body["loaded"] == "echo"
    group = h.core.control.group("echo")
    assert group.default() is new.model and group.draining == [old.model]

    b = h.infer(3.0)
    h.step()
    assert new.inflight and len(old.inflight) == 1  # new requests go to the new generation
    h.tick()
    assert h.out.stopped == []  # the old one still runs a batch
    h.compute(old)
    h.compute(new)
    got = results(h.out.take())
    np.testing.assert_array_equal(got[a], np.full((1, 4), 2.0, np.float32))
    np.testing.assert_array_equal(got[b], np.full((1, 4), 6.0, np.float32))
    h.tick()
    assert h.out.stopped == [old] and old.retired
    h.exit(old, 0)
    h.tick()
    assert old.id not in h.core.workers.by_id and group.draining == [] and old.restart_at is None
    assert new.state == WorkerState.READY


def test_queue_timeouts_answer_requests_that_never_started(tmp_path, harness):
    echo_model(tmp_path, extra_db="default_queue_policy { default_timeout_microseconds: 100000 "
                                  "allow_timeout_override: true }")
    h = harness()
    (w,) = h.out.spawned
    h.ready_all()
    a = h.infer(1.0)
    h.step()
    b = h.infer(2.0)  # queued behind the running batch (a batch that can grow waits for its worker)
    c = h.infer(3.0, timeout_us=20_000)  # a shorter timeout of its own
    h.step()
    assert len(w.bell.rung) == 1
    model = h.core.control.group("echo").default()
    assert len(model.batcher) == 2
    assert h.core.next_deadline() == pytest.approx(h.clock.now + 0.02)
    h.tick(0.03)
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == c and reply.code == errors.Timeout.code
    h.tick(0.08)
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == b and reply.code == errors.Timeout.code
    assert len(model.batcher) == 0
    h.compute(w)
    assert isinstance(results(h.out.take())[a], np.ndarray)


def test_stopping_drains_then_fails_what_is_left(tmp_path, harness):
    echo_model(tmp_path)
    h = harness()
    (w,) = h.out.spawned
    h.ready_all()
    a = h.infer(1.0)
    h.step()
    h.core.begin_stop()
    h.infer(2.0)
    (_, refused, _), = h.out.take()
    assert refused.code == errors.Unavailable.code and "shutting down" in refused.message
    assert h.tick() is False  # a batch still runs, within the drain timeout
    h.compute(w)
    assert isinstance(results(h.out.take())[a], np.ndarray)
    assert h.tick() is True


def test_worker_states_move_only_as_written():
    from gepool.scheduler.states import check_model, check_worker

    assert check_worker(WorkerState.STARTING, WorkerState.READY) == WorkerState.READY
    with pytest.raises(TransitionError):
        check_worker(WorkerState.FAILED, WorkerState.STARTING)  # a failed load is never restarted
    with pytest.raises(TransitionError):
        check_worker(WorkerState.READY, WorkerState.STARTING)  # only a dead worker restarts
    with pytest.raises(TransitionError):
        check_model(ModelState.UNAVAILABLE, ModelState.AVAILABLE)
    assert ModelState.AVAILABLE == "READY"  # the wire's word


def test_the_config_query_answers_with_the_config_being_served(tmp_path, harness):
    echo_model(tmp_path)
    h = harness(model_control_mode="explicit", load_models=("echo",))
    h.ready_all()

    def config() -> dict:
        h.send(protocol.Query(9, "config", {"model": "echo"}))
        (_, msg, _), = h.out.take()
        assert isinstance(msg, protocol.Reply), msg
        return msg.body

    assert config()["max_batch_size"] == 8 and config()["name"] == "echo"
    h.send(protocol.Query(8, "metadata", {"model": "echo"}))
    (_, meta, _), = h.out.take()
    assert meta.body == {"name": "echo", "state": "READY", "reason": "", "backend": "python", "platform": "python",
                         "versions": ["1"], "max_batch_size": 8,
                         "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 4]}],
                         "outputs": [{"name": "OUTPUT", "datatype": "FP32", "shape": [-1, 4]}]}
    text = (tmp_path / "echo" / "config.pbtxt").read_text()
    (tmp_path / "echo" / "config.pbtxt").write_text(text.replace("max_batch_size: 8", "max_batch_size: 4"))
    assert config()["max_batch_size"] == 8  # the file changed; what serves did not
    h.send(protocol.Query(10, "load", {"model": "echo"}))
    h.ready_all()
    h.out.take()
    assert config()["max_batch_size"] == 4


def test_queued_bytes_are_capped_pool_wide_and_freed_as_batches_leave(tmp_path, harness):
    echo_model(tmp_path)
    h = harness(max_queued_bytes=100)  # a request of one row holds 32 bytes (16 in, 16 out)
    (w,) = h.out.spawned
    h.ready_all()
    budget = h.core.control.budget
    first = h.infer(1.0)
    h.step()  # runs at once: it leaves the queue and its bytes with it
    assert len(w.bell.rung) == 1 and budget.used == 0
    queued = [h.infer(float(i)) for i in range(3)]  # wait behind the running batch
    h.step()
    assert budget.used == 96 and h.out.take() == []
    refused = h.infer(9.0)
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == refused and reply.code == errors.Unavailable.code
    assert "max_queued_bytes (100)" in reply.message
    h.compute(w)  # the queued three go as one batch
    assert budget.used == 0
    h.compute(w)
    got = results(h.out.take())
    assert all(isinstance(got[r], np.ndarray) for r in [first, *queued])
    again = h.infer(3.0)
    h.step()
    h.compute(w)
    assert isinstance(results(h.out.take())[again], np.ndarray)


def test_a_request_whose_clients_timeout_passed_leaves_its_queue_and_never_runs(tmp_path, harness):
    echo_model(tmp_path)  # no queue policy: only the client's own timeout applies
    h = harness()
    (w,) = h.out.spawned
    h.ready_all()
    a = h.infer(1.0)
    h.step()
    late = h.infer(2.0, deadline_us=50_000)
    patient = h.infer(3.0)
    h.step()
    assert h.core.next_deadline() == pytest.approx(h.clock.now + 0.05)
    h.tick(0.06)
    (reply,) = results(h.out.take()).values()
    assert reply.req_id == late and reply.code == errors.PoolUnavailable.code and "client's deadline" in reply.message
    stats = h.core.control.group("echo").stats_dict()
    assert stats["client_timeouts"] == 1 and stats["failure_reasons"]["CANCELED"] == 1, stats
    assert h.core.control.budget.used == 32  # only the patient one is still held
    h.compute(w)
    h.compute(w)
    got = results(h.out.take())
    assert set(got) == {a, patient}  # the late one never ran
    np.testing.assert_array_equal(got[patient], np.full((1, 4), 6.0, np.float32))


def test_a_model_that_does_not_load_in_time_is_unavailable_and_the_pool_ready(tmp_path, harness):
    echo_model(tmp_path, params='parameters { key: "model_load_timeout_s" value: { string_value: "2" } }')
    echo_model(tmp_path, name="good")
    h = harness()
    hanging, good = sorted(h.out.spawned, key=lambda w: w.model.name != "echo")
    h.ready(good)
    h.tick(1.5)
    assert h.out.killed == [] and h.out.status is None  # still loading, within its timeout
    assert h.core.next_deadline() == pytest.approx(h.clock.now + 0.5)
    h.tick(0.6)
    assert h.out.killed == [hanging]
    h.exit(hanging, -9)
    assert hanging.state == WorkerState.FAILED and hanging.restart_at is None
    status = h.out.status
    assert status is not None and status["models"]["good"]["state"] == "READY"
    group = h.core.control.group("echo")
    (echo,) = group.failed
    assert echo.state == ModelState.UNAVAILABLE and "did not load within 2 s (model_load_timeout_s)" in echo.reason
    h.infer(1.0)
    (reply,) = results(h.out.take()).values()
    assert reply.code == errors.ModelNotReady.code and "model_load_timeout_s" in reply.message


def test_a_bad_load_timeout_parameter_is_refused_naming_it(tmp_path, harness):
    echo_model(tmp_path, params='parameters { key: "model_load_timeout_s" value: { string_value: "soon" } }')
    h = harness()
    assert h.out.spawned == []
    (model,) = h.core.control.group("echo").failed
    assert model.state == ModelState.UNAVAILABLE and "model_load_timeout_s" in model.reason and "'soon'" in model.reason


def test_exit_code_3_at_run_time_is_a_crash_and_the_cannot_load_report_a_message(tmp_path, harness):
    echo_model(tmp_path, count=2)
    h = harness()
    w1, w2 = h.out.spawned
    h.ready(w1)
    h.exit(w2, 3)  # exited while loading with the old "cannot load" code, but said nothing: a crash
    assert w2.state == WorkerState.DEAD and w2.restart_at is not None
    h.core.on_worker_message(protocol.WorkerFailed(w2.id, "RuntimeError: weights are missing"))  # said late
    assert w2.state == WorkerState.FAILED and w2.restart_at is None and "weights" in w2.reason
    h.tick(60)
    assert w2 not in h.out.spawned[2:]  # never restarted
    h.exit(w1, 3)  # a ready worker whose model's code exited with 3: restarted like any crash
    assert w1.state == WorkerState.DEAD and w1.restart_at is not None
    h.tick(1.0)
    assert h.out.spawned[-1] is w1 and w1.state == WorkerState.STARTING


def test_a_header_too_large_is_refused_before_it_is_decoded(tmp_path, harness):
    from gepool.scheduler.core import MAX_HEADER_BYTES

    echo_model(tmp_path)
    h = harness()
    h.ready_all()
    lists = b"\xdd" + (MAX_HEADER_BYTES).to_bytes(4, "big") + b"\x90" * MAX_HEADER_BYTES  # an array of empty arrays
    h.core.on_message(b"\0client", [memoryview(lists)])
    (_, msg, _), = h.out.take()
    assert isinstance(msg, protocol.Error) and msg.code == errors.RequestTooLarge.code
    assert f"larger than the {MAX_HEADER_BYTES}" in msg.message
