"""The front's view of one model: its state, queue, workers and statistics."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gepool.common import errors
from gepool.common.config import BACKEND_PYTHON, ModelConfig, parse_size
from gepool.common.render import render
from gepool.common.repository import ModelSource
from gepool.ipc import layout
from gepool.scheduler.batcher import DynamicBatcher, QueueBudget
from gepool.scheduler.queues import PolicyQueues
from gepool.scheduler.requests import Admission
from gepool.scheduler.states import ModelState, WorkerState, check_model
from gepool.scheduler.stats import ModelStats

if TYPE_CHECKING:
    from gepool.scheduler.books import Worker

SLOTS_PER_WORKER = 2  # one batch runs while the next is copied in
DEFAULT_EXECUTION_TIMEOUT_MS = 300_000  # a batch running longer means a hung worker: kill and replace it
GE_WATCHDOG_GRACE_S = 5.0  # an NPU worker times its own batches out first (execution_timeout_ms)
DEFAULT_VARIABLE_SLOT_BYTES = 64 << 20  # tmpfs pages cost nothing until touched

LOADING, AVAILABLE, UNAVAILABLE = ModelState.LOADING, ModelState.AVAILABLE, ModelState.UNAVAILABLE
READY, STARTING, FAILED = WorkerState.READY, WorkerState.STARTING, WorkerState.FAILED


def slot_bytes_for(config: ModelConfig) -> int:
    """Room for a full batch: max rows x bytes per row of every tensor, plus alignment."""
    if "slot_bytes" in config.parameters:
        return parse_size(config.parameters["slot_bytes"])
    tensors = config.inputs + config.outputs
    if not all(t.fixed for t in tensors):
        return DEFAULT_VARIABLE_SLOT_BYTES
    rows = max(1, config.max_batch_size)
    return rows * sum(t.row_bytes() for t in tensors) + len(tensors) * layout.ALIGN


def _render(config: ModelConfig, name: str) -> dict | errors.GepoolError:
    try:
        return render(config)
    except Exception as exc:  # a config the renderer cannot express: the model still serves
        return errors.ModelNotReady(f"model '{name}': its config cannot be rendered: {exc}")


class Model:
    """One generation of one version of a model: its workers, queue and batcher."""

    def __init__(self, source: ModelSource, stats: ModelStats | None = None, generation: int = 0,
                 clock: Callable[[], float] = time.monotonic, budget: QueueBudget | None = None) -> None:
        """``budget``: the pool's queue budget, which this model's queued requests count against."""
        self.name, self.source, self.config = source.name, source, source.config
        self.version, self.generation = source.version, generation
        self.state = UNAVAILABLE if source.error else LOADING
        self.reason = source.error or ""
        self.workers: list[Worker] = []
        self.stats = stats if stats is not None else ModelStats()
        self.seq = 0
        self.was_ready = False
        self.slots_per_worker = SLOTS_PER_WORKER
        if self.config is not None and not source.error:
            db = self.config.dynamic_batching
            queues = PolicyQueues(db.priority_levels, db.default_priority_level, db.default_queue_policy,
                                  db.priority_queue_policy) if db else None
            self.batcher = DynamicBatcher(self.config.max_batch_size, db.preferred_batch_size if db else (),
                                          db.max_queue_delay_us if db else 0, enabled=db is not None,
                                          queues=queues, clock=clock,
                                          adaptive=self.config.parameters.get("batch_policy") == "adaptive",
                                          budget=budget)
            self.slot_bytes = slot_bytes_for(self.config)
            self.admission = Admission(self.config, self.slot_bytes)
            # a group of requests runs as one request where nobody could tell it from its members run one by
            # one: rows batched dynamically, no cache keyed by request, no queue that counts requests, no
            # python model (a TritonPythonModel sees each request)
            self.groupable = (db is not None and self.config.max_batch_size > 0 and self.config.ensemble is None
                              and not self.config.response_cache and self.config.backend != BACKEND_PYTHON
                              and not any(p.max_queue_size for p in self.batcher.queue.policies))
            ms = int(self.config.parameters.get("execution_timeout_ms", DEFAULT_EXECUTION_TIMEOUT_MS))
            self.exec_timeout_s = ms / 1000 + (GE_WATCHDOG_GRACE_S if self.config.backend == "ge" else 0.0)
            self._rendered = _render(self.config, self.name)
            self.load_timeout_s = self._load_timeout()
        else:
            self.load_timeout_s = None
            self.batcher = DynamicBatcher(0)
            self.groupable = False
            self.slot_bytes = 0
            self.exec_timeout_s = DEFAULT_EXECUTION_TIMEOUT_MS / 1000
            self._rendered = _render(self.config, self.name) if self.config is not None else {}

    def _load_timeout(self) -> float | None:
        """The config's ``model_load_timeout_s`` parameter (None: the pool's); a bad one makes the model
        UNAVAILABLE, naming it."""
        raw = self.config.parameters.get("model_load_timeout_s")
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            self.state = UNAVAILABLE
            self.reason = f"parameter model_load_timeout_s must be a number of seconds > 0, got '{raw}'"
            return None
        return value

    def worker_info(self, info: dict) -> None:
        """An NPU worker reports the batch sizes its .om was compiled for: without preferred sizes of
        its own, the batcher aims for those gears."""
        db = self.config.dynamic_batching
        gears = [g for g in info.get("gears", []) if isinstance(g, int) and 0 < g <= self.config.max_batch_size]
        if gears and db is not None and not db.preferred_given:
            self.batcher.set_preferred(tuple(gears))

    def deadline(self) -> float | None:
        """When the front must look at this model again: a request's queue timeout (whatever the workers
        are doing), or the batcher's delay if an idle worker could take the batch when it comes. While
        every worker computes, a delay that runs out changes nothing (the batch keeps growing until one
        frees, and a completion or an arrival wakes the front): waking for it anyway, the front spun in
        poll(0) from the oldest request's delay to the batch's end, a core taken from the worker."""
        timeout = self.batcher.timeout_deadline()
        if not len(self.batcher) or not any(w.state == READY and w.free and len(w.inflight) < w.concurrency
                                            for w in self.workers):
            return timeout
        delay = self.batcher.deadline()
        return min(d for d in (timeout, delay) if d is not None) if (timeout or delay) else None

    def servable(self) -> bool:
        """READY, or restarting after a crash: such a model keeps queueing, and its requests wait for the
        replacement (bounded by their timeouts and the queue policy) instead of being refused."""
        return self.state == AVAILABLE or (self.state == LOADING and self.was_ready)

    def check_servable(self) -> None:
        if not self.servable():
            why = f": {self.reason}" if self.reason else ""
            raise errors.ModelNotReady(f"model '{self.name}' is {self.state}{why}")

    def refresh_state(self) -> None:
        states = [w.state for w in self.workers]
        if READY in states:
            self.state, self.reason = check_model(self.state, AVAILABLE), ""
            self.was_ready = True
        elif STARTING in states or any(w.restart_at is not None for w in self.workers):
            self.state = check_model(self.state, LOADING)
        elif states:
            self.state = check_model(self.state, UNAVAILABLE)
            self.reason = "; ".join(sorted({w.reason for w in self.workers if w.state == FAILED and w.reason})) \
                or "every worker stopped"

    def rendered_config(self) -> dict:
        """The config this generation serves, as Triton renders it (rendered when it was loaded: the file
        may have changed since)."""
        if isinstance(self._rendered, errors.GepoolError):
            raise self._rendered
        return self._rendered
