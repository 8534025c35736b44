"""Triton's request-level inference parameters: which gepool honours on each surface, their rules and messages."""

from collections.abc import Mapping
from dataclasses import dataclass

from gepool.common.errors import InvalidArgument

HTTP, GRPC = "HTTP", "gRPC"
TIMEOUT, PRIORITY = "timeout", "priority"
BINARY_DATA_OUTPUT = "binary_data_output"  # HTTP's: outputs as binary data (gRPC's are always raw)
FINAL_FLAG = "triton_enable_empty_final_response"  # gRPC streaming clients and perf_analyzer send it
SUPPORTED = {HTTP: (BINARY_DATA_OUTPUT, PRIORITY, TIMEOUT), GRPC: (PRIORITY, TIMEOUT, FINAL_FLAG)}
MICROSECONDS = 1e-6
# Triton's versions, timeouts (gRPC's int64_param: its float round trip in _wire is 2**63, still a msgpack
# uint64), dimensions and counts are int64; its priority is a uint64
MAX_INT64, MAX_UINT64 = (1 << 63) - 1, (1 << 64) - 1
MAX_KEY_SHOWN = 100  # characters of an unknown key a message repeats


@dataclass(frozen=True)
class RequestParameters:
    timeout_s: float | None = None  # None: no timeout (Triton's 0)
    priority: int = 0  # 0: the model's default level, 1 the highest
    binary_data_output: bool = False
    final_response: bool = False  # mark the (only) response as the final one


DEFAULTS = RequestParameters()  # shared by every request without parameters: frozen, so none can change it


def non_negative_int(key: str, value: object, maximum: int, what: str = "", unit: str = "") -> int:
    """``value`` if it is an integer in 0..maximum, else InvalidArgument naming parameter ``key`` (of
    ``what``, e.g. "input 'X'", if given) and the range."""
    where = f"{what}: " if what else ""
    if type(value) is not int or value < 0:  # bool is an int subclass, and no count
        raise InvalidArgument(f"{where}parameter '{key}' must be a non-negative integer, got {value!r}{unit}")
    if value > maximum:
        raise InvalidArgument(f"{where}parameter '{key}' must be an integer in 0..{maximum}, got {value}{unit}")
    return value


def model_version(text: str | None) -> int | None:
    """A requested model version (URL path or gRPC model_version): None when absent, else an integer in
    1..MAX_INT64 or InvalidArgument."""
    if not text:
        return None
    digits = text.lstrip("0")
    refused = (f"failed to get model version from specified version string '{text[:MAX_KEY_SHOWN]}': version "
               f"should be an integral value")
    if not (text.isascii() and text.isdecimal()) or not digits:
        raise InvalidArgument(f"{refused} > 0")
    if len(digits) > len(str(MAX_INT64)) or int(digits) > MAX_INT64:  # int() refuses past 4300 digits
        raise InvalidArgument(f"{refused} in 1..{MAX_INT64}")
    return int(digits)


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"parameter '{key}' must be a bool, got {value!r}")
    return value


def check(params: Mapping[str, object], protocol: str) -> RequestParameters:
    """A request's parameters (key -> its value as JSON or the InferParameter's oneof reads) over
    ``protocol`` (HTTP or GRPC): what gepool does with them, or InvalidArgument naming the first it would
    otherwise ignore. ``timeout`` is Triton's, in microseconds; ``priority`` is Triton's uint64 (a level
    past the model's priority_levels runs at the default level, as Triton does)."""
    if not params:
        return DEFAULTS
    supported = SUPPORTED[protocol]
    timeout, priority, binary, final = None, 0, False, False
    for key, value in params.items():
        if key in supported:
            if key == TIMEOUT:
                micros = non_negative_int(key, value, MAX_INT64, unit=" (a timeout in microseconds)")
                timeout = micros * MICROSECONDS if micros else None
            elif key == PRIORITY:
                priority = non_negative_int(key, value, MAX_UINT64)
            elif key == BINARY_DATA_OUTPUT:
                binary = _bool(key, value)
            else:
                final = _bool(key, value)
        elif isinstance(key, str) and key.startswith("sequence_"):
            raise InvalidArgument(f"parameter '{key[:MAX_KEY_SHOWN]}': sequence batching is not supported by gepool")
        elif key in (BINARY_DATA_OUTPUT, FINAL_FLAG):
            other = HTTP if protocol == GRPC else GRPC
            raise InvalidArgument(f"parameter '{key}' is {other}'s, not supported over {protocol} (supported: "
                                  f"{', '.join(supported)})")
        else:
            raise InvalidArgument(f"parameter '{str(key)[:MAX_KEY_SHOWN]}' is not supported by gepool (supported: "
                                  f"{', '.join(supported)})")
    return RequestParameters(timeout, priority, binary, final)


def check_control(params: Mapping[str, object]) -> None:
    """A load or unload request's parameters: only unload_dependents false, which tritonclient sends with every
    unload; a config or file override, anything else, is refused naming it (nothing is ignored)."""
    rest = dict(params)
    if rest.pop("unload_dependents", False) is not False:
        raise InvalidArgument("unload_dependents is not supported: unload each model by name")
    if "config" in rest or any(k.startswith("file:") for k in rest):
        raise InvalidArgument("load with a 'config' or 'file:' override is not supported; change the repository "
                              "and load again")
    if rest:
        raise InvalidArgument(f"unrecognized load parameter(s) {sorted(rest)!r:.200}: gepool takes none but "
                              f"unload_dependents false")
