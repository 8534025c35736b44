"""Clients' shared-memory arenas as the front holds them: registered by name, released by the client,
or reaped when the client's process is gone (a dead client never unregisters)."""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gepool.common import errors
from gepool.ipc import naming
from gepool.ipc.shm import Segment

log = logging.getLogger("gepool.arenas")

CHECK_S = 1.0  # how often the owners of arenas are checked for life


@dataclass
class Arena:
    """A client's arena, mapped into the front."""

    segment: Segment
    owner: bytes
    view: memoryview
    pid: int | None = None  # the client process that created it: the arena goes when it does

    def close(self) -> None:
        self.view.release()
        self.segment.close()


class Arenas:
    def __init__(self, on_drop: Callable[[str], None] | None = None) -> None:
        """``on_drop(name)``: an arena was released (workers that mapped it for direct batches unmap it)."""
        self._arenas: dict[int, Arena] = {}
        self._next = 0
        self.check_at = 0.0
        self.on_drop = on_drop

    def __len__(self) -> int:
        return len(self._arenas)

    def get(self, arena_id: object) -> Arena | None:
        return self._arenas.get(arena_id) if isinstance(arena_id, int) else None

    def register(self, identity: bytes, name: object, size: object) -> int:
        if not isinstance(name, str) or not name.startswith("/" + naming.PREFIX):
            raise errors.InvalidArgument(f"arena name must start with '/{naming.PREFIX}', got {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise errors.InvalidArgument(f"arena size must be a non-negative integer, got {size!r}")
        try:
            seg = Segment.attach(name)
        except Exception as exc:
            raise errors.InvalidArgument(f"cannot map arena {name}: {exc}") from None
        if seg.size < size:
            seg.close()
            raise errors.InvalidArgument(f"arena {name} has {seg.size} bytes, fewer than the {size} declared")
        self._next += 1
        self._arenas[self._next] = Arena(seg, identity, memoryview(seg.buf), naming.owner_pid(name[1:]))
        return self._next

    def unregister(self, arena_id: object) -> bool:
        arena = self._arenas.pop(arena_id, None) if isinstance(arena_id, int) else None
        if arena is not None:
            self._dropped(arena)
        return arena is not None

    def reap(self, now: float) -> None:
        """Releases (and unlinks: its owner can no longer) every arena whose client process is gone."""
        if now < self.check_at or not self._arenas:
            return
        self.check_at = now + CHECK_S
        for arena_id, arena in list(self._arenas.items()):
            if arena.pid is not None and not naming.pid_alive(arena.pid):
                log.info("client pid %d is gone; releasing its arena %d", arena.pid, arena_id)
                del self._arenas[arena_id]
                arena.segment.unlink()
                self._dropped(arena)

    def _dropped(self, arena: Arena) -> None:
        arena.close()
        if self.on_drop is not None:
            self.on_drop(arena.segment.name)

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
