"""Clients' shared-memory arenas as the front holds them: registered by name, used and released only
by the client that registered them, or reaped when the client's process is gone (a dead client never
unregisters).

An arena belongs to the identity that registered it and to every lane of the process that made it
(a client's threads each have a lane; the kernel names a lane's process). A client on a lane may
register only an arena its own process made and owns; nobody may register the pool's own segments. A
ZMQ peer is not identified by the kernel (on a tcp endpoint without CURVE it may be any local user), so
every registration also proves access: it carries the token the arena's creator wrote at its offset 0,
and the segment must be one only its owner can open, so that nobody else could have read the token.

The front never maps an arena: it reads and writes it through its fd (scheduler/arena_io.py), so a
client that truncates its segment fails its own request and crashes nothing.
"""

import hmac
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from gepool.common import errors
from gepool.ipc import layout, naming
from gepool.scheduler.arena_io import ArenaFile

log = logging.getLogger("gepool.arenas")

CHECK_S = 1.0  # how often the owners of arenas are checked for life
MAX_ARENAS = 1024  # each holds an fd in the front: past this, registrations are refused, not fds run out


@dataclass
class Arena:
    """A client's arena, open in the front. ``size``: what it had at registration, the bound on offsets."""

    file: ArenaFile
    owner: bytes
    size: int
    pid: int | None = None  # the client process that created it: the arena goes when it does
    # it may run direct batches (a worker maps it): not once it was seen truncated or a worker died in it,
    # for a truncation racing a worker's mapped reads is SIGBUS there
    direct: bool = True

    @property
    def name(self) -> str:
        return self.file.name


def _no_peer(identity: bytes) -> tuple[int, int] | None:
    return None


def _check_access(file: ArenaFile, st: os.stat_result, size: int, token: bytes) -> None:
    """The opened segment is an owner-only arena of at least ``size`` bytes that begins with ``token``."""
    name, mode = file.name, stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode) or mode & 0o077:
        raise errors.PermissionDenied(f"arena {name} may be opened by others than its owner (mode {mode:04o}): "
                                      "its token proves nothing")
    if st.st_size < max(size, layout.ARENA_HEADER):
        raise errors.InvalidArgument(f"arena {name} has {st.st_size} bytes, fewer than the "
                                     f"{max(size, layout.ARENA_HEADER)} declared")
    if not hmac.compare_digest(file.read(0, layout.ARENA_TOKEN_BYTES), token):
        raise errors.PermissionDenied(f"arena {name}: the token does not match the one in the arena")


class Arenas:
    def __init__(self, on_drop: Callable[[str], None] | None = None, own_prefix: str = "") -> None:
        """``on_drop(name)``: an arena was released (workers that mapped it for direct batches unmap it).
        ``own_prefix``: the names of the pool's own segments."""
        self._arenas: dict[int, Arena] = {}
        self._next = 0
        self.check_at = 0.0
        self.on_drop = on_drop
        self.own_prefix = own_prefix
        self.peer: Callable[[bytes], tuple[int, int] | None] = _no_peer  # a lane's (pid, uid); the loop sets it

    def __len__(self) -> int:
        return len(self._arenas)

    def get(self, arena_id: object) -> Arena | None:
        return self._arenas.get(arena_id) if isinstance(arena_id, int) else None

    def of_client(self, arena_id: object, identity: bytes) -> Arena | None:
        """The arena, if the client behind ``identity`` may use it (None: unknown, or someone else's)."""
        arena = self._arenas.get(arena_id) if type(arena_id) is int else None
        if arena is None or arena.owner == identity:
            return arena
        peer = self.peer(identity)
        return arena if peer is not None and arena.pid is not None and peer[0] == arena.pid else None

    def register(self, identity: bytes, name: object, size: object, token: object = b"") -> int:
        if not isinstance(name, str) or not name.startswith("/" + naming.PREFIX):
            raise errors.InvalidArgument(f"arena name must start with '/{naming.PREFIX}', got {name!r}")
        if "/" in name[1:] or "\0" in name:
            raise errors.InvalidArgument(f"arena name {name!r} is not a segment name (a '/' or NUL inside)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise errors.InvalidArgument(f"arena size must be a non-negative integer, got {size!r}")
        pid = naming.owner_pid(name[1:])
        peer = self.peer(identity)
        if self.own_prefix and name.startswith(self.own_prefix):
            raise errors.PermissionDenied(f"{name} is one of the pool's own segments, not an arena")
        if peer is not None and pid != peer[0]:
            raise errors.PermissionDenied(f"arena {name} was not made by this client's process (pid {peer[0]})")
        if peer is not None:
            try:
                st = os.lstat(naming.SHM_DIR + name)
            except OSError as exc:
                raise errors.InvalidArgument(f"cannot map arena {name}: {exc.strerror}") from None
            if not stat.S_ISREG(st.st_mode) or st.st_uid != peer[1]:
                raise errors.PermissionDenied(f"arena {name} is not a segment of this client's user (uid {peer[1]})")
        if not isinstance(token, bytes) or len(token) != layout.ARENA_TOKEN_BYTES:
            raise errors.PermissionDenied(f"arena {name}: the registration carries no {layout.ARENA_TOKEN_BYTES}-byte "
                                          "token (the one its creator wrote at its offset 0)")
        try:
            file = ArenaFile(os.open(naming.SHM_DIR + name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), name)
        except OSError as exc:
            raise errors.InvalidArgument(f"cannot open arena {name}: {exc.strerror}") from None
        st = os.fstat(file.fd)  # of what was opened, not of what was looked at
        _check_access(file, st, size, token)
        if peer is not None and st.st_uid != peer[1]:
            raise errors.PermissionDenied(f"arena {name} is not a segment of this client's user (uid {peer[1]})")
        for arena_id, arena in self._arenas.items():
            if arena.owner == identity and arena.name == name:
                return arena_id  # registered again (a client retrying): the same arena, no second fd
        if len(self._arenas) >= MAX_ARENAS:
            raise errors.Unavailable(f"the front holds {MAX_ARENAS} client arenas; arena {name} is not registered")
        self._next += 1
        self._arenas[self._next] = Arena(file, identity, st.st_size, pid)
        return self._next

    def unregister(self, arena_id: object, identity: bytes) -> bool:
        """False for an id nobody registered; InvalidArgument for someone else's arena (left as it is)."""
        if self.get(arena_id) is None:
            return False
        arena = self.of_client(arena_id, identity)
        if arena is None:
            raise errors.InvalidArgument(f"arena {arena_id} is not registered by this client")
        del self._arenas[arena_id]
        self._dropped(arena)
        return True

    def reap(self, now: float) -> None:
        """Releases (and unlinks: its owner can no longer) every arena whose client process is gone."""
        if now < self.check_at or not self._arenas:
            return
        self.check_at = now + CHECK_S
        for arena_id, arena in list(self._arenas.items()):
            if arena.pid is not None and not naming.pid_alive(arena.pid):
                log.info("client pid %d is gone; releasing its arena %d", arena.pid, arena_id)
                del self._arenas[arena_id]
                try:
                    os.unlink(naming.SHM_DIR + arena.name)
                except OSError:
                    pass
                self._dropped(arena)

    def _dropped(self, arena: Arena) -> None:
        # its fd closes with the last queued request that still reads it (ArenaFile)
        if self.on_drop is not None:
            self.on_drop(arena.name)

    def close(self) -> None:
        self._arenas.clear()
