"""Security defaults: owner-only endpoint and segments, CURVE for tcp endpoints with keys from files."""

import os
import stat

import numpy as np
import pytest
import zmq.auth

from gepool import Client, Pool
from gepool.common import errors
from tests import repo as test_repo


@pytest.fixture
def tiny_repo(tmp_path):
    models = str(tmp_path / "models")
    test_repo.make_models.make_tiny(models)
    return models


def test_ipc_endpoint_is_owner_only(pool):
    path = pool.endpoint[len("ipc://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_curve_admits_authorized_keys_only(tiny_repo, tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    os.rename(client_public, allowed / "client.key")
    x = np.arange(16, dtype=np.float32)[None]
    with Pool(tiny_repo, endpoint="tcp://127.0.0.1:*", curve_secret_key=server_secret,
              curve_authorized_keys=str(allowed)) as pool:
        with Client(pool.endpoint, curve_server_key=server_public, curve_client_key=client_secret) as c:
            np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
        for kwargs in ({"curve_server_key": server_public, "curve_client_key": stranger_secret}, {}):
            with pytest.raises(errors.PoolUnavailable):  # refused in the handshake: no answer at all
                Client(pool.endpoint, connect_timeout=2, **kwargs)
        assert pool.client().infer("tiny", {"INPUT0": x})["OUTPUT0"][0, 1] == 3.0  # the owner's own keys


def test_a_zmq_client_cannot_name_itself_as_a_lane(pool):
    """libzmq lets a peer choose its routing id: one shaped as a lane's (the pool mints them from 1) is refused
    PermissionDenied over ZMQ, where the front took it for that lane's client and sent its answers, its
    arenas and its uid that way; the lane's own client is served as before."""
    import struct

    from gepool.ipc import protocol

    lane_client = pool.client()
    x = np.ones((1, 16), np.float32)
    np.testing.assert_array_equal(lane_client.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
    ctx = zmq.Context()
    try:
        forger = ctx.socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        forger.setsockopt(zmq.ROUTING_ID, struct.pack("<BQ", 1, 1))
        forger.connect(pool.endpoint)
        forger.send(protocol.Query(7, "status", {}).encode())
        assert forger.poll(30_000), "no answer: the front answered the lane named by the forged id"
        reply = protocol.decode(forger.recv_multipart()[0])
        assert isinstance(reply, protocol.Error) and reply.code == errors.PermissionDenied.code, reply
        assert "ZMQ_ROUTING_ID" in reply.message
    finally:
        ctx.destroy(linger=0)
    np.testing.assert_array_equal(lane_client.infer("tiny", {"INPUT0": x})["OUTPUT0"], 2 * x + 1)
