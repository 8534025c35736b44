"""Names of shared-memory segments, and clean-up of those whose owner process is gone.

Every segment gepool creates is named ``gepool.<owner pid>x<random>.<tag>``: the pid of the
process that created it comes first, so ``gepool cleanup`` can tell a live pool's segments
from a dead one's without any registry.
"""

import os
import secrets
import socket
import stat

PREFIX = "gepool."
SHM_DIR = "/dev/shm"
PROBE_TIMEOUT_S = 1.0


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
    (``gepool-<pid>x<random>...``), Pool endpoints (``pool-<pid>x<random>.sock``), and any other socket
    file nobody listens on (the default endpoint ``gepool.sock`` and its ``.lane`` of a killed front)."""
    try:
        entries = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    owners = {}
    for entry in entries:
        head = next((h for h in ("gepool-", "pool-") if entry.startswith(h)), None)
        if head is not None:
            owners[entry] = owner_pid(PREFIX + entry[len(head):])
    removed = _unlink_dead(folder, owners, dry_run)
    for entry in entries:
        if entry in owners and owners[entry] is not None:
            continue
        path = os.path.join(folder, entry)
        if _stale_socket(path):
            if not dry_run:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
            removed.append(entry)
    return removed


def _stale_socket(path: str) -> bool:
    """A Unix socket file that refuses connections: whoever listened on it is gone."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    kind = socket.SOCK_SEQPACKET if path.endswith(".lane") else socket.SOCK_STREAM
    with socket.socket(socket.AF_UNIX, kind) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)  # a live listener with a full backlog would block the connect
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:  # gone meanwhile, or of another kind: not ours to judge
            return False
    return False


def remove_runtime_of(folder: str, pid: int) -> list[str]:
    """Unlinks what the dead process ``pid`` left in the runtime folder (a pool's front killed before it
    could clean up: its worker socket and doorbells); returns their names."""
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return []
    return _unlink_dead(folder, {e: pid for e in sorted(entries) if e.startswith(f"gepool-{pid}x")}, False)
