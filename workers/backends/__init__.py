"""The backend registry: a config's backend name -> the class that serves it, and where it places workers."""

import importlib
import inspect

from gepool.common.config import ModelConfig
from gepool.workers.backends.base import AsyncBackend, Backend, Placement, SyncBackend

# Each backend's module, imported on first use (so a host without onnxruntime still serves python
# models); the module registers its class with @register when imported. A new backend: its module,
# decorated with @register, and its line here.
MODULES = {
    "onnxruntime": "gepool.workers.backends.onnx",
    "python": "gepool.workers.backends.python",
    "ge": "gepool.workers.backends.ge",
}

_registry: dict[str, type[Backend]] = {}


def register(cls: type[Backend]) -> type[Backend]:
    """Class decorator: adds a backend under ``cls.name``, once it is shown to implement the whole contract."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{cls!r} is not a Backend")
    if issubclass(cls, SyncBackend) == issubclass(cls, AsyncBackend):
        raise TypeError(f"backend {cls.__name__} must subclass exactly one of SyncBackend and AsyncBackend")
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise TypeError(f"backend {cls.__name__} does not implement {', '.join(missing)}")
    if not cls.name:
        raise TypeError(f"backend {cls.__name__} has no name")
    if cls.asynchronous != issubclass(cls, AsyncBackend):
        raise TypeError(f"backend {cls.__name__}: 'asynchronous' contradicts its base class")
    if cls.asynchronous and cls.arena_io:
        raise TypeError(f"backend {cls.__name__}: arena_io runs on the synchronous loop only")
    known = _registry.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"backend '{cls.name}' is already registered ({known.__module__}.{known.__name__})")
    _registry[cls.name] = cls
    return cls


def backend_class(name: str) -> type[Backend]:
    cls = _registry.get(name)
    if cls is None and name in MODULES:
        importlib.import_module(MODULES[name])
        cls = _registry.get(name)
    if cls is None:
        raise ValueError(f"unknown backend '{name}' (gepool has {sorted(set(MODULES) | set(_registry))})")
    return cls


def create_backend(config: ModelConfig, version_dir: str, device: str, threads: int) -> Backend:
    return backend_class(config.backend).open(config, version_dir, device, threads)


def placements(config: ModelConfig) -> list[Placement]:
    """The workers a model needs, as (device, batches in flight); raises ConfigError for a group its
    backend cannot run. The face hands this to the front (the scheduler holds no backend names)."""
    return backend_class(config.backend).placements(config)
