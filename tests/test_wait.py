"""The front's wait (scheduler/wait.py): it wakes on a timer, a signal, a doorbell, a pipe and a ZMQ message."""

import os
import signal
import time

import pytest
import zmq

from gepool.ipc import doorbell
from gepool.scheduler.channels import ZmqChannel
from gepool.scheduler.wait import Waiter

LONG_S = 30.0  # a timer far enough away that only an event ends the wait


@pytest.fixture
def waiter():
    w = Waiter()
    yield w
    w.close()


@pytest.fixture
def pipe():
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    yield r, w
    os.close(r)
    os.close(w)


@pytest.fixture
def router_dealer():
    """inproc: a message sent is in the router's pipe as send() returns (no I/O thread in between)."""
    ctx = zmq.Context()
    endpoint = "inproc://wait"
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(endpoint)
    dealer.connect(endpoint)
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _until(waiter: Waiter, fd: int, deadline_s: float = LONG_S) -> list:
    """Waits as the loop does (stale sockets first) until ``fd`` is among the events."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        events = waiter.stale() or waiter.sleep(end)
        if any(f == fd for f, _ in events):
            return events
    raise AssertionError(f"fd {fd} never became ready")


@pytest.mark.parametrize("delay_s", [300e-6, 2.5e-3])
def test_timer_returns_nothing_once_it_has_come_and_not_before(waiter, pipe, delay_s):
    waiter.add(pipe[0])
    at = time.monotonic() + delay_s
    assert waiter.sleep(at) == []
    assert time.monotonic() >= at  # neither epoll's whole milliseconds nor select() wake it early


def test_overdue_timer_still_reports_what_is_ready(waiter, pipe):
    r, w = pipe
    waiter.add(r)
    os.write(w, b"x")
    past = time.monotonic() - 1.0
    assert [fd for fd, _ in waiter.sleep(past)] == [r]
    assert [fd for fd, _ in waiter.sleep(past)] == [r]  # the second time, after a short wait


def test_overdue_timer_that_stays_overdue_waits_instead_of_spinning(waiter, pipe):
    waiter.add(pipe[0])
    past = time.monotonic() - 1.0
    assert waiter.sleep(past) == []  # at once: the tick after this clears most timers
    started = time.monotonic()
    assert waiter.sleep(past) == []  # the same timer again: it waits (epoll rounds it to 1 ms)
    assert time.monotonic() - started >= 0.4e-3


def test_pipe_wakes_a_wait_without_timer(waiter, pipe):
    r, w = pipe
    waiter.add(r)
    os.write(w, b"x")
    assert [fd for fd, _ in waiter.sleep(None)] == [r]


@pytest.mark.parametrize("delay_s", [None, 500e-6, LONG_S])
def test_signal_wakes_the_wait_through_its_wakeup_pipe(waiter, pipe, delay_s):
    r, w = pipe
    waiter.add(r)
    old_fd = signal.set_wakeup_fd(w)
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        end = time.monotonic() + LONG_S
        while time.monotonic() < end:
            events = waiter.sleep(None if delay_s is None else time.monotonic() + delay_s)
            if events:
                break
        assert [fd for fd, _ in events] == [r]
        assert signal.SIGALRM in os.read(r, 16)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        signal.set_wakeup_fd(old_fd)


def test_doorbell_completion_wakes_the_wait(waiter, tmp_path):
    paths = doorbell.make(str(tmp_path), "bell")
    front = doorbell.FrontBell(paths)
    worker = doorbell.WorkerBell(paths)
    try:
        waiter.add(front.done_fd)
        assert waiter.sleep(time.monotonic() + 1e-3) == []
        worker.done(3, 7)
        assert [fd for fd, _ in waiter.sleep(time.monotonic() + LONG_S)] == [front.done_fd]
        assert front.completions() == [(3, 7)]
    finally:
        worker.close()
        front.close()


def test_zmq_message_wakes_the_wait(waiter, router_dealer):
    router, dealer = router_dealer
    got = []
    channel = ZmqChannel(router, lambda ident, parts: got.append(bytes(parts[0])))
    fd = waiter.add_zmq(channel)
    assert waiter.stale() == [] and not channel.stale  # nothing yet: its descriptor now signals
    dealer.send(b"hello")
    _until(waiter, fd)
    channel.receive(8)
    assert got == [b"hello"]


def test_receive_stopped_at_its_budget_leaves_the_rest_to_the_next_wait(waiter, router_dealer):
    router, dealer = router_dealer
    got = []
    channel = ZmqChannel(router, lambda ident, parts: got.append(bytes(parts[0])))
    fd = waiter.add_zmq(channel)
    for i in range(5):
        dealer.send(b"%d" % i)
    while len(got) < 2:
        _until(waiter, fd)
        channel.receive(2)
    assert channel.stale  # it used its whole budget: the wait looks again before sleeping
    while len(got) < 5:
        assert any(f == fd for f, _ in waiter.stale())  # ZMQ_FD has nothing more to say for these
        channel.receive(2)
    assert got == [b"0", b"1", b"2", b"3", b"4"]
    channel.receive(2)
    assert not channel.stale and waiter.stale() == []


def test_a_zmq_socket_kept_stale_does_not_starve_what_else_is_ready(waiter, router_dealer, pipe):
    """A client flood that fills every receive budget leaves its socket stale pass after pass: the other
    sources (here a pipe, in the front the doorbells, lanes and signals) are still reported each pass."""
    router, dealer = router_dealer
    r, w = pipe
    waiter.add(r)
    channel = ZmqChannel(router, lambda ident, parts: None)
    fd = waiter.add_zmq(channel)
    for i in range(50):
        dealer.send(b"%d" % i)
    _until(waiter, fd)
    channel.receive(2)
    os.write(w, b"x")
    assert channel.stale
    events = waiter.stale()
    assert {f for f, _ in events} == {fd, r}


def test_messages_arriving_while_replies_go_out_are_all_received(waiter, router_dealer):
    """A send on a ZMQ socket may process the command announcing an arriving message, so that its
    descriptor never turns readable for it: after a send the wait reads ZMQ_EVENTS first."""
    router, dealer = router_dealer
    got = []
    channel = ZmqChannel(router, lambda ident, parts: got.append((ident, bytes(parts[0]))))
    fd = waiter.add_zmq(channel)
    dealer.send(b"first")
    _until(waiter, fd)
    channel.receive(8)
    for i in range(200):
        dealer.send(b"%d" % i)  # on its way while the router answers
        channel.send(got[-1][0], [b"reply"])
        assert channel.stale
        _until(waiter, fd)
        channel.receive(8)
    assert [m for _, m in got[1:]] == [b"%d" % i for i in range(200)]
    for _ in range(200):
        assert dealer.poll(LONG_S * 1000) and dealer.recv() == b"reply"


def test_descriptor_past_fd_setsize_still_wakes_a_sub_millisecond_wait(waiter, pipe):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = 1500
    if soft <= high:
        if hard != resource.RLIM_INFINITY and hard <= high:
            pytest.skip("the descriptor limit is below 1500")
        resource.setrlimit(resource.RLIMIT_NOFILE, (high + 1, hard))
    r, w = pipe
    os.dup2(r, high)
    try:
        waiter.add(high)
        os.write(w, b"x")
        end = time.monotonic() + LONG_S
        events = []
        while not events and time.monotonic() < end:
            events = waiter.sleep(time.monotonic() + 200e-6)
        assert [fd for fd, _ in events] == [high]
    finally:
        waiter.remove(high)
        os.close(high)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
