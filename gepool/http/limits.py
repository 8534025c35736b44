"""What one HTTP request may cost the sidecar: its body's size, the time the body takes to arrive, its JSON.

Every body is hostile: its declared size is checked against ``--http-max-body-bytes`` before a byte
is read, a body that stops arriving is answered 408 after ``BODY_TIMEOUT_S``, JSON above
``MAX_JSON_BYTES`` is refused unparsed (the C parser holds the GIL, so a big document would stall
every other client), and bodies above ``INLINE_PARSE_BYTES`` are parsed in a worker thread.
"""

import asyncio
import mmap
import zlib
from collections.abc import AsyncIterable, Callable

from aiohttp import web

from gepool.common import errors
from gepool.scheduler.regions import LARGEST_SLOT_OFFSET

DEFAULT_MAX_BODY_BYTES = 64 << 20  # Triton's --http-max-input-size default; the pool passes its largest slot
MAX_JSON_BYTES = 2 << 20  # about 50 ms of json.loads on this host's cores
INLINE_PARSE_BYTES = 64 << 10  # bodies above this (or naming shared memory) are parsed off the event loop
BODY_TIMEOUT_S = 30.0
BODY_HEADROOM_BYTES = 1 << 20  # room in the default body limit for the JSON header around a slot's tensors


class BodyLimit:
    """The largest request body: a size, or (``page``: the front's shared page) the larger of that size
    and the largest slot of any model the front holds now, plus ``BODY_HEADROOM_BYTES``, so that a model
    loaded after start with larger batches is served."""

    __slots__ = ("floor", "_words")

    def __init__(self, floor: int, page: mmap.mmap | None = None) -> None:
        self.floor = floor
        # read as a word of a view (about a third of unpack_from's cost: it is read for every request); the view
        # holds the mapping open for as long as this lives
        self._words = memoryview(page).cast("Q") if page is not None else None

    def __call__(self) -> int:
        if self._words is None:
            return self.floor
        slot = self._words[LARGEST_SLOT_OFFSET // 8] + BODY_HEADROOM_BYTES
        return slot if slot > self.floor else self.floor


class BodyTooLarge(errors.RequestTooLarge):
    http_status = 413


class BodyTimeout(errors.GepoolError):
    code, http_status = "TIMEOUT", 408


class ClientGone(errors.GepoolError):
    """The client closed its connection before its body arrived: nobody hears the answer, nothing is logged."""

    http_status = 400


ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")
NOT_DECODABLE = "the request body is not valid for its Content-Encoding"
AFTER_END = "the request body has data after the end of the compressed stream"
NOT_FRAMED = "the request body's chunked framing is malformed"
CLIENT_GONE = "the client closed the connection before its request body arrived"
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def too_large(max_body: int, declared: int | None = None) -> str:
    size = "" if declared is None else f" of {declared} bytes"
    return f"the request body{size} is over the {max_body}-byte limit (--http-max-body-bytes)"


def json_too_large(size: int, max_json: int) -> str:
    return f"the request JSON of {size} bytes is over the {max_json}-byte limit for JSON"


def too_slow(timeout: float, declared: int | None) -> str:
    return f"the request body did not arrive within {timeout:g} s (it declared {declared} bytes)"


def content_encoding(headers) -> str:
    """The body's Content-Encoding, lowercased: identity, gzip, x-gzip or deflate (zlib or raw), else 415."""
    encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding not in ENCODINGS:
        raise web.HTTPUnsupportedMediaType(reason=f"the Content-Encoding {encoding!a} is not supported "
                                                  f"(gzip, deflate or identity)")
    return encoding


async def read_body(request: web.Request, max_body: int, timeout: float, max_json: int | None = None,
                    refusal: Callable[[int, int], str] = json_too_large) -> bytes:
    """The whole body, its declared size checked before a byte is read, within ``timeout`` seconds; both
    servers decode the same encodings through ``decode``, and an empty body is empty whatever its
    Content-Encoding.

    ``max_json`` is given for a body that is all JSON: an uncompressed one that declares more is refused
    unread, as one over ``max_body`` is, with what ``refusal(declared, max_json)`` says."""
    declared = request.headers.get("Content-Length")
    if max_json is not None and declared is not None and declared.isdecimal():
        if int(declared) > max_body:
            raise BodyTooLarge(too_large(max_body, int(declared)))
        if int(declared) > max_json and content_encoding(request.headers) == "identity":
            if not isinstance(request, web.BaseRequest):
                await request.discard_body(timeout)
            raise BodyTooLarge(refusal(int(declared), max_json))
    if not isinstance(request, web.BaseRequest):  # granian's (rsgi.Request) bounds its own reads
        return await request.read_body(max_body, timeout)
    encoding = content_encoding(request.headers)
    length = request.content_length
    if length is not None and length > max_body:
        raise BodyTooLarge(too_large(max_body, length))
    try:
        if encoding == "identity" and request.content.is_eof():  # all of it came with the headers: no timer
            body = request.content.read_nowait()
            if len(body) > max_body:
                raise BodyTooLarge(too_large(max_body))
            return body
        async with asyncio.timeout(timeout):  # (not request.read(): its client_max_size is fixed at start)
            return await decode(request.content.iter_any(), max_body, encoding)
    except TimeoutError:
        raise BodyTimeout(too_slow(timeout, length)) from None
    except web.RequestPayloadError:  # aiohttp's chunked framing failed
        raise web.HTTPBadRequest(reason=NOT_FRAMED) from None
    except ConnectionResetError as exc:
        # aiohttp's reader keeps the exception, whose traceback holds the frames that hold the reader: a cycle
        # that would keep the body read so far until the collector's next pass
        exc.__traceback__ = None
        raise ClientGone(CLIENT_GONE) from None


async def decode(chunks: AsyncIterable[bytes], max_body: int, encoding: str) -> bytes:
    """The body read as it arrives (chunked, or compressed), decompressed as ``encoding`` says, never
    holding more than ``max_body`` of it, nor reading more than ``max_body`` bytes off the wire (an endless
    run of empty deflate blocks); both servers read a compressed body through this (aiohttp's own decoder
    is off)."""
    over = BodyTooLarge(too_large(max_body))
    wbits = _WBITS.get(encoding)
    decoder = zlib.decompressobj(wbits) if wbits is not None else None
    parts, size, raw = [], 0, 0
    async for chunk in chunks:
        raw += len(chunk)
        if raw > max_body:
            raise over
        if decoder is not None:
            if chunk and raw == len(chunk) and wbits == zlib.MAX_WBITS and chunk[0] & 0xF != 8:
                decoder = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, without zlib's header, as aiohttp
            if decoder.eof:
                if chunk:
                    raise web.HTTPBadRequest(reason=AFTER_END)
                continue
            try:
                chunk = decoder.decompress(chunk, max_body - size + 1)
            except zlib.error as exc:
                raise web.HTTPBadRequest(reason=f"{NOT_DECODABLE}: {exc}") from None
            if decoder.unconsumed_tail:
                raise over
            if decoder.unused_data:
                raise web.HTTPBadRequest(reason=AFTER_END)
        size += len(chunk)
        if size > max_body:
            raise over
        parts.append(chunk)
    if decoder is not None and raw:  # an empty body is empty
        try:
            tail = decoder.flush()
        except zlib.error as exc:
            raise web.HTTPBadRequest(reason=f"{NOT_DECODABLE}: {exc}") from None
        size += len(tail)
        if size > max_body:
            raise over
        parts.append(tail)
        if not decoder.eof:
            raise web.HTTPBadRequest(reason="the request body ends inside its compressed stream")
    return b"".join(parts)
