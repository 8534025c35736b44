"""KServe v2 / Triton HTTP infer bodies: JSON tensors and the binary tensor data extension, both ways.

Pure functions over bytes, so every malformed body can be tested without a server. See
shared/reference/triton.md §1.6-1.9: binary blobs follow the JSON header in the order of
``inputs[]`` (request) or ``outputs[]`` (response), sized by ``binary_data_size``; the header's
length travels in ``Inference-Header-Content-Length``; BYTES elements are a little-endian uint32
length followed by the bytes.
"""

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import orjson

from gepool.common import request_parameters
from gepool.common.errors import InvalidArgument, RequestTooLarge
from gepool.common.request_parameters import MAX_INT64, MAX_KEY_SHOWN
from gepool.http import jsonfast
from gepool.http.jsonfast import FAST_MIN_BYTES, Doubles, openings
from gepool.ipc import dtypes

HEADER_LENGTH = "Inference-Header-Content-Length"


class JSONTooLarge(RequestTooLarge):
    http_status = 413


def json_too_large(size: int, max_json: int) -> str:
    return (f"the request JSON of {size} bytes is over the {max_json}-byte limit for JSON; send large tensors "
            f"as binary data (binary_data=True) or through shared memory")


@dataclass
class OutputRequest:
    name: str
    binary: bool
    region: str | None = None
    region_size: int = 0
    region_offset: int = 0
    class_count: int = 0  # Triton's classification extension: the top N classes, not the tensor (0: the tensor)


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[OutputRequest] | None  # None: all outputs, binary per binary_data_output
    binary_output: bool
    id: str | None = None
    parameters: dict = field(default_factory=dict)
    priority: int = 0  # Triton's request priority: 0 the model's default level, 1 the highest
    timeout_s: float | None = None  # Triton's request timeout (its 'timeout' parameter is in microseconds)


def numpy_dtype(datatype: str) -> np.dtype:
    dtype = _DTYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InvalidArgument(f"unknown datatype '{datatype}'")
    return dtype


_DTYPES = {name: dtypes.to_numpy(name) for name in dtypes.DATATYPES}  # BYTES: object


MAX_NESTING = 32  # JSON tensor data nested deeper than any shape gepool serves
MAX_DIMS = 32  # numpy 1.x holds at most 32 dimensions (2.x 64): the bound for HTTP and gRPC alike
MAX_TENSOR_BYTES = 1 << 60  # below what numpy can size (its intp) for any element of up to 8 bytes
MIN_BYTES_ELEMENT = 4  # a BYTES element's raw length prefix: the least any element costs
OUTPUT_KEYS = ("binary_data", "classification", "shared_memory_region", "shared_memory_byte_size",
               "shared_memory_offset")  # Triton's HTTP output parameters
F32_MAX = float(np.finfo(np.float32).max)
NUMERIC_MIN = 128  # from this many elements numpy's calls cost less than _checked's Python-level pass
_INT_KINDS = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
_NUMBERS = frozenset((int, float))
_FLOATS = {float}
_LISTS = {list}


def tensor_from_bytes(name: str, datatype: str, shape: list[int], buf) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        if count * 4 > len(buf):  # every element carries a 4-byte length: refuse before allocating for it
            raise InvalidArgument(f"input '{name}': shape {shape} declares {count} BYTES elements, but "
                                  f"{len(buf)} bytes of data hold at most {len(buf) // 4}")
        try:
            return dtypes.deserialize_bytes(buf, tuple(shape))
        except ValueError as exc:
            raise InvalidArgument(f"input '{name}': {exc}") from None
    dtype = numpy_dtype(datatype)
    if len(buf) != count * dtype.itemsize:
        raise InvalidArgument(f"input '{name}': {len(buf)} bytes of data, but shape {shape} of {datatype} "
                              f"needs {count * dtype.itemsize}")
    return np.frombuffer(buf, dtype).reshape(shape)


def expected_bytes(datatype: str, shape: list[int]) -> int | None:
    """The byte size a fixed-size tensor of this shape has (None for BYTES)."""
    return None if datatype == "BYTES" else math.prod(shape) * numpy_dtype(datatype).itemsize


def _shape(name: str, shape, datatype: str, limit: int | None) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InvalidArgument(f"input '{name}': shape must be a list of non-negative integers, got {shape!r}"[:500])
    return check_shape(name, shape, datatype, limit)


def check_shape(name: str, shape: list[int], datatype: str, limit: int | None) -> list[int]:
    """A shape of non-negative dimensions that numpy can hold and whose data fits ``limit`` bytes (None: only
    what numpy can hold), checked before
    anything is allocated for it. numpy sizes an array by the product of its non-zero dimensions (an empty
    array of [0, 2**70] is still refused), so those are what is counted."""
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(f"input '{name}': shape has {len(shape)} dimensions, more than the {MAX_DIMS} gepool "
                              f"allows")
    if len(shape) and max(shape) > MAX_INT64:
        big = next(d for d in shape if d > MAX_INT64)
        raise InvalidArgument(f"input '{name}': shape dimension {big} is past the largest a tensor may have "
                              f"({MAX_INT64})")
    elements = math.prod(shape) if 0 not in shape else math.prod(d for d in shape if d)
    need = elements * (MIN_BYTES_ELEMENT if datatype == "BYTES" else numpy_dtype(datatype).itemsize)
    limit = MAX_TENSOR_BYTES if limit is None else min(limit, MAX_TENSOR_BYTES)
    if need > limit:
        counted = "" if all(shape) else " (counting its non-zero dimensions, as numpy sizes an array)"
        raise InvalidArgument(f"input '{name}': shape {shape} of {datatype} needs {need} bytes{counted}, past the "
                              f"{limit}-byte limit of one input")
    return shape


def unique(what: str, name: str, seen) -> str:
    """``name`` if ``seen`` does not hold it yet: an input or output named twice is refused (a repeated
    output would be answered once per copy, a small request drawing a huge reply)."""
    if name in seen:
        raise InvalidArgument(f"{what} '{name}' is {'given' if what == 'input' else 'requested'} twice")
    return name


def _name(what: str, item) -> str:
    """The name of an input or output entry, which the wire carries as UTF-8 (a lone surrogate is not)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        article = "each input needs" if what == "input" else "each requested output needs"
        raise InvalidArgument(f"{article} a 'name', got {str(item)[:200]}")
    name = item["name"]
    if not name.isascii() and not _utf8(name):
        raise InvalidArgument(f"{what} name {ascii(name)[:200]} is not valid UTF-8 (it holds a lone surrogate)")
    return name


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _from_json(name: str, datatype: str, shape: list[int], data) -> np.ndarray:
    if datatype in ("FP16", "BF16"):
        raise InvalidArgument(f"input '{name}': receiving {datatype} data via JSON is not supported")
    dtype = numpy_dtype(datatype)
    count = math.prod(shape)
    if type(data) is Doubles:  # FP32 or FP64 numbers read by simdjson, flattened
        if data.values.size != count:
            raise InvalidArgument(f"input '{name}': {data.values.size} values of data for shape {shape}")
        with np.errstate(over="ignore"):  # past float32's range is infinity, as for Python floats
            return data.values.astype(dtype).reshape(shape)
    if count >= NUMERIC_MIN and dtype.kind in "iuf":
        arr = _numeric(dtype, count, data)
        if arr is not None:
            return arr.reshape(shape)
    elif dtype.kind == "f" and type(data) is list and len(data) == count and set(map(type, data)) == _FLOATS:
        # flat floats only: each converted to the dtype as _checked's float64 array is (ints are not: numpy
        # would round a large one to float32 at once, not through a double)
        if dtype.itemsize < 8 and not -F32_MAX <= min(data) <= max(data) <= F32_MAX:
            with np.errstate(over="ignore"):
                return np.array(data, dtype).reshape(shape)
        return np.array(data, dtype).reshape(shape)
    return _checked(name, datatype, dtype, shape, count, data)


def _numeric(dtype: np.dtype, count: int, data) -> np.ndarray | None:
    """Numbers flattened and converted in C calls, where that gives the array ``_checked`` makes of them;
    None where it may not (data not a list, ragged or too deep, a string, null or bool among the numbers,
    a float among integers, a value out of range, the wrong count): ``_checked`` then decides and names
    what is wrong. No numpy call sees the data before ``sum`` has found only numbers in it (numpy would
    read a string as a number, or size a string array by the longest one)."""
    if type(data) is not list:
        return None
    flat = data
    for _ in range(MAX_NESTING - 1):
        if not flat or type(flat[0]) is not list:
            break
        if set(map(type, flat)) != _LISTS:  # chain would pass over an empty string or object in a row
            return None
        flat = list(chain.from_iterable(flat))
    else:
        return None
    if len(flat) != count:
        return None
    try:
        total = sum(flat)  # TypeError for anything but int, float and bool
        if dtype.kind != "f" and (type(total) is not int or not _in_range(dtype, flat)):
            return None
        # each value to a double, then to the dtype (as _checked's float64 array cast; past float32's range
        # is infinity); an integer past a double's range is an OverflowError. An integer past an integer
        # dtype's range must be refused before: numpy 1.x's fromiter wraps it with only a warning
        with np.errstate(over="ignore"):
            arr = np.fromiter(flat, dtype, count)  # np.array's conversion without its shape discovery
    except (TypeError, OverflowError):
        return None
    return None if _may_hold_bool(arr, flat) else arr



def _in_range(dtype: np.dtype, flat: list) -> bool:
    """Whether every integer fits the integer dtype (numpy 1.x's fromiter wraps one that does not)."""
    info = np.iinfo(dtype)
    return not flat or info.min <= min(flat) and max(flat) <= info.max


def _may_hold_bool(arr: np.ndarray, flat: list) -> bool:
    """Whether an element that numpy read as 0 or 1 was a bool: only those are looked at, unless they are
    many (then every element's type, in one C-speed pass, costs less than picking them out)."""
    mask = (arr == 0) | (arr == 1)
    suspects = int(np.count_nonzero(mask))
    if suspects > arr.size // 8:
        return bool in set(map(type, flat))
    return suspects > 0 and bool in set(map(type, map(flat.__getitem__, np.flatnonzero(mask).tolist())))


def _checked(name: str, datatype: str, dtype: np.dtype, shape: list[int], count: int, data) -> np.ndarray:
    """Tensor data flattened in Python, each element's kind checked: what is wrong is named."""
    flat, kinds = _flatten(name, data)  # kinds: the element types, seen at C speed before numpy builds anything
    if len(flat) != count:
        raise InvalidArgument(f"input '{name}': {len(flat)} values of data for shape {shape}")
    if datatype == "BYTES":
        if not kinds <= {str}:
            raise InvalidArgument(f"input '{name}': BYTES data in JSON must be strings")
        try:
            encoded = [d.encode("utf-8") for d in flat]
        except UnicodeEncodeError:
            raise InvalidArgument(f"input '{name}': BYTES data must be valid UTF-8 text; a string holds a lone "
                                  f"surrogate") from None
        return np.array(encoded, dtype=object).reshape(shape)
    if datatype == "BOOL":
        if not kinds <= {bool}:
            raise InvalidArgument(f"input '{name}': BOOL data must be true or false")
        return np.array(flat, dtype=np.bool_).reshape(shape)
    if datatype in _INT_KINDS:
        if not kinds <= {int}:
            raise InvalidArgument(f"input '{name}': {datatype} data must be integers")
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            bad = next(v for v in flat if v < info.min or v > info.max)
            raise InvalidArgument(f"input '{name}': value {bad} is out of range for {datatype} "
                                  f"[{info.min}, {info.max}]")
        return np.array(flat, dtype=dtype).reshape(shape)
    if not kinds <= _NUMBERS:
        raise InvalidArgument(f"input '{name}': {datatype} data must be numbers")
    try:
        arr = np.array(flat, dtype=np.float64)
    except OverflowError:
        raise InvalidArgument(f"input '{name}': a value is out of range for {datatype}") from None
    # past float32's range is infinity, without a warning (entering errstate costs 2-3 us: only then)
    if dtype.itemsize < 8 and flat and not -F32_MAX <= min(flat) <= max(flat) <= F32_MAX:
        with np.errstate(over="ignore"):
            return arr.astype(dtype).reshape(shape)
    return arr.astype(dtype).reshape(shape)


def _flatten(name: str, data) -> tuple[list, set]:
    """Tensor data given flat or nested row by row -> one flat list and the types of its elements, level by
    level (no recursion)."""
    flat = data if isinstance(data, list) else [data]
    for _ in range(MAX_NESTING):
        kinds = set(map(type, flat))
        if list not in kinds:
            return flat, kinds
        flat = [x for item in flat for x in (item if isinstance(item, list) else (item,))]
    raise InvalidArgument(f"input '{name}': data is nested more than {MAX_NESTING} levels deep")


def _param_int(what: str, params: dict, key: str, default: int | None = None) -> int | None:
    value = params.get(key, default)
    if value is None and default is None:
        return None
    return request_parameters.non_negative_int(key, value, MAX_INT64, what)


def _param_bool(what: str, params: dict, key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what}: '{key}' must be a bool (true or false), got {value!r}")
    return value


def _params(what: str, item: dict) -> dict:
    p = item.get("parameters")
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise InvalidArgument(f"{what}: 'parameters' must be an object")
    return p


def _region_name(what: str, params: dict) -> str:
    region = params["shared_memory_region"]
    if not isinstance(region, str) or not region:
        raise InvalidArgument(f"{what}: 'shared_memory_region' must be a region name, got {region!r}")
    return region


# orjson before 3.9 had no nesting limit and overflowed the C stack somewhere past 10^5 levels (later ones refuse
# past 1,024): a document with no more brackets than this cannot nest deeper, and one with more goes to the json module
ORJSON_MAX_BRACKETS = 1024


def load_header(raw, exact: bool = False) -> dict:
    """The JSON header of a request as an object; InvalidArgument for anything else.

    orjson reads it where it can (several times faster than the json module); what it refuses goes to
    the json module, which reads what it always read (NaN and Infinity literals, lone surrogates) and
    names what is wrong as before. ``exact``: the json module only, which also keeps an integer past 64
    bits an integer (orjson reads it as a float)."""
    raw = raw if isinstance(raw, bytes) else bytes(raw)
    if exact or len(raw) > ORJSON_MAX_BRACKETS and openings(raw) > ORJSON_MAX_BRACKETS:
        header = _load_json(raw)
    else:
        try:
            header = orjson.loads(raw)
        except orjson.JSONDecodeError:
            header = _load_json(raw)
    if not isinstance(header, dict):
        raise InvalidArgument("the request JSON must be an object")
    return header


def _load_json(raw) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"failed to parse the request JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("failed to parse the request JSON: it is nested too deeply") from None


def header_length(body, header_length: str | None) -> int:
    if header_length is None:
        return len(body)
    try:
        if not (header_length.isascii() and header_length.isdigit()):  # int() takes " 13 ", "1_0" and other digits
            raise ValueError
        hlen = int(header_length)
    except ValueError:
        raise InvalidArgument(f"{HEADER_LENGTH} must be an integer, got "
                              f"'{header_length[:MAX_KEY_SHOWN]}'") from None
    if hlen < 0 or hlen > len(body):
        raise InvalidArgument(f"{HEADER_LENGTH} {hlen} does not fit the {len(body)}-byte body")
    return hlen


def is_raw(hlen: int, header_length_text: str | None) -> bool:
    """Whether a body is Triton's raw binary request: an Inference-Header-Content-Length of 0, no JSON at all."""
    return hlen == 0 and header_length_text is not None


def raw_request(config: Mapping, body: bytes, model: str) -> InferRequest:
    """Triton's raw binary request (Inference-Header-Content-Length: 0, no JSON): ``body`` is the bytes of the
    model's one input, its shape deduced from ``config`` (the model's rendered config) as Triton's
    infer_request.cc deduces it: batch 1 for a batching model, its one variable dimension from the body's
    size; a BYTES input's shape must hold one element, the body. Every output comes back binary."""
    specs = config.get("input") or []
    if len(specs) != 1:
        raise InvalidArgument(f"Raw request must only have 1 input (found 1) to be deduced but got {len(specs)} "
                              f"inputs in '{model}' model configuration")
    name, dims = specs[0]["name"], [int(d) for d in specs[0].get("dims", [])]
    datatype = str(specs[0]["data_type"]).removeprefix("TYPE_")
    datatype = "BYTES" if datatype == "STRING" else datatype
    variable = [i for i, d in enumerate(dims) if d == -1]
    if len(variable) > 1:
        raise InvalidArgument(f"The shape of the raw input '{name}' can not be deduced because there are more than "
                              f"one variable-sized dimension")
    batch = [1] if int(config.get("max_batch_size", 0)) > 0 else []
    count = math.prod(d for d in dims if d != -1)
    if datatype == dtypes.BYTES:
        if variable or count != 1:
            raise InvalidArgument("For BYTE datatype raw input, the model must have input shape [1]")
        data = np.empty(1, dtype=object)
        data[0] = bytes(body)
        return InferRequest({name: data.reshape(batch + dims)}, None, True)
    dtype = numpy_dtype(datatype)
    if variable:
        dims[variable[0]] = len(body) // (count * dtype.itemsize) if count else 0
    shape = batch + dims
    if math.prod(shape) * dtype.itemsize != len(body) or len(shape) > MAX_DIMS:  # (Python's product: exact)
        raise InvalidArgument(f"input '{name}': the raw request's {len(body)} bytes do not make a {datatype} tensor "
                              f"of shape {shape}")
    try:
        return InferRequest({name: np.frombuffer(body, dtype).reshape(shape)}, None, True)
    except ValueError:  # a shape numpy cannot hold (dims past its index type, whose product is 0 bytes)
        raise InvalidArgument(f"input '{name}': the shape {shape} the model's config gives cannot be made") from None


def parse_request(body: bytes, header_length_text: str | None, regions=None, max_json: int | None = None,
                  max_input: int | None = None) -> InferRequest:
    """A request body -> numpy inputs and what to return; InvalidArgument names whatever is wrong.
    ``regions(name, offset, size, limit) -> bytes`` resolves system shared-memory inputs (at most
    ``limit`` bytes); ``max_json`` bounds the JSON header, ``max_input`` the bytes of any one input.

    A body refused as orjson read it is read again by the json module alone, so that what the caller
    hears is what the json module's reading makes of it (an integer past 64 bits out of range, not a
    float where an integer belongs)."""
    hlen = header_length(body, header_length_text)
    if max_json is not None and hlen > max_json:
        raise JSONTooLarge(json_too_large(hlen, max_json))
    raw = body if hlen == len(body) and isinstance(body, bytes) else bytes(memoryview(body)[:hlen])  # copied once
    header = jsonfast.load(raw, MAX_NESTING) if hlen >= FAST_MIN_BYTES else None
    if header is None:
        header = load_header(raw)
    try:
        return _parse(body, hlen, header, regions, max_input)
    except InvalidArgument:
        exact = load_header(raw, exact=True)
    return _parse(body, hlen, exact, regions, max_input)


def _parse(body: bytes, hlen: int, header: dict, regions, max_input: int | None) -> InferRequest:
    if not isinstance(header.get("inputs"), list):
        raise InvalidArgument("the request JSON must be an object with an 'inputs' list")
    params = _params("the request", header)
    checked = request_parameters.check(params, request_parameters.HTTP)
    if header.get("id") is not None and not isinstance(header["id"], str):
        raise InvalidArgument("'id' must be a string")
    limit = len(body) if max_input is None else max_input
    blob = None  # the binary data after the header, looked at only when an input says it is there
    pos = 0
    inputs: dict[str, np.ndarray] = {}
    for item in header["inputs"]:
        name = unique("input", _name("input", item), inputs)
        datatype = item.get("datatype")
        numpy_dtype(datatype)
        shape = _shape(name, item.get("shape"), datatype, max_input)
        p = {} if item.get("parameters") is None else _params(f"input '{name}'", item)
        sent = next((k for k in ("shared_memory_region", "binary_data_size") if k in p), None) if p else None
        if sent is not None and item.get("data") is not None:  # clients may write an unset field as null
            raise InvalidArgument(f"input '{name}': 'data' and '{sent}' are both given; send the tensor one way")
        if "shared_memory_region" in p:
            if regions is None:
                raise InvalidArgument("system shared memory is not available here")
            what = f"input '{name}'"
            size = _param_int(what, p, "shared_memory_byte_size")
            want = expected_bytes(datatype, shape)
            if want is not None and size is not None and size != want:
                raise InvalidArgument(f"{what}: shared_memory_byte_size {size}, but shape {shape} of {datatype} "
                                      f"needs {want}")
            buf = regions(_region_name(what, p), _param_int(what, p, "shared_memory_offset", 0),
                          size if size is not None else want, limit)
            inputs[name] = tensor_from_bytes(name, datatype, shape, buf)
        elif "binary_data_size" in p:
            if blob is None:
                blob = memoryview(body)[hlen:]
            size = p["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or pos + size > len(blob):
                raise InvalidArgument(f"input '{name}': binary_data_size {size!r} runs past the "
                                      f"{len(blob)} bytes of binary data")
            inputs[name] = tensor_from_bytes(name, datatype, shape, blob[pos:pos + size])
            pos += size
        elif "data" in item:
            inputs[name] = _from_json(name, datatype, shape, item["data"])
        else:
            raise InvalidArgument(f"input '{name}' has no data, binary_data_size or shared_memory_region")
    if pos != len(body) - hlen:
        raise InvalidArgument(f"{len(body) - hlen - pos} bytes of binary data are not claimed by any input")
    binary_output = checked.binary_data_output
    outputs = None
    if header.get("outputs") is not None:
        if not isinstance(header["outputs"], list):
            raise InvalidArgument("'outputs' must be a list")
        outputs = []
        seen: set[str] = set()
        for o in header["outputs"]:
            name = unique("output", _name("output", o), seen)
            seen.add(name)
            what = f"output '{name}'"
            op = _params(what, o)
            unknown = next((k for k in op if k not in OUTPUT_KEYS), None)
            if unknown is not None:
                raise InvalidArgument(f"{what}: parameter '{str(unknown)[:MAX_KEY_SHOWN]}' is not supported by "
                                      f"gepool (supported: {', '.join(OUTPUT_KEYS)})")
            region = _region_name(what, op) if "shared_memory_region" in op else None
            outputs.append(OutputRequest(
                name, _param_bool(what, op, "binary_data", binary_output), region,
                _param_int(what, op, "shared_memory_byte_size", 0), _param_int(what, op, "shared_memory_offset", 0),
                _param_int(what, op, "classification", 0)))
    return InferRequest(inputs, outputs, binary_output, header.get("id"), params, checked.priority, checked.timeout_s)


class FixedHeaders(dict):
    """Response headers made once and shared by every answer that has them (read-only); ``lines``: their text
    in a response head, written as it is."""

    __slots__ = ("lines",)

    def __init__(self, headers: dict[str, str]) -> None:
        names = {k.lower() for k in headers}
        if "content-type" not in names or names & {"content-length", "transfer-encoding", "connection", "date",
                                                   "server"}:
            raise ValueError(f"fixed headers name their Content-Type and none the server writes: {headers}")
        super().__init__(headers)
        self.lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")

    def _read_only(self, *args, **kwargs):
        raise TypeError("these headers are shared: copy them to change them")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _read_only


JSON_HEADERS = FixedHeaders({"Content-Type": "application/json"})
MAX_ANSWER_HEADS = 256  # the most answer texts (less their data) kept; past it the book starts again
_answer_heads: dict[tuple, bytes] = {}
_binary_heads: dict[tuple, tuple] = {}  # (header, its headers, (the last id, its header, their headers) or None)


def encode_response(model: str, version: str, req: InferRequest, outputs: dict[str, np.ndarray],
                    write_region=None) -> tuple[bytes, Mapping[str, str]]:
    """Outputs -> (body, headers). ``write_region(name, offset, size, data)`` writes shared-memory outputs.

    Binary outputs travel as views of the output arrays, joined once into the body. JSON is written by
    orjson: floats as the doubles the json module wrote (the shortest text that reads back as the same
    double; only the spelling may differ, as 1e-7 for 1e-07), so every client reads the
    same numbers as before. orjson writes NaN and infinities as null, which nothing else in a response
    is: a text with null in it is written again by the json module (NaN, Infinity, as before)."""
    if len(outputs) == 1:
        answer = _one_json(model, version, req, outputs)
        if answer is not None:
            return answer, JSON_HEADERS
        answer = _one_binary(model, version, req, outputs)
        if answer is not None:
            return answer
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
            data = raw if raw is not None else _raw_view(arr)
            entry["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        elif datatype == "BYTES":
            entry["data"] = [b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b) for b in arr.ravel()]
        elif arr.size < NUMPY_JSON_MIN:
            entry["data"] = arr.ravel().tolist()
        elif arr.dtype.kind == "f":
            entry["data"] = np.ascontiguousarray(arr, dtype=np.float64).ravel()  # widened exactly, as tolist()
        else:
            entry["data"] = np.ascontiguousarray(arr).ravel()
        entries.append(entry)
    body = {"model_name": model, "model_version": version, "outputs": entries}
    if req.id is not None:
        body["id"] = req.id
    header = _dumps(body)
    if header is None or _holds_null(header):
        header = _dumps_json(body)
    if not blobs:
        return header, JSON_HEADERS
    return b"".join([header, *blobs]), _binary_headers(len(header))


# below this many elements a list is written sooner than orjson sets up a numpy array
NUMPY_JSON_MIN = 128


def _one_json(model: str, version: str, req: InferRequest, outputs: dict[str, np.ndarray]) -> bytes | None:
    """The answer ``encode_response`` gives, sooner, for the common one: one numeric output in JSON. The text
    around its data is written once for each model, version, output and shape, as the full path writes it; the
    data, and an id, as the full path writes them (the id last). None where the full path is needed."""
    alone = _one_output(model, version, req, outputs, False, _JSON_DATATYPES)
    if alone is None:
        return None
    end = _id_end(req.id)
    if end is None:
        return None
    name, arr, datatype = alone
    key = (model, version, name, datatype, arr.shape)
    head = _answer_heads.get(key)
    if head is None:
        text = _dumps({"model_name": model, "model_version": version,
                       "outputs": [{"name": name, "datatype": datatype, "shape": list(arr.shape), "data": None}]})
        if text is None or not text.endswith(_NULL_END) or b"null" in text[:-len(_NULL_END)]:
            return None  # (the full path writes such a text with the json module)
        if len(_answer_heads) >= MAX_ANSWER_HEADS:
            _answer_heads.clear()
        head = _answer_heads[key] = text[:-len(_NULL_END)]
    if arr.size < NUMPY_JSON_MIN:
        data = orjson.dumps(arr.ravel().tolist())
    elif arr.dtype.kind == "f":
        data = orjson.dumps(np.ascontiguousarray(arr, dtype=np.float64).ravel(), option=orjson.OPT_SERIALIZE_NUMPY)
    else:
        data = orjson.dumps(np.ascontiguousarray(arr).ravel(), option=orjson.OPT_SERIALIZE_NUMPY)
    if _holds_null(data):
        return None
    return b"".join((head, data, end))


def _id_end(request_id: str | None) -> bytes | None:
    """What follows an answer's outputs, as the full path writes it (the id its last key); None where the full
    path writes it otherwise (a text holding null goes through the json module, as does what orjson refuses)."""
    global _last_end
    if request_id is None:
        return _END
    last = _last_end  # (one read: another thread may set it meanwhile)
    if last[0] == request_id:
        return last[1]
    try:
        text = orjson.dumps(request_id)
    except orjson.JSONEncodeError:  # (a lone surrogate)
        return None
    end = None if b"null" in text else b"".join((_ID_KEY, text, b"}"))
    if len(request_id) <= MAX_KEPT_ID:
        _last_end = (request_id, end)
    return end


def _one_binary(model: str, version: str, req: InferRequest, outputs: dict[str, np.ndarray]) \
        -> tuple[bytes, FixedHeaders] | None:
    """The answer ``encode_response`` gives, sooner, for one fixed-size output as binary data: its JSON header is
    written once for each model, version, output, datatype and shape, and an id added as the full path adds it.
    None where the full path is needed."""
    alone = _one_output(model, version, req, outputs, True, _BINARY_DATATYPES)
    if alone is None:
        return None
    end = _id_end(req.id)
    if end is None:
        return None
    name, arr, datatype = alone
    key = (model, version, name, datatype, arr.shape)
    known = _binary_heads.get(key)
    if known is None:
        header = _dumps({"model_name": model, "model_version": version, "outputs": [
            {"name": name, "datatype": datatype, "shape": list(arr.shape),
             "parameters": {"binary_data_size": arr.nbytes}}]})
        if header is None or b"null" in header:
            return None  # (the full path writes such a text with the json module)
        if len(_binary_heads) >= MAX_ANSWER_HEADS:
            _binary_heads.clear()
        known = _binary_heads[key] = (header, _binary_headers(len(header)), None)
    header, headers, last = known
    if req.id is not None:
        if last is not None and last[0] == req.id:  # a client's id again (perf_analyzer's is always "")
            _, header, headers = last
        else:  # (the header's closing '}]}' becomes '}]' and the id's end)
            header = b"".join((header[:-1], end[len(_END) - 1:]))
            headers = _binary_headers(len(header))
            _binary_heads[key] = (known[0], known[1], (req.id, header, headers))
    return b"".join([header, _raw_view(arr)]), headers


def _one_output(model: str, version: str, req: InferRequest, outputs: dict[str, np.ndarray], binary: bool,
                datatypes: dict) -> tuple[str, np.ndarray, str] | None:
    """The one output of an answer, its array and datatype, where it is asked for as ``binary`` says (in JSON or
    as binary data), nowhere else, and its dtype is one of ``datatypes``; else None."""
    ((name, arr),) = outputs.items()
    wanted = req.outputs
    if wanted is None:
        if req.binary_output != binary:
            return None
    elif len(wanted) != 1 or (o := wanted[0]).name != name or o.binary != binary or o.region is not None \
            or o.class_count:
        return None
    datatype = datatypes.get(arr.dtype)
    if datatype is None or type(model) is not str or type(version) is not str or type(name) is not str:
        return None
    return name, arr, datatype


def _binary_headers(header_length: int) -> FixedHeaders:
    """A binary answer's headers, made once for each length of its JSON header."""
    headers = _BINARY_HEADERS.get(header_length)
    if headers is None:
        if len(_BINARY_HEADERS) >= MAX_ANSWER_HEADS:
            _BINARY_HEADERS.clear()
        headers = _BINARY_HEADERS[header_length] = FixedHeaders(
            {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(header_length)})
    return headers


_BINARY_HEADERS: dict[int, FixedHeaders] = {}
_NULL_END = b"null}]}"
_END = b"}]}"
_ID_KEY = b'}],"id":'
MAX_KEPT_ID = 256  # the last id's end is kept for the next answer (a client's id again) up to this length
_last_end: tuple[str | None, bytes | None] = (None, _END)
# the numeric types orjson writes as the full path does (bool and float16 aside: a bool array, and float16
# through tolist, are written alike too, but are not worth a second path)
_JSON_DATATYPES = {np.dtype(t): dtypes.from_numpy(np.dtype(t)) for t in (
    np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)}
_BINARY_DATATYPES = {np.dtype(t): dtypes.from_numpy(np.dtype(t)) for t in (
    np.bool_, np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64)}


SCAN_MIN = 2048  # bytes of text from which skipping to each rare byte beats searching the whole text
SCAN_HITS = 32  # rare bytes looked at one by one before the rest of a text is searched as a whole


def holds(text: bytes, needle: bytes, anchor: int, end: int | None = None) -> bool:
    """``needle in text[:end]``, sooner where ``needle[anchor]`` is a byte the text seldom holds: memchr passes
    over the rest to the next such byte (an answer is mostly digits, a request body mostly its data) where the
    substring search looks at every byte. A short text is searched at once."""
    if end is None:
        end = len(text)
    if end < SCAN_MIN:
        return text.find(needle, 0, end) >= 0
    rare = needle[anchor:anchor + 1]
    pos = text.find(rare, anchor, end)
    for _ in range(SCAN_HITS):
        if pos < 0:
            return False
        if text.startswith(needle, pos - anchor, end):
            return True
        pos = text.find(rare, pos + 1, end)
    # (every place before this one's was looked at: what is left starts here at the soonest)
    return pos >= 0 and text.find(needle, pos - anchor, end) >= 0


def _holds_null(text: bytes) -> bool:
    return holds(text, b"null", 0)


def _raw_view(arr: np.ndarray) -> memoryview:
    """The tensor's bytes without a copy where it is contiguous already (the view keeps ``arr`` alive)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _dumps(body: dict) -> bytes | None:
    """orjson's text of a response, or None for what it cannot write as the json module would (a str that is
    not valid UTF-8: a lone surrogate from a decoded name, say)."""
    try:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError:
        return None


def _dumps_json(body: dict) -> bytes:
    for entry in body["outputs"]:
        if isinstance(entry.get("data"), np.ndarray):
            entry["data"] = entry["data"].tolist()
    return json.dumps(body, separators=(",", ":")).encode()
