"""Request headers read by simdjson (gepool/http/jsonfast.py) against orjson's reading of the same bodies: the
same inputs, dtypes, shapes and bytes, or the same refusal, for every datatype, nesting and hostile text."""

import json
import math
from unittest import mock

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gepool.common.errors import GepoolError
from gepool.http import jsonfast, kserve
from tests.test_kserve_fast import FLOAT_EDGES, INT_EDGES, JSON_TYPES, tensors

PAD = "p" * jsonfast.FAST_MIN_BYTES  # an id that puts any body past the fast path's threshold


def outcome(body: bytes, fast: bool):
    """What parse_request makes of a body with the simdjson reading on or off."""
    calls = []
    real = jsonfast.load

    def load(raw, max_openings):
        header = real(raw, max_openings)
        calls.append(header is not None)
        return header

    with mock.patch.object(kserve, "FAST_MIN_BYTES", 0 if fast else 1 << 60), \
            mock.patch.object(jsonfast, "load", load):
        try:
            req = kserve.parse_request(body, None)
        except GepoolError as exc:
            result = ("refused", type(exc).__name__, exc.message)
        else:
            result = ("parsed", req.id, req.parameters, [vars(o) for o in req.outputs or []],
                      {n: (a.dtype.str, a.shape, a.tolist() if a.dtype == object else a.tobytes())
                       for n, a in req.inputs.items()})
    return result, any(calls)


def same(body: bytes) -> tuple:
    want, _ = outcome(body, fast=False)
    got, took = outcome(body, fast=True)
    assert got == want, body[:300]
    return got, took


def body_of(inputs: list, **rest) -> bytes:
    return json.dumps({"id": PAD, "inputs": inputs, **rest}).encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=tensors(), datatype=st.sampled_from(JSON_TYPES), shape_kind=st.sampled_from(["leaves", "flat", "random"]),
       random_shape=st.lists(st.integers(0, 5), max_size=3))
def test_any_data_in_a_body_parses_as_orjson_reads_it(data, datatype, shape_kind, random_shape):
    def leaves(d):
        return sum(leaves(x) for x in d) if isinstance(d, list) else 1

    n = leaves(data)
    shape = {"leaves": [n], "flat": [1, n], "random": random_shape}[shape_kind]
    same(body_of([{"name": "X", "datatype": datatype, "shape": shape, "data": data}]))


@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
@pytest.mark.parametrize("values", [FLOAT_EDGES, INT_EDGES[:-1], [2**53 + 1, 2**63 + 1, 2**64 - 1, -2**63 - 1]],
                         ids=["floats", "ints", "big ints"])
def test_the_edges_of_float_data_read_the_same_doubles(datatype, values):
    flat, took = same(body_of([{"name": "X", "datatype": datatype, "shape": [len(values)], "data": values}]))
    nested, _ = same(body_of([{"name": "X", "datatype": datatype, "shape": [1, len(values)], "data": [values]}]))
    assert flat[0] == nested[0] == "parsed" and flat[4]["X"][2] == nested[4]["X"][2]
    # simdjson refuses NaN and Infinity (orjson too: the json module reads them) and integers past 64 bits
    readable = all(math.isfinite(v) if isinstance(v, float) else -2**63 <= v < 2**64 for v in values)
    assert took == readable


@pytest.mark.parametrize("text", [
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 2], "data": [3, 4]}]}',
    '{"id": "%s", "inputs": [], "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "datatype": "FP64", "shape": [1], "data": [1.1]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}], '
    '"parameters": {"priority": 1, "priority": 2}}',
    '\ufeff{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}]}',
    ' {"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}]}',
    '{"id": "%s", "inputs": [{"name": "X\\ud800", "datatype": "FP32", "shape": [1], "data": [1]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, NaN]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 1e400]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 123456789012345678901234]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, true]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, null]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, "2"]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, {"a": 2}]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [3], "data": [[], [[1, 2]], 3]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [3], "data": [1, 2]}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": 5}]}',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}]} trailing',
    '{"id": "%s", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}]',
    '{"id": "%s", "inputs": {"name": "X"}}',
    '{"id": "%s", "inputs": ["X"]}',
    '["%s"]',
], ids=["data twice", "inputs twice", "datatype twice", "nested key twice", "byte-order mark", "leading space",
        "lone surrogate", "NaN", "past a double", "past 64 bits", "bool", "null", "string", "object",
        "hidden nesting", "short", "scalar", "trailing text", "unclosed", "inputs an object", "input a string",
        "not an object"])
def test_hostile_texts_read_as_orjson_reads_them(text):
    same((text % PAD).encode())


@pytest.mark.parametrize("depth", [28, 29, 30, 31, 32, 33, 40])
def test_nesting_is_refused_past_the_limit_as_before(depth):
    data = "[" * depth + "1" + "]" * depth
    got, took = same(f'{{"id": "{PAD}", "inputs": [{{"name": "X", "datatype": "FP32", "shape": [1], "data": {data}}}]}}'
                     .encode())
    assert got[0] == ("parsed" if depth <= kserve.MAX_NESTING else "refused")
    assert took == (depth + 4 <= kserve.MAX_NESTING)  # the body's "{", "[" of inputs, "{" of the input, "[" of shape


def test_a_float_body_takes_the_fast_path_and_an_int_body_keeps_its_integers():
    """The reading is used (else every test above would pass with it switched off), and only float data
    becomes doubles: an INT64 past 2**53 keeps its exact value."""
    x = np.random.default_rng(3).random(1024).astype(np.float32)
    body = orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1024], "data": x.tolist()}]})
    assert len(body) >= jsonfast.FAST_MIN_BYTES
    header = jsonfast.load(body, kserve.MAX_NESTING)
    assert type(header["inputs"][0]["data"]) is jsonfast.Doubles
    (got, took), req = same(body), kserve.parse_request(body, None)
    assert took and got[0] == "parsed" and req.inputs["X"].tobytes() == x.reshape(1, 1024).tobytes()
    big = [2**53 + 1, 2**63 - 1] * 200
    body = body_of([{"name": "X", "datatype": "INT64", "shape": [len(big)], "data": big}])
    assert type(jsonfast.load(body, kserve.MAX_NESTING)["inputs"][0]["data"]) is list
    assert kserve.parse_request(body, None).inputs["X"].tolist() == big


def test_a_thread_keeps_no_parser_sized_for_a_large_document():
    """A parser kept per thread keeps the buffers of the largest document it read: past KEEP_PARSER_BYTES the
    document gets a parser of its own, dropped with it."""
    import threading

    kept = {}

    def parse(body: bytes) -> None:
        kserve.parse_request(body, None)
        kept[len(body)] = getattr(jsonfast._local, "parser", None)

    small = orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [512], "data": [0.5] * 512}]})
    large = orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [40_000], "data": [0.5] * 40_000}]})
    assert len(small) <= jsonfast.KEEP_PARSER_BYTES < len(large)
    for body in (small, large):
        thread = threading.Thread(target=parse, args=(body,))
        thread.start()
        thread.join()
    assert kept[len(small)] is not None and kept[len(large)] is None
