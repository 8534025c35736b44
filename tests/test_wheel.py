"""The built wheel carries every package: installed outside the source tree, it serves the demo."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    # Built from a copy: setuptools' build/ folder in the tree could carry modules that no longer exist.
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src") / "gepool"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "models"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    (found,) = out.glob("gepool-*.whl")
    return str(found)


def test_the_wheel_has_a_module_for_every_source_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    roots = {"gepool": "gepool", "gepool/ipc": "ipc", "gepool/scheduler": "scheduler", "gepool/workers": "workers"}
    expected = set()
    for pkg, folder in roots.items():
        for here, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__",) and not d.endswith(".egg-info")]
            rel = os.path.relpath(here, os.path.join(ROOT, folder))
            for f in files:
                if f.endswith((".py", ".proto")):
                    expected.add(os.path.normpath(os.path.join(pkg, rel, f)))
    assert "gepool/http/server.py" in expected
    assert expected - names == set()


def test_the_installed_wheel_serves_the_demo_outside_the_source_tree(wheel, tmp_path):
    # The venv sees the test environment's dependencies; gepool itself comes from the wheel alone.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True,
                   stdout=subprocess.DEVNULL)
    work = tmp_path / "work"
    shutil.copytree(os.path.join(ROOT, "examples"), work / "examples",
                    ignore=shutil.ignore_patterns("models", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import gepool.http.server as m; print(m.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    subprocess.run([python, "examples/make_models.py"], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
    demo = subprocess.run([python, "examples/demo.py"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=240)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert '"model_name":"tiny"' in demo.stdout.replace(" ", "")
    assert "nv_inference_request_success" in demo.stdout


def test_a_sidecar_that_cannot_start_says_why(tmp_path):
    import socket

    from gepool import Pool
    from gepool.common import errors
    from tests import repo as test_repo

    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(errors.GepoolError) as caught:
            test_repo.recorder(str(tmp_path), "echo")
            with Pool(str(tmp_path), http_port=port):
                pass
    assert "Address already in use" in str(caught.value) or "address already in use" in str(caught.value)
