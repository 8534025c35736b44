"""A named POSIX shared-memory segment mapped into this process (posix_ipc + mmap)."""

import mmap
from dataclasses import dataclass

import posix_ipc

OWNER_ONLY = 0o600


@dataclass(frozen=True)
class SegmentHandle:
    """What another process needs to map the same segment."""

    name: str
    size: int


class Segment:
    """One mapping of a named segment.

    ``close()`` unmaps this process's view; ``unlink()`` removes the name so no new process can
    attach, while every existing mapping stays valid until it is closed. gepool unlinks as soon
    as every party has mapped, so a crash of anyone afterwards leaks nothing.
    """

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory(name, flags, mode=OWNER_ONLY, size=size if create else 0)
        try:
            self.size = shm.size
            self.buf = mmap.mmap(shm.fd, self.size)
        except BaseException:
            if create:
                shm.unlink()
            raise
        finally:
            shm.close_fd()
        self.name = name
        self._linked = create

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        return cls(name, size, create=True)

    @classmethod
    def attach(cls, handle: SegmentHandle | str) -> "Segment":
        name = handle.name if isinstance(handle, SegmentHandle) else handle
        seg = cls(name, 0, create=False)
        seg._linked = False  # the creator owns the name
        return seg

    def handle(self) -> SegmentHandle:
        return SegmentHandle(self.name, self.size)

    def unlink(self) -> None:
        """Removes the name (idempotent); mappings stay valid."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
        self._linked = False

    def close(self) -> None:
        """Unmaps, unless numpy views still point into the mapping: then the mapping lives until
        the last view is collected (closing under a live view would make it fault)."""
        try:
            self.buf.close()
        except BufferError:
            pass
