"""Multipart send and receive on the hot path, without pyzmq's per-call sugar.

``Socket.send_multipart``/``recv_multipart`` re-check every part, combine enum flags and ask for
RCVMORE with a getsockopt per part: a few microseconds per message, paid several times per request
by the front and the client. These call the socket's compiled methods with plain int flags, and
read ``Frame.more`` instead. Parts must be bytes, Frames or contiguous buffers (ours always are).
"""

import zmq
from zmq.backend import Socket as _Compiled

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_send = _Compiled.send
_recv = _Compiled.recv
_get = _Compiled.get


def send_parts(sock: zmq.Socket, parts: list, copy: bool = False) -> None:
    """``copy=False`` lends large parts to ZMQ until sent: only for buffers nobody reuses meanwhile."""
    last = len(parts) - 1
    for i in range(last):
        _send(sock, parts[i], _SNDMORE, copy)
    _send(sock, parts[last], 0, copy)


def recv_parts(sock: zmq.Socket, flags: int = 0) -> list:
    """One whole message as Frames (raises zmq.Again under NOBLOCK when none is waiting)."""
    frame = _recv(sock, flags, False)
    parts = [frame]
    while frame.more:
        frame = _recv(sock, 0, False)
        parts.append(frame)
    return parts


def readable(sock: zmq.Socket) -> bool:
    """A whole message is waiting (EVENTS, not zmq.Again: an exception per wake costs more)."""
    return bool(_get(sock, _EVENTS) & _POLLIN)
