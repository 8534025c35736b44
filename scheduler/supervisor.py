"""Worker processes and their resources: start with a fresh ring and doorbell, reap, stop in steps."""

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from gepool.common.logsettings import LogSettings
from gepool.ipc import doorbell, naming
from gepool.ipc.ring import Ring
from gepool.scheduler.books import Worker
from gepool.scheduler.states import WorkerState

log = logging.getLogger("gepool.supervisor")

STOP_GRACE_S = 5.0
TERMINATE_GRACE_S = 2.0
REAP_TIMEOUT_S = 5.0

# start_worker(**kwargs) -> a started multiprocessing.Process; handed in by the face (gepool.pool)
StartWorker = Callable[..., Any]


class Supervisor:
    def __init__(self, owner_id: str, endpoint: str, start_worker: StartWorker, log: LogSettings,
                 bell_dir: str) -> None:
        self.owner_id, self.endpoint, self.start_worker = owner_id, endpoint, start_worker
        self.log = log  # what a worker logs, and how it stamps its lines, from its start
        self.bell_dir = bell_dir
        self._linked: set[int] = set()  # workers whose ring and bell names are not unlinked yet

    def spawn(self, w: Worker) -> None:
        """A fresh ring (a restarted worker never sees its predecessor's slots) and a new process, for a
        worker the core has marked started."""
        model = w.model
        w.ring = Ring.create(naming.segment_name(self.owner_id, f"w{w.id}.{w.restarts}"), w.slots, w.slot_bytes)
        self._linked.add(w.id)
        paths = doorbell.make(self.bell_dir, f"gepool-{self.owner_id}-w{w.id}.{w.restarts}")
        w.bell = doorbell.FrontBell(paths)
        w.process = self.start_worker(
            worker_id=w.id, config=model.config, version_dir=model.source.version_dir, device=w.device,
            threads=w.threads, ring=w.ring.handle(), endpoint=self.endpoint, log_level=self.log.level,
            log_format=self.log.format, bell=paths,
            bls_key=w.key)
        # the key goes through the spawn's pipe, which a process of the pool's own user can still open through
        # /proc/<pid>/fd: with the client endpoint owner-only, the key keeps out other users, remote CURVE clients
        # and careless clients, not a hostile process of the pool's own user
        log.info("worker %d (%s v%s on %s) started, pid %d", w.id, model.name, model.version, w.device,
                 w.process.pid)

    def mapped(self, w: Worker) -> None:
        """Both sides have mapped the ring and opened the doorbells: from now on a crash of anyone leaks
        nothing."""
        self._unlink(w)
        if w.bell is not None:
            w.bell.unlink()

    def reap(self, w: Worker) -> int | None:
        """A worker whose sentinel fired: its exit code, with its process, doorbell and ring closed."""
        # The sentinel closes as the process exits, a moment before it can be reaped.
        w.process.join(timeout=REAP_TIMEOUT_S)
        if w.process.exitcode is None:
            w.process.kill()
            w.process.join()
        code = w.process.exitcode
        w.process.close()  # its sentinel fd and pipes now, not whenever the object is collected
        w.process = None
        self._release(w)
        return code

    def _unlink(self, w: Worker) -> None:
        if w.ring is not None and w.id in self._linked:
            w.ring.segment.unlink()
        self._linked.discard(w.id)

    def _release(self, w: Worker) -> None:
        if w.bell is not None:
            w.bell.close()
            w.bell = None
        self._unlink(w)
        if w.ring is not None:
            w.ring.close()
            w.ring = None

    def stop_all(self, workers: Iterable[Worker], send: Callable[[Worker], None]) -> None:
        """Stop messages, then terminate, then kill: each step waits on the processes' own exit."""
        workers = list(workers)
        live = [w for w in workers if w.process is not None and w.process.exitcode is None]
        for w in live:
            if w.state == WorkerState.READY:
                send(w)
        for grace, step in ((STOP_GRACE_S, "terminate"), (TERMINATE_GRACE_S, "kill"), (TERMINATE_GRACE_S, None)):
            deadline = time.monotonic() + grace
            for w in live:
                w.process.join(max(0.0, deadline - time.monotonic()))
            live = [w for w in live if w.process.exitcode is None]
            if not live or step is None:
                break
            for w in live:
                log.warning("worker %d did not stop; %s", w.id, step)
                getattr(w.process, step)()
        for w in workers:
            self._release(w)
