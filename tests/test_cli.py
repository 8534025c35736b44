"""`gepool start` in the foreground, used the way a person would: infer, status, SIGTERM, cleanup."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from gepool.ipc import naming
from gepool.options import PoolOptions
from tests.conftest import _descendants, free_port, running, wait_until

START_TIMEOUT_S = 120


def gepool(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gepool.cli", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_start_infer_status_and_sigterm(model_repo, tmp_path):
    endpoint = f"ipc://{tmp_path}/cli.sock"
    http_port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gepool.cli", "start", "--model-repository", model_repo,
                             "--endpoint", endpoint, "--log-level", "WARNING", "--http-port", str(http_port),
                             "--metrics-port", str(metrics_port), "--grpc-port", "0", "--exit-on-error", "false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("gepool ready on"):
                break
        assert lines[-1] == f"gepool ready on {endpoint}", (lines, proc.stderr.read() if proc.poll() else "")
        assert "model tiny: READY (version 1, 1 worker(s))" in lines
        assert any(line.startswith("model cannot_load: UNAVAILABLE - ") for line in lines)
        assert f"HTTP (KServe v2) on http://127.0.0.1:{http_port}" in lines
        sized = PoolOptions(".", http_port=http_port).sidecar_count()  # by this host's cores
        assert f"{sized} sidecar process(es) serve these ports (--sidecars)" in lines
        workers = _descendants(proc.pid)
        assert len(workers) >= 8  # the workers and the HTTP sidecar
        live = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/live", timeout=30)
        assert live.status == 200
        with pytest.raises(urllib.error.HTTPError) as not_ready:  # strict readiness: cannot_load is not ready
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=30)
        assert not_ready.value.code == 400
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read()
        assert b"nv_inference_request_success" in metrics

        out = gepool("infer", "tiny", "--endpoint", endpoint, "--batch-size", "3")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("OUTPUT0 float32 [3, 16]")

        x = np.arange(16, dtype=np.float32)[None]
        np.save(tmp_path / "x.npy", x)
        out = gepool("infer", "tiny", "--endpoint", endpoint, "--input", f"INPUT0={tmp_path / 'x.npy'}",
                     "--shared-memory")
        assert out.returncode == 0, out.stderr
        assert "[[ 1.  3.  5." in out.stdout

        out = gepool("status", "--endpoint", endpoint, "--json")
        status = json.loads(out.stdout)
        assert status["models"]["mlp"]["state"] == "READY"
        table = gepool("status", "--endpoint", endpoint).stdout.splitlines()
        assert table[0].startswith(f"pool {status['pool_id']} on {endpoint} (pid {status['pid']})")
        assert table[1].split() == ["MODEL", "STATE", "VERSION", "WORKERS", "QUEUED", "RESTARTS", "REASON"]
        assert "mlp READY 1 1/1 0 0" in [" ".join(row.split()) for row in table]
        assert any(row.split()[:2] == ["cannot_load", "UNAVAILABLE"] and "weights are missing" in row for row in table)

        out = gepool("infer", "nosuch", "--endpoint", endpoint)
        assert out.returncode == 1 and "unknown model: 'nosuch'" in out.stderr

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not any(running(pid) for pid in workers))
        assert not os.path.exists(endpoint[len("ipc://"):])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_second_pool_on_a_live_endpoint_is_refused(pool, model_repo):
    out = gepool("start", "--model-repository", model_repo, "--endpoint", pool.endpoint, "--http-port", "0",
                 "--metrics-port", "0")
    assert out.returncode == 1
    assert "already serving" in out.stderr


def test_cleanup_removes_what_a_dead_pool_left():
    code = ("from gepool.ipc import naming; from gepool.ipc.ring import Ring; "
            "print(Ring.create(naming.segment_name(naming.new_owner_id(), 'w1.0'), 2, 4096).segment.name)")
    name = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert name[1:] in naming.list_segments()
    out = gepool("cleanup")
    assert out.returncode == 0
    assert f"removed /dev/shm/{name[1:]}" in out.stdout
    assert name[1:] not in naming.list_segments()


def test_cleanup_removes_stale_runtime_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    code = "import os; print(os.getpid())"
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    folder = tmp_path / "gepool"
    folder.mkdir(mode=0o700)
    stale = [folder / f"gepool-{dead}xabc.workers", folder / f"pool-{dead}xdef.sock"]
    live = folder / f"gepool-{os.getpid()}xabc.w1.0.run"
    for p in (*stale, live):
        p.write_text("")
    out = gepool("cleanup", env=dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path)))
    assert out.returncode == 0 and "removed 2 stale" in out.stdout
    assert not any(p.exists() for p in stale) and live.exists()
