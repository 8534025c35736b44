"""The response cache (Triton's local cache): whole responses by a hash of what was asked, LRU within a byte budget."""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gepool.ipc import dtypes

if TYPE_CHECKING:
    from gepool.scheduler.models import Model
    from gepool.scheduler.requests import Request

# Counted against the size with each entry: its key, header and book-keeping (so a flood of tiny
# responses cannot hold more memory than the configured size either).
ENTRY_OVERHEAD_BYTES = 256
KEY_BYTES = 16  # blake2b-128: a collision would answer one request with another's outputs
_LEN = struct.Struct("<Q")


def parse_cache_config(text: str) -> int:
    """Triton's ``--cache-config local,size=BYTES`` -> the size in bytes; ValueError naming what is wrong
    (gepool has the local cache only)."""
    kind, _, setting = text.partition(",")
    if kind.strip() != "local":
        raise ValueError(f"--cache-config '{text}': gepool has the 'local' cache only (local,size=BYTES)")
    key, _, value = setting.partition("=")
    if key.strip() != "size" or not value.strip().isdigit():
        raise ValueError(f"--cache-config '{text}': expected local,size=BYTES")
    return int(value)


@dataclass(slots=True)
class Entry:
    refs: list  # [name, datatype, shape, frame index] as a Result carries them
    frames: list[bytes]
    version: int
    nbytes: int


class ResponseCache:
    """Entries by key, least recently used first; ``used`` never exceeds ``capacity``. The front's one
    thread is its only user."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.hits = self.misses = self.inserts = self.evictions = 0

    def get(self, key: bytes) -> Entry | None:
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, refs: list, frames: list[bytes], version: int) -> bool:
        """Keeps a response, evicting the least recently used until it fits; False if it cannot fit at all."""
        nbytes = sum(len(f) for f in frames) + ENTRY_OVERHEAD_BYTES
        if nbytes > self.capacity:
            return False
        old = self.entries.pop(key, None)
        if old is not None:
            self.used -= old.nbytes
        while self.used + nbytes > self.capacity:
            _, evicted = self.entries.popitem(last=False)
            self.used -= evicted.nbytes
            self.evictions += 1
        self.entries[key] = Entry(refs, frames, version, nbytes)
        self.used += nbytes
        self.inserts += 1
        return True

    def as_dict(self) -> dict:
        lookups = self.hits + self.misses
        return {"kind": "local", "size": self.capacity, "used": self.used, "entries": len(self.entries),
                "lookups": lookups, "hits": self.hits, "misses": self.misses, "inserts": self.inserts,
                "evictions": self.evictions, "util": self.used / self.capacity if self.capacity else 0.0}


def request_key(model: Model, req: Request) -> bytes:
    """A hash of everything that decides the response: the model (name, version and the generation
    loaded, so a reload never answers from the old files), each input's name, datatype, shape and bytes,
    and which outputs were asked for, with their classification counts. Linear in the bytes the request
    brought, which admission has bounded already."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(f"{model.name}\0{model.version}\0{model.generation}\0".encode())
    for (name, datatype, _, _), shape, buf in zip(model.admission.inputs, req.shapes, req.inputs, strict=True):
        h.update(f"{name}\0{datatype}\0{shape}\0".encode())
        h.update(_LEN.pack(len(buf)))
        h.update(buf)
    wanted = sorted(req.outputs) if req.outputs is not None else ["*"]
    h.update("\0".join(f"{n}:{(req.classify or {}).get(n, 0)}" for n in wanted).encode())
    return h.digest()


def private_inputs(req: Request) -> None:
    """A cached request's inputs must not change between hashing and running: inputs in the client's arena
    (which it may rewrite at any time) are copied out first, so a client cannot store one input's outputs
    under another's key. The request then runs as frames do, never as a direct batch."""
    if req.where is not None:
        req.inputs = [memoryview(bytes(b)) for b in req.inputs]
        req.where = None


def entry_frames(names: list[str], pieces: list[np.ndarray]) -> tuple[list, list[bytes]]:
    """(refs, frames) of a response: private copies of the output pieces (views of a slot)."""
    refs, frames = [], []
    for i, (name, piece) in enumerate(zip(names, pieces, strict=True)):
        refs.append([name, dtypes.from_numpy(piece.dtype), list(piece.shape), i])
        frames.append(dtypes.serialize_bytes(piece) if piece.dtype == object else piece.tobytes())
    return refs, frames


def now_ns() -> int:
    return time.perf_counter_ns()
