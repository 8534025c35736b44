"""GRPCInferenceService: each of Triton's RPCs answered through the gateway's client of the front.

Handlers receive the request as bytes and parse it themselves, so a malformed message is answered
INVALID_ARGUMENT with what protobuf said (grpcio's own deserializer would answer INTERNAL). Errors
carry the same messages as over HTTP, with the gRPC status codes Triton uses.
"""

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Coroutine
from typing import NoReturn

import grpc
from google.protobuf import json_format, message

import gepool
from gepool.common import errors, request_parameters
from gepool.grpc import grpc_service_pb2 as pb
from gepool.grpc import stats, tensors
from gepool.grpc.access import GrpcRestrictions
from gepool.grpc.calls import Calls
from gepool.http import peer
from gepool.http.limits import INLINE_PARSE_BYTES
from gepool.http.server import answer_wait
from gepool.http.templates import copied
from gepool.ipc.protocol import ModelState, Origin

log = logging.getLogger("gepool.grpc")
SERVICE = "inference.GRPCInferenceService"
EXTENSIONS = ["model_configuration", "statistics", "system_shared_memory", "model_repository", "parameters"]
MAX_STREAM_INFLIGHT = 256  # requests of one stream running at once; reading the stream waits beyond it

_STATUS = {  # gepool's error code -> the gRPC status Triton answers with
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT, "MODEL_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "MODEL_NOT_READY": grpc.StatusCode.UNAVAILABLE, "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "REQUEST_TOO_LARGE": grpc.StatusCode.INVALID_ARGUMENT, "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "TIMEOUT": grpc.StatusCode.UNAVAILABLE, "POOL_UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "PROTOCOL": grpc.StatusCode.INTERNAL, "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "UNKNOWN": grpc.StatusCode.UNKNOWN, "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "UNSUPPORTED": grpc.StatusCode.UNIMPLEMENTED, "CANCELLED": grpc.StatusCode.CANCELLED,
}


class Unsupported(errors.GepoolError):
    """An RPC gepool answers as a Triton built without that feature does."""

    code, http_status = "UNAVAILABLE", 503


def status_of(exc: errors.GepoolError) -> grpc.StatusCode:
    return _STATUS.get(exc.code, grpc.StatusCode.INTERNAL)


def parse_message(cls: type[message.Message], raw: bytes) -> message.Message:
    try:
        return cls.FromString(raw)
    except message.DecodeError as exc:
        raise errors.InvalidArgument(f"malformed {cls.DESCRIPTOR.name}: {exc}") from None


def _names(call: tensors.InferCall) -> list | None:
    """The outputs to ask the front for; one asked for as classes travels as [name, class_count] (the front's
    classification)."""
    if call.outputs is None:
        return None
    return [[o.name, o.class_count] if o.class_count else o.name for o in call.outputs]


def _served(call: tensors.InferCall, outputs: dict) -> str:
    """The version that ran the request, from the reply itself."""
    served = getattr(outputs, "model_version", None)
    return str(served) if served is not None else (str(call.version) if call.version else "")


def _named(request: pb.ModelInferRequest) -> tuple[str, str, str]:
    """What names a request in a stream's answer to it: its id, model and version."""
    return request.id, request.model_name, request.model_version


def _streamed(names: tuple[str, str, str] | None, reply: pb.ModelInferResponse | None,
              exc: BaseException | None) -> pb.ModelStreamInferResponse:
    """A stream's answer to a request: its reply, or what failed, naming the request where it parsed."""
    if exc is None:
        return pb.ModelStreamInferResponse(infer_response=reply)
    if isinstance(exc, errors.GepoolError):
        answer = pb.ModelStreamInferResponse(error_message=exc.message)
    else:
        log.error("internal error on a ModelStreamInfer request", exc_info=exc)
        answer = pb.ModelStreamInferResponse(error_message=errors.INTERNAL_MESSAGE)
    if names is not None:  # so the caller can tell which request failed
        r = answer.infer_response
        r.id, r.model_name, r.model_version = names
    return answer


def _in_regions(request: pb.ModelInferRequest) -> bool:
    """Whether an input or output of the request is in shared memory."""
    return any("shared_memory_region" in t.parameters for t in (*request.inputs, *request.outputs))


class InferenceService:
    """The RPCs, by name, over one Gateway (its client of the front, regions and limits)."""

    stream_now = True  # a stream's requests are sent without a task each, where the server can write now

    def __init__(self, gw, host: str, port: int, restrictions: GrpcRestrictions | None = None) -> None:
        self.gw, self.host, self.port = gw, host, port
        self.restrictions = restrictions or GrpcRestrictions()
        self._answering: set[asyncio.Task] = set()  # infer_now's tasks
        self.calls = Calls()  # _send_now's requests, by their shape

    # -- helpers ---------------------------------------------------------------------------
    def caller(self, context: grpc.aio.ServicerContext | str, why: str) -> int:
        """The uid of the local process on the other end of this call (``peer.py``), or PermissionDenied.
        ``context`` may be the call's ``context.peer()`` already read ("ipv4:127.0.0.1:PORT")."""
        try:
            kind, _, rest = (context if isinstance(context, str) else context.peer()).partition(":")
            if kind not in ("ipv4", "ipv6"):
                raise peer.Unidentified("the connection is not TCP")
            addr, _, port = rest.rpartition(":")
            addr = addr.strip("[]")
            try:
                local = ipaddress.ip_address(self.host)
                local_ip = addr if local.is_unspecified else self.host
            except ValueError:  # a host name: the connection came to the peer's own loopback address
                local_ip = addr
            return peer.peer_uid((addr, int(port)), (local_ip, self.port))
        except (peer.Unidentified, ValueError) as exc:
            raise errors.PermissionDenied(f"{why} needs a caller on this host's loopback whose user the kernel can "
                                          f"name, and this one cannot be identified: {exc}") from None

    async def model_meta(self, name: str, version_text: str) -> dict:
        meta = await (await self.gw.front()).model_metadata(name)
        version = request_parameters.model_version(version_text)
        if version is not None and str(version) not in meta.get("versions", []):
            raise errors.ModelNotFound(f"Request for unknown model: '{meta['name']}' version {version} is not found")
        return meta

    # -- health and metadata ---------------------------------------------------------------
    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.gw.ready())

    async def ServerMetadata(self, request, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=self.gw.server_name, version=gepool.__version__, extensions=EXTENSIONS)

    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        try:
            meta = await self.model_meta(request.name, request.version)
        except errors.ModelNotFound:  # Triton: not ready, not an error
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=meta["state"] == ModelState.AVAILABLE)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context) -> pb.ModelMetadataResponse:
        meta = await self.model_meta(request.name, request.version)
        out = pb.ModelMetadataResponse(name=meta["name"], versions=meta.get("versions", []),
                                       platform=meta.get("platform", ""))
        for kind in ("inputs", "outputs"):
            for t in meta.get(kind, []):
                getattr(out, kind).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return out

    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        await self.model_meta(request.name, request.version)
        config = await (await self.gw.front()).query("config", {"model": request.name})
        out = pb.ModelConfigResponse()
        json_format.ParseDict(config, out.config)
        return out

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context) -> pb.ModelStatisticsResponse:
        client = await self.gw.front()
        if request.name:
            await self.model_meta(request.name, request.version)
        rows = stats.rows(await client.stats(), await client.status(), request.name or None)
        return json_format.ParseDict({"model_stats": rows}, pb.ModelStatisticsResponse())

    # -- inference -------------------------------------------------------------------------
    async def infer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        return await self._infer(request, context.peer())

    async def _infer(self, request: pb.ModelInferRequest, peer_text: str) -> pb.ModelInferResponse:
        held: dict[str, object] = {}  # region name -> Region, referenced until the request has ended
        regions = self.gw.regions

        def acquire(name: str):
            if name not in held:
                held[name] = regions.acquire(self.caller(peer_text, "system shared memory"), name)
            return held[name]

        def parse() -> tensors.InferCall:
            return tensors.parse(request, lambda name, offset, size, limit: regions.read(
                acquire(name), offset, size, limit), self.gw.max_body)

        try:
            try:
                shm = any("shared_memory_region" in i.parameters for i in request.inputs)
                if regions.stale():
                    await regions.current()
                # reading a region and copying large tensors stay off the event loop
                call = await asyncio.to_thread(parse) if shm or request.ByteSize() > INLINE_PARSE_BYTES else parse()
                for o in call.outputs or []:
                    if o.region is not None:  # an unknown region, or a place past its end, fails before the model runs
                        regions.check_output(acquire(o.region), o.region_offset, o.region_size)
            except errors.GepoolError as exc:
                await self._unparsed(request, exc)
            if not call.inputs:
                await self._no_inputs(call)
            outputs = await self._ask(call)
            return tensors.response(request.id, call, _served(call, outputs), outputs,
                                    lambda name, offset, size, data: regions.write(held[name], offset, size, data))
        finally:
            for region in held.values():
                regions.release(region)

    def infer_now(self, raw: bytes, peer_text: str,
                  done: Callable[[pb.ModelInferResponse | None, BaseException | None], None]) -> bool:
        """ModelInfer's common case on the native server, with no task, coroutine or future: a request small
        enough to parse here, with no shared memory, to a front already connected. Parsed and sent now;
        ``done(reply, None)`` or ``done(None, exc)`` is called once, later, with what ``ModelInfer`` would
        answer or raise. False, with nothing done, for what only ``ModelInfer`` serves. A request once parsed
        is never handed back: what the fast path cannot send, or what did not parse, a task here answers."""
        if not self._now(raw):
            return False
        try:
            known = self.calls.known(raw, self.gw.max_body)
        except Exception:  # (a bug of the fast path's own: the full path reads the request, as a stream's does)
            log.exception("internal error reading a ModelInfer request by its bytes")
            known = None
        if known is not None:  # a learnt request around other contents: nothing else to parse
            call, wanted, names = known
            self._submit(call, wanted, names[0], done)
            return True
        try:
            request = parse_message(pb.ModelInferRequest, raw)
        except errors.GepoolError as exc:
            asyncio.get_running_loop().call_soon(done, None, exc)
            return True
        if _in_regions(request):
            self._answer_later(done, self._infer(request, peer_text))
        else:
            self._send_now(request, done, raw)
        return True

    def _now(self, raw: bytes) -> bool:
        """Whether a request may go by the fast path: small enough to parse here, to a front connected."""
        gw = self.gw
        return gw.client is not None and gw.connected.is_set() and not gw.regions.stale() \
            and len(raw) <= INLINE_PARSE_BYTES

    def _send_now(self, request: pb.ModelInferRequest,
                  done: Callable[[pb.ModelInferResponse | bytes | None, BaseException | None], None],
                  raw: bytes | None = None, as_bytes: bool = True) -> None:
        """infer_now's part once a request with no shared memory has parsed: sent now, or answered by a task.
        ``as_bytes``: the answer may come as its serialized bytes (``_submit``)."""
        try:
            call = self.calls.parse(request, tensors.no_region, self.gw.max_body, raw)
        except errors.GepoolError as exc:
            self._answer_later(done, self._unparsed(request, exc))
            return
        if not call.inputs:
            self._answer_later(done, self._no_inputs(call))
            return
        self._submit(call, copied(call, inputs={}), request.id, done, as_bytes)

    def _submit(self, call: tensors.InferCall, wanted: tensors.InferCall, request_id: str,
                done: Callable[[pb.ModelInferResponse | bytes | None, BaseException | None], None],
                as_bytes: bool = True) -> None:
        """Sends a parsed call with inputs now, or has a task answer it. ``wanted``: the call less its inputs,
        all that the answer needs (the callback lives until the front answers, even when the call's connection
        has gone: the request and its inputs would stay with it). With ``as_bytes``, the answer is its serialized
        bytes where ``tensors.response_bytes`` writes them."""

        def answered(outputs: dict | None, exc: BaseException | None) -> None:
            if exc is None:
                try:
                    served = _served(wanted, outputs)
                    reply = as_bytes and tensors.response_bytes(request_id, wanted, served, outputs) \
                        or tensors.response(request_id, wanted, served, outputs, tensors.no_region)
                except Exception as failed:
                    done(None, failed)
                    return
                done(reply, None)
            else:
                done(None, exc)

        try:
            if self.gw.client.submit(call.model, call.inputs, _names(call), answered, version=call.version,
                                     timeout=call.timeout_s, priority=call.priority, origin=Origin.GRPC,
                                     wait=answer_wait(call.timeout_s)):
                return
        except errors.GepoolError as exc:
            asyncio.get_running_loop().call_soon(done, None, exc)
            return
        self._answer_later(done, self._infer_parsed(request_id, call))  # longer than one lane record

    def _answer_later(self, done: Callable, work: Coroutine) -> None:
        """A task calls ``done`` with what ``work`` returns or raises."""

        async def answer() -> None:
            try:
                reply = await work
            except Exception as exc:
                done(None, exc)
                return
            done(reply, None)

        task = asyncio.get_running_loop().create_task(answer())
        self._answering.add(task)  # held until it ends (the loop keeps only a weak reference)
        task.add_done_callback(self._answering.discard)

    async def _unparsed(self, request: pb.ModelInferRequest, exc: errors.GepoolError) -> NoReturn:
        """A request that did not parse: the caller hears first of a model that is not there."""
        try:
            if request.model_name:
                await self.model_meta(request.model_name, "")
            raise exc
        finally:
            exc = None  # the traceback holds this frame: with it the request would sit in a cycle

    async def _no_inputs(self, call: tensors.InferCall) -> NoReturn:
        meta = await self.model_meta(call.model, "")
        raise errors.InvalidArgument(f"expected {len(meta.get('inputs', []))} inputs but got 0 inputs for "
                                     f"model '{call.model}'")

    async def _ask(self, call: tensors.InferCall) -> dict:
        return await (await self.gw.front()).infer(call.model, call.inputs, _names(call), version=call.version,
                                                   timeout=call.timeout_s, priority=call.priority,
                                                   origin=Origin.GRPC, wait=answer_wait(call.timeout_s))

    async def _infer_parsed(self, request_id: str, call: tensors.InferCall) -> pb.ModelInferResponse:
        outputs = await self._ask(call)
        return tensors.response(request_id, call, _served(call, outputs), outputs, tensors.no_region)

    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        return await self.infer(request, context)

    async def stream(self, raw_requests, context) -> None:
        """Many requests on one stream, answered as each finishes (matched by ``id``); a failed one is
        answered in ``error_message`` and the stream goes on. On the native server (a context that can
        ``write_now``), a request is sent from this loop as infer_now sends one, with no task of its own."""
        loop = asyncio.get_running_loop()
        room = asyncio.Semaphore(MAX_STREAM_INFLIGHT)
        writing = asyncio.Lock()  # one write at a time on a call
        running: set[asyncio.Task] = set()
        write_now = getattr(context, "write_now", None) if self.stream_now else None
        sent = 0  # requests sent from this loop, not yet answered
        idle: asyncio.Future | None = None  # set once they all are, when the stream waits for them to be

        async def write(answer: pb.ModelStreamInferResponse) -> None:
            async with writing:
                await context.write(answer)

        def answered(answer: pb.ModelStreamInferResponse) -> None:
            # written now unless an earlier answer waits for the client's window: then after it, by a task
            try:
                if not writing.locked() and write_now(answer):
                    settled()
                    return
            except Exception:  # (as a task's failed write: that answer is lost, the stream goes on)
                log.exception("internal error writing a ModelStreamInfer answer")
                settled()
                return
            task = loop.create_task(write(answer))
            running.add(task)
            task.add_done_callback(running.discard)
            task.add_done_callback(written)

        def written(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.error("internal error writing a ModelStreamInfer answer", exc_info=task.exception())
            settled()

        def answering(names: tuple[str, str, str] | None) -> Callable:
            """A request's callback: answers once, whatever fails on the way (the stream waits for every one)."""
            called = False

            def done(reply: pb.ModelInferResponse | None, exc: BaseException | None) -> None:
                nonlocal called
                if called:
                    return
                called = True
                try:
                    answer = _streamed(names, reply, exc)
                except Exception as failed:
                    answer = _streamed(names, None, failed)
                answered(answer)
            return done

        def settled() -> None:
            nonlocal sent
            sent -= 1
            room.release()
            if not sent and idle is not None and not idle.done():
                idle.set_result(None)

        async def one(raw: bytes | pb.ModelInferRequest) -> None:
            request = raw if isinstance(raw, pb.ModelInferRequest) else None
            try:
                try:
                    if request is None:
                        request = parse_message(pb.ModelInferRequest, raw)
                    answer = _streamed(None, await self.infer(request, context), None)
                except Exception as exc:
                    answer = _streamed(_named(request) if request is not None else None, None, exc)
                await write(answer)
            finally:
                room.release()

        def start(raw: bytes | pb.ModelInferRequest) -> None:
            task = loop.create_task(one(raw))
            running.add(task)
            task.add_done_callback(running.discard)

        try:
            async for raw in raw_requests:
                await room.acquire()
                if write_now is None or not self._now(raw):
                    start(raw)
                    continue
                try:
                    known = self.calls.known(raw, self.gw.max_body)
                except Exception:  # (a bug of the fast path's own: the full path reads the request)
                    log.exception("internal error reading a ModelStreamInfer request by its bytes")
                    known = None
                if known is not None:  # a learnt request around other contents (as infer_now takes it)
                    sent += 1
                    call, wanted, names = known
                    done = answering(names)
                    try:
                        self._submit(call, wanted, names[0], done, as_bytes=False)
                    except Exception as exc:  # (as below)
                        done(None, exc)
                    continue
                try:
                    request = parse_message(pb.ModelInferRequest, raw)
                except errors.GepoolError as exc:
                    sent += 1
                    answered(_streamed(None, None, exc))
                    continue
                if _in_regions(request):
                    start(request)  # a task, cancelled with the stream: it holds regions while it runs
                    continue
                sent += 1
                # the callback keeps what names the request, not the request: it lives until the front answers,
                # even once the stream is over
                done = answering(_named(request))
                try:
                    self._send_now(request, done, raw, as_bytes=False)
                except Exception as exc:  # (as one task's failure: that request's answer, and the stream goes on)
                    done(None, exc)
            if sent:
                idle = loop.create_future()
                await idle
            while running:
                await asyncio.gather(*running, return_exceptions=True)
        finally:
            for task in running:
                task.cancel()

    # -- repository ------------------------------------------------------------------------
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context) -> pb.RepositoryIndexResponse:
        # the index HTTP's POST /v2/repository/index gives: every model folder, one row per version
        index = await (await self.gw.front()).query("index", {"ready": request.ready})
        out = pb.RepositoryIndexResponse()
        for row in index["models"]:
            out.models.add(name=row["name"], version=row.get("version", ""), state=row.get("state", ""),
                           reason=row.get("reason", ""))
        return out

    def may_control(self, request, context) -> None:
        request_parameters.check_control({k: tensors.param_value(v) for k, v in request.parameters.items()})
        if self.restrictions.restricts("model-repository"):  # the call carried its metadata: the server checked
            return
        uid = self.caller(context, "loading and unloading models")
        if uid not in (self.gw.owner_uid, 0):
            raise errors.PermissionDenied(f"loading and unloading models is allowed only to the pool's own user "
                                          f"(uid {self.gw.owner_uid}) and root, not to uid {uid}; a pool started "
                                          f"with --grpc-restricted-protocol model-repository:KEY=VALUE lets calls "
                                          f"carrying that metadata do it")

    async def RepositoryModelLoad(self, request, context) -> pb.RepositoryModelLoadResponse:
        self.may_control(request, context)
        await (await self.gw.front()).load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context) -> pb.RepositoryModelUnloadResponse:
        self.may_control(request, context)
        await (await self.gw.front()).unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ---------------------------------------------------------------------
    async def SystemSharedMemoryStatus(self, request, context) -> pb.SystemSharedMemoryStatusResponse:
        rows = await self.gw.regions.status(self.caller(context, "system shared memory"), request.name or None)
        out = pb.SystemSharedMemoryStatusResponse()
        for r in rows:
            out.regions[r["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**r))
        return out

    async def SystemSharedMemoryRegister(self, request, context) -> pb.SystemSharedMemoryRegisterResponse:
        uid = self.caller(context, "registering system shared memory")
        await self.gw.regions.register(uid, request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context) -> pb.SystemSharedMemoryUnregisterResponse:
        await self.gw.regions.unregister(self.caller(context, "system shared memory"), request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context) -> pb.CudaSharedMemoryStatusResponse:
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context) -> pb.CudaSharedMemoryRegisterResponse:
        raise errors.InvalidArgument("CUDA shared memory is not supported by gepool (no CUDA device)")

    async def CudaSharedMemoryUnregister(self, request, context) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace and log settings: a Triton built without them answers these -----------------
    async def TraceSetting(self, request, context) -> pb.TraceSettingResponse:
        raise Unsupported("trace is not supported")

    async def LogSettings(self, request, context) -> pb.LogSettingsResponse:
        raise Unsupported("logging is not supported")
