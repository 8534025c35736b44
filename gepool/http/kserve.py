"""KServe v2 / Triton HTTP infer bodies: JSON tensors and the binary tensor data extension, both ways.

Pure functions over bytes, so every malformed body can be tested without a server. See
shared/reference/triton.md §1.6-1.9: binary blobs follow the JSON header in the order of
``inputs[]`` (request) or ``outputs[]`` (response), sized by ``binary_data_size``; the header's
length travels in ``Inference-Header-Content-Length``; BYTES elements are a little-endian uint32
length followed by the bytes.
"""

import json
import math
from dataclasses import dataclass, field

import numpy as np

from gepool.common.errors import InvalidArgument
from gepool.ipc import dtypes

HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass
class OutputRequest:
    name: str
    binary: bool
    region: str | None = None
    region_size: int = 0
    region_offset: int = 0


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[OutputRequest] | None  # None: all outputs, binary per binary_data_output
    binary_output: bool
    id: str | None = None
    parameters: dict = field(default_factory=dict)


def numpy_dtype(datatype: str) -> np.dtype:
    if datatype == "BYTES":
        return np.dtype(object)
    if not isinstance(datatype, str) or not dtypes.is_supported(datatype):
        raise InvalidArgument(f"unknown datatype '{datatype}'")
    return dtypes.to_numpy(datatype)


def tensor_from_bytes(name: str, datatype: str, shape: list[int], buf) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        try:
            return dtypes.deserialize_bytes(buf, tuple(shape))
        except ValueError as exc:
            raise InvalidArgument(f"input '{name}': {exc}") from None
    dtype = numpy_dtype(datatype)
    if len(buf) != count * dtype.itemsize:
        raise InvalidArgument(f"input '{name}': {len(buf)} bytes of data, but shape {shape} of {datatype} "
                              f"needs {count * dtype.itemsize}")
    return np.frombuffer(buf, dtype).reshape(shape)


def _shape(name: str, shape) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InvalidArgument(f"input '{name}': shape must be a list of non-negative integers, got {shape!r}")
    return shape


def _from_json(name: str, datatype: str, shape: list[int], data) -> np.ndarray:
    if datatype in ("FP16", "BF16"):
        raise InvalidArgument(f"input '{name}': receiving {datatype} data via JSON is not supported")
    dtype = numpy_dtype(datatype)
    try:
        if datatype == "BYTES":
            flat = np.array([d.encode("utf-8") if isinstance(d, str) else bytes(d) for d in _flatten(data)],
                            dtype=object)
        else:
            flat = np.asarray(list(_flatten(data)), dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"input '{name}': data is not {datatype}: {exc}") from None
    if flat.size != math.prod(shape):
        raise InvalidArgument(f"input '{name}': {flat.size} values of data for shape {shape}")
    return flat.reshape(shape)


def _flatten(data):
    if isinstance(data, list):
        for item in data:
            yield from _flatten(item)
    else:
        yield data


def parse_request(body: bytes, header_length: str | None, regions=None) -> InferRequest:
    """A request body -> numpy inputs and what to return; InvalidArgument names whatever is wrong.
    ``regions(name, offset, size) -> memoryview`` resolves system shared-memory inputs."""
    if header_length is not None:
        try:
            hlen = int(header_length)
        except ValueError:
            raise InvalidArgument(f"{HEADER_LENGTH} must be an integer, got '{header_length}'") from None
        if hlen < 0 or hlen > len(body):
            raise InvalidArgument(f"{HEADER_LENGTH} {hlen} does not fit the {len(body)}-byte body")
    else:
        hlen = len(body)
    try:
        header = json.loads(bytes(body[:hlen]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InvalidArgument("the request JSON must be an object with an 'inputs' list")
    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgument("'parameters' must be an object")
    blob = memoryview(body)[hlen:]
    pos = 0
    inputs: dict[str, np.ndarray] = {}
    for item in header["inputs"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgument(f"each input needs a 'name', got {item!r}")
        name, datatype = item["name"], item.get("datatype")
        shape = _shape(name, item.get("shape"))
        numpy_dtype(datatype)
        p = item.get("parameters") or {}
        if "shared_memory_region" in p:
            if regions is None:
                raise InvalidArgument("system shared memory is not available here")
            buf = regions(p["shared_memory_region"], int(p.get("shared_memory_offset", 0)),
                          p.get("shared_memory_byte_size"))
            inputs[name] = tensor_from_bytes(name, datatype, shape, buf)
        elif "binary_data_size" in p:
            size = p["binary_data_size"]
            if not isinstance(size, int) or size < 0 or pos + size > len(blob):
                raise InvalidArgument(f"input '{name}': binary_data_size {size!r} runs past the "
                                      f"{len(blob)} bytes of binary data")
            inputs[name] = tensor_from_bytes(name, datatype, shape, blob[pos:pos + size])
            pos += size
        elif "data" in item:
            inputs[name] = _from_json(name, datatype, shape, item["data"])
        else:
            raise InvalidArgument(f"input '{name}' has no data, binary_data_size or shared_memory_region")
    if pos != len(blob):
        raise InvalidArgument(f"{len(blob) - pos} bytes of binary data are not claimed by any input")
    binary_output = bool(params.get("binary_data_output", False))
    outputs = None
    if header.get("outputs") is not None:
        if not isinstance(header["outputs"], list):
            raise InvalidArgument("'outputs' must be a list")
        outputs = []
        for o in header["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InvalidArgument(f"each requested output needs a 'name', got {o!r}")
            op = o.get("parameters") or {}
            outputs.append(OutputRequest(
                o["name"], bool(op.get("binary_data", binary_output)), op.get("shared_memory_region"),
                int(op.get("shared_memory_byte_size", 0) or 0), int(op.get("shared_memory_offset", 0) or 0)))
    return InferRequest(inputs, outputs, binary_output, header.get("id"), params)


def encode_response(model: str, version: str, req: InferRequest, outputs: dict[str, np.ndarray],
                    write_region=None) -> tuple[bytes, dict[str, str]]:
    """Outputs -> (body, headers). ``write_region(name, offset, size, data)`` writes shared-memory outputs."""
    wanted = req.outputs if req.outputs is not None else [OutputRequest(n, req.binary_output) for n in outputs]
    entries, blobs = [], []
    for o in wanted:
        arr = outputs[o.name]
        datatype = "BYTES" if arr.dtype == object else dtypes.from_numpy(arr.dtype)
        entry = {"name": o.name, "datatype": datatype, "shape": list(arr.shape)}
        raw = dtypes.serialize_bytes(arr) if datatype == "BYTES" else None
        if o.region is not None:
            data = raw if raw is not None else np.ascontiguousarray(arr).tobytes()
            write_region(o.region, o.region_offset, o.region_size, data)
            entry["parameters"] = {"shared_memory_region": o.region, "shared_memory_byte_size": len(data)}
        elif o.binary:
            data = raw if raw is not None else np.ascontiguousarray(arr).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        elif datatype == "BYTES":
            entry["data"] = [b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b) for b in arr.ravel()]
        else:
            entry["data"] = arr.ravel().tolist()
        entries.append(entry)
    body = {"model_name": model, "model_version": version, "outputs": entries}
    if req.id is not None:
        body["id"] = req.id
    header = json.dumps(body, separators=(",", ":")).encode()
    if not blobs:
        return header, {"Content-Type": "application/json"}
    return b"".join([header, *blobs]), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
