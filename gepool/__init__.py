"""gepool: a shared-memory, dynamically batching serving pool for Ascend NPU, CPU and GPU models."""

from gepool.common.errors import (
    ConfigError,
    GepoolError,
    Internal,
    InvalidArgument,
    ModelError,
    ModelNotFound,
    ModelNotReady,
    PoolUnavailable,
    ProtocolMismatch,
    RequestTooLarge,
    Timeout,
    Unavailable,
    WorkerDied,
)

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "ConfigError", "GepoolError", "Internal", "InvalidArgument", "ModelError",
           "ModelNotFound", "ModelNotReady", "Pool", "PoolUnavailable", "ProtocolMismatch", "RequestTooLarge",
           "Timeout", "Unavailable", "WorkerDied"]


def __getattr__(name: str):
    # Lazy, so that `gepool.common.config` and `gepool.common.errors` (leaves the front and workers import)
    # do not drag in the client, the pool and both process packages.
    if name == "Client":
        from gepool.client import Client

        return Client
    if name == "AsyncClient":
        from gepool.aio import AsyncClient

        return AsyncClient
    if name == "Pool":
        from gepool.pool import Pool

        return Pool
    raise AttributeError(f"module 'gepool' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
