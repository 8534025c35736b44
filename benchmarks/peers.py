"""Peer servers for the benchmarks: PyTriton (Triton's own HTTP and gRPC fronts) and Mosec, onnxruntime inside.

    from peers import matched_repo, start_pytriton
    repo = matched_repo("bench-")                  # tiny and mlp, batching as the peers batch
    http_port, grpc_port, stop = start_pytriton(repo)
    ...                                            # KServe v2 on 127.0.0.1:http_port and :grpc_port
    stop()
    port, stop = start_mosec(repo)                 # POST /v2/models/<name>/infer with a KServe v2 JSON body

A peer runs in its own process (``python benchmarks/peers.py pytriton REPO ...``) under the interpreter
``$GEPOOL_PEER_PYTHON`` names (else ``.venv/peers/bin/python`` when it exists, else this one): PyTriton
0.7 pins numpy<2, so it lives in a virtual environment of its own (benchmarks/README.md). Each model in
the repository is ``<name>/1/model.onnx``; PyTriton's infer callable runs it with onnxruntime on
``threads`` threads, and Triton's dynamic batcher gathers the batches with the given limits.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("tiny", "mlp")
MAX_BATCH = 32
PREFERRED = (8, 16, 32)
DELAY_US = 1000
START_TIMEOUT_S = 240.0  # tritonserver, its python backend stub and onnxruntime load on a busy 2-core host
STOP_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 5  # tritonserver's own wait for requests in flight when it is told to stop
POLL_S = 0.5


class PeerUnavailable(RuntimeError):
    """The peer could not start here; the message says why (with the tail of its log)."""


class Stop:
    """``stop()`` ends a peer (at most once); ``stop.pid`` is its server's process, whose session holds the rest."""

    def __init__(self, pid: int, end) -> None:
        self.pid, self._end, self._done = pid, end, False

    def __call__(self) -> None:
        if not self._done:
            self._done = True
            self._end()


def matched_repo(prefix: str, models: tuple[str, ...] = MODELS, max_batch: int = MAX_BATCH,
                 preferred: tuple[int, ...] = PREFERRED, delay_us: int = DELAY_US) -> str:
    """A fresh repository of the example models whose configs batch as the peers do (the same max batch,
    preferred sizes and queue delay for every model), so gepool and a peer are compared on one policy."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import make_models

    repo = tempfile.mkdtemp(prefix=prefix)
    for name in models:
        getattr(make_models, f"make_{name}")(repo)
        path = os.path.join(repo, name, "config.pbtxt")
        with open(path) as f:
            lines = f.read().splitlines()
        kept = []
        for line in lines:  # the example configs' batching, up to their instance_group, stays; the rest goes
            if line.startswith("max_batch_size:"):
                line = f"max_batch_size: {max_batch}"
            if line.startswith("dynamic_batching"):
                break
            kept.append(line)
        kept.append("dynamic_batching { preferred_batch_size: [ " + ", ".join(map(str, preferred)) + " ] "
                    f"max_queue_delay_microseconds: {delay_us} }}")
        with open(path, "w") as f:
            f.write("\n".join(kept) + "\n")
    return repo


def peer_python() -> str:
    """The interpreter the peer runs under (see the module docstring)."""
    named = os.environ.get("GEPOOL_PEER_PYTHON")
    if named:
        return named
    own = os.path.join(ROOT, ".venv", "peers", "bin", "python")
    return own if os.path.exists(own) else sys.executable


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int, models: tuple[str, ...]) -> bool:
    for name in models:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{name}/ready", timeout=2) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
    return True


def start_pytriton(models_dir: str, *, models: tuple[str, ...] = MODELS, threads: int = 1,
                   max_batch: int = MAX_BATCH, preferred: tuple[int, ...] = PREFERRED, delay_us: int = DELAY_US,
                   python: str | None = None, timeout_s: float = START_TIMEOUT_S):
    """Starts PyTriton serving ``models`` from ``models_dir`` on loopback and waits until every model is
    ready: ``(http_port, grpc_port, stop)``; ``stop()`` ends the server, its tritonserver and stubs, and
    removes their workspace and shared memory. PeerUnavailable (with the log's tail) when it cannot start."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    scratch = tempfile.mkdtemp(prefix="gepool-pytriton-")
    log_path = os.path.join(scratch, "pytriton.log")
    cmd = [python or peer_python(), os.path.abspath(__file__), "pytriton", os.path.abspath(models_dir),
           "--models", ",".join(models), "--threads", str(threads), "--max-batch", str(max_batch),
           "--preferred", ",".join(map(str, preferred)), "--delay-us", str(delay_us),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--workspace", os.path.join(scratch, "workspace")]
    with open(log_path, "w") as log:  # a file: tritonserver's log lines never fill a pipe
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail() -> str:
        with open(log_path, errors="replace") as f:
            return "".join(f.readlines()[-25:])

    def end() -> None:
        mapped = _session_segments(proc.pid)  # before the processes go: afterwards nothing says whose they were
        _stop_group(proc)
        for entry in os.listdir("/dev/shm"):
            # the python backend's regions are named after the server's pid; the tensor store's blocks
            # (psm_*) only show in the maps of the processes that used them
            if entry.startswith(f"pytrtion{proc.pid}-") or entry in mapped:
                try:
                    os.unlink(os.path.join("/dev/shm", entry))
                except FileNotFoundError:
                    pass
        shutil.rmtree(scratch, ignore_errors=True)

    stop = Stop(proc.pid, end)
    deadline = time.monotonic() + timeout_s
    while not _ready(http_port, models):
        if proc.poll() is not None or time.monotonic() > deadline:
            reason = (f"exited with code {proc.returncode}" if proc.poll() is not None
                      else f"not ready within {timeout_s:.0f}s")
            text = tail()
            stop()
            raise PeerUnavailable(f"PyTriton ({cmd[0]}) {reason}:\n{text}")
        time.sleep(POLL_S)
    return http_port, grpc_port, stop


def start_mosec(models_dir: str, *, models: tuple[str, ...] = MODELS, threads: int = 1, max_batch: int = MAX_BATCH,
                wait_ms: int = DELAY_US // 1000, python: str | None = None, timeout_s: float = START_TIMEOUT_S):
    """Starts Mosec (``mosec_peer.py``) serving ``models`` from ``models_dir`` at ``POST /v2/models/<name>/infer``
    on loopback, each batched up to ``max_batch`` with at most ``wait_ms`` of waiting, and waits until each
    answers: ``(http_port, stop)``. PeerUnavailable (with the log's tail) when it cannot start."""
    import json

    port = free_port()
    scratch = tempfile.mkdtemp(prefix="gepool-mosec-")
    log_path = os.path.join(scratch, "mosec.log")
    env = dict(os.environ, GEPOOL_PEER_REPO=os.path.abspath(models_dir), GEPOOL_PEER_MODELS=",".join(models),
               GEPOOL_PEER_THREADS=str(threads), GEPOOL_PEER_MAX_BATCH=str(max_batch), GEPOOL_PEER_WAIT_MS=str(wait_ms))
    cmd = [python or peer_python(), os.path.join(HERE, "mosec_peer.py"), "--address", "127.0.0.1", "--port", str(port),
           "--path", os.path.join(scratch, "ipc")]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def end() -> None:
        _stop_group(proc)
        shutil.rmtree(scratch, ignore_errors=True)

    stop = Stop(proc.pid, end)

    def answers(name: str) -> bool:
        import onnx  # the gepool side has it (examples/make_models.py); only the input's name and width are read

        graph = onnx.load(os.path.join(models_dir, name, "1", "model.onnx"), load_external_data=False).graph
        (tensor,) = graph.input
        width = tensor.type.tensor_type.shape.dim[1].dim_value
        body = json.dumps({"inputs": [{"name": tensor.name, "shape": [1, width], "datatype": "FP32",
                                       "data": [0.0] * width}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{name}/infer", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    deadline = time.monotonic() + timeout_s
    pending = list(models)
    while pending:
        if answers(pending[0]):
            pending.pop(0)
            continue
        if proc.poll() is not None or time.monotonic() > deadline:
            reason = (f"exited with code {proc.returncode}" if proc.poll() is not None
                      else f"not answering within {timeout_s:.0f}s")
            with open(log_path, errors="replace") as f:
                text = "".join(f.readlines()[-25:])
            stop()
            raise PeerUnavailable(f"Mosec ({cmd[0]}) {reason}:\n{text}")
        time.sleep(POLL_S)
    return port, stop


def _session_segments(sid: int) -> set[str]:
    """Names of the /dev/shm files the processes of session ``sid`` have mapped."""
    names = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) != sid:
                    continue
            with open(f"/proc/{entry}/maps") as f:
                names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
        except (OSError, IndexError, ValueError):
            continue
    return names


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the server (PyTriton stops tritonserver), then SIGKILL to its whole session if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # tritonserver and its stubs, if any outlived the server
    except ProcessLookupError:
        pass
    proc.wait()


# -- the peer's own process (runs under the peer's interpreter, which has no gepool) ------------------------
def serve_pytriton(args: argparse.Namespace) -> None:
    import sysconfig

    # the python backend stub links libpython by soname: without this it can load the system's libpython
    # under this interpreter's standard library (a Debian 3.11.2 beside a pyenv 3.11.7 fails in multiprocessing)
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)

    import numpy as np
    import onnxruntime as ort
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, metrics_address="127.0.0.1", metrics_port=args.metrics_port,
                          exit_timeout_secs=EXIT_TIMEOUT_S)
    # no access token: perf_analyzer reads the statistics endpoint, which PyTriton restricts by default
    with Triton(config=config, workspace=args.workspace,
                security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        for name in args.models.split(","):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = args.threads
            opts.inter_op_num_threads = 1
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(os.path.join(args.models_dir, name, "1", "model.onnx"), opts,
                                           providers=["CPUExecutionProvider"])
            ins, outs = session.get_inputs(), session.get_outputs()

            def tensors(metas):
                return [Tensor(name=m.name, dtype=np.float32, shape=tuple(m.shape[1:])) for m in metas]

            def make(session=session, outs=outs):
                @batch
                def infer(**inputs):
                    values = session.run([o.name for o in outs], inputs)
                    return {o.name: v for o, v in zip(outs, values)}
                return infer

            batcher = DynamicBatcher(max_queue_delay_microseconds=args.delay_us,
                                     preferred_batch_size=[int(s) for s in args.preferred.split(",")])
            triton.bind(name, make(), inputs=tensors(ins), outputs=tensors(outs),
                        config=ModelConfig(max_batch_size=args.max_batch, batcher=batcher), strict=True)
        print("pytriton: serving", args.models, flush=True)
        triton.serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="peer", required=True)
    p = sub.add_parser("pytriton", help="serve REPO's ONNX models with PyTriton (what start_pytriton runs)")
    p.add_argument("models_dir")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=MAX_BATCH)
    p.add_argument("--preferred", default=",".join(map(str, PREFERRED)))
    p.add_argument("--delay-us", type=int, default=DELAY_US)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--workspace", required=True)
    args = parser.parse_args()
    if args.peer == "pytriton":
        serve_pytriton(args)


if __name__ == "__main__":
    main()
