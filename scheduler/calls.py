"""BLS calls in the front: the batch each waits on, the wait-for check, and what a gone batch leaves queued.

A python worker runs one batch at a time, and a batch that makes BLS calls runs until they are answered.
The front books each call under the batch that made it, and reads a wait-for graph from the books:

* a batch finishes once each of its calls does;
* a queued call runs once any worker of its model can take it: one whose running batch finishes, one
  starting (once its warmup's calls do) or one restarting after a crash; never one that failed for good,
  nor one of a model never ready that keeps dying while it loads (``CRASH_LOOP_DEATHS``);
* a call in a worker's running batch finishes with that batch; one in a batch already over, at once.

A worker's running batch, as far as calls go, is its newest batch that made a call: the worker runs its
batches in order, so an older one it still holds is over and only waits for its completion to be read.

What finishes is the least fixpoint of these rules; a call outside it waits on calls that wait on it, and
only a timeout would ever end it. Such a call is refused as it arrives (it closes the cycle); after a
worker stops for good, a queued call left outside it is failed. A call into a model that has a worker with
no batch waiting on a call needs no graph (the fast path). A warmup's call into a model still loading queues
there like any call (``warming``), so warmups that wait on each other are a cycle too.

A call into an ensemble is booked as its step requests, each under the calling batch as it enters its
model's queue: the batch waits on the steps running or queued now, and a step that would close a cycle is
refused like a call. Once the batch is gone, the run stops (its ``Step``'s ``cancel``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gepool.common import errors
from gepool.ipc import protocol
from gepool.scheduler.books import dispatched
from gepool.scheduler.dispatch import send_error
from gepool.scheduler.requests import Sink
from gepool.scheduler.states import ModelState, WorkerState
from gepool.scheduler.stats import CANCELED

if TYPE_CHECKING:
    from gepool.scheduler.books import Worker, Workers
    from gepool.scheduler.models import Model
    from gepool.scheduler.requests import Request

OK, NEVER = "ok", "never"  # the graph's leaves: finishes on its own; never will (a worker failed for good)
ALL, ANY = "all", "any"
# a worker of a model never ready that died this many times in a row while loading is taken to never run a
# call (its restarts go on, with their backoff: a warmup waiting on it would wait out its whole timeout)
CRASH_LOOP_DEATHS = 3


class Step(Sink, Protocol):
    """The sink of an ensemble's step request that a BLS call started: the call wraps it."""

    def cancel(self, err: errors.GepoolError) -> None:
        """The batch that made the call is gone: the run stops, its client hears ``err``."""

    def callee(self) -> str:
        """The ensemble the batch called: "ensemble 'e'"."""

    def hops(self) -> list[str]:
        """Its place in the wait, outermost ensemble first: ["ensemble 'e' step 1 ('b')", ...]."""


class Call:
    """One BLS call in the books, and its request's sink: answers the caller as a client's request is
    answered; once the batch that made it is gone (``gone`` says how), it answers a cancellation instead.
    ``step``: the call is a step of an ensemble the batch called, and that step's sink gets the answer."""

    __slots__ = ("calls", "req", "model", "worker", "batch", "gone", "step")

    def __init__(self, calls: Calls, req: Request, model: Model, worker: Worker, batch: tuple[int, int],
                 step: Step | None = None) -> None:
        self.calls, self.req, self.model, self.worker, self.batch = calls, req, model, worker, batch
        self.gone: str | None = None
        self.step = step

    def done(self, model: Model, arrays: dict, row: int, compute_s: float) -> bool:
        self.calls.forget(self)
        if self.gone is not None:  # its answer is thrown away: nobody waits for it (a step's run has stopped)
            if self.step is None:
                self.calls.send_error(self.req, self.calls.canceled(self))
            return False
        if self.step is not None:
            return self.step.done(model, arrays, row, compute_s)
        self.calls.respond(model, self.req, arrays, row)
        return True

    def failed(self, model: Model, err: errors.GepoolError) -> None:
        self.calls.forget(self)
        if self.step is None:
            self.calls.send_error(self.req, err if self.gone is None else self.calls.canceled(self))
        elif self.gone is None:
            self.step.failed(model, err)


Respond = Callable[["Model", "Request", dict, int], None]  # the dispatcher's: outputs to the caller
Reply = Callable[[bytes, list, bool], None]  # the outbox's
Fail = Callable[["Model", "Request", errors.GepoolError], None]  # the dispatcher's reply_error: counted, then sent


class Calls:
    """The BLS calls the front has admitted and not answered, by the batch that made each."""

    def __init__(self, workers: Workers, respond: Respond, reply: Reply, fail: Fail) -> None:
        self.workers, self.respond, self.reply, self.fail = workers, respond, reply, fail
        # worker id -> (slot, seq) of its batch -> that batch's calls (a dict: ordered, O(1) removal)
        self.by_worker: dict[int, dict[tuple[int, int], dict[Call, None]]] = {}
        self.orphans: set[Call] = set()  # running when their batch went: a retry must not run them again

    # -- the books -------------------------------------------------------------------------
    def enter(self, req: Request, model: Model, caller: list) -> Call | None:
        """Books ``req``, a BLS call into ``model``'s queue from the batch ``caller`` names ([worker, slot,
        seq], checked by bls_chain), or a step request of an ensemble it called (its sink a ``Step``), and
        makes it the request's sink; raises Unavailable, booking nothing, when it could never run. None (not
        booked) for a warmup's call from a worker already serving."""
        w = self.workers.get(caller[0])
        slot, seq = caller[1], caller[2]
        if slot == protocol.WARMUP_SLOT:
            if w.state != WorkerState.STARTING:
                return None
            seq = 0
        call = Call(self, req, model, w, (slot, seq), req.sink)
        self.by_worker.setdefault(w.id, {}).setdefault(call.batch, {})[call] = None
        req.sink = call
        if not model.workers or any(self._worker_node(x) is OK for x in model.workers):
            return call
        stuck = self._stuck([call])
        if call in stuck:
            self.forget(call)
            req.sink = call.step
            raise errors.Unavailable(f"model '{model.name}' cannot take this BLS call: {self._why(call, stuck)}; "
                                     f"refused rather than left to wait out its timeout")
        return call

    def warming(self, caller: list | None) -> bool:
        """Whether ``caller`` (checked by bls_chain) names the warmup of a worker still starting: its call
        into a model still loading queues there until a worker of that model is ready, booked as any call,
        so that warmups waiting on each other are refused as they close the cycle."""
        if caller is None or caller[1] != protocol.WARMUP_SLOT:
            return False
        w = self.workers.get(caller[0])
        return w is not None and self._running(w, (protocol.WARMUP_SLOT, 0)) and not w.load_failed

    def check_servable(self, model: Model, caller: list | None) -> None:
        """``model.check_servable()``, except for a warmup's call into a model still loading (``warming``),
        which may queue there."""
        if not (model.state == ModelState.LOADING and self.warming(caller)):
            model.check_servable()

    def forget(self, call: Call) -> None:
        """Out of the books: answered, or never queued after all."""
        if call.gone is not None:
            self.orphans.discard(call)
            return
        batches = self.by_worker.get(call.worker.id)
        calls = batches.get(call.batch) if batches is not None else None
        if calls is None or call not in calls:
            return
        del calls[call]
        if not calls:
            del batches[call.batch]
            if not batches:
                del self.by_worker[call.worker.id]

    def sweep(self, w: Worker, why: str) -> None:
        """After ``w``'s batches ended (completed, failed, lost with its process) or its warmup did: the calls
        of each batch no longer running leave the books; those still queued leave their queue unrun
        (CANCELED), and the answers of those running will be thrown away."""
        batches = self.by_worker.get(w.id)
        if batches is None:
            return
        for key in [k for k in batches if not self._running(w, k)]:
            for call in batches.pop(key):
                call.gone = why
                if call.step is not None:  # its run stops first: none of its later steps may start
                    call.step.cancel(self.canceled(call))
                if not self._withdraw(call):
                    self.orphans.add(call)
        if not batches:
            del self.by_worker[w.id]

    def requeued(self) -> None:
        """After a callee's worker died: an orphan its recovery put back in a queue leaves it unrun."""
        for call in [c for c in self.orphans if self._withdraw(c)]:
            self.orphans.discard(call)

    def _withdraw(self, call: Call) -> bool:
        if not call.model.batcher.withdraw(call.req):
            return False
        call.model.stats.failed(CANCELED, call.req.origin)
        if call.step is None:
            self.send_error(call.req, self.canceled(call))
        return True

    def recheck(self) -> None:
        """After a worker stopped for good: a queued call that can now never run fails, the newest first and
        one at a time (each failure may let the others run)."""
        while self.by_worker:
            calls = [c for batches in self.by_worker.values() for cs in batches.values() for c in cs]
            stuck = self._stuck(calls)
            for call in reversed(calls):
                if call in stuck and call.model.batcher.withdraw(call.req):
                    self.fail(call.model, call.req, errors.Unavailable(
                        f"model '{call.model.name}' can no longer run this BLS call: {self._why(call, stuck)}"))
                    break
            else:
                return

    def canceled(self, call: Call) -> errors.GepoolError:
        callee = f"model '{call.model.name}'" if call.step is None else call.step.callee()
        return errors.Unavailable(f"BLS call to {callee} canceled: the batch of model "
                                  f"'{call.worker.model.name}' that made it is gone ({call.gone})")

    def send_error(self, req: Request, err: errors.GepoolError) -> None:
        send_error(self.reply, req, err)

    # -- the wait-for graph ----------------------------------------------------------------
    def _running(self, w: Worker, key: tuple[int, int]) -> bool:
        if key[0] == protocol.WARMUP_SLOT:
            return w.state == WorkerState.STARTING
        batch = w.inflight.get(key[0])
        return batch is not None and batch.seq == key[1]

    def _head(self, w: Worker) -> tuple[int, int] | None:
        """The (slot, seq) of ``w``'s running batch if it waits on a call: its newest that made one."""
        batches = self.by_worker.get(w.id)
        if not batches:
            return None
        keys = [k for k in batches if k[0] != protocol.WARMUP_SLOT and self._running(w, k)]
        return max(keys, key=lambda k: k[1]) if keys else None

    @staticmethod
    def _crash_looping(w: Worker) -> bool:
        return w.streak >= CRASH_LOOP_DEATHS and not w.model.was_ready and not w.load_failed

    def _worker_node(self, w: Worker):
        if w.state == WorkerState.READY:
            head = self._head(w)
            return OK if head is None else (w.id, *head)
        if self._crash_looping(w):
            return NEVER
        if w.state == WorkerState.STARTING:
            if w.load_failed:
                return NEVER
            return (w.id, protocol.WARMUP_SLOT, 0) if (protocol.WARMUP_SLOT, 0) in self.by_worker.get(w.id, {}) else OK
        return OK if w.state == WorkerState.DEAD and w.restart_at is not None else NEVER

    def _edges(self, node) -> tuple[str, tuple]:
        if node is OK:
            return ALL, ()
        if node is NEVER:
            return ANY, ()
        if type(node) is tuple:  # a batch (worker id, slot, seq): over once each of its calls is
            return ALL, tuple(self.by_worker.get(node[0], {}).get(node[1:], ()))
        call: Call = node
        placed = dispatched(call.model, call.req)
        if placed is not None:
            w, _, batch, _ = placed
            head = self._head(w)
            return ALL, () if head is None or batch.seq < head[1] else ((w.id, *head),)
        return ANY, tuple(dict.fromkeys(self._worker_node(w) for w in call.model.workers))

    def _stuck(self, starts: list) -> dict:
        """The nodes reachable from ``starts`` that never finish, each with its successors."""
        graph: dict = {}
        todo = list(starts)
        while todo:
            node = todo.pop()
            if node not in graph:
                graph[node] = self._edges(node)
                todo.extend(graph[node][1])
        need = {n: (len(kids) if kind == ALL else 1) for n, (kind, kids) in graph.items()}
        parents: dict = {}
        for n, (_, kids) in graph.items():
            for k in kids:
                parents.setdefault(k, []).append(n)
        moving = [n for n, left in need.items() if left == 0]
        finishes = set()
        while moving:
            n = moving.pop()
            finishes.add(n)
            for p in parents.get(n, ()):
                need[p] -= 1
                if need[p] == 0:
                    moving.append(p)
        return {n: kids for n, (_, kids) in graph.items() if n not in finishes}

    def _why(self, call: Call, stuck: dict) -> str:
        """Why ``call`` never runs, naming workers: the cycle back to the batch that made it, if there is one."""
        start = (call.worker.id, *call.batch)
        seen, queue = {call: None}, deque([call])
        while queue:
            node = queue.popleft()
            if node == start:
                break
            for k in stuck.get(node, ()):
                if k in stuck and k not in seen:
                    seen[k] = node
                    queue.append(k)
        path, node = [], start if start in seen else None
        while node is not None:
            path.append(node)
            node = seen[node]
        if not path:  # the wait never comes back to the caller: it ends at workers that stopped for good
            why = "; ".join(self._never_reasons(call, seen))
            return f"no worker of model '{call.model.name}' will ever be free to run it" + (f" ({why})" if why else "")
        hops = [self._name(start)]
        for n in reversed(path):  # the call first: each call, then the batch that waits on it
            if type(n) is tuple:
                hops.append(self._name(n))
            elif isinstance(n, Call) and n.step is not None:
                hops += n.step.hops()
        cycle = " -> ".join(hops)
        return f"every worker that could run it waits, through BLS calls, on the batch that made it ({cycle})"

    def _never_reasons(self, call: Call, reached) -> dict[str, None]:
        """Why the workers the wait ``reached`` (the callee's first, then those of the calls it waits on) will
        never run a call: the current reason of each that will not, never that of a worker serving again."""
        out: dict[str, None] = {}
        models = dict.fromkeys([call.model, *(n.model for n in reached if isinstance(n, Call))])
        for model in models:
            for w in model.workers:
                if self._worker_node(w) is not NEVER:
                    continue
                why = w.reason or f"worker {w.id} stopped"
                if self._crash_looping(w):
                    why += f", {w.streak} times in a row while loading"
                out[why if model is call.model else f"model '{model.name}': {why}"] = None
        return out

    def _name(self, node: tuple) -> str:
        w = self.workers.get(node[0])
        if w is None:
            return f"worker {node[0]}"
        return f"{w.model.name} (worker {w.id}{', warming up' if node[1] == protocol.WARMUP_SLOT else ''})"
