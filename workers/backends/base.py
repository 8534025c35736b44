"""The small interface every backend implements."""

import abc
import os

import numpy as np

from gepool.common.config import ModelConfig, WarmupInput, WarmupSample
from gepool.ipc import dtypes

DEFAULT_WARMUP_RUNS = 2


class Backend(abc.ABC):
    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int) -> None:
        self.config, self.version_dir, self.device, self.threads = config, version_dir, device, threads

    @abc.abstractmethod
    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """Runs one batch. ``outputs`` maps each output to a slot view of its exact shape when the shape
        is known in advance (write there and return it: no copy) or None (return a new array)."""

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

    def close(self) -> None:
        """Releases what the backend holds; the process exits right after."""
