"""benchmarks/grpc_sync_proto.py, the sync server grpc_bench.py --compare-sync measures, answers as the sidecar does."""

import os
import subprocess
import sys
from concurrent import futures

import grpc
import numpy as np
import pytest

from gepool import Pool
from tests import repo as test_repo
from tests.conftest import free_port
from tests.test_protocol_label import series

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

PROTO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "grpc_sync_proto.py")


@pytest.fixture(scope="module")
def proto(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("sync-proto-models"))
    test_repo.make_models.make_tiny(repo)
    with Pool(repo, http_port=0, metrics_port=free_port()) as pool:
        port = free_port()
        proc = subprocess.Popen([sys.executable, PROTO, "--endpoint", pool.endpoint, "--port", str(port),
                                 "--threads", "4"], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            yield pool, f"127.0.0.1:{port}", proc
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
            proc.stdout.close()


def test_many_threads_calling_at_once_each_get_their_own_answer(proto):
    _, url, _ = proto
    xs = [np.full((1 + i % 3, 16), i, np.float32) for i in range(96)]

    def one(x: np.ndarray) -> np.ndarray:
        with grpcclient.InferenceServerClient(url) as c:
            inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            return c.infer("tiny", [inp]).as_numpy("OUTPUT0")

    with futures.ThreadPoolExecutor(12) as ex:  # more callers than the server's 4 threads: the rest queue
        got = list(ex.map(one, xs))
    for x, y in zip(xs, got):
        np.testing.assert_array_equal(y, 2 * x + 1)


def test_metadata_and_config_run_on_the_loop_and_errors_keep_their_status(proto):
    _, url, _ = proto
    with grpcclient.InferenceServerClient(url) as c:
        assert c.get_model_metadata("tiny", as_json=True)["inputs"][0]["name"] == "INPUT0"
        assert c.get_model_config("tiny", as_json=True)["config"]["name"] == "tiny"
        with pytest.raises(InferenceServerException) as info:
            c.get_model_metadata("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
        with pytest.raises(InferenceServerException) as info:
            c.infer("nope", [inp])
        assert info.value.status() == "StatusCode.NOT_FOUND"
    with grpc.insecure_channel(url) as ch:
        with pytest.raises(grpc.RpcError) as info:
            ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")(b"\xff\xff", timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ModelInferRequest" in info.value.details()


def test_its_requests_count_as_grpc(proto):
    pool, url, _ = proto
    before = series(pool, "nv_inference_request_success", model="tiny")
    with grpcclient.InferenceServerClient(url) as c:
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
        for _ in range(3):
            c.infer("tiny", [inp])
    after = series(pool, "nv_inference_request_success", model="tiny")
    assert after["grpc"] - before["grpc"] == 3 and after["library"] == before["library"], (before, after)
