"""Triton's --http-address, --grpc-address and --metrics-address: each port on its own address (and
--allow-cpu-metrics)."""

import socket
import urllib.request

import pytest

from gepool import Pool
from gepool.http.servers import GRPC_SERVERS
from tests import repo as test_repo
from tests.conftest import free_port

grpcclient = pytest.importorskip("tritonclient.grpc")
ADDRESSES = {"http": "127.0.0.1", "grpc": "127.0.0.2", "metrics": "127.0.0.3"}  # all loopback on Linux


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=10).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("grpc_server", GRPC_SERVERS)
def test_each_port_binds_its_own_address_and_only_it(tmp_path, grpc_server):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    with Pool(repo, http_port=ports["http"], grpc_port=ports["grpc"], metrics_port=ports["metrics"],
              grpc_server=grpc_server, http_host=ADDRESSES["http"], grpc_host=ADDRESSES["grpc"],
              metrics_host=ADDRESSES["metrics"], cpu_metrics=grpc_server == "native") as pool:
        assert pool.status["http"] == f"http://127.0.0.1:{ports['http']}"
        assert pool.status["grpc"] == f"127.0.0.2:{ports['grpc']}"
        assert pool.status["metrics"] == f"http://127.0.0.3:{ports['metrics']}/metrics"
        for name, port in ports.items():
            for other, host in ADDRESSES.items():
                assert _accepts(host, port) == (other == name), (name, host)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/v2/health/ready", timeout=60) as reply:
            assert reply.status == 200
        with urllib.request.urlopen(pool.status["metrics"], timeout=60) as reply:
            text = reply.read()
        assert b"nv_inference_request_success" in text
        assert (b"\nnv_cpu_utilization " in text) == (grpc_server == "native")  # --allow-cpu-metrics false
        with grpcclient.InferenceServerClient(pool.status["grpc"]) as client:
            assert client.is_server_ready() and client.is_model_ready("tiny")
