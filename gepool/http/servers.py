"""Which HTTP server may serve the sidecar's KServe port, and whether this host has it installed."""

HTTP_SERVERS = ("aiohttp", "granian")
DEFAULT_HTTP_SERVER = "aiohttp"
GRANIAN_REQUIREMENT = "granian>=2.5,<3"


def refusal(name: str) -> str | None:
    """Why ``name`` cannot serve here (an unknown name, or its package missing), or None when it can."""
    if name not in HTTP_SERVERS:
        return f"the HTTP server must be one of {', '.join(HTTP_SERVERS)}, not '{name}'"
    if name == "granian" and not _importable("granian"):
        return f"the HTTP server granian needs the package granian, which is not installed " \
               f"(pip install '{GRANIAN_REQUIREMENT}', or gepool[granian])"
    return None


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
