"""How clients reach the front: the ZMQ socket and the local lanes, behind one interface."""

import logging
from collections.abc import Callable
from typing import Protocol

import zmq

from gepool.common import errors
from gepool.ipc import lane, protocol, zmqio
from gepool.ipc.sockets import ipc_path
from gepool.scheduler.lanes import Lanes, is_lane_identity
from gepool.scheduler.lograte import Limited

log = logging.getLogger("gepool.channels")
limited = Limited(log)

# on_message(identity, parts): a client's message as buffers, the header first; each view keeps
# what it was received into alive
OnMessage = Callable[[bytes, list[memoryview]], None]


class Channel(Protocol):
    def fileno(self) -> int:
        """A descriptor that turns readable when there is something to receive."""

    def receive(self, budget: int) -> None:
        """Hands at most ``budget`` waiting messages to the channel's handler."""

    def owns(self, identity: bytes) -> bool:
        """A client identity this channel minted."""

    def send(self, identity: bytes, parts: list, copy: bool = False) -> None:
        """One reply; ``copy``: the parts point into a slot, reused once this returns or, for the lanes,
        once their ``settle()`` returns (the dispatcher's call before it releases the slot)."""

    def close(self) -> None: ...


class ZmqChannel:
    """A ROUTER socket: the one on the pool's endpoint (any client, any host the endpoint admits), or the
    workers' (their identities, their messages)."""

    def __init__(self, sock: zmq.Socket, on_message: OnMessage, peer: str = "a client") -> None:
        self.sock, self.on_message, self.peer = sock, on_message, peer
        self.stale = True  # set by the front's Waiter.add_zmq too: the one that reads ZMQ_EVENTS
        self.lane_shaped = is_lane_identity if peer == "a client" else None

    def fileno(self) -> int:
        return self.sock.FD

    def receive(self, budget: int) -> None:
        sock, recv, readable = self.sock, zmqio.recv_parts, zmqio.readable
        for _ in range(budget):
            if not readable(sock):
                return
            frames = recv(sock, zmqio.NOBLOCK)
            if len(frames) >= 2 and self.lane_shaped is not None and self.lane_shaped(frames[0].bytes):
                self._refuse_lane_identity(frames[0].bytes)
            elif len(frames) >= 2:
                self.on_message(frames[0].bytes, [f.buffer for f in frames[1:]])
            else:
                limited.log(logging.WARNING, "short", frames[0].bytes if frames else b"",
                            "dropping a message of %d frames from %s", len(frames), self.peer)
        self.stale = True  # stopped at its budget: what is left will not signal

    def _refuse_lane_identity(self, identity: bytes) -> None:
        """A ZMQ client chose a routing id shaped as a lane's (libzmq lets a peer name itself): passed on,
        its answers, its arenas and its uid would be those of the lane client so named."""
        limited.log(logging.WARNING, "lane-id", identity, "refusing a ZMQ client whose routing id is a lane's")
        err = errors.PermissionDenied("this ZMQ client's routing id (ZMQ_ROUTING_ID) has the shape of a lane's "
                                      "identity, which only the pool mints; leave the routing id to libzmq")
        zmqio.send_parts(self.sock, [identity, protocol.Error(0, err.code, err.message).encode()])

    def owns(self, identity: bytes) -> bool:
        return True

    def send(self, identity: bytes, parts: list, copy: bool = False) -> None:
        zmqio.send_parts(self.sock, [identity, *parts], copy)
        self.stale = True  # a send processes the socket's commands, perhaps the one announcing a message

    def close(self) -> None:
        self.sock.close(0)


class LaneChannel(Lanes):
    """Same-host clients' SEQPACKET lanes (see lanes.py): one descriptor in the front's wait for all."""

    receive = Lanes.pump  # not a wrapper: one call fewer per wake on the hot path


def open_lanes(endpoint: str, curve: bool, on_message: OnMessage) -> LaneChannel | None:
    """Lanes beside an ipc endpoint (not with CURVE: a lane is not authenticated)."""
    path = ipc_path(endpoint)
    if path is None or curve:
        return None
    try:
        return LaneChannel(lane.path_for(path), on_message)
    except OSError as exc:  # a path too long for a Unix socket, say: clients keep to ZMQ
        log.warning("no lanes beside %s: %s", endpoint, exc)
        return None


class Channels:
    """Every channel the front listens on; a reply goes back over the one its request came by."""

    def __init__(self, zmq_channel: ZmqChannel, lanes: LaneChannel | None) -> None:
        self.zmq, self.lanes = zmq_channel, lanes
        self.all: list[Channel] = [zmq_channel] + ([lanes] if lanes is not None else [])
        if lanes is None:
            self.reply = zmq_channel.send  # one call per reply on the hot path, not two

    def reply(self, identity: bytes, parts: list, copy: bool = False) -> None:
        if self.lanes.owns(identity):
            self.lanes.send(identity, parts, copy)  # batched, sent now, or queued as a copy
        else:
            self.zmq.send(identity, parts, copy)

    def close(self) -> None:
        for ch in self.all:
            ch.close()
