"""The client core's in-flight book, alone: deadlines, the endpoint watch, and what each carrier took."""

from gepool.clientcore import WATCH_S, Inflight


def test_the_book_wakes_for_the_earliest_deadline_and_watches_only_zmq():
    book = Inflight()
    assert book.next_wake(100.0) is None
    book[1] = (None, "a", None, True)  # over a lane, no deadline: nothing to wake for (a dead lane is seen)
    assert book.next_wake(100.0) is None
    book[2] = (None, "b", 130.0, True)
    assert book.next_wake(100.0) == 130.0
    book[3] = (None, "c", None, False)  # over ZMQ: look at the endpoint soon
    assert book.next_wake(100.0) == 100.0 + WATCH_S
    book[4] = (None, "d", 100.1, False)
    assert book.next_wake(100.0) == 100.1


def test_the_book_hands_out_what_expired_or_what_a_carrier_took():
    book = Inflight({1: (None, "a", 5.0, True), 2: (None, "b", 9.0, False), 3: (None, "c", None, False),
                     4: (None, "d", None, True)})
    assert [req_id for req_id, _ in book.expired(6.0)] == [1]
    assert [(req_id, e[1]) for req_id, e in book.carried(False)] == [(2, "b"), (3, "c")]
    assert list(book) == [4]
    assert [req_id for req_id, _ in book.carried(True)] == [4] and not book


def test_both_faces_send_their_wait_as_the_deadline_and_a_timeout_only_when_given():
    """deadline_us is what the face will wait (its infer timeout, else the client's); timeout_us, Triton's
    override of the queue policy, only what infer(timeout=) asked. Both faces encode through the core."""
    import numpy as np

    from gepool import AsyncClient, Client
    from gepool.clientcore import ClientCore
    from gepool.ipc import protocol

    assert Client._encode is ClientCore._encode and AsyncClient._encode is ClientCore._encode
    core = ClientCore("ipc:///nowhere", shared_memory=False, arena_bytes=0, timeout=7.5, curve_server_key=None,
                      curve_client_key=None, lane=False, arena_min_bytes=0)
    x = {"X": np.ones((1, 1), np.float32)}
    default = protocol.decode(core._encode("m", x, None, None, None).frames[0])
    given = protocol.decode(core._encode("m", x, None, None, 0.25).frames[0])
    assert (default.timeout_us, default.deadline_us) == (0, 7_500_000)
    assert (given.timeout_us, given.deadline_us) == (250_000, 250_000)
