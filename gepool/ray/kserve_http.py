"""KServe v2 over Ray Serve's HTTP ingress: health, server and model metadata, model config, ready and infer.

Bodies are parsed and answered by ``gepool.http.kserve`` (the sidecar's own pure functions); the pool is
reached through the replica's AsyncClient. Serve's proxy hands over a Starlette request; nothing here
allocates for a body before its size is known to be within the limit.
"""

import asyncio
import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import gepool
from gepool.common import errors
from gepool.http import kserve
from gepool.http.limits import INLINE_PARSE_BYTES, MAX_JSON_BYTES
from gepool.ipc.protocol import ModelState

EXTENSIONS = ["binary_tensor_data", "model_configuration"]
METADATA_FIELDS = ("name", "versions", "platform", "inputs", "outputs")
_MODEL = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<rest>/ready|/infer|/config)?$")


class BodyTooLarge(errors.RequestTooLarge):
    http_status = 413


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def read_body(request: Request, max_body: int) -> bytes:
    """The body, refused (413) past ``max_body`` by its declared length or, without one, as it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_body):
        raise BodyTooLarge(f"the request body of {declared} bytes is over the {max_body}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise BodyTooLarge(f"the request body is over the {max_body}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def version_of(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or len(text) > 18:
        raise errors.InvalidArgument(f"a model version is a whole number, not '{text[:40]}'")
    return int(text)


async def model_meta(client, model: str, version: int | None) -> dict:
    meta = await client.model_metadata(model)
    if version is not None and str(version) not in meta.get("versions", []):
        raise errors.ModelNotFound(f"Request for unknown model: '{meta['name']}' version {version} is not found")
    return meta


async def handle(request: Request, client, ready, max_body: int) -> Response:
    """One KServe v2 request. ``client``: the pool's AsyncClient; ``ready()``: whether the replica takes
    traffic (awaitable)."""
    path, method = request.url.path.rstrip("/") or "/", request.method
    try:
        if path == "/v2/health/live" and method == "GET":
            return Response(status_code=200)
        if path == "/v2/health/ready" and method == "GET":
            return Response(status_code=200 if await ready() else 400)
        if path == "/v2" and method == "GET":
            return JSONResponse({"name": "gepool", "version": gepool.__version__, "extensions": EXTENSIONS})
        found = _MODEL.match(path)
        if found is None:
            return error(404, f"no KServe v2 route for {method} {path[:200]}")
        model, version, rest = found["model"], version_of(found["version"]), found["rest"]
        if rest == "/infer" and method == "POST":
            return await infer(request, client, model, version, max_body)
        if method != "GET" or rest == "/infer":
            return error(405, f"{method} is not allowed on {path[:200]}")
        meta = await model_meta(client, model, version)
        if rest is None:
            return JSONResponse({k: meta[k] for k in METADATA_FIELDS if k in meta})
        if rest == "/ready":
            return Response(status_code=200 if meta["state"] == ModelState.AVAILABLE else 400)
        return JSONResponse(await client.query("config", {"model": model}))
    except errors.GepoolError as exc:
        return error(exc.http_status, exc.message)


async def infer(request: Request, client, model: str, version: int | None, max_body: int) -> Response:
    body = await read_body(request, max_body)
    header_length = request.headers.get(kserve.HEADER_LENGTH)
    if len(body) > INLINE_PARSE_BYTES:  # json.loads of a large header holds the loop: off it
        req = await asyncio.to_thread(kserve.parse_request, body, header_length, None, MAX_JSON_BYTES, max_body)
    else:
        req = kserve.parse_request(body, header_length, None, MAX_JSON_BYTES, max_body)
    if any(o.region is not None for o in req.outputs or []):
        raise errors.InvalidArgument("system shared memory is not available through Ray Serve")
    if not req.inputs:
        meta = await model_meta(client, model, version)
        raise errors.InvalidArgument(f"expected {len(meta.get('inputs', []))} inputs but got 0 inputs for "
                                     f"model '{model}'")
    names = [o.name for o in req.outputs] if req.outputs is not None else None
    outputs = await client.infer(model, req.inputs, names, version=version)
    served = getattr(outputs, "model_version", None)
    payload, headers = kserve.encode_response(
        model, str(served) if served is not None else (str(version) if version else ""), req, outputs)
    return Response(content=payload, headers=headers)
