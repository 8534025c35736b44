"""A prototype sidecar: Triton's gRPC inference service from a sync ``grpc.server`` (grpc_bench.py --compare-sync).

    python benchmarks/grpc_sync_proto.py --endpoint E --port P [--threads N]

ModelInfer runs in grpcio's handler thread with the sync library client (each thread its own lane to the
front, exchanged on in that thread); every other unary RPC runs the sidecar's own coroutine on this
process's asyncio loop while the handler thread waits (``asyncio.run_coroutine_threadsafe``). No streaming,
health or reflection: it serves what perf_analyzer asks, to compare with the grpc.aio sidecar. Prints
"ready" once it listens and stops on SIGTERM or SIGINT.
"""

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import threading

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gepool.client import Client  # noqa: E402
from gepool.common import errors, request_parameters  # noqa: E402
from gepool.grpc import grpc_service_pb2 as pb  # noqa: E402
from gepool.grpc import tensors  # noqa: E402
from gepool.grpc.service import SERVICE, InferenceService, parse_message, status_of  # noqa: E402
from gepool.http.server import REQUEST_TIMEOUT_S, Gateway  # noqa: E402
from gepool.ipc.protocol import Origin  # noqa: E402

log = logging.getLogger("gepool.grpc")


class FrontClient(Client):
    """The sync library client whose requests the pool counts as gRPC's."""

    def _encode(self, model, inputs, outputs, version, timeout, priority, origin=Origin.GRPC):
        return super()._encode(model, inputs, outputs, version, timeout, priority, Origin.GRPC)


def model_meta(client: Client, name: str, version_text: str) -> dict:
    meta = client.model_metadata(name)
    version = request_parameters.model_version(version_text)
    if version is not None and str(version) not in meta.get("versions", []):
        raise errors.ModelNotFound(f"Request for unknown model: '{meta['name']}' version {version} is not found")
    return meta


def infer(service: InferenceService, client: Client, request: pb.ModelInferRequest,
          peer_text: str) -> pb.ModelInferResponse:
    """InferenceService.infer in the calling thread: parsing, the front's answer and the response all here."""
    held: dict[str, object] = {}
    regions = service.gw.regions

    def acquire(name: str):
        if name not in held:
            held[name] = regions.acquire(service.caller(peer_text, "system shared memory"), name)
        return held[name]

    try:
        try:
            call = tensors.parse(request, lambda name, offset, size, limit: regions.read(
                acquire(name), offset, size, limit), service.gw.max_body)
            for o in call.outputs or []:
                if o.region is not None:
                    acquire(o.region)
        except errors.GepoolError:
            if request.model_name:
                model_meta(client, request.model_name, "")
            raise
        if not call.inputs:
            meta = model_meta(client, call.model, "")
            raise errors.InvalidArgument(f"expected {len(meta.get('inputs', []))} inputs but got 0 inputs for "
                                         f"model '{call.model}'")
        names = [o.name for o in call.outputs] if call.outputs is not None else None
        outputs = client.infer(call.model, call.inputs, names, version=call.version, timeout=call.timeout_s,
                               priority=call.priority)
        served = getattr(outputs, "model_version", None)
        served_text = str(served) if served is not None else (str(call.version) if call.version else "")
        return tensors.response(request.id, call, served_text, outputs,
                                lambda name, offset, size, data: regions.write(held[name], offset, size, data))
    finally:
        for region in held.values():
            regions.release(region)


def _answered(context: grpc.ServicerContext, what: str, run):
    try:
        return run()
    except errors.GepoolError as exc:
        context.abort(status_of(exc), exc.message)
    except Exception as exc:
        log.error("internal error on %s", what, exc_info=exc)
        context.abort(grpc.StatusCode.INTERNAL, errors.INTERNAL_MESSAGE)


def handlers(service: InferenceService, client_of, loop: asyncio.AbstractEventLoop) -> dict:
    out = {}
    for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        if m.client_streaming:
            continue
        request_cls, response_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        if m.name == "ModelInfer":
            def handler(raw, context):
                return _answered(context, "ModelInfer", lambda: infer(
                    service, client_of(), parse_message(pb.ModelInferRequest, raw), context.peer()))
        else:
            def handler(raw, context, method=getattr(service, m.name), request_cls=request_cls):
                return _answered(context, method.__name__, lambda: asyncio.run_coroutine_threadsafe(
                    method(parse_message(request_cls, raw), context), loop).result())
        out[m.name] = grpc.unary_unary_rpc_method_handler(handler, request_deserializer=None,
                                                          response_serializer=response_cls.SerializeToString)
    return out


async def serve(endpoint: str, port: int, threads: int) -> None:
    gw = Gateway(endpoint)
    connecting = asyncio.get_running_loop().create_task(gw.connect())
    lock, made = threading.Lock(), []

    def client_of() -> Client:
        if not made:
            with lock:
                if not made:
                    made.append(FrontClient(endpoint, timeout=REQUEST_TIMEOUT_S))
        return made[0]

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc-infer")
    server = grpc.server(pool, options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", gw.max_body),
                                        ("grpc.max_send_message_length", -1)])
    server.add_registered_method_handlers(SERVICE, handlers(InferenceService(gw, "127.0.0.1", port), client_of,
                                                            asyncio.get_running_loop()))
    if server.add_insecure_port(f"127.0.0.1:{port}") != port:
        raise SystemExit(f"cannot listen on 127.0.0.1:{port}")
    server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    done = server.stop(1.0)
    await asyncio.to_thread(done.wait)
    pool.shutdown()
    connecting.cancel()
    if made:
        made[0].close()
    if gw.client is not None:
        await gw.client.close()
    gw.regions.close()
    gw.offload.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", required=True, help="the pool's endpoint")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=8, help="grpcio's handler threads")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.endpoint, args.port, args.threads))


if __name__ == "__main__":
    main()
