"""The shared-memory carrier without copies on the client: outputs are views of the arena, inputs made
with Client.empty travel as offsets, and every arena byte comes back once the arrays are gone."""

import gc
import os

import numpy as np
import pytest

from gepool import Client, _wire
from gepool.arena import ClientArena
from gepool.common import errors
from tests.conftest import wait_until


def in_arena(arena: ClientArena, arr: np.ndarray) -> bool:
    start = arr.__array_interface__["data"][0] - arena._base
    return 0 <= start and start + arr.nbytes <= arena.size


def whole(arena: ClientArena) -> bool:
    gc.collect()
    return arena.free_ranges() == [(arena.start, arena.size - arena.start)]


@pytest.fixture
def shm(pool, monkeypatch):
    monkeypatch.setattr(_wire, "ZERO_COPY_MIN", 0)  # the tiny model's outputs stand in for large ones
    with pool.client(shared_memory=True, arena_bytes=1 << 20, arena_min_bytes=0) as c:
        yield c


def test_small_outputs_are_copied_out_and_their_range_freed_at_once(pool):
    with pool.client(shared_memory=True, arena_bytes=1 << 20, arena_min_bytes=0) as c:
        x = np.ones((2, 16), np.float32)
        out = c.infer("tiny", {"INPUT0": x})["OUTPUT0"]
        np.testing.assert_array_equal(out, x * 2 + 1)
        assert not in_arena(c.arena, out) and whole(c.arena)


def test_outputs_are_read_only_views_of_the_arena_until_collected(shm):
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    out = shm.infer("tiny", {"INPUT0": x})["OUTPUT0"]
    np.testing.assert_array_equal(out, x * 2 + 1)
    assert in_arena(shm.arena, out) and not out.flags.writeable
    assert not whole(shm.arena)  # the output's range is held by the array
    view = out[1:]
    del out
    assert not whole(shm.arena)  # ... and by any view of it
    np.testing.assert_array_equal(view, x[1:] * 2 + 1)
    del view
    assert whole(shm.arena)


def test_held_outputs_do_not_change_later_answers(shm):
    xs = [np.full((1, 16), i, np.float32) for i in range(20)]
    outs = [shm.infer("tiny", {"INPUT0": x})["OUTPUT0"] for x in xs]
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.full((1, 16), 2 * i + 1, np.float32))
    del outs, out
    assert whole(shm.arena)


def test_an_input_made_in_the_arena_travels_as_its_offset(shm):
    x = shm.empty((3, 16), np.float32)
    x[:] = np.arange(48, dtype=np.float32).reshape(3, 16)
    sent = _wire.encode_infer("tiny", {"INPUT0": x}, None, None, None, (shm.arena, shm._arena_id), 3 * 16 * 4)
    ((_, _, _, where),) = _wire.protocol.decode(sent.frames[0]).inputs
    assert where == shm.arena.offset_of(x) and sent.ranges == []  # nothing copied, only the outputs' room
    sent.release(shm.arena)
    out = shm.infer("tiny", {"INPUT0": x})["OUTPUT0"]
    np.testing.assert_array_equal(out, np.asarray(x) * 2 + 1)
    del x, out
    assert whole(shm.arena)


def test_small_requests_travel_as_frames_unless_an_input_lies_in_the_arena(pool):
    """Under arena_min_bytes (64 KiB by default) a shared-memory client sends frames, which are faster
    for small tensors; from it up, and whenever an input was made in the arena, the arena carries them."""
    with pool.client(shared_memory=True, arena_bytes=1 << 20) as c:
        small = np.ones((1, 16), np.float32)
        sent = c._encode("tiny", {"INPUT0": small}, None, None, None)
        assert len(sent.frames) == 2 and sent.ranges == [] and sent.out_range is None and whole(c.arena)
        big = np.ones((1, 16 * 1024), np.float32)  # 64 KiB: at the threshold
        sent = _wire.encode_infer("x", {"X": big}, None, None, None, (c.arena, c._arena_id), 0)
        assert len(sent.frames) == 1 and sent.ranges and not whole(c.arena)
        sent.release(c.arena)
        placed = c.empty((1, 16), np.float32)
        sent = c._encode("tiny", {"INPUT0": placed}, None, None, None)
        assert len(sent.frames) == 1 and sent.out_range is not None  # offsets only; outputs get room
        sent.release(c.arena)
        np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": small})["OUTPUT0"], 2 * small + 1)
        del placed
        assert whole(c.arena)


def test_a_full_arena_falls_back_to_frames(shm):
    x = np.ones((8, 16), np.float32)
    held = []
    for _ in range(2000):  # 1 MiB arena, 512 bytes of output per request: it fills up
        held.append(shm.infer("tiny", {"INPUT0": x})["OUTPUT0"])
        if not in_arena(shm.arena, held[-1]):
            break
    else:
        pytest.fail("the arena never filled up")
    np.testing.assert_array_equal(held[-1], x * 2 + 1)  # answered as frames instead
    del held
    assert whole(shm.arena)


def test_empty_needs_an_arena(client):
    with pytest.raises(errors.InvalidArgument, match="shared_memory=True"):
        client.empty((1, 16), np.float32)


# -- direct batches: a lone large request runs in its client's arena ------------------------------------

WIDE = 16384  # FP32 per row: 64 KiB in and 64 KiB out, so even one row passes the direct threshold


@pytest.fixture(scope="module")
def wide_pool(tmp_path_factory):
    from gepool import Pool
    from tests.repo import make_models

    repo = str(tmp_path_factory.mktemp("wide"))
    make_models.make_tiny(repo, name="wide", width=WIDE, max_batch=4)
    with Pool(repo) as p:
        yield p


def _mapped_by_worker(pool, name: str) -> bool:
    pid = pool.client().status()["models"]["wide"]["worker_pids"][0]
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith("/dev/shm" + name) for line in f)


def test_a_lone_large_request_runs_in_the_clients_arena(wide_pool):
    """The worker maps the client's arena and reads and writes there (the front copies neither way);
    once the client releases its arena, the worker unmaps it."""
    from tests.conftest import wait_until

    c = wide_pool.client(shared_memory=True, arena_bytes=4 << 20)
    try:
        name = c.arena.segment.name
        assert not _mapped_by_worker(wide_pool, name)
        x = c.empty((2, WIDE), np.float32)
        x[:] = np.arange(2 * WIDE, dtype=np.float32).reshape(2, WIDE)
        out = c.infer("wide", {"INPUT0": x})["OUTPUT0"]
        np.testing.assert_array_equal(out, 2 * x + 1)
        assert in_arena(c.arena, out) and not out.flags.writeable
        assert _mapped_by_worker(wide_pool, name)
        y = np.full((1, WIDE), 3.0, np.float32)  # a numpy input: copied into the arena by the client, then direct
        np.testing.assert_array_equal(c.infer("wide", {"INPUT0": y})["OUTPUT0"], 2 * y + 1)
        np.testing.assert_array_equal(out, 2 * x + 1)  # the earlier answer's bytes were not reused meanwhile
        del out, x
        assert whole(c.arena)
    finally:
        c.close()
    assert wait_until(lambda: not _mapped_by_worker(wide_pool, name)), "the worker kept a released arena mapped"


def test_direct_and_slot_batches_mix(wide_pool):
    """Requests that arrive together batch in the slot as before; each answer is its own."""
    before = wide_pool.client().stats()["wide"]["requests"]
    with wide_pool.client(shared_memory=True, arena_bytes=8 << 20) as shm, wide_pool.client() as frames:
        for c in (shm, frames):
            xs = [np.full((1 + i % 2, WIDE), i, np.float32) for i in range(8)]
            futures = [c.infer_async("wide", {"INPUT0": x}) for x in xs]
            for x, f in zip(xs, futures, strict=True):
                np.testing.assert_array_equal(f.result(30)["OUTPUT0"], 2 * x + 1)
    stats = wide_pool.client().stats()["wide"]
    assert stats["failures"] == 0 and stats["requests"] - before == 16


def test_a_workers_arena_mappings_are_bounded():
    from gepool.workers.arena_maps import ArenaMaps

    arenas = [ClientArena(1 << 16) for _ in range(3)]
    maps = ArenaMaps(limit=2)
    try:
        for i, a in enumerate(arenas):
            a.buf[:4] = bytes([i + 1] * 4)
            assert bytes(maps.buffer(a.segment.name)[:4]) == bytes([i + 1] * 4)  # the client's bytes
        assert len(maps) == 2 and arenas[0].segment.name not in maps._maps
        maps.drop(arenas[1].segment.name)
        assert list(maps._maps) == [arenas[2].segment.name]
    finally:
        maps.close()
        for a in arenas:
            a.close()


# -- a request that timed out keeps its range until its late reply, in both faces ------------------------

def test_a_timed_out_requests_range_returns_with_its_late_reply(pool, gate_file):
    """The front may still write a timed-out request's outputs into its arena range: the range stays
    taken until the late reply arrives, then returns (a client that never took it back slowly drained
    its arena and fell back to frames for good)."""
    x = np.full((8, 4), -1, np.float32)  # a full preferred batch: it runs at once, and waits at the gate
    with pool.client(shared_memory=True, arena_bytes=1 << 20, arena_min_bytes=0) as c:
        open(gate_file, "w").close()
        try:
            with pytest.raises(errors.PoolUnavailable, match="within"):
                c.infer("recorder", {"INPUT": x}, timeout=0.5)
            assert not whole(c.arena), "the range was freed while the front may still write into it"
        finally:
            os.unlink(gate_file)
        assert wait_until(lambda: c.status() is not None and whole(c.arena)), c.arena.free_ranges()


def test_the_asyncio_clients_timed_out_range_returns_with_its_late_reply(pool, gate_file):
    import asyncio

    from gepool import AsyncClient

    x = np.full((8, 4), -1, np.float32)

    async def run() -> None:
        async with AsyncClient(pool.endpoint, shared_memory=True, arena_bytes=1 << 20, arena_min_bytes=0) as c:
            await c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})  # metadata fetched, outputs copied
            assert whole(c.arena)
            open(gate_file, "w").close()
            try:
                with pytest.raises(errors.PoolUnavailable, match="in time"):
                    await c.infer("recorder", {"INPUT": x}, timeout=0.5)
                assert not whole(c.arena), "the range was freed while the front may still write into it"
            finally:
                os.unlink(gate_file)
            deadline = asyncio.get_running_loop().time() + 30
            while not whole(c.arena) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)  # the late reply comes in on the client's reader
            assert whole(c.arena), c.arena.free_ranges()
            out = await c.infer("recorder", {"INPUT": np.ones((8, 4), np.float32)})
            np.testing.assert_array_equal(out["OUTPUT"], np.ones((8, 4)))
            del out
            assert whole(c.arena)

    asyncio.run(run())


def test_a_new_pool_on_the_endpoint_frees_what_timed_out_on_the_old_one(tmp_path):
    """The old pool was killed holding a request: its late reply will never come. Once a new pool on the
    same endpoint has the arena registered, nothing earlier can write into it, and the range returns."""
    from gepool import Pool
    from tests import repo as test_repo

    models, gate = str(tmp_path / "models"), str(tmp_path / "gate")
    test_repo.make_models.make_tiny(models)
    test_repo.recorder(models, "gated", gate=gate, delay_us=1000)
    endpoint = f"ipc://{tmp_path}/p.sock"
    open(gate, "w").close()
    old = Pool(models, endpoint=endpoint).start()
    c = None
    try:
        c = Client(endpoint, shared_memory=True, arena_bytes=1 << 20, arena_min_bytes=0)
        with pytest.raises(errors.PoolUnavailable):
            c.infer("gated", {"INPUT": np.full((8, 4), -1, np.float32)}, timeout=0.5)
        assert not whole(c.arena)
        old.process.kill()
        old.stop()  # removes the killed front's socket files
        os.unlink(gate)
        with Pool(models, endpoint=endpoint):
            x = np.ones((1, 16), np.float32)
            np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
            assert whole(c.arena), c.arena.free_ranges()
    finally:
        if c is not None:
            c.close()
        old.stop()
