"""A body whose client went away mid-upload is not kept in a reference cycle: the sidecar's collector runs
seldom (gc_policy.YOUNG_THRESHOLD), so a cycle would hold the bytes read so far until it does."""

import asyncio
import gc
import socket

from aiohttp import web

from gepool.http import limits
from tests.conftest import cyclic_garbage

SENT = 512 << 10  # of a body declaring twice as much


async def _abort_one_upload() -> None:
    gone = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        try:
            await limits.read_body(request, 64 << 20, 30)
        except limits.ClientGone:
            gone.set()
        return web.Response()

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        def upload() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 * SENT) + b"x" * SENT)

        await asyncio.to_thread(upload)
        await asyncio.wait_for(gone.wait(), 30)
    finally:
        await runner.cleanup()


def test_an_upload_cut_short_leaves_no_cycle_holding_its_body():
    garbage = cyclic_garbage(lambda: asyncio.run(_abort_one_upload()))
    held = [o for o in garbage if type(o).__name__ == "StreamReader"]
    big = [r for o in garbage for r in gc.get_referents(o) if isinstance(r, bytes | bytearray) and len(r) >= SENT // 4]
    assert not held and not big, (held, [len(b) for b in big])
