"""kserve's C-speed paths (numeric JSON data read in C calls, the answer's null scan) against the implementation
they replace (tests/kserve_prev.py), on random nested data of every kind and on the cases that must be refused."""

import dataclasses
import json
import math
import tracemalloc
import warnings
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gepool.common.errors import InvalidArgument
from gepool.http import jsonfast, kserve
from tests import kserve_prev as prev

JSON_TYPES = ["BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64", "FP16", "BF16",
              "FP32", "FP64", "BYTES"]
INT_EDGES = [0, 1, -1, 2, 127, 128, -128, -129, 255, 256, 32767, -32769, 65535, 2**31 - 1, -2**31, 2**32,
             2**53 + 1, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**64 - 1, 2**64, 10**30, -10**30, 10**400]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 5e-324, 3.4028235e38, 3.5e38, 1.7976931348623157e308, math.inf,
               -math.inf, math.nan, 0.1, 16777217.0]


def outcome(parse, datatype: str, shape: list[int], data):
    """What a parse makes of the data: the array's dtype, shape and bytes, or the refusal and its message."""
    try:
        arr = parse("X", datatype, shape, data)
    except InvalidArgument as exc:
        return "refused", exc.message, exc.http_status
    except Exception as exc:  # noqa: BLE001  (the oracle's own failures, e.g. a lone surrogate, must agree too)
        return "raised", type(exc).__name__
    body = arr.tolist() if arr.dtype == object else arr.tobytes()
    return "array", arr.dtype.str, arr.shape, body


def same(datatype: str, shape: list[int], data) -> tuple:
    """The new parse gives what the previous one gave, as it stands and with its numpy path taken from 0
    elements (else the small tensors random data mostly makes would all go the checked way)."""
    want = outcome(prev._from_json, datatype, shape, data)
    got = outcome(kserve._from_json, datatype, shape, data)
    assert got == want, (datatype, shape, data)
    with mock.patch.object(kserve, "NUMERIC_MIN", 0):
        assert outcome(kserve._from_json, datatype, shape, data) == want, ("numpy path", datatype, shape, data)
    return got


def leaves(data) -> int:
    return sum(leaves(d) for d in data) if isinstance(data, list) else 1


numbers = st.one_of(st.floats(), st.sampled_from(FLOAT_EDGES), st.integers(-300, 300), st.sampled_from(INT_EDGES))
anything = st.one_of(numbers, st.booleans(), st.sampled_from(["", "1", "a", "null"]), st.none(),
                     st.just({}), st.just([]), st.just({"a": 1}))
# mostly one kind of leaf (what a client sends), now and then anything else among them
leaf = st.one_of(numbers, numbers, numbers, st.booleans(), anything)


@st.composite
def tensors(draw):
    """Uniformly nested data (rows of equal length) with a leaf of any kind now and then, or ragged data."""
    dims = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    kind = draw(st.sampled_from(["float", "int", "bool", "mixed"]))
    base = {"float": st.one_of(st.floats(), st.sampled_from(FLOAT_EDGES)),
            "int": st.one_of(st.integers(-300, 300), st.sampled_from(INT_EDGES)), "bool": st.booleans(),
            "mixed": leaf}[kind]
    odd = draw(st.floats(0, 1))

    def build(level: int):
        if level == len(dims):
            return draw(anything) if draw(st.floats(0, 1)) < odd * 0.1 else draw(base)
        return [build(level + 1) for _ in range(dims[level])]

    data = build(0)
    if draw(st.booleans()) and isinstance(data, list) and data:  # ragged: one row longer, or a leaf for a row
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.one_of(base, st.lists(base, max_size=3)))
    return data


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=tensors(), datatype=st.sampled_from(JSON_TYPES), shape_kind=st.sampled_from(["leaves", "flat", "random"]),
       random_shape=st.lists(st.integers(0, 5), max_size=3))
def test_json_data_parses_as_before(data, datatype, shape_kind, random_shape):
    """Every datatype, nested or flat, uniform or ragged, any kind of leaf: the same array or the same refusal."""
    n = leaves(data)
    shape = {"leaves": [n], "flat": [1, n], "random": random_shape}[shape_kind]
    same(datatype, shape, data)


@settings(max_examples=500, deadline=None)
@given(data=st.lists(leaf, max_size=40), datatype=st.sampled_from(JSON_TYPES))
def test_flat_data_of_any_leaves_parses_as_before(data, datatype):
    same(datatype, [len(data)], data)


@pytest.mark.parametrize("datatype", ["FP32", "FP64", "INT32", "INT64", "UINT64", "UINT8"])
@pytest.mark.parametrize("data", [
    [1.0, True], [True, 1.0], [0, False, 3], [[1, 2], [True, 4]],  # a bool among numbers, read by numpy as 0 or 1
    [1.0, "2"], ["2", 1], [[1.0], ["2"]],  # a string numpy would read as a number
    [1.0, None], [[1, 2], [3, None]],  # null, which numpy reads as NaN
    [[1, 2], [3]], [[1, 2], 3], [1, [2, 3]], [[1, 2], [3, [4]]],  # ragged rows (refused only for the count)
    [[1, 2], ""], [[1, 2], {}], [[1, 2], []], [[1, 2], "ab"],  # a row that chain would pass over or split
    [1, 2.5], [2.5, 1], [1, math.nan],  # a float among integers
    [1, 300], [-1, 2], [2**63, 1], [1, 2**64], [-2**63 - 1, 0], [1, 10**400], [10**30, 1.5],  # out of range
], ids=repr)
def test_data_that_must_be_refused_or_read_exactly_is_as_before(datatype, data):
    shape = [leaves(data)]
    same(datatype, shape, data)
    same(datatype, [shape[0] + 1], data)  # and with a count the shape does not hold


@pytest.mark.parametrize("datatype", ["FP32", "INT64", "BOOL"])
@pytest.mark.parametrize("depth", [31, 32, 33, 40])
def test_nesting_past_the_limit_is_refused_as_before(datatype, depth):
    data = json.loads("[" * depth + ("true" if datatype == "BOOL" else "1") + "]" * depth)
    got = same(datatype, [1], data)
    assert (got[0] == "array") == (depth <= kserve.MAX_NESTING)


@pytest.mark.parametrize("datatype,values", [
    ("INT64", [-2**63, 2**63 - 1, 0, 1]), ("UINT64", [0, 1, 2**63, 2**64 - 1]), ("INT8", [-128, 127]),
    ("UINT32", [0, 2**32 - 1]), ("FP64", FLOAT_EDGES), ("FP32", FLOAT_EDGES), ("FP32", INT_EDGES[:-1]),
    ("FP64", [2**53 + 1, 2**63 + 1, 2**64 - 1, -2**63 - 1]),
])
def test_edges_of_every_range_read_the_same_values(datatype, values):
    got = same(datatype, [len(values)], values)
    assert got[0] == "array"
    nested = same(datatype, [1, len(values)], [values])
    assert nested[1:3] == (got[1], (1, len(values))) and nested[3] == got[3]


def test_the_numpy_path_reads_what_it_can_read(monkeypatch):
    """From NUMERIC_MIN elements, numbers (nested or flat) take the numpy path; fewer, bools, BYTES and whatever
    is refused take the checked one."""
    calls = []
    real = kserve._checked
    monkeypatch.setattr(kserve, "_checked", lambda *a: calls.append(a[1]) or real(*a))
    n = kserve.NUMERIC_MIN
    kserve._from_json("X", "FP32", [2, n], [[0.5] * n, list(range(n))])
    kserve._from_json("X", "INT64", [n], list(range(n)))
    kserve._from_json("X", "INT8", [n - 1], [0] * (n - 1))
    kserve._from_json("X", "BOOL", [n], [True] * n)
    with pytest.raises(InvalidArgument):
        kserve._from_json("X", "FP32", [n], [1.0] * (n - 1) + [True])
    assert calls == ["INT8", "BOOL", "FP32"]


@pytest.mark.parametrize("datatype", ["FP32", "INT64", "UINT8"])
@pytest.mark.parametrize("zeros_and_ones", [0, 1, 40, 1000])
@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_is_found_among_few_or_many_zeros_and_ones(datatype, zeros_and_ones, flag):
    """Few 0s and 1s: only those are looked at; many (past an eighth): every element's type is."""
    n = 1000
    data = [2 + i % 100 for i in range(n - zeros_and_ones)] + [i % 2 for i in range(zeros_and_ones)]
    assert same(datatype, [n], data)[0] == "array"
    for at in (0, n // 2, n - 1):
        bad = data[:at] + [flag] + data[at + 1:]
        assert same(datatype, [n], bad)[1] == f"input 'X': {datatype} data must be " + (
            "numbers" if datatype == "FP32" else "integers")


def test_strings_among_numbers_are_refused_without_a_string_array():
    """numpy would size a string array by the longest string: one long string and many short ones must not
    allocate (count x longest) before the refusal."""
    data = ["x" * 200_000] + [""] * 200
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument) as exc:
            kserve._from_json("X", "FP32", [len(data)], data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert exc.value.message == "input 'X': FP32 data must be numbers"
    assert peak < 8 << 20, peak  # a <U200000 array of 201 elements would be 160 MB


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("datatype", ["FP32", "FP64", "INT8", "INT32", "INT64", "UINT64", "BOOL", "BYTES"])
def test_whole_bodies_parse_as_before(datatype, nested):
    rng = np.random.default_rng(7)
    if datatype == "BYTES":
        data = ["a", "", "é", "null"] * 6
    elif datatype == "BOOL":
        data = rng.integers(0, 2, 24).astype(bool).tolist()
    elif datatype.startswith("FP"):
        data = rng.standard_normal(24).astype(np.float32).tolist()
    else:
        info = np.iinfo(kserve.numpy_dtype(datatype))
        rest = rng.integers(info.min, info.max, 22, dtype=info.dtype, endpoint=True)
        data = [int(info.min), int(info.max)] + rest.tolist()
    if nested:
        data = np.array(data, dtype=object).reshape(4, 6).tolist()
    body = json.dumps({"id": "r", "inputs": [{"name": "X", "datatype": datatype, "shape": [4, 6], "data": data}],
                       "outputs": [{"name": "Y", "parameters": {"binary_data": True}}]}).encode()
    new, old = kserve.parse_request(body, None), prev.parse_request(body, None)
    assert new.inputs["X"].dtype == old.inputs["X"].dtype and new.inputs["X"].shape == old.inputs["X"].shape == (4, 6)
    assert new.inputs["X"].tolist() == old.inputs["X"].tolist()
    assert new.inputs["X"].tobytes() == old.inputs["X"].tobytes() or datatype == "BYTES"
    assert [vars(o) for o in new.outputs] == [vars(o) for o in old.outputs] and new.id == old.id


# -- answers --------------------------------------------------------------------------------------------------

@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=80).map(lambda b: bytes(b"nulx\\\"9,"[c % 8] for c in b)),
       st.one_of(st.just(0), st.integers(kserve.SCAN_MIN - 80, kserve.SCAN_MIN + 100)), st.integers(0, 120))
def test_the_rare_byte_scan_finds_what_a_substring_search_finds(text, pad, cut):
    # padded past SCAN_MIN (the scan) or not (the plain search), cut short or not: both find what `in` finds
    text = b"9" * pad + text
    end = max(0, len(text) - cut)
    assert kserve._holds_null(text) == (b"null" in text)
    assert kserve.holds(text, b"nul", 1, end) == (b"nul" in text[:end])
    assert kserve.holds(text, b'x\\"', 2, end) == (b'x\\"' in text[:end])


def test_the_rare_byte_scan_past_its_hits_searches_the_rest():
    pad = b"9" * kserve.SCAN_MIN
    many = pad + b"n" * (kserve.SCAN_HITS * 3)
    assert kserve._holds_null(many + b"null") and not kserve._holds_null(many + b"nul")
    assert kserve._holds_null(pad + b"n" * kserve.SCAN_HITS + b"null") and not kserve._holds_null(b"")
    key = b"shared_memory_region"
    body = pad + b"_" * (kserve.SCAN_HITS * 3) + key
    assert kserve.holds(body, key, 6) and not kserve.holds(body, key, 6, len(body) - 1)
    assert kserve.holds(key + pad, key, 6) and not kserve.holds(key[1:] + pad, key, 5)
    # (a reviewer's mutants: the rest searched from the last rare byte, not from where its match would start;
    # the scan going on past the needle, not one byte; a match that runs past ``end``)
    assert kserve.holds(pad + b"u" * kserve.SCAN_HITS + b"unulu", b"nul", 1)
    assert kserve.holds(pad + b"_" * kserve.SCAN_HITS + key, key, 6)
    assert kserve._holds_null(pad + b"nnull")
    assert not kserve.holds(pad + b"null", b"null", 0, len(pad) + 3)


def _answers(outputs: dict, binary: bool = False, rid: str | None = "r"):
    new_req = kserve.InferRequest({}, [kserve.OutputRequest(n, binary) for n in outputs], binary, rid)
    old_req = prev.InferRequest({}, [prev.OutputRequest(n, binary) for n in outputs], binary, rid)
    return kserve.encode_response("m", "1", new_req, outputs), prev.encode_response("m", "1", old_req, outputs)


@pytest.mark.parametrize("size", [3, kserve.NUMPY_JSON_MIN, 1000, 64 * 4096])
@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_float_answers_are_byte_identical_with_nan_infinity_and_negative_zero(datatype, size):
    x = np.random.default_rng(size).standard_normal(size).astype(kserve.numpy_dtype(datatype))
    plain = dict(zip(["OUT", "I"], [x.copy(), np.arange(3)]))
    x[:3] = [np.nan, np.inf, -0.0] if size >= 3 else x[:3]
    special = {"OUT": x, "I": np.arange(3)}
    for outputs in (plain, special):
        for binary in (False, True):
            new, old = _answers(outputs, binary)
            assert bytes(new[0]) == bytes(old[0]) and new[1] == old[1]
    assert b"NaN,Infinity,-0.0" in _answers(special)[0][0]


@pytest.mark.parametrize("value", [b"null", b"\nulls", b"n" * 100 + b"null", b"n" * 100, b"nul", b"x\\null"])
def test_answers_whose_strings_spell_null_are_byte_identical(value):
    """A string with 'null' in it, or an escape that spells it (newline, 'ull'), or 'n's past the scan's hits:
    the json module writes the answer, as before; without one, orjson does."""
    outputs = {"OUT": np.array([value, b"\xe9t\xc3\xa9"], dtype=object), "F": np.arange(200, dtype=np.float64)}
    for rid in ("r", "null", None):
        new, old = _answers(outputs, rid=rid)
        assert new == old


@pytest.mark.parametrize("datatype", ["BOOL", "INT8", "INT64", "UINT64", "BYTES"])
def test_other_answers_are_byte_identical(datatype):
    if datatype == "BYTES":
        x = np.array([b"a", b"", b"n\xc3\xa9", b"\x00"] * 50, dtype=object)
    elif datatype == "BOOL":
        x = np.arange(200) % 3 == 0
    else:
        info = np.iinfo(kserve.numpy_dtype(datatype))
        x = np.random.default_rng(3).integers(info.min, info.max, 200, dtype=info.dtype, endpoint=True)
        x[:2] = [info.min, info.max]
    for shape in [(200,), (4, 50), (1,)]:
        outputs = {"OUT": x[: math.prod(shape)].reshape(shape)}
        for binary in (False, True):
            new, old = _answers(outputs, binary)
            assert bytes(new[0]) == bytes(old[0]) and new[1] == old[1]


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300) | st.binary(max_size=60).map(lambda b: bytes(b"[{;}]{[\xdb\xfb"[c % 9] for c in b)))
def test_the_bracket_count_counts_both_brackets_and_nothing_else(text):
    assert jsonfast.openings(text) == text.count(b"[") + text.count(b"{")


@pytest.mark.parametrize("n", [3, kserve.NUMERIC_MIN])
@pytest.mark.parametrize("edge", [3.4028235e38, -3.4028235e38, 3.4028235677973366e38, 3.4028236e38, 1e300, -1e300,
                                  2**128, math.inf, math.nan])
def test_floats_past_float32s_range_are_infinity_without_a_warning(edge, n):
    data = [1.5] * (n - 1) + [edge]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = same("FP32", [n], data)
    assert got[0] == "array"


def test_no_parameters_are_the_shared_frozen_defaults_on_both_surfaces():
    rp = kserve.request_parameters
    for protocol in (rp.HTTP, rp.GRPC):
        assert rp.check({}, protocol) is rp.DEFAULTS
    assert rp.DEFAULTS == rp.RequestParameters() == rp.check({"priority": 0}, rp.HTTP)
    assert rp.check({"priority": 2}, rp.GRPC) == rp.RequestParameters(priority=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rp.DEFAULTS.priority = 1  # shared by every request without parameters: none may change it
    body = b'{"inputs":[{"name":"X","datatype":"FP32","shape":[1],"data":[1]}]}'
    req = kserve.parse_request(body, None)
    assert (req.timeout_s, req.priority) == (None, 0)
    with pytest.raises(InvalidArgument, match="'binary_data_output' must be a bool"):
        kserve.parse_request(body.replace(b'{"inputs"', b'{"parameters":{"binary_data_output":1},"inputs"'), None)


def _wrapping_fromiter(values, dtype, count=-1):
    """numpy 1.x's fromiter: an integer out of the dtype's range wraps (numpy 2 raises OverflowError)."""
    bits = np.dtype(dtype).itemsize * 8
    return np.array([v % 2**bits for v in values], np.uint64).astype(dtype)


@pytest.mark.parametrize("datatype,bad", [("INT8", 200), ("INT8", -129), ("UINT8", -1), ("UINT8", 256),
                                          ("INT64", 2**63), ("UINT64", -1), ("UINT64", 2**64)])
def test_an_integer_out_of_range_is_refused_before_numpy_could_wrap_it(datatype, bad):
    info = np.iinfo(kserve.numpy_dtype(datatype))
    data = [1, 2] * kserve.NUMERIC_MIN + [bad]
    assert not kserve._in_range(kserve.numpy_dtype(datatype), data)
    assert kserve._in_range(kserve.numpy_dtype(datatype), [int(info.min), 3, int(info.max)])
    want = f"input 'X': value {bad} is out of range for {datatype} [{info.min}, {info.max}]"
    fits = data[:-1]
    with mock.patch.object(np, "fromiter", mock.Mock(wraps=_wrapping_fromiter)) as fromiter:
        assert kserve._from_json("X", datatype, [len(fits)], fits).tolist() == fits
        assert fromiter.call_count == 1  # the fast path's conversion is the wrapping stand-in
        with pytest.raises(InvalidArgument) as caught:
            kserve._from_json("X", datatype, [len(data)], data)
    assert caught.value.message == want


# -- Triton's raw binary request (Inference-Header-Content-Length: 0) ---------------------------------------------

def _raw_config(dims: list[int], data_type: str = "TYPE_FP32", max_batch_size: int = 8, inputs: int = 1) -> dict:
    spec = {"name": "X", "data_type": data_type, "dims": dims}
    return {"max_batch_size": max_batch_size, "input": [dict(spec, name=f"X{i}" if i else "X") for i in range(inputs)]}


def test_a_raw_request_deduces_its_shape_as_triton():
    x = np.arange(12, dtype=np.float32)
    req = kserve.raw_request(_raw_config([3, -1]), x.tobytes(), "m")  # batch 1, the variable dim from the size
    np.testing.assert_array_equal(req.inputs["X"], x.reshape(1, 3, 4))
    assert req.outputs is None and req.binary_output
    req = kserve.raw_request(_raw_config([-1], "TYPE_INT64", max_batch_size=0), x.tobytes(), "m")  # no batch dim
    assert req.inputs["X"].shape == (6,) and req.inputs["X"].dtype == np.int64
    req = kserve.raw_request(_raw_config([1], "TYPE_STRING"), b"\xffany bytes", "m")
    assert req.inputs["X"].shape == (1, 1) and req.inputs["X"][0, 0] == b"\xffany bytes"


@pytest.mark.parametrize("config, body, words", [
    (_raw_config([4], inputs=2), b"\0" * 16,
     "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'm' model configuration"),
    (_raw_config([-1, -1]), b"\0" * 16,
     "The shape of the raw input 'X' can not be deduced because there are more than one variable-sized dimension"),
    (_raw_config([2], "TYPE_STRING"), b"ab", "For BYTE datatype raw input, the model must have input shape [1]"),
    (_raw_config([-1], "TYPE_STRING"), b"ab", "For BYTE datatype raw input, the model must have input shape [1]"),
    (_raw_config([4]), b"\0" * 12, "input 'X': the raw request's 12 bytes do not make a FP32 tensor of shape [1, 4]"),
    (_raw_config([3, -1]), b"\0" * 16, "input 'X': the raw request's 16 bytes do not make a FP32 tensor of shape "
                                       "[1, 3, 1]"),
    (_raw_config([2 ** 62, 2 ** 62, -1]), b"", "input 'X': the shape [1, 4611686018427387904, 4611686018427387904, 0] "
                                              "the model's config gives cannot be made"),
])
def test_a_raw_request_the_model_cannot_take_is_refused_in_tritons_words(config, body, words):
    with pytest.raises(InvalidArgument) as refused:
        kserve.raw_request(config, body, "m")
    assert refused.value.message == words
