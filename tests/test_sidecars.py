"""Several sidecars serving one pool's ports: the pool binds each port once and every sidecar accepts on
the same sockets; shared-memory regions are the pool's, whichever sidecar registered them."""

import json
import os
import signal
import socket
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.options import MAX_AUTO_SIDECARS, PoolOptions
from tests import repo as test_repo
from tests.conftest import free_port, running, sidecar_pids, wait_until

X = np.arange(16, dtype=np.float32).reshape(1, 16)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("sidecars"))
    test_repo.make_models.make_tiny(repo)
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    with Pool(repo, sidecars=2, **ports) as pool:
        assert wait_until(lambda: len(sidecar_pids(pool)) == 2, 30)
        yield pool, ports


@contextmanager
def only(pid: int, others: list[int]):
    """Every sidecar but ``pid`` stopped (SIGSTOP): a connection opened meanwhile can only be accepted by it."""
    for other in others:
        if other != pid:
            os.kill(other, signal.SIGSTOP)
    try:
        yield
    finally:
        for other in others:
            if other != pid:
                os.kill(other, signal.SIGCONT)


def post(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:  # a new connection each time
            text = r.read()
            return r.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def register(port: int, region: str, key: str) -> int:
    return post(port, f"/v2/systemsharedmemory/region/{region}/register", {"key": key, "byte_size": X.nbytes})[0]


def infer_shm(port: int, region: str) -> tuple[int, dict]:
    return post(port, "/v2/models/tiny/infer", {"inputs": [{
        "name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
        "parameters": {"shared_memory_region": region, "shared_memory_byte_size": X.nbytes}}]})


def segment(name: str, data: np.ndarray) -> str:
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.write(fd, data.tobytes())
    finally:
        os.close(fd)
    return name


def test_every_sidecar_accepts_on_each_shared_port(two):
    import tritonclient.grpc as grpcclient

    pool, ports = two
    pids = sidecar_pids(pool)
    for pid in pids:
        with only(pid, pids):
            code, reply = post(ports["http_port"], "/v2/models/tiny/infer", {"inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": X.ravel().tolist()}]})
            assert code == 200 and reply["outputs"][0]["data"] == (2 * X + 1).ravel().tolist()
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=60) as r:
                assert b"nv_inference_request_success" in r.read()
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc_port']}")
            try:
                assert client.is_server_ready()
            finally:
                client.close()


def test_a_region_registered_through_one_sidecar_is_the_pools(two):
    """Registered through A, used through B; unregistered through B, gone through A; registered again under
    the same name with another segment through A, B reads the new one; status agrees everywhere."""
    pool, ports = two
    a, b = sidecar_pids(pool)
    http = ports["http_port"]
    first = segment(f"sidecars-first-{os.getpid()}", X)
    second = segment(f"sidecars-second-{os.getpid()}", X + 100)
    try:
        with only(a, [a, b]):
            assert register(http, "r", first) == 200
        with only(b, [a, b]):
            code, reply = infer_shm(http, "r")
            assert code == 200, reply
            assert reply["outputs"][0]["data"] == (2 * X + 1).ravel().tolist()
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/systemsharedmemory/status", timeout=60) as r:
                assert [row["key"] for row in json.loads(r.read())] == [first]
            assert post(http, "/v2/systemsharedmemory/region/r/unregister")[0] == 200
        with only(a, [a, b]):
            code, reply = infer_shm(http, "r")
            assert code == 400 and "Unable to find system shared memory region: 'r'" in reply["error"]
            assert register(http, "r", second) == 200
        with only(b, [a, b]):
            code, reply = infer_shm(http, "r")
            assert code == 200 and reply["outputs"][0]["data"] == (2 * (X + 100) + 1).ravel().tolist()
            code, reply = post(http, "/v2/systemsharedmemory/region/r/register", {"key": first, "byte_size": X.nbytes})
            assert code == 400 and "already in manager" in reply["error"]
    finally:
        post(http, "/v2/systemsharedmemory/unregister")
        os.unlink(f"/dev/shm/{first}")
        os.unlink(f"/dev/shm/{second}")


def test_a_segment_replaced_after_registering_is_refused_by_the_other_sidecars(two):
    """B opens the region itself when it first needs it: a key that names another file by then is refused."""
    pool, ports = two
    a, b = sidecar_pids(pool)
    http = ports["http_port"]
    key = segment(f"sidecars-swapped-{os.getpid()}", X)
    try:
        with only(a, [a, b]):
            assert register(http, "s", key) == 200
        os.unlink(f"/dev/shm/{key}")
        segment(key, X + 1)  # the same name, another file
        with only(b, [a, b]):
            code, reply = infer_shm(http, "s")
            assert code == 403 and "no longer names the segment it was registered with" in reply["error"], reply
        with only(a, [a, b]):  # A checked it and holds it open: it reads the segment it registered
            code, reply = infer_shm(http, "s")
            assert code == 200 and reply["outputs"][0]["data"] == (2 * X + 1).ravel().tolist()
    finally:
        post(http, "/v2/systemsharedmemory/unregister")
        os.unlink(f"/dev/shm/{key}")


def test_only_the_pools_sidecars_may_use_the_record(two):
    pool, _ = two
    client = pool.client()
    try:
        for args in ({"op": "list"}, {"op": "list", "token": "0" * 32},
                     {"op": "register", "token": None, "uid": 0, "name": "x", "key": "k", "offset": 0,
                      "byte_size": 1, "dev": 0, "ino": 0}):
            with pytest.raises(errors.PermissionDenied, match="through the pool's own sidecars"):
                client.query("regions", args)
    finally:
        client.close()


def test_a_killed_sidecar_leaves_the_port_accepting_and_the_regions_registered(tmp_path):
    """With one sidecar, a connection made while it is dead waits in the port's queue and is answered by
    the sidecar started in its place; the regions registered before are still there."""
    test_repo.make_models.make_tiny(str(tmp_path))
    http = free_port()
    key = segment(f"sidecars-restart-{os.getpid()}", X)
    try:
        with Pool(str(tmp_path), http_port=http, sidecars=1) as pool:
            (old,) = sidecar_pids(pool)
            assert register(http, "r", key) == 200
            os.kill(old, signal.SIGKILL)
            assert wait_until(lambda: not running(old), 30)
            with socket.create_connection(("127.0.0.1", http), timeout=60) as conn:  # accepted by the kernel's queue
                conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert conn.recv(64).startswith(b"HTTP/1.1 200")
            (new,) = sidecar_pids(pool)
            assert new != old
            code, reply = infer_shm(http, "r")
            assert code == 200 and reply["outputs"][0]["data"] == (2 * X + 1).ravel().tolist()
    finally:
        os.unlink(f"/dev/shm/{key}")


def test_sidecars_option_is_checked_and_sized(tmp_path, monkeypatch):
    repo = str(tmp_path)
    with pytest.raises(ValueError, match="sidecars must be >= 0"):
        PoolOptions(repo, sidecars=-1).check()
    with pytest.raises(ValueError, match="sidecars=2: grpc_server is grpcio"):
        PoolOptions(repo, grpc_port=8001, grpc_server="grpcio", sidecars=2).check()
    PoolOptions(repo, grpc_port=0, grpc_server="grpcio", sidecars=2).check()  # no gRPC port: nothing binds itself
    for cores, want in ((2, 1), (15, 1), (16, 2), (24, 3), (64, MAX_AUTO_SIDECARS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert PoolOptions(repo, http_port=8000).sidecar_count() == want
        assert PoolOptions(repo, http_port=8000, grpc_port=8001, grpc_server="grpcio").sidecar_count() == 1
    assert PoolOptions(repo, sidecars=3).sidecar_count() == 3


def test_a_port_in_use_is_refused_for_every_sidecar(tmp_path):
    test_repo.make_models.make_tiny(str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.Unavailable, match=f"cannot listen for metrics on 127.0.0.1:{port}: address "
                                                      f"already in use"):
            with Pool(str(tmp_path), http_port=free_port(), metrics_port=port, sidecars=2):
                pass
