"""Model control: which models and versions the front serves, (re)loading without loss, unloading, polling.

Triton's modes: ``none`` loads the whole repository at start and refuses load/unload; ``explicit``
loads only what it is told (``--load-model`` at start, then load/unload requests); ``poll`` loads
the repository and rescans it every ``poll_secs``, reloading what changed and unloading what went.
"""

import logging
import os
import time
from collections.abc import Callable

from gepool.common import errors
from gepool.common.ensemble import MAX_NESTING
from gepool.common.errors import ConfigError
from gepool.common.repository import Reading, load_sources, model_dir, model_names, signature
from gepool.ipc import protocol
from gepool.scheduler.batcher import QueueBudget
from gepool.scheduler.books import Workers
from gepool.scheduler.groups import Group
from gepool.scheduler.models import AVAILABLE, LOADING, UNAVAILABLE, Model
from gepool.scheduler.options import FrontOptions, named_at_start, queued_bytes_limit
from gepool.scheduler.outbox import Outbox
from gepool.scheduler.states import ModelState, WorkerState, check_model

log = logging.getLogger("gepool.control")

MODES = ("none", "explicit", "poll")


def _folder(repository: str, name: str) -> bool:
    """Whether ``name`` is a model folder of the repository (as a load request may name one)."""
    try:
        return os.path.isdir(model_dir(repository, name))
    except ValueError:
        return False


def cpu_threads(budget: int, instances: int) -> int:
    """Each model may use the whole CPU budget (every core the pool may run on, unless set), split
    among its own instances, which run side by side by design. Models do not split it between them:
    most of the time one model is busy and the others idle, and an idle session with spinning off
    costs nothing, so a static split left cores unused (the example MLP at c=16 on two cores: 1094
    rows/s on one thread, 1835-1996 on two). When several models are busy at once, the OS shares the
    cores, as with Triton's onnxruntime backend, whose sessions each take every core by default."""
    return max(1, (budget or len(os.sched_getaffinity(0)) or 1) // max(1, instances))


class ModelControl:
    def __init__(self, opts: FrontOptions, workers: Workers, out: Outbox,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.opts, self.workers, self.out, self.clock = opts, workers, out, clock
        self.groups: dict[str, Group] = {}
        self.unloaded: dict[str, list[int]] = {}  # names unloaded since their last load: the versions they had
        # explicit loads of ensembles, answered once no model under them is loading (answer_ensembles)
        self.after_steps: dict[str, list[tuple[bytes, int]]] = {}
        self.generation = 0
        self.poll_at: float | None = None
        self.budget = QueueBudget(queued_bytes_limit(opts.max_queued_bytes))  # every model's queues share it
        self.changed: Callable[[], None] = lambda: None  # the set of models held changed (loaded or dropped)
        self.reading = Reading.of(opts.auto_complete_config, opts.backend_config, opts.model_config_name)
        if opts.backend_config and not opts.auto_complete_config:
            log.warning("--backend-config default-max-batch-size has no effect: auto-complete is disabled, so no "
                        "model's max_batch_size is completed")

    @property
    def mode(self) -> str:
        return self.opts.model_control_mode

    def models(self) -> list[Model]:
        return [m for g in self.groups.values() for m in g.models()]

    def start(self) -> None:
        opts = self.opts
        if not os.path.isdir(opts.repository):  # in every mode: explicit loads would only fail later
            raise FileNotFoundError(f"model repository '{opts.repository}' does not exist or is not a directory")
        named = named_at_start(self.mode, opts.load_models)  # (explicit mode with none named loads none)
        for name in model_names(opts.repository) if named is None else named:
            self.load(name)
        if self.mode == "poll":
            self.poll_at = self.clock() + opts.poll_secs

    def group(self, name: object) -> Group:
        group = self.groups.get(name) if isinstance(name, str) else None
        if group is None or group.unloading:
            served = sorted(n for n, g in self.groups.items() if not g.unloading)
            raise errors.ModelNotFound(f"Request for unknown model: '{name}' is not found (this pool serves {served})")
        return group

    # -- load and unload -------------------------------------------------------------------
    def request(self, what: str, name: object, waiter: tuple[bytes, int]) -> dict | None:
        """A client's load/unload; a load is answered when it settles (None: the reply comes later)."""
        if self.mode != "explicit":
            raise errors.Unavailable(f"explicit model {what} is not allowed: this pool runs with model control "
                                     f"mode {self.mode.upper()} (start it with --model-control-mode explicit)")
        try:
            folder = model_dir(self.opts.repository, name)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        if what == "load" and not os.path.isdir(folder):  # refused, and nothing is added to the index
            raise errors.ModelNotFound(f"failed to load '{name}': the model repository has no folder '{name}'")
        if what == "unload":
            if name not in self.groups or self.groups[name].unloading:
                raise errors.ModelNotFound(f"Request for unknown model: '{name}' is not loaded")
            self.unload(name)
            return {"unloaded": name}
        try:
            self.load(name, waiter)
        except BaseException:  # the caller answers with what was raised: the waiter is not answered again
            group = self.groups.get(name)
            for waiting in (self.after_steps.get(name), group.waiters if group is not None else None):
                if waiting and waiter in waiting:
                    waiting.remove(waiter)
            if self.after_steps.get(name) == []:
                del self.after_steps[name]
            raise
        return None

    def load(self, name: str, waiter: tuple[bytes, int] | None = None, depth: int = 0) -> None:
        """Starts a new generation of every selected version beside what serves now. In explicit mode an
        ensemble's step models that are not held are loaded with it (as Triton loads an ensemble's
        dependencies), and its load is answered once none of them is loading (``answer_ensembles``)."""
        group = self.groups.get(name)
        if group is None or group.unloading and not group.models():
            group = self.groups[name] = Group(name)
        group.unloading = False
        self.unloaded.pop(name, None)
        if group.loading:
            if waiter is not None:
                group.waiters.append(waiter)
            return  # a load is under way; this request is answered when it settles
        group.signature = signature(self.opts.repository, name)
        sources = load_sources(self.opts.repository, name, self.reading)
        steps = {step.model_name for src in sources if not src.error and src.config is not None
                 and src.config.ensemble is not None for step in src.config.ensemble.steps}
        if waiter is not None:
            (self.after_steps.setdefault(name, []) if steps else group.waiters).append(waiter)
        if self.mode == "explicit" and depth < MAX_NESTING:  # (deeper, the ensemble's own check names the chain)
            for step in sorted(steps):  # (this group is held already: a cycle of ensembles ends here)
                held = self.groups.get(step)
                if (held is None or held.unloading) and _folder(self.opts.repository, step):
                    self.load(step, depth=depth + 1)
        for src in sources:
            self.generation += 1
            model = Model(src, group.version_stats(src.version), self.generation, self.clock,
                          self.budget)
            if src.config is not None and src.config.response_cache and not self.opts.cache_size:
                log.warning("model %s: response_cache is enabled, but this pool has no response cache "
                            "(start it with --cache-config local,size=BYTES): its responses are not cached", name)
            group.loading.append(model)
            if src.error or model.state == UNAVAILABLE:
                log.error("model %s version %s cannot load: %s", name, src.version, src.error or model.reason)
                continue
            self._place(model)
        self.changed()  # before any of them serves: a sidecar's body limit is raised first
        self.settle(group)

    def _place(self, model: Model) -> None:
        if model.config.ensemble is not None:  # no worker: it serves once settled, in its steps' state
            model.state = check_model(model.state, AVAILABLE)
            return
        try:
            placements = self.out.place(model.config)  # [(device, batches in flight)], from the backend
        except ConfigError as exc:
            log.error("model %s version %s cannot load: %s", model.name, model.version, exc)
            model.state, model.reason = check_model(model.state, UNAVAILABLE), str(exc)
            return
        threads = cpu_threads(self.opts.cpu_threads, len(placements))
        for device, concurrency in placements:
            w = self.workers.add(model, device, threads, model.slots_per_worker * concurrency, model.slot_bytes)
            w.concurrency, w.spawned_at = concurrency, self.clock()
            model.workers.append(w)
            self.out.spawn(w)

    def unload(self, name: str) -> None:
        group = self.groups[name]
        self.unloaded[name] = sorted({m.version for m in (*group.serving.values(), *group.loading)
                                      if m.version is not None})
        group.unloading = True
        group.draining += [*group.serving.values(), *group.loading]
        group.serving, group.loading = {}, []
        self._answer(group, errors.Unavailable(f"model '{name}' was unloaded before its load finished"))

    def settle(self, group: Group) -> None:
        result = group.settle()
        if result is None:
            return
        old, failed = result
        for model in failed:
            self.retire(model)
        if old:
            log.info("model %s: versions %s now serving; %d older generation(s) draining", group.name,
                     sorted(group.serving), len(old))
        swapped = bool(old) or (group.serving and not failed)
        if not group.serving:
            error = errors.ModelNotReady(f"model '{group.name}' failed to load: {group.error}")
        elif failed and not swapped:
            error = errors.ModelNotReady(f"model '{group.name}' failed to load; the generation already "
                                         f"serving keeps serving: {group.error}")
        else:
            error = None
        self._answer(group, error)

    def answer_ensembles(self) -> None:
        """Answers each ensemble load waiting on its steps once none of the models it needs is loading: with
        the ensemble's state then (the ensembles' states refreshed just before)."""
        for name, waiters in list(self.after_steps.items()):
            group = self.groups.get(name)
            if group is None or group.unloading:
                error = errors.Unavailable(f"model '{name}' was unloaded before its load finished")
            elif group.loading or any(m.state == LOADING for m in group.serving.values()):
                continue
            elif group.serving and any(m.servable() for m in group.serving.values()):
                error = None
            else:
                why = "; ".join(m.reason for m in group.serving.values() if m.reason) or group.error or "not ready"
                error = errors.ModelNotReady(f"model '{name}' failed to load: {why}")
            del self.after_steps[name]
            if group is not None:
                group.waiters += waiters
                self._answer(group, error)
            else:
                for identity, req_id in waiters:
                    self.out.reply(identity, [protocol.Error(req_id, error.code, error.message).encode()])

    def _answer(self, group: Group, error: errors.GepoolError | None) -> None:
        for identity, req_id in group.waiters:
            if error is not None:
                msg = protocol.Error(req_id, error.code, error.message)
            else:
                msg = protocol.Reply(req_id, {"loaded": group.name, "versions": sorted(group.serving),
                                              "failed": group.error})
            self.out.reply(identity, [msg.encode()])
        group.waiters = []

    # -- the repository index ----------------------------------------------------------------
    def index(self, ready_only: bool = False) -> list[dict]:
        """Triton's repository index: every model folder, and every name still served. A name with versions
        has one row per version with its state (and reason); one never loaded has its name only; one
        unloaded is UNAVAILABLE, reason "unloaded"."""
        try:
            folders = model_names(self.opts.repository)
        except FileNotFoundError:
            folders = []
        rows = []
        for name in sorted(set(folders) | set(self.groups)):
            group = self.groups.get(name)
            if group is not None and group.unloading:
                found = [(m.version, "UNLOADING", "") for m in group.models()]
            elif group is not None:
                found = [(m.version, ModelState.AVAILABLE if m.servable() else m.state, m.reason)
                         for m in (*group.serving.values(), *group.loading)]
                if not found:
                    found = [(m.version, m.state, m.reason or group.error) for m in group.failed]
            else:
                found = [(v, ModelState.UNAVAILABLE, "unloaded") for v in self.unloaded.get(name, ())]
            if not found and not ready_only:
                rows.append({"name": name})
            for version, state, reason in sorted(found, key=lambda f: f[0] if f[0] is not None else -1):
                if ready_only and state != ModelState.AVAILABLE:
                    continue
                row = {"name": name, "version": "" if version is None else str(version), "state": str(state)}
                if reason:
                    row["reason"] = reason
                rows.append(row)
        return rows

    # -- draining and retiring --------------------------------------------------------------
    def retire(self, model: Model) -> None:
        """Stops a generation's workers for good (Stop to a ready worker, kill to one still starting)."""
        for w in model.workers:
            if w.retired:
                continue
            w.retire()
            if w.process is None:
                self.workers.forget(w)
                continue
            if w.state == WorkerState.READY:
                self.out.stop(w)
            elif w.state == WorkerState.STARTING:
                self.out.kill(w)

    def drain(self) -> None:
        """Generations that were replaced or unloaded stop once nothing of theirs is queued or running. One that
        never finished loading stops at once: what waits in its queue (a warmup's BLS call) fails when its
        workers have exited, instead of keeping it loading to serve after its unload."""
        dropped = False
        for name, group in list(self.groups.items()):
            for model in list(group.draining):
                if model.state != LOADING and (len(model.batcher) or any(w.inflight for w in model.workers)):
                    continue
                self.retire(model)
                if any(w.process is not None for w in model.workers):
                    continue  # Stop sent; it leaves the books when its workers have exited
                group.draining.remove(model)
                dropped = True
            if group.unloading and not group.models():
                del self.groups[name]
        if dropped:
            self.changed()

    def on_refresh(self, model: Model) -> None:
        group = self.groups.get(model.name)
        if group is not None and model in group.loading and model.state != LOADING:
            self.settle(group)

    # -- polling ----------------------------------------------------------------------------
    def poll(self, now: float) -> None:
        if self.poll_at is None or now < self.poll_at:
            return
        self.poll_at = now + self.opts.poll_secs
        repo = self.opts.repository
        try:
            names = set(model_names(repo))
        except FileNotFoundError:
            return
        for name in sorted(names):
            group = self.groups.get(name)
            if group is None or group.unloading or (not group.loading and signature(repo, name) != group.signature):
                log.info("repository poll: (re)loading %s", name)
                self.load(name)
        for name, group in list(self.groups.items()):
            if name not in names and not group.unloading:
                log.info("repository poll: %s is gone; unloading", name)
                self.unload(name)
