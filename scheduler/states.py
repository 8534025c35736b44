"""Worker and model states as enums, with the transitions each may make (the wire carries their values)."""

import enum

from gepool.ipc.protocol import ModelState


class WorkerState(enum.StrEnum):
    """A worker as the front's books see it; only the books (scheduler/books.py) move it::

        STARTING --WorkerReady--> READY
           |                        |
           +---------- exit --------+--> DEAD --backoff over--> STARTING   (a restart)
                                    |     (kept DEAD: retired, or the pool stops)
                                    +--> FAILED                            (its load failed; final)

    DEAD -> FAILED: the worker's "cannot load" message was handled after its exit.
    """

    STARTING = "STARTING"
    READY = "READY"
    DEAD = "DEAD"
    FAILED = "FAILED"


# A model generation's states, from its workers' states (Model.refresh_state)::
#
#     LOADING --a worker READY--> AVAILABLE --no worker ready, one restarting--> LOADING
#        |                            |
#        +----- no worker left -------+--> UNAVAILABLE   (final: a reload is a new generation)
#
# The enum is the status wire's vocabulary, so the surfaces read it from gepool.ipc without the scheduler.


WORKER_MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.STARTING, WorkerState.READY, WorkerState.DEAD, WorkerState.FAILED}),
    WorkerState.READY: frozenset({WorkerState.DEAD, WorkerState.FAILED}),
    WorkerState.DEAD: frozenset({WorkerState.STARTING, WorkerState.FAILED}),
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
