"""The gateway's gRPC ModelInfer in place: the fast path against the handler's task, CPU per request.

    python benchmarks/grpc_inplace.py [--model tiny|mlp] [--requests 3000] [--rounds 8] [--stream]

One process, no socket and no pool: the gateway's native gRPC server (``grpc/native.py``'s Connection on
uvloop, the methods of ``grpc/server.py``) is fed unary ModelInfer calls as HTTP/2 frames a client sends
(its repeated header block all indexed, the tensor in ``raw_input_contents``), one at a time, and writes
its answer to a transport that only notes it; the front is a stand-in whose ``infer`` answers a fixed
output after one loop pass. Two variants alternate in rounds, each ``--requests`` calls: "fast path"
(``InferenceService.infer_now``, as the gateway serves a call without a deadline) and "handler's task"
(the method's coroutine in a task, as a call with a deadline, or any call before the fast path, runs).
With ``--stream``, the same requests go as messages on one ModelStreamInfer call a round, sent from the
stream's loop ("stream, no task", as on the native server) or each by a task of its own ("stream, a task
each", as before).
Figures: this process's CPU microseconds per call, the minimum and the median over the rounds.
"""

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time

import numpy as np
import uvloop
from hpack import Encoder

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from route_inplace import Front  # noqa: E402  (its stand-in front: one loop pass, then the fixed output)

from gepool.grpc import grpc_service_pb2 as pb  # noqa: E402
from gepool.grpc import native  # noqa: E402
from gepool.grpc import server as grpc_server  # noqa: E402
from gepool.grpc.service import SERVICE, InferenceService  # noqa: E402
from gepool.http import server  # noqa: E402

SHAPES = {"tiny": (16, 16), "mlp": (1024, 1000)}  # floats in, floats out
PATH = f"/{SERVICE}/ModelInfer"
STREAM = f"/{SERVICE}/ModelStreamInfer"


class Transport:
    """Notes what was written; everything else a transport is asked is a no-op."""

    def __init__(self) -> None:
        self.written: asyncio.Event | None = None
        self.last = b""

    def write(self, data) -> None:
        self.last = bytes(data)
        if self.written is not None:
            self.written.set()

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 50000) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    resume_reading = close = abort = pause_reading


def _last_data(written: bytes) -> bytes:
    """The payload of the last DATA frame in what was written."""
    pos, last = 0, b""
    while pos + 9 <= len(written):
        length = int.from_bytes(written[pos:pos + 3], "big")
        if written[pos + 3] == native.DATA:
            last = written[pos + 9:pos + 9 + length]
        pos += 9 + length
    return last


async def run(model: str, requests: int, rounds: int, stream: bool) -> None:
    width_in, width_out = SHAPES[model]
    rng = np.random.default_rng(0)
    output = rng.standard_normal((1, width_out)).astype(np.float32)
    gw = server.Gateway("ipc:///nonexistent")
    gw.client = Front(output)
    gw.connected.set()
    service = InferenceService(gw, "127.0.0.1", 0)
    methods = {f"/{name}/{method}": h for name, handlers in grpc_server.methods(service).items()
               for method, h in handlers.items()}
    listener = native.Listener(methods, "127.0.0.1", 0, 1 << 26)
    listener.loop = asyncio.get_running_loop()
    fast = {PATH.encode(): grpc_server._fast(service.infer_now, "ModelInfer")}
    conn = native.Connection(listener)
    transport = Transport()
    conn.connection_made(transport)
    # the client's preface, and room for every answer this run sends on the connection and on a stream
    conn.data_received(native.PREFACE + native.frame(native.SETTINGS, 0, 0, native._SETTING.pack(4, native.MAX_WINDOW))
                       + native.frame(native.WINDOW_UPDATE, 0, 0, native._U32.pack(native.MAX_WINDOW - 65535)))
    for _ in range(3):  # its acknowledgement written before the clock starts
        await asyncio.sleep(0)
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT", datatype="FP32", shape=[1, width_in])
    request.raw_input_contents.append(rng.standard_normal(width_in).astype(np.float32).tobytes())
    message = request.SerializeToString()
    data = native._PREFIX.pack(0, len(message)) + message
    encoder = Encoder()
    head = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"), ("te", "trailers")]
    if stream:
        head = [(k, STREAM if k == ":path" else v) for k, v in head]
    # the first call's block fills the decoder's table; every later one is the same block, all indexed
    block, again = encoder.encode(head), encoder.encode(head)
    sid = 1
    gc.collect()
    gc.freeze()  # as the sidecar does once started
    figures: dict[str, list[float]] = {"stream, no task": [], "stream, a task each": []} if stream \
        else {"fast path": [], "handler's task": []}
    for _ in range(rounds):
        for name in figures:
            listener.fast = fast if name == "fast path" else {}
            service.stream_now = name == "stream, no task"
            streaming = name.startswith("stream")
            if streaming:  # one call for the round, each request a message on it
                conn.data_received(native.frame(native.HEADERS, native.END_HEADERS, sid, block))
                block = again
            start = time.process_time()
            for _ in range(requests):
                transport.written = asyncio.Event()
                if streaming:
                    conn.data_received(native.frame(native.DATA, 0, sid, data))
                else:
                    conn.data_received(native.frame(native.HEADERS, native.END_HEADERS, sid, block)
                                       + native.frame(native.DATA, native.END_STREAM, sid, data))
                    sid, block = sid + 2, again
                await transport.written.wait()
                await asyncio.sleep(0)  # the handler's task ends
            figures[name].append((time.process_time() - start) / requests * 1e6)
            await asyncio.sleep(0)
            if streaming:
                reply = pb.ModelStreamInferResponse.FromString(_last_data(transport.last)[5:])
                if reply.error_message or not reply.infer_response.raw_output_contents:
                    raise SystemExit(f"{name}: the stream answered {reply}")
                sid += 2
            elif not transport.last.endswith(native._TRAILERS_OK):
                raise SystemExit(f"{name}: the call did not end OK: {transport.last[-80:]!r}")
    print(f"{model}: {width_in} floats in, {width_out} out; CPU us per call over {rounds} rounds of {requests}")
    for name, values in figures.items():
        print(f"  {name:15s} min {min(values):7.1f}  median {statistics.median(values):7.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--requests", type=int, default=3000, help="per variant and round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--stream", action="store_true", help="ModelStreamInfer's two variants, not ModelInfer's")
    args = p.parse_args()
    uvloop.run(run(args.model, args.requests, args.rounds, args.stream))


if __name__ == "__main__":
    main()
