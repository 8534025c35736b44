"""Backends turn a model version directory into something that executes a batch."""

from gepool.common.config import BACKEND_GE, BACKEND_ONNX, BACKEND_PYTHON, ModelConfig
from gepool.workers.backends.base import Backend


def create_backend(config: ModelConfig, version_dir: str, device: str, threads: int) -> Backend:
    """Imports the backend's module only here, so a host without onnxruntime still serves python models."""
    if config.backend == BACKEND_ONNX:
        from gepool.workers.backends.onnx import OnnxBackend

        return OnnxBackend(config, version_dir, device, threads)
    if config.backend == BACKEND_PYTHON:
        from gepool.workers.backends.python import PythonBackend

        return PythonBackend(config, version_dir, device, threads)
    if config.backend == BACKEND_GE:
        from gepool.workers.backends.ge import GeBackend

        return GeBackend(config, version_dir, device, threads)
    raise RuntimeError(f"unknown backend '{config.backend}'")
