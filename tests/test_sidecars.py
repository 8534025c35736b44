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
from gepool.options import MAX_AUTO_SIDECARS, MAX_SIDECARS, PoolOptions
from tests import repo as test_repo
from tests.conftest import free_port, running, sidecar_pids, wait_until

X = np.arange(16, dtype=np.float32).reshape(1, 16)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("sidecars"))
    test_repo.make_models.make_tiny(repo)
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    with Pool(repo, sidecars=2, **ports) as pool:
        assert pool.status["sidecars"] == 2
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


def post(port: int, path: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
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


@contextmanager
def segments(http: int, *contents: np.ndarray):
    """Fresh /dev/shm segments holding ``contents``; afterwards every region of ours is unregistered and
    each segment removed."""
    keys = [segment(f"sidecars-{os.getpid()}-{i}", data) for i, data in enumerate(contents)]
    try:
        yield keys
    finally:
        post(http, "/v2/systemsharedmemory/unregister")
        for key in keys:
            os.unlink(f"/dev/shm/{key}")


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
    with segments(http, X, X + 100) as (first, second):
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


def test_a_segment_replaced_after_registering_is_refused_by_the_other_sidecars(two):
    """B opens the region itself when it first needs it: a key that names another file by then is refused."""
    pool, ports = two
    a, b = sidecar_pids(pool)
    http = ports["http_port"]
    with segments(http, X) as (key,):
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
    PoolOptions(repo, http_port=8000, grpc_server="grpcio", sidecars=2).check()  # no gRPC port: nothing binds itself
    with pytest.raises(ValueError, match="sidecars=2: no port is served"):
        PoolOptions(repo, sidecars=2).check()
    with pytest.raises(ValueError, match=f"sidecars must be at most {MAX_SIDECARS}"):
        PoolOptions(repo, http_port=8000, sidecars=MAX_SIDECARS + 1).check()
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


def fds_naming(pid: int, needle: str) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if needle in target:
            out.append(target)
    return out


def test_a_long_key_or_name_is_refused_at_once(two):
    """A key or name past 256 characters is a 400 naming the limit, before the front hears of it (a query
    over the front's message limit went unanswered, and every register waited behind it)."""
    _, ports = two
    http = ports["http_port"]
    with segments(http, X) as (key,):
        code, reply = post(http, "/v2/systemsharedmemory/region/r/register",
                           {"key": "/" * 300_000 + key, "byte_size": X.nbytes})
        assert code == 400 and "shared memory key of 300" in reply["error"] and "longer than 256" in reply["error"]
        code, reply = post(http, f"/v2/systemsharedmemory/region/{'n' * 300}/register",
                           {"key": key, "byte_size": X.nbytes})
        assert code == 400 and "region name of 300 characters is longer than 256" in reply["error"]
        assert register(http, "r", key) == 200  # and the next register is served at once


def test_an_escaped_region_key_still_sees_the_current_record(two):
    """A request naming its region as "shared\\u005fmemory_region" (the same key once parsed) after an
    unregister through the other sidecar is refused, not served from the segment still open there."""
    pool, ports = two
    a, b = sidecar_pids(pool)
    http = ports["http_port"]
    escaped = ('{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "parameters": '
               '{"shared\\u005fmemory_region": "r", "shared_memory_byte_size": ' f'{X.nbytes}' '}}]}').encode()

    def infer_escaped() -> tuple[int, dict]:
        return post(http, "/v2/models/tiny/infer", escaped)

    with segments(http, X) as (key,):
        with only(a, [a, b]):
            assert register(http, "r", key) == 200
        with only(b, [a, b]):
            code, reply = infer_escaped()
            assert code == 200 and reply["outputs"][0]["data"] == (2 * X + 1).ravel().tolist()
        with only(a, [a, b]):
            assert post(http, "/v2/systemsharedmemory/region/r/unregister")[0] == 200
        with only(b, [a, b]):
            code, reply = infer_escaped()
            assert code == 400 and "Unable to find system shared memory region: 'r'" in reply["error"]


def test_an_idle_sidecar_closes_a_segment_unregistered_through_another(two):
    pool, ports = two
    a, b = sidecar_pids(pool)
    http = ports["http_port"]
    with segments(http, X) as (key,):
        with only(a, [a, b]):
            assert register(http, "r", key) == 200
        assert wait_until(lambda: fds_naming(b, key), 30)  # b adopts the record on its own, and opens it
        with only(a, [a, b]):
            assert post(http, "/v2/systemsharedmemory/region/r/unregister")[0] == 200
        assert wait_until(lambda: not fds_naming(a, key) and not fds_naming(b, key), 30)


def test_a_sidecar_short_of_descriptors_answers_503_and_opens_the_region_once_it_has_them(tmp_path):
    """The sidecar's Regions wired to the front's RegionBook in this process (the query's transport aside):
    with every descriptor taken, a region registered elsewhere is 503 "try again", not refused for good."""
    import asyncio
    import resource

    from gepool.http.shm import Regions
    from gepool.scheduler.regions import RegionBook, version_page, version_page_fd

    key = segment(f"sidecars-emfile-{os.getpid()}", X)
    rw, ro = version_page_fd()
    book = RegionBook("t" * 32, rw)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []

    async def ask(args: dict) -> dict:
        return book.answer({**args, "token": "t" * 32})

    async def main() -> None:
        here, elsewhere = Regions(ask, version_page(ro, False)), Regions(ask, version_page(ro, False))
        try:
            await elsewhere.register(os.getuid(), "r", key, 0, X.nbytes)
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
            while True:  # every descriptor taken
                try:
                    held.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            await here.current()
            with pytest.raises(errors.Unavailable, match="Too many open files; try again"):
                here.acquire(os.getuid(), "r")
            os.close(held.pop())
            os.close(held.pop())
            region = here.acquire(os.getuid(), "r")
            try:
                assert bytes(here.read(region, 0, None, X.nbytes)) == X.tobytes()
            finally:
                here.release(region)
        finally:
            here.close()
            elsewhere.close()

    try:
        asyncio.run(main())
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        book.close()
        os.close(rw)
        os.close(ro)
        os.unlink(f"/dev/shm/{key}")


def test_the_version_page_is_sealed_and_read_only_in_the_sidecars(two):
    pool, _ = two
    front = pool.process.pid
    for pid in sidecar_pids(pool):
        for n in os.listdir(f"/proc/{pid}/fd"):
            if "memfd:gepool-regions" in os.readlink(f"/proc/{pid}/fd/{n}"):
                with open(f"/proc/{pid}/fdinfo/{n}") as info:
                    flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
                assert flags & os.O_ACCMODE == os.O_RDONLY, (pid, n, oct(flags))
    fds = [n for n in os.listdir(f"/proc/{front}/fd") if "memfd:gepool-regions" in os.readlink(f"/proc/{front}/fd/{n}")]
    assert fds  # the front's own (read-write) and the one it hands the sidecars (read-only)
    page = os.open(f"/proc/{front}/fd/{fds[0]}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(page, 0)  # F_SEAL_SHRINK: no process can make the front's mapping fault
    finally:
        os.close(page)


def test_the_record_answers_a_change_with_the_change_alone():
    from gepool.scheduler.regions import RegionBook

    book = RegionBook("t" * 32)
    region = {"uid": 5, "key": "k", "offset": 0, "byte_size": 4, "dev": 1, "ino": 2}
    for i in range(3):
        change = book.answer({"op": "register", "token": "t" * 32, "name": f"r{i}", **region})
        assert set(change) == {"version", "region"} and change["version"] == i + 1
    assert len(book.answer({"op": "list", "token": "t" * 32})["regions"]) == 3
    change = book.answer({"op": "unregister", "token": "t" * 32, "uid": 5, "name": "r1"})
    assert change == {"version": 4, "removed": [[5, "r1"]]}
    for token in ("é" * 32, None, "t" * 31):
        with pytest.raises(errors.PermissionDenied):
            book.answer({"op": "list", "token": token})
    with pytest.raises(errors.InvalidArgument, match="key of 257 characters is longer than 256"):
        book.answer({"op": "register", "token": "t" * 32, "name": "x", **region, "key": "k" * 257})


def test_a_name_registered_again_elsewhere_during_a_register_is_read_from_its_new_segment():
    """Sidecar A registers r while one change behind; before A fetches the whole record, B unregisters r and
    registers it again on another segment. A must not keep its descriptor of the first segment under the
    record of the second (the Regions of both wired to the front's RegionBook in this process)."""
    import asyncio

    from gepool.http.shm import Regions
    from gepool.scheduler.regions import RegionBook, version_page, version_page_fd

    keys = [segment(f"sidecars-again-{os.getpid()}-{i}", data) for i, data in enumerate((X, X + 1, X + 2))]
    rw, ro = version_page_fd()
    book = RegionBook("t" * 32, rw)
    uid = os.getuid()

    async def main() -> None:
        async def ask_b(args: dict) -> dict:
            return book.answer({**args, "token": "t" * 32})

        b = Regions(ask_b, version_page(ro, False))
        raced = []

        async def ask_a(args: dict) -> dict:
            answer = book.answer({**args, "token": "t" * 32})
            if args["op"] == "register" and not raced:
                raced.append(True)
                await b.unregister(uid, "r")
                await b.register(uid, "r", keys[2], 0, X.nbytes)
            return answer

        a = Regions(ask_a, version_page(ro, False))
        try:
            await b.register(uid, "other", keys[0], 0, X.nbytes)  # a is now one change behind
            await a.register(uid, "r", keys[1], 0, X.nbytes)
            assert raced
            for regions in (a, b):
                await regions.current()
                region = regions.acquire(uid, "r")
                try:
                    assert bytes(regions.read(region, 0, None, X.nbytes)) == (X + 2).tobytes()
                finally:
                    regions.release(region)
        finally:
            a.close()
            b.close()

    try:
        asyncio.run(main())
        assert not [fd for key in keys for fd in fds_naming(os.getpid(), key)]  # every descriptor closed
    finally:
        book.close()
        os.close(rw)
        os.close(ro)
        for key in keys:
            os.unlink(f"/dev/shm/{key}")


def listen_backlogs(port: int) -> list[int]:
    """The accept-queue limit of each listening TCP socket of this host on ``port``, as sock_diag reports it
    (a listener's wqueue), for IPv4 and IPv6: a dump of every listener, with peer.py's netlink layout."""
    from gepool.http import peer

    nlmsg_done, nlm_f_dump, tcp_listen = 3, 0x300, 10
    found = []
    for family in (socket.AF_INET, socket.AF_INET6):
        req = peer._REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << tcp_listen) + bytes(peer._SOCKID_BYTES)
        try:
            nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, peer.NETLINK_SOCK_DIAG)
        except OSError as exc:
            pytest.skip(f"sock_diag is not available here: {exc}")
        with nl:
            nl.settimeout(10)
            nl.send(peer._NLMSG.pack(peer._NLMSG.size + len(req), peer.SOCK_DIAG_BY_FAMILY,
                                     peer.NLM_F_REQUEST | nlm_f_dump, 1, 0) + req)
            done = False
            while not done:
                data, pos = nl.recv(65536), 0
                while pos + peer._NLMSG.size <= len(data):
                    length, kind, _, _, _ = peer._NLMSG.unpack_from(data, pos)
                    if kind in (peer.NLMSG_ERROR, nlmsg_done):
                        done = True
                        break
                    body = pos + peer._NLMSG.size
                    sport = int.from_bytes(data[body + peer._MSG_HEAD.size:body + peer._MSG_HEAD.size + 2], "big")
                    _, _, backlog, _, _ = peer._MSG_TAIL.unpack_from(
                        data, body + peer._MSG_HEAD.size + peer._SOCKID_BYTES)
                    if sport == port:
                        found.append(backlog)
                    pos += (length + 3) & ~3
    return found


def test_every_port_keeps_the_pools_accept_queue(two):
    """aiohttp's SockSite listens again on the socket it is given, with its own default backlog of 128 unless
    told otherwise: the metrics port (aiohttp in every sidecar) must keep the backlog the pool bound it with."""
    from gepool.http import listen

    _, ports = two
    for name in ("http_port", "grpc_port", "metrics_port"):
        assert listen_backlogs(ports[name]) and set(listen_backlogs(ports[name])) == {listen.BACKLOG}, name


@pytest.mark.parametrize("server", ["aiohttp", "granian"])
def test_a_sidecar_on_another_http_server_keeps_the_accept_queue(tmp_path, server):
    """aiohttp serves the pool's socket, granian binds its own: both with the backlog the pool binds with."""
    if server == "granian":
        pytest.importorskip("granian")
    from gepool.http import listen

    test_repo.make_models.make_tiny(str(tmp_path))
    ports = {"http_port": free_port(), "metrics_port": free_port()}
    with Pool(str(tmp_path), http_server=server, **ports):
        for name, port in ports.items():
            assert set(listen_backlogs(port)) == {listen.BACKLOG}, name
