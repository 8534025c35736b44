"""Listening sockets bound once by the pool and shared by every sidecar process it starts."""

import asyncio
import os
import socket
from collections.abc import Callable

BACKLOG = 1024
PORTS = {"http": "HTTP", "metrics": "metrics", "grpc": "gRPC"}  # the sidecar's ports (passed as --<name>-fd)


def bind(host: str, port: int, what: str = "HTTP") -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to (as asyncio's create_server binds), with
    SO_REUSEADDR and never SO_REUSEPORT: a port another process holds is refused (OSError), not shared.
    Each sidecar inherits them (``pass_fds``) and accepts on the same ones."""
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # getaddrinfo may repeat an address
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # else "::" also takes the IPv4 port the next address binds
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen for {what} on {_show(address)}: "
                                         f"{exc.strerror.lower()}") from None
            sock.listen(BACKLOG)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


def adopt(fds: list[int]) -> list[socket.socket]:
    """The listening sockets a sidecar inherited, by descriptor (each is checked to be one)."""
    adopted = []
    for fd in fds:
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.detach()
            raise ValueError(f"descriptor {fd} is not a listening stream socket")
        os.set_inheritable(fd, False)  # the sidecar's own children (its JSON helper) must not hold it
        adopted.append(sock)
    return adopted


async def serve(loop: asyncio.AbstractEventLoop, protocol: Callable[[], asyncio.Protocol], host: str, port: int,
                socks: list[socket.socket] | None) -> list[asyncio.Server]:
    """Servers accepting on ``socks``, or (None) on host:port bound here."""
    if socks is None:
        return [await loop.create_server(protocol, host, port, reuse_address=True, backlog=BACKLOG)]
    return [await loop.create_server(protocol, sock=sock, backlog=BACKLOG) for sock in socks]


def _show(address: tuple) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
