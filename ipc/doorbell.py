"""Doorbells between the front and one worker: two named FIFOs carrying (slot, seq) records.

A batch's wake-up and its completion are the latency-critical messages; over ZMQ each one passes
through both sides' I/O threads. A FIFO write is one syscall, and its read end sits in the same
poll as everything else (the front's zmq.Poller, the worker's), so no thread hop is added. Each
record is written whole (far below PIPE_BUF), so a worker's completion threads may ring at once.
The front makes both FIFOs (owner-only) and unlinks them as soon as the worker has opened its ends.
"""

import os
import struct
from dataclasses import dataclass

RECORD = struct.Struct("<IQ")  # slot index, sequence number
READ_CHUNK = RECORD.size * 512
# Not a slot: "a batch is coming". A front that busy-polls sends it as a request arrives, so that the
# worker wakes (and polls) while the front admits the request, instead of after.
PREPARE = 0xFFFFFFFE


@dataclass(frozen=True)
class BellPaths:
    run: str  # front -> worker: run this slot
    done: str  # worker -> front: this slot is done


def make(folder: str, tag: str) -> BellPaths:
    paths = BellPaths(os.path.join(folder, f"{tag}.run"), os.path.join(folder, f"{tag}.done"))
    for p in (paths.run, paths.done):
        if os.path.exists(p):
            os.unlink(p)
        os.mkfifo(p, 0o600)
    return paths


_PREPARE_RECORD = RECORD.pack(PREPARE, 0)


def _records(data: bytes) -> list[tuple[int, int]]:
    return list(RECORD.iter_unpack(data[: len(data) - len(data) % RECORD.size]))


class FrontBell:
    def __init__(self, paths: BellPaths) -> None:
        self.paths = paths
        # O_RDWR: opening a FIFO this way never blocks and never fails for want of a peer (Linux)
        self.run_fd = os.open(paths.run, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.done_fd = os.open(paths.done, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._partial = b""

    def ring(self, slot: int, seq: int) -> None:
        os.write(self.run_fd, RECORD.pack(slot, seq))

    def prepare(self) -> None:
        os.write(self.run_fd, _PREPARE_RECORD)

    def completions(self) -> list[tuple[int, int]] | None:
        """Completed (slot, seq) records; None once the worker's end is closed (it exited)."""
        try:
            data = os.read(self.done_fd, READ_CHUNK)
        except BlockingIOError:
            return []
        if not data:
            return None
        data = self._partial + data
        cut = len(data) - len(data) % RECORD.size
        self._partial = data[cut:]
        return _records(data[:cut])

    def unlink(self) -> None:
        for p in (self.paths.run, self.paths.done):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        for fd in (self.run_fd, self.done_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class WorkerBell:
    def __init__(self, paths: BellPaths) -> None:
        self.run_fd = os.open(paths.run, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.done_fd = os.open(paths.done, os.O_WRONLY | os.O_CLOEXEC)  # the front holds the read end open
        self._partial = b""

    def runs(self) -> list[tuple[int, int]]:
        try:
            data = self._partial + os.read(self.run_fd, READ_CHUNK)
        except BlockingIOError:
            return []
        cut = len(data) - len(data) % RECORD.size
        self._partial = data[cut:]
        return _records(data[:cut])

    def done(self, slot: int, seq: int) -> None:
        os.write(self.done_fd, RECORD.pack(slot, seq))

    def close(self) -> None:
        for fd in (self.run_fd, self.done_fd):
            try:
                os.close(fd)
            except OSError:
                pass
