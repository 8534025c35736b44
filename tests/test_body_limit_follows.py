"""The sidecars' default body limit follows the models the front holds: a model loaded after start with larger
batches is served over HTTP and gRPC, and --http-max-body-bytes, when given, stays the limit."""

import os

import numpy as np
import pytest

from gepool import Pool
from gepool.http.limits import BODY_HEADROOM_BYTES, BodyLimit
from gepool.scheduler.regions import RegionBook, version_page, version_page_fd
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

ROWS = 40000  # 2.56 MB of input: past the limit a repository holding only an 8-row tiny starts with (~1 MiB)


def test_a_sidecar_reads_the_largest_slot_the_front_publishes():
    rw, ro = version_page_fd()
    book = RegionBook("t" * 32, rw)
    page = version_page(ro, False)
    try:
        follows, fixed = BodyLimit(5 << 20, page), BodyLimit(5 << 20)
        assert follows() == fixed() == 5 << 20  # nothing published yet: the size at start
        book.publish_largest_slot(64 << 20)
        assert follows() == (64 << 20) + BODY_HEADROOM_BYTES
        assert fixed() == 5 << 20
        book.publish_largest_slot(1 << 20)  # the large model went: never below the size at start
        assert follows() == 5 << 20
        with pytest.raises(TypeError):  # a sidecar's mapping cannot write the front's page
            page[8:16] = bytes(8)
    finally:
        del follows  # its view of the page, before the page closes
        page.close()
        book.close()
        os.close(rw)
        os.close(ro)


def _big(repo: str) -> None:
    test_repo.make_models.make_tiny(repo, "big", max_batch=ROWS)


def _http_infer(port: int, model: str, x: np.ndarray) -> np.ndarray:
    triton = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
    try:
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        out = triton.infer(model, [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
        return out.as_numpy("OUTPUT0")
    finally:
        triton.close()


def _grpc_infer(port: int, model: str, x: np.ndarray) -> np.ndarray:
    triton = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return triton.infer(model, [inp], client_timeout=120).as_numpy("OUTPUT0")
    finally:
        triton.close()


def _status(call) -> str:
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status())
    return "ok"


@pytest.mark.parametrize("http_server", ["httptools", "aiohttp"])
def test_a_model_loaded_after_start_with_larger_batches_is_served(tmp_path, http_server):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo, max_batch=8)
    x = np.ones((ROWS, 16), np.float32)
    with Pool(repo, http_port=free_port(), grpc_port=free_port(), model_control_mode="explicit",
              load_models=("tiny",), http_server=http_server) as pool:
        triton = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
        try:
            assert "413" in _status(lambda: _http_infer(pool.http_port, "tiny", x))  # the limit at start
            _big(repo)
            triton.load_model("big")
            np.testing.assert_array_equal(_http_infer(pool.http_port, "big", x), np.full((ROWS, 16), 3.0, np.float32))
            np.testing.assert_array_equal(_grpc_infer(pool.grpc_port, "big", x), np.full((ROWS, 16), 3.0, np.float32))
            triton.unload_model("big")  # the limit falls back once it has drained
            assert wait_until(lambda: "413" in _status(lambda: _http_infer(pool.http_port, "tiny", x)), 60)
            assert "RESOURCE_EXHAUSTED" in _status(lambda: _grpc_infer(pool.grpc_port, "tiny", x))
        finally:
            triton.close()


def test_a_body_limit_given_stays_the_limit(tmp_path):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo, max_batch=8)
    x = np.ones((ROWS, 16), np.float32)
    with Pool(repo, http_port=free_port(), grpc_port=free_port(), model_control_mode="explicit",
              load_models=("tiny",), http_max_body_bytes=2 << 20) as pool:
        triton = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
        try:
            _big(repo)
            triton.load_model("big")
            assert "413" in _status(lambda: _http_infer(pool.http_port, "big", x))
            assert "RESOURCE_EXHAUSTED" in _status(lambda: _grpc_infer(pool.grpc_port, "big", x))
            small = np.ones((1000, 16), np.float32)  # under the limit: served
            np.testing.assert_array_equal(_http_infer(pool.http_port, "big", small), np.full((1000, 16), 3.0,
                                                                                             np.float32))
        finally:
            triton.close()
