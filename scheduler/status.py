"""Typed answers to the status, stats, metadata and config queries, encoded to the wire's dicts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from gepool.common import errors
from gepool.scheduler.states import ModelState, WorkerState

if TYPE_CHECKING:
    from gepool.scheduler.core import Core
    from gepool.scheduler.groups import Group
    from gepool.scheduler.models import Model

READY = WorkerState.READY


@dataclass
class Peers:
    """What the loop's channels know about the clients connected to them."""

    lanes: Callable[[], int] = lambda: 0
    lane_pids: Callable[[], list[int]] = list


@dataclass
class Workload:
    """A model generation's workers, as status reports them (summed over generations per name)."""

    workers: int = 0
    ready_workers: int = 0
    queued: int = 0
    slots: int = 0
    slots_busy: int = 0
    restarts: int = 0
    worker_pids: list[int] = field(default_factory=list)
    busy_worker_pids: list[int] = field(default_factory=list)
    worker_threads: list[int] = field(default_factory=list)
    device_memory: dict[str, int] = field(default_factory=dict)
    devices: list[dict] = field(default_factory=list)  # per ready worker: its latest DeviceStats readings

    @classmethod
    def of(cls, model: Model) -> Workload:
        ready = [w for w in model.workers if w.state == READY]
        queued = sum(p.item.count for p in model.batcher.queue)  # client requests: a group counts its members
        return cls(len(model.workers), len(ready), queued, sum(w.slots for w in ready),
                   sum(len(w.inflight) for w in model.workers), sum(w.restarts for w in model.workers),
                   [w.pid for w in ready], [w.pid for w in ready if w.inflight],
                   [w.info["threads"] for w in ready if "threads" in w.info],
                   {w.device: w.info.get("device_memory", 0) for w in ready if "device_memory" in w.info},
                   [{"worker": w.id, "device": w.device, "pid": w.pid, **w.sample} for w in ready if w.sample])

    def add(self, other: Workload) -> None:
        for key in ("workers", "ready_workers", "queued", "slots", "slots_busy", "restarts"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.worker_pids += other.worker_pids
        self.busy_worker_pids += other.busy_worker_pids
        self.worker_threads += other.worker_threads
        self.device_memory.update(other.device_memory)
        self.devices += other.devices


@dataclass
class ModelStatus:
    """One model name: the state clients see, its versions, and the workload of what serves."""

    state: ModelState
    reason: str
    version: int | None
    versions: dict[str, ModelState]
    loading: list[int]
    draining: int
    version_requests: dict[str, int]
    load: Workload

    @classmethod
    def of(cls, group: Group) -> ModelStatus:
        current = list(group.serving.values()) or group.loading or group.failed
        state = group.state()
        load = Workload()
        for model in current:
            load.add(Workload.of(model))
        return cls(state, "" if state == ModelState.AVAILABLE else
                   (group.error or "; ".join(m.reason for m in current if m.reason)),
                   max((m.version for m in current if m.version is not None), default=None),
                   {str(v): m.state for v, m in sorted(group.serving.items())},
                   [m.version for m in group.loading], len(group.draining),
                   {str(k): v for k, v in sorted(group.version_requests.items())}, load)

    def as_wire(self) -> dict:
        out = {"state": self.state, "reason": self.reason, "version": self.version, "versions": self.versions,
               "loading": self.loading, "draining": self.draining, "version_requests": self.version_requests}
        out.update(asdict(self.load))
        return out


@dataclass
class PoolStatus:
    pool_id: str
    endpoint: str
    stopping: bool
    arenas: int
    lanes: int
    lane_pids: list[int]
    pid: int
    polling: dict
    model_control_mode: str
    models: dict[str, ModelStatus]

    def as_wire(self) -> dict:
        out = {k: getattr(self, k) for k in ("pool_id", "endpoint", "stopping", "arenas", "lanes", "lane_pids",
                                             "pid", "polling", "model_control_mode")}
        out["models"] = {name: m.as_wire() for name, m in self.models.items()}
        return out


@dataclass
class TensorMetadata:
    name: str
    datatype: str
    shape: list[int]  # -1 for the batch dimension and variable dims


@dataclass
class ModelMetadata:
    """KServe's model metadata, with gepool's state; a model with no valid config has no tensors."""

    name: str
    state: ModelState
    reason: str
    versions: list[str]
    backend: str | None = None
    platform: str = ""
    max_batch_size: int = 0
    inputs: list[TensorMetadata] = field(default_factory=list)
    outputs: list[TensorMetadata] = field(default_factory=list)

    @classmethod
    def of(cls, group: Group) -> ModelMetadata:
        current = group.default() or (group.loading or group.failed or [None])[0]
        if current is None:
            return cls(group.name, ModelState.UNAVAILABLE, group.error, [])
        versions = [str(v) for v, m in sorted(group.serving.items()) if m.state == ModelState.AVAILABLE]
        cfg = current.config
        if cfg is None:
            return cls(current.name, group.state(), current.reason, versions)
        batch = [-1] if cfg.max_batch_size > 0 else []
        return cls(current.name, group.state(), current.reason, versions, cfg.backend, cfg.platform or cfg.backend,
                   cfg.max_batch_size, [TensorMetadata(t.name, t.datatype, batch + list(t.dims)) for t in cfg.inputs],
                   [TensorMetadata(t.name, t.datatype, batch + list(t.dims)) for t in cfg.outputs])

    def as_wire(self) -> dict:
        out = {"name": self.name, "state": self.state, "reason": self.reason}
        if self.backend is not None:
            out.update(backend=self.backend, platform=self.platform)
        out["versions"] = self.versions
        if self.backend is not None:
            out.update(max_batch_size=self.max_batch_size, inputs=[asdict(t) for t in self.inputs],
                       outputs=[asdict(t) for t in self.outputs])
        return out


def pool_status(core: Core, pid: int) -> dict:
    cache = core.dispatch.cache
    return {**_pool_status(core, pid), "cache": cache.as_dict() if cache is not None else None,
            "ensemble_copies": asdict(core.ensembles.copies)}


def _pool_status(core: Core, pid: int) -> dict:
    return PoolStatus(core.opts.owner_id, core.opts.endpoint, core.stopping or core.grace_until is not None,
                      len(core.arenas), core.peers.lanes(), core.peers.lane_pids(), pid, core.polling.summary(),
                      core.opts.model_control_mode,
                      {name: ModelStatus.of(g) for name, g in core.control.groups.items()}).as_wire()


def answer_query(core: Core, what: str, args: object) -> dict:
    """The body of a Reply to a status, stats, metadata or config query."""
    if what == "status":
        return core.status()
    if what == "stats":
        return {name: g.stats_dict() for name, g in core.control.groups.items()}
    if what == "index":
        return {"models": core.control.index(bool(args.get("ready")) if isinstance(args, dict) else False)}
    if what in ("metadata", "config"):
        group = core.control.group(args.get("model") if isinstance(args, dict) else None)
        if what == "metadata":
            return ModelMetadata.of(group).as_wire()
        model = group.default() or next(iter(group.loading + group.failed), None)
        if model is None or model.config is None:
            raise errors.ModelNotReady(f"model '{group.name}' has no valid config: {group.error}")
        return model.rendered_config()
    raise errors.InvalidArgument(f"unknown query '{what}' (status, stats, index, metadata, config, load, unload, "
                                 f"logging, regions)")
