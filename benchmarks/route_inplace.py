"""The sidecar's infer route in place: what parsing and encoding cost among everything else a request runs.

    python benchmarks/route_inplace.py [--model tiny|mlp] [--requests 3000] [--rounds 8]

One process, no socket and no pool: the sidecar's own HTTP server (``native.Connection`` on uvloop, the
handlers of ``server.py``) is fed a KServe v2 JSON request as the bytes wrk sends, and writes its answer
to a transport that only notes it; the front is a stand-in whose ``infer`` answers a fixed output
after one loop pass. Four variants alternate in rounds, each ``--requests`` requests: the whole route,
and the same with ``kserve.parse_request`` or ``kserve.encode_response`` (or both) replaced by one that
returns a result made before the clock starts. A fifth round of the whole route times the two calls
themselves. Figures: this process's CPU microseconds per request, the minimum and the median over the
rounds. "handler's task" is the whole route without its fast path (``Gateway.infer_now``), as a
request that the fast path leaves to the handler runs. The differences are what parsing and encoding
cost in place, next to what timeit gives for the same calls in a tight loop (printed last): small
calls cost about twice as much among the rest of the route as they do alone.
"""

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
import timeit

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gepool.http import kserve, native, rsgi, server  # noqa: E402

SHAPES = {"tiny": (16, 16), "mlp": (1024, 1000)}  # floats in, floats out


class Outputs(dict):
    model_version = 1


class Front:
    """The stand-in for the pool client: one loop pass, then the fixed output."""

    def __init__(self, output: np.ndarray) -> None:
        self.output = output

    async def infer(self, model, inputs, names, **kwargs) -> Outputs:
        await asyncio.sleep(0)
        return Outputs(OUTPUT=self.output)

    def submit(self, model, inputs, names, done, **kwargs) -> bool:
        asyncio.get_running_loop().call_soon(done, Outputs(OUTPUT=self.output), None)
        return True


class Transport:
    """Notes that an answer was written; everything else a transport is asked is a no-op."""

    def __init__(self) -> None:
        self.written: asyncio.Event | None = None
        self.last = b""

    def write(self, data) -> None:
        self.last = bytes(data[:12])
        self.written.set()

    def writelines(self, parts) -> None:
        self.write(parts[0])

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, *args, **kwargs):
        return None

    def pause_reading(self) -> None:
        pass

    resume_reading = close = abort = pause_reading


async def run(model: str, requests: int, rounds: int) -> None:
    width_in, width_out = SHAPES[model]
    rng = np.random.default_rng(0)
    output = rng.standard_normal((1, width_out)).astype(np.float32)
    gw = server.Gateway("ipc:///nonexistent")
    gw.client = Front(output)
    gw.connected.set()
    router = rsgi.Router()
    server.add_routes(gw, router)
    listener = native.Listener(router, "127.0.0.1", 0, 60.0, 1 << 26)
    listener.loop = asyncio.get_running_loop()
    fast = {gw.infer: gw.infer_now}
    conn = native.Connection(listener)
    transport = Transport()
    conn.connection_made(transport)
    body = json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, width_in],
                                   "data": rng.standard_normal(width_in).astype(np.float32).tolist()}]}).encode()
    wire = (b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (model.encode(), len(body))) + body
    parse, encode = kserve.parse_request, kserve.encode_response
    parsed = parse(body, None)
    encoded = encode(model, "1", parsed, {"OUTPUT": output})
    spent = {"parse": [0, 0], "encode": [0, 0]}

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name][0] += time.perf_counter_ns() - start
                spent[name][1] += 1
        return call

    variants = {
        "whole route": (parse, encode),
        "handler's task": (parse, encode),
        "without parse": (lambda *a, **k: parsed, encode),
        "without encode": (parse, lambda *a, **k: encoded),
        "without both": (lambda *a, **k: parsed, lambda *a, **k: encoded),
        "timed calls": (timed("parse", parse), timed("encode", encode)),
    }
    gc.collect()
    gc.freeze()  # as the sidecar does once started
    figures: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, (p, e) in variants.items():
                kserve.parse_request, kserve.encode_response = p, e
                listener.fast = {} if name == "handler's task" else fast
                start = time.process_time()
                for _ in range(requests):
                    transport.written = asyncio.Event()
                    conn.data_received(wire)
                    await transport.written.wait()
                    await asyncio.sleep(0)  # the handler's task ends
                figures[name].append((time.process_time() - start) / requests * 1e6)
                if not transport.last.startswith(b"HTTP/1.1 200"):
                    raise SystemExit(f"{name}: the route answered {transport.last!r}")
    finally:
        kserve.parse_request, kserve.encode_response = parse, encode
    print(f"{model}: {width_in} floats in, {width_out} out; CPU us per request over {rounds} rounds of {requests}")
    for name, values in figures.items():
        print(f"  {name:15s} min {min(values):7.1f}  median {statistics.median(values):7.1f}")
    whole = statistics.median(figures["whole route"])
    alone = {"parse": lambda: parse(body, None), "encode": lambda: encode(model, "1", parsed, {"OUTPUT": output})}
    for name, fn in alone.items():
        without = statistics.median(figures[f"without {name}"])
        tight = min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6
        total, calls = spent[name]
        # (a known body's shape or a known answer's text skips the call: then it is not timed in place)
        in_place = f"{total / calls / 1e3:6.1f} us in {calls} of {rounds * requests}" if calls else "never called"
        print(f"  {name}: whole - without {whole - without:6.1f} us; timed in place {in_place}; "
              f"timeit alone {tight:6.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--requests", type=int, default=3000, help="per variant and round")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    uvloop.run(run(args.model, args.requests, args.rounds))


if __name__ == "__main__":
    main()
