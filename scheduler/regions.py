"""The pool's one record of system shared-memory regions, kept for its sidecars (each opens them itself).

Only a sidecar the pool started may change or read it: each query carries the token the pool gave
its sidecars in their environment. A sidecar checks the caller, opens and inspects the segment before
a region is recorded here; the other sidecars open it again on their own, and refuse it unless it is
still the same file (device and inode) owned by the same uid. Every change bumps a version number the
sidecars read from a shared page (``VERSION``), so a sidecar asks for the record again only when it
changed: what a client registered through one connection is there for its next request on any other.
The same page carries the largest slot of any model the front holds (``LARGEST_SLOT``), which a sidecar's
default body limit follows as models are loaded and unloaded. A register or unregister is answered with the
change alone (a sidecar whose record was current applies it; any other asks for the whole record), so no user's
churn costs the front the record of all.
"""

import fcntl
import hmac
import mmap
import os
import struct

from gepool.common import errors

TOKEN_ENV = "GEPOOL_SIDECAR_TOKEN"  # the token, in a sidecar's environment (only its own user can read it)
MAX_REGIONS_PER_UID = 256  # each holds an open fd in every sidecar: no user may exhaust their descriptors
MAX_REGION_TEXT = 256  # characters of a region's name or key (a key names one file: NAME_MAX is 255)
VERSION = struct.Struct("=Q")  # the record's version, at offset 0 of the shared page
LARGEST_SLOT = struct.Struct("=Q")  # the largest slot of any model the front holds, at LARGEST_SLOT_OFFSET
LARGEST_SLOT_OFFSET = 8
_FIELDS = {"uid": int, "name": str, "key": str, "offset": int, "byte_size": int, "dev": int, "ino": int}


def version_page_fd() -> tuple[int, int]:
    """A sealed one-page memfd for the version, as (the front's read-write fd, a read-only fd for the
    sidecars): it can be neither shrunk nor grown, so no sidecar can make the front's mapping fault."""
    fd = os.memfd_create("gepool-regions", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        os.close(fd)
        raise


def version_page(fd: int, writable: bool) -> mmap.mmap:
    """The page at ``fd`` that holds the version: the front writes it, sidecars only read it."""
    if writable:
        return mmap.mmap(fd, mmap.PAGESIZE)
    return mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ)


def check_text(what: str, value: str) -> None:
    """A region's name or key is at most MAX_REGION_TEXT characters (InvalidArgument naming it)."""
    if len(value) > MAX_REGION_TEXT:
        raise errors.InvalidArgument(f"shared memory {what} of {len(value)} characters is longer than "
                                     f"{MAX_REGION_TEXT}")


class RegionBook:
    """Regions by (uid, name), each with the serial it was registered under."""

    def __init__(self, token: str | None, page_fd: int = -1) -> None:
        self.token = token
        self.regions: dict[tuple[int, str], dict] = {}
        self.version = 0
        self._serial = 0
        self._page = version_page(page_fd, writable=True) if page_fd >= 0 else None

    def answer(self, args: object) -> dict:
        """The 'regions' query: {op: register | unregister | list, token, ...}. A list is answered with the
        whole record, a change with the version it made and what changed (``region``, ``removed``)."""
        token = args.get("token") if isinstance(args, dict) else None
        if self.token is None or not isinstance(token, str) or not token.isascii() \
                or not hmac.compare_digest(token, self.token):
            raise errors.PermissionDenied("shared memory regions are registered through the pool's own sidecars")
        op = args.get("op")
        if op == "register":
            region = {field: args.get(field) for field in _FIELDS}
            for field, kind in _FIELDS.items():
                if type(region[field]) is not kind:
                    raise errors.InvalidArgument(f"a region's {field} must be of type {kind.__name__}")
            check_text("region name", region["name"])
            check_text("key", region["key"])
            return {"version": self._register(region), "region": region}
        if op == "unregister":
            uid, name = args.get("uid"), args.get("name")
            if type(uid) is not int or name is not None and type(name) is not str:
                raise errors.InvalidArgument("unregister takes a uid and a name or null")
            removed = self._unregister(uid, name)
            return {"version": self.version, "removed": removed}
        if op == "list":
            return {"version": self.version, "regions": list(self.regions.values())}
        raise errors.InvalidArgument(f"unknown regions operation {str(op)[:40]!r} (register, unregister, list)")

    def _register(self, region: dict) -> int:
        uid, name = region["uid"], region["name"]
        if (uid, name) in self.regions:
            raise errors.AlreadyExists(f"shared memory region '{name}' already in manager")
        if sum(owner == uid for owner, _ in self.regions) >= MAX_REGIONS_PER_UID:
            raise errors.InvalidArgument(f"uid {uid} already has {MAX_REGIONS_PER_UID} shared memory regions "
                                         f"registered; unregister some first")
        self._serial += 1
        region["serial"] = self._serial
        self.regions[(uid, name)] = region
        self._changed()
        return self.version

    def _unregister(self, uid: int, name: str | None) -> list[list]:
        mine = [k for k in self.regions if k[0] == uid and (name is None or k[1] == name)]
        for k in mine:
            del self.regions[k]
        if mine:
            self._changed()
        return [list(k) for k in mine]

    def publish_largest_slot(self, nbytes: int) -> None:
        """Tells the sidecars the largest slot of any model held now (their default body limit follows it)."""
        if self._page is not None:
            LARGEST_SLOT.pack_into(self._page, LARGEST_SLOT_OFFSET, nbytes)

    def _changed(self) -> None:
        self.version += 1
        if self._page is not None:
            VERSION.pack_into(self._page, 0, self.version)

    def close(self) -> None:
        if self._page is not None:
            self._page.close()
            self._page = None
