"""The HTTP sidecar process: Triton's KServe v2 REST API and /metrics, as an asyncio client of the front.

It runs in its own process so the front's loop stays a plain zmq poll, and so that a slow HTTP client
can never stall batching. The KServe port is served by ``native.py`` (httptools' C parser on a bare
asyncio protocol, the default), by aiohttp, or by granian through ``rsgi.py``: the same handlers, which
are written against aiohttp's request and response; /metrics is always aiohttp's.

    python -m gepool.http.server --endpoint E [--http-host H] [--http-port P] [--metrics-port M] [--ready-fd FD]
        [--grpc-host H] [--metrics-host H]
        [--http-max-body-bytes N] [--http-restricted-api API[,API]:KEY=VALUE ...]
        [--grpc-restricted-protocol API[,API]:KEY=VALUE ...]
        [--http-server httptools|aiohttp|granian] [--grpc-server native|grpcio]

What one request may cost is bounded in ``limits.py``; who may call what, in ``access.py`` and ``peer.py``.
"""

import argparse
import asyncio
import logging
import mmap
import os
import socket
import sys
from collections.abc import Coroutine
from typing import NoReturn

from aiohttp import web

import gepool
from gepool.aio import AsyncClient
from gepool.clientcore import ANSWER_GRACE_S
from gepool.common import errors, gc_policy, request_parameters
from gepool.common.logsettings import FORMATS, LogSettings, printable
from gepool.common.request_parameters import MAX_KEY_SHOWN, model_version
from gepool.http import host, kserve, limits, listen, metrics, peer, rsgi, servers, trace
from gepool.http.access import Restrictions
from gepool.http.host import CpuUtilization
from gepool.http.limits import (
    BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    INLINE_PARSE_BYTES,
    MAX_JSON_BYTES,
    BodyLimit,
    BodyTimeout,
    BodyTooLarge,
)
from gepool.http.offload import JSONOffload
from gepool.http.shm import Regions
from gepool.http.statistics import model_statistics
from gepool.http.templates import Templates
from gepool.ipc.protocol import ModelState, Origin
from gepool.scheduler.regions import TOKEN_ENV, version_page

log = logging.getLogger("gepool.http")
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "system_shared_memory",
              "model_repository", "parameters", "logging", "trace"]
PARENT_CHECK_S = 1.0
LOG_FOLLOW_S = 1.0  # how often a sidecar reads the front's log settings again
CONNECT_RETRY_S = 0.5  # a client fails at once where no pool listens: wait before trying again
REQUEST_TIMEOUT_S = 300.0
FRONT_READY_WAIT_S = 30.0  # a pool's own sidecar starts after its front is ready: the first connect is near


def answer_wait(timeout_s: float | None) -> float:
    """How long the gateway waits for an answer: a request's timeout is the queue's alone, as Triton's is, so a
    batch still running when it passes is waited for; the pool answers a timeout that ran out in the queue."""
    return REQUEST_TIMEOUT_S if timeout_s is None else max(REQUEST_TIMEOUT_S, timeout_s + ANSWER_GRACE_S)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


_SHM_KEY = b"shared_memory_region"
_SHM_RARE = _SHM_KEY.index(b"_")  # where it holds a byte that no number does


def _mentions_shm(body: bytes, end: int) -> bool:
    """Whether the first ``end`` bytes of a body (its JSON) name a shared-memory region anywhere: such a body
    is parsed with the regions at hand."""
    return kserve.holds(body, _SHM_KEY, _SHM_RARE, end)


class _Declined(Exception):
    """The fast path met what it leaves to the handler (an input in shared memory spelled with escapes)."""


def _no_regions(name, offset, size, limit) -> bytes:
    raise _Declined(name)


def _logged(request) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("HTTP request: %s %s", request.method, printable(request.path))


def _names(req: kserve.InferRequest) -> list | None:
    """The outputs asked for; one asked for as classes travels as [name, class_count] (the front's
    classification)."""
    return [[o.name, o.class_count] if o.class_count else o.name for o in req.outputs] \
        if req.outputs is not None else None


def _failure(request, exc: BaseException) -> web.Response:
    """What the route answers for an exception its handler raised: a GepoolError's status and message, else
    500 (the traceback stays in the log; the client hears no Python)."""
    if isinstance(exc, errors.GepoolError):
        return _error(exc.http_status, exc.message)
    log.error("internal error on %s %s", request.method, request.path, exc_info=exc)
    return _error(500, errors.INTERNAL_MESSAGE)


async def _ask(client: AsyncClient, model: str, version: int | None, req: kserve.InferRequest,
               names: list | None) -> dict:
    return await client.infer(model, req.inputs, names, version=version, priority=req.priority, timeout=req.timeout_s,
                              origin=Origin.HTTP, wait=answer_wait(req.timeout_s))


async def _raise(exc: BaseException) -> NoReturn:
    try:
        raise exc
    finally:
        exc = None  # no cycle through this frame (see Gateway._unparsed)


class Gateway:
    def __init__(self, endpoint: str, curve_key: str | None = None, restrictions: Restrictions | None = None,
                 max_body: int = DEFAULT_MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT_S,
                 strict_readiness: bool = True, front_ready: bool = False,
                 regions: tuple[str, mmap.mmap] | None = None, body_limit_follows: bool = False) -> None:
        """``regions``: the token and version page of the front's shared-memory record (a sidecar the pool
        started); None: this process keeps its own. ``body_limit_follows``: the body limit is at least the
        largest slot of any model the front holds now (read off that page), plus headroom."""
        self.endpoint, self.curve_key, self.strict_readiness = endpoint, curve_key, strict_readiness
        self.client: AsyncClient | None = None
        self.connected = asyncio.Event()
        if regions is None:
            self.regions = Regions()
        else:
            token, page = regions

            async def book(args: dict) -> dict:
                return await (await self.front()).query("regions", {**args, "token": token})

            self.regions = Regions(book, page)
        self.restrictions = restrictions or Restrictions()
        self.server_name = "gepool"  # its name in the server metadata (Triton's --id)
        self.log_settings: LogSettings | None = None  # the front's, as last read
        self.cpu_metrics = True  # Triton's nv_cpu_* gauges in /metrics
        self.body_limit = BodyLimit(max_body, regions[1] if regions is not None and body_limit_follows else None)
        self.body_timeout = body_timeout
        self.owner_uid = os.geteuid()
        self.offload = JSONOffload()
        self._answering: set[asyncio.Task] = set()  # infer_now's tasks
        self.templates = Templates()  # infer_now's bodies, by their shape
        self.cpu = CpuUtilization()
        self.front_ready = front_ready

    @property
    def max_body(self) -> int:
        return self.body_limit()

    async def connect(self) -> None:
        """Keeps trying: the gateway listens before the front is ready, and outlives nothing it needs."""
        while True:
            client = AsyncClient(self.endpoint, timeout=REQUEST_TIMEOUT_S, curve_server_key=self.curve_key,
                                 curve_client_key=self.curve_key)  # the pool's own key pair, always admitted
            try:
                await client.start(connect_timeout=2.0)
            except errors.PoolUnavailable:  # start() closed it
                await asyncio.sleep(CONNECT_RETRY_S)
                continue
            self.client = client
            await self._adopt_log_settings()
            self.connected.set()
            return

    async def _adopt_log_settings(self, quiet: bool = False) -> None:
        """Logs as the front does: its settings may have changed since this sidecar was started, or since
        it last asked (through another sidecar: ``_follow_log_settings`` asks again every LOG_FOLLOW_S)."""
        try:
            settings = LogSettings.from_wire(await self.client.query("logging", {}))
        except errors.GepoolError as exc:
            (log.debug if quiet else log.warning)("could not read the pool's log settings: %s", exc)
            return
        self._use(settings)

    def _use(self, settings: LogSettings) -> None:
        """Logs as ``settings`` say (the front's), unless this sidecar already does."""
        if settings != self.log_settings:
            settings.apply()
            self.log_settings = settings

    async def front(self) -> AsyncClient:
        await self.connected.wait()
        return self.client

    async def ready(self) -> bool:
        """Triton's server readiness. A sidecar told its front is ready (``--front-ready``) waits a moment
        for its first connection instead of answering "not ready" in the instant after the pool said ready."""
        if not self.connected.is_set() and self.front_ready:
            try:
                await asyncio.wait_for(self.connected.wait(), FRONT_READY_WAIT_S)
            except TimeoutError:
                pass
        if not self.connected.is_set():
            return False
        status = await self.client.status()
        return not status["stopping"] and (not self.strict_readiness or all(
            m["state"] == ModelState.AVAILABLE for m in status["models"].values()))

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def route(handler):
        async def wrapped(self, request: web.Request) -> web.Response:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("HTTP request: %s %s", request.method, printable(request.path))
            refusal = self.restrictions.refusal(request.path, request.headers)
            if refusal is not None:  # before anything else, as Triton does
                return _error(403, refusal)
            try:
                return await handler(self, request)
            except BodyTimeout as exc:
                response = _error(exc.http_status, exc.message)
                response.force_close()  # the rest of the body may still come: never read it as a request
                return response
            except web.HTTPException as exc:
                return _error(exc.status, exc.reason)
            except Exception as exc:
                return _failure(request, exc)
        return wrapped

    async def _body(self, request: web.Request) -> bytes:
        return await limits.read_body(request, self.max_body, self.body_timeout)

    async def _json_body(self, request: web.Request) -> dict:
        raw = await limits.read_body(request, self.max_body, self.body_timeout, MAX_JSON_BYTES)
        if not raw.strip():
            return {}
        if len(raw) > MAX_JSON_BYTES:
            raise BodyTooLarge(limits.json_too_large(len(raw), MAX_JSON_BYTES))
        return kserve.load_header(raw)

    def _caller(self, request: web.Request, why: str) -> int:
        """The uid of the local process on the other end, or PermissionDenied saying why it is unknown."""
        transport = request.transport
        try:
            return peer.peer_uid(transport.get_extra_info("peername") if transport else None,
                                 transport.get_extra_info("sockname") if transport else None)
        except (peer.Unidentified, ValueError) as exc:
            raise errors.PermissionDenied(f"{why} needs a caller on this host's loopback whose user the kernel can "
                                          f"name, and this one cannot be identified: {exc}") from None

    def _owner_only(self, request: web.Request, api: str, what: str) -> None:
        """PermissionDenied unless the caller is the pool's own user or root, or ``api`` is restricted by a
        header (which the request then carried: the route checked it first)."""
        if self.restrictions.restricts(api):
            return
        uid = self._caller(request, what)
        if uid not in (self.owner_uid, 0):
            raise errors.PermissionDenied(
                f"{what} is allowed only to the pool's own user (uid {self.owner_uid}) and root, not to uid {uid}; "
                f"a pool started with --http-restricted-api {api}:KEY=VALUE lets requests carrying that header do it")

    async def _model_meta(self, request: web.Request) -> dict:
        meta = await (await self.front()).model_metadata(request.match_info["model"])
        version = model_version(request.match_info.get("version"))
        if version is not None and str(version) not in meta.get("versions", []):
            raise errors.ModelNotFound(f"Request for unknown model: '{meta['name']}' version {version} is not found")
        return meta

    # -- health and metadata ---------------------------------------------------------------
    @route
    async def live(self, request):
        return web.Response(status=200)

    @route
    async def server_ready(self, request):
        return web.Response(status=200 if await self.ready() else 400)

    @route
    async def server_metadata(self, request):
        return web.json_response({"name": self.server_name, "version": gepool.__version__, "extensions": EXTENSIONS})

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
        if meta["state"] != ModelState.AVAILABLE:
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
        if request.match_info.get("version") is not None:  # a version the model lacks is not found, as over gRPC
            await self._model_meta(request)
        out = [model_statistics(name, str(status["models"][name].get("version") or ""), s)
               for name, s in stats.items() if wanted is None or name == wanted]
        return web.json_response({"model_stats": out})

    # -- inference -------------------------------------------------------------------------
    @route
    async def infer(self, request):
        model = request.match_info["model"]
        version = model_version(request.match_info.get("version"))
        header_length = request.headers.get(kserve.HEADER_LENGTH)
        body = await limits.read_body(request, self.max_body, self.body_timeout,
                                      MAX_JSON_BYTES if header_length is None else None, kserve.json_too_large)
        held: dict[str, object] = {}  # region name -> Region, referenced until the request has ended
        caller: list[int] = []

        def acquire(name):
            if name not in held:
                if not caller:
                    caller.append(self._caller(request, "system shared memory"))
                held[name] = self.regions.acquire(caller[0], name)
            return held[name]

        def region_bytes(name, offset, size, limit):
            return self.regions.read(acquire(name), offset, size, limit)

        def parse():
            return kserve.parse_request(body, header_length, region_bytes, MAX_JSON_BYTES, self.max_body)

        try:
            try:
                hlen = kserve.header_length(body, header_length)
                shm = _mentions_shm(body, hlen)
                if self.regions.stale():  # not only when shm: the key may be spelled with escapes
                    await self.regions.current()
                if kserve.is_raw(hlen, header_length):  # the body is the one input
                    await self._model_meta(request)  # (an unknown model or version is heard of first)
                    config = await (await self.front()).query("config", {"model": model})
                    req = kserve.raw_request(config, body, model)
                elif INLINE_PARSE_BYTES < hlen <= MAX_JSON_BYTES and not shm:
                    req = await self.offload.parse(body, header_length, self.max_body)
                elif len(body) > INLINE_PARSE_BYTES or shm:
                    req = await asyncio.to_thread(parse)
                else:
                    req = parse()
                for o in req.outputs or []:
                    if o.region is not None:  # an unknown region, or a place past its end, fails before the model runs
                        self.regions.check_output(acquire(o.region), o.region_offset, o.region_size)
            except errors.GepoolError as exc:
                await self._unparsed(request, exc)
            if not req.inputs:
                await self._no_inputs(request)
            client = self.client if self.connected.is_set() else await self.front()
            outputs = await _ask(client, model, version, req, _names(req))
            payload, headers = self._encoded(
                model, version, req, outputs,
                lambda name, offset, size, data: self.regions.write(held[name], offset, size, data))
        finally:
            for region in held.values():
                self.regions.release(region)
        return web.Response(body=payload, headers=headers)

    def infer_now(self, request, done) -> bool:
        """The infer route's common case on the native server, with no task, coroutine or future: a body that
        came whole, small enough to parse here, with no shared memory, to a front already connected. Parsed and
        sent now; ``done(request, response)`` is called once, later, with the answer ``infer`` would give.
        False, with nothing done, for what only ``infer`` serves (it then reads the request from the start).
        Once a body is parsed it is never handed back: what the fast path cannot send, or what did not parse,
        is answered by a task here, as ``infer`` would answer it, so no body is parsed twice."""
        client = self.client
        if client is None or not self.connected.is_set() or self.regions.stale():
            return False
        body, max_body = request.body_now(), self.body_limit()
        if body is None or len(body) > INLINE_PARSE_BYTES or len(body) > max_body:
            return False
        headers = request.headers
        if self.restrictions.refusal(request.path, headers) is not None:
            return False
        header_length = headers.get(kserve.HEADER_LENGTH)
        try:
            version = model_version(request.match_info.get("version"))
            hlen = kserve.header_length(body, header_length)
        except errors.GepoolError:
            return False
        if _mentions_shm(body, hlen) or kserve.is_raw(hlen, header_length):  # (a raw request: the handler's)
            return False
        try:
            req = self.templates.parse(body, _no_regions, MAX_JSON_BYTES, max_body) if header_length is None \
                else self.templates.parse_binary(body, header_length, hlen, _no_regions, MAX_JSON_BYTES, max_body)
        except _Declined:  # an input in shared memory, its key spelled with escapes
            return False
        except errors.GepoolError as exc:
            _logged(request)
            self._answer_later(request, done, self._unparsed(request, exc))
            return True
        if any(o.region is not None for o in req.outputs or ()):  # (the same, for an output)
            return False
        _logged(request)
        if not req.inputs:
            self._answer_later(request, done, self._no_inputs(request))
            return True
        model = request.match_info["model"]

        def answered(outputs: dict | None, exc: BaseException | None) -> None:
            if exc is None:
                try:
                    response = self._reply(model, version, req, outputs)
                except Exception as failed:  # answered below, as the route answers a failure
                    response = _failure(request, failed)
            else:
                response = _failure(request, exc)
            done(request, response)

        names = _names(req)
        try:
            if client.submit(model, req.inputs, names, answered, version=version, priority=req.priority,
                             timeout=req.timeout_s, origin=Origin.HTTP, wait=answer_wait(req.timeout_s)):
                return True
        except errors.GepoolError as exc:
            self._answer_later(request, done, _raise(exc))
            return True
        self._answer_later(request, done, self._infer_parsed(model, version, req, names))  # longer than one record
        return True

    def _answer_later(self, request, done, work: Coroutine) -> None:
        """A task answers ``request`` with what ``work`` returns or raises, mapped as the route maps it."""

        async def answer() -> None:
            try:
                response = await work
            except Exception as exc:
                response = _failure(request, exc)
            done(request, response)

        task = asyncio.get_running_loop().create_task(answer())
        self._answering.add(task)  # held until it ends (the loop keeps only a weak reference)
        task.add_done_callback(self._answering.discard)

    async def _unparsed(self, request, exc: errors.GepoolError) -> NoReturn:
        """A body that did not parse: the caller hears first of a model (or version) that is not there."""
        try:
            await self._model_meta(request)
            raise exc
        finally:
            exc = None  # the traceback holds this frame: with it the body would sit in a cycle (gc_policy)

    async def _no_inputs(self, request) -> NoReturn:
        meta = await self._model_meta(request)
        raise errors.InvalidArgument(f"expected {len(meta.get('inputs', []))} inputs but got 0 inputs for "
                                     f"model '{request.match_info['model']}'")

    async def _infer_parsed(self, model: str, version: int | None, req: kserve.InferRequest,
                            names: list | None) -> rsgi.Reply:
        outputs = await _ask(self.client, model, version, req, names)
        return self._reply(model, version, req, outputs)

    def _reply(self, model: str, version: int | None, req: kserve.InferRequest, outputs: dict) -> rsgi.Reply:
        payload, headers = self._encoded(model, version, req, outputs)
        return rsgi.Reply(200, headers, payload)

    @staticmethod
    def _encoded(model: str, version: int | None, req: kserve.InferRequest, outputs: dict,
                 write_region=None) -> tuple[bytes, dict[str, str]]:
        """The answer's body and headers. The version that ran it comes from the reply itself (asking the
        front for metadata cost every unversioned request a second round trip)."""
        served = getattr(outputs, "model_version", None)
        return kserve.encode_response(model, str(served) if served is not None else (str(version) if version else ""),
                                      req, outputs, write_region)

    # -- repository ------------------------------------------------------------------------
    @route
    async def repository_index(self, request):
        body = await self._json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise errors.InvalidArgument(f"'ready' must be a bool (true or false), got {repr(ready)[:MAX_KEY_SHOWN]}")
        index = await (await self.front()).query("index", {"ready": ready})
        return web.json_response(index["models"])

    @route
    async def repository_control(self, request):
        body = await self._json_body(request)
        params = body.get("parameters") or {}
        if not isinstance(params, dict):
            raise errors.InvalidArgument("'parameters' must be an object")
        request_parameters.check_control(params)
        self._owner_only(request, "model-repository", "loading and unloading models")
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
        uid = self._caller(request, "system shared memory")
        return web.json_response(await self.regions.status(uid, request.match_info.get("region")))

    @route
    async def shm_register(self, request):
        body = await self._json_body(request)
        uid = self._caller(request, "registering system shared memory")
        await self.regions.register(uid, request.match_info["region"], body.get("key"), body.get("offset", 0),
                                    body.get("byte_size"))
        return web.Response(status=200)

    @route
    async def shm_unregister(self, request):
        await self._body(request)
        await self.regions.unregister(self._caller(request, "system shared memory"),
                                      request.match_info.get("region"))
        return web.Response(status=200)

    @route
    async def cuda_shm(self, request):
        action = request.path.rsplit("/", 1)[-1]
        if action == "status":
            return web.json_response([])
        if action == "register":
            return _error(400, "CUDA shared memory is not supported by gepool (no CUDA device)")
        return web.Response(status=200)

    # -- logging and trace settings ---------------------------------------------------------
    @route
    async def logging_settings(self, request):
        """Triton's logging extension: the pool's settings (the front's, its workers' and this sidecar's),
        changed first by a POST's (the pool's own user's: more logging is more disk and more detail)."""
        args = {}
        if request.method == "POST":
            body = await self._json_body(request)
            self._owner_only(request, "logging", "changing the log settings")
            args = {"update": body}
        settings = LogSettings.from_wire(await (await self.front()).query("logging", args))
        self._use(settings)
        return web.json_response(settings.as_triton())

    @route
    async def trace_settings(self, request):
        """Triton's trace extension, with tracing off: a POST that would turn it on is refused."""
        if "model" in request.match_info:
            try:
                await self._model_meta(request)
            except errors.ModelNotFound:
                raise errors.InvalidArgument(f"Request for unknown model : {request.match_info['model']}") from None
        if request.method == "POST":
            trace.check_update(await self._json_body(request))
        return web.json_response(trace.settings())

    # -- metrics ---------------------------------------------------------------------------
    @route
    async def metrics(self, request):
        client = await self.front()
        status, stats = await client.status(), await client.stats()
        text = metrics.render(status, stats, (self.cpu.read(), *host.memory()) if self.cpu_metrics else None)
        return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def add_routes(gw: Gateway, r) -> None:
    """Every KServe route, on aiohttp's router or ``rsgi.Router`` (the same ``add_get``/``add_post``)."""
    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version}"
    # first: the router tries the routes under one prefix in the order they were added
    r.add_post(m + "/infer", gw.infer)
    r.add_post(mv + "/infer", gw.infer)
    r.add_get("/v2/health/live", gw.live)
    r.add_get("/v2/health/ready", gw.server_ready)
    r.add_get("/v2", gw.server_metadata)
    r.add_get("/v2/models/stats", gw.model_stats)
    for base in (m, mv):
        r.add_get(base, gw.model_metadata)
        r.add_get(base + "/ready", gw.model_ready)
        r.add_get(base + "/config", gw.model_config)
        r.add_get(base + "/stats", gw.model_stats)
    for repo in ("/v2/repository", "/v2/repository/{repo}"):
        r.add_post(repo + "/index", gw.repository_index)
        r.add_post(repo + "/models/{model}/{action:load|unload}", gw.repository_control)
    for path in ("/v2/logging", "/v2/trace/setting", m + "/trace/setting"):
        handler = gw.logging_settings if path == "/v2/logging" else gw.trace_settings
        r.add_get(path, handler)
        r.add_post(path, handler)
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


def http_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.max_body)
    add_routes(gw, app.router)
    return app


async def serve(endpoint: str, host: str, http_port: int, metrics_port: int, ready_fd: int | None,
                curve_key: str | None = None, restrictions: Restrictions | None = None,
                max_body: int = DEFAULT_MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT_S,
                strict_readiness: bool = True, grpc_port: int = 0, front_ready: bool = False,
                http_server: str = servers.DEFAULT_HTTP_SERVER,
                grpc_server_kind: str = servers.DEFAULT_GRPC_SERVER,
                inherited: dict[str, list[socket.socket]] | None = None,
                regions: tuple[str, mmap.mmap] | None = None, grpc_restrictions=None,
                hosts: dict[str, str] | None = None, server_id: str = "gepool", cpu_metrics: bool = True,
                body_limit_follows: bool = False) -> None:
    """Serves until SIGTERM or SIGINT, or until the pool that started it is gone. ``inherited``: listening
    sockets by port ("http", "metrics", "grpc"), bound by the pool and shared with its other sidecars;
    a port without them is bound here, on ``host`` or its own in ``hosts``. ``regions``, ``body_limit_follows``:
    see Gateway."""
    inherited = inherited or {}
    hosts = {"http": host, **(hosts or {})}
    gw = Gateway(endpoint, curve_key, restrictions, max_body, body_timeout, strict_readiness, front_ready, regions,
                 body_limit_follows)
    gw.server_name, gw.cpu_metrics = server_id, cpu_metrics
    connecting = asyncio.get_running_loop().create_task(gw.connect())
    runners, listener = [], None
    if http_port and http_server != "aiohttp":  # the KServe port on granian or httptools, routed by rsgi.Router
        router = rsgi.Router()
        add_routes(gw, router)
        if http_server == "granian":
            listener = rsgi.Listener(rsgi.App(router), host, http_port, body_timeout)
        else:
            from gepool.http import native  # (httptools may be absent where another server is asked for)

            listener = native.Listener(router, host, http_port, body_timeout, gw.body_limit, inherited.get("http"))
            listener.fast[gw.infer] = gw.infer_now
        await listener.start()
    for name, port, app in (("http", 0 if listener else http_port, http_app(gw)), ("metrics", metrics_port, None)):
        if not port:
            continue
        if app is None:
            app = web.Application()
            app.router.add_get("/metrics", gw.metrics)
        # keepalive_timeout is also aiohttp's only bound on a connection that never finishes its headers
        # (it is armed when the connection opens): without it a slow-loris connection lives an hour
        # auto_decompress off: limits.decode reads compressed bodies, bounding the bytes read off the wire
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=body_timeout, auto_decompress=False)
        await runner.setup()
        # the backlog the pool bound with: aiohttp listens again on a socket it is given, by default with 128
        if name in inherited:
            for sock in inherited[name]:
                await web.SockSite(runner, sock, backlog=listen.BACKLOG).start()
        else:
            await web.TCPSite(runner, hosts.get(name, host), port, reuse_address=True,
                              backlog=listen.BACKLOG).start()
        runners.append(runner)
    if grpc_port:
        from gepool.grpc import server as grpc_server

        grpc_listener = await grpc_server.start(gw, hosts.get("grpc", host), grpc_port, grpc_server_kind,
                                                inherited.get("grpc"), grpc_restrictions)
    gw.regions.watch()
    gc_policy.settle()
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")  # left open: a later failure written there finds no reader, not a reused fd
    parent = os.getppid()
    following = asyncio.get_running_loop().create_task(_follow_log_settings(gw))
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
    if grpc_port:
        await grpc_server.stop(grpc_listener)
    if listener is not None:
        await listener.stop()
    for runner in runners:
        await runner.cleanup()
    connecting.cancel()
    following.cancel()
    if gw.client is not None:
        await gw.client.close()
    gw.regions.close()
    gw.offload.close()


async def _follow_log_settings(gw: Gateway) -> None:
    """Reads the front's log settings every LOG_FOLLOW_S: a change another sidecar or a library client made
    reaches this one too (the front tells no sidecar of it)."""
    while True:
        await asyncio.sleep(LOG_FOLLOW_S)
        if gw.connected.is_set():
            await gw._adopt_log_settings(quiet=True)  # (a front that cannot answer now may next time)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gepool-http")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--http-host", default="127.0.0.1", help="the address the HTTP port binds, and the others'")
    p.add_argument("--grpc-host", help="the address the gRPC port binds (default: --http-host)")
    p.add_argument("--metrics-host", help="the address the metrics port binds (default: --http-host)")
    p.add_argument("--id", default="gepool", help="the server's name in its metadata (Triton's --id)")
    p.add_argument("--allow-cpu-metrics", choices=["true", "false"], default="true",
                   help="Triton's nv_cpu_* gauges in /metrics")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--grpc-port", type=int, default=0, help="Triton's KServe v2 gRPC service here (0: off)")
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--log-format", choices=FORMATS, default="default",
                   help="the log lines' time stamps until the front's settings are read (Triton's --log-format)")
    p.add_argument("--curve-key", help="the pool's CURVE certificate, when its endpoint uses CURVE")
    p.add_argument("--http-max-body-bytes", "--http-max-input-size", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="the largest request body accepted (413 above it)")
    p.add_argument("--http-body-timeout-s", type=float, default=BODY_TIMEOUT_S,
                   help="a request body not complete this long after its headers is answered 408; it is also "
                        "the idle timeout of keep-alive connections and the time a request's headers may take "
                        "(on both servers): a connection idle, or sending its headers, this long is closed")
    p.add_argument("--http-restricted-api", action="append", default=[], metavar="API[,API...]:KEY=VALUE",
                   help="requests to these APIs must carry header KEY with VALUE (Triton's flag; repeatable)")
    p.add_argument("--grpc-restricted-protocol", action="append", default=[], metavar="API[,API...]:KEY=VALUE",
                   help="calls to these APIs' gRPC methods must carry metadata triton-grpc-protocol-KEY with VALUE "
                        "(Triton's flag; repeatable)")
    p.add_argument("--strict-readiness", choices=["true", "false"], default="true",
                   help="false: /v2/health/ready is ready while the pool answers, whatever its models' states")
    p.add_argument("--http-server", choices=servers.HTTP_SERVERS, default=servers.DEFAULT_HTTP_SERVER,
                   help=servers.HELP)
    p.add_argument("--grpc-server", choices=servers.GRPC_SERVERS, default=servers.DEFAULT_GRPC_SERVER,
                   help=servers.GRPC_HELP)
    for port in listen.PORTS:
        p.add_argument(f"--{port}-fd", type=int, action="append", default=[], metavar="FD",
                       help=f"an inherited listening socket to serve the {port} port on instead of binding it "
                            f"(repeatable: one per address)")
    p.add_argument("--regions-fd", type=int, metavar="FD",
                   help="the pool's shared-memory record's version page (a memfd); with the token in "
                        f"${TOKEN_ENV}, registered regions are the pool's, not this process's")
    p.add_argument("--body-limit-follows-loads", action="store_true",
                   help="with --regions-fd: the body limit is at least the largest slot of any model the front "
                        "holds now, plus 1 MiB (the pool's own sidecars, when --http-max-body-bytes was not given)")
    p.add_argument("--front-ready", action="store_true",
                   help="the front was ready when this sidecar started (the pool's own): the readiness probe "
                        "waits a moment for the first connection instead of answering not ready")
    args = p.parse_args(argv)
    from gepool.grpc.access import GrpcRestrictions  # (which does not import grpc)

    try:
        restrictions = Restrictions.parse(args.http_restricted_api)
        grpc_restrictions = GrpcRestrictions.parse(args.grpc_restricted_protocol)
    except ValueError as exc:
        p.error(str(exc))
    if args.http_max_body_bytes <= 0:
        p.error(f"--http-max-body-bytes must be positive, got {args.http_max_body_bytes}")
    if args.body_limit_follows_loads and args.regions_fd is None:
        p.error("--body-limit-follows-loads needs --regions-fd (the page the front publishes its slots on)")
    refusal = servers.refusal(args.http_server)
    if refusal:
        p.error(f"--http-server: {refusal}")
    if args.http_fd and args.http_server == "granian":
        p.error("--http-fd: granian binds its own port; serve an inherited socket with httptools or aiohttp")
    if args.grpc_fd and args.grpc_server == "grpcio":
        p.error("--grpc-fd: grpc.aio binds its own port; serve an inherited socket with the native server")
    try:
        inherited = {port: listen.adopt(getattr(args, f"{port}_fd")) for port in listen.PORTS
                     if getattr(args, f"{port}_fd")}
    except (OSError, ValueError) as exc:
        p.error(f"an inherited socket: {exc}")
    token = os.environ.pop(TOKEN_ENV, None)  # not for this process's own children
    regions = None
    if args.regions_fd is not None:
        if token is None:
            p.error(f"--regions-fd needs the pool's token in ${TOKEN_ENV}")
        try:
            regions = (token, version_page(args.regions_fd, writable=False))
            os.close(args.regions_fd)  # the mapping holds the page
        except (OSError, ValueError) as exc:
            p.error(f"--regions-fd {args.regions_fd}: {exc}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s http %(levelname)s %(message)s")
    LogSettings.of_level(logging.getLogger().level, args.log_format).apply()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.endpoint, args.http_host, args.http_port, args.metrics_port, args.ready_fd,
                      args.curve_key, restrictions, args.http_max_body_bytes, args.http_body_timeout_s,
                      args.strict_readiness == "true", args.grpc_port, args.front_ready, args.http_server,
                      args.grpc_server, inherited, regions, grpc_restrictions,
                      {name: given for name, given in (("grpc", args.grpc_host), ("metrics", args.metrics_host))
                       if given},
                      args.id, args.allow_cpu_metrics == "true", args.body_limit_follows_loads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
