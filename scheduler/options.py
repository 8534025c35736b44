"""What a front is started with."""

import logging
import os
from dataclasses import dataclass

from gepool.common.logsettings import LogSettings

DRAIN_TIMEOUT_S = 30.0
QUEUED_BYTES_SHARE = 4  # by default the queues may hold a quarter of the host's memory
ALL_MODELS = "*"  # Triton's --load-model that loads every model of the repository (the only one given)
MODEL_LOAD_TIMEOUT_S = 180.0  # then a model still loading is UNAVAILABLE (below Pool.start()'s own timeout)


def named_at_start(mode: str, load_models: tuple[str, ...]) -> tuple[str, ...] | None:
    """The models a pool loads by name at start (explicit mode's --load-model), or None for every model of the
    repository (the other modes, and ALL_MODELS)."""
    return tuple(load_models) if mode == "explicit" and ALL_MODELS not in load_models else None


@dataclass
class FrontOptions:
    repository: str
    endpoint: str
    owner_id: str
    cpu_threads: int = 0  # threads per CPU model, split among its instances; 0 = every core
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    log_level: int = logging.INFO
    log_format: str = "default"  # Triton's log_format: "ISO8601" stamps log lines in UTC
    log_file: str = ""  # where every process's standard error goes (Triton's log_file, reported); "": unchanged
    exit_grace_s: float = 0.0  # after SIGTERM: report not ready but keep serving this long, then drain
    model_control_mode: str = "none"  # none | explicit | poll (Triton's names)
    load_models: tuple[str, ...] = ()  # explicit mode: what to load at start (ALL_MODELS alone: every model)
    poll_secs: float = 15.0
    curve_secret_key: str | None = None  # a certificate file: turns CURVE on for the client endpoint
    curve_authorized_keys: str | None = None  # a folder of client public keys; none: any key may connect
    busy_poll_us: int = 0  # 0: poll only for what is due within microseconds; N > 0: also N us when idle; -1: never
    backend_config: tuple[str, ...] = ()  # Triton's --backend-config groups (default-max-batch-size)
    model_config_name: str = ""  # Triton's --model-config-name: configs/<name>.pbtxt over config.pbtxt
    auto_complete_config: bool = True  # Triton's config auto-complete (off: --disable-auto-complete-config)
    max_queued_bytes: int = 0  # bytes of requests all queues may hold together (UNAVAILABLE past it); 0: default
    model_load_timeout_s: float = MODEL_LOAD_TIMEOUT_S  # a worker still loading after this is killed
    cache_size: int = 0  # bytes of the response cache (Triton's --cache-config local,size=BYTES); 0: no cache
    sidecar_token: str | None = None  # what the pool's sidecars show to use the shared-memory record
    regions_fd: int = -1  # a memfd the shared-memory record's version is written to, for the sidecars

    def log_settings(self) -> LogSettings:
        """The log settings the front and its workers start with."""
        return LogSettings.of_level(self.log_level, self.log_format, self.log_file)


def queued_bytes_limit(asked: int) -> int:
    """``max_queued_bytes`` as the front applies it: the asked number, or a share of the host's RAM."""
    if asked < 0:
        raise ValueError(f"max_queued_bytes must be >= 0 (0: a 1/{QUEUED_BYTES_SHARE} share of memory), not {asked}")
    return asked or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // QUEUED_BYTES_SHARE
