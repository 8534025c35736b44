"""tritonserver's common flags on ``gepool start``, each through a real ``gepool start`` process."""

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests import repo as test_repo
from tests.conftest import free_port

START_TIMEOUT_S = 120


@pytest.fixture
def small_repo(tmp_path):
    """A model that serves and, with ``failing``, one whose initialize raises."""
    def make(failing: bool) -> str:
        repo = str(tmp_path / ("models-failing" if failing else "models"))
        test_repo.recorder(repo, "echo", delay_us=0)
        if failing:
            test_repo.write(f"{repo}/broken/1/model.py", test_repo.FAILING_INIT_PY)
            test_repo.write(f"{repo}/broken/config.pbtxt", """
                backend: "python"
                max_batch_size: 4
                input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
                output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
            """)
        return repo
    return make


class Started:
    """``gepool start ARGS`` until its ready line (or its exit); stopped with SIGTERM on leaving."""

    def __init__(self, tmp_path, *args: str) -> None:
        self.endpoint = f"ipc://{tmp_path}/flags.sock"
        self.proc = subprocess.Popen([sys.executable, "-m", "gepool.cli", "start", "--endpoint", self.endpoint,
                                      "--grpc-port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if line.startswith("gepool ready on"):
                break

    @property
    def ready(self) -> bool:
        return bool(self.lines) and self.lines[-1].startswith("gepool ready on")

    def stop(self) -> tuple[int, str]:
        """(exit code, stderr) after SIGTERM (or after its own exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err

    def __enter__(self) -> "Started":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def http_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=30).status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_exit_on_error_is_the_default_a_failed_model_stops_the_start(small_repo, tmp_path):
    http = free_port()
    with Started(tmp_path, "--model-repository", small_repo(True), "--http-port", str(http),
                 "--metrics-port", "0") as pool:
        code, err = pool.stop() if not pool.ready else (None, "")
    assert not pool.ready and code == 1, (pool.lines, err)
    assert "model broken: UNAVAILABLE - " in "\n".join(pool.lines)
    assert "gepool: error: model 'broken' failed to load: " in err and "weights are missing" in err
    assert "1 model(s) failed to load; stopped" in err
    assert " INFO " in err  # the default logs info messages (the workers starting)
    assert not listening(http)  # its HTTP sidecar is gone too


def test_exit_on_error_false_serves_the_others_and_strict_readiness_false_reports_ready(small_repo, tmp_path):
    """--model-store is --model-repository; --allow-metrics false serves no metrics; --log-verbose 1 logs debug."""
    http, metrics = free_port(), free_port()
    with Started(tmp_path, "--model-store", small_repo(True), "--exit-on-error", "false", "--http-port", str(http),
                 "--metrics-port", str(metrics), "--strict-readiness=false", "--allow-metrics", "false",
                 "--log-verbose", "1") as pool:
        assert pool.ready, pool.lines
        assert f"HTTP (KServe v2) on http://127.0.0.1:{http}" in pool.lines
        assert not any(line.startswith("metrics on") for line in pool.lines) and not listening(metrics)
        assert http_status(f"http://127.0.0.1:{http}/v2/models/broken/ready") == 400
        assert http_status(f"http://127.0.0.1:{http}/v2/health/ready") == 200  # strict: 400 (test_cli's start)
        out = subprocess.run([sys.executable, "-m", "gepool.cli", "bench", "nosuch", "--http", f"127.0.0.1:{http}",
                              "--concurrency", "1", "--duration", "0.2"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr  # the server's answer, one line
        (line,) = out.stderr.splitlines()
        assert line.startswith("gepool: error: ") and f"GET http://127.0.0.1:{http}/v2/models/nosuch: HTTP 400" in line
        assert "unknown model" in line, line
        code, err = pool.stop()
    assert code == 0, err
    assert " DEBUG serving " in err


def test_load_model_wildcard_loads_every_model_and_must_be_the_only_one(small_repo, tmp_path):
    """Triton's --load-model=* in explicit mode (its model_repository_manager.cc): every model, and alone."""
    repo = small_repo(True)
    out = subprocess.run([sys.executable, "-m", "gepool.cli", "start", "--model-repository", repo,
                          "--model-control-mode", "explicit", "--load-model", "*", "--load-model", "echo"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "Wildcard model name '*' must be the ONLY startup model if specified at all." in out.stderr
    with Started(tmp_path, "--model-repository", repo, "--model-control-mode", "explicit", "--load-model", "*",
                 "--exit-on-error", "false", "--metrics-port", "0") as pool:
        assert pool.ready, pool.lines
        assert "model echo: READY (version 1, 1 worker(s))" in pool.lines
        assert any(line.startswith("model broken: UNAVAILABLE - ") for line in pool.lines), pool.lines
        assert not any("'*'" in line for line in pool.lines), pool.lines
        code, err = pool.stop()
    assert code == 0, err
    with Started(tmp_path, "--model-repository", repo, "--model-control-mode", "explicit", "--load-model", "*",
                 "--metrics-port", "0") as pool:  # --exit-on-error true: the broken one was asked for
        code, err = pool.stop() if not pool.ready else (None, "")
    assert not pool.ready and code == 1, (pool.lines, err)
    assert "gepool: error: model 'broken' failed to load: " in err


def test_allow_http_false_and_log_info_false(small_repo, tmp_path):
    http = free_port()
    with Started(tmp_path, "--model-repository", small_repo(False), "--allow-http", "FALSE", "--http-port", str(http),
                 "--metrics-port", "0", "--log-info", "off") as pool:
        assert pool.ready, pool.lines
        assert "model echo: READY (version 1, 1 worker(s))" in pool.lines
        assert not any(line.startswith("HTTP") for line in pool.lines) and not listening(http)
        code, err = pool.stop()
    assert code == 0, err
    assert " INFO " not in err


def test_a_missing_repository_is_an_error_in_every_mode(tmp_path):
    for mode in ("none", "explicit", "poll"):
        out = subprocess.run([sys.executable, "-m", "gepool.cli", "start", "--model-repository",
                              str(tmp_path / "nosuch"), "--model-control-mode", mode], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.startswith("gepool: error: --model-repository"), out.stderr
        assert "is not a folder" in out.stderr and "Traceback" not in out.stderr


def test_the_log_flags_set_a_threshold_or_are_refused():
    import logging

    from gepool.cli import UsageError, build_parser, log_threshold

    def threshold(*flags: str) -> int:
        return log_threshold(build_parser().parse_args(["start", "--model-repository", ".", *flags]))

    assert threshold() == logging.INFO
    assert threshold("--log-verbose", "1") == threshold("--log-verbose=true") == logging.DEBUG
    assert threshold("--log-verbose", "0") == logging.INFO
    assert threshold("--log-info", "false") == logging.WARNING
    assert threshold("--log-info", "0", "--log-warning", "off") == logging.ERROR
    assert threshold("--log-info", "false", "--log-warning", "false", "--log-error", "false") == logging.CRITICAL
    assert threshold("--log-level", "warning") == logging.WARNING
    for refused in (["--log-warning", "false"], ["--log-verbose", "2", "--log-info", "false"],
                    ["--log-info", "false", "--log-error", "false"], ["--log-level", "INFO", "--log-verbose", "1"]):
        with pytest.raises(UsageError):
            threshold(*refused)
