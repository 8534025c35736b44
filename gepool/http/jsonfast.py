"""Request headers read by simdjson, each float input's JSON data parsed straight into doubles.

orjson makes a Python float of every number and numpy then reads them one by one; simdjson writes a
flat array of numbers into a buffer in C. A header is read here only where that reading cannot differ
from orjson's: anything simdjson refuses, a repeated key where this module looks keys up (orjson keeps
the last, simdjson's lookup finds the first), or brackets enough to nest data past ``kserve.MAX_NESTING``
all go back to the caller's usual reading, as does a text that does not start with '{' (rare: whitespace
or a byte-order mark first). Nested data is flattened in order, as ``kserve._flatten`` does.
"""

import threading

import numpy as np
import simdjson

# a parser per thread, kept for documents up to KEEP_PARSER_BYTES: a new one allocates its buffers for every
# document, but a kept one keeps the buffers of the largest it read (about 15 bytes per byte of text). No
# proxy of a document outlives load(), so the next parse may reuse them (simdjson refuses it, RuntimeError,
# while one does)
_local = threading.local()
KEEP_PARSER_BYTES = 64 << 10
FAST_MIN_BYTES = 1024  # below this, walking simdjson's proxies costs more than orjson's whole parse
FLOAT_DATATYPES = ("FP32", "FP64")  # data read as doubles gives these dtypes exactly what Python floats give


class Doubles:
    """An input's JSON data, every number flattened to a double (ints too, as Python's float() would)."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values


def load(raw: bytes, max_openings: int) -> dict | None:
    """The header as orjson would read it, except that a float input's numeric data is ``Doubles``; None
    where this reading might differ (the caller then reads it as usual). ``max_openings``: the most '['
    and '{' the text may hold (a bound on how deep its data can nest)."""
    if raw[:1] != b"{" or openings(raw) > max_openings:
        return None
    try:
        doc = _parser(len(raw)).parse(raw)
        if not isinstance(doc, simdjson.Object):
            return None
        header = _fields(doc, "inputs")
        if "inputs" in header:
            inputs = doc["inputs"]
            header["inputs"] = [_input(item) for item in inputs] if isinstance(inputs, simdjson.Array) \
                else _plain(inputs)
        return header
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError):  # simdjson's refusals, a repeated key
        return None


def doubles(text: bytes) -> Doubles | None:
    """A flat JSON list of numbers as ``load`` reads an input's data, or None (not such a list, or refused)."""
    try:
        doc = _parser(len(text)).parse(text)
        if not isinstance(doc, simdjson.Array):
            return None
        return Doubles(np.frombuffer(doc.as_buffer(of_type="d"), np.float64))
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError):
        return None


def _parser(size: int) -> "simdjson.Parser":
    """This thread's kept parser for a text of ``size`` bytes; a new one for a longer text."""
    if size > KEEP_PARSER_BYTES:
        return simdjson.Parser()
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    return parser


def _fields(obj: "simdjson.Object", skip: str) -> dict:
    """An object's fields as Python objects, except ``skip`` (present as None until the caller reads it)."""
    keys = list(obj.keys())
    if len(set(keys)) != len(keys):  # looked up by key below, which finds the first of them
        raise KeyError("a repeated key")
    return {key: None if key == skip else _plain(obj[key]) for key in keys}


def _input(item) -> object:
    if not isinstance(item, simdjson.Object):
        return _plain(item)
    out = _fields(item, "data")
    if "data" in out:
        data = item["data"]
        if isinstance(data, simdjson.Array) and out.get("datatype") in FLOAT_DATATYPES:
            try:
                out["data"] = Doubles(np.frombuffer(data.as_buffer(of_type="d"), np.float64))
            except TypeError:  # not only numbers (a bool, null, a string, an object): read as orjson would
                out["data"] = _plain(data)
        else:
            out["data"] = _plain(data)
    return out


def _plain(value) -> object:
    """A value as Python objects; as orjson, a repeated key inside keeps its last value."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def openings(raw: bytes) -> int:
    """How many '[' and '{' a text holds (numpy compares a byte at a time in vector code: bytes.count
    does not). They differ in one bit, 0x20, which no other byte sets to make 0x7B."""
    return int(np.count_nonzero((np.frombuffer(raw, np.uint8) | 0x20) == 0x7B))
