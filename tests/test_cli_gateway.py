"""``gepool start``'s gateway flags and Triton's logging extension, each through a real ``gepool start``."""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from gepool import Client
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

httpclient = pytest.importorskip("tritonclient.http")
START_TIMEOUT_S = 120

CHATTY_PY = '''
import logging

import numpy as np

log = logging.getLogger("chatty")


class Model:
    def initialize(self, config):
        log.info("CHATTY-INIT %s", config["name"])

    def execute(self, inputs):
        x = inputs["X"]
        log.debug("CHATTY-EXEC %s", float(x[0, 0]))
        return {"Y": x.copy()}
'''


def chatty(repo: str, name: str) -> None:
    """A python model that logs at INFO when it loads and at DEBUG for each batch."""
    test_repo.write(f"{repo}/{name}/1/model.py", CHATTY_PY)
    test_repo.write(f"{repo}/{name}/config.pbtxt", """
        backend: "python"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    """)


class Started:
    """``gepool start ARGS`` with an HTTP port, until its ready line; its stderr goes to a file (the log of
    every process of the pool), so that a verbose pool cannot fill a pipe. SIGTERM on leaving."""

    def __init__(self, tmp_path, *args: str) -> None:
        self.http = free_port()
        self.log_path = str(tmp_path / "stderr.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "gepool.cli", "start", "--endpoint",
                                      f"ipc://{tmp_path}/gw.sock", "--http-port", str(self.http), "--metrics-port",
                                      "0", "--grpc-port", "0", "--sidecars", "1", *args],  # one, on any host
                                     stdout=subprocess.PIPE, stderr=self._log,
                                     text=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if line.startswith("gepool ready on"):
                break
        assert self.lines and self.lines[-1].startswith("gepool ready on"), (self.lines, self.log())
        self.triton = httpclient.InferenceServerClient(f"127.0.0.1:{self.http}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        self.triton.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Started":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else {}
    finally:
        conn.close()


def test_restricted_api_body_limit_and_disabled_auto_complete_flags(tmp_path):
    """--http-restricted-api (repeatable) guards the APIs it names with a header; --http-max-input-size
    (the alias of --http-max-body-bytes) bounds a body; --disable-auto-complete-config leaves a model
    without config.pbtxt unservable, naming why, while a complete one serves."""
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    os.makedirs(f"{repo}/bare/1")
    shutil.copy(f"{repo}/tiny/1/model.onnx", f"{repo}/bare/1/model.onnx")  # no config.pbtxt
    with Started(tmp_path, "--model-repository", repo, "--exit-on-error", "false", "--disable-auto-complete-config",
                 "--http-restricted-api", "model-config,metadata:X-Config-Key=open sesame",
                 "--http-restricted-api=model-repository:X-Admin=yes", "--http-max-input-size", "4096") as pool:
        assert "model tiny: READY (version 1, 1 worker(s))" in pool.lines
        (bare,) = [line for line in pool.lines if line.startswith("model bare: ")]
        assert bare.startswith("model bare: UNAVAILABLE - ") and "auto-complete is disabled" in bare, bare
        port = pool.http
        for path in ("/v2/models/tiny/config", "/v2/models/tiny", "/v2"):
            status, reply = request(port, "GET", path)
            assert status == 403 and reply["error"] == "This API is restricted, expecting header 'X-Config-Key'"
            assert request(port, "GET", path, headers={"X-Config-Key": "wrong"})[0] == 403
            assert request(port, "GET", path, headers={"X-Config-Key": "open sesame"})[0] == 200
        status, reply = request(port, "POST", "/v2/repository/index")
        assert status == 403 and "X-Admin" in reply["error"]
        assert request(port, "POST", "/v2/repository/index", headers={"X-Admin": "yes"})[0] == 200
        assert pool.triton.is_server_live() and pool.triton.is_model_ready("tiny")  # health is not restricted
        x = np.ones((4, 16), np.float32)  # 256 bytes of data: a body well under 4096
        inp = httpclient.InferInput("INPUT0", [4, 16], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(pool.triton.infer("tiny", [inp]).as_numpy("OUTPUT0"), 2 * x + 1)
        big = json.dumps({"inputs": [{"name": "INPUT0", "shape": [8, 16], "datatype": "FP32",
                                      "data": [1.0] * 128}]}).encode() + b" " * 4096
        status, reply = request(port, "POST", "/v2/models/tiny/infer", big)
        assert status == 413 and "over the 4096-byte limit" in reply["error"], reply
        # clients that hang up mid-body (chunked, or short of their Content-Length) cost no log line: the
        # sidecar logged an "internal error" and a traceback for each
        for head in (b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"inp", b"Content-Length: 500\r\n\r\n{\"inp"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\n" + head)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):  # until the sidecar closes its end
                    pass
        np.testing.assert_array_equal(pool.triton.infer("tiny", [inp]).as_numpy("OUTPUT0"), 2 * x + 1)
        assert "internal error" not in pool.log() and "Traceback" not in pool.log(), pool.log()
        assert pool.stop() == 0


@pytest.mark.parametrize("flags, words", [
    (["--http-restricted-api", "inference"], "option format is '<config name>:<setting>=<value>'"),
    (["--http-restricted-api", "nosuch:K=V"], "unknown restricted api 'nosuch'"),
    (["--http-max-body-bytes", "0"], "--http-max-body-bytes/--http-max-input-size: takes a number of bytes >= 1"),
    (["--http-max-input-size", "lots"], "--http-max-body-bytes/--http-max-input-size: takes a number of bytes"),
])
def test_bad_gateway_flags_are_one_line_and_exit_2(tmp_path, flags, words):
    out = subprocess.run([sys.executable, "-m", "gepool.cli", "start", "--model-repository", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("gepool: error: ") and words in line, line


def sidecars(pid: int) -> list[int]:
    from tests.conftest import _descendants

    def cmdline(p: int) -> bytes:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""

    return [p for p in _descendants(pid) if b"_gateway_main" in cmdline(p)]


ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ worker\d+ DEBUG CHATTY-EXEC", re.M)


def test_log_settings_change_the_logging_of_the_front_its_workers_and_the_sidecar(tmp_path):
    from tritonclient.utils import InferenceServerException

    repo = str(tmp_path / "models")
    chatty(repo, "first")
    chatty(repo, "second")
    with Started(tmp_path, "--model-repository", repo, "--log-info", "false", "--model-control-mode", "explicit",
                 "--load-model", "first") as pool:
        triton = pool.triton

        def infer(model: str, value: float) -> None:
            inp = httpclient.InferInput("X", [1, 1], "FP32")
            inp.set_data_from_numpy(np.full((1, 1), value, np.float32))
            assert triton.infer(model, [inp]).as_numpy("Y")[0, 0] == value

        quiet = {"log_file": "", "log_info": False, "log_warning": True, "log_error": True, "log_verbose_level": 0,
                 "log_format": "default"}
        assert triton.get_log_settings() == quiet
        infer("first", 1.0)
        assert "CHATTY" not in pool.log() and " INFO " not in pool.log() and " DEBUG " not in pool.log()

        verbose = dict(quiet, log_info=True, log_verbose_level=1)
        assert triton.update_log_settings({"log_verbose_level": 1, "log_info": True}) == verbose
        assert triton.get_log_settings() == verbose
        # the worker that was already running logs its model's debug messages (it reads the change
        # between batches, so a batch racing the change may still be quiet)
        assert wait_until(lambda: infer("first", 2.0) or "CHATTY-EXEC 2.0" in pool.log(), 60), pool.log()
        triton.load_model("second")  # the front logs at INFO, a worker started now logs too, and the sidecar
        infer("second", 3.0)
        log = pool.log()
        assert re.search(r" gepool\.front INFO worker \d+ \(second v1\) ready", log), log
        assert re.search(r" worker\d+ INFO CHATTY-INIT second", log), log
        assert wait_until(lambda: "CHATTY-EXEC 3.0" in pool.log(), 30), pool.log()
        assert " http DEBUG HTTP request: POST /v2/repository/models/second/load" in log, log

        assert triton.update_log_settings({"log_format": "ISO8601"})["log_format"] == "ISO8601"
        assert wait_until(lambda: infer("first", 4.0) or ISO_LINE.search(pool.log()), 60), pool.log()[-2000:]

        # a sidecar that dies is restarted with the options it was started with: it adopts the front's settings
        sidecar_restarted_and_logging(pool, pool.log)

        for refused, words in (({"log_warning": False}, "log_warning false with log_info on"),
                               ({"log_file": "/tmp/elsewhere.log"}, "log file location can not be updated"),
                               ({"log_info": "yes"}, "'log_info' must be true or false"),
                               ({"log_verbosity": 1}, "unknown log setting 'log_verbosity'")):
            with pytest.raises(InferenceServerException) as info:
                triton.update_log_settings(refused)
            assert info.value.status() == "400" and words in info.value.message(), info.value.message()
        assert triton.get_log_settings() == dict(verbose, log_format="ISO8601")  # the refusals changed nothing
        assert pool.stop() == 0


def test_tritonserver_flags_for_log_format_server_id_and_strict_model_config(tmp_path):
    """--log-format ISO8601 from the start (front, workers and sidecar), --id as the server's name over HTTP
    and gRPC, and the deprecated --strict-model-config with tritonserver's warnings."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    repo = str(tmp_path / "models")
    chatty(repo, "first")
    grpc_port = free_port()
    with Started(tmp_path, "--model-repository", repo, "--log-format", "ISO8601", "--log-verbose", "1",
                 "--id=-my-triton", "--strict-model-config", "false", "--grpc-port", str(grpc_port)) as pool:
        triton = pool.triton
        assert triton.get_log_settings()["log_format"] == "ISO8601"
        assert triton.get_server_metadata()["name"] == "-my-triton"  # (a name may start with '-', as Triton's)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            assert client.get_server_metadata().name == "-my-triton"
        inp = httpclient.InferInput("X", [1, 1], "FP32")
        inp.set_data_from_numpy(np.full((1, 1), 5.0, np.float32))
        assert triton.infer("first", [inp]).as_numpy("Y")[0, 0] == 5.0
        stamp = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "
        for process in (r"gepool\.front INFO", r"worker\d+ INFO CHATTY-INIT first", r"http DEBUG HTTP request"):
            assert wait_until(lambda p=process: re.search(stamp + p, pool.log(), re.M), 60), (process, pool.log())
        assert "'--strict-model-config' has been deprecated" in pool.log()
        assert not DEFAULT_STAMP.search(pool.log()), pool.log()  # no process logged a line before it knew
        # a change the front takes from a library client reaches the sidecar too (it asks every second)
        with Client(f"ipc://{tmp_path}/gw.sock") as client:
            assert client.query("logging", {"update": {"log_format": "default"}})["format"] == "default"

        def sidecar_follows() -> bool:
            request(pool.http, "GET", "/v2/health/live")
            return bool(re.search(DEFAULT_STAMP.pattern + "http DEBUG HTTP request: GET /v2/health/live", pool.log(),
                                  re.M))

        assert wait_until(sidecar_follows, 60), pool.log()[-2000:]
    with Started(tmp_path, "--model-repository", repo, "--strict-model-config", "false",
                 "--disable-auto-complete-config") as pool:
        assert "Overriding deprecated '--strict-model-config' from False to True" in pool.log()
        assert triton_default_stamps(pool.log())


def test_log_file_takes_every_process_log_and_the_console_gets_none(tmp_path):
    """--log-file as tritonserver's: the front's, a worker's and the sidecar's lines appended to the file (a
    restarted sidecar's too), the console spared; GET /v2/logging reports the file and no POST moves it."""
    from tritonclient.utils import InferenceServerException

    repo = str(tmp_path / "models")
    chatty(repo, "first")
    path = tmp_path / "triton.log"
    path.write_text("an earlier run\n")
    with Started(tmp_path, "--model-repository", repo, "--log-verbose", "1", "--log-file", str(path)) as pool:
        triton = pool.triton
        assert triton.get_log_settings()["log_file"] == str(path)
        inp = httpclient.InferInput("X", [1, 1], "FP32")
        inp.set_data_from_numpy(np.full((1, 1), 6.0, np.float32))
        assert triton.infer("first", [inp]).as_numpy("Y")[0, 0] == 6.0
        for process in (r"gepool\.front INFO", r"worker\d+ INFO CHATTY-INIT first", r"http DEBUG HTTP request"):
            assert wait_until(lambda p=process: re.search(p, path.read_text()), 60), (process, path.read_text())
        assert path.read_text().startswith("an earlier run\n")
        request(pool.http, "GET", "/v2/models/x%0A2099-01-01%2000:00:00,000%20gepool.front%20ERROR%20FORGED/ready")
        assert wait_until(lambda: "FORGED" in path.read_text(), 60)
        assert not re.search(r"^2099-01-01 .*FORGED", path.read_text(), re.M)  # a client writes no line of its own
        assert "HTTP request: GET /v2/models/x\\n2099-01-01 00:00:00,000 gepool.front ERROR FORGED" in path.read_text()
        with pytest.raises(InferenceServerException) as info:
            triton.update_log_settings({"log_file": str(tmp_path / "elsewhere.log")})
        assert "log file location can not be updated" in info.value.message()
        assert triton.get_log_settings()["log_file"] == str(path)

        seen = sidecar_restarted_and_logging(pool, path.read_text)
        assert pool.stop() == 0
    assert "stopping" in path.read_text()[seen:]  # the front's last lines too
    assert pool.log() == "", pool.log()  # nothing reached the console's standard error


def sidecar_restarted_and_logging(pool: Started, read_log) -> int:
    """Kills the pool's sidecar and waits for its successor to log a request in ``read_log()``; returns how
    long the log was before the kill."""
    (sidecar,) = sidecars(pool.proc.pid)
    os.kill(sidecar, signal.SIGKILL)
    assert wait_until(lambda: sidecars(pool.proc.pid) not in ([], [sidecar]), 60)
    seen = len(read_log())

    def logged_by_the_new_sidecar() -> bool:
        try:
            request(pool.http, "GET", "/v2/health/live")
        except OSError:  # started, not yet listening
            return False
        return " http DEBUG HTTP request: GET /v2/health/live" in read_log()[seen:]

    assert wait_until(logged_by_the_new_sidecar, 60), read_log()[seen:]
    return seen


DEFAULT_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.M)  # local time, a comma before the ms


def triton_default_stamps(log: str) -> bool:
    """The front's lines carry the default time stamps."""
    return bool(re.search(DEFAULT_STAMP.pattern + r"gepool\.front ", log, re.M))
