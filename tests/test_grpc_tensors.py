"""gepool's gRPC messages against Triton's (tritonclient's copy), and requests decoded without a server."""

import numpy as np
import pytest

from gepool import _wire
from gepool.common.errors import InvalidArgument
from gepool.grpc import grpc_service_pb2 as pb
from gepool.grpc import model_config_pb2, tensors
from gepool.grpc.service import parse_message

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
triton_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult  # noqa: E402
from tritonclient.grpc._utils import _get_inference_request  # noqa: E402


def _fields(desc) -> dict:
    """name -> (number, type, repeated, type name) of a message and, recursively, its nested messages."""
    out = {}
    for f in desc.fields:
        kind = f.message_type.full_name if f.message_type else f.enum_type.full_name if f.enum_type else ""
        out[f"{desc.full_name}.{f.name}"] = (f.number, f.type, f.is_repeated, kind)
    for nested in desc.nested_types:
        out.update(_fields(nested))
    return out


def test_every_message_and_rpc_is_tritons():
    ours, theirs = pb.DESCRIPTOR, service_pb2.DESCRIPTOR
    assert ours.package == theirs.package == "inference"
    assert set(ours.message_types_by_name) == set(theirs.message_types_by_name)
    for name, desc in theirs.message_types_by_name.items():
        assert _fields(ours.message_types_by_name[name]) == _fields(desc), name
    mine = {m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
            for m in ours.services_by_name["GRPCInferenceService"].methods}
    assert mine == {m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming,
                             m.server_streaming) for m in theirs.services_by_name["GRPCInferenceService"].methods}


def test_model_config_is_inference_model_config_with_tritons_numbers():
    assert pb.ModelConfigResponse.DESCRIPTOR.fields_by_name["config"].message_type.full_name == "inference.ModelConfig"
    theirs = {}
    for desc in triton_config_pb2.DESCRIPTOR.message_types_by_name.values():
        theirs.update(_fields(desc))
    ours = {}
    for desc in model_config_pb2.DESCRIPTOR.message_types_by_name.values():
        ours.update(_fields(desc))
    shared = set(ours) & set(theirs)
    assert len(shared) > 80  # a cut-down copy, but the bulk of what config.pbtxt holds
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}


def _request(inputs, outputs=None, **kw) -> pb.ModelInferRequest:
    """A request as tritonclient builds it, read back as gepool's message (the wire in between)."""
    msg = _get_inference_request("m", inputs, "", kw.get("request_id", ""), outputs, 0, False, False,
                                 kw.get("priority", 0), kw.get("timeout"), None)
    return pb.ModelInferRequest.FromString(msg.SerializeToString())


def _no_shm(name, offset, size, limit):
    raise AssertionError("no shared memory in this request")


def test_raw_inputs_of_every_fixed_type_and_bytes():
    rng = np.random.default_rng(3)
    arrays = {"F16": rng.standard_normal((2, 3)).astype(np.float16), "I8": np.array([[-128, 127]], np.int8),
              "U64": np.array([2**64 - 1], np.uint64), "B": np.array([[True, False]]),
              "S": np.array([b"ab", "\u00e9".encode(), b""], dtype=object)}
    ins = []
    for name, arr in arrays.items():
        i = InferInput(name, list(arr.shape), {"F16": "FP16", "I8": "INT8", "U64": "UINT64", "B": "BOOL",
                                               "S": "BYTES"}[name])
        i.set_data_from_numpy(arr)
        ins.append(i)
    call = tensors.parse(_request(ins), _no_shm, 1 << 20)
    for name, arr in arrays.items():
        assert call.inputs[name].dtype == arr.dtype and call.inputs[name].tolist() == arr.tolist(), name


def test_priority_and_timeout_parameters_as_tritonclient_sends_them():
    i = InferInput("X", [1], "FP32")
    i.set_data_from_numpy(np.ones(1, np.float32))
    call = tensors.parse(_request([i], priority=(1 << 64) - 1, timeout=1500), _no_shm, 1 << 20)
    assert (call.priority, call.timeout_s) == ((1 << 64) - 1, 0.0015)  # a uint64; the front maps it to a level
    assert tensors.parse(_request([i]), _no_shm, 1 << 20).priority == 0


def test_a_request_without_parameters_runs_with_the_defaults():
    """No parameters: what request_parameters.check makes of none (taken ready-made); a bad one still refused."""
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="X", datatype="FP32", shape=[1])
    req.raw_input_contents.append(np.ones(1, np.float32).tobytes())
    call = tensors.parse(req, _no_shm, 1 << 20)
    assert (call.timeout_s, call.priority, call.mark_final) == (None, 0, False)
    req.parameters["binary_data_output"].bool_param = True
    with pytest.raises(InvalidArgument, match="binary_data_output"):
        tensors.parse(req, _no_shm, 1 << 20)


def test_typed_contents():
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="X", datatype="INT16", shape=[2, 2])
    t.contents.int_contents.extend([1, -2, 3, 32767])
    t = req.inputs.add(name="Y", datatype="FP32", shape=[3])
    t.contents.fp32_contents.extend([0.5, 1.5, -2.0])
    t = req.inputs.add(name="S", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"text")
    call = tensors.parse(req, _no_shm, 1 << 20)
    assert call.inputs["X"].dtype == np.int16 and call.inputs["X"].tolist() == [[1, -2], [3, 32767]]
    assert call.inputs["Y"].tolist() == [0.5, 1.5, -2.0] and call.inputs["S"].tolist() == [b"text"]


def _bad(req: pb.ModelInferRequest, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        tensors.parse(req, _no_shm, 1 << 20)


def test_hostile_requests_are_refused_naming_what_is_wrong():
    def raw(shape, data, datatype="FP32", **params):
        req = pb.ModelInferRequest(model_name="m", raw_input_contents=[data])
        req.inputs.add(name="X", datatype=datatype, shape=shape)
        for k, v in params.items():
            req.parameters[k].int64_param = v
        return req

    _bad(raw([2, 4], b"\0" * 31), "31 bytes of data, but shape \\[2, 4\\] of FP32 needs 32")
    _bad(raw([1 << 40, 1 << 20], b"\0" * 16), "needs")  # a huge declaration: refused before any allocation
    _bad(raw([-1, 4], b"\0" * 16), "non-negative")
    _bad(raw([4], b"\0" * 8, "BF16"), "'BF16' is not supported")
    _bad(raw([4], b"\0" * 16, "FLOAT"), "'FLOAT' is not supported")
    _bad(raw([3], b"\x05\0\0\0ab", "BYTES"), "BYTES")
    _bad(raw([4], b"\0" * 16, priority=-3), "'priority' must be a non-negative integer, got -3")
    _bad(raw([4], b"\0" * 16, sequence_id=7), "sequence batching")
    _bad(raw([4], b"\0" * 16, colour=1), "'colour' is not supported")
    extra = raw([4], b"\0" * 16)
    extra.raw_input_contents.append(b"\0" * 16)
    _bad(extra, "1 raw_input_contents are not claimed")
    both = raw([1], b"\0" * 4)
    both.inputs[0].contents.fp32_contents.append(1.0)
    _bad(both, "contents field must not be specified when using raw_input_contents")
    shared = pb.ModelInferRequest(model_name="m")  # shared memory was read and the contents quietly dropped
    shared.inputs.add(name="X", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    shared.inputs[0].parameters["shared_memory_region"].string_param = "r"
    _bad(shared, "input 'X': 'contents' and 'shared_memory_region' are both given; send the tensor one way")
    shared.inputs[0].ClearField("contents")
    shared.inputs[0].parameters["shared_memory_offset"].string_param = "abc"  # HTTP's words, as test_http_hostile
    _bad(shared, "input 'X': parameter 'shared_memory_offset' must be a non-negative integer, got 'abc'")
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="X", datatype="INT8", shape=[2]).contents.int_contents.extend([1, 300])
    _bad(typed, "value 300 is out of range for INT8")
    typed.inputs[0].shape[:] = [3]
    _bad(typed, "2 values in contents.int_contents, but shape")
    typed.inputs[0].shape[:] = [1 << 40]
    _bad(typed, r"shape \[1099511627776\] of INT8 needs 1099511627776 bytes, past the 1048576-byte limit")
    half = pb.ModelInferRequest(model_name="m")
    half.inputs.add(name="H", datatype="FP16", shape=[1]).contents.fp32_contents.append(1.0)
    _bad(half, "FP16 data must be sent in raw_input_contents")
    _bad(pb.ModelInferRequest(), "names no model")
    assert tensors.parse(raw([4], b"\0" * 16, timeout=250_000), _no_shm, 1 << 20).timeout_s == pytest.approx(0.25)
    _bad(raw([4], b"\0" * 16, triton_enable_empty_final_response=1), "must be a bool")
    flagged = raw([4], b"\0" * 16)
    flagged.parameters["triton_enable_empty_final_response"].bool_param = True
    call = tensors.parse(flagged, _no_shm, 1 << 20)
    reply = tensors.response(flagged.id, call, "1", {"Y": np.zeros(2, np.float32)}, None)
    assert call.mark_final and reply.parameters["triton_final_response"].bool_param


def test_shapes_numpy_cannot_hold_are_refused_before_any_allocation():
    """A zero-element shape whose other dimensions pass what numpy can size, more dimensions than the one
    bound HTTP shares, a dimension past int64: each named, where numpy raised ValueError (INTERNAL)."""
    def raw(shape, datatype="FP32"):
        req = pb.ModelInferRequest(model_name="m", raw_input_contents=[b""])
        req.inputs.add(name="X", datatype=datatype, shape=shape)
        return req

    for shape in ([0, (1 << 63) - 1], [0, 1 << 40, 1 << 40]):
        _bad(raw(shape), r"input 'X': shape \[0, .* of FP32 needs \d+ bytes \(counting its non-zero dimensions")
    _bad(raw([0, 1 << 40, 1 << 40], "BYTES"), "of BYTES needs")
    _bad(raw([0] * 33), r"input 'X': shape has 33 dimensions, more than the 32 gepool allows")  # HTTP's words
    _bad(raw([0] * 40 + [-1]), r"input 'X': shape must be a list of non-negative integers, got dimension -1")
    assert tensors.parse(raw([0] * 32), _no_shm, 1 << 20).inputs["X"].shape == (0,) * 32
    assert tensors.parse(raw([0, 1 << 10]), _no_shm, 1 << 20).inputs["X"].shape == (0, 1024)


def test_a_repeated_output_and_unbounded_numbers_are_refused():
    """An output asked for twice (each copy was answered: 80 MB from a 200 KB request), and numbers past
    what the wire carries (a timeout of 2**64-1 us, a model version past int64) name their range."""
    req = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 16])
    req.inputs.add(name="X", datatype="FP32", shape=[4])
    req.outputs.add(name="Y")
    req.outputs.add(name="Z")
    assert [o.name for o in tensors.parse(req, _no_shm, 1 << 20).outputs] == ["Y", "Z"]
    req.outputs.add(name="Y")
    _bad(req, "output 'Y' is requested twice")
    del req.outputs[:]
    classes = req.outputs.add(name="Y")
    classes.parameters["classification"].int64_param = 3
    assert tensors.parse(req, _no_shm, 1 << 20).outputs[0].class_count == 3
    classes.parameters["classification"].uint64_param = (1 << 64) - 1
    _bad(req, r"output 'Y': parameter 'classification' must be an integer in 0..9223372036854775807")
    del req.outputs[:]
    req.parameters["timeout"].uint64_param = (1 << 64) - 1
    _bad(req, r"parameter 'timeout' must be an integer in 0..9223372036854775807, got 18446744073709551615")
    req.parameters["timeout"].int64_param = (1 << 63) - 1
    largest = tensors.parse(req, _no_shm, 1 << 20).timeout_s
    assert 0 < _wire._timeout_us(largest) <= (1 << 64) - 1  # 2**63 after the float round trip: msgpack's uint64
    del req.parameters["timeout"]
    req.model_version = "99999999999999999999999999"
    _bad(req, r"version should be an integral value in 1..9223372036854775807")
    req.model_version = "9223372036854775807"
    assert tensors.parse(req, _no_shm, 1 << 20).version == (1 << 63) - 1


def test_malformed_protobuf_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="malformed ModelInferRequest"):
        parse_message(pb.ModelInferRequest, b"\x0a\xff\xff\xff\xff\x0f")


def test_response_reads_back_in_tritonclient():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = np.array([[b"a"], [b"bc"]], dtype=object)
    req = _request([InferInput("X", [2, 3], "FP32")], [InferRequestedOutput("S"), InferRequestedOutput("Y")],
                   request_id="r1")
    call = tensors.InferCall("m", None, {}, [tensors.OutputRequest("S"), tensors.OutputRequest("Y")], None)
    written = {}
    shm_call = tensors.InferCall("m", None, {}, [tensors.OutputRequest("S"), tensors.OutputRequest("Y", "out", 24)],
                                 None)
    for c in (call, shm_call):
        msg = tensors.response(req.id, c, "1", {"Y": x, "S": s},
                               lambda name, off, size, data: written.__setitem__(name, (off, size, data)))
        result = InferResult(service_pb2.ModelInferResponse.FromString(msg.SerializeToString()))
        assert result.get_response().id == "r1" and result.get_response().model_version == "1"
        assert result.as_numpy("S").tolist() == s.tolist()
        if c is call:
            np.testing.assert_array_equal(result.as_numpy("Y"), x)
    assert written == {"out": (0, 24, x.tobytes())}


def _grpc_parameter(req: pb.ModelInferRequest, key: str, value) -> None:
    """A JSON value as the InferParameter tritonclient.grpc would send for it."""
    p = req.parameters[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = value


BAD_PARAMETERS = [("timeout", -5), ("timeout", 2.5), ("timeout", True), ("timeout", "soon"), ("priority", -2),
                  ("priority", "high"), ("priority", 1.0), ("sequence_id", 3), ("sequence_start", True)]


@pytest.mark.parametrize("key, value", BAD_PARAMETERS)
def test_a_bad_request_parameter_reads_the_same_over_http_and_grpc(key, value):
    """One rule and one message (gepool.common.request_parameters) for both surfaces' parsers."""
    import json

    from gepool.http import kserve

    body = {"inputs": [{"name": "X", "shape": [4], "datatype": "FP32", "data": [0.0] * 4}], "parameters": {key: value}}
    with pytest.raises(InvalidArgument) as over_http:
        kserve.parse_request(json.dumps(body).encode(), None)
    req = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 16])
    req.inputs.add(name="X", datatype="FP32", shape=[4])
    _grpc_parameter(req, key, value)
    with pytest.raises(InvalidArgument) as over_grpc:
        tensors.parse(req, _no_shm, 1 << 20)
    assert over_http.value.message == over_grpc.value.message
    assert f"'{key}'" in over_http.value.message


def test_each_surface_names_what_it_supports_and_refuses_the_others_parameter():
    import json

    from gepool.common import request_parameters
    from gepool.http import kserve

    def http(params: dict):
        body = {"inputs": [{"name": "X", "shape": [4], "datatype": "FP32", "data": [0.0] * 4}], "parameters": params}
        return kserve.parse_request(json.dumps(body).encode(), None)

    def grpc(params: dict):
        req = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 16])
        req.inputs.add(name="X", datatype="FP32", shape=[4])
        for k, v in params.items():
            _grpc_parameter(req, k, v)
        return tensors.parse(req, _no_shm, 1 << 20)

    with pytest.raises(InvalidArgument, match=r"'max_tokens' is not supported by gepool \(supported: "
                                              r"binary_data_output, priority, timeout\)"):
        http({"max_tokens": 3})
    with pytest.raises(InvalidArgument, match=r"'max_tokens' is not supported by gepool \(supported: priority, "
                                              r"timeout, triton_enable_empty_final_response\)"):
        grpc({"max_tokens": 3})
    with pytest.raises(InvalidArgument, match="'binary_data_output' is HTTP's, not supported over gRPC"):
        grpc({"binary_data_output": True})
    with pytest.raises(InvalidArgument, match="'triton_enable_empty_final_response' is gRPC's, not supported over"):
        http({request_parameters.FINAL_FLAG: True})
    with pytest.raises(InvalidArgument, match="'binary_data_output' must be a bool, got 'yes'"):
        http({"binary_data_output": "yes"})  # was read as true
    got = http({"timeout": 2500, "priority": 2, "binary_data_output": True})
    assert (got.timeout_s, got.priority, got.binary_output) == (pytest.approx(0.0025), 2, True)
    call = grpc({"timeout": 2500, "priority": 2, request_parameters.FINAL_FLAG: True})
    assert (call.timeout_s, call.priority, call.mark_final) == (pytest.approx(0.0025), 2, True)
    assert http({"timeout": 0}).timeout_s is None and grpc({"timeout": 0}).timeout_s is None
