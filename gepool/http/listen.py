"""Listening sockets bound once by the pool and shared by every sidecar process it starts."""

import asyncio
import os
import socket

BACKLOG = 1024
PORTS = {"http": "HTTP", "metrics": "metrics", "grpc": "gRPC"}  # the sidecar's ports (passed as --<name>-fd)


def bind(host: str, port: int, what: str = "HTTP") -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to (as asyncio's create_server binds), with
    SO_REUSEADDR and never SO_REUSEPORT: a port another process holds is refused (OSError), not shared.
    Each sidecar inherits them (``pass_fds``) and accepts on the same ones."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"cannot listen for {what} on {show(host, port)}: {exc.strerror.lower()}") from None
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


class Listening:
    """What gepool's own HTTP/1.1 and gRPC servers share: servers accepting on host:port (bound here) or on
    inherited sockets, the set of open connections, a sweep of them every ``sweep_s``, and a stop that
    lets running work finish within a grace period. A subclass says how a connection is made, swept,
    told to stop, found busy and cut off."""

    sweep_s = 1.0

    def __init__(self, host: str, port: int, socks: list[socket.socket] | None) -> None:
        self.host, self.port, self.socks = host, port, socks
        self.connections: set = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.Task | None = None

    def connection(self) -> asyncio.Protocol:
        raise NotImplementedError

    def swept(self, now: float) -> None:
        """Called every ``sweep_s`` with the loop's time."""
        raise NotImplementedError

    def stopping_now(self, conn) -> None:
        """``conn`` hears that the server stops (it may close at once if idle)."""
        raise NotImplementedError

    def busy(self, conn) -> bool:
        """Whether ``conn`` still runs work the stop should wait for."""
        raise NotImplementedError

    def cut(self, conn) -> None:
        """Closes ``conn`` at once, ending whatever it still runs."""
        raise NotImplementedError

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.socks is None:
            self._servers = [await self.loop.create_server(self.connection, self.host, self.port,
                                                           reuse_address=True, backlog=BACKLOG)]
        else:
            self._servers = [await self.loop.create_server(self.connection, sock=sock, backlog=BACKLOG)
                             for sock in self.socks]
        self._sweeper = self.loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            self.swept(self.loop.time())

    async def stop(self, grace: float) -> None:
        """Stops accepting; each connection hears so, running work gets ``grace`` seconds, then every
        connection is cut."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if not self._servers:
            return
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            self.stopping_now(conn)
        deadline = self.loop.time() + grace
        while any(self.busy(c) for c in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            self.cut(conn)
        for server in self._servers:
            await server.wait_closed()


def _show(address: tuple) -> str:
    return show(address[0], address[1])


def show(host: str, port: int) -> str:
    """host:port, an IPv6 address in brackets (as URLs and gRPC targets write it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
