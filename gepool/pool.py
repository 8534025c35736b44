"""Starting a pool: the front (in this process, or a spawned one) wired to the worker entry point.

`scheduler` and `workers` never import each other; this module hands the front's supervisor the
function that starts a worker.
"""

import json
import logging
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from gepool.common import errors
from gepool.ipc import naming
from gepool.ipc.sockets import default_endpoint, runtime_dir

START_TIMEOUT_S = 300.0
GATEWAY_START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
GATEWAY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # between restarts of a sidecar that keeps dying
GATEWAY_STEADY_S = 60.0  # a sidecar that lived this long restarts from the first backoff again
BODY_HEADROOM_BYTES = 1 << 20  # room in the default body limit for the JSON header around the tensors

_spawn = multiprocessing.get_context("spawn")
log = logging.getLogger("gepool.pool")


def start_worker(**kwargs):
    """Spawns one worker process from plain values and handles; returns the started Process."""
    from gepool.workers.main import WorkerSpec, run_worker

    spec = WorkerSpec(parent_pid=os.getpid(), **kwargs)
    proc = _spawn.Process(target=run_worker, args=(spec,), name=f"gepool-worker-{spec.worker_id}", daemon=True)
    proc.start()
    return proc


def place_workers(config):
    """The workers a model needs, as its backend places them: [(device, batches in flight)]."""
    from gepool.workers.backends import placements

    return placements(config)


def serve(repository: str, endpoint: str | None = None, *, cpu_threads: int = 0, log_level: int = logging.INFO,
          on_ready=None, owner_id: str | None = None, http_port: int = 0, http_host: str = "127.0.0.1",
          metrics_port: int = 0, curve_secret_key: str | None = None, curve_authorized_keys: str | None = None,
          exit_grace_s: float = 0.0, model_control_mode: str = "none", load_models: tuple[str, ...] = (),
          poll_secs: float = 15.0, busy_poll_us: int = 0, auto_complete_config: bool = True,
          http_restricted_api: tuple[str, ...] = (), http_max_body_bytes: int = 0,
          strict_readiness: bool = True, grpc_port: int = 0) -> int:
    """Runs a front in this process until SIGINT/SIGTERM; returns its exit code. With an HTTP or metrics
    port, the sidecar process starts once the front is ready, is restarted (with backoff) if it dies,
    and stops after the front has drained. ``http_restricted_api``: Triton's ``API[,API]:KEY=VALUE``
    groups; ``http_max_body_bytes`` (0: the repository's largest slot plus room for the JSON header);
    ``strict_readiness`` False makes its /v2/health/ready answer ready while any model is unavailable;
    ``grpc_port`` (0: off) serves Triton's KServe v2 gRPC service from the same sidecar, on ``http_host``."""
    from gepool.http.access import Restrictions
    from gepool.scheduler.front import Front, FrontOptions

    Restrictions.parse(http_restricted_api)  # a bad group fails the start, not a sidecar restart loop

    opts = FrontOptions(repository=os.path.abspath(repository), endpoint=endpoint or default_endpoint(),
                        owner_id=owner_id or naming.new_owner_id(), cpu_threads=cpu_threads, log_level=log_level,
                        curve_secret_key=curve_secret_key, curve_authorized_keys=curve_authorized_keys,
                        exit_grace_s=exit_grace_s, model_control_mode=model_control_mode,
                        load_models=tuple(load_models), poll_secs=poll_secs, busy_poll_us=busy_poll_us,
                        auto_complete_config=auto_complete_config)
    gateway: list[_Sidecar] = []

    def ready(status: dict) -> None:
        if http_port or metrics_port or grpc_port:
            args = _gateway_args(status["endpoint"], http_host, http_port, metrics_port, log_level, curve_secret_key,
                                 http_restricted_api, http_max_body_bytes or _default_max_body(opts.repository),
                                 strict_readiness, grpc_port)
            gateway.append(_Sidecar(args))
            status["http"] = f"http://{http_host}:{http_port}" if http_port else None
            status["metrics"] = f"http://{http_host}:{metrics_port}/metrics" if metrics_port else None
            status["grpc"] = f"{http_host}:{grpc_port}" if grpc_port else None
        if on_ready is not None:
            on_ready(status)

    try:
        return Front(opts, start_worker, ready, place=place_workers).run()
    finally:
        for sidecar in gateway:
            sidecar.stop()


def _default_max_body(repository: str) -> int:
    """The largest slot of any model in the repository, plus room for a JSON header."""
    from gepool.common.repository import scan
    from gepool.scheduler.models import DEFAULT_VARIABLE_SLOT_BYTES, slot_bytes_for

    slots = [slot_bytes_for(src.config) for src in scan(repository) if src.config is not None]
    return max(slots, default=DEFAULT_VARIABLE_SLOT_BYTES) + BODY_HEADROOM_BYTES


def _gateway_args(endpoint: str, host: str, http_port: int, metrics_port: int, log_level: int,
                  curve_key: str | None = None, restricted: tuple[str, ...] = (), max_body: int = 0,
                  strict_readiness: bool = True, grpc_port: int = 0) -> list[str]:
    return ["--endpoint", endpoint, "--http-host", host, "--http-port", str(http_port),
            "--metrics-port", str(metrics_port), "--grpc-port", str(grpc_port),
            "--log-level", logging.getLevelName(log_level),
            "--strict-readiness", "true" if strict_readiness else "false",
            *(["--curve-key", curve_key] if curve_key else []),
            *(["--http-max-body-bytes", str(max_body)] if max_body else []),
            *(f"--http-restricted-api={group}" for group in restricted)]


class _Sidecar:
    """The HTTP sidecar, started now (failing the start if it cannot listen) and restarted with backoff
    by a watcher thread whenever it dies, until stop()."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.proc = _start_gateway(args)
        self.restarts = 0
        self._watcher = threading.Thread(target=self._watch, name="gepool-sidecar-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            failures = 0 if time.monotonic() - started > GATEWAY_STEADY_S else failures
            delay = GATEWAY_BACKOFF_S[min(failures, len(GATEWAY_BACKOFF_S) - 1)]
            log.warning("the HTTP sidecar exited with code %s; restarting it in %.1f s", code, delay)
            failures += 1
            while not self._stopping.wait(delay):
                try:
                    proc = _start_gateway(self.args)
                except errors.Unavailable as exc:
                    log.warning("%s; trying again in %.1f s", exc, delay)
                    delay = GATEWAY_BACKOFF_S[min(failures, len(GATEWAY_BACKOFF_S) - 1)]
                    failures += 1
                    continue
                with self._lock:  # stop() may have run while it started: it must not outlive the pool
                    if self._stopping.is_set():
                        _stop(proc)
                        return
                    self.proc = proc
                    self.restarts += 1
                break

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            proc = self.proc
        _stop(proc)
        self._watcher.join(STOP_TIMEOUT_S)


def _start_gateway(args: list[str]) -> subprocess.Popen:
    """The HTTP sidecar; returns once it listens (it reaches the front on its own, lazily)."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _GATEWAY_BOOT, *args, "--ready-fd", str(write_fd)],
                                pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        ready, _, _ = select.select([reader], [], [], GATEWAY_START_TIMEOUT_S)
        line = reader.readline() if ready else ""
    if line.strip() != "ready":
        _stop(proc)
        why = line.strip().removeprefix("failed ") or f"it exited with code {proc.returncode} and said nothing"
        where = " ".join(args[args.index("--http-host"):args.index("--log-level")])
        raise errors.Unavailable(f"the HTTP sidecar did not start ({where}): {why}")
    return proc


# The sidecar's entry, run with `python -c`: an import that fails (a wheel missing gepool.http, a missing
# dependency) is reported on the ready pipe like any other start failure, not lost in a bare exit code.
_GATEWAY_BOOT = "import sys; from gepool.pool import _gateway_main; sys.exit(_gateway_main(sys.argv[1:]))"


def _gateway_main(argv: list[str]) -> int:
    fd = int(argv[argv.index("--ready-fd") + 1])
    try:
        from gepool.http.server import main

        return main(argv)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        try:
            os.write(fd, f"failed {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass  # it had already reported ready, and the pipe is closed
        raise


def _stop(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _front_process(argv: list[str]) -> int:
    """`python -m gepool.pool ARGS_JSON READY_FD [DEATH_FD]`: a front whose readiness is one JSON line on
    READY_FD, and that stops (as on SIGTERM) once DEATH_FD reads end of file: its Pool's process is gone."""
    args, fd = json.loads(argv[0]), int(argv[1])
    logging.basicConfig(level=args["log_level"], format="%(asctime)s front %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the Pool's owner stops us with SIGTERM
    if len(argv) > 2:
        _watch_owner(int(argv[2]))
    out = os.fdopen(fd, "w")

    def report(kind: str, body) -> None:
        out.write(json.dumps([kind, body]) + "\n")
        out.flush()

    try:
        code = serve(args["repository"], args["endpoint"], cpu_threads=args["cpu_threads"],
                     log_level=args["log_level"], on_ready=lambda status: report("ready", status),
                     http_port=args["http_port"], http_host=args["http_host"], metrics_port=args["metrics_port"],
                     curve_secret_key=args["curve_secret_key"], curve_authorized_keys=args["curve_authorized_keys"],
                     exit_grace_s=args["exit_grace_s"], model_control_mode=args["model_control_mode"],
                     load_models=tuple(args["load_models"]), poll_secs=args["poll_secs"],
                     busy_poll_us=args.get("busy_poll_us", 0),
                     auto_complete_config=args.get("auto_complete_config", True),
                     http_restricted_api=tuple(args.get("http_restricted_api", ())),
                     http_max_body_bytes=args.get("http_max_body_bytes", 0),
                     grpc_port=args.get("grpc_port", 0))
    except Exception as exc:
        report("failed", f"{type(exc).__name__}: {exc}")
        raise
    return code


def _watch_owner(death_fd: int) -> None:
    """The Pool holds the other end of this pipe and never writes: end of file means its process died (or
    closed it). The front then stops as on SIGTERM, draining; before its handler is installed, SIGTERM's
    default ends the process, which has nothing to clean up yet."""
    os.set_inheritable(death_fd, False)  # the front's own children (workers, the sidecar) must not hold it

    def watch() -> None:
        while True:
            try:
                if not os.read(death_fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        log.warning("the process that started this pool is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gepool-owner-watch", daemon=True).start()


class Pool:
    """A pool in a child process: ``with Pool("models") as pool: pool.client().infer(...)``.

    Entering returns once every model has loaded or failed (``pool.status`` says which); leaving
    answers or fails every request in flight, stops the workers and leaves no segment behind.
    """

    def __init__(self, model_repository: str, *, endpoint: str | None = None, cpu_threads: int = 0,
                 log_level: int = logging.WARNING, start_timeout: float = START_TIMEOUT_S, http_port: int = 0,
                 http_host: str = "127.0.0.1", metrics_port: int = 0, curve_secret_key: str | None = None,
                 curve_authorized_keys: str | None = None, exit_grace_s: float = 0.0,
                 model_control_mode: str = "none", load_models: tuple[str, ...] = (), poll_secs: float = 15.0,
                 busy_poll_us: int = 0, auto_complete_config: bool = True, http_restricted_api: tuple[str, ...] = (),
                 http_max_body_bytes: int = 0, grpc_port: int = 0) -> None:
        """``http_port`` / ``metrics_port`` (0: off) also start the KServe v2 HTTP sidecar;
        ``curve_secret_key`` (a ZMQ certificate file) turns on CURVE for a tcp endpoint, admitting the
        public keys in ``curve_authorized_keys`` (a folder of .key files) or, without it, any key.
        ``busy_poll_us``: 0 polls adaptively while traffic is sequential (``scheduler/polling.py``),
        N > 0 polls N microseconds before any sleep (a core's time under light load), -1 never polls.
        ``auto_complete_config=False`` is Triton's ``--disable-auto-complete-config``: every model needs a
        complete config.pbtxt, which is still checked against an ONNX model's file. ``grpc_port`` (0: off)
        serves Triton's KServe v2 gRPC service from the sidecar, on ``http_host`` like HTTP."""
        self.repository = model_repository
        self.endpoint = endpoint or f"ipc://{runtime_dir()}/pool-{naming.new_owner_id()}.sock"
        self.cpu_threads, self.log_level, self.start_timeout = cpu_threads, log_level, start_timeout
        self.http_port, self.http_host, self.metrics_port = http_port, http_host, metrics_port
        self.curve_secret_key, self.curve_authorized_keys = curve_secret_key, curve_authorized_keys
        self.exit_grace_s = exit_grace_s
        self.model_control_mode, self.load_models, self.poll_secs = model_control_mode, list(load_models), poll_secs
        self.busy_poll_us, self.auto_complete_config = busy_poll_us, auto_complete_config
        self.http_restricted_api, self.http_max_body_bytes = list(http_restricted_api), http_max_body_bytes
        self.grpc_port = grpc_port
        self.process = None
        self._death_w: int | None = None
        self.status: dict = {}
        self._clients: list = []

    def start(self) -> "Pool":
        """Starts the front as a fresh interpreter (not a fork or a spawn of the caller's main module, so
        no ``if __name__ == "__main__"`` guard is needed) and waits for its readiness line."""
        read_fd, write_fd = os.pipe()
        args = {"repository": self.repository, "endpoint": self.endpoint, "cpu_threads": self.cpu_threads,
                "log_level": self.log_level, "http_port": self.http_port, "http_host": self.http_host,
                "metrics_port": self.metrics_port, "curve_secret_key": self.curve_secret_key,
                "curve_authorized_keys": self.curve_authorized_keys, "exit_grace_s": self.exit_grace_s,
                "model_control_mode": self.model_control_mode, "load_models": self.load_models,
                "poll_secs": self.poll_secs, "busy_poll_us": self.busy_poll_us,
                "auto_complete_config": self.auto_complete_config,
                "http_restricted_api": self.http_restricted_api, "http_max_body_bytes": self.http_max_body_bytes,
                "grpc_port": self.grpc_port}
        # the death pipe: the front holds the read end, this process the write end (not inheritable, so no
        # other child keeps the front alive); when this process dies the front reads end of file and stops
        death_r, self._death_w = os.pipe()
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "gepool.pool", json.dumps(args), str(write_fd),
                                             str(death_r)], pass_fds=(write_fd, death_r), stdin=subprocess.DEVNULL)
        except BaseException:
            os.close(self._death_w)
            self._death_w = None
            raise
        finally:
            os.close(write_fd)
            os.close(death_r)
        with os.fdopen(read_fd) as reader:
            ready, _, _ = select.select([reader], [], [], self.start_timeout)
            line = reader.readline() if ready else ""
        kind, body = json.loads(line) if line else ("failed", "the front exited during start-up" if ready else
                                                    f"not ready within {self.start_timeout}s")
        if kind != "ready":
            code = self.stop()
            raise errors.Unavailable(f"pool failed to start: {body} (exit code {code})")
        self.status = body
        self.endpoint = body["endpoint"]  # the bound one, when a tcp port was left to the system
        return self

    def client(self, **kwargs):
        """A Client connected to this pool; closed when the pool stops."""
        from gepool.client import Client

        if self.curve_secret_key:  # the owner of the pool speaks with the pool's own keys
            kwargs.setdefault("curve_server_key", self.curve_secret_key)
            kwargs.setdefault("curve_client_key", self.curve_secret_key)
        c = Client(self.endpoint, **kwargs)
        self._clients.append(c)
        return c

    def stop(self) -> int | None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        if self.process is None:
            return None
        code = _stop(self.process)
        if self._death_w is not None:
            os.close(self._death_w)
            self._death_w = None
        if code is not None and code < 0:  # killed by a signal: the front could not remove its files
            self._remove_leftovers()
        return code

    def _remove_leftovers(self) -> None:
        """The dead front's worker socket and doorbells, and its endpoint and lane sockets unless some
        other pool listens there by now (stop() may come late, and twice)."""
        naming.remove_runtime_of(runtime_dir(), self.process.pid)
        if not self.endpoint.startswith("ipc://"):
            return
        path = self.endpoint[len("ipc://"):]
        for leftover, kind in ((path, socket.SOCK_STREAM), (path + ".lane", socket.SOCK_SEQPACKET)):
            with socket.socket(socket.AF_UNIX, kind) as probe:
                try:
                    probe.connect(leftover)
                except ConnectionRefusedError:  # a socket file nobody listens on
                    os.unlink(leftover)
                except OSError:  # gone already, or not a socket
                    pass

    def __enter__(self) -> "Pool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(_front_process(sys.argv[1:]))
