"""Shared fixtures: generated model repositories, one session pool, and leak checks on every test."""

import gc
import os
import random
import socket
import time
from collections.abc import Callable

import pytest

from gepool.ipc import naming
from tests import repo as test_repo

LEAK_GRACE_S = 30.0  # a process exit, then the unlink, on a loaded machine


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sidecar_pids(pool) -> list[int]:
    """The pids of a pool's sidecar processes."""
    return sorted(pid for pid in _descendants(pool.process.pid)
                  if b"_gateway_main" in open(f"/proc/{pid}/cmdline", "rb").read())


def sidecar_pid(pool) -> int:
    """The pid of a pool's HTTP sidecar process."""
    pids = sidecar_pids(pool)
    assert len(pids) == 1, pids
    return pids[0]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.fixture(scope="module")
def raw(pool):
    """A bare DEALER on the session pool's endpoint, for messages no client would send."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pool.endpoint)
    yield sock
    sock.close()
    ctx.term()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a whole process (every thread), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


SIDECAR_SERVERS = ("aiohttp", "granian", "httptools")  # every sidecar test module runs on each HTTP server


def pytest_collection_modifyitems(config, items):
    """A test marked ``aiohttp_only`` runs on the aiohttp sidecar alone: it exercises a handler, which is the
    same code behind the other servers' adapters, not the server; the adapters' paths are what the rest run on
    every server."""
    others = set(SIDECAR_SERVERS) - {"aiohttp"}
    items[:] = [item for item in items if not (item.get_closest_marker("aiohttp_only") and others & set(
        getattr(getattr(item, "callspec", None), "params", {}).values()))]


def free_port() -> int:
    """A loopback port nobody listens on right now, for a server another process binds later. It lies
    below the kernel's ephemeral range, so no connection's local port (nor another bind to port 0) takes
    it meanwhile, and it is never handed out twice in a session; a race with a process that binds that
    very port on its own is accepted."""
    high = _ephemeral_low()
    low = max(1024, high - 16384)
    while True:
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def sidecar_refuses(flag: str, groups: str) -> str:
    """What a sidecar started with ``flag=GROUP`` for each of ``groups`` (split on " FLAG=") says on stderr as
    it refuses them: it must exit 2, its usage error, before serving anything."""
    import subprocess
    import sys

    args = [f"{flag}={g}" for g in groups.split(f" {flag}=")]
    proc = subprocess.run([sys.executable, "-m", "gepool.http.server", "--endpoint", "ipc:///nowhere",
                           "--http-port", "0", "--metrics-port", "0", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    return proc.stderr


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Polls with a generous deadline; returns the predicate's last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="session")
def gate_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gate") / "gate")


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory, gate_file):
    return test_repo.make_test_repo(str(tmp_path_factory.mktemp("models")), gate_file)


@pytest.fixture(scope="session")
def pool(model_repo):
    from gepool import Pool

    with Pool(model_repo) as p:
        yield p


@pytest.fixture(scope="session")
def client(pool):
    return pool.client()


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _ours(entry: str, before: set[str]) -> bool:
    """A segment this test session is responsible for: made by us or a live descendant, or new since
    ``before`` and made by a process now gone. (A pool someone else runs on this host is not ours.)"""
    pid = naming.owner_pid(entry)
    if pid is None:
        return False
    if not naming.pid_alive(pid):
        return entry not in before
    while pid not in (None, 0, 1):
        if pid == os.getpid():
            return True
        pid = _ppid(pid)
    return False


def _leaked(before: set[str]) -> list[str]:
    return [e for e in naming.list_segments() if _ours(e, before)]


def _children_left() -> list[int]:
    """Our descendants, less multiprocessing's resource tracker: tritonclient's shared-memory helpers
    (multiprocessing.shared_memory) start it in this process, and it lives until this interpreter exits."""
    def tracker(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"multiprocessing.resource_tracker" in f.read()
        except OSError:
            return False

    return [pid for pid in _descendants(os.getpid()) if not tracker(pid)]


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_exit():
    """The whole session: no segment and no child process may outlive the tests."""
    before = set(naming.list_segments())
    yield
    assert wait_until(lambda: not _children_left(), LEAK_GRACE_S), f"child processes left: {_children_left()}"
    assert wait_until(lambda: not _leaked(before), LEAK_GRACE_S), f"gepool segments left: {_leaked(before)}"


@pytest.fixture(autouse=True)
def no_segment_left():
    """Every test: live pools unlink their segments once mapped, so none of ours may be visible after it."""
    before = set(naming.list_segments())
    yield
    assert wait_until(lambda: not _leaked(before), LEAK_GRACE_S), f"gepool segments left: {_leaked(before)}"


@pytest.fixture
def front(tmp_path):
    """In-process front cores (tests/test_core.py's Harness) over tmp_path's repository, made by calling
    the fixture once the models are written; each is closed after the test."""
    from tests.test_core import Harness  # that module imports this one

    made = []

    def make() -> Harness:
        made.append(Harness(tmp_path))
        return made[-1]

    yield make
    for h in made:
        h.close()


def cyclic_garbage(run: Callable[[], object]) -> list:
    """The objects in reference cycles after ``run()`` ran with the collector off (the sidecar's collector runs
    seldom, so whatever a cycle holds stays until it does): a test looks among them for what must not be there."""
    gc.collect()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
