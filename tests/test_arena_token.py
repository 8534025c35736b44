"""An arena is registered only by a client that could read it: the token its creator wrote at offset 0.

Over tcp without CURVE the kernel names no peer, so the token is all that stands between a local user
who knows an arena's name (it is in /dev/shm for anyone to list) and another client's tensors."""

import os
import secrets
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest
import zmq

from gepool import Client, Pool
from gepool.common import errors
from gepool.ipc import lane, layout, protocol
from tests import repo as test_repo
from tests.test_http_hostile import as_nobody, root_only


@pytest.fixture(scope="module")
def tcp_pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("arena-token"))
    test_repo.make_models.make_tiny(repo)
    with Pool(repo, endpoint="tcp://127.0.0.1:*") as pool:
        yield pool


def _register(endpoint: str, msgs: list) -> list[tuple[str, str, str]]:
    """Sends each message on a fresh DEALER and returns (type, code, message) of each reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(endpoint)
    try:
        out = []
        for msg in msgs:
            sock.send(msg.encode())
            reply = protocol.decode(sock.recv())
            out.append((type(reply).__name__, getattr(reply, "code", ""), getattr(reply, "message", "")))
        return out
    finally:
        sock.close()
        ctx.term()


def _owner_served(owner: Client) -> None:
    x = owner.empty((1, 16), np.float32)
    x[:] = 2.0
    np.testing.assert_array_equal(owner.infer("tiny", {"INPUT0": x})["OUTPUT0"], np.full((1, 16), 5.0))


def test_a_tcp_client_without_the_token_cannot_register_an_arena(tcp_pool):
    """The attacker knows the name and size but not the token: no token, a guessed one and one of the
    wrong length are each refused naming the arena; the owner, who sent its token, is served from it."""
    with Client(tcp_pool.endpoint, shared_memory=True, arena_min_bytes=0) as owner:
        assert owner._arena_id != protocol.NO_ARENA  # the owner registered over tcp
        name, size = owner.arena.segment.name, owner.arena.size
        arenas = owner.status()["arenas"]
        replies = _register(tcp_pool.endpoint, [
            protocol.RegisterArena(1, name, size),
            protocol.RegisterArena(2, name, size, secrets.token_bytes(layout.ARENA_TOKEN_BYTES)),
            protocol.RegisterArena(3, name, size, owner.arena.token[:16]),
        ])
        for kind, code, message in replies:
            assert (kind, code) == ("Error", errors.PermissionDenied.code) and name in message, replies
        assert "no 32-byte token" in replies[0][2] and "does not match" in replies[1][2]
        assert "no 32-byte token" in replies[2][2]
        assert owner.status()["arenas"] == arenas  # nothing registered
        _owner_served(owner)


def test_an_arena_others_may_open_is_refused_even_with_its_token(tcp_pool):
    """A token in a segment others can read proves nothing: the front checks the mode of what it mapped."""
    with Client(tcp_pool.endpoint, shared_memory=True, arena_min_bytes=0) as owner:
        name, size = owner.arena.segment.name, owner.arena.size
        os.chmod(f"/dev/shm{name}", 0o644)
        replies = _register(tcp_pool.endpoint, [protocol.RegisterArena(1, name, size, owner.arena.token)])
        assert replies[0][:2] == ("Error", errors.PermissionDenied.code) and "mode 0644" in replies[0][2], replies
        os.chmod(f"/dev/shm{name}", 0o600)
        replies = _register(tcp_pool.endpoint, [protocol.RegisterArena(2, name, size, owner.arena.token)])
        assert replies[0][0] == "Reply", replies  # the token is what the owner's own registration sends


def _attack_as_another_user(endpoint: str, name: str, size: int) -> dict:
    try:
        posix_ipc.SharedMemory(name)
        readable = True
    except posix_ipc.PermissionsError:
        readable = False
    guessed = bytes(layout.ARENA_TOKEN_BYTES)
    return {"readable": readable, "replies": _register(endpoint, [protocol.RegisterArena(1, name, size),
                                                                  protocol.RegisterArena(2, name, size, guessed)])}


@root_only
def test_another_user_over_tcp_can_neither_read_the_token_nor_register_the_arena(tcp_pool):
    """uid 65534, on the same host, lists the arena's name and tries it: it cannot open the segment to
    read the token, and both registrations are refused; the owner's bytes are untouched."""
    with Client(tcp_pool.endpoint, shared_memory=True, arena_min_bytes=0) as owner:
        name, size = owner.arena.segment.name, owner.arena.size
        owner.arena.buf[layout.ARENA_HEADER:layout.ARENA_HEADER + 4096] = b"\x07" * 4096
        arenas = owner.status()["arenas"]
        got = as_nobody(_attack_as_another_user, tcp_pool.endpoint, name, size)
        assert got["readable"] is False
        for kind, code, message in got["replies"]:
            assert (kind, code) == ("Error", errors.PermissionDenied.code) and name in message, got
        assert owner.status()["arenas"] == arenas
        assert bytes(owner.arena.buf[layout.ARENA_HEADER:layout.ARENA_HEADER + 4096]) == b"\x07" * 4096
        _owner_served(owner)


LANE_ATTACK = """
import sys
from gepool.ipc import lane, protocol

conn = lane.Connection(sys.argv[1])
conn.send([protocol.RegisterArena(1, sys.argv[2], int(sys.argv[3]), bytes.fromhex(sys.argv[4])).encode()], 10)
reply = protocol.decode(conn.recv(None)[0])
print(type(reply).__name__, getattr(reply, "code", ""), getattr(reply, "message", ""), flush=True)
conn.close()
"""


def test_over_a_lane_the_right_token_does_not_lift_the_process_check(pool):
    """A lane's peer is known to the kernel: another process is refused another's arena even with its token."""
    with Client(pool.endpoint, shared_memory=True, arena_min_bytes=0) as owner:
        name, size = owner.arena.segment.name, owner.arena.size
        path = lane.path_for(pool.endpoint[len("ipc://"):])
        out = subprocess.run([sys.executable, "-c", LANE_ATTACK, path, name, str(size), owner.arena.token.hex()],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("Error PERMISSION_DENIED"), out.stdout + out.stderr
        assert "not made by this client's process" in out.stdout
        _owner_served(owner)


def test_registrations_are_bounded_and_a_repeat_holds_no_second_fd(monkeypatch):
    """Each registered arena holds an fd in the front: one client registering its arena again and again
    gets the same id (one fd), and past MAX_ARENAS every new registration is refused UNAVAILABLE."""
    from gepool.arena import ClientArena
    from gepool.scheduler import arenas as front_arenas

    monkeypatch.setattr(front_arenas, "MAX_ARENAS", 3)
    mine = [ClientArena(1 << 16) for _ in range(4)]
    held = front_arenas.Arenas()
    try:
        fds = len(os.listdir("/proc/self/fd"))
        first = held.register(b"a", mine[0].segment.name, mine[0].size, mine[0].token)
        for _ in range(50):
            assert held.register(b"a", mine[0].segment.name, mine[0].size, mine[0].token) == first
        assert len(held) == 1 and len(os.listdir("/proc/self/fd")) == fds + 1
        held.register(b"b", mine[1].segment.name, mine[1].size, mine[1].token)
        held.register(b"c", mine[2].segment.name, mine[2].size, mine[2].token)
        with pytest.raises(errors.Unavailable, match=f"holds 3 client arenas; arena {mine[3].segment.name}"):
            held.register(b"d", mine[3].segment.name, mine[3].size, mine[3].token)
    finally:
        held.close()
        for a in mine:
            a.close()
