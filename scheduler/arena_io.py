"""A client arena's bytes as the front reads and writes them: through its file, never a mapping.

A client may truncate its own segment at any time; a read or write through a mapping past the new end is
SIGBUS, which kills the front and every client with it. pread/pwrite on the segment's fd turn the same
truncation into a short read that fails one request.
"""

import os

import numpy as np

from gepool.common import errors


class ArenaFile:
    """The open segment. Requests still queued hold it (through their spans): the fd is closed only when the
    last holder goes, so a number that the kernel hands out again is never read as the arena."""

    __slots__ = ("fd", "name")

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def write(self, offset: int, arr: np.ndarray) -> bool:
        """Writes an array's bytes at ``offset``; False when the segment would not take them (then the
        caller sends them as frames). Past a truncated end the file grows back: nothing faults."""
        data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        try:
            return os.pwritev(self.fd, [data], offset) == len(data)
        except OSError:
            return False

    def __del__(self) -> None:
        os.close(self.fd)


class ArenaSpan:
    """An input that lies in a client's arena: where, and how many bytes; read when it is copied."""

    __slots__ = ("file", "offset", "nbytes")

    def __init__(self, file: ArenaFile, offset: int, nbytes: int) -> None:
        self.file, self.offset, self.nbytes = file, offset, nbytes

    def __len__(self) -> int:
        return self.nbytes

    def end(self) -> int:
        return self.offset + self.nbytes

    def read_into(self, dst: memoryview) -> None:
        """Copies the bytes into ``dst`` (a slot's). A segment truncated under the copy leaves a short
        read: the rest is zeroed, so the batch never carries an earlier batch's bytes for this request."""
        got = os.preadv(self.file.fd, [dst], self.offset) if self.nbytes else 0
        if got < self.nbytes:
            dst[got:] = bytes(self.nbytes - got)

    def __bytes__(self) -> bytes:
        data = self.file.read(self.offset, self.nbytes)
        if len(data) != self.nbytes:
            raise errors.InvalidArgument(truncated(self.file.name, self.end()))
        return data


def truncated(name: str, end: int) -> str:
    return f"arena {name} was truncated: its request reads up to byte {end}, past the segment's end"
