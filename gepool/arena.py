"""A client's shared-memory arena: tensors placed here reach the front as offsets, not bytes."""

import collections
import secrets
import threading
import weakref

import numpy as np

from gepool.ipc import layout, naming
from gepool.ipc.shm import Segment


class ArenaFull(Exception):
    """No free range is large enough; the caller falls back to sending frames."""


class ClientArena:
    """A segment plus a first-fit allocator of 256-byte aligned ranges, safe across threads.

    Its name stays linked while the client lives, so that a pool restarted on the same endpoint can
    map it again; close() unlinks it, the front unlinks it when it sees the client's process gone, and
    ``gepool cleanup`` finds it by the pid in its name.

    Its first ``layout.ARENA_HEADER`` bytes are never handed out: they hold a random token that only
    processes able to open the owner-only segment can read. RegisterArena carries it, and the front
    registers the arena only for a client that sent it (a peer on tcp has no identity the kernel gives)."""

    def __init__(self, size: int) -> None:
        self.size = layout.align(max(size, layout.ARENA_HEADER + 1), 4096)
        self.segment = Segment.create(naming.segment_name(naming.new_owner_id(), "arena"), self.size)
        self.buf = memoryview(self.segment.buf)
        self.token = secrets.token_bytes(layout.ARENA_TOKEN_BYTES)
        self.buf[:len(self.token)] = self.token
        self.start = layout.ARENA_HEADER  # the first offset alloc may hand out
        self._free: list[tuple[int, int]] = [(self.start, self.size - self.start)]  # sorted (offset, length)
        self._lock = threading.Lock()
        # ranges of collected arrays: a finalizer may run on a thread that is inside alloc or free
        # already, so it only appends here (atomic) and the next alloc or free takes them in
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._base = np.frombuffer(self.buf, np.uint8).__array_interface__["data"][0]

    def empty(self, shape, dtype) -> np.ndarray:
        """An array that lives in the arena: fill it and pass it as an input, and the request carries
        its offset instead of copying it in. Its range returns to the arena when the array is collected."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offset = self.alloc(nbytes)
        region = np.frombuffer(self.buf, np.uint8, max(nbytes, 1), offset)
        weakref.finalize(region, self.give_back, offset, nbytes)
        return region[:nbytes].view(dtype).reshape(shape)

    def offset_of(self, arr: np.ndarray) -> int | None:
        """Where a C-contiguous array lies in the arena, or None when it lies elsewhere."""
        if not arr.flags.c_contiguous or arr.nbytes == 0:
            return None
        start = arr.__array_interface__["data"][0] - self._base
        return start if 0 <= start and start + arr.nbytes <= self.size else None

    def give_back(self, offset: int, nbytes: int) -> None:
        """``free`` for finalizers: safe to call from anywhere, taken in by the next alloc or free."""
        self._returned.append((offset, nbytes))

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free (offset, length) ranges, sorted; what the arena can still hand out."""
        self.free(0, -1)
        return list(self._free)

    def alloc(self, nbytes: int) -> int:
        need = layout.align(max(nbytes, 1))
        self.free(0, -1)  # take in what finalizers gave back
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    return off
        raise ArenaFull(f"no {need} free bytes in the {self.size}-byte arena")

    def free(self, offset: int, nbytes: int) -> None:
        """Returns a range (``nbytes`` < 0: none, only take in what finalizers gave back)."""
        with self._lock:
            if nbytes >= 0:
                self._free.append((offset, layout.align(max(nbytes, 1))))
            while self._returned:
                off, n = self._returned.popleft()
                self._free.append((off, layout.align(max(n, 1))))
            if not self._free:
                return
            self._free.sort()
            merged = [self._free[0]]
            for off, length in self._free[1:]:
                last_off, last_len = merged[-1]
                if last_off + last_len == off:
                    merged[-1] = (last_off, last_len + length)
                else:
                    merged.append((off, length))
            self._free = merged

    def close(self) -> None:
        self.segment.unlink()
        try:
            self.buf.release()
        except BufferError:
            pass
        self.segment.close()
