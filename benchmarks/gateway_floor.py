"""The sidecar's CPU per request against the least a Python server on uvloop spends on the same wrk load.

    python benchmarks/gateway_floor.py [--rounds 2] [--seconds 6] [--models mlp] [--levels 64] [--by-library]

Three floors, each a bare ``asyncio.Protocol`` on uvloop that reads wrk's KServe JSON request (the body of
``gateway_bench.py``'s wrk) and answers it with no checks:

- ``http``: a fixed answer of the model's output size, made once: the kernel's TCP loopback, uvloop and the
  least Python a request can take;
- ``codecs``: the request's data read by simdjson into float32 and the answer's doubles written by orjson,
  as gepool's JSON route does (the answer is the input, cut to the output's size): the floor of any Python
  gateway that speaks this JSON;
- ``model``: the same codecs around the model itself. What one loop pass reads goes, in messages of at most
  48 KiB as the sidecar's groups go, over a SOCK_SEQPACKET socket to a forked child, which runs what is
  waiting (up to 32 rows) as one batch in onnxruntime (set up as gepool's worker) and sends each message
  its rows back: the least a gateway with a process hop to its model can spend, at the rate the model allows.

Then gepool's sidecar under the same load (``gateway_bench.py``'s pool: the peers' batching, its default HTTP
server), alternating with the floors in rounds. What the sidecar spends over the model floor is its own
route: HTTP checks, the learnt body, the lane protocol both ways, groups, the answer's assembly. CPU per
request is utime+stime of the server's process alone (not the model floor's child, as not gepool's front and
worker) over the level, divided by the requests answered (wrk's count for a floor, the pool's for gepool).

``--by-library`` also samples each server's process with ``perf record -e cpu-clock`` over its level (Debian's
linux-perf) and splits its CPU per request by the library it ran in (``perf report --sort dso``): the interpreter,
the kernel, orjson, simdjson, libc, numpy, uvloop. Where gepool spends more than the model floor shows which of
them the difference lies in.
"""

import argparse
import asyncio
import contextlib
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
from collections import deque

import gateway_bench
import numpy as np

from gepool._groups import GROUP_MAX_BYTES
from gepool.workers.backends.onnx import DEFAULT_ALLOW_SPINNING

OUT_WIDTH = {"tiny": 16, "mlp": 1000}  # the model's answer: as many floats as gepool writes back
FLOORS = ("http", "codecs", "model")
MAX_BATCH = 32  # the peers' batching: max_batch_size 32
LIBRARIES = {"libpython": "python", "[kernel": "kernel", "orjson": "orjson", "csimdjson": "simdjson", "libc.": "libc",
             "_multiarray": "numpy", "loop.cpython": "uvloop"}  # perf's dso name starts with: the column


def run_model(lane: socket.socket, model: str) -> None:
    """The front and worker's stand-in (a forked child): the messages waiting on ``lane``, up to MAX_BATCH
    rows, run as one batch by onnxruntime set up as gepool's worker sets it up (every core), each
    message's rows of the answer sent back; until the server is gone."""
    import onnxruntime as ort

    repo = gateway_bench.make_repo()
    options = ort.SessionOptions()  # as gepool's onnx backend sets it up on its own
    options.intra_op_num_threads = len(os.sched_getaffinity(0))
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", DEFAULT_ALLOW_SPINNING)
    session = ort.InferenceSession(f"{repo}/{model}/1/model.onnx", options, providers=["CPUExecutionProvider"])
    shutil.rmtree(repo, ignore_errors=True)
    (meta,) = session.get_inputs()
    width = meta.shape[1]
    lane.send(b"ready")
    later = None  # a message that would have taken the batch past MAX_BATCH rows: the next batch's first
    try:
        while True:
            msg = later if later is not None else lane.recv(1 << 20)
            later = None
            if not msg:  # the server is gone
                break
            msgs = [np.frombuffer(msg, np.float32).reshape(-1, width)]
            rows = len(msgs[0])
            while rows < MAX_BATCH:
                try:
                    more = lane.recv(1 << 20, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if not more:
                    break
                more_rows = np.frombuffer(more, np.float32).reshape(-1, width)
                if rows + len(more_rows) > MAX_BATCH:
                    later = more
                    break
                msgs.append(more_rows)
                rows += len(more_rows)
            (out,) = session.run(None, {meta.name: np.concatenate(msgs)})
            at = 0
            for m in msgs:
                lane.send(np.ascontiguousarray(out[at:at + len(m)]).tobytes())
                at += len(m)
    except OSError:
        pass
    os._exit(0)


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
    status = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"

    def reply(transport, y: np.ndarray) -> None:
        out = head + orjson.dumps(np.resize(y, width).astype(np.float64), option=orjson.OPT_SERIALIZE_NUMPY) + b"}"
        transport.write(status % len(out) + out)

    def read(body: bytes) -> np.ndarray:
        data = parser.parse(body)["inputs"][0]["data"]
        return np.frombuffer(data.as_buffer(of_type="d"), np.float64).astype(np.float32)

    lane, waiting, queued = None, deque(), []
    if floor == "model":
        lane, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.fork() == 0:
            lane.close()
            run_model(other, model)
        other.close()
        if lane.recv(16) != b"ready":  # its model made and loaded: no request waits for that
            raise SystemExit("the model floor's child did not start")

    outq: deque = deque()  # (message, its requests' transports) the socket had no room for yet
    writing = False  # whether the loop watches the socket for room

    def flush() -> None:
        # what this loop pass read goes in messages of at most GROUP_MAX_BYTES and MAX_BATCH rows (the child's
        # batches are whole messages), as the sidecar's groups go
        rows = max(1, min(MAX_BATCH, GROUP_MAX_BYTES // queued[0][1].nbytes))
        for at in range(0, len(queued), rows):
            batch = queued[at:at + rows]
            outq.append((b"".join(x.tobytes() for _, x in batch), [t for t, _ in batch]))
        queued.clear()
        pump()

    def pump() -> None:
        nonlocal writing
        while outq:
            msg, transports = outq[0]
            try:
                lane.send(msg, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if not writing:
                    asyncio.get_running_loop().add_writer(lane.fileno(), pump)
                    writing = True
                return
            outq.popleft()
            waiting.append(transports)
        if writing:
            asyncio.get_running_loop().remove_writer(lane.fileno())
            writing = False

    def answered() -> None:
        while True:
            try:
                msg = lane.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if not msg:  # (no answer can come any more: the run fails loudly, not at wrk's timeouts)
                print("the model floor's child is gone", file=sys.stderr, flush=True)
                os._exit(1)
            rows = np.frombuffer(msg, np.float32).reshape(len(waiting[0]), -1)
            for transport, y in zip(waiting.popleft(), rows):
                if not transport.is_closing():  # (wrk hung up at the end of its run)
                    reply(transport, y)

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
                body = buf[end + 4:end + 4 + size]
                buf = buf[end + 4 + size:]
                if floor == "http":
                    self.transport.write(status % len(fixed) + fixed)
                elif floor == "codecs":
                    reply(self.transport, read(body))
                else:
                    if not queued:
                        asyncio.get_running_loop().call_soon(flush)
                    queued.append((self.transport, read(body)))
            self.buf = buf

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if lane is not None:
            loop.add_reader(lane.fileno(), answered)
        server = await loop.create_server(Floor, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


@contextlib.contextmanager
def sampled(pid: int | None, shares: dict):
    """With a pid: ``perf record`` on that process while the block runs, then ``shares`` filled with each
    library's share of its samples ({column: fraction}, the rest under "other"). Without one, nothing."""
    if pid is None:
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "1999", "-p", str(pid), "-o", data],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield
        finally:
            perf.send_signal(signal.SIGINT)
            perf.wait()
        text = subprocess.run(["perf", "report", "-i", data, "--sort", "dso", "--stdio", "-q"], capture_output=True,
                              text=True).stdout
    for line in text.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
        if found is None:
            continue
        column = next((c for start, c in LIBRARIES.items() if found.group(2).startswith(start)), "other")
        shares[column] = shares.get(column, 0.0) + float(found.group(1)) / 100
    if not shares:
        raise SystemExit(f"perf recorded nothing for pid {pid}:\n{text[-1500:]}")


def floor_level(floor: str, model: str, conc: int, seconds: float, by_library: bool = False) -> dict:
    """One level against a fresh floor server: req/s, p99 and its CPU µs per request (and by library)."""
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
        shares: dict[str, float] = {}
        with sampled(proc.pid if by_library else None, shares):
            before = gateway_bench.cpu_seconds(proc.pid)
            r = gateway_bench.run_wrk(url, model, conc, seconds, workdir)  # the client gepool gets below
            used = gateway_bench.cpu_seconds(proc.pid) - before
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    if not r["answered"]:
        raise SystemExit(f"wrk against the {floor} floor failed:\n{r['raw'][-1500:]}")
    us = used / r["answered"] * 1e6
    return {"rps": r["rps"], "p99_ms": r["p99_ms"], "us": us, "errors": r["errors"],
            "libraries": {c: share * us for c, share in shares.items()}}


def gepool_level(model: str, conc: int, seconds: float, by_library: bool = False) -> dict:
    """One level against a fresh pool, as gateway_bench.py measures it."""
    with gateway_bench.served("gepool-floor-") as (pool, url, workdir):
        gateway_bench.run_wrk(url, model, 8, 1.0, workdir)  # warm-up
        procs = gateway_bench.processes(pool.process.pid, None)
        shares: dict[str, float] = {}
        with sampled(procs["sidecar"] if by_library else None, shares):
            r = gateway_bench.level(gateway_bench.run_wrk, url, pool.client(), procs, model, conc, seconds, workdir)
    us = r["cpu_us"]["sidecar"]
    return {"rps": r["rps"], "p99_ms": r["p99_ms"], "us": us, "errors": r["errors"],
            "libraries": {c: share * us for c, share in shares.items()}}


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0, help="per server, level and round")
    p.add_argument("--models", default="mlp")
    p.add_argument("--levels", default="64")
    p.add_argument("--by-library", action="store_true", help="split each server's CPU by library (perf)")
    args = p.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed")
    if args.by_library and shutil.which("perf") is None:
        raise SystemExit("--by-library needs perf (apt-get install linux-perf)")
    models, levels = args.models.split(","), [int(c) for c in args.levels.split(",")]
    servers = [*FLOORS, "gepool"]
    results: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]  # drift falls on all alike
        for model in models:
            for conc in levels:
                for server in order:
                    got = gepool_level(model, conc, args.seconds, args.by_library) if server == "gepool" \
                        else floor_level(server, model, conc, args.seconds, args.by_library)
                    results.setdefault((model, conc, server), []).append(got)
                    print(f"round {r + 1} {model:5s} c={conc:<3d} {server:7s} {got['rps']:8.0f} req/s "
                          f"p99 {got['p99_ms']:7.2f} ms  {got['us']:6.1f} us/req  errors {got['errors']}", flush=True)
    print(f"\nmedians over {args.rounds} rounds: the server's CPU us per request ({time.strftime('%F %T')})")
    print(f"{'model':5s} {'conc':>4s} {'http':>7s} {'codecs':>7s} {'model':>7s} {'gepool':>7s} "
          f"{'over codecs':>11s} {'over model':>10s}")
    for model in models:
        for conc in levels:
            med = {s: statistics.median(x["us"] for x in results[(model, conc, s)]) for s in servers}
            print(f"{model:5s} {conc:4d} {med['http']:7.1f} {med['codecs']:7.1f} {med['model']:7.1f} "
                  f"{med['gepool']:7.1f} {med['gepool'] - med['codecs']:11.1f} {med['gepool'] - med['model']:10.1f}")
    if args.by_library:
        columns = [*dict.fromkeys(LIBRARIES.values()), "other"]
        print(f"\nmedians over {args.rounds} rounds: the server's CPU us per request, by library (perf's samples)")
        print(f"{'model':5s} {'conc':>4s} {'server':14s} " + " ".join(f"{c:>8s}" for c in columns))
        for model in models:
            for conc in levels:
                med = {s: {c: statistics.median(x["libraries"].get(c, 0.0) for x in results[(model, conc, s)])
                           for c in columns} for s in servers}
                for server in ("model", "gepool"):
                    print(f"{model:5s} {conc:4d} {server:14s} " + " ".join(f"{med[server][c]:8.1f}" for c in columns))
                print(f"{model:5s} {conc:4d} {'gepool - model':14s} "
                      + " ".join(f"{med['gepool'][c] - med['model'][c]:8.1f}" for c in columns))


if __name__ == "__main__":
    main()
