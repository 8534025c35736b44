"""Names of shared-memory segments, and clean-up of those whose owner process is gone.

Every segment gepool creates is named ``gepool.<owner pid>x<random>.<tag>``: the pid of the
process that created it comes first, so ``gepool cleanup`` can tell a live pool's segments
from a dead one's without any registry.
"""

import os
import secrets

PREFIX = "gepool."
SHM_DIR = "/dev/shm"


def new_owner_id() -> str:
    """An id unique on this host for segments this process creates."""
    return f"{os.getpid()}x{secrets.token_hex(4)}"


def segment_name(owner_id: str, tag: str) -> str:
    """The posix_ipc name (leading slash) of one segment."""
    return f"/{PREFIX}{owner_id}.{tag}"


def owner_pid(entry: str) -> int | None:
    """The creating pid encoded in a /dev/shm entry name, or None if it is not gepool's."""
    if not entry.startswith(PREFIX):
        return None
    head = entry[len(PREFIX):].split(".", 1)[0]
    pid, _, _ = head.partition("x")
    return int(pid) if pid.isdigit() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_segments() -> list[str]:
    """Every gepool entry in /dev/shm (names without the leading slash)."""
    try:
        return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(PREFIX))
    except FileNotFoundError:
        return []


def _unlink_dead(folder: str, owners: dict[str, int | None], dry_run: bool) -> list[str]:
    """Unlinks the entries whose owner pid is known and gone; returns their names."""
    removed = []
    for entry, pid in owners.items():
        if pid is None or pid_alive(pid):
            continue
        if not dry_run:
            try:
                os.unlink(os.path.join(folder, entry))
            except FileNotFoundError:
                continue
        removed.append(entry)
    return removed


def cleanup_dead(dry_run: bool = False) -> list[str]:
    """Unlinks segments whose creating process no longer exists; returns their names."""
    return _unlink_dead(SHM_DIR, {e: owner_pid(e) for e in list_segments()}, dry_run)


def cleanup_runtime(folder: str, dry_run: bool = False) -> list[str]:
    """Unlinks what dead pools left in the runtime folder: worker sockets and doorbell FIFOs
    (``gepool-<pid>x<random>...``) and Pool endpoints (``pool-<pid>x<random>.sock``)."""
    try:
        entries = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    owners = {}
    for entry in entries:
        head = next((h for h in ("gepool-", "pool-") if entry.startswith(h)), None)
        if head is not None:
            owners[entry] = owner_pid(PREFIX + entry[len(head):])
    return _unlink_dead(folder, owners, dry_run)


def remove_runtime_of(folder: str, pid: int) -> list[str]:
    """Unlinks what the dead process ``pid`` left in the runtime folder (a pool's front killed before it
    could clean up: its worker socket and doorbells); returns their names."""
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return []
    return _unlink_dead(folder, {e: pid for e in sorted(entries) if e.startswith(f"gepool-{pid}x")}, False)
