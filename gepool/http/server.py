"""The HTTP sidecar process: Triton's KServe v2 REST API and /metrics, as an asyncio client of the front.

aiohttp was measured against uvicorn+httptools on this 2-core host (wrk, 8 connections, a small JSON
POST answered in place): 23k vs 29k requests/s. Both are 10x what the pool itself serves, so the
HTTP layer is not the bottleneck either way; aiohttp is one well-kept dependency with its own
routing, where the other needs three. It runs in its own process so the front's loop stays a
plain zmq poll, and so that a slow HTTP client can never stall batching.

    python -m gepool.http.server --endpoint E [--http-host H] [--http-port P] [--metrics-port M] [--ready-fd FD]
"""

import argparse
import asyncio
import json
import logging
import os
import sys

from aiohttp import web

import gepool
from gepool.aio import AsyncClient
from gepool.common import errors
from gepool.http import kserve, metrics
from gepool.http.shm import Regions

log = logging.getLogger("gepool.http")
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "system_shared_memory",
              "model_repository", "parameters"]
PARENT_CHECK_S = 1.0
REQUEST_TIMEOUT_S = 300.0


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Gateway:
    def __init__(self, endpoint: str, curve_key: str | None = None, strict_readiness: bool = True) -> None:
        self.endpoint, self.curve_key, self.strict_readiness = endpoint, curve_key, strict_readiness
        self.client: AsyncClient | None = None
        self.connected = asyncio.Event()
        self.regions = Regions()

    async def connect(self) -> None:
        """Keeps trying: the gateway listens before the front is ready, and outlives nothing it needs."""
        while True:
            client = AsyncClient(self.endpoint, timeout=REQUEST_TIMEOUT_S, curve_server_key=self.curve_key,
                                 curve_client_key=self.curve_key)  # the pool's own key pair, always admitted
            try:
                await client.start(connect_timeout=2.0)
            except errors.PoolUnavailable:
                continue  # start() closed it
            self.client = client
            self.connected.set()
            return

    async def front(self) -> AsyncClient:
        await self.connected.wait()
        return self.client

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def route(handler):
        async def wrapped(self, request: web.Request) -> web.Response:
            try:
                return await handler(self, request)
            except errors.GepoolError as exc:
                return _error(exc.http_status, exc.message)
            except Exception as exc:  # the traceback stays here; the client hears a 500
                log.exception("internal error on %s %s", request.method, request.path)
                return _error(500, f"internal error: {exc}")
        return wrapped

    async def _json_body(self, request: web.Request) -> dict:
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise errors.InvalidArgument(f"failed to parse the request JSON: {exc}") from None
        if not isinstance(body, dict):
            raise errors.InvalidArgument("the request body must be a JSON object")
        return body

    async def _model_meta(self, request: web.Request) -> dict:
        meta = await (await self.front()).model_metadata(request.match_info["model"])
        version = request.match_info.get("version")
        if version is not None and version not in meta.get("versions", []):
            raise errors.ModelNotFound(f"Request for unknown model: '{meta['name']}' version {version} is not found")
        return meta

    # -- health and metadata ---------------------------------------------------------------
    @route
    async def live(self, request):
        return web.Response(status=200)

    @route
    async def ready(self, request):
        if not self.connected.is_set():
            return web.Response(status=400)
        status = await self.client.status()
        ok = not status["stopping"] and (not self.strict_readiness
                                         or all(m["state"] == "READY" for m in status["models"].values()))
        return web.Response(status=200 if ok else 400)

    @route
    async def server_metadata(self, request):
        return web.json_response({"name": "gepool", "version": gepool.__version__, "extensions": EXTENSIONS})

    @route
    async def model_metadata(self, request):
        meta = await self._model_meta(request)
        return web.json_response({k: meta[k] for k in ("name", "versions", "platform", "inputs", "outputs")
                                  if k in meta})

    @route
    async def model_ready(self, request):
        try:
            meta = await self._model_meta(request)
        except errors.ModelNotFound as exc:
            return _error(400, exc.message)
        if meta["state"] != "READY":
            return _error(400, "Model version not ready")
        return web.Response(status=200)

    @route
    async def model_config(self, request):
        await self._model_meta(request)
        return web.json_response(await (await self.front()).query("config", {"model": request.match_info["model"]}))

    @route
    async def model_stats(self, request):
        client = await self.front()
        stats, status = await client.stats(), await client.status()
        wanted = request.match_info.get("model")
        if wanted is not None and wanted not in stats:
            raise errors.ModelNotFound(f"Request for unknown model: '{wanted}' is not found")
        out = []
        for name, s in stats.items():
            if wanted is not None and name != wanted:
                continue
            version = str(status["models"][name].get("version") or "")
            ns = 1_000_000_000
            sizes, compute = s["batch_sizes"], s["batch_compute_s"]
            out.append({
                "name": name, "version": version, "last_inference": int(s["last_inference"] * 1000),
                "inference_count": s["rows"], "execution_count": s["batches"],
                "inference_stats": {
                    "success": {"count": s["requests"], "ns": s["request_us"] * 1000},
                    "fail": {"count": s["failures"], "ns": 0},
                    "queue": {"count": s["histograms"]["queue"]["count"], "ns": s["queue_us"] * 1000},
                    "compute_input": {"count": s["batches"], "ns": 0},
                    "compute_infer": {"count": s["batches"], "ns": s["compute_us"] * 1000},
                    "compute_output": {"count": s["batches"], "ns": 0},
                    "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0}},
                "response_stats": {},
                "batch_stats": [{"batch_size": int(size), "compute_input": {"count": n, "ns": 0},
                                 "compute_infer": {"count": n, "ns": int(compute.get(size, 0) * ns)},
                                 "compute_output": {"count": n, "ns": 0}} for size, n in sizes.items()],
                "memory_usage": [],
            })
        return web.json_response({"model_stats": out})

    # -- inference -------------------------------------------------------------------------
    @route
    async def infer(self, request):
        model = request.match_info["model"]
        version = request.match_info.get("version")
        body = await request.read()
        held = []

        def region_bytes(name, offset, size):
            region = self.regions.acquire(name)
            held.append(region)
            return self.regions.read(region, offset, size)

        def write_region(name, offset, size, data):
            region = self.regions.acquire(name)
            held.append(region)
            self.regions.write(region, offset, size, data)

        try:
            req = kserve.parse_request(body, request.headers.get(kserve.HEADER_LENGTH), region_bytes)
            for o in req.outputs or []:
                if o.region is not None:  # an unknown region fails before the model runs
                    self.regions.release(self.regions.acquire(o.region))
            names = [o.name for o in req.outputs] if req.outputs is not None else None
            outputs = await (await self.front()).infer(model, req.inputs, names,
                                                       version=int(version) if version else None)
            # the version that ran it, from the reply itself (asking the front for metadata cost every
            # unversioned request a second round trip)
            served = getattr(outputs, "model_version", None)
            payload, headers = kserve.encode_response(model, str(served) if served is not None else (version or ""),
                                                      req, outputs, write_region)
        finally:
            for region in held:
                self.regions.release(region)
        return web.Response(body=payload, headers=headers)

    # -- repository ------------------------------------------------------------------------
    @route
    async def repository_index(self, request):
        body = await self._json_body(request)
        status = await (await self.front()).status()
        rows = [{"name": n, "version": str(m["version"] or ""), "state": m["state"], "reason": m["reason"]}
                for n, m in sorted(status["models"].items())]
        if body.get("ready"):
            rows = [r for r in rows if r["state"] == "READY"]
        return web.json_response(rows)

    @route
    async def repository_control(self, request):
        body = await self._json_body(request)
        if (body.get("parameters") or {}).get("config") or any(k.startswith("file:") for k in
                                                                 (body.get("parameters") or {})):
            raise errors.InvalidArgument("load with a 'config' or 'file:' override is not supported; change the "
                                         "repository and load again")
        client = await self.front()
        model = request.match_info["model"]
        if request.match_info["action"] == "load":
            await client.load(model)
        else:
            await client.unload(model)
        return web.Response(status=200)

    # -- shared memory ---------------------------------------------------------------------
    @route
    async def shm_status(self, request):
        return web.json_response(self.regions.status(request.match_info.get("region")))

    @route
    async def shm_register(self, request):
        body = await self._json_body(request)
        self.regions.register(request.match_info["region"], body.get("key"), body.get("offset", 0),
                              body.get("byte_size"))
        return web.Response(status=200)

    @route
    async def shm_unregister(self, request):
        self.regions.unregister(request.match_info.get("region"))
        return web.Response(status=200)

    @route
    async def cuda_shm(self, request):
        action = request.path.rsplit("/", 1)[-1]
        if action == "status":
            return web.json_response([])
        if action == "register":
            return _error(400, "CUDA shared memory is not supported by gepool (no CUDA device)")
        return web.Response(status=200)

    # -- metrics ---------------------------------------------------------------------------
    @route
    async def metrics(self, request):
        client = await self.front()
        text = metrics.render(await client.status(), await client.stats())
        return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def http_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    r = app.router
    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version}"
    r.add_get("/v2/health/live", gw.live)
    r.add_get("/v2/health/ready", gw.ready)
    r.add_get("/v2", gw.server_metadata)
    r.add_get("/v2/models/stats", gw.model_stats)
    for base in (m, mv):
        r.add_get(base, gw.model_metadata)
        r.add_get(base + "/ready", gw.model_ready)
        r.add_get(base + "/config", gw.model_config)
        r.add_get(base + "/stats", gw.model_stats)
        r.add_post(base + "/infer", gw.infer)
    for repo in ("/v2/repository", "/v2/repository/{repo}"):
        r.add_post(repo + "/index", gw.repository_index)
        r.add_post(repo + "/models/{model}/{action:load|unload}", gw.repository_control)
    r.add_get("/v2/systemsharedmemory/status", gw.shm_status)
    r.add_get("/v2/systemsharedmemory/region/{region}/status", gw.shm_status)
    r.add_post("/v2/systemsharedmemory/region/{region}/register", gw.shm_register)
    r.add_post("/v2/systemsharedmemory/unregister", gw.shm_unregister)
    r.add_post("/v2/systemsharedmemory/region/{region}/unregister", gw.shm_unregister)
    for path in ("/v2/cudasharedmemory/status", "/v2/cudasharedmemory/region/{region}/status"):
        r.add_get(path, gw.cuda_shm)
    for path in ("/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/{region}/unregister",
                 "/v2/cudasharedmemory/region/{region}/register"):
        r.add_post(path, gw.cuda_shm)
    return app


async def serve(endpoint: str, host: str, http_port: int, metrics_port: int, ready_fd: int | None,
                curve_key: str | None = None, strict_readiness: bool = True) -> None:
    gw = Gateway(endpoint, curve_key, strict_readiness)
    connecting = asyncio.get_running_loop().create_task(gw.connect())
    runners = []
    for port, app in ((http_port, http_app(gw)), (metrics_port, None)):
        if not port:
            continue
        if app is None:
            app = web.Application()
            app.router.add_get("/metrics", gw.metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        runners.append(runner)
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")  # left open: a later failure written there finds no reader, not a reused fd
    parent = os.getppid()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), PARENT_CHECK_S)
        except TimeoutError:
            if os.getppid() != parent:
                log.warning("the pool that started this gateway is gone; exiting")
                break
    for runner in runners:
        await runner.cleanup()
    connecting.cancel()
    if gw.client is not None:
        await gw.client.close()
    gw.regions.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gepool-http")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--curve-key", help="the pool's CURVE certificate, when its endpoint uses CURVE")
    p.add_argument("--strict-readiness", choices=["true", "false"], default="true",
                   help="false: /v2/health/ready is ready while the pool answers, whatever its models' states")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s http %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.endpoint, args.http_host, args.http_port, args.metrics_port, args.ready_fd,
                      args.curve_key, args.strict_readiness == "true"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
