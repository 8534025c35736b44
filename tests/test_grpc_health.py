"""grpc.health.v1 Watch streams share one readiness query per interval, and their number is bounded: a real
grpc.aio server in this process, its Health servicer over a gateway whose readiness calls are counted."""

import asyncio

import grpc
import pytest

from gepool.grpc import health_pb2, health_pb2_grpc
from gepool.grpc import server as grpc_server
from tests.conftest import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING


class CountingGateway:
    """What Health reads of the gateway: ready(), here counted instead of asking a front."""

    def __init__(self) -> None:
        self.asked = 0

    async def ready(self) -> bool:
        self.asked += 1
        return True


class Service:
    def __init__(self) -> None:
        self.gw = CountingGateway()


async def _serve(health: grpc_server.Health) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_registered_method_handlers(grpc_server.HEALTH_SERVICE, grpc_server.health_methods(health))
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    return server, port


def test_many_watch_streams_ask_the_front_once_per_interval_and_their_number_is_bounded(monkeypatch):
    """200 Watch streams opened together each hear SERVING, from a few readiness queries (one per
    WATCH_INTERVAL_S for all of them; each stream asked once per interval before), and a stream past
    MAX_WATCHERS is refused RESOURCE_EXHAUSTED while the others stay open."""
    monkeypatch.setattr(grpc_server, "MAX_WATCHERS", 200)

    async def run() -> None:
        service = Service()
        health = grpc_server.Health(service)
        server, port = await _serve(health)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                streams = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(200)]
                firsts = await asyncio.wait_for(asyncio.gather(*(s.read() for s in streams)), 60)
                assert [f.status for f in firsts] == [SERVING] * 200
                assert 1 <= service.gw.asked <= 10, service.gw.asked  # one a second: 200 before
                extra = stub.Watch(health_pb2.HealthCheckRequest())
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(extra.read(), 60)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "too many health Watch streams" in refused.value.details()
                for s in streams:
                    s.cancel()
                async with asyncio.timeout(60):  # each stream's end is seen by the server in its own time
                    while health.watchers:
                        await asyncio.sleep(0.01)
                unknown = stub.Watch(health_pb2.HealthCheckRequest(service="other"))
                first = await asyncio.wait_for(unknown.read(), 60)
                assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                unknown.cancel()
        finally:
            await server.stop(0)

    asyncio.run(run())
