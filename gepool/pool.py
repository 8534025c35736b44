"""Starting a pool: the front (in this process, or a spawned one) wired to the worker entry point.

`scheduler` and `workers` never import each other; this module hands the front's supervisor the
function that starts a worker.
"""

import json
import logging
import multiprocessing
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from gepool.common import errors
from gepool.common.logsettings import LogSettings, log_to_file
from gepool.ipc import naming
from gepool.ipc.sockets import runtime_dir
from gepool.options import OPTION_NAMES, PoolOptions
from gepool.scheduler.regions import TOKEN_ENV, version_page_fd

START_TIMEOUT_S = 300.0
GATEWAY_START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
GATEWAY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # between restarts of a sidecar that keeps dying
GATEWAY_STEADY_S = 60.0  # a sidecar that lived this long restarts from the first backoff again

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


def serve(options: PoolOptions, on_ready: Callable[[dict], None] | None = None) -> int:
    """Runs a front in this process until SIGINT/SIGTERM; returns its exit code. With an HTTP or metrics
    port, the sidecar process starts once the front is ready, is restarted (with backoff) if it dies,
    and stops after the front has drained."""
    from gepool.scheduler.front import Front

    options.check()  # a bad option fails the start, not a sidecar restart loop
    if options.log_file:  # before the first worker or sidecar starts: each inherits it as its standard error
        try:
            log_to_file(options.log_file)
        except OSError as exc:
            raise errors.InvalidArgument(f"log_file '{options.log_file}' cannot be written: "
                                         f"{exc.strerror or exc}") from None
    front = options.front_options()
    gateway: list[_Sidecar] = []
    listening: list = []
    sidecars = bool(options.http_port or options.metrics_port or options.grpc_port)
    page_fd = -1  # the sidecars' read-only descriptor of the regions' version page
    if sidecars:  # the shared-memory record the sidecars share through the front (scheduler/regions.py)
        front.sidecar_token = secrets.token_hex(16)
        front.regions_fd, page_fd = version_page_fd()

    def ready(status: dict) -> None:
        if sidecars:
            args = _gateway_args(status["endpoint"], options, front.repository)
            fds = _listen(options, args, listening)
            env = {**os.environ, TOKEN_ENV: front.sidecar_token}
            shared = (*(s.fileno() for s in listening), page_fd)
            gateway.extend(_start_sidecars(options.sidecar_count(), [*args, *fds, f"--regions-fd={page_fd}"],
                                           shared, env))
            from gepool.http.listen import show

            host = options.host_of
            status["http"] = f"http://{show(host('http'), options.http_port)}" if options.http_port else None
            status["metrics"] = (f"http://{show(host('metrics'), options.metrics_port)}/metrics"
                                 if options.metrics_port else None)
            status["grpc"] = show(host("grpc"), options.grpc_port) if options.grpc_port else None
            status["sidecars"] = len(gateway)
        if on_ready is not None:
            on_ready(status)

    def start(**kwargs):  # the endpoint as bound (a tcp port left to the system is known once the front runs)
        return start_worker(pool_endpoint=front.endpoint, pool_curve_key=front.curve_secret_key, **kwargs)

    try:
        return Front(front, start, ready, place=place_workers).run()
    finally:
        for sidecar in gateway:
            sidecar.stop()
        for sock in listening:  # after the sidecars: connections still queued on a port are refused now
            sock.close()
        for fd in (front.regions_fd, page_fd):
            if fd >= 0:
                os.close(fd)


def _listen(options: PoolOptions, args: list[str], listening: list) -> list[str]:
    """Binds the sidecar's ports here, once, so that every sidecar (and each restart of one) accepts on
    the same sockets; returns the sidecar's arguments naming them. granian and grpc.aio bind their own."""
    from gepool.http import listen

    ports = {"http": options.http_port, "metrics": options.metrics_port, "grpc": options.grpc_port}
    own = options.self_bound()
    fds = []
    for name, port in ports.items():
        if not port or name in own:
            continue
        host = options.host_of(name)
        try:
            socks = listen.bind(host, port, listen.PORTS[name])
        except OSError as exc:
            raise errors.Unavailable(f"{exc.strerror or exc} (--{name}-address, --{name}-port)") from None
        listening.extend(socks)
        fds += [f"--{name}-fd={sock.fileno()}" for sock in socks]
    return fds


def _default_max_body(repository: str, options: PoolOptions) -> int:
    """The largest slot of any model in the repository, plus room for a JSON header."""
    from gepool.common.repository import scan
    from gepool.http.limits import BODY_HEADROOM_BYTES
    from gepool.scheduler.models import DEFAULT_VARIABLE_SLOT_BYTES, slot_bytes_for

    slots = [slot_bytes_for(src.config) for src in scan(repository, options.reading()) if src.config is not None]
    return max(slots, default=DEFAULT_VARIABLE_SLOT_BYTES) + BODY_HEADROOM_BYTES


def _gateway_args(endpoint: str, options: PoolOptions, repository: str) -> list[str]:
    """The sidecar's command line (``gepool.http.server.main``) for a pool with these options."""
    max_body = options.http_max_body_bytes or _default_max_body(repository, options)
    return ["--endpoint", endpoint, "--http-host", options.http_host, "--http-port", str(options.http_port),
            f"--grpc-host={options.host_of('grpc')}", f"--metrics-host={options.host_of('metrics')}",
            "--metrics-port", str(options.metrics_port), "--grpc-port", str(options.grpc_port),
            "--log-level", logging.getLevelName(options.log_level), f"--log-format={options.log_format}",
            f"--id={options.server_id}", f"--allow-cpu-metrics={'true' if options.cpu_metrics else 'false'}",
            "--strict-readiness", "true" if options.strict_readiness else "false",
            *(["--curve-key", options.curve_secret_key] if options.curve_secret_key else []),
            "--http-max-body-bytes", str(max_body), "--http-server", options.http_server,
            *([] if options.http_max_body_bytes else ["--body-limit-follows-loads"]),
            "--grpc-server", options.grpc_server, "--front-ready",
            *(f"--http-restricted-api={group}" for group in options.http_restricted_api),
            *(f"--grpc-restricted-protocol={group}" for group in options.grpc_restricted_protocol)]


class _Sidecar:
    """The HTTP sidecar, started now (failing the start if it cannot listen) and restarted with backoff
    by a watcher thread whenever it dies, until stop()."""

    def __init__(self, args: list[str], fds: tuple[int, ...] = (), env: dict[str, str] | None = None) -> None:
        self.args, self.fds, self.env = args, fds, env
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.proc = _start_gateway(args, fds, env)
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
                    proc = _start_gateway(self.args, self.fds, self.env)
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


def _start_sidecars(count: int, args: list[str], fds: tuple[int, ...], env: dict[str, str]) -> list[_Sidecar]:
    """``count`` sidecars, started at once (each takes a second or so to import and listen); if one fails
    to start, the others are stopped and its error raised."""
    with ThreadPoolExecutor(count, thread_name_prefix="gepool-sidecar-start") as starting:
        futures = [starting.submit(_Sidecar, args, fds, env) for _ in range(count)]
    started = [f.result() for f in futures if f.exception() is None]
    failed = next((f.exception() for f in futures if f.exception() is not None), None)
    if failed is not None:
        for sidecar in started:
            sidecar.stop()
        raise failed
    return started


def _start_gateway(args: list[str], fds: tuple[int, ...] = (), env: dict[str, str] | None = None) -> subprocess.Popen:
    """The HTTP sidecar, inheriting the descriptors ``fds`` (its listening sockets, the regions page);
    returns once it listens (it reaches the front on its own, lazily)."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _GATEWAY_BOOT, *args, "--ready-fd", str(write_fd)],
                                pass_fds=(write_fd, *fds), stdin=subprocess.DEVNULL, env=env)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        ready, _, _ = select.select([reader], [], [], GATEWAY_START_TIMEOUT_S)
        line = reader.readline() if ready else ""
    if line.strip() != "ready":
        _stop(proc)
        why = line.strip().removeprefix("failed ") or f"it exited with code {proc.returncode} and said nothing"
        raise errors.Unavailable(f"the HTTP sidecar did not start ({_where(args)}): {why}")
    return proc


def _where(args: list[str]) -> str:
    """The sidecar's host and ports, as its command line gives them (for a start that failed)."""
    return " ".join(args[args.index("--http-host"):args.index("--log-level")])


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
    """`python -m gepool.pool OPTIONS_JSON READY_FD [DEATH_FD]`: a front whose readiness is one JSON line on
    READY_FD, and that stops (as on SIGTERM) once DEATH_FD reads end of file: its Pool's process is gone."""
    options, fd = PoolOptions.decode(argv[0]), int(argv[1])
    logging.basicConfig(level=options.log_level, format="%(asctime)s front %(name)s %(levelname)s %(message)s")
    LogSettings.of_level(options.log_level, options.log_format).apply()  # (the sidecars read it from the front)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the Pool's owner stops us with SIGTERM
    if len(argv) > 2:
        _watch_owner(int(argv[2]))
    out = os.fdopen(fd, "w")

    def report(kind: str, body) -> None:
        out.write(json.dumps([kind, body]) + "\n")
        out.flush()

    try:
        code = serve(options, on_ready=lambda status: report("ready", status))
    except errors.GepoolError as exc:  # a refusal the Pool raises in its owner: no traceback on its console
        report("failed", f"{type(exc).__name__}: {exc}")
        return 2
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

    def __init__(self, model_repository: "str | PoolOptions", *, start_timeout: float = START_TIMEOUT_S,
                 **options) -> None:
        """``Pool("models", http_port=8000, ...)`` takes the fields of ``gepool.options.PoolOptions`` as
        keywords (or one PoolOptions), each also readable as ``pool.<name>``. ``http_port`` /
        ``metrics_port`` (0: off) also start the KServe v2 HTTP sidecar; ``curve_secret_key`` (a ZMQ
        certificate file) turns on CURVE for a tcp endpoint, admitting the public keys in
        ``curve_authorized_keys`` (a folder of .key files) or, without it, any key. ``busy_poll_us``: 0
        polls adaptively while traffic is sequential (``scheduler/polling.py``), N > 0 polls N
        microseconds before any sleep (a core's time under light load), -1 never polls.
        ``auto_complete_config=False`` is Triton's ``--disable-auto-complete-config``: every model needs a
        complete config.pbtxt, which is still checked against an ONNX model's file. A repository that is
        not a folder, or a bad option, raises at once, naming it."""
        if isinstance(model_repository, PoolOptions):
            opts = replace(model_repository, **options)
        else:
            opts = PoolOptions(repository=model_repository, **options)
        if opts.endpoint is None:  # a socket of its own, so that pools of one user do not collide
            opts.endpoint = f"ipc://{runtime_dir()}/pool-{naming.new_owner_id()}.sock"
        opts.check()
        self.options, self.start_timeout = opts, start_timeout
        self.process = None
        self._death_w: int | None = None
        self.status: dict = {}
        self._clients: list = []

    def __getattr__(self, name: str):
        options = self.__dict__.get("options")
        if options is not None and name in OPTION_NAMES:
            return getattr(options, name)
        raise AttributeError(f"'Pool' object has no attribute '{name}'")

    def start(self) -> "Pool":
        """Starts the front as a fresh interpreter (not a fork or a spawn of the caller's main module, so
        no ``if __name__ == "__main__"`` guard is needed) and waits for its readiness line."""
        read_fd, write_fd = os.pipe()
        # the death pipe: the front holds the read end, this process the write end (not inheritable, so no
        # other child keeps the front alive); when this process dies the front reads end of file and stops
        death_r, self._death_w = os.pipe()
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "gepool.pool", self.options.encode(),
                                             str(write_fd), str(death_r)], pass_fds=(write_fd, death_r),
                                            stdin=subprocess.DEVNULL)
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
        self.options.endpoint = body["endpoint"]  # the bound one, when a tcp port was left to the system
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
