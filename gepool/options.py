"""The pool's options: one dataclass, from the command line or ``Pool(...)`` through to the front process."""

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from gepool.common.logsettings import FORMATS
from gepool.http.servers import DEFAULT_GRPC_SERVER, DEFAULT_HTTP_SERVER, GRPC_SERVERS
from gepool.ipc import naming
from gepool.ipc.sockets import default_endpoint
from gepool.scheduler.options import ALL_MODELS, MODEL_LOAD_TIMEOUT_S, FrontOptions

if TYPE_CHECKING:
    from gepool.common.repository import Reading

MODEL_CONTROL_MODES = ("none", "explicit", "poll")
# sidecars=0: one sidecar per this many cores, at most this many (see docs/design.md, "Sidecars")
SIDECAR_CORES = 8
MAX_AUTO_SIDECARS = 4
MAX_SIDECARS = 64


@dataclass
class PoolOptions:
    """Everything a pool is started with. A new option is one field here (named as the front's own
    ``FrontOptions`` field when the front needs it: ``front_options`` copies every field the two share)
    and, for ``gepool start``, one flag in ``gepool/cli/start.py`` whose ``dest`` is the field's name."""

    repository: str
    endpoint: str | None = None  # None: the default ipc endpoint in the user's runtime folder
    owner_id: str | None = None  # the id in the names of the pool's segments and files; None: a new one
    cpu_threads: int = 0  # onnxruntime threads per CPU model, split among its instances; 0: every core
    log_level: int = logging.WARNING  # the least severe level logged, in the front, its workers and the sidecar
    log_format: str = "default"  # Triton's --log-format: "ISO8601" stamps log lines in UTC, in every process
    log_file: str = ""  # Triton's --log-file: every process's log (its standard error) appended to it; "": none
    server_id: str = "gepool"  # the server's name in its metadata (Triton's --id)
    exit_grace_s: float = 0.0  # after SIGTERM: report not ready but keep serving this long, then drain
    model_control_mode: str = "none"  # Triton's none | explicit | poll
    load_models: tuple[str, ...] = ()  # explicit mode: what to load at start ("*" alone: every model)
    poll_secs: float = 15.0  # poll mode: seconds between repository scans
    curve_secret_key: str | None = None  # a ZMQ certificate file: CURVE on a tcp endpoint
    curve_authorized_keys: str | None = None  # a folder of client public keys; None: any key may connect
    busy_poll_us: int = 0  # 0: adaptive polling; N > 0: poll N us before any sleep; -1: never poll
    auto_complete_config: bool = True  # False: Triton's --disable-auto-complete-config
    backend_config: tuple[str, ...] = ()  # Triton's [BACKEND,]SETTING=VALUE groups (default-max-batch-size only)
    model_config_name: str = ""  # Triton's --model-config-name: a model's configs/<name>.pbtxt, where it has one
    http_port: int = 0  # the KServe v2 HTTP sidecar's port; 0: no HTTP
    http_host: str = "127.0.0.1"  # the address the HTTP port binds (Triton's --http-address), and the others'
    grpc_host: str = ""  # the gRPC port's address (Triton's --grpc-address); "": http_host
    metrics_host: str = ""  # the metrics port's address (Triton's --metrics-address); "": http_host
    metrics_port: int = 0  # Prometheus /metrics; 0: none
    cpu_metrics: bool = True  # Triton's nv_cpu_* gauges in /metrics (Triton's --allow-cpu-metrics)
    grpc_port: int = 0  # Triton's KServe v2 gRPC service, served by the sidecar; 0: none
    http_restricted_api: tuple[str, ...] = ()  # Triton's API[,API...]:KEY=VALUE groups
    grpc_restricted_protocol: tuple[str, ...] = ()  # the same for gRPC (metadata triton-grpc-protocol-KEY)
    http_max_body_bytes: int = 0  # the largest HTTP request body; 0: the largest slot plus room for JSON
    http_server: str = DEFAULT_HTTP_SERVER  # what serves http_port (gepool/http/servers.py)
    grpc_server: str = DEFAULT_GRPC_SERVER  # what serves grpc_port (gepool/http/servers.py)
    sidecars: int = 0  # sidecar processes sharing the HTTP, metrics and gRPC ports; 0: sized by sidecar_count
    strict_readiness: bool = True  # False: /v2/health/ready is ready while any model is unavailable
    max_queued_bytes: int = 0  # bytes of requests all queues may hold together (UNAVAILABLE past it); 0: a RAM share
    model_load_timeout_s: float = MODEL_LOAD_TIMEOUT_S  # a model still loading after this is UNAVAILABLE
    cache_size: int = 0  # bytes of the response cache (Triton's --cache-config local,size=BYTES); 0: no cache

    def __post_init__(self) -> None:
        for name in ("load_models", "http_restricted_api", "grpc_restricted_protocol", "backend_config"):
            given = getattr(self, name)
            if isinstance(given, str | bytes) or not isinstance(given, list | tuple) \
                    or not all(isinstance(item, str) for item in given):  # (a str would be its letters)
                raise ValueError(f"{name} must be a list of strings, not {given!r:.100}")
            setattr(self, name, tuple(given))  # lists from JSON and argparse

    def check(self) -> None:
        """Refuses, naming it, an option no pool can start with (before any process is started)."""
        if not os.path.isdir(self.repository):
            raise FileNotFoundError(f"the model repository '{self.repository}' is not a folder")
        if self.model_control_mode not in MODEL_CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {', '.join(MODEL_CONTROL_MODES)}, not "
                             f"'{self.model_control_mode}'")
        if self.model_control_mode == "explicit" and ALL_MODELS in self.load_models and len(set(self.load_models)) > 1:
            raise ValueError(f"Wildcard model name '{ALL_MODELS}' must be the ONLY startup model if specified at all.")
        for name in ("http_host", "grpc_host", "metrics_host", "server_id", "log_format", "log_file",
                     "model_config_name"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, not {getattr(self, name)!r:.100}")
        if not isinstance(self.cpu_metrics, bool):
            raise ValueError(f"cpu_metrics must be true or false, not {self.cpu_metrics!r:.100}")
        if self.log_format not in FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(FORMATS)}, not '{self.log_format}'")
        if "\0" in self.log_file or not self.log_file.isprintable():
            raise ValueError(f"log_file must be a path of printable characters, not {self.log_file!r:.100}")
        try:
            self.log_file.encode()
        except UnicodeEncodeError:  # a path of bytes that are not UTF-8 (os.fsdecode's escapes)
            raise ValueError(f"log_file must be a UTF-8 path, not {self.log_file!r:.100}") from None
        name = self.model_config_name
        if name and (any(c.isspace() for c in name) or "/" in name or "\0" in name or name.startswith(".")):
            raise ValueError(f"model_config_name must be a file name without spaces (configs/NAME.pbtxt), not "
                             f"{name!r:.100}")
        if not self.server_id:
            raise ValueError("server_id must be a name, not empty")
        if not self.http_host:
            raise ValueError("http_host must be an address, not empty")
        for name in ("http_port", "metrics_port", "grpc_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a port number (0: off), not {getattr(self, name)}")
        for name in ("sidecars", "cpu_threads", "exit_grace_s", "http_max_body_bytes", "max_queued_bytes",
                     "cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.model_load_timeout_s <= 0:
            raise ValueError(f"model_load_timeout_s must be > 0, not {self.model_load_timeout_s}")
        if self.poll_secs <= 0:
            raise ValueError(f"poll_secs must be > 0, not {self.poll_secs}")
        if self.busy_poll_us < -1:
            raise ValueError(f"busy_poll_us must be -1 (never poll), 0 (adaptive) or a time, not {self.busy_poll_us}")
        from gepool.grpc.access import GrpcRestrictions
        from gepool.http import servers
        from gepool.http.access import Restrictions

        Restrictions.parse(self.http_restricted_api)  # ValueError in Triton's words
        GrpcRestrictions.parse(self.grpc_restricted_protocol)
        self.reading()  # --backend-config's groups, in Triton's words
        refusal = servers.refusal(self.http_server) if self.http_port else None
        if refusal:
            raise ValueError(f"http_server: {refusal}")
        if self.grpc_server not in GRPC_SERVERS:
            raise ValueError(f"grpc_server must be one of {', '.join(GRPC_SERVERS)}, not '{self.grpc_server}'")
        if self.sidecars and not (self.http_port or self.grpc_port or self.metrics_port):
            raise ValueError(f"sidecars={self.sidecars}: no port is served (http_port, grpc_port and metrics_port "
                             f"are 0), so no sidecar would start")
        if self.sidecars > MAX_SIDECARS:
            raise ValueError(f"sidecars must be at most {MAX_SIDECARS}, not {self.sidecars}")
        if self.sidecars > 1:
            for why in self.self_bound().values():
                raise ValueError(f"sidecars={self.sidecars}: {why}, which binds its port itself and cannot share "
                                 f"it with other sidecars; use sidecars=1 or another server")

    def reading(self) -> "Reading":
        """How the front reads its models' configs."""
        from gepool.common.repository import Reading

        return Reading.of(self.auto_complete_config, self.backend_config, self.model_config_name)

    def host_of(self, port: str) -> str:
        """The address the sidecar's port "http", "grpc" or "metrics" binds."""
        return {"grpc": self.grpc_host, "metrics": self.metrics_host}.get(port) or self.http_host

    def self_bound(self) -> dict[str, str]:
        """The sidecar's ports ("http", "grpc") whose server binds them itself, so that only one sidecar can
        serve and the pool does not bind them: each with the setting that says so."""
        bound = {}
        if self.http_port and self.http_server == "granian":
            bound["http"] = "http_server is granian"
        if self.grpc_port and self.grpc_server == "grpcio":
            bound["grpc"] = "grpc_server is grpcio"
        return bound

    def sidecar_count(self) -> int:
        """How many sidecars serve the ports: ``sidecars``, or with 0 one per SIDECAR_CORES cores this
        process may run on, between 1 and MAX_AUTO_SIDECARS (one where a server binds its own port)."""
        if self.sidecars:
            return self.sidecars
        if self.self_bound():
            return 1
        return max(1, min(MAX_AUTO_SIDECARS, len(os.sched_getaffinity(0)) // SIDECAR_CORES))

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> "PoolOptions":
        return cls(**json.loads(text))

    def front_options(self) -> FrontOptions:
        """The front's own options: every field the two share, by name, with the endpoint and owner id
        decided (the front binds and names its files with them)."""
        ours = {f.name for f in fields(self)}
        shared = {f.name: getattr(self, f.name) for f in fields(FrontOptions) if f.name in ours}
        shared.update(repository=os.path.abspath(self.repository), endpoint=self.endpoint or default_endpoint(),
                      owner_id=self.owner_id or naming.new_owner_id())
        return FrontOptions(**shared)


DEFAULT = PoolOptions(repository="")
OPTION_NAMES = frozenset(f.name for f in fields(PoolOptions))
