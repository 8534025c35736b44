"""The CLI as a person meets it: a user error is one line and exit code 2, never a traceback; help and --version."""

import argparse
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import free_port


def gepool(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """``gepool ARGS`` in a fresh interpreter; ``code`` runs first (to hide a package, say)."""
    argv = [sys.executable, "-m", "gepool.cli", *args] if code is None else \
        [sys.executable, "-c", f"{code}; import sys; from gepool.cli import main; sys.exit(main(sys.argv[1:]))", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def assert_user_error(out: subprocess.CompletedProcess, *says: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gepool: error: "), out.stderr
    for text in says:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("argv, says", [
    (["start", "--model-repository", "/nonexistent/models"], ["--model-repository '/nonexistent/models'",
                                                             "is not a folder"]),
    (["start"], ["required: --model-repository"]),
    (["start", "--model-repository", ".", "--model-store", "."], ["one model repository"]),
    (["start", "--model-repository", ".", "--exit-on-error", "maybe"], ["--exit-on-error", "true or false"]),
    (["start", "--model-repository", ".", "--log-level", "DEBUG", "--log-info", "true"], ["--log-level",
                                                                                          "--log-info"]),
    (["start", "--model-repository", ".", "--log-warning", "false"], ["--log-warning false"]),
    (["start", "--model-repository", ".", "--log-verbose", "x"], ["--log-verbose"]),
    (["start", "--model-repository", ".", "--log-file", "/nonexistent/triton.log"],
     ["--log-file '/nonexistent/triton.log' cannot be written: No such file or directory"]),
    (["start", "--model-repository", ".", "--log-file", "/"], ["--log-file '/' cannot be written: Is a directory"]),
    (["start", "--model-repository", ".", "--backend-config=python,shm-default-byte-size=1048576"],
     ["--backend-config python,shm-default-byte-size=1048576: gepool has no setting 'shm-default-byte-size'"]),
    (["start", "--model-repository", ".", "--model-config-name="], ["empty argument for --model-config-name"]),
    (["start", "--model-repository", ".", "--backend-config", ",default-max-batch-size=3"],
     ["No backend specified. --backend-config option format is"]),
    (["status", "--endpoint", "localhost"], ["ipc://PATH, tcp://HOST:PORT or HOST:PORT", "'localhost'"]),
    (["status", "--endpoint", "tcp://127.0.0.1:*"], ["needs the pool's port"]),
    (["status", "--endpoint", "ipc:///nonexistent/gepool.sock"], ["no pool on ipc:///nonexistent/gepool.sock",
                                                                 "does not exist"]),
    (["infer", "tiny", "--input", "INPUT0"], ["--input takes NAME=FILE.npy, not 'INPUT0'"]),
    (["infer", "tiny", "--input", "INPUT0=/nonexistent/x.npy"], ["cannot load '/nonexistent/x.npy'"]),
    (["bench", "tiny", "--endpoint", "ipc:///nonexistent/gepool.sock"], ["no pool on"]),
    (["bench", "tiny", "--concurrency", "1,x"], ["--concurrency takes a comma-separated list"]),
    (["nosuch"], ["invalid choice: 'nosuch'"]),
    (["status", "--nosuch"], ["unrecognized arguments: --nosuch"]),
])
def test_a_user_error_is_one_line_and_exit_code_2(argv, says):
    assert_user_error(gepool(*argv), *says)


def test_host_port_is_an_endpoint_and_one_that_does_not_listen_is_said_so():
    port = free_port()
    assert_user_error(gepool("status", "--endpoint", f"127.0.0.1:{port}"), f"no pool listens on tcp://127.0.0.1:{port}")
    assert_user_error(gepool("bench", "tiny", "--http", f"127.0.0.1:{port}", "--duration", "0.1"),
                      f"nothing listens on http://127.0.0.1:{port}")


def test_a_missing_npy_and_an_unknown_input_name_are_user_errors(pool, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    assert_user_error(gepool("infer", "tiny", "--endpoint", pool.endpoint, "--input", f"NOSUCH={tmp_path}/x.npy"),
                      "model 'tiny' has no input NOSUCH", "INPUT0")
    assert_user_error(gepool("infer", "tiny", "--endpoint", pool.endpoint, "--input", f"INPUT0={tmp_path}/y.npy"),
                      f"cannot load '{tmp_path}/y.npy'")


def test_plot_without_matplotlib_is_refused_before_the_run(pool, client):
    before = client.stats()["tiny"]["requests"]
    out = gepool("bench", "tiny", "--endpoint", pool.endpoint, "--concurrency", "1", "--duration", "0.5",
                 "--plot", "x.png", code="sys = __import__('sys'); sys.modules['matplotlib'] = None")
    assert_user_error(out, "--plot needs matplotlib", "pip install 'gepool[plot]'")
    assert client.stats()["tiny"]["requests"] == before  # nothing was sent


def test_a_pool_refusal_is_one_line_and_exit_code_1(pool):
    for model, says in (("nosuch", "unknown model"), ("bad_config", "model 'bad_config' declares no inputs")):
        out = gepool("bench", model, "--endpoint", pool.endpoint, "--concurrency", "1", "--duration", "0.2")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        (line,) = out.stderr.splitlines()
        assert line.startswith("gepool: error: ") and says in line, line


def test_version():
    from gepool import __version__

    out = gepool("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"gepool {__version__}"


def test_every_subcommand_and_option_has_help():
    from gepool.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {"start", "status", "infer", "load", "unload", "bench", "cleanup", "ray"}
    listed = {c.dest for c in sub._choices_actions}
    assert listed == set(sub.choices)  # each has a one-line help in `gepool --help`
    assert all(c.help for c in sub._choices_actions)
    for name, p in [("gepool", parser), *sub.choices.items()]:
        missing = [a.option_strings or a.dest for a in p._actions if not a.help]
        assert not missing, f"{name}: options without help: {missing}"
        assert p.format_help()  # renders


def test_the_status_table():
    from gepool.cli import format_status

    status = {"pool_id": "123xab", "endpoint": "ipc:///run/g.sock", "pid": 123, "stopping": False,
              "model_control_mode": "explicit", "polling": {"mode": "adaptive"},
              "models": {"tiny": {"state": "READY", "version": 1, "workers": 2, "ready_workers": 2, "queued": 3,
                                  "restarts": 0, "reason": ""},
                         "broken_model": {"state": "UNAVAILABLE", "version": None, "workers": 1, "ready_workers": 0,
                                          "queued": 0, "restarts": 4, "reason": "weights are missing"}}}
    assert format_status(status).splitlines() == [
        "pool 123xab on ipc:///run/g.sock (pid 123), model control explicit, polling adaptive",
        "MODEL         STATE        VERSION  WORKERS  QUEUED  RESTARTS  REASON",
        "broken_model  UNAVAILABLE  -        0/1      0       4         weights are missing",
        "tiny          READY        1        2/2      3       0",
    ]
    assert format_status(dict(status, models={})).splitlines()[-1] == "(no models)"
