"""Shared fixtures: generated model repositories, one session pool, and leak checks on every test."""

import os
import socket
import time

import pytest

from gepool.ipc import naming
from tests import repo as test_repo

LEAK_GRACE_S = 10.0


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


def free_port() -> int:
    """A loopback port nobody listens on right now (a small race with other processes is accepted)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_exit():
    """The whole session: no segment and no child process may outlive the tests."""
    before = set(naming.list_segments())
    yield
    assert wait_until(lambda: not _descendants(os.getpid()), LEAK_GRACE_S), \
        f"child processes left: {_descendants(os.getpid())}"
    left = wait_until(lambda: not (set(naming.list_segments()) - before), LEAK_GRACE_S)
    assert left, f"gepool segments left in /dev/shm: {set(naming.list_segments()) - before}"


@pytest.fixture(autouse=True)
def no_segment_left():
    """Every test: live pools unlink their segments once mapped, so none may be visible after it."""
    yield
    ok = wait_until(lambda: not naming.list_segments(), LEAK_GRACE_S)
    assert ok, f"gepool segments left in /dev/shm: {naming.list_segments()}"
