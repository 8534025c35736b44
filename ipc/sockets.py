"""The one place that makes ZMQ sockets: bind/connect, high-water marks, linger, endpoint files."""

import os
import stat

import zmq

LINGER_MS = 0  # a stopping process never waits on unsent messages: every peer handles loss
HWM = 0  # no silent drops at a high-water mark; overload is refused by the front's queues


def runtime_dir() -> str:
    """gepool's folder in the user's runtime directory (made if missing), which only the user can enter:
    endpoints, worker sockets and doorbells live there."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/gepool-{os.getuid()}"
    folder = os.path.join(base, "gepool")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def default_endpoint() -> str:
    """An ipc:// path in the user's runtime directory, in a folder only the user can enter."""
    return f"ipc://{runtime_dir()}/gepool.sock"


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def load_keys(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret) from a ZMQ certificate file (zmq.auth.create_certificates writes them); the
    secret is None for a .key file that holds only the public half."""
    import zmq.auth

    return zmq.auth.load_certificate(path)


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
                identity: bytes | None = None, curve_server: tuple[bytes, bytes] | None = None,
                curve_client: tuple[bytes, bytes, bytes] | None = None) -> zmq.Socket:
    """A socket with gepool's options; an ipc endpoint it binds is made owner-only (0600).
    ``curve_server=(public, secret)`` or ``curve_client=(server_public, public, secret)`` turn on ZMQ's
    CURVE encryption and authentication (for tcp endpoints)."""
    sock = ctx.socket(kind)
    if curve_server is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve_server
    if curve_client is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_client
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished peer are dropped, not raised
    try:
        if bind is not None:
            path = ipc_path(bind)
            if path and os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)  # a stale socket file left by a dead pool; a live one was checked for
            sock.bind(bind)
            if path:
                os.chmod(path, 0o600)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(0)
        raise
    return sock
