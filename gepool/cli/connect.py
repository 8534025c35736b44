"""Reaching a pool from the command line: a clear user error, at once, when nothing listens."""

import os
import socket

from gepool.cli.args import UsageError
from gepool.common import errors

PROBE_TIMEOUT_S = 5.0  # a tcp endpoint that does not accept a connection in this long is not listening


def connect(target: str | None, **kwargs):
    """A Client of the pool at ``target`` (default: the default endpoint), or a UsageError saying that
    nothing listens there, at once rather than after the client's connect timeout."""
    from gepool.client import Client
    from gepool.ipc.sockets import default_endpoint, ipc_path

    target = target or default_endpoint()
    path = ipc_path(target)
    if path is not None:
        if not os.path.exists(path):
            raise UsageError(f"no pool on {target}: {path} does not exist (start one with 'gepool start', "
                             "or give its --endpoint)")
        probe(path, f"no pool listens on {target}")
    else:
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        if not port.isdigit():
            raise UsageError(f"a client needs the pool's port, not '{target}'")
        probe((host.strip("[]"), int(port)), f"no pool listens on {target}")
    try:
        return Client(target, **kwargs)
    except errors.PoolUnavailable as exc:
        raise UsageError(f"no pool answers on {target}: {exc}") from None


def probe(address, why: str) -> None:
    """Raises UsageError(why: ...) unless something accepts a connection at ``address`` (a Unix socket
    path, or (host, port))."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET6 if ":" in address[0] \
        else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(PROBE_TIMEOUT_S)
        try:
            s.connect(address)
        except OSError as exc:
            raise UsageError(f"{why}: {exc.strerror or exc}") from None
