"""The gateway's gRPC server: Triton's inference service, gRPC health and reflection, on the gateway's loop.

The server (``native.py`` by default, or ``grpc.aio``) shares the gateway's event loop, its client of the
front, its shared-memory regions and its size limit (the HTTP body limit bounds a request message).
"""

import asyncio
import ipaddress
import logging

import grpc

from gepool.common import errors
from gepool.grpc import grpc_service_pb2 as pb
from gepool.grpc import health_pb2, health_pb2_grpc
from gepool.grpc.access import GrpcRestrictions
from gepool.grpc.reflection import SERVICE_NAMES as REFLECTION_SERVICES
from gepool.grpc.reflection import Reflection
from gepool.grpc.service import SERVICE, InferenceService, parse_message, status_of
from gepool.http.servers import DEFAULT_GRPC_SERVER

log = logging.getLogger("gepool.grpc")
HEALTH_SERVICE = "grpc.health.v1.Health"
WATCH_INTERVAL_S = 1.0  # how often a health Watch looks at the pool's readiness
MAX_WATCHERS = 1024  # health Watch streams open at once; each holds a stream and a task
STOP_GRACE_S = 5.0  # calls in flight when the gateway stops get this long to finish
_Status = health_pb2.HealthCheckResponse


async def _abort(context, exc: BaseException, what: str) -> None:
    if isinstance(exc, errors.GepoolError):
        await context.abort(status_of(exc), exc.message)
    log.error("internal error on %s", what, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, errors.INTERNAL_MESSAGE)


def _unary(method, request_cls, response_cls) -> grpc.RpcMethodHandler:
    async def handler(raw: bytes, context):
        try:
            return await method(parse_message(request_cls, raw), context)
        except grpc.aio.AbortError:  # the method's own abort (an Exception): its status passes untouched
            raise
        except Exception as exc:
            await _abort(context, exc, method.__name__)
    return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=None,
                                               response_serializer=response_cls.SerializeToString)


def _unary_stream(method, request_cls, response_cls) -> grpc.RpcMethodHandler:
    """_unary for a method that yields its replies."""
    async def handler(raw: bytes, context):
        try:
            async for reply in method(parse_message(request_cls, raw), context):
                yield reply
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method.__name__)
    return grpc.unary_stream_rpc_method_handler(handler, request_deserializer=None,
                                                response_serializer=response_cls.SerializeToString)


def inference_methods(service: InferenceService) -> dict[str, grpc.RpcMethodHandler]:
    """Every RPC of the service by name, taking its request as bytes (see service.py for why). They are
    registered methods: grpcio finds a call's handler without asking each generic handler in Python."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        response_cls = getattr(pb, m.output_type.name)
        if m.client_streaming:
            handlers[m.name] = grpc.stream_stream_rpc_method_handler(
                service.stream, request_deserializer=None, response_serializer=response_cls.SerializeToString)
        else:
            handlers[m.name] = _unary(getattr(service, m.name), getattr(pb, m.input_type.name), response_cls)
    return handlers


class Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING while the pool is ready (as ServerReady), NOT_SERVING otherwise (draining,
    models not loaded, the front not reached yet). The empty service name means the whole server."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.watchers = 0
        self._asked_at = -WATCH_INTERVAL_S
        self._asking: asyncio.Future | None = None

    async def _watched(self) -> bool:
        """The pool's readiness for every Watch stream at once: the front is asked at most once per
        WATCH_INTERVAL_S, however many streams watch."""
        loop = asyncio.get_running_loop()
        if self._asking is None or loop.time() - self._asked_at >= WATCH_INTERVAL_S:
            self._asked_at = loop.time()
            self._asking = loop.create_task(self._ready())
        return await asyncio.shield(self._asking)

    async def _ready(self) -> bool:
        try:
            return await self.service.gw.ready()
        except errors.GepoolError:
            return False

    async def _status(self, name: str) -> int:
        if name not in ("", SERVICE):
            return _Status.SERVICE_UNKNOWN
        try:
            ready = await self.service.gw.ready()
        except errors.GepoolError:
            ready = False
        return _Status.SERVING if ready else _Status.NOT_SERVING

    async def Check(self, request, context):
        status = await self._status(request.service)
        if status == _Status.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return _Status(status=status)

    async def List(self, request, context):
        out = health_pb2.HealthListResponse()
        for name in ("", SERVICE):
            out.statuses[name].status = await self._status(name)
        return out

    async def Watch(self, request, context):
        if self.watchers >= MAX_WATCHERS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many health Watch streams open ({MAX_WATCHERS}); use Check, or close one")
        self.watchers += 1
        try:
            last = None
            while True:
                if request.service not in ("", SERVICE):  # never known: said once, the stream kept open
                    status = _Status.SERVICE_UNKNOWN
                else:
                    status = _Status.SERVING if await self._watched() else _Status.NOT_SERVING
                if status != last:
                    yield _Status(status=status)
                    last = status
                await asyncio.sleep(WATCH_INTERVAL_S)
        finally:
            self.watchers -= 1


def health_methods(health: Health) -> dict[str, grpc.RpcMethodHandler]:
    """Check, List and Watch taking their request as bytes, so that a malformed one is INVALID_ARGUMENT
    (grpcio's own deserializer answers UNKNOWN naming a Python class)."""
    return {"Check": _unary(health.Check, health_pb2.HealthCheckRequest, _Status),
            "List": _unary(health.List, health_pb2.HealthListRequest, health_pb2.HealthListResponse),
            "Watch": _unary_stream(health.Watch, health_pb2.HealthCheckRequest, _Status)}


def _address(host: str, port: int) -> str:
    try:
        return f"[{host}]:{port}" if ipaddress.ip_address(host).version == 6 else f"{host}:{port}"
    except ValueError:
        return f"{host}:{port}"


def _fast(now, what: str):
    """A method's fast path for the native server (``native.Listener.fast``), its failures answered as
    ``_unary``'s handler answers them: a GepoolError with its status, anything else INTERNAL, logged."""
    from gepool.grpc import native

    def fast(raw: bytes, peer_text: str, done) -> bool:
        def answered(reply, exc: BaseException | None) -> None:
            if exc is not None and not isinstance(exc, grpc.aio.AbortError):
                if isinstance(exc, errors.GepoolError):
                    exc = native.Abort(status_of(exc), exc.message)
                else:
                    log.error("internal error on %s", what, exc_info=exc)
                    exc = native.Abort(grpc.StatusCode.INTERNAL, errors.INTERNAL_MESSAGE)
            done(reply, exc)

        try:
            return now(raw, peer_text, answered)
        except Exception as exc:  # after a request was taken, or before: answered once either way (native)
            answered(None, exc)
            return True
    return fast


class Restricted(grpc.aio.ServerInterceptor):
    """``--grpc-restricted-protocol`` on grpc.aio: a refused call gets a handler that answers it UNAVAILABLE,
    one that takes its requests as a stream, so that grpc.aio waits for none of them."""

    def __init__(self, restrictions: GrpcRestrictions) -> None:
        self.restrictions = restrictions

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        path = details.method.encode()
        if handler is None or path not in self.restrictions.by_path:
            return handler
        metadata: dict[bytes, bytes] = {}
        for key, value in details.invocation_metadata or ():
            if isinstance(value, str):  # (a "-bin" key's value is bytes: never a restriction's)
                metadata.setdefault(key.encode(), value.encode())
        text = self.restrictions.refusal(path, metadata)
        if text is None:
            return handler

        async def refuse(requests, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, text)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.stream_unary_rpc_method_handler(refuse)


def methods(service: InferenceService) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
    """Every RPC the port serves, by service and method name."""
    table = {SERVICE: inference_methods(service), HEALTH_SERVICE: health_methods(Health(service))}
    reflection = Reflection([SERVICE, HEALTH_SERVICE])
    for name in REFLECTION_SERVICES:
        table[name] = reflection.methods()
    return table


async def start(gw, host: str, port: int, kind: str = DEFAULT_GRPC_SERVER, socks: list | None = None,
                restrictions: GrpcRestrictions | None = None):
    """Listens on host:port (refusing a port another process holds), or for the native server on the
    listening sockets ``socks`` where given, and serves until ``stop``. ``restrictions``: Triton's
    ``--grpc-restricted-protocol`` groups."""
    restrictions = restrictions or GrpcRestrictions()
    service = InferenceService(gw, host, port, restrictions)
    table = methods(service)
    if kind == "native":
        from gepool.grpc import native

        listener = native.Listener({f"/{name}/{method}": h for name, handlers in table.items()
                                    for method, h in handlers.items()}, host, port, gw.body_limit, socks,
                                   restrictions)
        listener.fast[f"/{SERVICE}/ModelInfer".encode()] = _fast(service.infer_now, "ModelInfer")
        try:
            await listener.start()
        except OSError as exc:
            raise errors.Unavailable(f"cannot listen for gRPC on {_address(host, port)}: {exc}") from None
        return listener
    if socks:
        raise errors.Unavailable("grpc.aio cannot serve a listening socket it did not bind; start it with a port")
    server = grpc.aio.server(interceptors=[Restricted(restrictions)] if restrictions.by_path else None, options=[
        ("grpc.max_receive_message_length", gw.max_body),
        ("grpc.max_send_message_length", -1),  # outputs are bounded by the pool's slots
        ("grpc.so_reuseport", 0),  # else a second server binds the same port and steals half the calls
    ])
    for service, handlers in table.items():
        server.add_registered_method_handlers(service, handlers)
    try:
        bound = server.add_insecure_port(_address(host, port))
    except RuntimeError as exc:
        raise errors.Unavailable(f"cannot listen for gRPC on {_address(host, port)}: {exc}") from None
    if bound != port:
        raise errors.Unavailable(f"cannot listen for gRPC on {_address(host, port)}")
    await server.start()
    return server


async def stop(server) -> None:
    """Calls in flight get STOP_GRACE_S to finish (a grpc.aio server or a native Listener alike)."""
    await server.stop(STOP_GRACE_S)
