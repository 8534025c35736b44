"""gepool: a shared-memory, dynamically batching serving pool for Ascend NPU, CPU and GPU models."""

from gepool.errors import GepoolError

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "GepoolError", "Pool"]


def __getattr__(name: str):
    # Lazy, so that `gepool.config` and `gepool.errors` (leaves the front and workers import)
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
