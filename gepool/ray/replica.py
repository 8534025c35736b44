"""The Serve deployment: one gepool Pool per replica, answering the handle and KServe v2 HTTP."""

import asyncio
import logging
import os

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from gepool.aio import AsyncClient
from gepool.common import errors
from gepool.ipc.protocol import ModelState
from gepool.ray import kserve_http

log = logging.getLogger("gepool.ray")
HEALTH_TIMEOUT_S = 10.0  # below Serve's health_check_timeout_s (30 s by default)
BODY_HEADROOM_BYTES = 1 << 20  # room beside the largest slot for the JSON header of an HTTP request


def default_max_body(repository: str) -> int:
    """The largest slot of any model in the repository, plus room for a JSON header."""
    from gepool.common.repository import scan
    from gepool.scheduler.models import DEFAULT_VARIABLE_SLOT_BYTES, slot_bytes_for

    slots = [slot_bytes_for(src.config) for src in scan(repository) if src.config is not None]
    return max(slots, default=DEFAULT_VARIABLE_SLOT_BYTES) + BODY_HEADROOM_BYTES


@serve.deployment(name="gepool")
class GepoolReplica:
    """Starts a Pool on ``model_repository`` (every model must load, or the replica fails to start).

    - ``await handle.infer.remote(model, {name: ndarray})`` -> {name: ndarray}, through the pool's local
      socket (a lane), never HTTP;
    - Serve's HTTP proxy: KServe v2 health, metadata, config, ready and infer (``tritonclient.http``);
    - ``check_health``: the front's process is alive and every model serves;
    - shutdown: Serve stops sending and waits for the requests in flight, then ``__del__`` stops the
      pool, which drains what it still holds and removes its segments.
    """

    def __init__(self, model_repository: str, cpu_threads: int = 0, max_body_bytes: int = 0) -> None:
        from gepool.pool import Pool

        self.repository = os.path.abspath(model_repository)
        self.pool = Pool(self.repository, cpu_threads=cpu_threads).start()
        failed = {name: m["reason"] for name, m in self.pool.status["models"].items()
                  if m["state"] != ModelState.AVAILABLE}
        if failed:
            self.pool.stop()
            raise errors.Unavailable("models failed to load: " + "; ".join(f"{n}: {r}" for n, r in failed.items()))
        self.max_body = max_body_bytes or default_max_body(self.repository)
        self._client: AsyncClient | None = None
        self._connecting = asyncio.Lock()
        self._front_gone: asyncio.Future | None = None
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context is not None else str(os.getpid())
        log.info("replica %s: pool %s serving %s", self.replica_id, self.pool.process.pid, self.repository)

    async def client(self) -> AsyncClient:
        """The pool's AsyncClient, made in the replica's event loop on first use (it is bound to it), and
        the watch on the front's process (a pidfd in the same loop)."""
        async with self._connecting:
            if self._client is None:
                self._watch_front()
                self._client = await AsyncClient.connect(self.pool.endpoint)
            return self._client

    def _watch_front(self) -> None:
        loop = asyncio.get_running_loop()
        self._front_gone = loop.create_future()
        try:
            fd = os.pidfd_open(self.pool.process.pid)
        except ProcessLookupError:  # already reaped
            self._front_gone.set_result(None)
            return

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            if not self._front_gone.done():
                self._front_gone.set_result(None)

        loop.add_reader(fd, exited)

    async def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                    version: int | None = None) -> dict[str, np.ndarray]:
        """One request to this replica's pool: {output name: ndarray}; a GepoolError says why not."""
        return dict(await self._unless_front_gone((await self.client()).infer(model, inputs, outputs,
                                                                               version=version)))

    async def _unless_front_gone(self, call):
        """``call``'s result, or Unavailable at once if the front dies first: a killed front leaves its
        socket file behind, and a request in flight there would wait for its timeout."""
        if self._front_gone.done():
            call.close()
            raise self._gone()
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait((task, self._front_gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # Serve cancels a request whose client went away: so is its call
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            raise self._gone()
        return task.result()

    def _gone(self) -> errors.Unavailable:
        return errors.Unavailable(f"this replica's pool is gone (its front exited with code "
                                  f"{self.pool.process.poll()}); Serve replaces the replica")

    async def __call__(self, request: Request) -> Response:
        client = await self.client()
        try:
            return await self._unless_front_gone(kserve_http.handle(request, client, self.ready, self.max_body))
        except errors.Unavailable as exc:
            return kserve_http.error(exc.http_status, exc.message)

    async def ready(self) -> bool:
        """KServe's server readiness: the pool answers, is not stopping, and every model serves."""
        try:
            status = await self._status()
        except errors.GepoolError:
            return False
        return not status["stopping"] and all(m["state"] == ModelState.AVAILABLE for m in status["models"].values())

    async def pool_info(self) -> dict:
        """Which replica answered, its front's pid, and its pool's status and stats."""
        client = await self.client()
        return {"replica_id": self.replica_id, "front_pid": self.pool.process.pid,
                "status": await self._unless_front_gone(client.status()),
                "stats": await self._unless_front_gone(client.stats())}

    async def check_health(self) -> None:
        """Raises (Serve then replaces the replica) when the front is gone or a model cannot serve."""
        await self.client()
        code = self.pool.process.poll()
        if code is not None or self._front_gone.done():
            raise RuntimeError(f"the pool's front exited with code {code}")
        try:
            status = await self._status()
        except errors.GepoolError as exc:
            raise RuntimeError(f"the pool does not answer: {exc}") from None
        down = {n: m["reason"] or m["state"] for n, m in status["models"].items()
                if m["state"] == ModelState.UNAVAILABLE}
        if down:
            raise RuntimeError("models unavailable: " + "; ".join(f"{n}: {r}" for n, r in down.items()))

    async def _status(self) -> dict:
        client = await self.client()
        try:
            return await asyncio.wait_for(self._unless_front_gone(client.status()), HEALTH_TIMEOUT_S)
        except TimeoutError:
            raise errors.Unavailable(f"no status from the pool within {HEALTH_TIMEOUT_S:.0f}s") from None

    def __del__(self) -> None:
        # Serve calls this once the replica takes no new requests and those in flight have ended (or its
        # graceful_shutdown_timeout_s passed); the interpreter may call it again on exit: stop() is idempotent
        pool = getattr(self, "pool", None)
        if pool is not None:
            code = pool.stop()
            log.info("replica %s: pool stopped with code %s", getattr(self, "replica_id", "?"), code)
