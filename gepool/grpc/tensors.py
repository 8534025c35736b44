"""ModelInferRequest -> numpy inputs and what to return; numpy outputs -> ModelInferResponse.

Pure functions over messages, so every hostile request can be tested without a server. As Triton
reads a request: an input whose parameters name a ``shared_memory_region`` is read from that region;
every other input takes the next ``raw_input_contents`` entry when the request carries any, else its
typed ``contents``. Sizes are checked against shape x datatype before anything is allocated (the
messages themselves are already bounded by the server's maximum message length). Responses carry
every output in ``raw_output_contents``, in ``outputs`` order, as Triton does; an output written to
shared memory gets an empty entry so the indices of the others stay right.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gepool.common import request_parameters
from gepool.common.errors import InvalidArgument
from gepool.grpc import grpc_service_pb2 as pb
from gepool.http import kserve
from gepool.ipc import dtypes

# datatype -> the InferTensorContents field that carries it typed (FP16 and BF16 have none: raw only)
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
OUTPUT_KEYS = ("classification", "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


@dataclass
class OutputRequest:
    name: str
    region: str | None = None
    region_size: int = 0
    region_offset: int = 0
    class_count: int = 0  # Triton's classification extension: the top N classes, not the tensor (0: the tensor)


@dataclass
class InferCall:
    model: str
    version: int | None
    inputs: dict[str, np.ndarray]
    outputs: list[OutputRequest] | None  # None: every output of the model
    timeout_s: float | None
    mark_final: bool = False  # triton_enable_empty_final_response: flag the (only) response as the final one
    priority: int = 0  # 0: the model's default level


def param_value(p: pb.InferParameter):
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _int_param(what: str, params, key: str, default: int | None) -> int | None:
    if key not in params:
        return default
    return request_parameters.non_negative_int(key, param_value(params[key]), request_parameters.MAX_INT64, what)


def _region(what: str, params) -> str:
    region = param_value(params["shared_memory_region"])
    if not isinstance(region, str) or not region:
        raise InvalidArgument(f"{what}: 'shared_memory_region' must be a region name, got {region!r}")
    return region


def _shape(name: str, shape, datatype: str, limit: int) -> list[int]:
    dims = list(shape)
    negative = next((d for d in dims if d < 0), None)
    if negative is not None:
        raise InvalidArgument(f"input '{name}': shape must be a list of non-negative integers, got dimension "
                              f"{negative}")
    return kserve.check_shape(name, dims, datatype, limit)


def _typed(name: str, datatype: str, shape: list[int], contents: pb.InferTensorContents) -> np.ndarray:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(f"input '{name}': {datatype} data must be sent in raw_input_contents (it has no "
                              f"typed contents field)")
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidArgument(f"input '{name}': {len(values)} values in contents.{field}, but shape {shape} "
                              f"holds {count}")
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise InvalidArgument(f"input '{name}': {datatype} data belongs in contents.{field}, not in "
                              f"{', '.join(others)}")
    if datatype == "BYTES":
        return np.array(list(values), dtype=object).reshape(shape)
    dtype = dtypes.to_numpy(datatype)
    arr = np.array(values, dtype=np.int64 if dtype.kind == "i" else np.uint64 if dtype.kind == "u" else None)
    if dtype.kind in "iu" and count:
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            bad = next(int(v) for v in arr if v < info.min or v > info.max)
            raise InvalidArgument(f"input '{name}': value {bad} is out of range for {datatype} "
                                  f"[{info.min}, {info.max}]")
    return arr.astype(dtype).reshape(shape)


def parse(request: pb.ModelInferRequest, read_region: Callable[[str, int, int | None, int], memoryview],
          max_input: int) -> InferCall:
    """A request -> the call to make; InvalidArgument names what is wrong. ``read_region(name, offset,
    size, limit)`` reads a system shared-memory input of at most ``limit`` bytes."""
    if not request.model_name:
        raise InvalidArgument("the request names no model (model_name is empty)")
    checked = request_parameters.check({k: param_value(p) for k, p in request.parameters.items()},
                                       request_parameters.GRPC)
    raw = request.raw_input_contents
    raw_used = 0
    inputs: dict[str, np.ndarray] = {}
    for item in request.inputs:
        name, datatype = kserve.unique("input", item.name, inputs), item.datatype
        if datatype == "BF16" or not dtypes.is_supported(datatype):
            raise InvalidArgument(f"input '{name}': datatype '{datatype}' is not supported by gepool")
        shape = _shape(name, item.shape, datatype, max_input)
        params = item.parameters
        what = f"input '{name}'"
        if "shared_memory_region" in params:
            if item.HasField("contents"):
                raise InvalidArgument(f"{what}: 'contents' and 'shared_memory_region' are both given; send the "
                                      f"tensor one way")
            size = _int_param(what, params, "shared_memory_byte_size", None)
            want = kserve.expected_bytes(datatype, shape)
            if want is not None and size is not None and size != want:
                raise InvalidArgument(f"{what}: shared_memory_byte_size {size}, but shape {shape} of {datatype} "
                                      f"needs {want}")
            buf = read_region(_region(what, params), _int_param(what, params, "shared_memory_offset", 0),
                              size if size is not None else want, max_input)
            inputs[name] = kserve.tensor_from_bytes(name, datatype, shape, buf)
        elif raw:
            if item.HasField("contents"):
                raise InvalidArgument(f"contents field must not be specified when using raw_input_contents for "
                                      f"'{name}' for model '{request.model_name}'")
            if raw_used >= len(raw):
                raise InvalidArgument(f"{what}: the request has {len(raw)} raw_input_contents for more inputs")
            inputs[name] = kserve.tensor_from_bytes(name, datatype, shape, raw[raw_used])
            raw_used += 1
        else:
            inputs[name] = _typed(name, datatype, shape, item.contents)
    if raw_used != len(raw):
        raise InvalidArgument(f"{len(raw) - raw_used} raw_input_contents are not claimed by any input "
                              f"(each input not in shared memory takes one, in order)")
    outputs = None
    if request.outputs:
        outputs = []
        seen: set[str] = set()
        for o in request.outputs:
            seen.add(kserve.unique("output", o.name, seen))
            what = f"output '{o.name}'"
            unknown = set(o.parameters) - set(OUTPUT_KEYS)
            if unknown:
                raise InvalidArgument(f"{what}: parameter '{sorted(unknown)[0]}' is not supported by gepool")
            region = _region(what, o.parameters) if "shared_memory_region" in o.parameters else None
            outputs.append(OutputRequest(o.name, region,
                                         _int_param(what, o.parameters, "shared_memory_byte_size", 0),
                                         _int_param(what, o.parameters, "shared_memory_offset", 0),
                                         _int_param(what, o.parameters, "classification", 0)))
    return InferCall(request.model_name, request_parameters.model_version(request.model_version), inputs, outputs,
                     checked.timeout_s, checked.final_response, checked.priority)


MAX_ANSWER_HEADS = 256
_answer_heads: dict[tuple, tuple[bytes, bytes] | None] = {}
_ID_TAG = b"\x1a"  # ModelInferResponse.id: field 3, length-delimited
_CONTENTS_TAG = b"\x32"  # ModelInferResponse.raw_output_contents: field 6, length-delimited
_PROBE_ID = "\u00e9-id"  # (an id that the check of a head writes: not ASCII, so its bytes are not its characters)


def response_bytes(request_id: str, call: InferCall, served: str, outputs: dict[str, np.ndarray]) -> bytes | None:
    """``response(...).SerializeToString()`` sooner, for the common answer: one fixed-size output, raw. The bytes
    around its id (fields 1 and 2 before it, 4 and 5 after) are serialized once for each model, version, output,
    dtype and shape, and kept only where the whole message, with an id and without, serializes as they, the id
    and the contents do. None where the full path is needed."""
    if len(outputs) != 1:
        return None
    ((name, arr),) = outputs.items()
    wanted = call.outputs
    if wanted is not None and (len(wanted) != 1 or wanted[0].name != name or wanted[0].region is not None) \
            or type(arr) is not np.ndarray or arr.dtype.kind in "OSU":  # (strings: a length before each element)
        return None
    key = (call.model, served, call.mark_final, name, arr.dtype, arr.shape, wanted is None)
    parts = _answer_heads.get(key, False)
    if parts is None:
        return None
    data = np.ascontiguousarray(arr).tobytes()
    if parts is False:
        parts = _answer_parts(call, served, outputs, data)
        if len(_answer_heads) >= MAX_ANSWER_HEADS:
            _answer_heads.clear()
        _answer_heads[key] = parts
        if parts is None:
            return None
    before, after = parts
    if not request_id:
        return b"".join((before, after, _CONTENTS_TAG, varint(len(data)), data))
    text = request_id.encode("utf-8")
    return b"".join((before, _ID_TAG, varint(len(text)), text, after, _CONTENTS_TAG, varint(len(data)), data))


def _answer_parts(call: InferCall, served: str, outputs: dict[str, np.ndarray], data: bytes) \
        -> tuple[bytes, bytes] | None:
    """The bytes of an answer before its id and after it, up to its contents; None where the whole message does
    not serialize as they, an id and the contents do (another serializer's order: the full path then, always)."""
    whole = response("", call, served, outputs, no_region).SerializeToString()
    tail = _CONTENTS_TAG + varint(len(data)) + data
    split = len(pb.ModelInferResponse(model_name=call.model, model_version=served).SerializeToString())
    before, after = whole[:split], whole[split:len(whole) - len(tail)]
    text = _PROBE_ID.encode("utf-8")
    with_id = response(_PROBE_ID, call, served, outputs, no_region).SerializeToString()
    if before + after + tail != whole or before + _ID_TAG + varint(len(text)) + text + after + tail != with_id:
        return None
    return before, after


def varint(value: int) -> bytes:
    """A base-128 varint's bytes (protobuf's wire format)."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def no_region(*args) -> None:
    """The ``read_region`` and ``write_region`` of a call with no shared memory, which never reads or writes one."""
    raise AssertionError("a call with no shared memory reads and writes no region")


def response(request_id: str, call: InferCall, served: str, outputs: dict[str, np.ndarray],
             write_region: Callable[[str, int, int, bytes], None]) -> pb.ModelInferResponse:
    """The answer to the request ``request_id`` names: every wanted output raw, or (shared memory) written where
    it was asked."""
    out = pb.ModelInferResponse(model_name=call.model, model_version=served, id=request_id)
    if call.mark_final:
        out.parameters["triton_final_response"].bool_param = True
    wanted = call.outputs if call.outputs is not None else [OutputRequest(n) for n in outputs]
    for o in wanted:
        arr = outputs[o.name]
        datatype = dtypes.BYTES if arr.dtype == object else dtypes.from_numpy(arr.dtype)
        data = dtypes.serialize_bytes(arr) if datatype == dtypes.BYTES else np.ascontiguousarray(arr).tobytes()
        tensor = out.outputs.add(name=o.name, datatype=datatype, shape=arr.shape)
        if o.region is not None:
            write_region(o.region, o.region_offset, o.region_size, data)
            tensor.parameters["shared_memory_region"].string_param = o.region
            tensor.parameters["shared_memory_byte_size"].int64_param = len(data)
            if o.region_offset:
                tensor.parameters["shared_memory_offset"].int64_param = o.region_offset
            data = b""
        out.raw_output_contents.append(data)
    return out
