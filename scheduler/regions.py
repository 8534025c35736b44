"""The pool's one record of system shared-memory regions, kept for its sidecars (each opens them itself).

Only a sidecar the pool started may change or read it: each query carries the token the pool gave
its sidecars in their environment. A sidecar checks the caller, opens and inspects the segment before
a region is recorded here; the other sidecars open it again on their own, and refuse it unless it is
still the same file (device and inode) owned by the same uid. Every change bumps a version number the
sidecars read from a shared page (``VERSION``), so a sidecar asks for the record again only when it
changed: what a client registered through one connection is there for its next request on any other.
"""

import hmac
import mmap
import struct

from gepool.common import errors

TOKEN_ENV = "GEPOOL_SIDECAR_TOKEN"  # the token, in a sidecar's environment (only its own user can read it)
MAX_REGIONS_PER_UID = 256  # each holds an open fd in every sidecar: no user may exhaust their descriptors
VERSION = struct.Struct("=Q")  # the record's version, at offset 0 of the shared page
_FIELDS = {"uid": int, "name": str, "key": str, "offset": int, "byte_size": int, "dev": int, "ino": int}


def version_page(fd: int, writable: bool) -> mmap.mmap:
    """The page at ``fd`` (a memfd) that holds the version: the front writes it, sidecars only read it."""
    if writable:
        return mmap.mmap(fd, mmap.PAGESIZE)
    return mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ)


class RegionBook:
    """Regions by (uid, name), each with the serial it was registered under."""

    def __init__(self, token: str | None, page_fd: int = -1) -> None:
        self.token = token
        self.regions: dict[tuple[int, str], dict] = {}
        self.version = 0
        self._serial = 0
        self._page = version_page(page_fd, writable=True) if page_fd >= 0 else None

    def answer(self, args: object) -> dict:
        """The 'regions' query: {op: register | unregister | list, token, ...}; the record as it is after it."""
        if not isinstance(args, dict) or self.token is None or not isinstance(args.get("token"), str) \
                or not hmac.compare_digest(args["token"], self.token):
            raise errors.PermissionDenied("shared memory regions are registered through the pool's own sidecars")
        op = args.get("op")
        if op == "register":
            region = {field: args.get(field) for field in _FIELDS}
            for field, kind in _FIELDS.items():
                if type(region[field]) is not kind:
                    raise errors.InvalidArgument(f"a region's {field} must be of type {kind.__name__}")
            self._register(region)
        elif op == "unregister":
            uid, name = args.get("uid"), args.get("name")
            if type(uid) is not int or name is not None and type(name) is not str:
                raise errors.InvalidArgument("unregister takes a uid and a name or null")
            self._unregister(uid, name)
        elif op != "list":
            raise errors.InvalidArgument(f"unknown regions operation {str(op)[:40]!r}")
        return {"version": self.version, "regions": list(self.regions.values())}

    def _register(self, region: dict) -> None:
        uid, name = region["uid"], region["name"]
        if (uid, name) in self.regions:
            raise errors.InvalidArgument(f"shared memory region '{name}' already in manager")
        if sum(owner == uid for owner, _ in self.regions) >= MAX_REGIONS_PER_UID:
            raise errors.InvalidArgument(f"uid {uid} already has {MAX_REGIONS_PER_UID} shared memory regions "
                                         f"registered; unregister some first")
        self._serial += 1
        region["serial"] = self._serial
        self.regions[(uid, name)] = region
        self._changed()

    def _unregister(self, uid: int, name: str | None) -> None:
        mine = [k for k in self.regions if k[0] == uid and (name is None or k[1] == name)]
        for k in mine:
            del self.regions[k]
        if mine:
            self._changed()

    def _changed(self) -> None:
        self.version += 1
        if self._page is not None:
            VERSION.pack_into(self._page, 0, self.version)

    def close(self) -> None:
        if self._page is not None:
            self._page.close()
            self._page = None
