"""The small interface every backend implements."""

import abc

import numpy as np

from gepool.config import ModelConfig
from gepool.ipc import dtypes


class Backend(abc.ABC):
    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int) -> None:
        self.config, self.version_dir, self.device, self.threads = config, version_dir, device, threads

    @abc.abstractmethod
    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """Runs one batch. ``outputs`` maps each output to a slot view of its exact shape when the shape
        is known in advance (write there and return it: no copy) or None (return a new array)."""

    def warmup(self) -> None:
        """One run on zeros at batch size 1, so the first request does not pay for lazy set-up."""
        if not all(t.fixed for t in self.config.inputs):
            return
        lead = (1,) if self.config.max_batch_size > 0 else ()
        feeds = {t.name: np.zeros(lead + t.dims, dtypes.to_numpy(t.datatype)) for t in self.config.inputs}
        self.execute(feeds, {t.name: None for t in self.config.outputs})

    def close(self) -> None:
        """Releases what the backend holds; the process exits right after."""
