"""What happens when a worker dies or hangs: its batches are retried or failed, and it is restarted."""

import logging

from gepool.common import errors
from gepool.scheduler.books import Worker, Workers
from gepool.scheduler.dispatch import Dispatcher
from gepool.scheduler.outbox import Outbox
from gepool.scheduler.states import WorkerState

log = logging.getLogger("gepool.recovery")


class Recovery:
    def __init__(self, workers: Workers, dispatch: Dispatcher, out: Outbox, load_timeout_s: float) -> None:
        """``load_timeout_s``: how long a worker may take to load its model (a model's own
        ``model_load_timeout_s`` parameter overrides it)."""
        self.workers, self.dispatch, self.out = workers, dispatch, out
        self.load_timeout_s = load_timeout_s

    def on_exit(self, w: Worker, code: int | None, now: float, stopping: bool) -> None:
        """A reaped worker: each request of its lost batches runs once more on another ready worker of
        its model (oldest first), or hears why it failed; then it waits out its backoff."""
        model = w.model
        lost = w.fail_all()
        w.exited(code, now, stopping)
        if w.restart_at is not None:
            log.warning("%s; restart in %.1fs", w.reason, w.restart_at - now)
        can_retry = not stopping and any(o.state == WorkerState.READY for o in model.workers if o is not w)
        err = errors.WorkerDied(f"the worker running model '{model.name}' died ({w.reason}) while executing "
                                f"this request")
        for batch in reversed(lost):  # each goes back to the head of the queue: the oldest ends up first
            self.dispatch.recover(model, batch, err, can_retry)
        if w.retired:
            self.workers.forget(w)

    def watchdog(self, now: float) -> None:
        """A worker that has held a batch past its model's execution timeout is hung: that batch is
        answered now, the worker is killed, and its death path replaces it and retries the rest."""
        for w in self.workers.values():
            model = w.model
            head = w.hung(now, model.exec_timeout_s) if w.inflight else None
            if head is None:
                continue
            timeout_ms = round(model.exec_timeout_s * 1000)
            self.dispatch.fail_batch(model, head, errors.WorkerDied(
                f"model '{model.name}' did not finish a batch within {timeout_ms} ms (execution_timeout_ms); "
                f"its worker was killed and is being replaced"))
            w.reason = "hung: killed by the watchdog"
            log.error("worker %d (%s) hung; killing it", w.id, model.name)
            self.out.kill(w)

    def load_watch(self, now: float) -> None:
        """A worker still loading past its load timeout is killed; its exit makes it FAILED with that reason."""
        for w in self.workers.values():
            if w.state == WorkerState.STARTING and w.process is not None and not w.load_failed:
                timeout = self._load_timeout(w)
                if now >= w.spawned_at + timeout:
                    w.load_failed = True
                    w.reason = f"the model did not load within {timeout:g} s (model_load_timeout_s)"
                    log.error("worker %d (%s): %s; killing it", w.id, w.model.name, w.reason)
                    self.out.kill(w)

    def _load_timeout(self, w: Worker) -> float:
        own = w.model.load_timeout_s
        return self.load_timeout_s if own is None else own

    def restart_due(self, now: float) -> None:
        for w in self.workers.values():
            if w.restart_at is not None and w.restart_at <= now and not w.retired:
                w.started(now)
                self.out.spawn(w)

    def next_deadline(self) -> float | None:
        """The nearest restart, load timeout or watchdog deadline."""
        deadlines = [w.restart_at for w in self.workers.values() if w.restart_at is not None]
        deadlines += [w.spawned_at + self._load_timeout(w) for w in self.workers.values()
                      if w.state == WorkerState.STARTING and w.process is not None and not w.load_failed]
        deadlines += [w.progress_at + w.model.exec_timeout_s for w in self.workers.values()
                      if w.inflight and w.state == WorkerState.READY]
        return min(deadlines) if deadlines else None
