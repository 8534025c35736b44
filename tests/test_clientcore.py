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
