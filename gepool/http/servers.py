"""Which servers may serve the sidecar's KServe ports (HTTP, gRPC), and whether this host has them installed."""

import importlib.util

HTTP_SERVERS = ("aiohttp", "granian", "httptools")
DEFAULT_HTTP_SERVER = "httptools"
GRANIAN_REQUIREMENT = "granian>=2.5,<3"
HELP = (f"what serves the KServe HTTP port: httptools (HTTP parsed in C by httptools, on a bare asyncio "
        f"protocol), aiohttp, or granian (HTTP parsed in Rust; the package granian, gepool[granian]); default "
        f"{DEFAULT_HTTP_SERVER}; /metrics is served by aiohttp in every case")


GRPC_SERVERS = ("native", "grpcio")
DEFAULT_GRPC_SERVER = "native"
GRPC_HELP = ("what serves the gRPC port: native (HTTP/2 and gRPC on the sidecar's asyncio loop, no threads) or "
             f"grpcio (grpc.aio); default {DEFAULT_GRPC_SERVER}")


def refusal(name: str) -> str | None:
    """Why ``name`` cannot serve here (an unknown name, or its package missing), or None when it can."""
    if name not in HTTP_SERVERS:
        return f"the HTTP server must be one of {', '.join(HTTP_SERVERS)}, not '{name}'"
    if name == "granian" and not _installed("granian"):
        return f"the HTTP server granian needs the package granian, which is not installed " \
               f"(pip install '{GRANIAN_REQUIREMENT}', or gepool[granian])"
    if name == "httptools" and not _installed("httptools"):
        return "the HTTP server httptools needs the package httptools, which is not installed (pip install httptools)"
    return None


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # sys.modules[module] is None (hidden), or has no spec
        return False
