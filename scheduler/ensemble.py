"""Ensembles scheduled in the front: each step a request in its model's own queue, tensors kept between steps.

An ensemble request is admitted against the ensemble's config, then each step whose input tensors all
exist becomes an internal request of its model (admitted like a client's, so it batches with direct
requests and with other ensembles' steps). When a step's batch completes, the next step's batch copies
its outputs from its slot into its own when it goes out at once (the copy batching needs); what has to
wait is first copied out of the slot into buffers the run owns (``handoff``). The ensemble's outputs are
answered from the last step's slot, or from those buffers. Nothing passes through a socket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from gepool.common import errors
from gepool.common.ensemble import LATEST, check_nesting, check_steps
from gepool.ipc import dtypes, protocol
from gepool.scheduler import handoff
from gepool.scheduler.calls import Call, Calls
from gepool.scheduler.dispatch import send_error
from gepool.scheduler.handoff import Copies, Link, Tensor
from gepool.scheduler.models import AVAILABLE, LOADING, UNAVAILABLE, Model
from gepool.scheduler.requests import (
    Admission,
    NotText,
    Request,
    check_batch,
    check_names,
    check_tensor,
    check_texts,
    whole_buffer,
)
from gepool.scheduler.stats import CANCELED, failure_reason

log = logging.getLogger("gepool.ensemble")
MAX_CHECKED = 1024  # step checks remembered (one per ensemble generation and its steps' generations)


@dataclass(eq=False)
class Run:
    """One ensemble request on its way through the steps."""

    model: Model  # the ensemble generation it was admitted to (it may be reloaded meanwhile)
    req: Request  # its priority and deadline (its timeout or its client's, whichever ends first) hold
    # for the whole pipeline
    tensors: dict[str, Tensor]
    waiting: set[int]  # steps not started
    # the steps started and not done: each one's request in its model's queue or batch, or its sub-pipeline
    steps: dict[int, tuple[Model, Request] | Run] = field(default_factory=dict)
    finished: bool = False
    queue_s: float = 0.0  # summed over its steps, as Triton reports an ensemble's queue and compute
    compute_s: float = 0.0


@dataclass(eq=False)
class StepSink:
    ensembles: Ensembles
    run: Run
    index: int
    started: float = field(default=0.0)

    def done(self, model: Model, arrays: dict, row: int, compute_s: float) -> bool:
        return self.ensembles.step_done(self, model, arrays, row, compute_s)

    def failed(self, model: Model, err: errors.GepoolError) -> None:
        self.ensembles.fail(self.run, self.index, err)

    def cancel(self, err: errors.GepoolError) -> None:
        self.ensembles.cancel(self.run, err)

    def callee(self) -> str:
        *_, top = _up(self)
        return f"ensemble '{top.run.model.name}'"

    def hops(self) -> list[str]:
        """This step and the steps above it that are ensembles, outermost first."""
        out = [f"ensemble '{s.run.model.name}' {s.run.model.config.ensemble.steps[s.index].label(s.index)}"
               for s in _up(self)]
        return out[::-1]


def _up(sink: object) -> Iterator[StepSink]:
    """``sink`` if it is an ensemble step's, then the step of each ensemble above, to the outermost one (whose
    request a client or a BLS call made)."""
    while isinstance(sink, StepSink):
        yield sink
        sink = sink.run.req.sink


def _admit_step(plan: Admission, input_map: dict[str, str], run: Run, now: float, timeout_us: int) -> Request:
    """A step request made straight from the run's tensors, each whole already (admitted with the ensemble's
    request, or a step's output), checked by the functions ``admit`` checks a client's request with."""
    check_names(plan, input_map.keys())
    shapes, buffers, rows, total = [], [], -1, 0
    tensors = run.tensors
    for spec in plan.inputs:
        name, _, _, itemsize = spec
        t = tensors[input_map[name]]
        rows = check_tensor(plan, spec, t.datatype, t.shape, rows, shapes)
        buf = whole_buffer(name, itemsize, t.shape, t.buf)
        shapes.append(t.shape)
        buffers.append(buf)
        total += len(buf)
    rows, total, key = check_batch(plan, shapes, rows, total)
    try:
        check_texts(plan, shapes, buffers)
    except NotText as exc:
        if input_map[exc.input] in run.model.admission.names:  # the client's own tensor
            raise
        raise errors.ModelError(f"{exc.message} (tensor '{input_map[exc.input]}', an earlier step's output)") from None
    outer = run.req
    return Request(outer.identity, outer.req_id, plan.config.name, shapes, buffers, rows, total, None,
                   protocol.NO_ARENA, 0, 0, now, key, origin=outer.origin, priority=outer.priority,
                   deadline=now + timeout_us / 1e6 if timeout_us else None,
                   expires=now + timeout_us / 1e6 if timeout_us else None)


def _step_sink(req: Request) -> StepSink:
    """The sink of an ensemble's step request, under the BLS call that may wrap it."""
    sink = req.sink
    return sink.step if isinstance(sink, Call) else sink


class Ensembles:
    """Runs the ensembles' requests, and keeps each ensemble's state that of its steps' models.
    ``respond`` answers a client from arrays (the dispatcher's), ``reply`` sends a client a message (the
    outbox's), ``enqueue`` puts a step request in its model's queue and marks it to be scheduled (raising
    as admission does when it cannot; a step of an ensemble a BLS call runs is booked there, under the batch
    that made the call), ``prewake(model name)`` wakes the idle worker of a step about to
    be queued, when traffic is sequential (the core's rule for a client's request; ``may_prewake()`` says
    whether it is, for any model), ``dispatch(model)``
    hands out the batches a model's queue can send now (the dispatcher's). ``hand_over()`` must follow each
    completion the dispatcher handles, before any other batch is dispatched (the core's on_completions).
    ``calls``: the BLS calls' books, which a step of such an ensemble leaves when it is withdrawn."""

    def __init__(self, control, arenas, respond: Callable, reply: Callable, enqueue: Callable,
                 clock: Callable[[], float], prewake: Callable[[str], bool] = lambda name: False,
                 dispatch: Callable[[Model], None] = lambda model: None, calls: Calls | None = None,
                 may_prewake: Callable[[], bool] = lambda: True) -> None:
        self.control, self.arenas, self.clock = control, arenas, clock
        self.respond, self.reply, self.enqueue, self.prewake = respond, reply, enqueue, prewake
        self.may_prewake = may_prewake
        self.dispatch, self.calls = dispatch, calls
        self.copies = Copies()
        self._links: list[Link] | None = None  # step requests submitted while a completion is handled
        self._pending: list[tuple[Run, Model, list[Link]]] = []  # runs holding views of the completed slot
        self._checked: dict[tuple, tuple] = {}  # _steps_problem's results

    # -- state -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Every ensemble generation's state, from what its steps would run now; an ensemble step's state
        is settled before that of any ensemble above it."""
        settled: set[Model] = set()
        for group in self.control.groups.values():
            for model in (*group.serving.values(), *group.loading):
                self._settle(model, settled)
        if self.control.after_steps:
            self.control.answer_ensembles()

    def _settle(self, model: Model, settled: set[Model]) -> None:
        if model in settled or model.config is None or model.config.ensemble is None or model.source.error:
            return
        settled.add(model)
        model.state, model.reason = self._state(model, settled)

    def _nested(self, name: str) -> list[str]:
        """The ensembles that the steps of ensemble ``name`` name, in any generation loaded or loading."""
        group = self.control.groups.get(name)
        if group is None:
            return []
        out = []
        for model in (*group.serving.values(), *group.loading):
            if model.config is not None and model.config.ensemble is not None:
                out += [s.model_name for s in model.config.ensemble.steps if self._is_ensemble(s.model_name)]
        return out

    def _is_ensemble(self, name: str) -> bool:
        group = self.control.groups.get(name)
        return group is not None and any(m.config is not None and m.config.ensemble is not None
                                         for m in (*group.serving.values(), *group.loading))

    def _state(self, model: Model, settled: set[Model]) -> tuple[str, str]:
        problem = check_nesting(model.name, self._nested)
        if problem:
            return UNAVAILABLE, f"ensemble '{model.name}': {problem}"
        configs, loading = {}, []

        def where(i: int, step) -> str:  # formatted only for a message: the tick refreshes every ensemble
            return f"ensemble '{model.name}' {step.label(i)}"

        for i, step in enumerate(model.config.ensemble.steps):
            group = self.control.groups.get(step.model_name)
            if group is None or group.unloading:
                gone = step.model_name in self.control.unloaded or (group is not None and group.unloading)
                state = "unloaded" if gone else "not loaded"
                return UNAVAILABLE, f"{where(i, step)}: model '{step.model_name}' is {state}"
            for inner in (*group.serving.values(), *group.loading):
                self._settle(inner, settled)  # an ensemble as a step: in its own steps' state first
            target = self._target(group, step.model_version)
            if target is None:
                if group.loading or any(m.state == LOADING for m in group.serving.values()):
                    loading.append(where(i, step))
                    continue
                want = f"version {step.model_version}" if step.model_version != LATEST else "version"
                why = group.error or "; ".join(m.reason for m in group.serving.values() if m.reason) or "not ready"
                return UNAVAILABLE, f"{where(i, step)}: model '{step.model_name}' has no {want} ready: {why}"
            configs[i] = target.config
        if loading:
            return LOADING, f"{loading[0]}: its model is loading"
        problem = self._steps_problem(model.config, configs)
        return (UNAVAILABLE, problem) if problem else (AVAILABLE, "")

    def _steps_problem(self, config, configs: dict[int, object]) -> str | None:
        """``check_steps``, once per ensemble config and set of step configs (all frozen): the front's tick
        refreshes every ensemble's state."""
        key = (id(config), *map(id, configs.values()))
        hit = self._checked.get(key)
        if hit is None:
            if len(self._checked) >= MAX_CHECKED:
                self._checked.clear()
            # the configs are held with their result, so that their ids cannot be reused meanwhile
            hit = self._checked[key] = (check_steps(config, configs), config, tuple(configs.values()))
        return hit[0]

    @staticmethod
    def _target(group, version: int) -> Model | None:
        """The generation a step request would go to now (Group.route's choice among ready ones)."""
        if version != LATEST:
            model = group.serving.get(version)
            return model if model is not None and model.servable() else None
        ready = [m for m in group.serving.values() if m.servable()]
        return max(ready, key=lambda m: m.version) if ready else None

    # -- requests ----------------------------------------------------------------------------
    def start(self, model: Model, req: Request) -> Run:
        """An admitted ensemble request: its first steps enter their queues now (raising, as admission
        does, when one cannot). Its timeout and its client's deadline, whichever ends first, bound the
        whole pipeline."""
        run = self._run(model, req)
        self._begin(run)
        return run

    @staticmethod
    def _run(model: Model, req: Request) -> Run:
        tensors = {t.name: Tensor(t.datatype, req.shapes[i], req.inputs[i]) for i, t in enumerate(model.config.inputs)}
        return Run(model, req, tensors, set(range(len(model.config.ensemble.steps))))

    def _begin(self, run: Run) -> None:
        self._prewake_ready(run, ())
        try:
            self._advance(run)
        except errors.GepoolError:
            run.finished = True
            self._withdraw(run)  # the steps it queued before the one refused
            raise

    def _advance(self, run: Run) -> None:
        """Starts every waiting step whose inputs exist, in the ensemble's order; answers when all ran."""
        steps, have = run.model.config.ensemble.steps, run.tensors.keys()
        for i in run.model.config.ensemble.order:
            if i in run.waiting and steps[i].reads <= have:
                run.waiting.discard(i)
                try:
                    self._submit(run, i)
                except errors.GepoolError as exc:
                    raise type(exc)(f"ensemble '{run.model.name}' {steps[i].label(i)}: {exc.message}") from None
        if not run.waiting and not run.steps:
            self._answer(run)

    def _prewake_ready(self, run: Run, coming: Iterable[str]) -> None:
        """Wakes the workers of the steps that can start once the tensors ``coming`` exist. A worker woken
        by its batch's doorbell takes a CPU from the front in the middle of its hand-over, and the front
        then competes with the batch it handed over; woken first, the worker polls and yields while the
        front copies and admits, and the front goes back to sleep before the batch computes."""
        if not self.may_prewake():
            return
        steps, have = run.model.config.ensemble.steps, run.tensors.keys() | coming
        for i in run.model.config.ensemble.order:
            if i in run.waiting and steps[i].reads <= have:
                self.prewake(steps[i].model_name)

    def _submit(self, run: Run, i: int) -> None:
        step = run.model.config.ensemble.steps[i]
        now = self.clock()
        timeout_us = 0
        if run.req.deadline is not None:
            left = run.req.deadline - now
            if left <= 0:
                raise errors.Timeout("Request timeout expired before this step could start")
            timeout_us = max(1, int(left * 1e6))
        group = self.control.group(step.model_name)
        model = group.route(protocol.NO_VERSION if step.model_version == LATEST else step.model_version)
        if model.name in run.req.chain:  # a BLS caller's own model as a step: it would wait on itself
            loop = " -> ".join([*run.req.chain[run.req.chain.index(model.name):], run.model.name, model.name])
            raise errors.InvalidArgument(f"model '{model.name}' calls itself through BLS: {loop}")
        if self.calls is None:
            model.check_servable()
        else:  # a warmup's step waits for its model to load, as the warmup's call would
            self.calls.check_servable(model, run.req.caller)
        try:
            req = _admit_step(model.admission, step.input_map, run, now, timeout_us)
            req.sink = StepSink(self, run, i, now)
            req.chain, req.caller = run.req.chain, run.req.caller
            if model.config.ensemble is not None:  # a sub-pipeline, answering this step through its sink
                sub = run.steps[i] = self._run(model, req)  # recorded before it starts: it may end at once
                try:
                    self._begin(sub)
                except errors.GepoolError:
                    run.steps.pop(i, None)
                    raise
                group.version_requests[model.version] = group.version_requests.get(model.version, 0) + 1
                return
        except errors.GepoolError as exc:  # refused as a client's request would be, and counted so
            model.stats.failed(failure_reason(exc), run.req.origin)
            raise
        # a BLS call's step is booked, as a call, under the batch that made it (refused if it never could run)
        run.steps[i] = (model, req)
        try:
            self.enqueue(group, model, req, run.req.priority, timeout_us, timeout_us)
        except errors.GepoolError:
            run.steps.pop(i, None)
            raise
        if self._links is not None:
            self._links.append(Link(req, model, [(k, run.tensors[step.input_map[t.name]])
                                                 for k, t in enumerate(model.config.inputs)
                                                 if run.tensors[step.input_map[t.name]].view]))

    def step_done(self, sink: StepSink, model: Model, arrays: dict, row: int, compute_s: float,
                  queue_s: float | None = None) -> bool:
        """Step ``sink.index`` ran: its outputs are rows ``row``.. of ``arrays``, views of its slot; or, for
        a step that is an ensemble (``queue_s`` given: its steps' queue time, summed), the arrays that
        sub-pipeline owns and is done with. False: the run had stopped, and the answer is dropped."""
        run = sink.run
        run.steps.pop(sink.index, None)
        if run.finished:
            return False
        steps = run.model.config.ensemble.steps
        step = steps[sink.index]
        self._prewake_ready(run, step.output_map.values())  # before the copies: the worker wakes meanwhile
        rows = run.req.rows
        batched = model.config.max_batch_size > 0
        owned = queue_s is not None
        fresh = []  # views of the step's slot: valid until hand_over, which follows this completion
        for t in model.config.outputs:
            name = step.output_map.get(t.name)
            if name is None:
                continue
            piece = arrays[t.name][row:row + rows] if batched else arrays[t.name]
            if piece.dtype == object:
                array = piece if owned else piece.copy()
                run.tensors[name] = Tensor(t.datatype, array.shape, memoryview(dtypes.serialize_bytes(array)), array)
            else:
                tensor = Tensor(t.datatype, piece.shape, memoryview(piece).cast("B") if piece.flags.c_contiguous
                                else handoff.EMPTY, piece, view=not owned)
                if not piece.flags.c_contiguous:
                    handoff.own(tensor, self.copies)
                run.tensors[name] = tensor
                fresh.append(tensor)
        run.compute_s += compute_s
        run.queue_s += queue_s if owned else max(0.0, self.clock() - sink.started - compute_s)
        for i in run.waiting:  # an ensemble as a step keeps what it is given: it gets the run's copies
            if self._is_ensemble(steps[i].model_name):
                for name in steps[i].input_map.values():
                    if name in run.tensors:
                        handoff.own(run.tensors[name], self.copies)
        outer, self._links = self._links, []
        try:
            self._advance(run)
        except errors.GepoolError as exc:
            self._fail(run, exc)
        finally:
            links, self._links = self._links, outer
            # a step started here may read a view made earlier in this completion (a sub-pipeline answering
            # after a sibling step of the same batch): its links must reach hand_over too
            if links or any(t.view for t in fresh):
                self._pending.append((run, model, links))
        return True

    def hand_over(self) -> None:
        """After a completion's requests were all answered, before anything can refill its slot: the step
        requests submitted then that read the slot's views go out now if their model's queue holds nothing
        else (the batch copies them slot to slot) and are rebound to their own slot's copy, or are rebound
        to the run's copies to wait; the views still needed later are copied out, the others dropped. A step
        of a run that stopped meanwhile was withdrawn from its queue: it is neither counted nor rebound."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        links = [link for _, _, ls in pending for link in ls if not _step_sink(link.req).run.finished]
        try:
            producers = {id(producer) for _, producer, _ in pending}
            for model in {id(link.model): link.model for link in links if link.inputs}.values():
                ours = sum(1 for link in links if link.model is model)
                if id(model) not in producers and len(model.batcher) == ours:  # nothing queued before them
                    self.dispatch(model)
            places = handoff.Placements()
            for link in links:
                if link.inputs:
                    placed = places.of(link.model, link.req)
                    if placed is not None:
                        handoff.rebind_to_slot(link, placed, places, self.copies)
                    else:
                        handoff.rebind_to_own(link, self.copies)
        except Exception:  # a bug here must not leave a view of a slot about to be refilled
            log.exception("internal error handing ensemble tensors over")
            for link in links:
                handoff.rebind_to_own(link, self.copies)
        for run, _, _ in pending:
            steps = run.model.config.ensemble.steps
            needed = set()
            if not run.finished:  # the steps still to start, and the answer
                needed = {name for i in run.waiting for name in steps[i].input_map.values()}
                needed |= {t.name for t in run.model.config.outputs}
            for name, t in run.tensors.items():
                if name in needed:
                    handoff.own(t, self.copies)
                else:
                    handoff.drop(t)

    def cancel(self, run: Run, err: errors.GepoolError) -> None:
        """The batch whose BLS call started ``run``'s pipeline is gone: it and the runs above it stop unanswered
        (CANCELED in each ensemble's statistics), and the call hears ``err``."""
        for r in (run, *(s.run for s in _up(run.req.sink))):
            if not self._stop(r):
                return
            if not isinstance(r.req.sink, StepSink):
                send_error(self.reply, r.req, err)

    def fail(self, run: Run, index: int, err: errors.GepoolError) -> None:
        """A step that will not run, or that its model failed: the ensemble request fails, the step named."""
        run.steps.pop(index, None)
        if run.finished:
            return
        step = run.model.config.ensemble.steps[index]
        self._fail(run, type(err)(f"ensemble '{run.model.name}' {step.label(index)}: {err.message}"))

    def _fail(self, run: Run, err: errors.GepoolError) -> None:
        run.finished = True
        run.model.stats.failed(failure_reason(err), run.req.origin)
        self._withdraw(run)
        if run.req.sink is not None:  # a sub-pipeline: the ensemble above names its step, and fails too
            run.req.sink.failed(run.model, err)
            return
        send_error(self.reply, run.req, err)

    def _withdraw(self, run: Run) -> None:
        """A run that failed: each of its steps still queued leaves its queue unrun, and each sub-pipeline it
        started stops, its own queued steps with it (CANCELED, in each model's statistics: nobody waits for
        them). A step already in a batch runs, and its answer is dropped."""
        steps, run.steps = run.steps, {}
        for step in steps.values():
            if isinstance(step, Run):
                if self._stop(step):
                    self._withdraw(step)
                continue
            model, req = step
            if model.batcher.withdraw(req):
                model.stats.failed(CANCELED, req.origin)
                if isinstance(req.sink, Call):  # a BLS call's step: out of the calling batch's books
                    self.calls.forget(req.sink)

    @staticmethod
    def _stop(run: Run) -> bool:
        """``run`` stops unanswered, nobody waiting for it (CANCELED in its ensemble's statistics); False when
        it had finished already."""
        if run.finished:
            return False
        run.finished = True
        run.model.stats.failed(CANCELED, run.req.origin)
        return True

    def _answer(self, run: Run) -> None:
        run.finished = True
        model, req = run.model, run.req
        outs = [run.tensors[t.name] for t in model.config.outputs]  # each produced by a step
        if req.sink is not None:  # a sub-pipeline: its outputs become the step's above, kept past this call
            for t in outs:
                handoff.own(t, self.copies)
        else:  # answered (copied into the reply or the client's arena) before the slot is released
            self.copies.answered_bytes += sum(t.array.nbytes for t in outs if t.view)
        arrays = {t.name: tensor.array for t, tensor in zip(model.config.outputs, outs, strict=True)}
        if req.sink is not None:
            model.stats.ensemble_answered(req.rows, self.clock() - req.arrived, run.queue_s, run.compute_s,
                                          req.origin)
            self.step_done(req.sink, model, arrays, 0, run.compute_s, run.queue_s)
            return
        try:
            self.respond(model, req, arrays, 0)
        except Exception as exc:  # one bad answer must not take the front down
            log.exception("internal error answering ensemble request %s", req.req_id)
            self._fail(run, errors.Internal(f"internal error: {exc}"))
            return
        model.stats.ensemble_answered(req.rows, self.clock() - req.arrived, run.queue_s, run.compute_s, req.origin)
