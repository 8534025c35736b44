"""Worker and model states, with the transitions each may make (the wire carries their values).

A worker, as the front's books see it::

    STARTING --WorkerReady--> READY --exit--> DEAD --backoff over--> STARTING
        |                       |               (restarted, unless retired or stopping)
        +--------exit-----------+--> DEAD (retired, stopping) | FAILED (exit code: load failed)

A model generation (one version, one load)::

    LOADING --a worker READY--> AVAILABLE <--a worker READY-- LOADING (a restart after a crash)
       |                            |
       +--no worker left--> UNAVAILABLE <--every worker stopped or failed--+   (final: a reload makes
                                                                            a new generation)

AVAILABLE travels as "READY" (Triton's word for a model that serves).
"""

import enum


class WorkerState(enum.StrEnum):
    STARTING = "STARTING"
    READY = "READY"
    DEAD = "DEAD"
    FAILED = "FAILED"


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    AVAILABLE = "READY"
    UNAVAILABLE = "UNAVAILABLE"


WORKER_MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.STARTING, WorkerState.READY, WorkerState.DEAD, WorkerState.FAILED}),
    WorkerState.READY: frozenset({WorkerState.DEAD, WorkerState.FAILED}),
    WorkerState.DEAD: frozenset({WorkerState.STARTING}),
    WorkerState.FAILED: frozenset(),
}

MODEL_MOVES: dict[ModelState, frozenset[ModelState]] = {
    ModelState.LOADING: frozenset({ModelState.LOADING, ModelState.AVAILABLE, ModelState.UNAVAILABLE}),
    ModelState.AVAILABLE: frozenset({ModelState.AVAILABLE, ModelState.LOADING, ModelState.UNAVAILABLE}),
    ModelState.UNAVAILABLE: frozenset({ModelState.UNAVAILABLE}),  # nothing of this generation restarts
}


class TransitionError(RuntimeError):
    """A state change the tables above do not allow: a bug in the front, never a client's doing."""


def check_worker(old: WorkerState, new: WorkerState) -> WorkerState:
    if new not in WORKER_MOVES[old]:
        raise TransitionError(f"a worker cannot go from {old} to {new}")
    return new


def check_model(old: ModelState, new: ModelState) -> ModelState:
    if new not in MODEL_MOVES[old]:
        raise TransitionError(f"a model cannot go from {old} to {new}")
    return new
