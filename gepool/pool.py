"""Starting a pool: the front (in this process, or a spawned one) wired to the worker entry point.

`scheduler` and `workers` never import each other; this module hands the front's supervisor the
function that starts a worker.
"""

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal

from gepool import errors
from gepool.ipc import naming
from gepool.ipc.sockets import default_endpoint

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0

_spawn = multiprocessing.get_context("spawn")


def start_worker(**kwargs):
    """Spawns one worker process from plain values and handles; returns the started Process."""
    from gepool.workers.main import WorkerSpec, run_worker

    spec = WorkerSpec(parent_pid=os.getpid(), **kwargs)
    proc = _spawn.Process(target=run_worker, args=(spec,), name=f"gepool-worker-{spec.worker_id}", daemon=True)
    proc.start()
    return proc


def serve(repository: str, endpoint: str | None = None, *, cpu_threads: int = 0, log_level: int = logging.INFO,
          on_ready=None, owner_id: str | None = None) -> int:
    """Runs a front in this process until SIGINT/SIGTERM; returns its exit code."""
    from gepool.scheduler.front import Front, FrontOptions

    opts = FrontOptions(repository=os.path.abspath(repository), endpoint=endpoint or default_endpoint(),
                        owner_id=owner_id or naming.new_owner_id(), cpu_threads=cpu_threads, log_level=log_level)
    return Front(opts, start_worker, on_ready).run()


def _front_main(repository: str, endpoint: str, cpu_threads: int, log_level: int, conn) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s front %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the Pool's owner stops us with SIGTERM
    try:
        code = serve(repository, endpoint, cpu_threads=cpu_threads, log_level=log_level,
                     on_ready=lambda status: conn.send(("ready", status)))
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    raise SystemExit(code)


class Pool:
    """A pool in a child process: ``with Pool("models") as pool: pool.client().infer(...)``.

    Entering returns once every model has loaded or failed (``pool.status`` says which); leaving
    answers or fails every request in flight, stops the workers and leaves no segment behind.
    """

    def __init__(self, model_repository: str, *, endpoint: str | None = None, cpu_threads: int = 0,
                 log_level: int = logging.WARNING, start_timeout: float = START_TIMEOUT_S) -> None:
        self.repository = model_repository
        self.endpoint = endpoint or f"ipc://{os.path.dirname(default_endpoint()[6:])}/pool-{naming.new_owner_id()}.sock"
        self.cpu_threads, self.log_level, self.start_timeout = cpu_threads, log_level, start_timeout
        self.process = None
        self.status: dict = {}
        self._clients: list = []

    def start(self) -> "Pool":
        parent, child = _spawn.Pipe(duplex=False)
        self.process = _spawn.Process(target=_front_main, name="gepool-front",
                                      args=(self.repository, self.endpoint, self.cpu_threads, self.log_level, child))
        self.process.start()
        child.close()
        ready = multiprocessing.connection.wait([parent, self.process.sentinel], self.start_timeout)
        if parent in ready:
            try:
                kind, body = parent.recv()
            except EOFError:
                kind, body = "failed", "the front exited during start-up"
        else:
            kind, body = "failed", ("the front exited during start-up" if ready else
                                    f"not ready within {self.start_timeout}s")
        parent.close()
        if kind != "ready":
            self.stop()
            raise errors.Unavailable(f"pool failed to start: {body} (exit code {self.process.exitcode})")
        self.status = body
        return self

    def client(self, **kwargs):
        """A Client connected to this pool; closed when the pool stops."""
        from gepool.client import Client

        c = Client(self.endpoint, **kwargs)
        self._clients.append(c)
        return c

    def stop(self) -> int | None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        if self.process is None:
            return None
        if self.process.exitcode is None:
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
        return self.process.exitcode

    def __enter__(self) -> "Pool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
