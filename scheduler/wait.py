"""The front's one wait: an epoll over every descriptor, ZMQ sockets included, with sub-millisecond timers.

zmq.Poller costs the front five syscalls a wake (a poll over every descriptor, then, for each ZMQ
socket, a getpid and a poll of its mailbox to read ZMQ_EVENTS) and builds Python lists on each call.
Here the ZMQ sockets' own descriptors (ZMQ_FD) sit in the epoll beside the doorbells, lanes, sentinels
and signal pipe, and a wake is one epoll_wait. ZMQ_FD only says "look": it turns readable when the
socket's mailbox receives a command, and reading ZMQ_EVENTS consumes that. So a socket whose messages
may be waiting without a signal to come is marked ``stale`` (by whoever last received or sent on it:
a receive that stopped at its budget leaves messages; a send may consume the command that announced
an arriving message) and asked for ZMQ_EVENTS before the next wait.
"""

import select
import time
from typing import Protocol

import zmq

from gepool.ipc import zmqio

FD_SETSIZE = 1024  # select()'s limit on Linux
OVERDUE_S = 0.5e-3  # a timer still overdue on its second wait: epoll rounds this up to one millisecond
Events = list[tuple[int, int]]


class ZmqSource(Protocol):
    sock: zmq.Socket
    stale: bool  # messages may be waiting that its descriptor will not signal


class Waiter:
    """``ready(0)`` polls, ``sleep(at)`` waits until a clock time (``time.monotonic``) with microsecond
    precision; both return [(fd, events)] for descriptors ready now, ZMQ sockets by their ZMQ_FD."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self._fd = self.epoll.fileno()
        # select() waits for the epoll's own descriptor where epoll_wait's milliseconds are too coarse
        self._fine = [self._fd] if self._fd < FD_SETSIZE else None
        self._zmq: list[tuple[int, ZmqSource]] = []
        self._overdue: float | None = None
        self.ready = self.epoll.poll  # not a wrapper: one call fewer per wake

    def fileno(self) -> int:
        return self._fd

    def add(self, fd: int) -> None:
        self.epoll.register(fd, select.EPOLLIN)

    def add_zmq(self, source: ZmqSource) -> int:
        """Watches a ZMQ socket; returns the descriptor its events come under. It starts stale (nothing
        has read its ZMQ_EVENTS yet)."""
        fd = source.sock.FD
        self.add(fd)
        source.stale = True
        self._zmq.append((fd, source))
        return fd

    def remove(self, fd: int) -> None:
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):  # closed already (the epoll forgot it then)
            pass

    def stale(self) -> Events:
        """The stale ZMQ sockets that hold a message, each then fresh: its descriptor signals what comes
        next, until someone receives or sends on it again. When any does, whatever else is ready comes
        with them: a client that keeps a socket stale must not starve the doorbells, lanes and signals."""
        found = []
        for fd, source in self._zmq:
            if source.stale:
                source.stale = False
                if zmqio.readable(source.sock):  # reading ZMQ_EVENTS takes the command that woke the fd
                    found.append((fd, select.EPOLLIN))
        if found:
            seen = {fd for fd, _ in found}
            found += [e for e in self.epoll.poll(0) if e[0] not in seen]
        return found

    def sleep(self, at: float | None) -> Events:
        """What becomes ready before ``at`` (None: no timer); [] once it has come."""
        poll = self.epoll.poll
        if at is None:
            return poll(-1)
        while True:
            remaining = at - time.monotonic()
            if remaining <= 0:
                # a timer the tick after this cannot clear (a killed worker not yet gone) must not spin
                events = poll(OVERDUE_S if at == self._overdue else 0)
                self._overdue = at
                return events
            if remaining >= 1e-3 or self._fine is None:
                # whole milliseconds, rounded down (epoll rounds up): the rest below, in select()
                ms = int(remaining * 1000)
                events = poll((ms - 0.5) / 1000 if ms else remaining)
            elif select.select(self._fine, [], [], remaining)[0]:
                events = poll(0)
            else:
                return []
            if events:
                return events

    def close(self) -> None:
        self.epoll.close()
