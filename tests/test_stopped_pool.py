"""Clients of a pool that is not there: no socket file, a dead one's file, one that stopped cleanly."""

import asyncio
import signal
import socket
import time

import numpy as np
import pytest

from gepool import AsyncClient, Client, Pool
from gepool.common import errors
from tests import repo as test_repo

# Far below the timeouts the clients are given (60 s to connect, 120 s per request): a client that waits
# for either fails the test, while one that fails at once passes even on a loaded machine.
PROMPT_S = 5.0
X = np.ones((1, 16), np.float32)


def _sync_connect(endpoint: str, lane: bool) -> None:
    Client(endpoint, lane=lane, connect_timeout=60).close()


def _async_connect(endpoint: str, lane: bool) -> None:
    async def run() -> None:
        c = AsyncClient(endpoint, lane=lane)
        await c.start(connect_timeout=60)  # start() closes what it made when it fails
        await c.close()

    asyncio.run(run())


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "zmq"])
@pytest.mark.parametrize("connect", [_sync_connect, _async_connect], ids=["sync", "asyncio"])
def test_a_client_fails_at_once_where_no_socket_file_is(tmp_path, connect, lane):
    endpoint = f"ipc://{tmp_path}/nothing.sock"
    start = time.monotonic()
    with pytest.raises(errors.PoolUnavailable, match="socket file does not exist") as caught:
        connect(endpoint, lane)
    assert time.monotonic() - start < PROMPT_S
    assert endpoint in str(caught.value)


@pytest.mark.parametrize("connect", [_sync_connect, _async_connect], ids=["sync", "asyncio"])
def test_a_client_fails_at_once_on_a_socket_file_nobody_listens_on(tmp_path, connect):
    path = str(tmp_path / "killed.sock")  # what a killed pool leaves: the file, and no listener
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
        leftover.bind(path)
    start = time.monotonic()
    with pytest.raises(errors.PoolUnavailable, match="nobody listens"):
        connect(f"ipc://{path}", True)
    assert time.monotonic() - start < PROMPT_S


def _prompt(call) -> errors.PoolUnavailable:
    start = time.monotonic()
    with pytest.raises(errors.PoolUnavailable) as caught:
        call()
    took = time.monotonic() - start
    assert took < PROMPT_S, f"{took:.1f}s to see the pool had stopped"
    return caught.value


def test_clients_of_a_pool_that_stopped_cleanly_fail_promptly(tmp_path):
    """SIGTERM: the pool drains and removes its socket files. Each client, each carrier, fails its next
    request within a second or so (not at its 120 s timeout), naming the endpoint."""
    test_repo.make_models.make_tiny(str(tmp_path / "models"))
    endpoint = f"ipc://{tmp_path}/p.sock"
    pool = Pool(str(tmp_path / "models"), endpoint=endpoint).start()

    async def run() -> None:
        sync = {lane: Client(endpoint, lane=lane) for lane in (True, False)}
        aio = {lane: await AsyncClient.connect(endpoint, lane=lane) for lane in (True, False)}
        try:
            for lane in (True, False):  # every carrier is up: the thread's lane, the I/O thread's, the loop's
                assert sync[lane].infer("tiny", {"INPUT0": X})["OUTPUT0"][0, 0] == 3.0
                assert sync[lane].infer_async("tiny", {"INPUT0": X}).result(60)["OUTPUT0"][0, 0] == 3.0
                assert (await aio[lane].infer("tiny", {"INPUT0": X}))["OUTPUT0"][0, 0] == 3.0
            assert (await aio[True].status())["lanes"] >= 3
            pool.process.send_signal(signal.SIGTERM)
            assert pool.process.wait(60) == 0
            for lane in (True, False):
                c = sync[lane]
                assert endpoint in str(_prompt(lambda c=c: c.infer("tiny", {"INPUT0": X})))
                assert endpoint in str(_prompt(lambda c=c: c.infer_async("tiny", {"INPUT0": X}).result(60)))
                start = time.monotonic()
                with pytest.raises(errors.PoolUnavailable, match=endpoint):
                    await aio[lane].infer("tiny", {"INPUT0": X})
                assert time.monotonic() - start < PROMPT_S
        finally:
            for c in sync.values():
                c.close()
            for c in aio.values():
                await c.close()

    try:
        asyncio.run(run())
    finally:
        pool.stop()
