"""The KServe v2 infer route through the sidecar, a minimal aiohttp app, granian and uvicorn: CPU per request.

    python benchmarks/http_servers.py [--seconds 4] [--rounds 2] [--levels 8,64] [--models tiny,mlp]
        [--servers sidecar,sidecar-aiohttp,sidecar-granian,aiohttp,granian,granian-rust,granian-mp,uvicorn]
        [--profile SERVER:FILE] [--null]
    python benchmarks/http_servers.py --breakdown [--seconds 3] [--levels 8,64] [--models tiny,mlp]

One pool (the peers' batching settings, as gateway_bench.py) serves every server in turn, alternating
over rounds, with wrk (KServe v2 JSON bodies of one row) at each level:

    sidecar       the real one (``python -m gepool.http.server``, as the pool starts it)
    sidecar-aiohttp, sidecar-granian
                  the real sidecar started beside the pool with ``--http-server aiohttp`` or ``granian``
    aiohttp       a minimal aiohttp app on uvloop doing only the infer route's work: kserve.parse_request,
                  AsyncClient.infer, kserve.encode_response (no access checks, limits, stats or tracing)
    granian       the same handler as an RSGI app on granian's embedded server (1 Rust runtime thread,
                  HTTP/1, asyncio tasks) on uvloop, in one process
    granian-rust  the same, with granian's Rust task implementation (experimental in granian)
    granian-mp    the same app under granian's own runner (``granian --interface rsgi --workers 1
                  --runtime-mode st --runtime-threads 1 --loop uvloop``: a supervisor and one worker process)
    uvicorn       the same handler as a raw ASGI app on uvicorn with httptools and uvloop

Every answer is checked in wrk's Lua (status 200, the KServe response's structure) and counted; one
answer per server and model is also read in full and compared with the library client's. CPU per
request is utime+stime of each process (the server with its threads and children, the front, the
workers) over the level, divided by the requests the pool counted in it. The ratios are to the first of
--servers (the sidecar by default). ``--null`` measures the minimal servers alone: each reads every body
and gives the model's first answer again, without parsing it or asking the pool (CPU per answer wrk got);
``--breakdown`` runs no server and measures the route's own work alone (parse, encode, AsyncClient.infer).
"""

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gateway_bench as gw  # noqa: E402  (it puts examples/ on the path for make_models)

SERVERS = ("sidecar", "sidecar-aiohttp", "sidecar-granian", "aiohttp", "granian", "granian-rust", "granian-mp",
           "uvicorn")
ENDPOINT_ENV = "GEPOOL_BENCH_ENDPOINT"  # granian-mp's worker process reads the pool's endpoint here
NULL_ENV = "GEPOOL_BENCH_NULL"  # and whether to answer from the cache (--null)
ROUTE = re.compile(r"/v2/models/([^/]+)/infer")
MAX_BODY = 64 << 20
REQUEST_TIMEOUT_S = 300.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
JSON_HEADERS = {"Content-Type": "application/json"}
# appended to gateway_bench's script: every answer is checked against its server's reference answer;
# one that differs is checked again for a KServe response's structure (batching may change the last bits)
CHECK_LUA = """
local function slurp(path)
  local g = assert(io.open(path, "rb"))
  local s = g:read("*a")
  g:close()
  return s
end
local ref = slurp("%s")
local prefix = slurp("%s")
local suffix = "]}]}"
local commas = %d
local threads = {}
function setup(thread)
  table.insert(threads, thread)
end
function init(args)
  bad, differ, first_bad = 0, 0, ""
end
function response(status, headers, body)
  if status == 200 and body == ref then
    return
  end
  local _, n = string.gsub(body, ",", ",")
  if status ~= 200 or body:sub(1, #prefix) ~= prefix or body:sub(-#suffix) ~= suffix or n ~= commas then
    bad = bad + 1
    if first_bad == "" then
      first_bad = status .. " " .. body:sub(1, 300)
    end
  else
    differ = differ + 1
  end
end
function done(summary, latency, requests)
  for _, t in ipairs(threads) do
    io.write(string.format("CHECK bad=%%d differ=%%d\\n", t:get("bad"), t:get("differ")))
    io.write("FIRST_BAD " .. t:get("first_bad") .. "\\n")
  end
end
"""


# -- the minimal infer route, the same for every server ----------------------------------------
class Infer:
    """The sidecar's infer work and nothing else: parse, AsyncClient.infer, encode."""

    def __init__(self, endpoint: str, null: bool = False) -> None:
        self.endpoint = endpoint
        self.client = None
        # --null: a model's first answer, given again to every later request without parsing or the pool
        self.cache: dict[str, tuple[int, bytes, dict]] | None = {} if null else None

    async def start(self) -> None:
        from gepool.aio import AsyncClient

        client = AsyncClient(self.endpoint, timeout=REQUEST_TIMEOUT_S)
        await client.start()
        self.client = client

    async def __call__(self, model: str, body: bytes, header_length: str | None) -> tuple[int, bytes, dict]:
        if self.cache is not None:
            if model not in self.cache:
                self.cache[model] = await self._infer(model, body, header_length)
            return self.cache[model]
        return await self._infer(model, body, header_length)

    async def _infer(self, model: str, body: bytes, header_length: str | None) -> tuple[int, bytes, dict]:
        from gepool.common import errors
        from gepool.http import kserve
        from gepool.http.limits import MAX_JSON_BYTES
        from gepool.ipc.protocol import Origin

        try:
            req = kserve.parse_request(body, header_length, None, MAX_JSON_BYTES, MAX_BODY)
            names = [[o.name, o.class_count] if o.class_count else o.name for o in req.outputs] \
                if req.outputs is not None else None
            outputs = await self.client.infer(model, req.inputs, names, priority=req.priority,
                                              timeout=req.timeout_s, origin=Origin.HTTP)
            served = getattr(outputs, "model_version", None)
            payload, headers = kserve.encode_response(model, str(served) if served is not None else "", req, outputs)
            return 200, payload, headers
        except errors.GepoolError as exc:
            return exc.http_status, json.dumps({"error": exc.message}).encode(), JSON_HEADERS


def _too_large(length: str | None) -> bool:
    return length is not None and (not length.isdecimal() or int(length) > MAX_BODY)


TOO_LARGE = (413, b'{"error":"request body too large"}', JSON_HEADERS)
NOT_FOUND = (404, b'{"error":"not found"}', JSON_HEADERS)


async def serve_aiohttp(infer: Infer, port: int, stop: asyncio.Event) -> None:
    from aiohttp import web

    from gepool.http.kserve import HEADER_LENGTH

    async def handle(request: web.Request) -> web.Response:
        if _too_large(request.headers.get("Content-Length")):
            status, payload, headers = TOO_LARGE
        else:
            body = await request.read()
            status, payload, headers = await infer(request.match_info["model"], body,
                                                   request.headers.get(HEADER_LENGTH))
        return web.Response(status=status, body=payload, headers=headers)

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v2/models/{model}/infer", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    yield_ready()
    await stop.wait()
    await runner.cleanup()


class RSGIApp:
    def __init__(self, infer: Infer) -> None:
        self.infer = infer

    async def __rsgi__(self, scope, proto) -> None:
        if scope.proto != "http":
            return
        m = ROUTE.fullmatch(scope.path)
        if m is None or scope.method != "POST":
            status, payload, headers = NOT_FOUND
        elif _too_large(scope.headers.get("content-length")):
            status, payload, headers = TOO_LARGE
        else:
            body = await proto()
            status, payload, headers = await self.infer(m.group(1), body,
                                                        scope.headers.get("inference-header-content-length"))
        proto.response_bytes(status, list(headers.items()), payload)


class LazyRSGIApp(RSGIApp):
    """RSGIApp for granian's own runner, whose loop exists only in its worker: connects on the first request."""

    def __init__(self) -> None:
        super().__init__(None)
        self._starting: asyncio.Future | None = None

    async def _start(self) -> None:
        infer = Infer(os.environ[ENDPOINT_ENV], os.environ.get(NULL_ENV) == "1")
        await infer.start()
        self.infer = infer

    async def __rsgi__(self, scope, proto) -> None:
        if self.infer is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._start())
            await asyncio.shield(self._starting)
        await super().__rsgi__(scope, proto)


mp_app = LazyRSGIApp()


async def serve_granian(infer: Infer, port: int, stop: asyncio.Event, task_impl: str) -> None:
    from granian.constants import HTTPModes, Interfaces, TaskImpl
    from granian.server.embed import Server

    server = Server(RSGIApp(infer), address="127.0.0.1", port=port, interface=Interfaces.RSGI, runtime_threads=1,
                    http=HTTPModes.http1, websockets=False, log_enabled=False, task_impl=TaskImpl(task_impl))
    serving = asyncio.get_running_loop().create_task(server.serve())
    await wait_listening(port)
    yield_ready()
    await stop.wait()
    server.stop()
    await serving


class ASGIApp:
    def __init__(self, infer: Infer) -> None:
        self.infer = infer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        m = ROUTE.fullmatch(scope["path"])
        head = dict(scope["headers"])
        if m is None or scope["method"] != "POST":
            status, payload, headers = NOT_FOUND
        elif _too_large(head.get(b"content-length", b"").decode() or None):
            status, payload, headers = TOO_LARGE
        else:
            chunks = []
            while True:
                message = await receive()
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            hl = head.get(b"inference-header-content-length")
            status, payload, headers = await self.infer(m.group(1), b"".join(chunks), hl.decode() if hl else None)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        await send({"type": "http.response.body", "body": payload})


async def serve_uvicorn(infer: Infer, port: int, stop: asyncio.Event) -> None:
    import uvicorn

    config = uvicorn.Config(ASGIApp(infer), host="127.0.0.1", port=port, loop="none", http="httptools",
                            ws="none", lifespan="off", access_log=False, log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.get_running_loop().create_task(server.serve())
    await wait_listening(port)
    yield_ready()
    await stop.wait()
    server.should_exit = True
    await serving


async def wait_listening(port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


_READY_FD: list[int] = []


def yield_ready() -> None:
    os.write(_READY_FD[0], b"ready\n")


async def serve(kind: str, endpoint: str, port: int, null: bool) -> None:
    infer = Infer(endpoint, null)
    await infer.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if kind == "aiohttp":
            await serve_aiohttp(infer, port, stop)
        elif kind == "granian":
            await serve_granian(infer, port, stop, "asyncio")
        elif kind == "granian-rust":
            await serve_granian(infer, port, stop, "rust")
        elif kind == "uvicorn":
            await serve_uvicorn(infer, port, stop)
        else:
            raise SystemExit(f"unknown server '{kind}'")
    finally:
        await infer.client.close()


def serve_main(kind: str, endpoint: str, port: int, ready_fd: int, null: bool) -> None:
    import uvloop

    _READY_FD.append(ready_fd)
    # not asyncio.run: at its end it walks every task, and granian's Rust tasks fail that walk
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve(kind, endpoint, port, null))
    finally:
        loop.close()


# -- the driver ------------------------------------------------------------------------------
class Server:
    """One server under test: its URL and the pids whose CPU is its own."""

    def __init__(self, kind: str, port: int, proc: subprocess.Popen | None, pids: list[int]) -> None:
        self.kind, self.port, self.proc, self.pids = kind, port, proc, pids  # pids[0]: the server itself
        self.url = f"http://127.0.0.1:{port}"

    def cpu(self) -> float:
        return sum(gw.cpu_seconds(p) for p in self.pids)

    def threads(self) -> dict[str, float]:
        """CPU seconds by thread name (the Python loop's thread is the process's own name)."""
        out: dict[str, float] = {}
        for pid in self.pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        head, _, rest = f.read().rpartition(")")
                except OSError:
                    continue
                fields = rest.split()
                name = "main" if tid == str(pid) else head.partition("(")[2]
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / gw.TICK
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:  # the server, not py-spy around it: py-spy writes its profile when its child has exited
            os.kill(self.pids[0], signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_granian_mp(endpoint: str, profile: str | None, null: bool) -> Server:
    port = gw.free_port()
    cmd = [sys.executable, "-m", "granian", "--interface", "rsgi", "--workers", "1", "--runtime-mode", "st",
           "--runtime-threads", "1", "--loop", "uvloop", "--http", "1", "--no-ws", "--log-level", "warning",
           "--host", "127.0.0.1", "--port", str(port), "--working-dir", HERE, "http_servers:mp_app"]
    if profile:
        cmd = ["py-spy", "record", "--subprocesses", "-r", "100", "-f", "raw" if profile.endswith(".txt")
               else "flamegraph", "-o", profile, "--", *cmd]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env={**os.environ, ENDPOINT_ENV: endpoint,
                                                                      NULL_ENV: "1" if null else "0"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:  # listening, and the worker started (it connects to the pool on its first request)
        kids = gw.descendants(proc.pid)
        if len(kids) >= (2 if profile else 1):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    break
            except OSError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SystemExit(f"granian's runner did not start (exit code {proc.poll()})")
        time.sleep(0.1)
    pids = gw.descendants(proc.pid) if profile else [proc.pid, *gw.descendants(proc.pid)]
    return Server("granian-mp", port, proc, pids)


def start_server(kind: str, endpoint: str, profile: str | None = None, null: bool = False) -> Server:
    if kind == "granian-mp":
        return start_granian_mp(endpoint, profile, null)
    port = gw.free_port()
    read_fd, write_fd = os.pipe()
    if kind.startswith("sidecar-"):  # the real sidecar on the server its name ends with, as a pool would start it
        cmd = [sys.executable, "-m", "gepool.http.server", "--endpoint", endpoint, "--http-port", str(port),
               "--metrics-port", "0", "--http-max-body-bytes", str(MAX_BODY), "--front-ready",
               "--http-server", kind.removeprefix("sidecar-"), "--ready-fd", str(write_fd)]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", kind, "--endpoint", endpoint, "--port",
               str(port), "--ready-fd", str(write_fd)] + (["--null"] if null else [])
    if profile:
        fmt = "raw" if profile.endswith(".txt") else "flamegraph"  # raw: collapsed stacks, one a line
        cmd = ["py-spy", "record", "-r", "100", "-f", fmt, "-o", profile, "--", *cmd]
    proc = subprocess.Popen(cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
    os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        if reader.readline().strip() != "ready":
            proc.kill()
            proc.wait()
            raise SystemExit(f"the {kind} server did not start (exit code {proc.poll()})")
    pids = [proc.pid, *gw.descendants(proc.pid)]
    if profile:  # py-spy's own CPU is not the server's
        pids = gw.descendants(proc.pid)
    return Server(kind, port, proc, pids)


def reference(server: Server, client, model: str) -> tuple[bytes, list[str]]:
    """One answer read in full: its bytes, and what is wrong with it against the library client's answer."""
    body = gw.json_body(model)
    request = urllib.request.Request(f"{server.url}/v2/models/{model}/infer", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        return exc.read(), [f"HTTP {exc.code}"]
    problems = []
    answer = json.loads(raw)
    name, width = gw.SHAPES[model]
    x = np.array(json.loads(body)["inputs"][0]["data"], dtype=np.float32).reshape(1, width)
    expected = client.infer(model, {name: x})
    if answer.get("model_name") != model:
        problems.append(f"model_name {answer.get('model_name')!r}")
    got = {o["name"]: o for o in answer.get("outputs", [])}
    if set(got) != set(expected):
        problems.append(f"outputs {sorted(got)} instead of {sorted(expected)}")
    for out, arr in expected.items():
        o = got.get(out)
        if o is None:
            continue
        if o.get("datatype") != "FP32" or o.get("shape") != list(arr.shape):
            problems.append(f"{out}: {o.get('datatype')} {o.get('shape')} instead of FP32 {list(arr.shape)}")
        elif not np.allclose(np.array(o["data"], dtype=np.float32).reshape(arr.shape), arr, rtol=1e-5, atol=1e-6):
            problems.append(f"{out}: data differs from the library client's")
    return raw, problems


def run_wrk(server: Server, model: str, conc: int, seconds: float, workdir: str, ref: bytes) -> dict:
    body = os.path.join(workdir, f"{model}.json")
    with open(body, "wb") as f:
        f.write(gw.json_body(model))
    ref_path = os.path.join(workdir, f"{server.kind}-{model}.ref")
    with open(ref_path, "wb") as f:
        f.write(ref)
    prefix_path = os.path.join(workdir, f"{server.kind}-{model}.prefix")
    with open(prefix_path, "wb") as f:
        f.write(ref[:ref.index(b'"data":[') + len(b'"data":[')])
    script = os.path.join(workdir, f"{server.kind}-{model}.lua")
    with open(script, "w") as f:
        f.write(gw.WRK_SCRIPT % body + CHECK_LUA % (ref_path, prefix_path, ref.count(b",")))
    proc = subprocess.run(["wrk", "-t1", f"-c{conc}", f"-d{max(1, round(seconds))}s", "--latency", "-s", script,
                           f"{server.url}/v2/models/{model}/infer"], capture_output=True, text=True)
    text = proc.stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)] if m else float("nan")

    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    sent = re.search(r"^\s*(\d+) requests in", text, re.M)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    check = re.search(r"CHECK bad=(\d+) differ=(\d+)", text)
    first_bad = re.search(r"^FIRST_BAD (.*)$", text, re.M)
    errors = (int(check.group(1)) if check else 0) + (sum(map(int, sock.groups())) if sock else 0)
    return {"rps": float(rps.group(1)) if rps else float("nan"), "p50_ms": ms("50"), "p99_ms": ms("99"),
            "answered": int(sent.group(1)) if sent else 0, "errors": errors,
            "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "differ": int(check.group(2)) if check else -1,
            "first_bad": first_bad.group(1).strip() if first_bad else "",
            "raw": "" if rps and check else text + proc.stderr}


def measure(server: Server, pool_procs: dict[str, int], client, model: str, conc: int, seconds: float,
            workdir: str, ref: bytes, null: bool) -> dict:
    from gepool.bench.results import server_window

    before_stats = client.stats()[model]
    before = {label: gw.cpu_seconds(pid) for label, pid in pool_procs.items()}
    before_server, before_threads = server.cpu(), server.threads()
    result = run_wrk(server, model, conc, seconds, workdir, ref)
    after_server, after_threads = server.cpu(), server.threads()
    after = {label: gw.cpu_seconds(pid) for label, pid in pool_procs.items()}
    window = server_window(before_stats, client.stats()[model])
    n = max(result["answered"] if null else window["requests"], 1)  # --null: the pool saw none of them
    result["requests"], result["avg_batch"] = window["requests"], window["avg_batch_size"]
    workers = sum(after[k] - before[k] for k in pool_procs if k.startswith("worker"))
    result["cpu_us"] = {"server": (after_server - before_server) / n * 1e6,
                        "front": (after["front"] - before["front"]) / n * 1e6, "worker": workers / n * 1e6}
    result["threads_us"] = {k: (v - before_threads.get(k, 0.0)) / n * 1e6 for k, v in after_threads.items()
                            if v - before_threads.get(k, 0.0) > 0}
    return result


async def _client_floor(endpoint: str, model: str, inputs: dict, conc: int, seconds: float) -> tuple[int, float]:
    """Requests done and this thread's CPU seconds: ``conc`` tasks calling AsyncClient.infer for ``seconds``."""
    from gepool.ipc.protocol import Origin

    infer = Infer(endpoint)
    await infer.start()
    done, stop_at = 0, time.monotonic() + seconds

    async def one() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await infer.client.infer(model, inputs, origin=Origin.HTTP)
            done += 1

    start = time.thread_time()
    await asyncio.gather(*(one() for _ in range(conc)))
    cpu = time.thread_time() - start
    await infer.client.close()
    return done, cpu


def _per_call(seconds: float, fn, *args) -> float:
    """This thread's CPU microseconds per call of fn(*args), over at most a second."""
    n, start, stop_at = 0, time.thread_time(), time.monotonic() + min(seconds, 1.0)
    while time.monotonic() < stop_at:
        for _ in range(50):
            fn(*args)
        n += 50
    return (time.thread_time() - start) / n * 1e6


def breakdown(pool, models: list[str], levels: list[int], seconds: float) -> None:
    """The infer route's own work outside any HTTP server: kserve.parse_request and encode_response on one
    row's body (this thread's CPU per call), and AsyncClient.infer alone on uvloop at each level."""
    import uvloop

    from gepool.http import kserve
    from gepool.http.limits import MAX_JSON_BYTES

    client = pool.client()
    for model in models:
        body = gw.json_body(model)
        req = kserve.parse_request(body, None, None, MAX_JSON_BYTES, MAX_BODY)
        outputs = client.infer(model, req.inputs)
        figures = {"parse": _per_call(seconds, kserve.parse_request, body, None, None, MAX_JSON_BYTES, MAX_BODY),
                   "load": _per_call(seconds, kserve.load_header, body),
                   "encode": _per_call(seconds, kserve.encode_response, model, "1", req, outputs)}
        print(f"{model:5s} kserve.parse_request {figures['parse']:6.1f} us  encode_response {figures['encode']:6.1f} us"
              f"  (body {len(body)} bytes, answer {len(kserve.encode_response(model, '1', req, outputs)[0])} bytes)")
        print(f"{model:5s}   of the parse: load_header (orjson) {figures['load']:6.1f} us, the tensors and the rest "
              f"{figures['parse'] - figures['load']:6.1f} us")
        for conc in levels:
            loop = uvloop.new_event_loop()
            try:
                done, cpu = loop.run_until_complete(_client_floor(pool.endpoint, model, req.inputs, conc, seconds))
            finally:
                loop.close()
            print(f"{model:5s} AsyncClient.infer alone c={conc:<3d} {done / seconds:7.0f} req/s "
                  f"{cpu / max(done, 1) * 1e6:6.1f} us of the loop thread's CPU per request", flush=True)


def summarise(rows: list[tuple], servers: list[str]) -> None:
    print()
    print(f"{'model':5s} {'conc':>4s} {'server':12s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'batch':>5s} "
          f"{'server us':>9s} {'front us':>8s} {'worker us':>9s} {'x server':>8s} {'x front':>7s} {'x worker':>8s} "
          f"{'x req/s':>7s} {'errors':>6s}")
    cells = {}
    for model, conc, kind, r in rows:
        cells.setdefault((model, conc, kind), []).append(r)

    def med(rs: list[dict], key) -> float:
        return statistics.median(key(r) for r in rs)

    for model, conc in dict.fromkeys((m, c) for m, c, _ in cells):
        base = cells.get((model, conc, servers[0]))
        for kind in servers:
            rs = cells.get((model, conc, kind))
            if not rs:
                continue
            fig = {"rps": med(rs, lambda r: r["rps"]), "p50": med(rs, lambda r: r["p50_ms"]),
                   "p99": med(rs, lambda r: r["p99_ms"]), "batch": med(rs, lambda r: r["avg_batch"]),
                   **{k: med(rs, lambda r, k=k: r["cpu_us"][k]) for k in ("server", "front", "worker")}}
            ratio = {}
            for k in ("server", "front", "worker"):
                b = med(base, lambda r, k=k: r["cpu_us"][k]) if base else float("nan")
                ratio[k] = fig[k] / b if b else float("nan")
            ratio["rps"] = fig["rps"] / med(base, lambda r: r["rps"]) if base else float("nan")
            errors = sum(r["errors"] + r["non2xx"] for r in rs)
            print(f"{model:5s} {conc:4d} {kind:12s} {fig['rps']:7.0f} {fig['p50']:7.2f} {fig['p99']:7.2f} "
                  f"{fig['batch']:5.1f} {fig['server']:9.0f} {fig['front']:8.0f} {fig['worker']:9.0f} "
                  f"{ratio['server']:8.2f} {ratio['front']:7.2f} {ratio['worker']:8.2f} {ratio['rps']:7.2f} "
                  f"{errors:6d}")
    print(f"(medians over rounds; CPU us per request: utime+stime over the level / requests the pool counted; "
          f"x: ratio to {servers[0]}; {time.strftime('%F %T')})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="per level, server and round")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the servers, alternating")
    parser.add_argument("--levels", default="8,64", help="wrk connections")
    parser.add_argument("--models", default="tiny,mlp")
    parser.add_argument("--servers", default="sidecar,aiohttp,granian,uvicorn", help=f"of {','.join(SERVERS)}")
    parser.add_argument("--profile", metavar="SERVER:FILE",
                        help="run that server under py-spy (Python frames, 100 Hz): a flame graph (FILE.svg) or "
                             "collapsed stacks (FILE.txt) written when it stops; its figures then pay for the sampling")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead: CPU per call of parse_request, encode_response and AsyncClient.infer alone")
    parser.add_argument("--null", action="store_true",
                        help="the minimal servers read each body and give the model's first answer again, without "
                             "parsing it or asking the pool: what the HTTP server alone costs (no sidecar)")
    parser.add_argument("--serve", choices=[k for k in SERVERS if not k.startswith("sidecar") and k != "granian-mp"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_main(args.serve, args.endpoint, args.port, args.ready_fd, args.null)
        return
    servers = args.servers.split(",")
    if args.null and any(s.startswith("sidecar") for s in servers):
        parser.error("--null runs only the minimal servers: leave the sidecars out of --servers")
    unknown = [s for s in servers if s not in SERVERS]
    if unknown:
        parser.error(f"unknown --servers {unknown}: choose from {','.join(SERVERS)}")
    needs = {"sidecar-granian": ("granian",),
             "aiohttp": ("aiohttp", "uvloop"), "granian": ("granian", "uvloop"), "granian-rust": ("granian", "uvloop"),
             "granian-mp": ("granian", "uvloop"), "uvicorn": ("uvicorn", "httptools", "uvloop")}
    missing = sorted({m for k in servers for m in needs.get(k, ()) if importlib.util.find_spec(m) is None})
    if missing:
        parser.error(f"--servers {args.servers} needs {', '.join(missing)} (pip install {' '.join(missing)}) "
                     f"or leave out the servers that need them")
    profiled, _, profile_file = (args.profile or "").partition(":")
    if args.profile and (profiled not in servers or profiled == "sidecar" or not profile_file):
        parser.error("--profile takes SERVER:FILE.svg, SERVER one of --servers other than the sidecar")
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed")
    levels = [int(c) for c in args.levels.split(",")]
    models = args.models.split(",")

    from gepool import Pool

    repo = gw.make_repo()
    workdir = tempfile.mkdtemp(prefix="gepool-httpservers-")
    started: list[Server] = []
    rows = []
    try:
        if args.breakdown:
            with Pool(repo, metrics_port=0) as pool:
                breakdown(pool, models, levels, args.seconds)
            return
        with Pool(repo, http_port=gw.free_port() if "sidecar" in servers else 0, metrics_port=0) as pool:
            client = pool.client()
            pool_procs = gw.processes(pool.process.pid, None)
            by_kind = {}
            for kind in servers:
                if kind == "sidecar":
                    sidecar_pid = pool_procs.pop("sidecar")
                    pids = [sidecar_pid, *(pool_procs.pop(k) for k in list(pool_procs) if k.startswith("sidecar"))]
                    by_kind[kind] = Server(kind, pool.http_port, None, pids)
                else:
                    s = start_server(kind, pool.endpoint, os.path.abspath(profile_file) if kind == profiled else None,
                                     args.null)
                    started.append(s)
                    by_kind[kind] = s
            print("processes:", " ".join(f"{k}={v}" for k, v in pool_procs.items()),
                  " ".join(f"{s.kind}={','.join(map(str, s.pids))}" for s in by_kind.values()), flush=True)
            refs = {}
            for kind, s in by_kind.items():
                for model in models:
                    raw, problems = reference(s, client, model)
                    refs[kind, model] = raw
                    if problems:
                        raise SystemExit(f"{kind} answers {model} wrongly: {'; '.join(problems)}: {raw[:300]!r}")
                    run_wrk(s, model, 8, 1.0, workdir, raw)  # warm-up
            for rnd in range(args.rounds):
                order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
                for model in models:
                    for conc in levels:
                        for kind in order:
                            s = by_kind[kind]
                            r = measure(s, pool_procs, client, model, conc, args.seconds, workdir, refs[kind, model],
                                        args.null)
                            rows.append((model, conc, kind, r))
                            cpu = " ".join(f"{k} {v:.0f}" for k, v in r["cpu_us"].items())
                            print(f"round {rnd} {model:5s} c={conc:<3d} {kind:12s} {r['rps']:7.0f} req/s "
                                  f"p50 {r['p50_ms']:6.2f} p99 {r['p99_ms']:6.2f} ms batch {r['avg_batch']:4.1f} "
                                  f"errors {r['errors']} non-2xx {r['non2xx']} not-identical {r['differ']}  "
                                  f"CPU us/req: {cpu}", flush=True)
                            print("  server CPU us/req by thread:",
                                  " ".join(f"{k} {v:.0f}" for k, v in sorted(r["threads_us"].items())))
                            if r["first_bad"]:
                                print("  first bad answer:", r["first_bad"])
                            if r["raw"]:
                                print(r["raw"])
    finally:
        for s in started:
            s.stop()
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    summarise(rows, servers)


if __name__ == "__main__":
    main()
