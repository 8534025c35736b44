"""The one place that makes ZMQ sockets: bind/connect, high-water marks, linger, endpoint files."""

import os
import stat

import zmq

LINGER_MS = 0  # a stopping process never waits on unsent messages: every peer handles loss
HWM = 0  # no silent drops at a high-water mark; overload is refused by the front's queues
FALLBACK_BASE = "/tmp/gepool-{uid}"  # the runtime directory's stand-in when XDG_RUNTIME_DIR is unset


def runtime_dir() -> str:
    """gepool's folder in the user's runtime directory (made if missing), which only the user can enter:
    endpoints, worker sockets and doorbells live there. Without XDG_RUNTIME_DIR the base is
    /tmp/gepool-<uid>, made 0700; a folder there (or gepool's own) that another user made in advance, a
    link, or one others may enter is refused with a PermissionError saying so."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = xdg or FALLBACK_BASE.format(uid=os.getuid())
    if not xdg:
        _own_folder(base)
    folder = os.path.join(base, "gepool")
    _own_folder(folder)
    return folder


def _own_folder(path: str) -> None:
    """Makes ``path`` (mode 0700) unless it exists, then checks that it is a real folder of this user's
    that nobody else may enter."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    uid = os.getuid()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"gepool's runtime folder {path} is not a folder (a link or a file is there): "
                              f"remove it, or set XDG_RUNTIME_DIR to a folder of your own")
    if st.st_uid != uid:
        raise PermissionError(f"gepool's runtime folder {path} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {uid}): remove it, or set XDG_RUNTIME_DIR to a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours: made by an older gepool, or by hand with a wider mode


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
                curve_client: tuple[bytes, bytes, bytes] | None = None, max_frame: int = -1) -> zmq.Socket:
    """A socket with gepool's options; an ipc endpoint it binds is made owner-only (0600).
    ``curve_server=(public, secret)`` or ``curve_client=(server_public, public, secret)`` turn on ZMQ's
    CURVE encryption and authentication (for tcp endpoints). ``max_frame``: a peer declaring a larger
    frame is disconnected at its header (-1: no limit)."""
    sock = ctx.socket(kind)
    if curve_server is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve_server
    if curve_client is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_client
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)  # before bind: a listener copies the options it has then
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
