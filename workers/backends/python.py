"""User Python models: ``model.py`` defines a class with initialize(config), execute(inputs), finalize()."""

import importlib.util
import inspect
import os

import numpy as np

from gepool.common.config import ModelConfig
from gepool.workers.backends.base import Backend

CLASS_NAME = "Model"


class PythonBackend(Backend):
    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int) -> None:
        super().__init__(config, version_dir, device, threads)
        path = os.path.join(version_dir, config.model_filename)
        spec = importlib.util.spec_from_file_location(f"gepool_model_{config.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cls = getattr(module, CLASS_NAME, None) or _only_model_class(module, path)
        self.model = cls()
        init = getattr(self.model, "initialize", None)
        if init is not None:
            init({
                "name": config.name,
                "max_batch_size": config.max_batch_size,
                "parameters": dict(config.parameters),
                "inputs": [{"name": t.name, "data_type": t.datatype, "dims": list(t.dims)} for t in config.inputs],
                "outputs": [{"name": t.name, "data_type": t.datatype, "dims": list(t.dims)} for t in config.outputs],
                "version_dir": version_dir,
                "device": device,
            })

    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        result = self.model.execute(inputs)
        if not isinstance(result, dict):
            raise TypeError(f"execute() must return a dict of output name -> array, got {type(result).__name__}")
        return {name: np.asarray(value) for name, value in result.items()}

    def close(self) -> None:
        fin = getattr(self.model, "finalize", None)
        if fin is not None:
            fin()


def _only_model_class(module, path: str) -> type:
    found = [c for _, c in inspect.getmembers(module, inspect.isclass)
             if c.__module__ == module.__name__ and callable(getattr(c, "execute", None))]
    if len(found) != 1:
        raise ValueError(f"{path}: define a class named '{CLASS_NAME}' with execute(inputs) -> dict")
    return found[0]
