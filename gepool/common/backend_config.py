"""Triton's --backend-config: ``[BACKEND,]SETTING=VALUE`` groups; gepool has one setting, default-max-batch-size."""

from gepool.common.config import BACKEND_ONNX

DEFAULT_MAX_BATCH_SIZE = 4  # tritonserver's default for default-max-batch-size
MAX_BATCH_SIZE = (1 << 31) - 1  # max_batch_size is an int32 in Triton's ModelConfig
# each setting gepool has, with the backends that read it ("": a global group, which tritonserver gives every
# backend; a backend's own group overrides it for that backend)
SETTINGS = {"default-max-batch-size": ("", BACKEND_ONNX)}
FORMAT = "--backend-config option format is '<backend name>,<setting>=<value>'. Got "


def parse(arg: str) -> tuple[str, str, str]:
    """(backend, setting, value) of one group, backend "" for a global one; ValueError in tritonserver's words
    (ParseBackendConfigOption), then for a setting gepool does not have."""
    name_end = arg.find(",")
    setting_end = arg.find("=", name_end + 1)
    if name_end == 0:
        raise ValueError("No backend specified. --backend-config option format is <backend name>,<setting>=<value> "
                         f"or <setting>=<value>. Got {arg}")
    if setting_end < 0:
        raise ValueError(FORMAT + arg)
    backend = arg[:name_end] if name_end > 0 else ""
    setting, value = arg[name_end + 1:setting_end], arg[setting_end + 1:]
    if not setting or not value:
        raise ValueError(FORMAT + arg)
    if backend not in SETTINGS.get(setting, ()):
        scope = f"backend '{backend}'" if backend else "every backend (a group without a backend name)"
        raise ValueError(f"--backend-config {arg}: gepool has no setting '{setting}' for {scope}; its only "
                         f"setting is default-max-batch-size, global or for {BACKEND_ONNX}")
    if not value.isdecimal() or not value.isascii() or int(value) > MAX_BATCH_SIZE:
        raise ValueError(f"--backend-config {arg}: default-max-batch-size must be an integer from 0 to "
                         f"{MAX_BATCH_SIZE}, not '{value}'")
    return backend, setting, value


def default_max_batch_size(groups: tuple[str, ...] | list[str], backend: str = BACKEND_ONNX) -> int:
    """The max_batch_size auto-complete gives ``backend``'s batchable models: its own group's, else the global
    one's (the last of each when repeated), else tritonserver's default. ValueError for a bad group."""
    found: dict[str, int] = {}
    for arg in groups:
        name, _, value = parse(arg)
        found[name] = int(value)
    return found.get(backend, found.get("", DEFAULT_MAX_BATCH_SIZE))
