"""The runtime folder is the user's own, and what a killed front leaves there is cleaned up."""

import os
import socket

import pytest

from gepool.ipc import naming
from gepool.ipc.sockets import runtime_dir


@pytest.fixture
def fallback(monkeypatch, tmp_path):
    """runtime_dir() without XDG_RUNTIME_DIR, its /tmp/gepool-<uid> stand-in moved under tmp_path."""
    from gepool.ipc import sockets

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(sockets, "FALLBACK_BASE", str(tmp_path / "gepool-{uid}"))
    return str(tmp_path / f"gepool-{os.getuid()}")


def test_a_runtime_folder_someone_else_made_is_refused_clearly(fallback, monkeypatch):
    os.mkdir(fallback, 0o755)  # made in advance by another user: seen from a uid that is not its owner
    owner = os.stat(fallback).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    # Only the folder's own name changes: its parent (pytest-0 on a fresh machine) may hold "-0" too.
    os.rename(fallback, os.path.join(os.path.dirname(fallback), f"gepool-{owner + 1}"))
    with pytest.raises(PermissionError, match=f"belongs to uid {owner}, not to this user .uid {owner + 1}."):
        runtime_dir()
    monkeypatch.undo()


def test_a_link_for_the_runtime_folder_is_refused(fallback, tmp_path):
    os.mkdir(tmp_path / "elsewhere", 0o700)
    os.symlink(tmp_path / "elsewhere", fallback)
    with pytest.raises(PermissionError, match="is not a folder"):
        runtime_dir()


def test_the_runtime_folder_and_its_parent_are_made_owner_only(fallback):
    folder = runtime_dir()
    assert folder == os.path.join(fallback, "gepool")
    for path in (fallback, folder):
        st = os.lstat(path)
        assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700, (path, oct(st.st_mode))


def test_cleanup_removes_socket_files_nobody_listens_on(tmp_path):
    folder = str(tmp_path)
    dead = []
    for name, kind in (("gepool.sock", socket.SOCK_STREAM), ("gepool.sock.lane", socket.SOCK_SEQPACKET)):
        s = socket.socket(socket.AF_UNIX, kind)
        s.bind(os.path.join(folder, name))
        s.listen(1)
        s.close()  # the file stays, as after a killed front
        dead.append(name)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(os.path.join(folder, "other.sock"))
    live.listen(1)
    (tmp_path / "notes.txt").write_text("not a socket")
    try:
        assert sorted(naming.cleanup_runtime(folder, dry_run=True)) == dead
        assert sorted(os.listdir(folder)) == sorted([*dead, "other.sock", "notes.txt"])
        assert sorted(naming.cleanup_runtime(folder)) == dead
        assert sorted(os.listdir(folder)) == ["notes.txt", "other.sock"]
    finally:
        live.close()


def test_the_cli_says_why_a_runtime_folder_is_refused_in_one_line(fallback, tmp_path, capsys):
    from gepool.cli import main

    os.mkdir(tmp_path / "elsewhere", 0o700)
    os.symlink(tmp_path / "elsewhere", fallback)
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gepool: error: ") and "is not a folder" in err and err.count("\n") == 1, err
