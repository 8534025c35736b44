"""ZMQ CURVE for the front's client endpoint: keys from certificate files, a ZAP handler that admits
the authorized client keys (and the pool's own, which its HTTP sidecar uses) or any key."""

import os

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from gepool.common import errors
from gepool.ipc.sockets import load_keys


class _AllowKeys:
    """A ZAP credentials provider: a client key is admitted if it is one of the authorized ones."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


def start_curve(ctx: zmq.Context, secret_file: str, authorized_dir: str | None
                ) -> tuple[ThreadAuthenticator, tuple[bytes, bytes]]:
    """The running authenticator (stop it before the context terminates) and the server's (public, secret)."""
    public, secret = load_keys(secret_file)
    if secret is None:
        raise errors.InvalidArgument(f"{secret_file} holds no secret key")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    if authorized_dir:
        allowed = {public} | {load_keys(os.path.join(authorized_dir, f))[0]
                              for f in os.listdir(authorized_dir) if f.endswith(".key")}
        auth.configure_curve_callback("*", credentials_provider=_AllowKeys(allowed))
    else:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    return auth, (public, secret)
