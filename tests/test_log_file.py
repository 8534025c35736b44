"""Triton's --log-file (PoolOptions.log_file): every process's log appended to one file, the console spared."""

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from gepool import Pool
from gepool.common import errors
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

REDIRECT = textwrap.dedent("""
    import subprocess, sys
    from gepool.common.logsettings import log_to_file
    print("before", file=sys.stderr, end="")
    log_to_file(sys.argv[1])
    log_to_file(sys.argv[1])  # a second call for the same file (serve() after gepool start) changes nothing
    print("parent line", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "import sys; print('child line', file=sys.stderr)"], check=True)
""")


def _redirect(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", REDIRECT, path], capture_output=True, text=True, timeout=60)


def test_standard_error_goes_to_the_end_of_the_file_in_this_process_and_its_children(tmp_path):
    path = tmp_path / "triton.log"
    path.write_text("an earlier run's line\n")
    path.chmod(0o644)
    out = _redirect(str(path))
    assert out.returncode == 0, out.stderr
    assert out.stderr == "before"  # only what was written before the redirect reached the console
    assert path.read_text() == "an earlier run's line\nparent line\nchild line\n"  # appended, as Triton's (ios::app)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # an existing file keeps its mode


def test_a_new_log_file_is_readable_by_its_user_only(tmp_path):
    path = tmp_path / "new.log"
    out = _redirect(str(path))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # other local users do not read what clients sent
    assert path.read_text() == "parent line\nchild line\n"


@pytest.mark.parametrize("make, words", [
    (lambda path: os.mkfifo(path), "it is a fifo or socket that no process reads"),  # refused, not waited on
    (lambda path: os.symlink(path + ".target", path), "it is a symbolic link"),  # another user's could aim at ours
])
def test_a_log_file_that_is_not_ours_to_append_to_is_refused(tmp_path, make, words):
    path = str(tmp_path / "triton.log")
    make(path)
    out = _redirect(path)  # in a child: a redirect that went through would take this test run's stderr
    assert out.returncode == 1 and words in out.stderr, out.stderr
    assert not os.path.exists(path + ".target")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user owns needs root")
def test_a_log_file_another_user_owns_is_refused(tmp_path):
    path = tmp_path / "triton.log"
    path.write_text("")
    os.chown(path, 65534, 65534)  # as if another user had made it first, in a folder both may write
    out = _redirect(str(path))
    assert out.returncode == 1 and "it belongs to uid 65534, not to this user" in out.stderr, out.stderr
    assert path.read_text() == ""


def test_a_library_pool_logs_every_process_to_the_file_and_nothing_to_its_owner(tmp_path, capfd):
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    path = tmp_path / "pool.log"
    port = free_port()
    with Pool(repo, http_port=port, log_level=logging.DEBUG, log_file=str(path)) as pool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/logging", timeout=30) as answer:
            assert json.loads(answer.read())["log_file"] == str(path)
        assert pool.status["models"]["tiny"]["state"] == "READY"

        def every_process_logged() -> bool:
            log = path.read_text()
            return " front " in log and "http DEBUG HTTP request: GET /v2/logging" in log
        assert wait_until(every_process_logged, 60), path.read_text()[-2000:]
    assert capfd.readouterr().err == ""  # the owner's console kept clean


def test_a_library_pool_whose_log_file_cannot_be_written_does_not_start(tmp_path, capfd):
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    pool = Pool(repo, log_file="/nonexistent/pool.log")
    try:
        with pytest.raises(errors.Unavailable, match="log_file '/nonexistent/pool.log' cannot be written: No such"):
            pool.start()
    finally:
        pool.stop()
    assert "Traceback" not in capfd.readouterr().err  # a refusal, said once, by the exception


def test_why_gepool_start_ends_reaches_the_console_as_well_as_the_log_file(tmp_path):
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        out = subprocess.run([sys.executable, "-m", "gepool.cli", "start", "--model-repository", repo, "--endpoint",
                              f"ipc://{tmp_path}/gw.sock", "--http-port", str(taken.getsockname()[1]),
                              "--grpc-port", "0", "--metrics-port", "0", "--log-file", str(tmp_path / "t.log")],
                             capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert out.returncode == 1, out
    (line,) = out.stderr.splitlines()  # the console hears why, once
    assert line.startswith("gepool: error: ") and "--http-port" in line, line
    assert line in (tmp_path / "t.log").read_text()  # and the log has it too
