"""System shared-memory regions registered by HTTP clients (Triton's system_shared_memory extension).

A region is opened by the exact key the client gives (``/dev/shm/<key without leading slashes>``),
checked against its size at registration, and reference-counted by the requests using it, so an
unregister during a request takes effect when the request ends instead of unmapping under it.
"""

import mmap
import os
from dataclasses import dataclass

from gepool.common.errors import InvalidArgument

SHM_DIR = "/dev/shm"


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    map: mmap.mmap
    refs: int = 0
    doomed: bool = False


class Regions:
    def __init__(self) -> None:
        self.regions: dict[str, Region] = {}

    def register(self, name: str, key, offset, byte_size) -> None:
        if name in self.regions:
            raise InvalidArgument(f"shared memory region '{name}' already in manager")
        if not isinstance(key, str) or not key.strip("/") or "/" in key.strip("/"):
            raise InvalidArgument(f"shared memory key must name an object in {SHM_DIR}, got {key!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, byte_size)):
            raise InvalidArgument("offset and byte_size must be non-negative integers")
        path = os.path.join(SHM_DIR, key.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise InvalidArgument(f"Unable to open shared memory region: '{key}': {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size or byte_size == 0:
                raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args "
                                      f"(offset {offset} + byte_size {byte_size} > {size} bytes of '{key}')")
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.regions[name] = Region(name, key, offset, byte_size, mapped)

    def unregister(self, name: str | None) -> None:
        for region in ([self.regions[name]] if name in self.regions else [] if name else list(self.regions.values())):
            region.doomed = True
            self._maybe_close(region)

    def status(self, name: str | None = None) -> list[dict]:
        if name is not None and name not in self.regions:
            raise InvalidArgument(f"Unable to find system shared memory region: '{name}'")
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in self.regions.values() if name is None or r.name == name]

    def acquire(self, name: str) -> Region:
        region = self.regions.get(name)
        if region is None or region.doomed:
            raise InvalidArgument(f"Unable to find system shared memory region: '{name}'")
        region.refs += 1
        return region

    def release(self, region: Region) -> None:
        region.refs -= 1
        self._maybe_close(region)

    def read(self, region: Region, offset: int, size) -> bytes:
        """A copy of [offset, offset + size) of the region (the region is the client's: keep no view)."""
        size = region.byte_size - offset if size is None else size
        self._check(region, offset, size)
        start = region.offset + offset
        return region.map[start:start + size]

    def write(self, region: Region, offset: int, size: int, data: bytes) -> None:
        limit = size or region.byte_size - offset
        self._check(region, offset, len(data))
        if len(data) > limit:
            raise InvalidArgument(f"output of {len(data)} bytes does not fit the {limit} bytes given in "
                                  f"region '{region.name}'")
        start = region.offset + offset
        region.map[start:start + len(data)] = data

    def _check(self, region: Region, offset: int, size: int) -> None:
        if not isinstance(offset, int) or offset < 0 or size < 0 or offset + size > region.byte_size:
            raise InvalidArgument(f"[{offset}, {offset + size}) lies outside shared memory region '{region.name}' "
                                  f"of {region.byte_size} bytes")

    def _maybe_close(self, region: Region) -> None:
        if region.doomed and region.refs == 0 and self.regions.get(region.name) is region:
            del self.regions[region.name]
            region.map.close()

    def close(self) -> None:
        for region in list(self.regions.values()):
            region.map.close()
        self.regions.clear()
