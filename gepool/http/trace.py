"""Triton's trace extension as a pool without tracing answers it: tracing is off and cannot be turned on.

GET answers the settings Triton reports with tracing off (its defaults); a POST is accepted only where
it leaves them as they are (a setting given its current value, or null), and anything else is refused,
naming the setting, rather than accepted and ignored.
"""

from gepool.common.errors import InvalidArgument

SETTINGS = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
            "trace_file": "", "trace_mode": "triton"}


def settings() -> dict:
    return {k: list(v) if isinstance(v, list) else v for k, v in SETTINGS.items()}


def check_update(request: object) -> None:
    """InvalidArgument for a $trace_request that would change anything (gepool has no tracing)."""
    if not isinstance(request, dict):
        raise InvalidArgument("the trace setting request must be a JSON object")
    for key, value in request.items():
        if key not in SETTINGS:
            raise InvalidArgument(f"unknown trace setting '{key}' (the settings: {', '.join(SETTINGS)})")
        if key == "trace_file" and value is not None:  # Triton refuses it through the network, whatever it is
            raise InvalidArgument("trace file location can not be updated through network protocol")
        if value is not None and value != SETTINGS[key]:
            raise InvalidArgument(f"gepool has no tracing: trace setting '{key}' can only be "
                                  f"{SETTINGS[key]!r}, not {value!r:.100}")
