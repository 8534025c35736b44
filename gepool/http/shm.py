"""System shared-memory regions registered by HTTP clients (Triton's system_shared_memory extension).

A caller may register only memory it could open itself, and never the pool's own: the key names one
regular file directly in /dev/shm, opened without following links, owned by the caller's uid (the
peer of the loopback connection, see ``peer.py``) with owner read and write in its mode, and not
one of gepool's segments. Regions live in one namespace per uid, so no caller sees, uses or
unregisters another's. Data moves with ``os.preadv``/``os.pwritev`` on the region's fd, never
through a mapping: a client that truncates its segment under a request gets an error for that
request instead of killing this process with SIGBUS. A request holds a reference on each region it
names, so an unregister during the request takes effect when the request ends.

A sidecar the pool started keeps no record of its own: the front holds the pool's one record
(``scheduler/regions.py``), so that every sidecar serving the port sees what was registered through
any of them. This process keeps an open fd per region, reopened (and checked again) when the
record's version changes.
"""

import asyncio
import errno
import logging
import mmap
import os
import stat
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from gepool.common.errors import AlreadyExists, GepoolError, InvalidArgument, PermissionDenied, Unavailable
from gepool.ipc import naming
from gepool.scheduler.regions import MAX_REGIONS_PER_UID, VERSION, check_text

log = logging.getLogger("gepool.http")
SHM_DIR = "/dev/shm"
_RESERVED = (naming.PREFIX, "sem." + naming.PREFIX)
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass
class Region:
    uid: int
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int  # -1: not open here (``broken`` says why)
    refs: int = 0
    doomed: bool = False
    serial: int = 0  # the front's serial for it (0: a sidecar keeping its own record)
    dev: int = 0  # the file the registering sidecar checked, which every other must open again
    ino: int = 0
    broken: str | None = None  # why it can never be opened here (403)
    lacking: str | None = None  # why it could not be opened here the last time it was tried (503, tried again)


def _count(what: str, value, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _key_name(key) -> str:
    if not isinstance(key, str):
        raise InvalidArgument(f"shared memory key must be a string naming an object in {SHM_DIR}, got {key!r:.200}")
    check_text("key", key)
    name = key.lstrip("/")
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise InvalidArgument(f"shared memory key must name one object directly in {SHM_DIR}, got {key!r}")
    if name.startswith(_RESERVED):
        raise PermissionDenied(f"shared memory key '{key}' names one of gepool's own segments; register a "
                               f"segment of your own")
    return name


Book = Callable[[dict], Awaitable[dict]]  # the front's 'regions' query, the token added
BOOK_TIMEOUT_S = 10.0  # a 'regions' query the front has not answered by then fails (503), freeing the others
WATCH_S = 1.0  # an idle sidecar adopts a changed record this often: unregistered segments close in it too


class Regions:
    """Every registered region by (uid, name); safe to use from the event loop and worker threads.
    ``book`` and ``page``: the front's record and its version page (a sidecar the pool started); without
    them this process keeps the only record."""

    def __init__(self, book: Book | None = None, page: mmap.mmap | None = None) -> None:
        self.regions: dict[tuple[int, str], Region] = {}
        self._lock = threading.Lock()
        self.book, self.page = book, page
        self.version = -1  # of the front's record as last adopted (-1: never)
        self._syncing = asyncio.Lock()  # one exchange with the front at a time: records are adopted in order
        self._watcher: asyncio.Task | None = None

    def stale(self) -> bool:
        """Whether the front's record changed since this process adopted it (a read of the shared page)."""
        return self.book is not None and VERSION.unpack_from(self.page)[0] != self.version

    async def current(self) -> None:
        """Adopts the front's record if it changed since last adopted: called before a request may look a
        region up, so that one registered or unregistered through another sidecar is seen."""
        if not self.stale():
            return
        async with self._syncing:
            if self.stale():
                self._adopt(await self._ask({"op": "list"}))

    def watch(self) -> None:
        """Adopts a changed record every WATCH_S even with no request here (closing unregistered segments)."""
        if self.book is not None and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self.current()
            except GepoolError as exc:  # the front busy or gone: the next request or pass tries again
                log.debug("could not adopt the shared-memory record: %s", exc)

    async def _ask(self, args: dict) -> dict:
        try:
            return await asyncio.wait_for(self.book(args), BOOK_TIMEOUT_S)
        except TimeoutError:
            raise Unavailable(f"the pool did not answer about shared memory regions within {BOOK_TIMEOUT_S:.0f} "
                              f"s") from None

    async def register(self, uid: int, name: str, key, offset, byte_size) -> None:
        offset, byte_size = _count("offset", offset, 0), _count("byte_size", byte_size)
        entry = _key_name(key)
        check_text("region name", name)
        if self.book is None:
            with self._lock:
                self._room(uid, name)
        fd = _open(entry, key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PermissionDenied(f"shared memory key '{key}' is not a regular file")
            if st.st_uid != uid:
                raise PermissionDenied(f"shared memory key '{key}' belongs to uid {st.st_uid}, not to the caller "
                                       f"(uid {uid}): register only segments you own")
            if st.st_mode & (stat.S_IRUSR | stat.S_IWUSR) != stat.S_IRUSR | stat.S_IWUSR:
                raise PermissionDenied(f"shared memory key '{key}' is not readable and writable by its owner "
                                       f"(mode {stat.S_IMODE(st.st_mode):o})")
            if byte_size == 0 or offset + byte_size > st.st_size:
                raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args "
                                      f"(offset {offset} + byte_size {byte_size} > {st.st_size} bytes of '{key}')")
            if self.book is not None:
                async with self._syncing:
                    change = await self._ask({"op": "register", "uid": uid, "name": name, "key": key,
                                              "offset": offset, "byte_size": byte_size, "dev": st.st_dev,
                                              "ino": st.st_ino})
                    if change["version"] == self.version + 1:
                        self._add(change["region"], fd)
                        fd = -1
                        self.version = change["version"]
                    else:  # other sidecars changed it too meanwhile: the whole record, this region's fd kept
                        mine = (uid, name, change["region"]["serial"])
                        fd = self._adopt(await self._ask({"op": "list"}), mine, fd)
                if fd >= 0:  # unregistered again (through another sidecar) before this one adopted it
                    os.close(fd)
                return
            with self._lock:
                self._room(uid, name)
                self.regions[(uid, name)] = Region(uid, name, key, offset, byte_size, fd, dev=st.st_dev,
                                                   ino=st.st_ino)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

    def _adopt(self, record: dict, mine: tuple[int, str, int] | None = None, fd: int = -1) -> int:
        """Makes this process's regions the front's ``record``: a region gone from it (or registered again
        since, under a new serial) is doomed, a new one opened here, except ``mine`` (uid, name, serial),
        which takes ``fd`` (the caller's, just checked) if the record still holds that registration.
        Returns ``fd`` unless the region took it (then -1)."""
        wanted = {(r["uid"], r["name"]): r for r in record["regions"]}
        with self._lock:
            for k, region in list(self.regions.items()):
                if k not in wanted or wanted[k]["serial"] != region.serial:
                    self._doom(self.regions.pop(k))
            new = [r for k, r in wanted.items() if k not in self.regions]
        for r in new:
            if (r["uid"], r["name"], r["serial"]) == mine:
                self._add(r, fd)
                fd = -1
            else:
                self._add(r, -1)
        self.version = record["version"]
        return fd

    def _add(self, r: dict, fd: int) -> None:
        """The front's region ``r`` into this process's, on ``fd`` (the registering caller's) or, with -1,
        opened here (outside the lock: acquire() in worker threads need not wait for the syscalls)."""
        region = Region(r["uid"], r["name"], r["key"], r["offset"], r["byte_size"], fd, serial=r["serial"],
                        dev=r["dev"], ino=r["ino"])
        if fd < 0:
            _open_again(region)
        with self._lock:
            self.regions[(region.uid, region.name)] = region

    def _doom(self, region: Region) -> None:
        region.doomed = True
        if region.refs == 0 and region.fd >= 0:
            os.close(region.fd)

    def _room(self, uid: int, name: str) -> None:
        if (uid, name) in self.regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        if sum(owner == uid for owner, _ in self.regions) >= MAX_REGIONS_PER_UID:
            raise InvalidArgument(f"uid {uid} already has {MAX_REGIONS_PER_UID} shared memory regions registered; "
                                  f"unregister some first")

    async def unregister(self, uid: int | None, name: str | None) -> None:
        """One region of the caller's, or (no name) all of them; a region in use closes when released."""
        if self.book is not None:
            if uid is not None:
                async with self._syncing:
                    change = await self._ask({"op": "unregister", "uid": uid, "name": name})
                    if change["version"] == self.version + bool(change["removed"]):
                        with self._lock:
                            for owner, n in change["removed"]:
                                if (owner, n) in self.regions:
                                    self._doom(self.regions.pop((owner, n)))
                        self.version = change["version"]
                    else:  # other sidecars changed it too meanwhile
                        self._adopt(await self._ask({"op": "list"}))
            return
        with self._lock:
            mine = [k for k in self.regions if k[0] == uid and (name is None or k[1] == name)]
            for k in mine:
                self._doom(self.regions.pop(k))

    async def status(self, uid: int | None, name: str | None = None) -> list[dict]:
        await self.current()
        with self._lock:
            if name is not None and (uid, name) not in self.regions:
                raise InvalidArgument(f"Unable to find system shared memory region: '{name}'")
            return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                    for (owner, n), r in sorted(self.regions.items()) if owner == uid and name in (None, n)]

    def acquire(self, uid: int | None, name) -> Region:
        with self._lock:
            region = self.regions.get((uid, name)) if isinstance(name, str) else None
            if region is None:
                raise InvalidArgument(f"Unable to find system shared memory region: '{name}'")
            if region.fd < 0 and region.broken is None:  # it could not be opened for want of a descriptor
                _open_again(region)
            if region.broken is not None:
                raise PermissionDenied(region.broken)
            if region.fd < 0:
                raise Unavailable(f"shared memory region '{name}' cannot be opened here now: {region.lacking}")
            region.refs += 1
            return region

    def release(self, region: Region) -> None:
        with self._lock:
            region.refs -= 1
            if region.doomed and region.refs == 0 and region.fd >= 0:
                os.close(region.fd)

    def read(self, region: Region, offset, size, limit: int) -> memoryview:
        """A copy of [offset, offset + size) of the region (size None: to its end), at most ``limit`` bytes."""
        offset = _count("shared_memory_offset", offset, 0)
        _inside(region, offset, 0)  # before a size is taken from what lies past the offset
        size = region.byte_size - offset if size is None else _count("shared_memory_byte_size", size)
        _inside(region, offset, size)
        if size > limit:
            raise InvalidArgument(f"{size} bytes from shared memory region '{region.name}' exceed the {limit}-byte "
                                  f"limit of one request (--http-max-body-bytes)")
        view, pos = memoryview(np.empty(size, np.uint8)), 0  # not zero-filled: preadv writes every byte
        while pos < size:
            n = os.preadv(region.fd, [view[pos:]], region.offset + offset + pos)
            if n == 0:
                raise InvalidArgument(_truncated(region, offset + pos))
            pos += n
        return view

    def check_output(self, region: Region, offset: int, size: int) -> None:
        """An output's place in ``region`` (size 0: to its end) lies inside it: checked before the model runs."""
        _inside(region, offset, size)

    def write(self, region: Region, offset, size, data: bytes) -> None:
        offset, size = _count("shared_memory_offset", offset, 0), _count("shared_memory_byte_size", size, 0)
        limit = size or region.byte_size - offset
        _inside(region, offset, len(data))
        if len(data) > limit:
            raise InvalidArgument(f"output of {len(data)} bytes does not fit the {limit} bytes given in "
                                  f"region '{region.name}'")
        start = region.offset + offset
        if os.fstat(region.fd).st_size < start + len(data):  # never grow a segment its owner shrank
            raise InvalidArgument(_truncated(region, offset))
        view, pos = memoryview(data).cast("B"), 0
        while pos < len(view):
            pos += os.pwritev(region.fd, [view[pos:]], start + pos)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        with self._lock:
            for region in self.regions.values():
                self._doom(region)
            self.regions.clear()


def _open(entry: str, key: str) -> int:
    """The segment ``entry`` opened without following links; Unavailable when this process lacks a
    descriptor or memory for it (the caller may try again), InvalidArgument or PermissionDenied else."""
    try:
        dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _open_error(key, exc) from None
    try:
        return os.open(entry, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in _LACKING and os.path.islink(os.path.join(SHM_DIR, entry)):
            raise PermissionDenied(f"shared memory key '{key}' is a symbolic link; register the segment "
                                   f"itself") from None
        raise _open_error(key, exc) from None
    finally:
        os.close(dir_fd)


_LACKING = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def _open_error(key: str, exc: OSError) -> GepoolError:
    if exc.errno in _LACKING:
        return Unavailable(f"Unable to open shared memory region: '{key}': {exc.strerror}; try again")
    return InvalidArgument(f"Unable to open shared memory region: '{key}': {exc.strerror}")


def _open_again(region: Region) -> None:
    """A region another sidecar registered, opened here, unless its key no longer names the file that
    sidecar checked (same device and inode, same owner): then ``broken`` says so for good. A want of
    descriptors or memory is not for good: ``lacking`` says it, and the next acquire tries again."""
    key, name = region.key, region.name
    try:
        fd = _open(_key_name(key), key)
    except Unavailable as exc:
        region.lacking = exc.message
        return
    except GepoolError as exc:
        region.broken = f"shared memory region '{name}' cannot be opened again: {exc.message}"
        return
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (region.dev, region.ino) or st.st_uid != region.uid:
        os.close(fd)
        region.broken = (f"shared memory region '{name}': key '{key}' no longer names the segment it was "
                         f"registered with; unregister it and register it again")
        return
    region.fd, region.lacking = fd, None


def _inside(region: Region, offset: int, size: int) -> None:
    if offset + size > region.byte_size:
        raise InvalidArgument(f"[{offset}, {offset + size}) lies outside shared memory region '{region.name}' "
                              f"of {region.byte_size} bytes")


def _truncated(region: Region, at: int) -> str:
    return (f"shared memory region '{region.name}' (key '{region.key}') ends before byte {at} of the region: "
            f"its segment was truncated after it was registered")
