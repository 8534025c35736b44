"""Large JSON request bodies parsed in a helper process, so that one big document never holds the GIL
of the process that answers every other HTTP client.

json.loads holds the GIL for its whole run (about 100 ms for 2 MiB on a loaded 2-core host), so a
thread does not help. The helper returns the parsed request (numpy arrays pickle as flat buffers), a
refusal as (its code, message), or the traceback of anything else: exceptions never cross the process
boundary. The helper is given no JSON limit (the caller checked it), so no refusal is a subclass whose
HTTP status its code does not give.
"""

import asyncio
import logging
import multiprocessing
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gepool.common import errors
from gepool.http import kserve

log = logging.getLogger("gepool.http")


def _parse(body: bytes, header_length: str | None, max_input: int) -> tuple:
    try:
        return "ok", kserve.parse_request(body, header_length, None, None, max_input)
    except errors.GepoolError as exc:
        return "error", exc.code, exc.message
    except Exception:  # noqa: BLE001  (reported as internal, as anywhere else; the traceback to the log)
        return "crash", traceback.format_exc()


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
        if result[0] == "error":
            raise errors.from_code(result[1], result[2])
        log.error("internal error parsing a request in the helper process:\n%s", result[-1])
        raise errors.Internal(errors.INTERNAL_MESSAGE)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
