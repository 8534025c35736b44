"""Triton's KServe v2 gRPC service in the gateway, with real clients: tritonclient.grpc (sync, asyncio,
streaming), raw gRPC calls for hostile input, grpc.health.v1, reflection, perf_analyzer -i grpc; each on
both gRPC servers (the native one and grpc.aio)."""

import asyncio
import os
import queue
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import descriptor_pb2

from gepool import Pool
from gepool.common import errors
from gepool.grpc import health_pb2, health_pb2_grpc, reflection_pb2
from gepool.http.servers import GRPC_SERVERS
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

grpcclient = pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc.aio as grpcaio  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

RNG = np.random.default_rng(19)
MAX_BODY = 8 << 20
SERVICE = "/inference.GRPCInferenceService/"


def make_mixed(repo: str) -> None:
    """An ONNX model over FP16 and INT32 inputs: HALF2 = HALF + HALF, INTS2 = INTS * 3."""
    from onnx import TensorProto, helper, numpy_helper

    half = helper.make_tensor_value_info("HALF", TensorProto.FLOAT16, ["batch", 4])
    ints = helper.make_tensor_value_info("INTS", TensorProto.INT32, ["batch", 3])
    half2 = helper.make_tensor_value_info("HALF2", TensorProto.FLOAT16, ["batch", 4])
    ints2 = helper.make_tensor_value_info("INTS2", TensorProto.INT32, ["batch", 3])
    three = numpy_helper.from_array(np.array(3, np.int32), "three")
    nodes = [helper.make_node("Add", ["HALF", "HALF"], ["HALF2"]),
             helper.make_node("Mul", ["INTS", "three"], ["INTS2"])]
    test_repo.make_models._save(helper.make_graph(nodes, "mixed", [half, ints], [half2, ints2], [three]),
                                f"{repo}/mixed/1/model.onnx")
    test_repo.write(f"{repo}/mixed/config.pbtxt", """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "HALF" data_type: TYPE_FP16 dims: [ 4 ] },
                { name: "INTS" data_type: TYPE_INT32 dims: [ 3 ] } ]
        output [ { name: "HALF2" data_type: TYPE_FP16 dims: [ 4 ] },
                 { name: "INTS2" data_type: TYPE_INT32 dims: [ 3 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        dynamic_batching { }
    """)


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def gpool(tmp_path_factory, request):
    repo = str(tmp_path_factory.mktemp("grpc-models"))
    test_repo.make_models.make_tiny(repo)
    test_repo.make_models.make_mlp(repo, (64, 256, 10))
    test_repo.bytes_model(repo)
    make_mixed(repo)
    with Pool(repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port(),
              http_max_body_bytes=MAX_BODY, grpc_server=request.param) as pool:
        pool.repo = repo
        pool.url = f"127.0.0.1:{pool.grpc_port}"
        yield pool


@pytest.fixture(scope="module")
def triton(gpool):
    c = grpcclient.InferenceServerClient(gpool.url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def channel(gpool):
    with grpc.insecure_channel(gpool.url) as ch:
        yield ch


def direct(repo: str, name: str, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(os.path.join(repo, name, "1", "model.onnx"),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def raw_call(channel, method: str, payload: bytes, timeout: float = 30) -> bytes:
    return channel.unary_unary(SERVICE + method)(payload, timeout=timeout)  # bytes in, bytes out


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# -- health, metadata, config, statistics -------------------------------------------------------------
def test_health_metadata_config_and_statistics(gpool, triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("tiny") and triton.is_model_ready("tiny", "1")
    assert not triton.is_model_ready("tiny", "2") and not triton.is_model_ready("nonexistent")
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "gepool" and {"statistics", "system_shared_memory"} <= set(meta["extensions"])
    mm = triton.get_model_metadata("mlp", as_json=True)
    assert mm["versions"] == ["1"] and mm["platform"] == "onnxruntime_onnx"
    assert mm["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": ["-1", "64"]}]
    cfg = triton.get_model_config("mlp").config  # tritonclient's own inference.ModelConfig class
    assert cfg.max_batch_size == 32 and list(cfg.input[0].dims) == [64] and cfg.input[0].data_type == 11
    assert list(cfg.dynamic_batching.preferred_batch_size) == [16, 32]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 5000
    assert cfg.version_policy.latest.num_versions == 1 and cfg.instance_group[0].kind == 2  # KIND_CPU
    before = triton.get_inference_statistics("tiny").model_stats[0].inference_stats.success.count
    inp = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_data_from_numpy(np.ones((2, 16), np.float32))
    for _ in range(3):
        triton.infer("tiny", [inp])
    stats = triton.get_inference_statistics("tiny").model_stats
    assert [s.name for s in stats] == ["tiny"] and stats[0].inference_stats.success.count == before + 3
    assert stats[0].inference_stats.success.ns > 0 and stats[0].batch_stats
    assert {s.name for s in triton.get_inference_statistics().model_stats} >= {"tiny", "mlp", "shout", "mixed"}
    index = {m.name: m for m in triton.get_model_repository_index().models}
    assert index["tiny"].state == "READY" and index["tiny"].version == "1"


# -- inference ----------------------------------------------------------------------------------------
def test_infer_raw_contents_matches_onnxruntime(gpool, triton):
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    inp = grpcclient.InferInput("INPUT", [3, 64], "FP32")
    inp.set_data_from_numpy(x)
    result = triton.infer("mlp", [inp], outputs=[grpcclient.InferRequestedOutput("LOGITS")], request_id="r7")
    (want,) = direct(gpool.repo, "mlp", {"INPUT": x})
    np.testing.assert_allclose(result.as_numpy("LOGITS"), want, rtol=1e-5, atol=1e-5)
    response = result.get_response()
    assert response.id == "r7" and response.model_version == "1" and response.model_name == "mlp"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_a_client_timeout(gpool, triton, algorithm):
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    inp = grpcclient.InferInput("INPUT", [2, 64], "FP32")
    inp.set_data_from_numpy(x)
    result = triton.infer("mlp", [inp], compression_algorithm=algorithm, client_timeout=30)
    np.testing.assert_allclose(result.as_numpy("LOGITS"), direct(gpool.repo, "mlp", {"INPUT": x})[0],
                               rtol=1e-5, atol=1e-5)


def test_fp16_and_int32_inputs_and_typed_contents(gpool, triton, channel):
    half = RNG.standard_normal((2, 4)).astype(np.float16)
    ints = RNG.integers(-1000, 1000, (2, 3)).astype(np.int32)
    h, i = grpcclient.InferInput("HALF", [2, 4], "FP16"), grpcclient.InferInput("INTS", [2, 3], "INT32")
    h.set_data_from_numpy(half)
    i.set_data_from_numpy(ints)
    result = triton.infer("mixed", [h, i])
    want_half, want_ints = direct(gpool.repo, "mixed", {"HALF": half, "INTS": ints})
    assert result.as_numpy("HALF2").dtype == np.float16
    np.testing.assert_array_equal(result.as_numpy("HALF2"), want_half)
    np.testing.assert_array_equal(result.as_numpy("INTS2"), want_ints)
    # typed contents (tritonclient always sends raw: build the message as another language's stub would)
    x = RNG.standard_normal((2, 16)).astype(np.float32)
    req = service_pb2.ModelInferRequest(model_name="tiny", id="typed")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16]).contents.fp32_contents.extend(x.ravel().tolist())
    reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    (want,) = direct(gpool.repo, "tiny", {"INPUT0": x})
    got = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(list(reply.outputs[0].shape))
    np.testing.assert_array_equal(got, want)
    assert reply.id == "typed" and reply.outputs[0].datatype == "FP32"


def test_bytes_through_the_python_backend(triton, channel):
    text = np.array([[b"gepool"], [b"ascend npu"], ["h\u00e9".encode()]], dtype=object)
    inp = grpcclient.InferInput("TEXT", [3, 1], "BYTES")
    inp.set_data_from_numpy(text)
    result = triton.infer("shout", [inp])
    assert result.as_numpy("UPPER")[:, 0].tolist() == [b"GEPOOL", b"ASCEND NPU", "H\u00e9".encode()]
    assert result.as_numpy("LENGTH")[:, 0].tolist() == [6, 10, 3]
    req = service_pb2.ModelInferRequest(model_name="shout")
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"typed")
    reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert grpcclient.InferResult(reply).as_numpy("UPPER").tolist() == [[b"TYPED"]]


def test_system_shared_memory_inputs_and_outputs(gpool, triton):
    import tritonclient.utils.shared_memory as shm

    x = RNG.standard_normal((2, 16)).astype(np.float32)
    key_in, key_out = f"/gepool_grpc_in_{os.getpid()}", f"/gepool_grpc_out_{os.getpid()}"
    h_in = shm.create_shared_memory_region("in", key_in, x.nbytes)
    h_out = shm.create_shared_memory_region("out", key_out, x.nbytes)
    try:
        shm.set_shared_memory_region(h_in, [x])
        triton.register_system_shared_memory("in", key_in, x.nbytes)
        triton.register_system_shared_memory("out", key_out, x.nbytes)
        regions = triton.get_system_shared_memory_status().regions
        assert set(regions) == {"in", "out"} and regions["in"].key == key_in and regions["in"].byte_size == x.nbytes
        with pytest.raises(InferenceServerException, match="shared memory region 'in' already in manager") as twice:
            triton.register_system_shared_memory("in", key_in, x.nbytes)
        assert twice.value.status() == "StatusCode.ALREADY_EXISTS"  # Triton's shared_memory_manager.cc
        inp = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("out", x.nbytes)
        result = triton.infer("tiny", [inp], outputs=[out])
        meta = result.get_output("OUTPUT0")
        assert meta.parameters["shared_memory_region"].string_param == "out"
        got = shm.get_contents_as_numpy(h_out, np.float32, [2, 16])
        (want,) = direct(gpool.repo, "tiny", {"INPUT0": x})
        np.testing.assert_array_equal(got, want)
        ran = triton.get_inference_statistics("tiny").model_stats[0].inference_stats.success.count
        past = grpcclient.InferRequestedOutput("OUTPUT0")
        past.set_shared_memory("out", x.nbytes, offset=8)  # found only after the model had run
        with pytest.raises(InferenceServerException, match=r"\[8, 136\) lies outside shared memory region 'out' "
                                                           r"of 128 bytes"):
            triton.infer("tiny", [inp], outputs=[past])
        assert triton.get_inference_statistics("tiny").model_stats[0].inference_stats.success.count == ran
        with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'gone'"):
            inp.set_shared_memory("gone", x.nbytes)
            triton.infer("tiny", [inp])
        triton.unregister_system_shared_memory("in")
        assert set(triton.get_system_shared_memory_status().regions) == {"out"}
    finally:
        triton.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)
    assert not triton.get_system_shared_memory_status().regions
    assert not triton.get_cuda_shared_memory_status().regions  # answered harmlessly
    triton.unregister_cuda_shared_memory()


def test_asyncio_client(gpool):
    xs = [RNG.standard_normal((1, 16)).astype(np.float32) for _ in range(20)]

    async def main():
        async with grpcaio.InferenceServerClient(gpool.url) as c:
            assert await c.is_server_ready() and await c.is_model_ready("tiny")

            async def one(x):
                inp = grpcaio.InferInput("INPUT0", [1, 16], "FP32")
                inp.set_data_from_numpy(x)
                return (await c.infer("tiny", [inp])).as_numpy("OUTPUT0")
            return await asyncio.gather(*(one(x) for x in xs))

    for x, got in zip(xs, asyncio.run(main())):
        np.testing.assert_array_equal(got, direct(gpool.repo, "tiny", {"INPUT0": x})[0])


def test_200_requests_on_one_stream_each_matched_by_id(gpool):
    answers: queue.Queue = queue.Queue()
    xs = {str(i): RNG.standard_normal((1 + i % 4, 16)).astype(np.float32) for i in range(200)}
    c = grpcclient.InferenceServerClient(gpool.url)
    try:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        for rid, x in xs.items():
            inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            c.async_stream_infer("tiny", [inp], request_id=rid)
        got = {}
        for _ in xs:
            result, error = answers.get(timeout=60)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("OUTPUT0")
        c.stop_stream()
    finally:
        c.close()
    assert set(got) == set(xs)
    session = ort.InferenceSession(os.path.join(gpool.repo, "tiny", "1", "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    for rid, x in xs.items():
        np.testing.assert_array_equal(got[rid], session.run(None, {"INPUT0": x})[0])


# -- hostile input ------------------------------------------------------------------------------------
def test_malformed_protobuf_mismatched_raw_contents_and_unknown_models(gpool, triton, channel):
    code, details = status_of(lambda: raw_call(channel, "ModelInfer", b"\x0a\xff\xff\xff\xff\x0f"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed ModelInferRequest" in details
    code, _ = status_of(lambda: raw_call(channel, "ModelMetadata", b"\xff\xff"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    req = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[b"\0" * 100])
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16])
    code, details = status_of(lambda: stub.ModelInfer(req, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "100 bytes of data, but shape [2, 16] of FP32 needs 128" in details
    req.inputs[0].shape[:] = [1 << 40, 1 << 20]  # an oversized declaration costs nothing
    assert status_of(lambda: stub.ModelInfer(req, timeout=30))[0] == grpc.StatusCode.INVALID_ARGUMENT
    req = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[b"\0" * 64])
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 8])  # the front checks it against the config
    code, details = status_of(lambda: stub.ModelInfer(req, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "INPUT0" in details, details
    req.model_name = "nonexistent"
    code, details = status_of(lambda: stub.ModelInfer(req, timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND and "nonexistent" in details
    with pytest.raises(InferenceServerException, match="nonexistent") as info:
        triton.get_model_metadata("nonexistent")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        triton.get_model_config("tiny", "x")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    big = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[b"\0" * (MAX_BODY + 64)])
    big.inputs.add(name="INPUT0", datatype="FP32", shape=[1, (MAX_BODY + 64) // 4])
    assert status_of(lambda: stub.ModelInfer(big, timeout=60))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
    assert triton.infer("tiny", [inp]).as_numpy("OUTPUT0")[0, 0] == 1.0  # still serving


def test_repeated_outputs_unholdable_shapes_and_unbounded_numbers_are_invalid_argument(gpool, channel):
    """What an attacker sent (outputs repeated 20,000 times drew an 80 MB reply; an empty tensor numpy cannot
    size; a timeout and a version past int64 reached msgpack): each INVALID_ARGUMENT naming it, and the pool
    serves on."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    x = np.arange(16, dtype=np.float32).reshape(1, 16)

    def tiny() -> service_pb2.ModelInferRequest:
        req = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[x.tobytes()])
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        return req

    repeated = tiny()
    for _ in range(20_000):
        repeated.outputs.add(name="OUTPUT0")
    empty = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[b""])
    empty.inputs.add(name="INPUT0", datatype="FP32", shape=[0, (1 << 63) - 1])
    timeout, version = tiny(), tiny()
    timeout.parameters["timeout"].uint64_param = (1 << 64) - 1
    version.model_version = "99999999999999999999999999"
    for req, words in [(repeated, "output 'OUTPUT0' is requested twice"),
                       (empty, "input 'INPUT0': shape [0, 9223372036854775807] of FP32 needs"),
                       (timeout, "parameter 'timeout' must be an integer in 0..9223372036854775807"),
                       (version, "version should be an integral value in 1..9223372036854775807")]:
        code, details = status_of(lambda req=req: stub.ModelInfer(req, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (code, details)
    out = np.frombuffer(stub.ModelInfer(tiny(), timeout=30).raw_output_contents[0], np.float32)
    np.testing.assert_allclose(out, direct(gpool.repo, "tiny", {"INPUT0": x})[0].ravel(), rtol=1e-6)


def test_a_stream_answers_garbage_in_error_message_and_keeps_serving(gpool, channel):
    good = service_pb2.ModelInferRequest(model_name="tiny", id="ok", raw_input_contents=[np.ones((1, 16),
                                                                                                 np.float32).tobytes()])
    good.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    unknown = service_pb2.ModelInferRequest(model_name="nonexistent", id="nope")
    stream = channel.stream_stream(SERVICE + "ModelStreamInfer", response_deserializer=(
        service_pb2.ModelStreamInferResponse.FromString))
    sent = [b"\x0a\xff\xff\xff\xff\x0f", unknown.SerializeToString(), good.SerializeToString(),
            good.SerializeToString()]
    replies = list(stream(iter(sent), timeout=60))
    assert len(replies) == 4
    failed = {r.infer_response.id: r.error_message for r in replies if r.error_message}
    assert set(failed) == {"", "nope"}  # an error names its request's id where the request could be read
    assert "malformed ModelInferRequest" in failed[""] and "unknown model: 'nonexistent'" in failed["nope"]
    ok = [r.infer_response for r in replies if not r.error_message]
    assert [r.id for r in ok] == ["ok", "ok"]
    assert all(np.frombuffer(r.raw_output_contents[0], np.float32)[0] == 3.0 for r in ok)


def test_trace_and_log_settings_answer_as_an_unsupported_triton(triton):
    for call in (triton.get_trace_settings, triton.get_log_settings):
        with pytest.raises(InferenceServerException, match="not supported") as info:
            call()
        assert info.value.status() == "StatusCode.UNAVAILABLE"


def test_loading_in_mode_none_is_refused(triton):
    with pytest.raises(InferenceServerException, match="NONE"):
        triton.load_model("tiny")
    assert triton.is_model_ready("tiny")


@pytest.mark.skipif(os.geteuid() != 0, reason="a second user's socket needs root to setuid(65534)")
def test_only_the_pools_user_loads_and_unloads_over_grpc(gpool, triton):
    """The caller is named by the kernel from the peer address gRPC reports: a connection that a process of
    uid 65534 opened is refused repository control; this process's own is let through (to the front)."""
    from types import SimpleNamespace

    from gepool.grpc import grpc_service_pb2 as pb
    from gepool.grpc.service import InferenceService

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        # bash's /dev/tcp: the interpreter running this test is under /root, which that user cannot enter
        child = subprocess.Popen(["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/$0 && read -t 60 -u 3", str(port)],
                                 user=65534, group=65534, extra_groups=[], cwd="/")
        listener.settimeout(30)
        conn, (addr, peer_port) = listener.accept()
        try:
            service = InferenceService(SimpleNamespace(owner_uid=os.geteuid()), "127.0.0.1", port)
            with pytest.raises(errors.PermissionDenied, match="allowed only to the pool's own user"):
                service.may_control(pb.RepositoryModelUnloadRequest(model_name="tiny"), f"ipv4:{addr}:{peer_port}")
            with socket.create_connection(("127.0.0.1", port)) as mine:
                own, (addr2, port2) = listener.accept()
                service.may_control(pb.RepositoryModelUnloadRequest(model_name="tiny"),
                                     f"ipv4:{addr2}:{mine.getsockname()[1]}")
                own.close()
        finally:
            conn.close()
            child.wait(30)
    with pytest.raises(InferenceServerException, match="unload_dependents is not supported"):
        triton.unload_model("tiny", unload_dependents=True)
    assert triton.is_model_ready("tiny")


def test_classification_is_served_over_grpc_as_over_http(triton):
    """tritonclient's gRPC client sends ``class_count`` as the output parameter 'classification': the top N
    classes come back as "value:index" BYTES, as HTTP serves them (gRPC refused the parameter)."""
    x = np.array([[0, 5, 1, 7, 2, 3, 4, 6, 8, 9, 15, 10, 11, 12, 14, 13]], np.float32)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    result = triton.infer("tiny", [inp], outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=3)])
    assert result.as_numpy("OUTPUT0").tolist() == [[b"31.000000:10", b"29.000000:14", b"27.000000:15"]]
    result = triton.infer("tiny", [inp], outputs=[grpcclient.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2 + 1)


# -- health, reflection, metrics ----------------------------------------------------------------------
def test_grpc_health_and_reflection(gpool, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "inference.GRPCInferenceService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    code, _ = status_of(lambda: health.Check(health_pb2.HealthCheckRequest(service="other"), timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
    for garbage in (channel.unary_unary("/grpc.health.v1.Health/Check"),  # grpcio's own deserializer answered
                    channel.unary_unary("/grpc.health.v1.Health/List"),  # UNKNOWN naming a Python class
                    lambda raw, timeout: list(watch(raw, timeout=timeout))):
        code, details = status_of(lambda garbage=garbage: garbage(b"\x0a\xff\xff\xff\xff\x0f", timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed Health" in details, (code, details)
        assert "class" not in details and "DecodeError" not in details
    assert health.List(health_pb2.HealthListRequest(), timeout=30).statuses[""].status == \
        health_pb2.HealthCheckResponse.SERVING
    watching = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    assert next(watching).status == health_pb2.HealthCheckResponse.SERVING
    watching.cancel()
    for version in ("v1", "v1alpha"):  # grpcurl asks v1 first, older clients v1alpha
        info = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        asks = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
                reflection_pb2.ServerReflectionRequest(file_by_filename="no_such.proto")]
        listed, found, missing = list(info(iter(r.SerializeToString() for r in asks), timeout=30))
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= {
            s.name for s in listed.list_services_response.service}
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in found.file_descriptor_response.file_descriptor_proto]
        assert [f.name for f in files] == ["grpc_service.proto", "model_config.proto"]  # with what it imports
        assert files[0].package == files[1].package == "inference"
        assert "ModelInfer" in {m.name for m in files[0].service[0].method}
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_grpc_requests_count_in_the_same_metrics_series(gpool, triton):
    def success() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{gpool.metrics_port}/metrics", timeout=30).read().decode()
        line = next(ln for ln in text.splitlines()
                    if ln.startswith('nv_inference_request_success{model="mixed",protocol="grpc"'))
        return float(line.rsplit(" ", 1)[1])

    before = success()
    h, i = grpcclient.InferInput("HALF", [1, 4], "FP16"), grpcclient.InferInput("INTS", [1, 3], "INT32")
    h.set_data_from_numpy(np.ones((1, 4), np.float16))
    i.set_data_from_numpy(np.ones((1, 3), np.int32))
    for _ in range(4):
        triton.infer("mixed", [h, i])
    assert success() == before + 4


def test_a_bad_request_parameter_gets_the_same_message_over_http_and_grpc(gpool, channel):
    """400 over HTTP, INVALID_ARGUMENT over gRPC, one text; and the pool serves on."""
    import json

    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    for key, value in [("timeout", -5), ("priority", "high"), ("sequence_id", 3)]:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": x.ravel().tolist()}],
                "parameters": {key: value}}
        http = urllib.request.Request(f"http://127.0.0.1:{gpool.http_port}/v2/models/tiny/infer",
                                      data=json.dumps(body).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(http, timeout=30)
        assert refused.value.code == 400
        http_message = json.loads(refused.value.read())["error"]
        req = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[x.tobytes()])
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        if isinstance(value, str):
            req.parameters[key].string_param = value
        else:
            req.parameters[key].int64_param = value
        code, details = status_of(lambda req=req: stub.ModelInfer(req, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == http_message and f"'{key}'" in details
        del req.parameters[key]
        out = np.frombuffer(stub.ModelInfer(req, timeout=30).raw_output_contents[0], np.float32)
        np.testing.assert_allclose(out, direct(gpool.repo, "tiny", {"INPUT0": x})[0].ravel(), rtol=1e-6)


@pytest.mark.parametrize("grpc_server", GRPC_SERVERS)
def test_health_is_not_serving_while_the_pool_drains(tmp_path, grpc_server):
    """SIGTERM with a grace period longer than the test: NOT_SERVING while the pool still serves, then
    SIGINT drains it at once and it exits cleanly."""
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)
    pool = Pool(repo, grpc_port=free_port(), exit_grace_s=30, grpc_server=grpc_server).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{pool.grpc_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status():
                return health.Check(health_pb2.HealthCheckRequest(), timeout=30).status

            assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 60)
            pool.process.send_signal(signal.SIGTERM)
            assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 60)
            c = grpcclient.InferenceServerClient(f"127.0.0.1:{pool.grpc_port}")
            try:
                assert not c.is_server_ready() and c.is_server_live()
            finally:
                c.close()
        pool.process.send_signal(signal.SIGINT)  # ends the grace: the drain starts now, not in 30 s
        assert pool.process.wait(60) == 0
    finally:
        pool.stop()


@pytest.mark.parametrize("grpc_server", GRPC_SERVERS)
def test_a_grpc_port_in_use_fails_the_start_naming_it(tmp_path, grpc_server):
    """Held by a plain listener, or by another gRPC server (grpcio sets SO_REUSEPORT by default, so without
    turning it off the pool would share the port and answer half of that server's calls)."""
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)

    def start_fails(port: int) -> None:
        pool = Pool(repo, grpc_port=port, grpc_server=grpc_server)
        try:
            with pytest.raises(errors.Unavailable, match=f"gRPC on 127.0.0.1:{port}"):
                pool.start()
        finally:
            pool.stop()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        start_fails(taken.getsockname()[1])
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        start_fails(port)
    finally:
        other.stop(None)


# -- perf_analyzer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
def test_perf_analyzer_over_grpc(gpool, streaming):
    from tests.test_http import _perf_analyzer_env

    env = _perf_analyzer_env()
    if env is None:
        pytest.skip("perf_analyzer cannot run here: .ci/run extracts it from the tritonclient==2.40.0 wheel into "
                    ".perf_analyzer/; it needs Debian's libb64-0d and libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12)")
    proc = subprocess.run(["perf_analyzer", "-m", "tiny", "-u", gpool.url, "-i", "grpc",
                           *(["--streaming"] if streaming else []), "--concurrency-range", "1:8:7",
                           "--measurement-interval", "1000", "-v", "--stability-percentage", "1000"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Concurrency: 1, throughput" in proc.stdout and "Concurrency: 8, throughput" in proc.stdout
    assert "error" not in proc.stdout.lower().replace("errors: 0", ""), proc.stdout[-3000:]
