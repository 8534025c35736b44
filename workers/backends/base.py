"""The backend contract: capabilities, placement, and the synchronous or the asynchronous execution API."""

import abc
import os
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import numpy as np

from gepool.common.config import ModelConfig, WarmupInput, WarmupSample
from gepool.common.errors import ConfigError
from gepool.ipc import dtypes
from gepool.ipc.ring import Slot, TensorDesc

DEFAULT_WARMUP_RUNS = 2
KIND_CPU = "KIND_CPU"

# (device, batches it runs at once): one worker process each, e.g. ("cpu", 1) or ("ascend:0", 4)
Placement = tuple[str, int]


class RequestSpan(NamedTuple):
    """One request of a batch: its rows (from ``start``) and the outputs its client asked for."""

    start: int
    rows: int
    outputs: tuple[str, ...]


class Backend(abc.ABC):
    """What every backend declares. Subclass SyncBackend or AsyncBackend, never this class directly.

    Capabilities are class attributes, read by the worker and reported to the front when ready:

    - ``asynchronous``: batches go through start/submit/pump and complete on the backend's own
      threads (AsyncBackend); otherwise ``execute`` runs each batch in the worker's loop.
    - ``arena_io``: reads inputs and writes outputs through pointers, so it can run a direct batch
      whose tensors lie in a client's arena (only on the synchronous loop).
    - ``per_request``: needs each request's rows in the batch, and may fail one request alone
      (``execute_requests``).
    - ``kinds``: the instance_group kinds it runs; ``placements`` refuses any other.
    """

    name: ClassVar[str] = ""  # the config's backend: "onnxruntime", "python", ...
    asynchronous: ClassVar[bool] = False
    arena_io: ClassVar[bool] = False
    per_request: ClassVar[bool] = False
    kinds: ClassVar[tuple[str, ...]] = (KIND_CPU,)

    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int) -> None:
        self.config, self.version_dir, self.device, self.threads = config, version_dir, device, threads
        self.info: dict = {}  # what the worker reports about the instance once ready (threads, gears, ...)

    @classmethod
    def open(cls, config: ModelConfig, version_dir: str, device: str, threads: int) -> "Backend":
        """Loads one instance. A backend whose model file decides which class serves it overrides this."""
        return cls(config, version_dir, device, threads)

    @classmethod
    def placements(cls, config: ModelConfig) -> list[Placement]:
        """One worker per instance on the CPU: ``count`` per group, one per listed device id. Raises
        ConfigError naming the group whose kind this backend cannot run."""
        check_kinds(cls, config)
        return [(f"cpu:{d}" if g.devices else "cpu", 1) for g in config.instance_groups
                for d in (g.devices or (None,)) for _ in range(g.count)]

    @abc.abstractmethod
    def warmup(self) -> int:
        """Runs the model before it is READY; returns the number of runs. A failure raises."""

    def device_stats(self) -> dict:
        """What its device reports now, for the worker's stats thread (ipc.protocol.DeviceStats): numbers
        under memory_used_bytes, memory_total_bytes, utilization_ratio, and a ``health`` word, each left out
        where the device cannot tell. Called from that thread, never between a stream's calls: read what
        the backend already holds. A CPU backend has no device beyond the process: {}."""
        return {}

    def close(self) -> None:
        """Releases what the backend holds; the process exits right after."""


class SyncBackend(Backend):
    """Runs one batch at a time in the worker's loop, inputs as views of the slot."""

    @abc.abstractmethod
    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """Runs one batch. ``outputs`` maps each output to a slot view of its exact shape when the shape
        is known in advance (write there and return it: no copy) or None (return a new array)."""

    def execute_requests(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None],
                         requests: list[RequestSpan]) -> tuple[dict[str, np.ndarray], dict[int, str]]:
        """For ``per_request`` backends: runs one batch of ``requests``; returns the batch's outputs (rows of
        failed requests are filler) and {request index: error message} for the requests that failed."""
        return self.execute(inputs, outputs), {}

    def warmup(self) -> int:
        """Runs the config's model_warmup samples, or by default DEFAULT_WARMUP_RUNS on zeros at each
        preferred batch size (batch 1 without batching), so a model is READY only once it has really run;
        returns the number of runs. A failure raises, and the model does not become READY."""
        runs = 0
        for sample in self.config.model_warmup or self._default_warmup():
            feeds = {name: self._warmup_input(name, inp, sample.batch_size) for name, inp in sample.inputs.items()}
            for _ in range(sample.count):
                try:
                    self.execute(feeds, {t.name: None for t in self.config.outputs})
                except Exception as exc:
                    raise RuntimeError(f"warmup '{sample.name}' failed: {type(exc).__name__}: {exc}") from exc
                runs += 1
        return runs

    def _default_warmup(self) -> list[WarmupSample]:
        if not all(t.fixed for t in self.config.inputs):
            return []  # no shape to invent: only an explicit model_warmup can warm it
        db = self.config.dynamic_batching
        sizes = db.preferred_batch_size if db and self.config.max_batch_size > 0 else (1,)
        inputs = {t.name: WarmupInput(t.datatype, t.dims, "zero") for t in self.config.inputs}
        return [WarmupSample(f"default{b}", b, DEFAULT_WARMUP_RUNS, inputs) for b in sizes]

    def _warmup_input(self, name: str, inp: WarmupInput, batch: int) -> np.ndarray:
        shape = ((batch,) if self.config.max_batch_size > 0 else ()) + inp.dims
        dtype = dtypes.to_numpy(inp.datatype)
        if inp.data == "file":
            with open(os.path.join(os.path.dirname(self.version_dir), "warmup", inp.file), "rb") as f:
                raw = f.read()
            if inp.datatype == dtypes.BYTES:
                one = dtypes.deserialize_bytes(raw, inp.dims)
            else:
                one = np.frombuffer(raw, dtype).reshape(inp.dims)
            return np.ascontiguousarray(np.broadcast_to(one, shape))
        if inp.datatype == dtypes.BYTES:
            return np.full(shape, b"" if inp.data == "zero" else b"warmup", dtype=object)
        if inp.data == "random":
            rng = np.random.default_rng(0)
            return (rng.random(shape) * 10).astype(dtype)
        return np.zeros(shape, dtype)


# plan(slot, batch, input descriptors) -> output descriptors: where a batch's outputs go in its slot
PlanOutputs = Callable[[Slot, int, list[TensorDesc]], list[TensorDesc]]


class AsyncBackend(Backend):
    """Several batches in flight; each completes on the backend's own threads, in submission order per
    stream. The worker's loop stays the only thread that touches its sockets."""

    asynchronous = True

    @abc.abstractmethod
    def start(self, notify: Callable[[int, int], None], fatal: Callable[[str], None]) -> None:
        """Before the first batch: ``notify(index, seq)`` reports a slot DONE or FAILED (from any thread);
        ``fatal(reason)`` reports a device that stopped answering (the worker exits to be replaced)."""

    @abc.abstractmethod
    def submit(self, slot: Slot, index: int, seq: int, plan: PlanOutputs) -> None:
        """Takes a FILLED slot; it starts now or once a stream frees up (see pump)."""

    @abc.abstractmethod
    def pump(self) -> None:
        """Called by the worker's loop after completions: starts queued batches on freed streams."""


def check_kinds(cls: type[Backend], config: ModelConfig) -> None:
    """Refuses, naming the group, an instance_group whose kind ``cls`` cannot run (never a silent CPU run)."""
    for i, g in enumerate(config.instance_groups):
        if g.kind not in cls.kinds:
            gpu = " (gepool has no GPU backend)" if g.kind == "KIND_GPU" else ""
            raise ConfigError(config.source, None, "instance_group",
                              f"instance_group[{i}] has kind {g.kind}: backend '{cls.name}' runs on "
                              f"{' or '.join(cls.kinds)} only{gpu}")
