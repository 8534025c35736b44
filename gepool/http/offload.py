"""Large JSON request bodies parsed in a helper process, so that one big document never holds the GIL
of the process that answers every other HTTP client.

json.loads holds the GIL for its whole run (about 100 ms for 2 MiB on a loaded 2-core host), so a
thread does not help. The helper returns the parsed request (numpy arrays pickle as flat buffers) or
an error as (code, message): exceptions never cross the process boundary.
"""

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gepool.common import errors
from gepool.http import kserve


def _parse(body: bytes, header_length: str | None, max_input: int) -> tuple:
    try:
        return "ok", kserve.parse_request(body, header_length, None, None, max_input)
    except errors.GepoolError as exc:
        return "error", exc.code, exc.message
    except Exception as exc:  # noqa: BLE001  (reported as internal, as anywhere else)
        return "error", "INTERNAL", f"parsing the request failed: {type(exc).__name__}"


class JSONOffload:
    """One helper process, started on first use and again after it died."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, body: bytes, header_length: str | None, max_input: int) -> kserve.InferRequest:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, _parse, bytes(body), header_length,
                                                                      max_input)
        except BrokenProcessPool:
            self._pool = None
            raise errors.Unavailable("the helper process that parses large JSON bodies died; send the request "
                                     "again") from None
        if result[0] == "ok":
            return result[1]
        raise errors.from_code(result[1], result[2])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
