"""Who may call which gRPC method: Triton's ``--grpc-restricted-protocol`` groups.

``--grpc-restricted-protocol=API[,API...]:KEY=VALUE`` (repeatable) makes every call to those protocols' methods carry
the metadata ``triton-grpc-protocol-KEY`` with exactly VALUE, else it is answered UNAVAILABLE "This protocol
is restricted, expecting header 'triton-grpc-protocol-KEY'" before its request is read, as Triton does (its
``kRestrictedProtocolHeaderTemplate`` and ``ExecutePrecondition`` in ``src/grpc/``). The protocols are named
as ``--http-restricted-api``'s APIs; the methods in each are Triton's (``src/grpc/grpc_server.cc``, one
``restricted_keys_.Get`` per method). The first copy of a repeated key decides, as Triton's metadata lookup.
"""

import re

from gepool.http.access import Restrictions

FLAG = "--grpc-restricted-protocol"
PREFIX = "triton-grpc-protocol-"
_INFERENCE = "/inference.GRPCInferenceService/"
_HEALTH = "/grpc.health.v1.Health/"
METHODS = {
    "health": [_INFERENCE + m for m in ("ServerLive", "ServerReady", "ModelReady")]
    + [_HEALTH + m for m in ("Check", "List", "Watch")],
    "metadata": [_INFERENCE + m for m in ("ServerMetadata", "ModelMetadata")],
    "inference": [_INFERENCE + m for m in ("ModelInfer", "ModelStreamInfer")],
    "shared-memory": [_INFERENCE + f"{kind}SharedMemory{op}" for kind in ("System", "Cuda")
                      for op in ("Status", "Register", "Unregister")],
    "model-config": [_INFERENCE + "ModelConfig"],
    "model-repository": [_INFERENCE + m for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")],
    "statistics": [_INFERENCE + "ModelStatistics"],
    "trace": [_INFERENCE + "TraceSetting"],
    "logging": [_INFERENCE + "LogSettings"],
}
# gRPC's spec (PROTOCOL-HTTP2.md): a metadata key is lowercase; a value that is not binary ("-bin") is
# printable ASCII. A key or value outside them could never be sent, so the API would be shut to everyone.
_KEY = re.compile(r"[0-9a-z_.-]+")
_VALUE = re.compile(r"[\x20-\x7e]+")


class GrpcRestrictions:
    """Method path (bytes, as ``:path`` arrives) -> (metadata key, value, the refusal's text)."""

    def __init__(self, restrictions: Restrictions | None = None) -> None:
        self.api = restrictions or Restrictions()
        self.by_path: dict[bytes, tuple[bytes, bytes, str]] = {}
        for api, (key, value) in self.api.by_api.items():
            header = PREFIX + key.lower()
            rule = (header.encode(), value.encode(), f"This protocol is restricted, expecting header '{header}'")
            for path in METHODS[api]:
                self.by_path[path.encode()] = rule
        self.keys = frozenset(rule[0] for rule in self.by_path.values())

    @classmethod
    def parse(cls, groups: list[str] | tuple[str, ...]) -> "GrpcRestrictions":
        """Each group as Triton takes it; ValueError with Triton's words, or naming a key or value no gRPC
        client can send."""
        restrictions = Restrictions.parse(groups, FLAG, "protocol")
        for key, value in restrictions.by_api.values():
            if not _KEY.fullmatch(key.lower()) or (PREFIX + key.lower()).endswith("-bin"):
                raise ValueError(f"{FLAG}: '{key}' cannot be a gRPC metadata key (letters, digits, '_', '.' and '-', "
                                 f"not ending in '-bin')")
            if not _VALUE.fullmatch(value):
                raise ValueError(f"{FLAG}: the value of '{key}' must be printable ASCII to travel as gRPC metadata")
        return cls(restrictions)

    def refusal(self, path: bytes, metadata: dict[bytes, bytes]) -> str | None:
        """The UNAVAILABLE text for a call to ``path`` whose metadata (key -> its first value) lacks its API's
        key and value, or None when it may go on."""
        rule = self.by_path.get(path)
        if rule is None or metadata.get(rule[0]) == rule[1]:
            return None
        return rule[2]

    def restricts(self, api: str) -> bool:
        return self.api.restricts(api)
