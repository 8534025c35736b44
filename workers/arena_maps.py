"""Clients' arenas mapped into a worker, for direct batches (one request whose tensors stay in its
client's arena: the worker reads the inputs and writes the outputs there, and the front copies
neither way).

The front names the arena in the slot; the worker maps it on first use and keeps the mapping for
the next batches of that client. The front says when a client has released its arena (DropArena),
and the map is bounded besides, so mappings of clients gone cannot pile up.
"""

from collections import OrderedDict

from gepool.ipc.shm import Segment

MAX_MAPPED = 16


class ArenaMaps:
    def __init__(self, limit: int = MAX_MAPPED) -> None:
        self.limit = limit
        self._maps: OrderedDict[str, tuple[Segment, memoryview]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._maps)

    def buffer(self, name: str) -> memoryview:
        """The arena's bytes, mapped now if not already (raises if the client has unlinked it)."""
        entry = self._maps.get(name)
        if entry is None:
            seg = Segment.attach(name)
            entry = self._maps[name] = (seg, memoryview(seg.buf))
            while len(self._maps) > self.limit:
                self._close(self._maps.popitem(last=False)[1])
        else:
            self._maps.move_to_end(name)
        return entry[1]

    def drop(self, name: str) -> None:
        entry = self._maps.pop(name, None)
        if entry is not None:
            self._close(entry)

    def close(self) -> None:
        while self._maps:
            self._close(self._maps.popitem()[1])

    @staticmethod
    def _close(entry: tuple[Segment, memoryview]) -> None:
        seg, view = entry
        try:
            view.release()
        except BufferError:  # an array of a batch still points here; the mapping lives until it goes
            pass
        seg.close()
