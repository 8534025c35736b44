"""The HTTP sidecar against a hostile local user (a real second uid, forked and setuid) and hostile bytes."""

import encodings.idna  # noqa: F401  (http.client imports it lazily; after setuid the child may not read it)
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gepool import Pool
from gepool.http import peer
from tests import repo as test_repo
from tests.conftest import SIDECAR_SERVERS, _descendants, free_port, rss_kb, sidecar_pid, sidecar_refuses, wait_until

NOBODY = 65534
GOOD = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": list(range(16))}]}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="attacking as a second user needs root to setuid(65534)")


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gate") / "gate")


@pytest.fixture(scope="module", params=SIDECAR_SERVERS)
def hpool(tmp_path_factory, gate, request):
    repo = str(tmp_path_factory.mktemp("hostile-models"))
    test_repo.make_models.make_tiny(repo)
    test_repo.bytes_model(repo)
    test_repo.recorder(repo, "recorder", gate=gate, delay_us=0, preferred="1")
    # one sidecar whatever the host's cores: the tests watch its process (memory, descriptors, restarts)
    with Pool(repo, http_port=free_port(), model_control_mode="explicit", sidecars=1,
              load_models=("tiny", "shout", "recorder"), http_server=request.param) as pool:
        yield pool


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
            timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data) if data else {}
        except ValueError:
            return resp.status, {"raw": data[:200].decode("latin-1")}
    finally:
        conn.close()


def post(port: int, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    return request(port, "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)


def as_nobody(fn, *args):
    """Runs fn(*args) in a forked child that has become uid/gid 65534; returns what it returned (JSON)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = json.dumps(fn(*args)).encode()
        except BaseException as exc:
            out, code = json.dumps({"child_error": repr(exc)}).encode(), 1
        with os.fdopen(write_fd, "wb") as w:
            w.write(out)
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as r:
        data = r.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    assert not (isinstance(result, dict) and "child_error" in result), result
    return result


def segment(name: str, data: bytes, mode: int = 0o600) -> str:
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


SECRET = b"S" * 64


@root_only
def test_another_users_memory_cannot_be_registered(hpool, tmp_path):
    """Root's owner-only segment, names of gepool's arena and ring segments, and a symbolic link planted
    in /dev/shm to an owner-only file: every registration refused with a 4xx, nothing read or written."""
    port, tag = hpool.http_port, f"{os.getpid()}"
    victim = segment(f"victim_{tag}", SECRET)
    arena = segment(f"gepool.{tag}x0bad.arena", SECRET)
    ring = segment(f"gepool.{tag}x0bad.w0.0", SECRET)
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    os.chmod(secret_file, 0o600)
    os.chmod(tmp_path, 0o755)
    link = f"/dev/shm/link_{tag}"

    def attack():
        os.symlink(str(secret_file), link)
        own = segment(f"nobody_gepool.{tag}", b"\0" * 64)  # a segment of the attacker's own, named like ours
        os.rename(own, f"/dev/shm/gepool.{tag}x0own.arena")
        out = {}
        for i, key in enumerate([f"/victim_{tag}", f"/gepool.{tag}x0bad.arena", f"gepool.{tag}x0bad.w0.0",
                                 f"/link_{tag}", f"/gepool.{tag}x0own.arena"]):
            out[key] = post(port, f"/v2/systemsharedmemory/region/r{i}/register",
                            {"key": key, "offset": 0, "byte_size": 64})
        out["status"] = request(port, "GET", "/v2/systemsharedmemory/status")
        return out

    try:
        result = as_nobody(attack)
    finally:
        for path in (victim, arena, ring, link, f"/dev/shm/gepool.{tag}x0own.arena"):
            if os.path.lexists(path):
                os.unlink(path)
    status = result.pop("status")
    for key, (code, reply) in result.items():
        assert 400 <= code < 500, (key, code, reply)
    assert "belongs to uid 0" in result[f"/victim_{tag}"][1]["error"]
    assert "gepool's own segments" in result[f"/gepool.{tag}x0bad.arena"][1]["error"]
    assert "gepool's own segments" in result[f"gepool.{tag}x0bad.w0.0"][1]["error"]
    assert "gepool's own segments" in result[f"/gepool.{tag}x0own.arena"][1]["error"]
    assert "symbolic link" in result[f"/link_{tag}"][1]["error"]
    assert status == [200, []]
    assert secret_file.read_bytes() == SECRET


@root_only
def test_a_user_uses_only_its_own_regions_and_a_truncated_one_is_a_400(hpool):
    """The second user registers and uses its own segment (so it is identified); it cannot use, list or
    unregister root's region of the same name; truncating its segment under use is a 400 and the
    sidecar lives on."""
    port, tag = hpool.http_port, f"{os.getpid()}"
    x = np.arange(16, dtype=np.float32)[None]
    root_key = f"/root_in_{tag}"
    segment(root_key[1:], SECRET)
    assert post(port, "/v2/systemsharedmemory/region/in/register", {"key": root_key, "byte_size": 64})[0] == 200
    before = sidecar_pid(hpool)

    def attack():
        path = segment(f"nobody_in_{tag}", x.tobytes())
        segment(f"nobody_out_{tag}", b"\0" * 64)
        out = {"list": request(port, "GET", "/v2/systemsharedmemory/status"),
               "root_in": post(port, "/v2/models/tiny/infer", {"inputs": [{
                   "name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                   "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 64}}]}),
               "unregister_all": post(port, "/v2/systemsharedmemory/unregister", b"")}
        for name in ("mine_in", "mine_out"):
            key = f"/nobody_{name[5:]}_{tag}"
            out[name] = post(port, f"/v2/systemsharedmemory/region/{name}/register", {"key": key, "byte_size": 64})
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {
            "shared_memory_region": "mine_in", "shared_memory_byte_size": 64}}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"shared_memory_region": "mine_out",
                                                           "shared_memory_byte_size": 64}}]}
        out["own"] = post(port, "/v2/models/tiny/infer", body)
        with open(f"/dev/shm/nobody_out_{tag}", "rb") as f:
            out["own_output"] = np.frombuffer(f.read(), np.float32).tolist()
        os.truncate(path, 0)
        out["truncated_in"] = post(port, "/v2/models/tiny/infer", body)
        with open(path, "wb") as f:
            f.write(x.tobytes())
        os.truncate(f"/dev/shm/nobody_out_{tag}", 8)
        out["truncated_out"] = post(port, "/v2/models/tiny/infer", body)
        out["after"] = post(port, "/v2/models/tiny/infer", GOOD)
        out["mine"] = request(port, "GET", "/v2/systemsharedmemory/status")
        post(port, "/v2/systemsharedmemory/unregister", b"")
        for p in (path, f"/dev/shm/nobody_out_{tag}"):
            os.unlink(p)
        return out

    try:
        out = as_nobody(attack)
        assert out["list"] == [200, []]  # root's region is not listed to another user
        assert out["root_in"][0] == 400 and "Unable to find system shared memory region: 'in'" in out["root_in"][1][
            "error"]
        assert out["mine_in"][0] == out["mine_out"][0] == 200, out
        assert out["own"][0] == 200, out["own"]
        np.testing.assert_array_equal(out["own_output"], (2 * x + 1)[0])
        for case in ("truncated_in", "truncated_out"):
            assert out[case][0] == 400 and "was truncated" in out[case][1]["error"], out[case]
        assert out["after"][0] == 200
        assert [r["name"] for r in out["mine"][1]] == ["mine_in", "mine_out"]
        assert sidecar_pid(hpool) == before  # no SIGBUS, no restart
        code, regions = request(port, "GET", "/v2/systemsharedmemory/status")  # root's survived the unregister
        assert [r["name"] for r in regions] == ["in"]
    finally:
        post(port, "/v2/systemsharedmemory/unregister", b"")
        os.unlink(f"/dev/shm/{root_key[1:]}")


@root_only
def test_only_the_pools_user_loads_and_unloads(hpool):
    port = hpool.http_port
    code, reply = as_nobody(post, port, "/v2/repository/models/tiny/unload", b"")
    assert code == 403 and "allowed only to the pool's own user" in reply["error"]
    assert request(port, "GET", "/v2/models/tiny/ready")[0] == 200
    assert as_nobody(post, port, "/v2/repository/index", b"")[0] == 200  # reading the index stays open


def test_the_peer_of_a_closed_connection_is_not_root():
    """Once a client closes its socket the kernel reports uid 0 for it: that must read as unidentified."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        client = socket.socket()
        client.connect(srv.getsockname())
        conn, _ = srv.accept()
        with conn:
            assert peer.peer_uid(conn.getpeername(), conn.getsockname()) == os.geteuid()
            assert peer._proc(*map(peer._ip, (conn.getpeername()[0],)), conn.getpeername()[1],
                              peer._ip(conn.getsockname()[0]), conn.getsockname()[1]) == os.geteuid()
            client.close()
            assert wait_until(lambda: _unidentified(conn))
    with pytest.raises(peer.Unidentified, match="not on this host's loopback"):
        peer.peer_uid(("10.1.2.3", 5000), ("127.0.0.1", 8000))


def test_a_wildcard_listener_identifies_the_one_socket_its_peer_has():
    """A listener on 0.0.0.0 knows its port but not the connection's local address: the peer is the one
    established socket at the client's address connected to that port; a second one from the same source
    address and port (to another loopback address) makes both unidentified."""
    with socket.socket() as srv:
        srv.bind(("0.0.0.0", 0))
        srv.listen()
        port = srv.getsockname()[1]
        first = socket.socket()
        first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.bind(("127.0.0.1", 0))
        first.connect(("127.0.0.1", port))
        conn, peername = srv.accept()
        with first, conn:
            assert peer.peer_uid(peername, ("0.0.0.0", port)) == os.geteuid()
            assert peer.peer_uid(("::ffff:" + peername[0], peername[1]), ("::", port)) == os.geteuid()
            with pytest.raises(peer.Unidentified, match="not on this host's loopback"):
                peer.peer_uid(("10.1.2.3", peername[1]), ("0.0.0.0", port))
            with socket.socket() as twin:
                twin.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                twin.bind(first.getsockname())
                twin.connect(("127.0.0.2", port))
                other, _ = srv.accept()
                with other, pytest.raises(peer.Unidentified, match="more than one socket"):
                    peer.peer_uid(peername, ("0.0.0.0", port))


@pytest.mark.parametrize("server", SIDECAR_SERVERS)
def test_the_owner_is_identified_on_a_wildcard_bind(tmp_path, server):
    """--http-host 0.0.0.0: the owner's shared-memory register and model unload are served, not refused."""
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    key = f"/wild_{os.getpid()}_{server}"
    segment(key[1:], b"\0" * 64)
    try:
        with Pool(repo, http_host="0.0.0.0", http_port=free_port(), http_server=server,
                  model_control_mode="explicit", load_models=("tiny",)) as pool:
            port = pool.http_port
            assert post(port, "/v2/systemsharedmemory/region/w/register", {"key": key, "byte_size": 64}) == (200, {})
            assert post(port, "/v2/repository/models/tiny/unload", b"")[0] == 200
    finally:
        os.unlink(f"/dev/shm/{key[1:]}")


def _unidentified(conn) -> bool:
    try:
        peer.peer_uid(conn.getpeername(), conn.getsockname())
    except peer.Unidentified:
        return True
    return False


# -- bad input is a 400 that says what was wrong ------------------------------------------------------
def _infer(datatype: str, data, shape=(1, 16)) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": list(shape), "datatype": datatype, "data": data}]}


@pytest.mark.parametrize("path, body, words", [
    ("/v2/models/tiny/infer", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("/v2/models/tiny/infer", _infer("FP32", [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
                                                [1, 1]), "nested more than"),
    ("/v2/models/shout/infer", {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [3]}]},
     "must be strings"),
    ("/v2/models/tiny/infer", _infer("FP32", ["1"] * 16), "must be numbers"),
    ("/v2/models/tiny/versions/abc/infer", GOOD, "version should be an integral value > 0"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                           "parameters": {"shared_memory_region": "r",
                                                          "shared_memory_offset": "abc",
                                                          "shared_memory_byte_size": 64}}]},
     "input 'INPUT0': parameter 'shared_memory_offset' must be a non-negative integer, got 'abc'"),  # gRPC's words
    ("/v2/models/tiny/infer", {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                           "parameters": {"shared_memory_region": "r",
                                                          "shared_memory_byte_size": "lots"}}]},
     "input 'INPUT0': parameter 'shared_memory_byte_size' must be a non-negative integer, got 'lots'"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                           "parameters": [1]}]}, "'parameters' must be an object"),
    ("/v2/systemsharedmemory/region/x/register", {"key": "/a\u0000b", "byte_size": 64}, "must name one object"),
    ("/v2/systemsharedmemory/region/x/register", {"key": "/..", "byte_size": 64}, "must name one object"),
    ("/v2/systemsharedmemory/region/x/register", {"key": "/k", "byte_size": "64"}, "byte_size must be"),
    ("/v2/models/tiny/infer", {"inputs": []}, "expected 1 inputs but got 0 inputs for model 'tiny'"),
    ("/v2/models/nosuch/infer", b"{garbage", "unknown model"),
    ("/v2/models/nosuch/infer", {"inputs": []}, "unknown model"),
    ("/v2/models/tiny/infer", {**GOOD, "outputs": [{"name": "OUTPUT0"}] * 2}, "output 'OUTPUT0' is requested twice"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [0, 2**70], "data": []}]},
     "shape dimension 1180591620717411303424 is past the largest a tensor may have (9223372036854775807)"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [0, 2**61, 2**61],
                                           "data": []}]},
     "input 'INPUT0': shape [0, 2305843009213693952, 2305843009213693952] of FP32 needs"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [0] * 100, "data": []}]},
     "input 'INPUT0': shape has 100 dimensions, more than the 32 gepool allows"),
    ("/v2/models/tiny/infer", {**GOOD, "parameters": {"timeout": 10**23}},
     "parameter 'timeout' must be an integer in 0..9223372036854775807, got 100000000000000000000000"),
    ("/v2/models/tiny/infer", {**GOOD, "parameters": {"priority": 2**64}},
     "parameter 'priority' must be an integer in 0..18446744073709551615"),
    ("/v2/models/tiny/infer", {**GOOD, "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 10**23}}]},
     "output 'OUTPUT0': parameter 'classification' must be an integer in 0..9223372036854775807"),
    ("/v2/models/tiny/versions/99999999999999999999999/infer", GOOD,
     "version should be an integral value in 1..9223372036854775807"),
    ("/v2/models/shout/infer", {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
                                            "data": ["\ud800"]}]}, "input 'TEXT': BYTES data must be valid UTF-8"),
    ("/v2/models/tiny/infer", {"inputs": [{**GOOD["inputs"][0], "name": "\ud800"}]},
     "input name '\\ud800' is not valid UTF-8"),
    ("/v2/models/tiny/infer", {**GOOD, "outputs": [{"name": "\udfff"}]}, "output name '\\udfff' is not valid UTF-8"),
    ("/v2/repository/models/tiny/load", {"parameters": "abc"}, "'parameters' must be an object"),
    ("/v2/repository/models/tiny/load", {"parameters": [1]}, "'parameters' must be an object"),
    ("/v2/repository/index", {"ready": "false"}, "'ready' must be a bool (true or false), got 'false'"),
    ("/v2/repository/index", {"ready": 1}, "'ready' must be a bool (true or false), got 1"),
    ("/v2/models/tiny/infer", {**GOOD, "outputs": [{"name": "OUTPUT0", "parameters": {"bogus": 1}}]},
     "output 'OUTPUT0': parameter 'bogus' is not supported by gepool (supported: binary_data, classification, "
     "shared_memory_region, shared_memory_byte_size, shared_memory_offset)"),
    ("/v2/models/tiny/infer", {**GOOD, "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": "false"}}]},
     "output 'OUTPUT0': 'binary_data' must be a bool (true or false), got 'false'"),
    ("/v2/models/tiny/infer", {"inputs": [{**GOOD["inputs"][0], "parameters": {"binary_data_size": 0}}]},
     "input 'INPUT0': 'data' and 'binary_data_size' are both given"),
    ("/v2/models/tiny/infer", {"inputs": [{**GOOD["inputs"][0], "parameters": {"shared_memory_region": "r"}}]},
     "input 'INPUT0': 'data' and 'shared_memory_region' are both given"),
], ids=["deep-json", "deep-data", "bytes-not-str", "str-for-fp32", "version-abc", "offset-abc", "size-lots",
        "parameters-list", "key-nul", "key-dotdot", "size-str", "no-inputs", "unknown-model-garbage",
        "unknown-model-no-inputs", "output-twice", "dim-past-int64", "zero-size-past-numpy", "100-dims",
        "timeout-past-int64", "priority-past-uint64", "classification-past-int64", "version-past-int64",
        "bytes-surrogate", "input-name-surrogate", "output-name-surrogate", "load-parameters-str",
        "load-parameters-list", "index-ready-str", "index-ready-int", "output-parameter-unknown", "binary-data-str",
        "data-and-binary", "data-and-shm"])
def test_bad_input_is_a_400_naming_it(hpool, path, body, words):
    code, reply = post(hpool.http_port, path, body)
    assert code == 400, reply
    assert words in reply["error"] and "Traceback" not in reply["error"]
    assert post(hpool.http_port, "/v2/models/tiny/infer", GOOD)[0] == 200


def test_a_shared_memory_offset_past_the_region_is_a_400(hpool):
    """A BYTES input (its size is not known from its shape) read from past its region's end: the size left
    was negative, and numpy's error a 500."""
    port, tag = hpool.http_port, f"{os.getpid()}"
    path = segment(f"offset_{tag}", b"\0" * 64)
    try:
        assert post(port, "/v2/systemsharedmemory/region/r1/register", {"key": f"/offset_{tag}", "byte_size": 64})[
            0] == 200
        body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "parameters": {
            "shared_memory_region": "r1", "shared_memory_offset": 100}}]}
        code, reply = post(port, "/v2/models/shout/infer", body)
        assert code == 400 and reply["error"] == "[100, 100) lies outside shared memory region 'r1' of 64 bytes"
        ran = request(port, "GET", "/v2/models/tiny/stats")[1]["model_stats"][0]["inference_stats"]["success"]
        past = {**GOOD, "outputs": [{"name": "OUTPUT0", "parameters": {  # found only after the model had run
            "shared_memory_region": "r1", "shared_memory_offset": 8, "shared_memory_byte_size": 64}}]}
        code, reply = post(port, "/v2/models/tiny/infer", past)
        assert code == 400 and reply["error"] == "[8, 72) lies outside shared memory region 'r1' of 64 bytes"
        assert request(port, "GET", "/v2/models/tiny/stats")[1]["model_stats"][0]["inference_stats"]["success"] \
            == ran
    finally:
        post(port, "/v2/systemsharedmemory/region/r1/unregister", b"")
        os.unlink(path)
    assert post(port, "/v2/models/tiny/infer", GOOD)[0] == 200


def test_statistics_of_a_version_the_model_lacks_are_refused(hpool):
    """As gRPC's ModelStatistics does (HTTP answered version 1's statistics)."""
    port = hpool.http_port
    code, reply = request(port, "GET", "/v2/models/tiny/versions/2/stats")
    assert code == 400 and "'tiny' version 2 is not found" in reply["error"], reply
    code, reply = request(port, "GET", "/v2/models/tiny/versions/1/stats")
    assert code == 200 and [s["name"] for s in reply["model_stats"]] == ["tiny"]


@pytest.mark.parametrize("text", [" 13 ", "1_3", "\u0661\u0663", "+13", "13\n"])
def test_the_header_length_is_ascii_digits_only(text):
    """int() reads each of these as 13 (or 10): Triton's header is a plain decimal count."""
    from gepool.common.errors import InvalidArgument
    from gepool.http import kserve

    with pytest.raises(InvalidArgument, match="Inference-Header-Content-Length must be an integer"):
        kserve.header_length(b"{}" * 20, text)
    assert kserve.header_length(b"{}" * 20, "13") == 13


def test_an_odd_header_length_is_a_400_over_http(hpool):
    body = json.dumps(GOOD).encode()
    length = str(len(body))
    code, reply = post(hpool.http_port, "/v2/models/tiny/infer", body,
                       {"Inference-Header-Content-Length": f"{length[0]}_{length[1:]}"})  # int() read it as the length
    assert code == 400 and "must be an integer" in reply["error"], reply


@pytest.mark.parametrize("datatype, value, words", [
    ("INT8", 300, "value 300 is out of range for INT8"),
    ("UINT8", -1, "value -1 is out of range for UINT8"),
    ("INT32", 1.5, "INT32 data must be integers"),
    ("INT64", 2**70, "out of range for INT64"),
    ("BOOL", 1, "BOOL data must be true or false"),
])
def test_json_values_are_checked_against_their_datatype(datatype, value, words):
    from gepool.common.errors import InvalidArgument
    from gepool.http import kserve

    body = json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": datatype, "data": [0, value]}]})
    with pytest.raises(InvalidArgument, match=words.replace("[", r"\[")):
        kserve.parse_request(body.encode(), None)


def test_data_null_beside_binary_data_is_unset_not_a_second_copy():
    """Clients that write unset fields as null send "data": null with binary_data_size: that was valid before
    data given two ways was refused, and still is."""
    from gepool.http import kserve

    x = np.arange(4, dtype=np.float32)
    head = json.dumps({"inputs": [{"name": "X", "shape": [4], "datatype": "FP32", "data": None,
                                   "parameters": {"binary_data_size": 16}}]}).encode()
    req = kserve.parse_request(head + x.tobytes(), str(len(head)))
    np.testing.assert_array_equal(req.inputs["X"], x)


# -- declared sizes ------------------------------------------------------------------------------------
def _raw(port: int, head: bytes, body: bytes, wait: float = 60) -> tuple[int, bytes]:
    """Sends exactly these bytes and returns the status and reply (0 if the sidecar closed silently, which
    includes closing before it took all of them)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        try:
            s.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed mid-send: whatever it answered first may still be readable
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
    return (int(data.split()[1]) if data else 0), data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.mark.parametrize("path", ["/v2/models/tiny/infer", "/v2/systemsharedmemory/region/r/register"])
def test_a_json_body_declared_over_the_json_limit_is_refused_unread(hpool, path):
    from gepool.http.limits import MAX_JSON_BYTES

    # no byte of the body is sent: a sidecar that waited for it would answer 408 after its body timeout
    code, data = _raw(hpool.http_port, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                      % (path.encode(), MAX_JSON_BYTES + 1), b"")
    assert code == 413, data[:300]
    assert b"the request JSON of %d bytes is over the %d-byte limit" % (MAX_JSON_BYTES + 1, MAX_JSON_BYTES) in data


def test_oversized_declarations_cost_no_memory_and_stall_no_one(hpool):
    port = hpool.http_port
    pid = sidecar_pid(hpool)
    served, stop = [], threading.Event()

    def others():
        while not stop.is_set():
            served.append(post(port, "/v2/models/tiny/infer", GOOD)[0])

    before = rss_kb(pid)
    bystander = threading.Thread(target=others)
    bystander.start()
    try:
        for rows, words in [(300_000_000, "of BYTES needs 1200000000 bytes, past the"), (1000, "hold at most 2")]:
            bytes_header = json.dumps({"inputs": [{"name": "TEXT", "shape": [rows, 1], "datatype": "BYTES",
                                                   "parameters": {"binary_data_size": 8}}]}).encode()
            code, reply = post(port, "/v2/models/shout/infer", bytes_header + b"\0" * 8,
                               {"Inference-Header-Content-Length": str(len(bytes_header))})
            assert code == 400 and words in reply["error"], reply
        code, data = _raw(port, b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2147483648\r\n"
                          b"\r\n", b"{}" * 50)
        assert code == 413 and b"--http-max-body-bytes" in data
        big_json = (b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":['
                    + b"0," * 9_500_000 + b"0]}]}")
        code, data = _raw(port, b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                          % len(big_json), big_json)
        assert code == 413, data[:300]
        code, data = _raw(port, b"POST /v2/systemsharedmemory/region/r/register HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(big_json), big_json)
        assert code == 413, data[:300]
        assert rss_kb(pid) - before < 50 * 1024, (before, rss_kb(pid))
    finally:
        stop.set()
        bystander.join()
    assert served and set(served) == {200}
    print(f"sidecar RSS {before} kB -> {rss_kb(pid)} kB; {len(served)} other requests answered meanwhile")


@root_only
def test_a_huge_shared_memory_declaration_is_refused_before_reading(hpool):
    port, tag = hpool.http_port, os.getpid()
    pid = sidecar_pid(hpool)
    before = rss_kb(pid)

    def attack():
        path = f"/dev/shm/nobody_huge_{tag}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4 << 30)  # sparse: costs the attacker nothing
        os.close(fd)
        try:
            reg = post(port, "/v2/systemsharedmemory/region/huge/register", {"key": path[8:], "byte_size": 4 << 30})
            infer = post(port, "/v2/models/shout/infer", {"inputs": [{
                "name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
                "parameters": {"shared_memory_region": "huge", "shared_memory_byte_size": 4 << 30}}]})
            post(port, "/v2/systemsharedmemory/unregister", b"")
        finally:
            os.unlink(path)
        return [reg, infer]

    reg, infer = as_nobody(attack)
    assert reg[0] == 200
    assert infer[0] == 400 and "limit of one request" in infer[1]["error"]
    assert rss_kb(pid) - before < 50 * 1024
    print(f"sidecar RSS {before} kB -> {rss_kb(pid)} kB after a 4 GiB shared-memory declaration")


def test_unregistering_an_output_region_during_a_request_does_not_fail_it(hpool, gate):
    import tritonclient.utils.shared_memory as shm

    port = hpool.http_port
    x = np.full((1, 4), -1, np.float32)  # negative: the recorder holds the batch while the gate exists
    key = f"/gepool_test_hold_{os.getpid()}"
    handle = shm.create_shared_memory_region("hold", key, 64)
    open(gate, "w").close()
    try:
        assert post(port, "/v2/systemsharedmemory/region/hold/register", {"key": key, "byte_size": 64})[0] == 200
        body = {"inputs": [{"name": "INPUT", "shape": [1, 4], "datatype": "FP32", "data": x.ravel().tolist()}],
                "outputs": [{"name": "OUTPUT", "parameters": {"shared_memory_region": "hold",
                                                              "shared_memory_byte_size": 16}}]}
        result = []
        t = threading.Thread(target=lambda: result.append(post(port, "/v2/models/recorder/infer", body)))
        t.start()
        assert wait_until(lambda: hpool.client().status()["models"]["recorder"]["slots_busy"] > 0)
        assert post(port, "/v2/systemsharedmemory/region/hold/unregister", b"")[0] == 200  # while it runs
        assert request(port, "GET", "/v2/systemsharedmemory/status") == (200, [])
        os.unlink(gate)
        t.join(60)
        assert result and result[0][0] == 200, result
        assert result[0][1]["outputs"][0]["parameters"]["shared_memory_region"] == "hold"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 4]), x)
    finally:
        if os.path.exists(gate):
            os.unlink(gate)
        shm.destroy_shared_memory_region(handle)


def test_a_requests_timeout_is_the_queues_not_the_sidecars_wait(hpool):
    """Triton's ``timeout`` parameter (µs) is the queue policy's, and only with allow_timeout_override: on a
    model without one, a 1 µs timeout is served as Triton serves it, where the sidecar used to stop waiting
    after 1 µs and answer 503 "no answer from the pool ... in time", naming the pool's socket."""
    for timeout in (1, 100, 2000):
        body = dict(GOOD, parameters={"timeout": timeout})
        code, reply = post(hpool.http_port, "/v2/models/tiny/infer", body)
        assert code == 200, (timeout, reply)


# -- Triton's --http-restricted-api, and a body that never arrives ----------------------------------------
RESTRICTED_MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def restricted(hpool):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gepool.http.server", "--endpoint", hpool.endpoint,
                             "--http-port", str(port), "--metrics-port", "0", "--http-body-timeout-s", "2",
                             "--http-server", hpool.http_server, "--http-max-body-bytes", str(RESTRICTED_MAX_BODY),
                             "--http-restricted-api=model-repository,shared-memory:admin-key=s3cret",
                             "--http-restricted-api", "statistics:stats-key=v"])
    try:
        assert wait_until(lambda: _listening(port), 60)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_restricted_apis_need_their_header(restricted):
    port = restricted
    code, reply = post(port, "/v2/repository/models/tiny/unload", b"")
    assert (code, reply) == (403, {"error": "This API is restricted, expecting header 'admin-key'"})
    assert request(port, "GET", "/v2/systemsharedmemory/status")[0] == 403
    assert request(port, "GET", "/v2/models/stats", headers={"admin-key": "s3cret"})[0] == 403  # its own key
    assert request(port, "GET", "/v2/models/stats", headers={"stats-key": "v"})[0] == 200
    assert post(port, "/v2/repository/index", b"", {"admin-key": "wrong"})[0] == 403
    assert post(port, "/v2/repository/index", b"", {"admin-key": "s3cret"})[0] == 200
    assert request(port, "GET", "/v2/systemsharedmemory/status", headers={"admin-key": "s3cret"}) == (200, [])
    assert post(port, "/v2/models/tiny/infer", GOOD)[0] == 200  # inference is not restricted here
    assert request(port, "GET", "/v2/health/ready")[0] == 200


def test_a_repeated_header_counts_by_its_first_copy(restricted):
    """Two copies of the restriction header: the first decides, on both servers (aiohttp's get)."""
    head = b"GET /v2/systemsharedmemory/status HTTP/1.1\r\nHost: x\r\nadmin-key: %s\r\nadmin-key: %s\r\n\r\n"
    assert _raw(restricted, head % (b"wrong", b"s3cret"), b"")[0] == 403
    assert _raw(restricted, head % (b"s3cret", b"wrong"), b"")[0] == 200


@pytest.mark.parametrize("group, words", [
    ("model-repository", "option format is '<config name>:<setting>=<value>'. Got model-repository"),
    ("model-reposit:k=v", "unknown restricted api 'model-reposit'"),
    ("health,model-repository:k=v --http-restricted-api=health:k2=v2",
     "restricted api 'health' can not be specified in multiple config groups"),
])
def test_bad_restricted_api_groups_are_refused(group, words):
    stderr = sidecar_refuses("--http-restricted-api", group)
    assert words in stderr, stderr


def test_a_body_that_never_arrives_is_answered_and_others_are_not_stalled(restricted):
    port = restricted
    with socket.create_connection(("127.0.0.1", port), timeout=60) as liar:
        liar.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"in")
        start = time.monotonic()
        assert post(port, "/v2/models/tiny/infer", GOOD)[0] == 200  # answered while the liar waits
        reply = liar.recv(65536)
        assert reply.split()[1] == b"408" and b"did not arrive within 2 s" in reply
        assert time.monotonic() - start < 50
        assert liar.recv(65536) == b""  # and the connection is closed


def test_a_connection_that_never_finishes_its_headers_is_closed(restricted):
    """Slow loris on the headers: connections that send half a request line's headers and stop are closed
    within the body timeout (2 s here), and others are served meanwhile."""
    port = restricted
    lorises = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(20)]
    try:
        for s in lorises:
            s.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert post(port, "/v2/models/tiny/infer", GOOD)[0] == 200
        for s in lorises:
            assert s.recv(65536) == b""  # closed by the sidecar, not left open for its hour-long default
    finally:
        for s in lorises:
            s.close()


def test_a_chunked_body_is_bounded_while_it_arrives(restricted):
    """No Content-Length to refuse by: the body is counted as it arrives and refused 413 past the limit,
    and the sidecar does not hold the rest; a chunked body under the limit is served."""
    port = restricted
    chunk = b"%x\r\n%s\r\n" % (64 << 10, b" " * (64 << 10))
    head = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            for _ in range(4 * RESTRICTED_MAX_BODY // (64 << 10)):  # 4 MiB, unless the sidecar stops reading
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = s.recv(65536)
    assert reply.split()[1] == b"413" and b"--http-max-body-bytes" in reply, reply[:300]
    good = json.dumps(GOOD).encode()
    code, data = _raw(port, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good))
    assert code == 200, data[:300]


def test_bytes_after_the_end_of_a_compressed_body_are_refused(hpool, restricted):
    """Junk after a gzip stream's end decompresses to nothing: it is refused 400 as it arrives, not read
    uncounted until the timeout; a deflate stream of empty blocks is bounded by its raw size (413), on both
    servers."""
    import zlib

    port = restricted
    head = (b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Encoding: %s\r\n\r\n")
    gz = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    tiny = gz.compress(json.dumps(GOOD).encode()) + gz.flush()
    endless, flushes = b"\x78\x9c", b"\x00\x00\x00\xff\xff" * ((64 << 10) // 5)  # zlib header, empty blocks
    cases = [(b"gzip", tiny, b"j" * (64 << 10), b"after the end of the compressed stream"),
             (b"deflate", endless, flushes, b"--http-max-body-bytes")]
    for encoding, first, more, words in cases:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(head % encoding + b"%x\r\n%s\r\n" % (len(first), first))
            try:
                for _ in range(8 * RESTRICTED_MAX_BODY // len(more)):  # 8 MiB, unless the sidecar stops reading
                    s.sendall(b"%x\r\n%s\r\n" % (len(more), more))
            except (BrokenPipeError, ConnectionResetError):
                pass
            reply = s.recv(65536)
        assert reply.split()[1] in (b"400", b"413") and words in reply, (encoding, reply[:300])
    code, data = _raw(port, head % b"gzip", b"%x\r\n%s\r\n0\r\n\r\n" % (len(tiny), tiny))
    assert code == 200, data[:300]


def test_a_chunked_body_with_broken_framing_is_refused_not_cut_short(hpool):
    """A good chunk and then a chunk size that is not hex: 400 on both servers. granian hands the framing
    error on as an empty chunk, which read as the body's end had served the good part as the whole body."""
    good = json.dumps(GOOD).encode()
    head = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    for tail in (b"zz\r\nGARBAGE\r\n0\r\n\r\n", b"-5\r\nabcde\r\n0\r\n\r\n"):
        code, data = _raw(hpool.http_port, head, b"%x\r\n%s\r\n" % (len(good), good) + tail, wait=30)
        assert code == 400, (tail, data[:300])
    code, data = _raw(hpool.http_port, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good))
    assert code == 200, data[:300]


def test_header_values_that_are_not_utf8_are_refused_by_name(hpool):
    """A Content-Encoding or Inference-Header-Content-Length of bytes that are not UTF-8 is refused naming the
    header, on both servers (aiohttp failed writing its own 415 and answered 500; granian dropped the value,
    so the body was read as identity, or all of it as JSON)."""
    good = json.dumps(GOOD).encode()
    head = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(good)
    for name, status in ((b"Content-Encoding", 415), (b"Inference-Header-Content-Length", 400)):
        code, data = _raw(hpool.http_port, head + name + b": \xff\xfe\r\n\r\n", good, wait=30)
        assert code == status and name in data, (name, data[:300])


def test_both_servers_decode_the_same_encodings(hpool):
    """One policy for Content-Encoding: an unknown one is a 415 naming it, deflate may be raw or zlib-wrapped,
    and an empty body is empty whatever its encoding."""
    import zlib

    port, good = hpool.http_port, json.dumps(GOOD).encode()
    code, reply = post(port, "/v2/models/tiny/infer", good, {"Content-Encoding": "compress"})
    assert code == 415 and "Content-Encoding 'compress'" in reply["error"], reply
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    for body in (zlib.compress(good), raw.compress(good) + raw.flush()):
        assert post(port, "/v2/models/tiny/infer", body, {"Content-Encoding": "deflate"})[0] == 200
    assert post(port, "/v2/repository/index", b"", {"Content-Encoding": "gzip"})[0] == 200


def test_idle_connections_are_closed_and_pipelined_requests_answered_in_order(restricted):
    """A connection that never sends a byte, and one idle after its answer, are closed within the body
    timeout (2 s); two requests sent in one write are both answered, in order, on the connection."""
    port = restricted
    with socket.create_connection(("127.0.0.1", port), timeout=30) as silent, \
            socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
        good = json.dumps(GOOD).encode()
        one = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(good), good)
        two = b"GET /v2/models/nothing_here HTTP/1.1\r\nHost: x\r\n\r\n"
        idle.sendall(one + two)
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.rstrip().endswith(b"}"):
            chunk = idle.recv(65536)
            assert chunk, data
            data += chunk
        first, second = data.split(b"HTTP/1.1 ")[1:3]
        assert first.startswith(b"200") and b"OUTPUT0" in first
        assert second.startswith(b"400") or second.startswith(b"404"), second[:200]
        start = time.monotonic()
        assert idle.recv(65536) == b"" and silent.recv(65536) == b""
        assert time.monotonic() - start < 25


def test_oversized_headers_are_refused_and_the_server_lives(restricted):
    """Headers past the server's bound (aiohttp: 8 KiB a field; granian: hyper's 64 KiB read buffer, which
    a read may overshoot to under 300 KiB, and 100 fields) are refused, never read into memory without
    bound; the next request is served."""
    port = restricted
    for head in (b"X-Big: " + b"a" * (1 << 20) + b"\r\n", b"X-Big: " + b"a" * (300 << 10) + b"\r\n",
                 b"".join(b"X-%d: v\r\n" % i for i in range(200))):
        code, data = _raw(port, b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n", b"")
        # Past the bytes a server buffers (hyper: 64 KiB), it may close while the rest is still
        # being sent, and the reset can discard its 431 before it is read: that too is a refusal.
        assert code in (400, 431) or (code == 0 and len(head) > 64 << 10), data[:300]
    assert request(port, "GET", "/v2")[0] == 200


def test_many_silent_connections_do_not_keep_others_out(hpool):
    """300 connections that send nothing (over granian's default of 128 served at once) do not hold a new
    client back: it is answered while every one of them is still open (the body timeout is 30 s here)."""
    port = hpool.http_port
    silent = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(300)]
    try:
        assert request(port, "GET", "/v2/health/live")[0] == 200
        for s in silent:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing to read and not closed: still open
                s.recv(1)
    finally:
        for s in silent:
            s.close()


@pytest.mark.parametrize("server", SIDECAR_SERVERS)
def test_a_dead_sidecar_is_restarted(tmp_path, server):
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    port = free_port()
    with Pool(repo, http_port=port, http_server=server, sidecars=1) as pool:
        first = sidecar_pid(pool)
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: _ready(port) and sidecar_pid(pool) != first, 60)
        assert post(port, "/v2/models/tiny/infer", GOOD)[0] == 200


def test_the_pools_own_sidecar_is_ready_as_soon_as_its_front(tmp_path):
    """A sidecar told its front is ready (the pool's own: --front-ready) answers a readiness probe sent
    before its first connection once connected, not "not ready" from the instant between; one not told so
    answers at once. The front is ready first; its socket appears under the sidecars' path only later."""
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    with Pool(repo, endpoint=f"ipc://{tmp_path}/front.sock"):
        later = tmp_path / "later.sock"
        ports = [free_port(), free_port()]
        procs = [subprocess.Popen([sys.executable, "-m", "gepool.http.server", "--endpoint", f"ipc://{later}",
                                   "--http-port", str(port), "--metrics-port", "0", *flag])
                 for port, flag in zip(ports, (["--front-ready"], []))]
        try:
            assert wait_until(lambda: all(_listening(port) for port in ports), 60)
            assert request(ports[1], "GET", "/v2/health/ready")[0] == 400  # no front reached, and none promised
            early = {}
            probe = threading.Thread(target=lambda: early.update(code=request(ports[0], "GET", "/v2/health/ready")[0]))
            probe.start()
            try:
                assert not wait_until(lambda: "code" in early, 0.5)  # held while its front cannot be reached
                os.symlink(tmp_path / "front.sock", later)
                probe.join(60)
                assert early == {"code": 200}
                assert wait_until(lambda: _ready(ports[1]), 60)
            finally:
                probe.join(60)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


def _ready(port: int) -> bool:
    try:
        return request(port, "GET", "/v2/health/ready", timeout=5)[0] == 200
    except OSError:
        return False


# -- fuzzing every endpoint ------------------------------------------------------------------------------
ENDPOINTS = [("GET", "/v2"), ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2/models/tiny"),
             ("GET", "/v2/models/tiny/ready"), ("GET", "/v2/models/tiny/config"), ("GET", "/v2/models/stats"),
             ("GET", "/v2/models/{m}/versions/{v}"), ("POST", "/v2/models/{m}/infer"),
             ("POST", "/v2/models/{m}/versions/{v}/infer"), ("POST", "/v2/repository/index"),
             ("GET", "/v2/systemsharedmemory/status"),
             ("POST", "/v2/systemsharedmemory/region/{m}/register"),
             ("POST", "/v2/systemsharedmemory/region/{m}/unregister"), ("GET", "/v2/cudasharedmemory/status"),
             ("POST", "/v2/cudasharedmemory/region/{m}/register")]


def _fuzz_strategies():
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
    tensor = st.fixed_dictionaries({"name": st.sampled_from(["INPUT0", "TEXT", "X"]) | values,
                                    "datatype": st.sampled_from(["FP32", "INT8", "UINT8", "BYTES", "BOOL", "FP16",
                                                                 "NOPE"]) | values,
                                    "shape": st.lists(st.integers(-2, 2**40), max_size=3) | values},
                                   optional={"data": values, "parameters": st.dictionaries(
                                       st.sampled_from(["binary_data_size", "shared_memory_region",
                                                        "shared_memory_offset", "shared_memory_byte_size",
                                                        "binary_data"]), values, max_size=3) | values})
    infer = st.fixed_dictionaries({"inputs": st.lists(tensor, max_size=2) | values},
                                  optional={"outputs": st.lists(tensor, max_size=2) | values, "id": values,
                                            "parameters": st.dictionaries(st.text(max_size=20), values) | values})
    bodies = (infer.map(lambda d: json.dumps(d).encode()) | values.map(lambda d: json.dumps(d).encode())
              | st.binary(max_size=200))
    names = st.sampled_from(["tiny", "shout", "nosuch", "abc", "%00", "..", "x" * 300])
    return st.tuples(st.sampled_from(ENDPOINTS), names, st.sampled_from(["1", "abc", "0", "-1", "99"]), bodies,
                     st.none() | st.integers(-5, 5000).map(str) | st.from_regex(r"[!-~]{0,6}", fullmatch=True))


def test_every_endpoint_survives_fuzzing_and_answers_4xx_at_worst(hpool):
    from hypothesis import HealthCheck, given, settings

    port, pid = hpool.http_port, sidecar_pid(hpool)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=_fuzz_strategies())
    def fuzz(case):
        (method, path), model, version, body, hlen = case
        headers = {} if hlen is None else {"Inference-Header-Content-Length": hlen}
        code, reply = request(port, method, path.format(m=model, v=version), body if method == "POST" else b"",
                              headers)
        assert code < 500, (method, path, model, body[:300], hlen, code, reply)

    fuzz()
    assert sidecar_pid(hpool) == pid
    assert post(port, "/v2/models/tiny/infer", GOOD)[0] == 200


def test_large_json_is_parsed_in_a_helper_process(hpool):
    """A JSON body above the inline threshold is parsed outside the sidecar's own process (json.loads holds
    the GIL); its answer and its errors are the same as inline."""
    port = hpool.http_port
    pad = b" " * (200 << 10)
    code, reply = post(port, "/v2/models/tiny/infer", json.dumps(GOOD).encode() + pad)
    assert code == 200 and reply["outputs"][0]["data"][:3] == [1.0, 3.0, 5.0]
    bad = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [True] * 16}]}
    code, reply = post(port, "/v2/models/tiny/infer", json.dumps(bad).encode() + pad)
    assert code == 400 and "FP32 data must be numbers" in reply["error"]
    # what numpy refused in the helper was a 500 naming ValueError or UnicodeEncodeError: the inline words now
    for bad in ({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [0, 2**62], "data": []}]},
                {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["\ud800"]}]}):
        path = "/v2/models/tiny/infer" if bad["inputs"][0]["name"] == "INPUT0" else "/v2/models/shout/infer"
        inline = post(port, path, json.dumps(bad).encode())
        helped = post(port, path, json.dumps(bad).encode() + pad)
        assert inline[0] == helped[0] == 400 and inline == helped, (inline, helped)
        assert "Error" not in helped[1]["error"]
    helpers = [p for p in _descendants(sidecar_pid(hpool)) if b"multiprocessing" in open(f"/proc/{p}/cmdline",
                                                                                          "rb").read()]
    assert helpers, "no helper process parsed the large body"


def test_the_helper_processs_refusals_keep_their_class_and_its_crashes_stay_in_the_log(caplog):
    """A refusal comes back as the class its code names, with its words; anything else is a 500
    'internal error' without a Python class name, its traceback in the sidecar's log. Run on a thread pool
    in place of the helper process, so that the parse can be made to fail."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from unittest import mock

    from gepool.common import errors
    from gepool.http import kserve, offload

    helper = offload.JSONOffload()
    helper._pool = ThreadPoolExecutor(1)
    try:
        with mock.patch.object(kserve, "parse_request", side_effect=errors.InvalidArgument("input 'X': bad")):
            with pytest.raises(errors.InvalidArgument) as refused:
                asyncio.run(helper.parse(b"{}", None, 1 << 20))
        assert refused.value.http_status == 400 and refused.value.message == "input 'X': bad"
        with mock.patch.object(kserve, "parse_request", side_effect=ValueError("negative dimensions")):
            with pytest.raises(errors.Internal) as crashed:
                asyncio.run(helper.parse(b"{}", None, 1 << 20))
        assert crashed.value.message == "internal error (the sidecar's log has the details)"
        assert "ValueError: negative dimensions" in caplog.text and "Traceback" in caplog.text
    finally:
        helper.close()


def test_no_user_holds_more_than_its_share_of_regions(hpool):
    from gepool.http.shm import MAX_REGIONS_PER_UID

    port, key = hpool.http_port, f"/gepool_test_many_{os.getpid()}"
    path = segment(key[1:], b"\0" * 64)
    try:
        for i in range(MAX_REGIONS_PER_UID):
            assert post(port, f"/v2/systemsharedmemory/region/m{i}/register", {"key": key, "byte_size": 64})[0] == 200
        code, reply = post(port, "/v2/systemsharedmemory/region/one_more/register", {"key": key, "byte_size": 64})
        assert code == 400 and f"already has {MAX_REGIONS_PER_UID}" in reply["error"]
        fds = len(os.listdir(f"/proc/{sidecar_pid(hpool)}/fd"))
        post(port, "/v2/systemsharedmemory/unregister", b"")
        pid = sidecar_pid(hpool)  # every region's fd closed (polled: the server closes each request's connection
        # when it sees the client's end, which may come after the client has its answer)
        assert wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= fds - MAX_REGIONS_PER_UID, 30), \
            (len(os.listdir(f"/proc/{pid}/fd")), fds)
    finally:
        post(port, "/v2/systemsharedmemory/unregister", b"")
        os.unlink(path)
