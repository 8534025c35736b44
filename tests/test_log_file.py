"""Triton's --log-file (PoolOptions.log_file): every process's log appended to one file, the console spared."""

import errno
import logging
import os
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


def test_a_fifo_no_one_reads_is_refused_at_once_not_waited_on(tmp_path):
    from gepool.common.logsettings import log_to_file

    fifo = str(tmp_path / "log.fifo")
    os.mkfifo(fifo)
    with pytest.raises(OSError) as raised:
        log_to_file(fifo)
    assert raised.value.errno == errno.ENXIO


def test_a_library_pool_logs_every_process_to_the_file_and_nothing_to_its_owner(tmp_path, capfd):
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    path = tmp_path / "pool.log"
    port = free_port()
    with Pool(repo, http_port=port, log_level=logging.DEBUG, log_file=str(path)) as pool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/logging", timeout=30) as answer:
            assert b'"log_file":"' + str(path).encode() + b'"' in answer.read().replace(b" ", b"")
        assert pool.status["models"]["tiny"]["state"] == "READY"

        def every_process_logged() -> bool:
            log = path.read_text()
            return " front " in log and "http DEBUG HTTP request: GET /v2/logging" in log
        assert wait_until(every_process_logged, 60), path.read_text()[-2000:]
    assert " front " not in capfd.readouterr().err  # the owner's console kept clean


def test_a_library_pool_whose_log_file_cannot_be_written_does_not_start(tmp_path):
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    with pytest.raises(errors.Unavailable, match="log_file '/nonexistent/pool.log' cannot be written: No such file"):
        Pool(repo, log_file="/nonexistent/pool.log").start()
