"""HTTP/1.1 on the wire, the same on every sidecar server: pipelining, bodies split across writes, 100-continue,
HTTP/1.0, HEAD, an answer given before its body has arrived."""

import json
import socket
import time

import pytest

from gepool import Pool
from tests import repo as test_repo
from tests.conftest import SIDECAR_SERVERS, free_port

GOOD = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                               "data": list(range(16))}]}).encode()
INFER = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(GOOD)


@pytest.fixture(scope="module", params=SIDECAR_SERVERS)
def port(tmp_path_factory, request):
    repo = str(tmp_path_factory.mktemp("wire-models"))
    test_repo.make_models.make_tiny(repo)
    with Pool(repo, http_port=free_port(), metrics_port=0, http_server=request.param) as pool:
        yield pool.http_port


class Reader:
    """Responses read off one socket, one at a time (Content-Length framed, as every gepool answer is)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""

    def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.data:
            self._more()
        head, self.data = self.data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = 0 if head_only else int(headers.get("content-length", 0))
        while len(self.data) < length:
            self._more()
        body, self.data = self.data[:length], self.data[length:]
        return int(lines[0].split()[1]), headers, body

    def closed(self) -> bool:
        """Whether the server closes the connection (within the socket's timeout) with nothing more sent."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"closed with {self.data[:200]!r} unread"
        self.data += chunk


def _connect(port: int) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock, Reader(sock)


def _answer(body: bytes) -> list[float]:
    return json.loads(body)["outputs"][0]["data"]


def test_many_pipelined_requests_are_answered_in_order(port):
    """Fifty requests in one write, each with its own input: fifty answers, each to its own request."""
    sock, reader = _connect(port)
    with sock:
        bodies = [json.dumps({"id": str(i), "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                                         "data": [i] * 16}]}).encode() for i in range(50)]
        sock.sendall(b"".join(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                              % (len(b), b) for b in bodies))
        for i in range(50):
            status, _, body = reader.response()
            assert status == 200 and json.loads(body)["id"] == str(i), body[:200]
            assert _answer(body) == [2.0 * i + 1] * 16


def test_a_pipelined_requests_body_may_come_after_the_answer_before_it(port):
    """The second request's head and half its body come with the first request; the rest only once the first
    is answered: the second is still read and answered."""
    sock, reader = _connect(port)
    with sock:
        half = len(GOOD) // 2
        sock.sendall(INFER + GOOD + INFER + GOOD[:half])
        assert reader.response()[0] == 200
        time.sleep(0.2)
        sock.sendall(GOOD[half:])
        status, _, body = reader.response()
        assert status == 200 and _answer(body) == [2.0 * i + 1 for i in range(16)]


def test_a_body_sent_in_pieces_is_read_whole(port):
    sock, reader = _connect(port)
    with sock:
        sock.sendall(INFER)
        for i in range(0, len(GOOD), 40):
            time.sleep(0.02)
            sock.sendall(GOOD[i:i + 40])
        assert reader.response()[0] == 200
        sock.sendall(INFER + GOOD)  # and the connection serves the next one
        assert reader.response()[0] == 200


def test_expect_100_continue_is_answered_before_the_body_is_sent(port):
    sock, reader = _connect(port)
    with sock:
        sock.sendall(INFER[:-2] + b"Expect: 100-continue\r\n\r\n")
        assert reader.response(head_only=True)[0] == 100
        sock.sendall(GOOD)
        assert reader.response()[0] == 200


def test_http_10_closes_unless_asked_to_keep_alive(port):
    head = b"POST /v2/models/tiny/infer HTTP/1.0\r\nContent-Length: %d\r\n" % len(GOOD)
    sock, reader = _connect(port)
    with sock:
        sock.sendall(head + b"\r\n" + GOOD)
        assert reader.response()[0] == 200
        assert reader.closed()
    sock, reader = _connect(port)
    with sock:
        for _ in range(2):
            sock.sendall(head + b"Connection: keep-alive\r\n\r\n" + GOOD)
            status, headers, _ = reader.response()
            assert status == 200 and headers.get("connection", "").lower() == "keep-alive", headers


def test_head_answers_the_headers_of_get_without_a_body(port):
    sock, reader = _connect(port)
    with sock:
        sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = reader.response()
        assert status == 200 and body
        sock.sendall(b"HEAD /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, head_headers, _ = reader.response(head_only=True)
        assert status == 200 and head_headers["content-length"] == str(len(body))
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # nothing of a body came in between
        assert reader.response()[0] == 200


def test_an_answer_before_the_body_reaches_the_client_still_sending_it(port):
    """A request refused by its route before its body is read (no such model: 400 or 404) while the client
    is still sending: the client hears the answer, not a reset, and every answer carries a Date."""
    sock, reader = _connect(port)
    with sock:
        body = b" " * (256 << 10)
        sock.sendall(b"POST /v2/nothing/here HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.sendall(body[:1000])
        status, headers, _ = reader.response()
        assert status in (404, 405) and "date" in headers, headers
        try:
            sock.sendall(body[1000:])
        except (BrokenPipeError, ConnectionResetError):
            pass
    sock, reader = _connect(port)  # and the server serves on
    with sock:
        sock.sendall(INFER + GOOD)
        assert reader.response()[0] == 200
