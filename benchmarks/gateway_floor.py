"""The sidecar's CPU per request against the least any Python server on uvloop spends on the same wrk load.

    python benchmarks/gateway_floor.py [--rounds 2] [--seconds 6] [--models mlp] [--levels 64]

Two floors, each a bare ``asyncio.Protocol`` on uvloop that reads wrk's KServe JSON request (the body of
``gateway_bench.py``'s wrk) and answers it with no model, no pool and no checks:

- ``http``: a fixed answer of the model's output size, made once: the kernel's TCP loopback, uvloop and the
  least Python a request can take;
- ``codecs``: the same, but the request's data read by simdjson into float32 and the answer's doubles written
  by orjson, as gepool's JSON route does: the floor of any Python gateway that speaks this JSON.

Then gepool's sidecar under the same load (``gateway_bench.py``'s pool: the peers' batching, its default HTTP
server), alternating with the floors in rounds. What the sidecar spends over the codecs floor is its own
route: HTTP checks, the learnt body, the lane to the front both ways, groups, the answer's assembly.
CPU per request is utime+stime over the level divided by the requests answered (wrk's count for a floor, the
pool's for gepool).
"""

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import gateway_bench
import numpy as np

OUT_WIDTH = {"tiny": 16, "mlp": 1000}  # the model's answer: as many floats as gepool writes back
FLOORS = ("http", "codecs")


def serve(port: int, floor: str, model: str) -> None:
    """The floor server (a child process): until killed."""
    import orjson
    import simdjson
    import uvloop

    width = OUT_WIDTH[model]
    head = (b'{"model_name":"%s","model_version":"1","outputs":[{"name":"OUTPUT","datatype":"FP32","shape":[1,%d],'
            b'"data":' % (model.encode(), width))
    fixed = head + orjson.dumps(np.zeros(width), option=orjson.OPT_SERIALIZE_NUMPY) + b"}"
    parser = simdjson.Parser()

    def answer(body: bytes) -> bytes:
        if floor == "http":
            return fixed
        data = parser.parse(body)["inputs"][0]["data"]
        x = np.frombuffer(data.as_buffer(of_type="d"), np.float64).astype(np.float32)
        y = np.resize(x, width)
        return head + orjson.dumps(y.astype(np.float64), option=orjson.OPT_SERIALIZE_NUMPY) + b"}"

    class Floor(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            buf = self.buf + data if self.buf else data
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                at = buf[:end].lower().find(b"content-length:") + len(b"content-length:")
                size = int(buf[at:buf.index(b"\r\n", at)])
                if len(buf) < end + 4 + size:
                    break
                out = answer(buf[end + 4:end + 4 + size])
                buf = buf[end + 4 + size:]
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                     % len(out) + out)
            self.buf = buf

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Floor, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


def floor_level(floor: str, model: str, conc: int, seconds: float) -> dict:
    """One level against a fresh floor server: req/s, p99 and its CPU µs per request."""
    port = gateway_bench.free_port()
    workdir = tempfile.mkdtemp(prefix="gepool-floor-")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(port), floor, model])
    try:
        for _ in range(400):  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        gateway_bench.run_wrk(url, model, 8, 1.0, workdir)  # warm-up
        before = gateway_bench.cpu_seconds(proc.pid)
        r = gateway_bench.run_wrk(url, model, conc, seconds, workdir)  # the client gepool gets below
        used = gateway_bench.cpu_seconds(proc.pid) - before
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    if not r["answered"]:
        raise SystemExit(f"wrk against the {floor} floor failed:\n{r['raw'][-1500:]}")
    return {"rps": r["rps"], "p99_ms": r["p99_ms"], "us": used / r["answered"] * 1e6, "errors": r["errors"]}


def gepool_level(model: str, conc: int, seconds: float) -> dict:
    """One level against a fresh pool, as gateway_bench.py measures it."""
    from gepool import Pool

    repo = gateway_bench.make_repo()
    workdir = tempfile.mkdtemp(prefix="gepool-floor-")
    port = gateway_bench.free_port()
    try:
        with Pool(repo, http_port=port, metrics_port=0) as pool:
            url = f"http://127.0.0.1:{port}"
            gateway_bench.run_wrk(url, model, 8, 1.0, workdir)  # warm-up
            procs = gateway_bench.processes(pool.process.pid, None)
            r = gateway_bench.level(gateway_bench.run_wrk, url, pool.client(), procs, model, conc, seconds, workdir)
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rps": r["rps"], "p99_ms": r["p99_ms"], "us": r["cpu_us"]["sidecar"], "errors": r["errors"]}


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0, help="per server, level and round")
    p.add_argument("--models", default="mlp")
    p.add_argument("--levels", default="64")
    args = p.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed")
    models, levels = args.models.split(","), [int(c) for c in args.levels.split(",")]
    servers = [*FLOORS, "gepool"]
    results: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]  # drift falls on all alike
        for model in models:
            for conc in levels:
                for server in order:
                    got = gepool_level(model, conc, args.seconds) if server == "gepool" \
                        else floor_level(server, model, conc, args.seconds)
                    results.setdefault((model, conc, server), []).append(got)
                    print(f"round {r + 1} {model:5s} c={conc:<3d} {server:7s} {got['rps']:8.0f} req/s "
                          f"p99 {got['p99_ms']:7.2f} ms  {got['us']:6.1f} us/req  errors {got['errors']}", flush=True)
    print(f"\nmedians over {args.rounds} rounds: the server's CPU us per request ({time.strftime('%F %T')})")
    print(f"{'model':5s} {'conc':>4s} {'http floor':>10s} {'codecs floor':>12s} {'gepool':>7s} {'over codecs':>11s}")
    for model in models:
        for conc in levels:
            med = {s: statistics.median(x["us"] for x in results[(model, conc, s)]) for s in servers}
            print(f"{model:5s} {conc:4d} {med['http']:10.1f} {med['codecs']:12.1f} {med['gepool']:7.1f} "
                  f"{med['gepool'] - med['codecs']:11.1f}")


if __name__ == "__main__":
    main()
