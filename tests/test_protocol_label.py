"""Triton's per-request series carry a `protocol` label: each request counts under the surface it came by."""

import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gepool import Pool
from gepool.ipc import protocol
from tests.conftest import free_port, wait_until
from tests.repo import make_models
from tests.test_core import Harness, echo_model

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


def series(pool, name: str, **labels) -> dict[str, float]:
    """protocol label -> value of the samples of ``name`` matching ``labels``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{pool.metrics_port}/metrics", timeout=30).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # the parser reports Triton's suffix-less counters as "<name>_total"
            if s.name.removesuffix("_total") == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.labels["protocol"]] = s.value
    return out


def test_each_request_counts_under_the_protocol_it_came_by(tmp_path):
    repo = str(tmp_path / "models")
    make_models.make_tiny(repo)
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    with Pool(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()) as pool:
        assert series(pool, "nv_inference_request_success", model="tiny") == {"library": 0, "http": 0, "grpc": 0}
        h = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        assert (h.infer("tiny", [inp]).as_numpy("OUTPUT0") == 2 * x + 1).all()
        assert series(pool, "nv_inference_request_success", model="tiny") == {"library": 0, "http": 1, "grpc": 0}
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{pool.grpc_port}")
        for _ in range(2):
            inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            assert (g.infer("tiny", [inp]).as_numpy("OUTPUT0") == 2 * x + 1).all()
        assert (pool.client().infer("tiny", {"INPUT0": x})["OUTPUT0"] == 2 * x + 1).all()
        assert series(pool, "nv_inference_request_success", model="tiny") == {"library": 1, "http": 1, "grpc": 2}
        durations = series(pool, "nv_inference_request_duration_us", model="tiny")
        assert durations["grpc"] > 0 and durations["http"] > 0 and durations["library"] > 0, durations
        # a request the front refuses (a shape the config does not take) fails under its own protocol
        bad = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
        bad.set_data_from_numpy(x[:, :3])
        with pytest.raises(InferenceServerException, match="shape"):
            g.infer("tiny", [bad])
        assert wait_until(lambda: series(pool, "nv_inference_request_failure", model="tiny", reason="OTHER")
                          == {"library": 0, "http": 0, "grpc": 1})
        stats = pool.client().stats()["tiny"]
        assert stats["requests"] == 4 and stats["failures"] == 1  # Triton's statistics keep the totals


def test_the_front_refuses_an_origin_it_does_not_know(tmp_path):
    echo_model(str(tmp_path))
    h = Harness(tmp_path)
    try:
        h.ready_all()
        for origin in (7, -1, True, "http"):
            msg = protocol.Infer(1, "echo", protocol.NO_VERSION, [["INPUT", "FP32", [1, 4], 0]], None, 0, 0,
                                 protocol.NO_ARENA, 0, 0, origin=origin)
            h.core.on_message(b"\0client", [memoryview(msg.encode()), memoryview(np.ones((1, 4), np.float32))])
            ((_, reply, _),) = h.out.take()
            assert isinstance(reply, protocol.Error) and "origin must be one of [0, 1, 2]" in reply.message, reply
        assert h.core.status()["models"]["echo"]["queued"] == 0
        stats = h.core.control.groups["echo"].stats_dict()
        assert stats["protocols"]["library"]["failures"] == 4  # counted, under the origin it could not name
    finally:
        h.close()
