"""The sidecar on granian (gepool/http/rsgi.py): what the adapter adds to the routes, and the option that picks it."""

import http.client
import subprocess
import sys
import textwrap

import pytest

from gepool import Pool
from gepool.http import servers
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

pytest.importorskip("granian")

# an RSGI app of the adapter's own router: one route that crashes, one that answers, one aiohttp error
CRASHING = textwrap.dedent("""
    import asyncio, os, sys
    from aiohttp import web
    from gepool.http import rsgi

    async def boom(request):
        raise RuntimeError("a bug in a handler")

    async def fine(request):
        body = await request.read_body(1 << 20, 5.0)
        return web.json_response({"got": len(body), "model": request.match_info["model"],
                                  "key": request.headers.get("X-Key")})

    async def main():
        router = rsgi.Router()
        router.add_post("/boom", boom)
        router.add_post("/m/{model}/fine", fine)
        listener = rsgi.Listener(rsgi.App(router), "127.0.0.1", int(sys.argv[1]), 5.0)
        await listener.start()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await listener.stop()

    asyncio.run(main())
""")


def _send(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_crashing_handler_is_a_500_without_python_and_the_server_lives():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", CRASHING, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(3):
            status, body = _send(port, "POST", "/boom", b"x")
            assert status == 500 and b"internal error" in body and b"Traceback" not in body
        status, body = _send(port, "POST", "/m/a%20b/fine", b"12345", {"x-KEY": "v"})
        assert (status, body) == (200, b'{"got": 5, "model": "a b", "key": "v"}')
        status, body = _send(port, "POST", "/m/a%2520b/fine", b"")  # decoded once, as aiohttp does
        assert (status, body) == (200, b'{"got": 0, "model": "a%20b", "key": null}')
        assert _send(port, "GET", "/m/a/fine")[0] == 405
        assert _send(port, "GET", "/nowhere")[0] == 404
        status, body = _send(port, "POST", "/m/a/fine", b"x", {"Content-Encoding": "br"})
        assert status == 415 and b"Content-Encoding 'br'" in body
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0, proc.stderr.read()
        err = proc.stderr.read()
    assert "a bug in a handler" in err  # the traceback went to the log


def test_granian_is_refused_naming_the_package_when_it_is_not_installed(tmp_path):
    hide = "import sys; sys.modules['granian'] = None; "
    proc = subprocess.run([sys.executable, "-c", hide + "from gepool.http.server import main; main()",
                           "--endpoint", "ipc:///nowhere", "--http-server", "granian"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs the package granian" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-c", hide + "from gepool.options import PoolOptions; "
                           f"PoolOptions({str(tmp_path)!r}, http_port=8000, http_server='granian').check()"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "http_server: the HTTP server granian needs the package granian" in proc.stderr
    assert servers.refusal("nginx") == "the HTTP server must be one of aiohttp, granian, httptools, not 'nginx'"


def test_httptools_is_refused_naming_the_package_when_it_is_not_installed():
    hide = "import sys; sys.modules['httptools'] = None; "
    proc = subprocess.run([sys.executable, "-c", hide + "from gepool.http.server import main; main()",
                           "--endpoint", "ipc:///nowhere", "--http-server", "httptools"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs the package httptools" in proc.stderr, proc.stderr


@pytest.mark.parametrize("server", servers.HTTP_SERVERS)
def test_gepool_start_serves_on_the_server_it_names(tmp_path, server):
    """--http-server reaches the sidecar: its Server header says which one answered (httptools writes none)."""
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    port = free_port()
    with Pool(repo, http_port=port, http_server=server):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v2/health/live")
        resp = conn.getresponse()
        resp.read()
        conn.close()
    assert resp.status == 200
    said = resp.getheader("Server", "")
    assert ("granian" in said, "aiohttp" in said, said == "") == (server == "granian", server == "aiohttp",
                                                                  server == "httptools"), said


def test_a_body_deadline_ends_only_the_read_past_it():
    """A read past its deadline raises TimeoutError and leaves its task uncancelled; one that completes in
    time returns its value; the owner's own cancellation still cancels."""
    import asyncio

    from gepool.http.rsgi import Deadlines

    async def main():
        deadlines = Deadlines()
        never = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await deadlines.run(never, 0.3)
        assert 0.3 <= loop.time() - start < 10 and asyncio.current_task().cancelling() == 0

        async def soon():
            await asyncio.sleep(0.01)
            return b"body"

        assert await deadlines.run(soon(), 30) == b"body"
        owned = loop.create_task(deadlines.run(loop.create_future(), 30))
        await asyncio.sleep(0.05)
        owned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owned
        assert not deadlines._due
        deadlines.close()

    asyncio.run(main())


def test_a_port_already_served_is_refused_not_shared():
    """granian binds with SO_REUSEPORT; a second sidecar on a port another one serves must fail to start
    (as on aiohttp), not take half of that port's connections."""
    port = free_port()
    args = ["--endpoint", "ipc:///nowhere", "--http-port", str(port), "--metrics-port", "0", "--http-server", "granian"]
    first = subprocess.Popen([sys.executable, "-m", "gepool.http.server", *args], stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: _live(port), 60)
        second = subprocess.run([sys.executable, "-m", "gepool.http.server", *args], capture_output=True, text=True,
                                timeout=60)
        assert second.returncode != 0 and "address already in use" in second.stderr, second.stderr[-2000:]
    finally:
        first.terminate()
        first.wait(30)


def _live(port: int) -> bool:
    try:
        return _send(port, "GET", "/v2/health/live")[0] == 200
    except OSError:
        return False


def test_the_server_choice_is_checked_without_importing_granian_and_helped_once():
    """Checking that granian is installed does not import it into the front; both command lines carry the one
    help text for --http-server, and the sidecar's --http-body-timeout-s says it also closes idle connections."""
    check = ("import sys; from gepool.options import PoolOptions; "
             "PoolOptions('/tmp', http_port=8000, http_server='granian').check(); "
             "print('granian' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]
    for command in (["-c", "from gepool.cli import main; main()", "start", "--help"],
                    ["-m", "gepool.http.server", "--help"]):
        proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=60)
        words = " ".join(proc.stdout.split())
        assert proc.returncode == 0 and servers.HELP in words, (command, proc.stdout[-3000:])
    assert "also the idle timeout of keep-alive connections" in words
