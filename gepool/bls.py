"""The pool handle a python model gets for BLS: calls to other models of its pool, from inside a worker."""

import threading

from gepool.common import errors
from gepool.ipc.protocol import WARMUP_SLOT

BLS_TIMEOUT_S = 60.0  # a call with no timeout of its own waits this long for its answer, then fails


def _caller_client(endpoint: str, caller, **kwargs):
    """A Client whose requests name the batch that waits on them (``caller()``, read as each is sent).
    The client face is imported here, on the first call, so a worker whose model never calls pays nothing."""
    from gepool import _wire
    from gepool.client import Client

    class CallerClient(Client):
        def _encode(self, model, inputs, outputs, version, timeout, priority=0, origin=0):
            if self._closed:
                raise errors.InvalidArgument("the pool handle is closed")
            wait = self.timeout if timeout is None else timeout  # as ClientCore: the front drops it after
            return _wire.encode_infer(model, inputs, outputs, version, timeout, None, 0, self.arena_min_bytes,
                                      wait, priority, origin, caller=caller())

    return CallerClient(endpoint, **kwargs)


class PoolHandle:
    """``config["pool"]`` of a python model: ``infer`` and ``infer_async`` on any model of the pool.

    The connection to the front is made on the first call (a model that never calls pays nothing) and
    is shared by every thread of the worker (each thread gets its own socket from the Client). Each call
    names the batch its worker is running (``running``), so the front knows the call chain and refuses a
    call that would wait on itself. ``key``: the one the front started this worker with; each call carries
    it, and the front refuses a call naming the worker's batch without it."""

    def __init__(self, endpoint: str, worker_id: int, curve_key: str | None = None,
                 timeout: float = BLS_TIMEOUT_S, key: bytes = b"") -> None:
        self.endpoint, self.worker_id, self.curve_key, self.timeout = endpoint, worker_id, curve_key, timeout
        self._key = key
        self._batch: tuple[int, int] | None = None  # (slot, seq) being executed; None while warming up
        self._client = None  # the Client, made on the first call
        self._lock = threading.Lock()
        self._closed = False

    def running(self, slot: int | None, seq: int = 0) -> None:
        """The worker's loop: the batch whose execute runs now (None: none, or the warmup)."""
        self._batch = None if slot is None else (slot, seq)

    def _caller(self) -> list:
        batch = self._batch
        return [self.worker_id, WARMUP_SLOT, 0, self._key] if batch is None else [self.worker_id, *batch, self._key]

    def _connect(self):
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._closed:
                raise errors.InvalidArgument("the pool handle is closed (the model is finalizing)")
            if not self.endpoint:
                raise errors.Unavailable("no pool to call: BLS calls work in a python model served by a "
                                         "gepool pool (Pool or gepool start)")
            if self._client is None:
                key = self.curve_key
                # CURVE: the pool admits its own key, so the worker uses the pool's certificate both ways
                self._client = _caller_client(self.endpoint, self._caller, timeout=self.timeout,
                                              curve_server_key=key, curve_client_key=key)
            return self._client

    def infer(self, model: str, inputs: dict, outputs: list[str] | None = None, *, version: int | None = None,
              timeout: float | None = None) -> dict:
        """Runs ``model`` on ``inputs`` ({name: ndarray}) and returns {output name: ndarray} (read-only
        views); raises a GepoolError naming what failed. ``version`` None or -1: the default version.
        ``timeout`` (s) is the call's, as a client's: without one the callee's queue policy applies, and
        the front gives the call no more time than the requests that made it have left; either way the
        call waits for its answer at most ``timeout`` or the handle's (BLS_TIMEOUT_S). A call that could
        never run (every worker of ``model`` waits, through BLS calls, on this batch) raises Unavailable at
        once, naming the cycle; a call still queued when its batch ends never runs. A call from the warmup
        (or ``initialize``) into a model still loading waits in the front for it to be ready; one that would
        close a cycle of warmups waiting on each other is refused the same way."""
        client = self._connect()
        return client.infer(model, inputs, outputs, version=_version(version), timeout=timeout)

    def infer_async(self, model: str, inputs: dict, outputs: list[str] | None = None, *,
                    version: int | None = None, timeout: float | None = None):
        """Sends now. Inside a running event loop (an ``async def execute``) returns an asyncio future to
        await, else a concurrent.futures.Future; either resolves to the outputs or raises the error."""
        import asyncio

        client = self._connect()
        fut = client.infer_async(model, inputs, outputs, version=_version(version), timeout=timeout)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return fut
        return asyncio.wrap_future(fut)

    def close(self) -> None:
        """Closes the connection (the worker's exit). Idempotent."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _version(version: int | None) -> int | None:
    return None if version is None or version == -1 else int(version)


_installed: PoolHandle | None = None


def install(handle: PoolHandle | None) -> None:
    """The worker's handle, for the model it loads (one model per worker process)."""
    global _installed
    _installed = handle


def installed() -> PoolHandle:
    """The worker's handle; outside a worker, one whose calls fail saying there is no pool."""
    global _installed
    if _installed is None:
        _installed = PoolHandle("", 0)
    return _installed


