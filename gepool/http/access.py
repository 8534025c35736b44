"""Who may call which HTTP API: Triton's ``--http-restricted-api`` groups, and gepool's default that only
the pool's own user (or root) may load and unload models.

``--http-restricted-api=API[,API...]:KEY=VALUE`` (repeatable) makes every request to those APIs carry
the header KEY with exactly VALUE, else it is answered 403 "This API is restricted, expecting header
'KEY'", before anything else is looked at, as Triton does. The API names and the endpoints in each are
Triton's (``src/restricted_features.h``, ``src/http_server.cc``).
"""

import re
from dataclasses import dataclass, field

API_NAMES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
             "statistics", "trace", "logging")
FLAG = "--http-restricted-api"

# Path -> API, checked in order; what matches none (an unknown path) is left to the router's 404.
_PATHS = [(re.compile(p), api) for p, api in (
    (r"^/v2/health/(live|ready)$", "health"),
    (r"^/v2/models/[^/]+(/versions/[^/]+)?/ready$", "health"),
    (r"^/v2/models/[^/]+(/versions/[^/]+)?/(infer|generate|generate_stream)$", "inference"),
    (r"^/v2/models/[^/]+(/versions/[^/]+)?/config$", "model-config"),
    (r"^/v2/models(/[^/]+(/versions/[^/]+)?)?/stats$", "statistics"),
    (r"^/v2/models/[^/]+(/versions/[^/]+)?/trace/setting$", "trace"),
    (r"^/v2/trace/setting$", "trace"),
    (r"^/v2/logging$", "logging"),
    (r"^/v2/repository(/[^/]+)?/(index|models/[^/]+/(load|unload))$", "model-repository"),
    (r"^/v2/(system|cuda)sharedmemory(/region/[^/]+)?/(status|register|unregister)$", "shared-memory"),
    (r"^/v2/models/[^/]+(/versions/[^/]+)?$", "metadata"),
    (r"^/v2$", "metadata"),
)]


def api_of(path: str) -> str | None:
    for pattern, api in _PATHS:
        if pattern.match(path):
            return api
    return None


@dataclass
class Restrictions:
    """API name -> (header, value) it requires."""

    by_api: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, groups: list[str] | tuple[str, ...], flag: str = FLAG, noun: str = "api") -> "Restrictions":
        """Each group as Triton takes it: ``API[,API...]:KEY=VALUE``; ValueError with Triton's words (which
        call the groups of ``--grpc-restricted-protocol`` protocols: ``noun``)."""
        out = cls()
        for arg in groups:
            apis, colon, setting = arg.partition(":")
            key, eq, value = setting.partition("=")
            if not colon or not eq or not apis or not key or not value:
                raise ValueError(f"{flag} option format is '<config name>:<setting>=<value>'. Got {arg}")
            for api in apis.split(","):
                if api not in API_NAMES:
                    raise ValueError(f"unknown restricted {noun} '{api}' (known: {', '.join(API_NAMES)})")
                if api in out.by_api:
                    raise ValueError(f"restricted {noun} '{api}' can not be specified in multiple config groups")
                out.by_api[api] = (key, value)
        return out

    def refusal(self, path: str, headers) -> str | None:
        """The 403 message for a request that lacks its API's header, or None when it may pass."""
        if not self.by_api:  # nothing restricted: every request passes, without matching its path
            return None
        api = api_of(path)
        if api is None or api not in self.by_api:
            return None
        key, value = self.by_api[api]
        if headers.get(key) != value:
            return f"This API is restricted, expecting header '{key}'"
        return None

    def restricts(self, api: str) -> bool:
        return api in self.by_api
