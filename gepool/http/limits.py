"""What one HTTP request may cost the sidecar: its body's size, the time the body takes to arrive, its JSON.

Every body is hostile: its declared size is checked against ``--http-max-body-bytes`` before a byte
is read, a body that stops arriving is answered 408 after ``BODY_TIMEOUT_S``, JSON above
``MAX_JSON_BYTES`` is refused unparsed (the C parser holds the GIL, so a big document would stall
every other client), and bodies above ``INLINE_PARSE_BYTES`` are parsed in a worker thread.
"""

import asyncio
from collections.abc import Callable

from aiohttp import web

from gepool.common import errors

DEFAULT_MAX_BODY_BYTES = 64 << 20  # Triton's --http-max-input-size default; the pool passes its largest slot
MAX_JSON_BYTES = 2 << 20  # about 50 ms of json.loads on this host's cores
INLINE_PARSE_BYTES = 64 << 10  # bodies above this (or naming shared memory) are parsed off the event loop
BODY_TIMEOUT_S = 30.0


class BodyTooLarge(errors.RequestTooLarge):
    http_status = 413


class BodyTimeout(errors.GepoolError):
    code, http_status = "TIMEOUT", 408


ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")
NOT_DECODABLE = "the request body is not valid for its Content-Encoding"
AFTER_END = "the request body has data after the end of the compressed stream"


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
        raise web.HTTPUnsupportedMediaType(reason=f"the Content-Encoding '{encoding}' is not supported "
                                                  f"(gzip, deflate or identity)")
    return encoding


async def read_body(request: web.Request, max_body: int, timeout: float, max_json: int | None = None,
                    refusal: Callable[[int, int], str] = json_too_large) -> bytes:
    """The whole body, its declared size checked before a byte is read, within ``timeout`` seconds; both
    servers decode the same encodings, and an empty body is empty whatever its Content-Encoding.

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
    content_encoding(request.headers)  # aiohttp would pass an unknown one through undecoded
    length = request.content_length
    if length is not None and length > max_body:
        raise BodyTooLarge(too_large(max_body, length))
    try:
        if request.content.is_eof():  # all of it came with the headers: nothing to wait for, no timer to set
            body = request.content.read_nowait()
            if len(body) > max_body:  # a compressed body is counted as it was decompressed, as read() does
                raise BodyTooLarge(too_large(max_body))
            return body
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(too_slow(timeout, length)) from None
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(too_large(max_body)) from None
    except web.RequestPayloadError:  # aiohttp's decoder failed: bad compressed data, or data after its end
        raise web.HTTPBadRequest(reason=NOT_DECODABLE) from None


def version(text: str | None) -> int | None:
    """A version from the URL: None when absent, else a positive integer or InvalidArgument."""
    if not text:
        return None
    if not (text.isascii() and text.isdecimal()) or int(text) <= 0:
        raise errors.InvalidArgument(f"failed to get model version from specified version string '{text}': "
                                     f"version should be an integral value > 0")
    return int(text)
