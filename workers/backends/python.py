"""User Python models: gepool's ``class Model`` (execute(inputs) -> outputs), or Triton's ``TritonPythonModel``."""

import importlib.util
import inspect
import os
import sys
from types import ModuleType

import numpy as np

from gepool.common.config import BACKEND_PYTHON, ModelConfig
from gepool.workers.backends import register
from gepool.workers.backends import triton_python_backend_utils as pb_utils
from gepool.workers.backends.base import KIND_CPU, Backend, SyncBackend

CLASS_NAME = "Model"
TRITON_CLASS_NAME = "TritonPythonModel"
TRITON_UTILS = "triton_python_backend_utils"


@register
class PythonBackend(SyncBackend):
    name = BACKEND_PYTHON
    kinds = (KIND_CPU, "KIND_MODEL")  # KIND_MODEL: the model places its own work; gepool gives it a CPU worker

    @classmethod
    def open(cls, config: ModelConfig, version_dir: str, device: str, threads: int) -> Backend:
        """model.py decides the interface: a TritonPythonModel class is served as Triton's python backend
        serves it (requests in, one response each), otherwise gepool's own Model class."""
        module = load_module(config, version_dir)
        if hasattr(module, TRITON_CLASS_NAME):
            from gepool.workers.backends.triton_python import TritonPythonBackend

            return TritonPythonBackend(config, version_dir, device, threads, getattr(module, TRITON_CLASS_NAME))
        return cls(config, version_dir, device, threads, module)

    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int,
                 module: ModuleType | None = None) -> None:
        super().__init__(config, version_dir, device, threads)
        module = module or load_module(config, version_dir)
        path = os.path.join(version_dir, config.model_filename)
        model_cls = getattr(module, CLASS_NAME, None) or _only_model_class(module, path)
        self.model = model_cls()
        self.runner = Coroutines()
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
                "pool": pool_handle(),
            })

    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        result = self.runner.run(self.model.execute(inputs))
        if not isinstance(result, dict):
            raise TypeError(f"execute() must return a dict of output name -> array, got {type(result).__name__}")
        return {name: np.asarray(value) for name, value in result.items()}

    def close(self) -> None:
        self.runner.finalize(self.model)


def pool_handle():
    """The worker's pool handle (gepool.bls), what BLS calls go through; it connects on its first call."""
    from gepool import bls

    return bls.installed()


class Coroutines:
    """Runs what an ``async def execute`` (or finalize) returns to completion on an event loop of the
    backend's own, made on first use; a plain value passes through."""

    def __init__(self) -> None:
        self.loop = None  # an asyncio event loop, once a coroutine needs one

    def run(self, result):
        if not inspect.isawaitable(result):
            return result
        if self.loop is None:
            import asyncio  # only for models with an async def execute

            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(result)

    def finalize(self, model) -> None:
        """Runs the model's ``finalize`` (plain or async), if it has one, then closes the loop."""
        fin = getattr(model, "finalize", None)
        try:
            if fin is not None:
                self.run(fin())
        finally:
            self.close()

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
            self.loop = None


def load_module(config: ModelConfig, version_dir: str) -> ModuleType:
    """Executes the user's model.py; ``import triton_python_backend_utils`` inside it finds gepool's."""
    sys.modules[TRITON_UTILS] = pb_utils  # before the user's file runs its imports, over any other copy
    path = os.path.join(version_dir, config.model_filename)
    spec = importlib.util.spec_from_file_location(f"gepool_model_{config.name}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _only_model_class(module: ModuleType, path: str) -> type:
    found = [c for _, c in inspect.getmembers(module, inspect.isclass)
             if c.__module__ == module.__name__ and callable(getattr(c, "execute", None))]
    if len(found) != 1:
        raise ValueError(f"{path}: define a class named '{CLASS_NAME}' with execute(inputs) -> dict, "
                         f"or Triton's '{TRITON_CLASS_NAME}' with execute(requests) -> responses")
    return found[0]
