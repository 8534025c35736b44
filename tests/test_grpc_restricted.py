"""Triton's --grpc-restricted-protocol on both gRPC servers: a restricted protocol's calls need the metadata
triton-grpc-protocol-KEY with its VALUE, else UNAVAILABLE before their request reaches the pool."""


import grpc
import numpy as np
import pytest

from gepool import Pool
from gepool.grpc import health_pb2
from gepool.grpc.access import METHODS
from gepool.grpc.service import SERVICE
from gepool.http.servers import GRPC_SERVERS
from tests import repo as test_repo
from tests.conftest import free_port, sidecar_refuses

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

INFER_KEY = "triton-grpc-protocol-infer-key"  # the flag's key is Infer-Key: metadata keys are lowercase
ADMIN_KEY = "triton-grpc-protocol-admin"
GROUPS = ("inference,health:Infer-Key=v 1", "model-repository:admin=yes")
REFUSED = f"This protocol is restricted, expecting header '{INFER_KEY}'"
MAX_BODY = 1 << 20


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def rpool(tmp_path_factory, request):
    repo = str(tmp_path_factory.mktemp("restricted-models"))
    test_repo.make_models.make_tiny(repo)
    with Pool(repo, grpc_port=free_port(), http_port=0, metrics_port=0, grpc_server=request.param,
              http_max_body_bytes=MAX_BODY,
              grpc_restricted_protocol=GROUPS, model_control_mode="explicit", load_models=["tiny"]) as pool:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{pool.grpc_port}") as client:
            pool.client = client
            yield pool


def _tiny_input() -> tuple[np.ndarray, object]:
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    inp = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_data_from_numpy(x)
    return x, inp


def _refused(call) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == "StatusCode.UNAVAILABLE", info.value
    return info.value.message()


def _successes(client) -> tuple[int, int]:
    stats = client.get_inference_statistics("tiny").model_stats[0]
    return stats.inference_stats.success.count, stats.inference_stats.fail.count


def test_a_restricted_api_needs_its_metadata_and_the_rest_stay_open(rpool):
    client = rpool.client
    x, inp = _tiny_input()
    before = _successes(client)  # statistics are not restricted
    for headers in (None, {INFER_KEY: "v"}, {INFER_KEY: "v 1 "}, {ADMIN_KEY: "yes"}):
        assert _refused(lambda h=headers: client.infer("tiny", [inp], headers=h)) == REFUSED
    assert _successes(client) == before  # refused before the pool saw them: neither served nor failed
    out = client.infer("tiny", [inp], headers={INFER_KEY: "v 1"}).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, 2 * x + 1)
    assert _successes(client) == (before[0] + 1, before[1])
    assert _refused(lambda: client.is_server_live()) == REFUSED  # health is in the same group
    assert _refused(lambda: client.is_model_ready("tiny", headers={ADMIN_KEY: "yes"})) == REFUSED
    assert client.is_model_ready("tiny", headers={INFER_KEY: "v 1"})
    assert client.get_server_metadata().name == "gepool"  # metadata and config are not restricted
    assert client.get_model_config("tiny").config.max_batch_size > 0


def test_model_control_is_open_to_its_metadata(rpool):
    client = rpool.client
    message = _refused(lambda: client.unload_model("tiny", headers={INFER_KEY: "v 1"}))
    assert message == f"This protocol is restricted, expecting header '{ADMIN_KEY}'"
    assert _refused(lambda: client.get_model_repository_index()) == message
    client.unload_model("tiny", headers={ADMIN_KEY: "yes"})
    assert not client.is_model_ready("tiny", headers={INFER_KEY: "v 1"})
    client.load_model("tiny", headers={ADMIN_KEY: "yes"})
    assert client.is_model_ready("tiny", headers={INFER_KEY: "v 1"})


def test_a_stream_without_its_metadata_ends_unavailable(rpool):
    client = rpool.client
    x, inp = _tiny_input()
    for headers, expect in ((None, "refused"), ({INFER_KEY: "v 1"}, "served")):
        results = []
        client.start_stream(callback=lambda result, error, got=results: got.append((result, error)), headers=headers)
        try:
            client.async_stream_infer("tiny", [inp])
        except InferenceServerException as exc:  # the refusal may end the stream before the request is sent
            assert expect == "refused" and "no longer in valid state" in exc.message(), exc
        finally:
            client.stop_stream()  # waits for the stream to end
        if expect == "served":
            ((result, error),) = results
            assert error is None
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * x + 1)
        else:
            ((result, error),) = results
            assert result is None and "StatusCode.UNAVAILABLE" in str(error.status()) and REFUSED in str(error)


def test_raw_calls_the_first_copy_of_a_key_decides_and_grpc_health_is_health(rpool):
    with grpc.insecure_channel(f"127.0.0.1:{rpool.grpc_port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        request = health_pb2.HealthCheckRequest().SerializeToString()
        with pytest.raises(grpc.RpcError) as info:
            check(request, timeout=30)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, REFUSED)
        reply = health_pb2.HealthCheckResponse.FromString(
            check(request, timeout=30, metadata=[(INFER_KEY, "v 1")]))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            check(request, timeout=30, metadata=[(INFER_KEY, "no"), (INFER_KEY, "v 1")])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        check(request, timeout=30, metadata=[(INFER_KEY, "v 1"), (INFER_KEY, "no")])
        # repeated on one connection, each call's header block is all indexed (the native server's cached heads)
        for _ in range(3):
            for metadata, passes in (([(INFER_KEY, "v 1")], True), ([], False), ([(INFER_KEY, "v 2")], False)):
                try:
                    check(request, timeout=30, metadata=metadata)
                    assert passes, metadata
                except grpc.RpcError as exc:
                    assert not passes and exc.code() == grpc.StatusCode.UNAVAILABLE, (metadata, exc)
        # a request that is not even a message: refused for its metadata first, as Triton checks before reading
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            infer(b"\xff\xff", timeout=30)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, REFUSED)
        with pytest.raises(grpc.RpcError) as info:
            infer(b"\xff\xff", timeout=30, metadata=[(INFER_KEY, "v 1")])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_every_method_of_the_service_belongs_to_an_api():
    from gepool.grpc import grpc_service_pb2 as pb

    listed = {path for paths in METHODS.values() for path in paths}
    served = {f"/{SERVICE}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert served <= listed, sorted(served - listed)


@pytest.mark.parametrize("group, words", [
    ("inference", "--grpc-restricted-protocol option format is '<config name>:<setting>=<value>'. Got inference"),
    ("inferense:k=v", "unknown restricted protocol 'inferense'"),
    ("health:k=v --grpc-restricted-protocol=health,statistics:k2=v2",
     "restricted protocol 'health' can not be specified in multiple config groups"),
    ("inference:a/b=v", "'a/b' cannot be a gRPC metadata key"),
    ("inference:key-bin=v", "'key-bin' cannot be a gRPC metadata key"),
    ("inference:BIN=v", "'BIN' cannot be a gRPC metadata key"),  # triton-grpc-protocol-bin: a binary key
    ("inference:k=caf\u00e9", "the value of 'k' must be printable ASCII"),
])
def test_bad_groups_are_refused_naming_them(group, words):
    stderr = sidecar_refuses("--grpc-restricted-protocol", group)
    assert words in stderr, stderr


def test_a_refused_call_is_answered_without_waiting_for_its_request(rpool):
    """A call that never sends its message, or one past the size limit: refused for its metadata at once,
    where grpc.aio would wait for the message (the deadline) or refuse its size first."""
    with grpc.insecure_channel(f"127.0.0.1:{rpool.grpc_port}") as channel:
        for path in (f"/{SERVICE}/ModelInfer", f"/{SERVICE}/ModelStreamInfer"):
            never = channel.stream_unary(path)  # the same bytes on the wire as a unary call with no message
            with pytest.raises(grpc.RpcError) as info:
                never(iter(()), timeout=60)
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, REFUSED), path
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            infer(b"\0" * (2 * MAX_BODY), timeout=60)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, REFUSED)
        with pytest.raises(grpc.RpcError) as info:
            infer(b"\0" * (2 * MAX_BODY), timeout=60, metadata=[(INFER_KEY, "v 1")])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
