"""Instructions per request through the sidecar's whole infer route, in one process, counted by callgrind.

    python benchmarks/route_instructions.py [--model tiny|mlp] [--few 100] [--many 1100] [--base REV]

``route_inplace.py``'s setup (the native server's connection and handlers, a stand-in front answering after
one loop pass, no socket) runs ``--few`` and then ``--many`` requests under ``valgrind --tool=callgrind``; the
difference of the two totals over the difference of the counts is what one request costs, start-up left out.
Eight bodies of different numbers (and so different lengths) take turns, as a client's would. With ``--base``
the same is counted for that revision's package (exported with ``git archive``), so two trees compare on a
figure a busy host does not move (the hash seed fixed, so that set and dict layouts repeat). Needs valgrind
(``apt-get install valgrind``); about a minute per count.
"""

import argparse
import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {"tiny": (16, 16), "mlp": (1024, 1000)}  # floats in, floats out
# the hash seed fixed, so that set and dict layouts repeat; no OpenBLAS thread: numpy's starts one per spare core,
# which spins for a while after start-up (counted by callgrind as many instructions as the host's load lets it run)
FIXED_ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}


def drive(model: str, requests: int) -> None:
    """The route ``requests`` times (run inside callgrind, from the tree on sys.path)."""
    import uvloop

    # the tree's own stand-ins (its route_inplace.py puts the tree first on sys.path, so gepool is the tree's)
    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
    from route_inplace import Front, Transport

    from gepool.http import native, rsgi, server

    async def run() -> None:
        width_in, width_out = SHAPES[model]
        rng = np.random.default_rng(0)
        gw = server.Gateway("ipc:///nonexistent")
        gw.client = Front(rng.standard_normal((1, width_out)).astype(np.float32))
        gw.connected.set()
        router = rsgi.Router()
        server.add_routes(gw, router)
        listener = native.Listener(router, "127.0.0.1", 0, 60.0, 1 << 26)
        listener.loop = asyncio.get_running_loop()
        listener.fast = {gw.infer: gw.infer_now}
        conn = native.Connection(listener)
        transport = Transport()
        conn.connection_made(transport)
        wires = []
        for _ in range(8):
            data = rng.standard_normal(width_in).astype(np.float32).tolist()
            body = json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, width_in],
                                           "data": data}]}).encode()
            wires.append(b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (model.encode(), len(body)) + body)
        gc.collect()
        gc.freeze()  # as the sidecar does once started
        for i in range(requests):
            transport.written = asyncio.Event()
            conn.data_received(wires[i % len(wires)])
            await transport.written.wait()
            await asyncio.sleep(0)
        if not transport.last.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the route answered {transport.last[:200]!r}")

    uvloop.run(run())


def count(tree: str, model: str, requests: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable, __file__,
             "--drive", model, str(requests)],
            cwd=tree, env={**os.environ, **FIXED_ENV, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"callgrind gave no count:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_request(tree: str, model: str, few: int, many: int) -> float:
    return (count(tree, model, many) - count(tree, model, few)) / (many - few)


def main() -> None:
    if sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2], int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--few", type=int, default=100)
    p.add_argument("--many", type=int, default=1100)
    p.add_argument("--base", help="a revision to count too")
    args = p.parse_args()
    trees = {"this tree": os.path.dirname(HERE)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            base = os.path.join(tmp, "base")
            os.makedirs(base)
            archive = subprocess.run(["git", "archive", args.base], cwd=trees["this tree"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
            trees = {args.base: base, **trees}
        figures = {name: per_request(tree, args.model, args.few, args.many) for name, tree in trees.items()}
    for name, value in figures.items():
        print(f"{args.model}: {name:12s} {value:12,.0f} instructions per request")
    if args.base:
        first, last = figures.values()
        print(f"{args.model}: change {100 * (last / first - 1):+.1f}%")


if __name__ == "__main__":
    main()
