"""The gateway's fast JSON path (orjson, numpy) against main's json-module encoder and parser, on random tensors
of every datatype, malformed bodies, and a real pool under many connections."""

import gzip
import http.client
import json
import math
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from gepool import Pool
from gepool.common.errors import InvalidArgument
from gepool.http import kserve
from tests import kserve_main as main
from tests import repo as test_repo
from tests.conftest import SIDECAR_SERVERS, free_port

RNG = np.random.default_rng(18)
NUMERIC = ["BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64", "FP16", "FP32", "FP64"]
DATATYPES = NUMERIC + ["BYTES"]


def random_tensor(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values over the whole range of the type, its limits and, for floats, every magnitude
    (subnormals and values under 1e-4, whose text the two encoders spell differently, and values past 1e16)."""
    n = math.prod(shape)
    if datatype == "BYTES":
        alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\x00", "\x1f", '"', "\\", "é", "€", "😀"]
        return np.array(["".join(RNG.choice(alphabet, RNG.integers(0, 12))).encode() for _ in range(n)],
                        dtype=object).reshape(shape)
    dtype = kserve.numpy_dtype(datatype)
    if datatype == "BOOL":
        return RNG.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = RNG.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        values[: min(n, 2)] = [info.min, info.max][: min(n, 2)]
        return values.reshape(shape)
    info = np.finfo(dtype)
    exponents = RNG.uniform(np.log10(float(info.smallest_subnormal)), np.log10(float(info.max)), n)
    values = np.clip(np.sign(RNG.standard_normal(n)) * 10.0 ** exponents, -info.max, info.max).astype(dtype)
    specials = np.array([v for v in (0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_subnormal, 1e-4, 1e16,
                                     0.1) if abs(v) <= float(info.max)], dtype=np.float64).astype(dtype)
    values[: min(n, len(specials))] = specials[: min(n, len(specials))]
    return values.reshape(shape)


def same_json(new: bytes, old: bytes) -> None:
    """Both texts read back as the same document, every float the same double bit for bit."""
    a, b = json.loads(new), json.loads(old)
    assert _floats_as_bits(a) == _floats_as_bits(b)


def _floats_as_bits(value):
    if isinstance(value, float):
        return ("f", np.float64(value).tobytes())
    if isinstance(value, list):
        return [_floats_as_bits(v) for v in value]
    if isinstance(value, dict):
        return {k: _floats_as_bits(v) for k, v in value.items()}
    return value


def _request(outputs: dict, binary: bool, rid: str | None = "req-1"):
    new = kserve.InferRequest({}, [kserve.OutputRequest(n, binary) for n in outputs], binary, rid)
    old = main.InferRequest({}, [main.OutputRequest(n, binary) for n in outputs], binary, rid)
    return new, old


# -- responses ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 4), (0, 4)], ids=str)
def test_binary_responses_are_byte_identical(datatype, shape):
    outputs = {"OUT": random_tensor(datatype, shape), "T": random_tensor(datatype, shape[::-1]).T}  # T: strided
    new_req, old_req = _request(outputs, binary=True)
    new, new_headers = kserve.encode_response("m", "1", new_req, outputs)
    old, old_headers = main.encode_response("m", "1", old_req, outputs)
    assert bytes(new) == old and new_headers == old_headers


@pytest.mark.parametrize("datatype", DATATYPES)
def test_json_responses_read_back_as_the_same_values(datatype):
    for shape in [(1,), (4, 7), (2, 3, 5), (0,), (1000,)]:
        outputs = {"OUT": random_tensor(datatype, shape), "T": random_tensor(datatype, shape[::-1]).T}
        new_req, old_req = _request(outputs, binary=False)
        new, new_headers = kserve.encode_response("m", "1", new_req, outputs)
        old, old_headers = main.encode_response("m", "1", old_req, outputs)
        same_json(new, old)
        assert new_headers == old_headers
        got = json.loads(new)["outputs"][0]
        if datatype != "BYTES":  # what a Triton client makes of the text: the very tensor that was sent
            back = np.array(got["data"], dtype=kserve.numpy_dtype(datatype)).reshape(got["shape"])
            assert back.tobytes() == outputs["OUT"].tobytes()


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d not in ("FP16", "FP32", "FP64")])
def test_json_responses_without_floats_or_escapes_are_byte_identical(datatype):
    outputs = {"OUT": random_tensor(datatype, (6, 9))}
    if datatype == "BYTES":  # the json module escapes non-ASCII text, orjson writes it as UTF-8: both read the same
        outputs["OUT"] = np.array([b"ab", b"", b"x y", b"a\"b\\c\n\td"] * 6, dtype=object).reshape(6, 4)
    new_req, old_req = _request(outputs, binary=False)
    assert kserve.encode_response("m", "1", new_req, outputs)[0] == main.encode_response("m", "1", old_req, outputs)[0]


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_floats_of_magnitude_1e_minus_4_and_up_are_byte_identical(datatype):
    """From 1e-4 up to the type's largest both spell a double the same: the shortest text that reads back as it,
    a positive exponent with its sign (orjson from 3.11.7; 3.8 wrote 1e16 for 1e+16)."""
    dtype = kserve.numpy_dtype(datatype)
    top = float(np.log10(np.finfo(dtype).max))
    x = (np.sign(RNG.standard_normal(5000)) * 10.0 ** RNG.uniform(-4, top, 5000)).astype(dtype).astype(np.float64)
    x = x[(np.abs(x) >= 1e-4) & np.isfinite(x)].astype(dtype)
    if dtype.itemsize > 2:  # (FP16 ends at 65504)
        assert (np.abs(x.astype(np.float64)) >= 1e16).sum() > 1000
    outputs = {"OUT": x}
    new_req, old_req = _request(outputs, binary=False)
    assert kserve.encode_response("m", "1", new_req, outputs)[0] == main.encode_response("m", "1", old_req, outputs)[0]


@pytest.mark.parametrize("size", [4, kserve.NUMPY_JSON_MIN, 1000], ids=["list", "numpy-min", "numpy"])
def test_nan_and_infinity_are_written_as_before(size):
    x = np.linspace(-1, 1, size, dtype=np.float32)
    x[1:4] = [np.nan, np.inf, -np.inf]
    outputs = {"OUT": x, "I": np.arange(3)}
    new_req, old_req = _request(outputs, binary=False)
    new = kserve.encode_response("m", "1", new_req, outputs)[0]
    assert new == main.encode_response("m", "1", old_req, outputs)[0] and b"NaN,Infinity,-Infinity" in new


def test_a_string_saying_null_is_written_as_before():
    outputs = {"OUT": np.array([b"null", b"x"], dtype=object), "F": np.arange(200, dtype=np.float64)}
    new_req, old_req = _request(outputs, binary=False, rid="null")
    assert kserve.encode_response("m", "1", new_req, outputs)[0] == main.encode_response("m", "1", old_req, outputs)[0]


def test_a_name_orjson_cannot_write_is_written_as_before():
    outputs = {"OUT": np.arange(4, dtype=np.float32)}
    new_req, old_req = _request(outputs, binary=False, rid="\ud800")  # a lone surrogate: not UTF-8
    assert kserve.encode_response("m", "1", new_req, outputs)[0] == main.encode_response("m", "1", old_req, outputs)[0]


def test_a_large_tensor_both_ways():
    x = RNG.standard_normal((64, 4096)).astype(np.float32)
    for binary in (True, False):
        new_req, old_req = _request({"OUT": x}, binary)
        new = kserve.encode_response("m", "1", new_req, {"OUT": x})[0]
        old = main.encode_response("m", "1", old_req, {"OUT": x})[0]
        if binary:
            assert new == old
        else:
            same_json(new, old)


# -- requests -------------------------------------------------------------------------------------------------

def _body(inputs: list[dict], **extra) -> bytes:
    return json.dumps({"id": "r", "inputs": inputs, **extra}).encode()


def _same_parse(body: bytes, header_length: str | None = None) -> kserve.InferRequest:
    new = kserve.parse_request(body, header_length)
    old = main.parse_request(body, header_length)
    assert list(new.inputs) == list(old.inputs)
    for name, arr in old.inputs.items():
        assert new.inputs[name].dtype == arr.dtype and new.inputs[name].shape == arr.shape
        if arr.dtype == object:
            assert new.inputs[name].tolist() == arr.tolist()
        else:
            assert new.inputs[name].tobytes() == arr.tobytes()
    assert (new.id, new.binary_output, new.parameters) == (old.id, old.binary_output, old.parameters)
    assert [vars(o) for o in new.outputs or []] == [vars(o) for o in old.outputs or []]
    return new


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "FP16"])  # FP16 is refused in JSON, as Triton
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_json_inputs_parse_to_the_same_arrays(datatype, nested):
    for shape in [(1, 16), (3, 4, 5), (1, 1024), (0, 3)]:
        x = random_tensor(datatype, shape)
        data = [b.decode() for b in x.ravel()] if datatype == "BYTES" else x.ravel().tolist()
        if nested and shape[0]:
            data = np.array(data, dtype=object).reshape(shape).tolist()
        body = _body([{"name": "X", "datatype": datatype, "shape": list(shape), "data": data}],
                     outputs=[{"name": "Y", "parameters": {"binary_data": True}}])
        _same_parse(body)


def test_floats_as_clients_write_them_parse_to_the_same_values():
    """Python's float reprs, 9-digit float32 texts, exponents both ways, integers past 2**53."""
    x = RNG.standard_normal(4000) * 10.0 ** RNG.uniform(-38, 37, 4000)
    texts = [repr(float(v)) for v in x] + [f"{v:.9g}" for v in x.astype(np.float32)] + ["1E5", "-0", "0.0", "1e-45",
                                                                             "3.4028235e38", "9007199254740993"]
    body = f'{{"inputs":[{{"name":"X","datatype":"FP64","shape":[{len(texts)}],"data":[{",".join(texts)}]}}]}}'
    _same_parse(body.encode())
    _same_parse(body.replace("FP64", "FP32").encode())


@pytest.mark.parametrize("datatype", ["FP32", "INT32", "BOOL", "BYTES"])
def test_binary_inputs_parse_to_the_same_arrays(datatype):
    x = random_tensor(datatype, (4, 8))
    blob = kserve.dtypes.serialize_bytes(x) if datatype == "BYTES" else x.tobytes()
    header = json.dumps({"inputs": [{"name": "X", "datatype": datatype, "shape": [4, 8],
                                     "parameters": {"binary_data_size": len(blob)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    _same_parse(header + blob, str(len(header)))


BAD_BODIES = {
    "wrong-count": _body([{"name": "X", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 15}]),
    "str-in-fp32": _body([{"name": "X", "datatype": "FP32", "shape": [2], "data": [1.0, "2"]}]),
    "bool-in-fp32": _body([{"name": "X", "datatype": "FP32", "shape": [2], "data": [1.0, True]}]),
    "float-in-int": _body([{"name": "X", "datatype": "INT32", "shape": [2], "data": [1, 2.5]}]),
    "int-out-of-range": _body([{"name": "X", "datatype": "INT8", "shape": [2], "data": [1, 300]}]),
    "huge-int-in-int64": b'{"inputs":[{"name":"X","datatype":"INT64","shape":[2],"data":[1,1180591620717411303424]}]}',
    "huge-negative-in-int64": b'{"inputs":[{"name":"X","datatype":"INT64","shape":[1],"data":[-9223372036854775809]}]}',
    "huge-int-in-uint64": b'{"inputs":[{"name":"X","datatype":"UINT64","shape":[1],"data":[18446744073709551616]}]}',
    "nan-in-int": b'{"inputs":[{"name":"X","datatype":"INT32","shape":[1],"data":[NaN]}]}',
    "fp16-json": _body([{"name": "X", "datatype": "FP16", "shape": [1], "data": [1.0]}]),
    "bf16": _body([{"name": "X", "datatype": "BF16", "shape": [1], "data": [1.0]}]),
    "deep-body": b"[" * 100_000 + b"]" * 100_000,
    "deep-data": _body([{"name": "X", "datatype": "FP32", "shape": [1], "data": json.loads("[" * 40 + "0" + "]" * 40)}
                        ]),
    "deep-in-object": b'{"inputs":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "not-json": b"{garbage",
    "trailing-garbage": b'{"inputs":[]} x',
    "not-utf8": b'{"inputs":[{"name":"\xff","datatype":"FP32","shape":[1],"data":[1]}]}',
    "not-an-object": b"[1, 2]",
    "bytes-not-str": _body([{"name": "X", "datatype": "BYTES", "shape": [1], "data": [3]}]),
    "no-data": _body([{"name": "X", "datatype": "FP32", "shape": [1]}]),
    "twice": _body([{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}] * 2),
    "bad-shape": _body([{"name": "X", "datatype": "FP32", "shape": [-1], "data": [1]}]),
    "bad-datatype": _body([{"name": "X", "datatype": "FP33", "shape": [1], "data": [1]}]),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_malformed_bodies_are_refused_with_mains_message(name):
    body = BAD_BODIES[name]
    with pytest.raises(InvalidArgument) as old:
        main.parse_request(body, None)
    with pytest.raises(InvalidArgument) as new:
        kserve.parse_request(body, None)
    assert new.value.message == old.value.message and new.value.http_status == 400


# refused by main too, but with what numpy or the data count said: now the shape is named before any allocation
SHAPES_REFUSED_SOONER = {
    "count-before-alloc": (_body([{"name": "X", "datatype": "FP32", "shape": [1 << 40, 1 << 20], "data": [1.0]}]),
                           "shape [1099511627776, 1048576] of FP32 needs 4611686018427387904 bytes"),
    "huge-shape": (b'{"inputs":[{"name":"X","datatype":"FP32","shape":[123456789012345678901234567890],"data":[1]}]}',
                   "shape dimension 123456789012345678901234567890 is past the largest"),
}


@pytest.mark.parametrize("name", list(SHAPES_REFUSED_SOONER))
def test_shapes_main_refused_are_refused_naming_the_shape(name):
    body, words = SHAPES_REFUSED_SOONER[name]
    with pytest.raises(InvalidArgument):
        main.parse_request(body, None)
    with pytest.raises(InvalidArgument, match=re.escape(words)) as new:
        kserve.parse_request(body, None)
    assert new.value.http_status == 400


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_literals_main_accepted_are_accepted(literal):
    body = b'{"inputs":[{"name":"X","datatype":"FP32","shape":[2],"data":[1.5,%s]}]}' % literal.encode()
    assert _same_parse(body).inputs["X"].tobytes() == main.parse_request(body, None).inputs["X"].tobytes()


def test_a_lone_surrogate_in_bytes_data_is_refused_naming_the_input():
    body = b'{"inputs":[{"name":"X","datatype":"BYTES","shape":[1],"data":["a\\ud800"]}]}'
    with pytest.raises(UnicodeEncodeError):  # main's own reading: encoding the string fails (a 500)
        main.parse_request(body, None)
    with pytest.raises(InvalidArgument, match="input 'X': BYTES data must be valid UTF-8 text"):
        kserve.parse_request(body, None)


def test_a_million_levels_of_nesting_never_reach_orjson():
    """orjson 3.8 has no nesting limit and overflows the C stack on this: it must go to the json module."""
    code = ("from gepool.http import kserve\n"
            "body = b'{\"inputs\":' + b'[' * 1_000_000 + b']' * 1_000_000 + b'}'\n"
            "try:\n    kserve.parse_request(body, None)\n"
            "except kserve.InvalidArgument as exc:\n    print(exc.message)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nested too deeply" in proc.stdout


def test_as_much_nesting_as_orjson_is_given_is_safe_in_a_thread():
    """The deepest document orjson reads, in a thread (a smaller stack than the main thread's, where
    asyncio.to_thread parses large bodies)."""
    depth = kserve.ORJSON_MAX_BRACKETS - 1
    body = b'{"a":' + b"[" * depth + b"1" + b"]" * depth + b"}"
    seen = []
    t = threading.Thread(target=lambda: seen.append(kserve.load_header(body)))
    t.start()
    t.join(60)
    assert seen and isinstance(seen[0]["a"], list)


# -- a real pool ----------------------------------------------------------------------------------------------

ECHO_PY = '''
class Model:
    def execute(self, inputs):
        return {"OUT_" + name[3:]: value for name, value in inputs.items()}
'''


MAX_BODY = 256 << 10  # a body this size still arrives whole before the handler runs


@pytest.fixture(scope="module", params=SIDECAR_SERVERS)
def echo_pool(tmp_path_factory, request):
    """A python model that returns each of its inputs, one per datatype, and the tiny model."""
    repo = str(tmp_path_factory.mktemp("echo-models"))
    test_repo.make_models.make_tiny(repo)
    test_repo.write(f"{repo}/echo/1/model.py", ECHO_PY)

    def tensors(prefix: str) -> str:
        return ", ".join(f'{{ name: "{prefix}_{d}" data_type: TYPE_{"STRING" if d == "BYTES" else d} dims: [ -1 ] }}'
                         for d in DATATYPES)

    test_repo.write(f"{repo}/echo/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 0
        input [ {tensors("IN")} ]
        output [ {tensors("OUT")} ]
    """)
    with Pool(repo, http_port=free_port(), metrics_port=0, http_max_body_bytes=MAX_BODY,
              http_server=request.param) as pool:
        yield pool


def _post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes, dict]:
    """Status, body and headers, their names lower-cased (granian's HTTP/1 writes them so; both are HTTP)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_every_datatype_through_the_pool_answers_as_main_would(echo_pool, binary):
    xs = {d: random_tensor(d, (7,)) for d in DATATYPES}
    items, blobs = [], []
    for datatype, x in xs.items():
        item = {"name": f"IN_{datatype}", "datatype": datatype, "shape": [7]}
        if binary or datatype == "FP16":  # FP16 travels in binary only, as in Triton
            blob = kserve.dtypes.serialize_bytes(x) if datatype == "BYTES" else x.tobytes()
            item["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            item["data"] = [b.decode() for b in x] if datatype == "BYTES" else x.tolist()
        items.append(item)
    header = json.dumps({"id": "e", "inputs": items, "outputs": [
        {"name": f"OUT_{d}", "parameters": {"binary_data": binary}} for d in DATATYPES]}).encode()
    status, body, headers = _post(echo_pool.http_port, "/v2/models/echo/infer", header + b"".join(blobs),
                                  {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    ref_req = main.InferRequest({}, [main.OutputRequest(f"OUT_{d}", binary) for d in DATATYPES], binary, "e")
    expected, expected_headers = main.encode_response("echo", "1", ref_req, {f"OUT_{d}": x for d, x in xs.items()})
    if binary:
        assert body == expected
        assert headers["inference-header-content-length"] == expected_headers["Inference-Header-Content-Length"]
    else:
        same_json(body, expected)


def test_many_connections_at_once_each_get_their_own_answer(echo_pool):
    """64 connections, each sending its own rows over one keep-alive connection: every answer is 2x + 1
    of what that connection sent, as the float32 values a client reads."""
    errors: list[str] = []

    def one(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", echo_pool.http_port, timeout=120)
        try:
            for j in range(10):
                x = np.random.default_rng(i * 100 + j).standard_normal((1, 16)).astype(np.float32)
                binary = (i + j) % 2 == 0
                body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                               "data": x.ravel().tolist()}],
                                   "parameters": {"binary_data_output": binary}}).encode()
                conn.request("POST", "/v2/models/tiny/infer", body)
                resp = conn.getresponse()
                raw = resp.read()
                if resp.status != 200:
                    errors.append(f"{i}/{j}: {resp.status} {raw[:200]!r}")
                    return
                if binary:
                    hlen = int(resp.getheader("Inference-Header-Content-Length"))
                    got = np.frombuffer(raw[hlen:], np.float32)
                else:
                    got = np.array(json.loads(raw)["outputs"][0]["data"], dtype=np.float32)
                if got.tobytes() != (x * np.float32(2) + np.float32(1)).ravel().tobytes():
                    errors.append(f"{i}/{j}: wrong answer")
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:5]


@pytest.mark.parametrize("name", ["wrong-count", "str-in-fp32", "huge-int-in-int64", "deep-body", "not-json"])
def test_malformed_bodies_over_http_are_400_naming_the_problem(echo_pool, name):
    body = BAD_BODIES[name].replace(b'"X"', b'"INPUT0"')
    status, reply, _ = _post(echo_pool.http_port, "/v2/models/tiny/infer", body)
    assert status == 400
    with pytest.raises(InvalidArgument) as old:
        main.parse_request(body, None)
    assert json.loads(reply)["error"] == old.value.message


def test_a_compressed_body_is_held_to_the_limit_as_it_unpacks(echo_pool):
    """A body that arrives whole is taken from the buffer without waiting: its size still counts as
    decompressed (a gzip body of a few KiB that unpacks past the limit is 413, as before)."""
    good = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}]})
    for padding, want in ((0, 200), (MAX_BODY + (32 << 10), 413), (4 * MAX_BODY, 413)):
        packed = gzip.compress(b" " * padding + good.encode())
        assert len(packed) < 64 << 10
        status, reply, _ = _post(echo_pool.http_port, "/v2/models/tiny/infer", packed,
                                 {"Content-Encoding": "gzip", "Content-Type": "application/json"})
        assert status == want, reply[:300]
        if want == 200:
            assert json.loads(reply)["outputs"][0]["data"] == [3.0] * 16
        else:
            assert b"--http-max-body-bytes" in reply
