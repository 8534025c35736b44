"""The gateway under the peer harness's load: wrk (KServe v2 JSON), perf_analyzer (binary tensors over HTTP)
and perf_analyzer over gRPC, with the CPU each process of the pool spends per request (benchmarks/README.md).

    python benchmarks/gateway_bench.py [--seconds 10] [--levels 1,8,64] [--models tiny,mlp]
        [--tools wrk,pa,grpc,stream,wrkbin,h2grpc] [--sidecars N] [--profile-sidecar FILE.prof]

perf_analyzer spends several times wrk's CPU per request, which on two cores it takes from the pool: to
compare the three protocols' cost to the sidecar, ``wrkbin`` posts the binary tensor extension with wrk and
``h2grpc`` posts gRPC ModelInfer frames with h2load (nghttp2-client: one connection, as many streams as the
level), each the same row as wrk's JSON body, both clients in C.

Both models get the peers' batching settings (max_batch_size 32, preferred [8, 16, 32], 1 ms delay).
CPU per request is utime+stime from /proc/PID/stat over the level divided by the requests the pool
counted over the same window: on a shared host that is the figure to compare, not requests/s.
"""

import argparse
import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

SHAPES = {"tiny": ("INPUT0", 16), "mlp": ("INPUT", 1024)}
PEER_BATCHING = """dynamic_batching {
  preferred_batch_size: [ 8, 16, 32 ]
  max_queue_delay_microseconds: 1000
}
"""
TICK = os.sysconf("SC_CLK_TCK")
WRK_SCRIPT = """local f = assert(io.open("%s", "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
"""


def make_repo() -> str:
    """tiny and the MLP, both under the peers' batching settings."""
    import make_models

    repo = tempfile.mkdtemp(prefix="gepool-gwbench-")
    make_models.make_tiny(repo, max_batch=32)
    make_models.make_mlp(repo)
    for model in ("tiny", "mlp"):
        path = f"{repo}/{model}/config.pbtxt"
        with open(path) as f:
            text = f.read()
        text = re.sub(r"dynamic_batching \{.*?\}\n", PEER_BATCHING, text, flags=re.S)
        text = re.sub(r'parameters \{ key: "batch_policy".*\n', "", text)
        with open(path, "w") as f:
            f.write(text)
    return repo


@contextlib.contextmanager
def served(prefix: str):
    """A pool of ``make_repo``'s models serving HTTP on a free port: (the pool, its URL, a scratch folder named
    with ``prefix``), the repository and the folder removed afterwards."""
    from gepool import Pool

    repo = make_repo()
    workdir = tempfile.mkdtemp(prefix=prefix)
    port = free_port()
    try:
        with Pool(repo, http_port=port, metrics_port=0) as pool:
            yield pool, f"http://127.0.0.1:{port}", workdir
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes(front_pid: int, sidecar_pid: int | None) -> dict[str, int]:
    """{label: pid}: the front, the sidecar (and its JSON helper), each worker."""
    out = {"front": front_pid}
    sidecar_tree = set()
    if sidecar_pid is not None:
        out["sidecar"] = sidecar_pid
        sidecar_tree = set(descendants(sidecar_pid))
        for i, pid in enumerate(sorted(sidecar_tree)):
            out[f"sidecar-helper{i}"] = pid
    workers = 0
    for pid in sorted(descendants(front_pid)):
        if pid == sidecar_pid or pid in sidecar_tree:
            continue
        if "_gateway_main" in cmdline(pid):  # with several sidecars: sidecar, sidecar2, sidecar3, ...
            n = sum(k.startswith("sidecar") and "helper" not in k for k in out)
            label = "sidecar" if n == 0 else f"sidecar{n + 1}"
            out[label] = pid
            for i, h in enumerate(sorted(descendants(pid))):
                out[f"{label}-helper{i}"] = h
                sidecar_tree.add(h)
            continue
        if "resource_tracker" in cmdline(pid):
            continue
        out[f"worker{workers}"] = pid
        workers += 1
    return out


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def json_body(model: str) -> bytes:
    import json

    name, width = SHAPES[model]
    x = np.random.default_rng(0).standard_normal(width).astype(np.float32)
    return json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": [1, width],
                                   "data": x.tolist()}]}).encode()


def run_wrk(url: str, model: str, conc: int, seconds: float, workdir: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> dict:
    path = os.path.join(workdir, f"{model}.body")
    with open(path, "wb") as f:
        f.write(json_body(model) if body is None else body)
    script = os.path.join(workdir, f"{model}.lua")
    with open(script, "w") as f:
        f.write(WRK_SCRIPT % path + "".join(f'wrk.headers["{k}"] = "{v}"\n'
                                             for k, v in (headers or {"Content-Type": "application/json"}).items()))
    proc = subprocess.run(["wrk", "-t1", f"-c{conc}", f"-d{max(1, round(seconds))}s", "--latency", "-s", script,
                           f"{url}/v2/models/{model}/infer"], capture_output=True, text=True)
    text = proc.stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        if m is None:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errs = re.search(r"Socket errors:.*", text)
    done = re.search(r"(\d+) requests in", text)
    return {"rps": float(rps.group(1)) if rps else float("nan"), "p50_ms": ms("50"), "p99_ms": ms("99"),
            "answered": int(done.group(1)) if done else 0,
            "errors": (int(bad.group(1)) if bad else 0), "socket_errors": errs.group(0) if errs else "",
            "raw": text if rps is None else ""}


def binary_body(model: str) -> tuple[bytes, int]:
    """The binary extension's body of wrk's row (its answer asked as binary data too) and its JSON header's length."""
    import json

    name, width = SHAPES[model]
    x = np.random.default_rng(0).standard_normal(width).astype(np.float32)
    header = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": [1, width],
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    return header + x.tobytes(), len(header)


def run_wrkbin(url: str, model: str, conc: int, seconds: float, workdir: str) -> dict:
    body, header_length = binary_body(model)
    return run_wrk(url, model, conc, seconds, workdir, body=body, headers={
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_length)})


def grpc_frame(model: str) -> bytes:
    """wrk's row as one gRPC ModelInfer message, framed (the flag byte, the length, the message)."""
    from gepool.grpc import grpc_service_pb2 as pb

    name, width = SHAPES[model]
    x = np.random.default_rng(0).standard_normal(width).astype(np.float32)
    msg = pb.ModelInferRequest(model_name=model, inputs=[
        pb.ModelInferRequest.InferInputTensor(name=name, datatype="FP32", shape=[1, width])],
        raw_input_contents=[x.tobytes()]).SerializeToString()
    return b"\0" + len(msg).to_bytes(4, "big") + msg


def run_h2grpc(url: str, model: str, conc: int, seconds: float, workdir: str) -> dict:
    if shutil.which("h2load") is None:
        return {"rps": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan"), "errors": 0,
                "raw": "h2load not found (apt-get install nghttp2-client)"}
    data = os.path.join(workdir, f"{model}.grpc")
    with open(data, "wb") as f:
        f.write(grpc_frame(model))
    log = os.path.join(workdir, "h2load.log")
    proc = subprocess.run(["h2load", "-c1", f"-m{conc}", f"-D{max(1, round(seconds))}", "-d", data,
                           "-H", "content-type: application/grpc", "-H", "te: trailers", f"--log-file={log}",
                           f"http://{url}/inference.GRPCInferenceService/ModelInfer"],
                          capture_output=True, text=True)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", proc.stdout)
    rps = re.search(r"finished in [\d.]+\w*, ([\d.]+) req/s", proc.stdout)
    times = []
    if os.path.exists(log):
        with open(log) as f:
            times = sorted(int(line.split()[2]) for line in f if line.strip())
        os.unlink(log)
    if done is None or rps is None or not times:
        return {"rps": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan"), "errors": 0,
                "raw": proc.stdout[-800:] + proc.stderr[-800:]}
    # (a gRPC failure is status 200 with a grpc-status trailer: the pool's count of requests shows it)
    return {"rps": float(rps.group(1)), "p50_ms": times[len(times) // 2] / 1000,
            "p99_ms": times[min(len(times) - 1, len(times) * 99 // 100)] / 1000,
            "errors": int(done.group(1)) - int(done.group(2)), "raw": ""}


def perf_analyzer_env() -> tuple[str, dict] | None:
    exe = shutil.which("perf_analyzer", path=os.pathsep.join([os.path.join(ROOT, ".perf_analyzer"),
                                                              os.environ.get("PATH", "")]))
    if exe is None:
        return None
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime

        lib = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join([lib, env.get("LD_LIBRARY_PATH", "")])
    except ImportError:
        pass
    return exe, env


def run_pa(url: str, model: str, conc: int, seconds: float, workdir: str, protocol: str = "http",
           streaming: bool = False) -> dict:
    found = perf_analyzer_env()
    if found is None:
        return {"rps": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan"), "errors": 0,
                "raw": "perf_analyzer not found (.ci/run extracts it into .perf_analyzer/)"}
    exe, env = found
    out = os.path.join(workdir, "pa.csv")
    # three windows of a third of the level each; a shared host never passes the stability check
    window_ms = max(300, int(seconds * 1000 / 3))
    proc = subprocess.run([exe, "-m", model, "-u", url.removeprefix("http://"), "-i", protocol,
                           "--concurrency-range", str(conc), "--measurement-interval", str(window_ms),
                           "--stability-percentage", "1000", "--max-trials", "3", "-f", out,
                           *(["--streaming"] if streaming else [])],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"rps": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan"), "errors": 0,
                "raw": (proc.stdout[-800:] + proc.stderr[-800:])}
    import csv

    with open(out) as f:
        row = next(csv.DictReader(f))
    os.unlink(out)
    return {"rps": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1000,
            "p99_ms": float(row["p99 latency"]) / 1000, "errors": 0, "raw": ""}


def level(tool, url: str, client, procs: dict[str, int], model: str, conc: int, seconds: float,
          workdir: str) -> dict:
    from gepool.bench.results import server_window

    before_stats = client.stats()[model]
    before = {label: cpu_seconds(pid) for label, pid in procs.items()}
    result = tool(url, model, conc, seconds, workdir)
    after = {label: cpu_seconds(pid) for label, pid in procs.items()}
    window = server_window(before_stats, client.stats()[model])
    n = max(window["requests"], 1)
    result["requests"] = window["requests"]
    result["avg_batch"] = window["avg_batch_size"]
    result["cpu_us"] = {label: (after[label] - before[label]) / n * 1e6 for label in procs}
    return result


# cProfile on the process's CPU clock: on a shared host, wall time would charge other processes' turns
PROFILED_SIDECAR = """import cProfile, sys, time
from gepool.http import server
profile = cProfile.Profile(time.process_time)
try:
    profile.runcall(server.main, sys.argv[2:])
finally:
    profile.dump_stats(sys.argv[1])
"""


def start_profiled_sidecar(endpoint: str, port: int, profile: str, http_server: str | None,
                           grpc_port: int = 0) -> subprocess.Popen:
    """The sidecar as gepool starts it, under cProfile (its stats written when it is stopped)."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", PROFILED_SIDECAR, profile, "--endpoint", endpoint,
                             "--http-port", str(port), "--metrics-port", "0", "--ready-fd", str(write_fd),
                             *(["--http-server", http_server] if http_server else []),
                             *(["--grpc-port", str(grpc_port)] if grpc_port else [])],
                            pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
    os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        if reader.readline().strip() != "ready":
            proc.kill()
            raise SystemExit("the profiled sidecar did not start")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="per level and tool")
    parser.add_argument("--levels", default="1,8,64", help="client concurrencies")
    parser.add_argument("--models", default="tiny,mlp")
    parser.add_argument("--tools", default="wrk,pa", help="wrk (JSON bodies), pa (perf_analyzer, binary), grpc "
                        "(perf_analyzer over gRPC), stream (the same, ModelStreamInfer), wrkbin (wrk, binary) "
                        "and/or h2grpc (h2load, gRPC)")
    parser.add_argument("--http-server", help="the sidecar's HTTP server: aiohttp, granian or httptools (default: "
                                              "the pool's)")
    parser.add_argument("--sidecars", type=int, help="sidecar processes sharing the port (default: the pool's)")
    parser.add_argument("--profile-sidecar", metavar="FILE",
                        help="run the sidecar under cProfile, write its stats here and print the top entries")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    models = args.models.split(",")
    tools = {"wrk": run_wrk, "pa": run_pa, "grpc": functools.partial(run_pa, protocol="grpc"), "wrkbin": run_wrkbin,
             "h2grpc": run_h2grpc, "stream": functools.partial(run_pa, protocol="grpc", streaming=True)}
    chosen = [(t, tools[t]) for t in args.tools.split(",")]
    if shutil.which("wrk") is None and any(t in ("wrk", "wrkbin") for t, _ in chosen):
        raise SystemExit("wrk is not installed")

    from gepool import Pool

    repo = make_repo()
    workdir = tempfile.mkdtemp(prefix="gepool-gwbench-run-")
    port = free_port()
    rows = []
    sidecar = None
    try:
        extra = {"http_server": args.http_server} if args.http_server else {}  # older trees lack it
        if args.sidecars is not None:
            extra["sidecars"] = args.sidecars
        grpc_port = free_port() if any(t in ("grpc", "h2grpc", "stream") for t, _ in chosen) else 0
        if grpc_port:
            extra["grpc_port"] = 0 if args.profile_sidecar else grpc_port
        with Pool(repo, http_port=0 if args.profile_sidecar else port, metrics_port=0, **extra) as pool:
            if args.profile_sidecar:
                sidecar = start_profiled_sidecar(pool.endpoint, port, os.path.abspath(args.profile_sidecar),
                                                 args.http_server, grpc_port)
            urls = {"wrk": f"http://127.0.0.1:{port}", "pa": f"http://127.0.0.1:{port}",
                    "grpc": f"127.0.0.1:{grpc_port}", "wrkbin": f"http://127.0.0.1:{port}",
                    "h2grpc": f"127.0.0.1:{grpc_port}", "stream": f"127.0.0.1:{grpc_port}"}
            client = pool.client()
            procs = processes(pool.process.pid, sidecar.pid if sidecar else None)
            print("processes:", " ".join(f"{k}={v}" for k, v in procs.items()), flush=True)
            for model in models:
                run_wrk(urls["wrk"], model, 8, 1.0, workdir) if shutil.which("wrk") else None  # warm-up
                for name, tool in chosen:
                    for conc in levels:
                        r = level(tool, urls[name], client, procs, model, conc, args.seconds, workdir)
                        rows.append((model, name, conc, r))
                        cpu = " ".join(f"{k} {v:.0f}" for k, v in r["cpu_us"].items())
                        print(f"{model:5s} {name:6s} c={conc:<3d} {r['rps']:8.0f} req/s p50 {r['p50_ms']:7.2f} "
                              f"p99 {r['p99_ms']:7.2f} ms  batch {r['avg_batch']:5.1f}  errors {r['errors']}  "
                              f"CPU us/req: {cpu}", flush=True)
                        if r.get("raw"):
                            print(r["raw"])
    finally:
        if sidecar is not None:
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(30)
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    labels = sorted({k for *_, r in rows for k in r["cpu_us"]}, key=lambda k: (k != "sidecar", k != "front", k))
    print(f"{'model':5s} {'tool':6s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'batch':>5s} "
          + " ".join(f"{k + ' us':>12s}" for k in labels))
    for model, name, conc, r in rows:
        print(f"{model:5s} {name:6s} {conc:4d} {r['rps']:8.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
              f"{r['avg_batch']:5.1f} " + " ".join(f"{r['cpu_us'].get(k, float('nan')):12.0f}" for k in labels))
    print(f"(CPU us per request: utime+stime over the level / requests the pool counted; {time.strftime('%F %T')})")
    if args.profile_sidecar:
        import pstats

        pstats.Stats(args.profile_sidecar).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
