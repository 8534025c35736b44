"""config.pbtxt -> plain typed objects, parsed by protobuf's own text-format parser.

The objects are frozen dataclasses so they pickle into spawned workers unchanged. Every error
names the file, the line and the field, so a user can fix a config without reading our code.
"""

import math
import os
import re
import stat
from dataclasses import dataclass, field

from google.protobuf import text_format

from gepool.common import model_config_pb2 as pb
from gepool.common.ensemble import Ensemble, check_graph, parse_steps
from gepool.common.errors import ConfigError
from gepool.common.labels import read_labels
from gepool.common.unsupported import not_carried, refuse_for_ensemble, refuse_unimplemented, refuse_unsupported
from gepool.ipc import dtypes

BACKEND_ONNX = "onnxruntime"
BACKEND_PYTHON = "python"
BACKEND_GE = "ge"
BACKEND_ENSEMBLE = "ensemble"  # platform "ensemble": scheduled by the front, no worker and no model file
_PLATFORMS = {"onnxruntime_onnx": BACKEND_ONNX, "ensemble": BACKEND_ENSEMBLE}
_BACKENDS = {BACKEND_ONNX, BACKEND_PYTHON, BACKEND_GE}
# an ensemble's "file" is its version folder itself: Triton wants the folder, and nothing in it
DEFAULT_FILENAMES = {BACKEND_ONNX: "model.onnx", BACKEND_PYTHON: "model.py", BACKEND_GE: "model.om",
                     BACKEND_ENSEMBLE: ""}
KIND_ASCEND = "KIND_ASCEND"
STREAM_NUM_ENV = "GE_BACKEND_STREAM_NUM"  # the GE backend's host-wide defaults, read when a model loads
POOL_SIZE_ENV = "GE_BACKEND_SHARED_MEMORY_POOL_SIZE"
DEFAULT_STREAM_NUM = 2


@dataclass(frozen=True)
class TensorConfig:
    name: str
    datatype: str  # Triton name: "FP32", "INT64", ...
    dims: tuple[int, ...]  # without the batch dimension when max_batch_size > 0; -1 = variable
    format: str = ""  # an input's declared layout (FORMAT_NHWC, FORMAT_NCHW), reported to clients; "" = none
    label_filename: str = ""  # an output's labels file in the model folder, for classification
    labels: tuple[str, ...] = ()  # its lines, read when the model loads

    @property
    def fixed(self) -> bool:
        """Every request's bytes for this tensor follow from its batch size (no -1 dim, not BYTES)."""
        return all(d >= 0 for d in self.dims) and self.datatype != dtypes.BYTES

    def row_bytes(self) -> int | None:
        """Bytes of one batch row (the whole tensor when unbatched); None if a dim is variable."""
        return math.prod(self.dims) * dtypes.itemsize(self.datatype) if self.fixed else None


@dataclass(frozen=True)
class InstanceGroup:
    count: int
    kind: str  # "KIND_CPU", "KIND_GPU", "KIND_ASCEND", ...
    devices: tuple[int, ...] = ()
    policy: str = ""
    name: str = ""  # as written; rendered as Triton names it (<model>_<index>) when empty


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy (see gepool.scheduler.queues for what each field does)."""

    timeout_action: str = "REJECT"
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_size: tuple[int, ...]
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    preferred_given: bool = True  # False: Triton's default [max_batch_size]; an .om's gears may replace it
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: dict[int, QueuePolicy] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionPolicy:
    kind: str = "latest"  # latest | all | specific
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of those present, highest first."""
        ordered = sorted(available, reverse=True)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[: self.num_versions]


@dataclass(frozen=True)
class WarmupInput:
    datatype: str
    dims: tuple[int, ...]
    data: str  # "zero", "random" or "file"
    file: str = ""  # for "file": a name in <model>/warmup/


@dataclass(frozen=True)
class WarmupSample:
    """Triton's model_warmup entry: run ``count`` times on a batch of ``batch_size`` before READY."""

    name: str
    batch_size: int
    count: int
    inputs: dict[str, WarmupInput]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    instance_groups: tuple[InstanceGroup, ...]
    dynamic_batching: DynamicBatching | None
    version_policy: VersionPolicy = VersionPolicy()
    parameters: dict[str, str] = field(default_factory=dict)
    default_model_filename: str = ""
    platform: str = ""
    source: str = ""  # the config.pbtxt path (the model folder when auto-complete wrote the config), for messages
    model_warmup: tuple[WarmupSample, ...] = ()
    response_cache: bool = False  # response_cache { enable }
    ensemble: Ensemble | None = None  # platform "ensemble": its steps

    @property
    def model_filename(self) -> str:
        return self.default_model_filename or DEFAULT_FILENAMES[self.backend]

    @property
    def instance_count(self) -> int:
        return sum(g.count * max(1, len(g.devices)) for g in self.instance_groups)

    def input(self, name: str) -> TensorConfig | None:
        return next((t for t in self.inputs if t.name == name), None)

    @property
    def stream_num(self) -> int:
        """Batches in flight per instance on an NPU: parameter stream_num, else $GE_BACKEND_STREAM_NUM."""
        return int(self.parameters.get("stream_num") or os.environ.get(STREAM_NUM_ENV) or DEFAULT_STREAM_NUM)

    @property
    def memory_pool_size(self) -> int:
        """Device memory cap per worker in bytes (0: none): memory_pool_size, else the GE env default."""
        return parse_size(self.parameters.get("memory_pool_size") or os.environ.get(POOL_SIZE_ENV) or "0")


MAX_CONFIG_BYTES = 16 << 20


def parse_config(path: str, model_name: str) -> ModelConfig:
    """Reads and checks one config.pbtxt as written (no auto-complete); raises ConfigError naming file,
    line and field."""
    msg, text = read_message(path)
    return check_message(msg, path, text, model_name)


def read_message(path: str) -> tuple[pb.ModelConfig, str]:
    """The config.pbtxt at ``path`` as a protobuf message, and its text (for locating fields in messages)."""
    try:
        # non-blocking, then checked on the descriptor opened: a path checked first and opened after could be
        # swapped for a fifo meanwhile, whose open (or read) would hang the front
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(path, None, None, "is not a regular file")
        with open(fd, encoding="utf-8") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, None, None, f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(path, None, None, f"is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        msg = text_format.Parse(text, pb.ModelConfig())
    except text_format.ParseError as exc:
        line = exc.GetLine() if hasattr(exc, "GetLine") else None
        detail = re.sub(r"^\d+:\d+ : ", "", str(exc))
        field = _field_in(detail)
        raise ConfigError(path, line, field, not_carried(detail, field)) from None
    return msg, text


def check_message(msg: pb.ModelConfig, source: str, text: str, model_name: str,
                  model_path: str | None = None) -> ModelConfig:
    """The typed config of a parsed (and perhaps auto-completed) message; ``source`` names it in errors,
    ``model_path`` is the model folder (label files are read there; default: the folder of ``source``)."""
    return _Checker(source, text, model_name, model_path or os.path.dirname(source)).check(msg)


def _field_in(detail: str) -> str | None:
    m = re.search(r'field named "([^"]+)"|field "?([\w.]+)"?', detail)
    return (m.group(1) or m.group(2)) if m else None


class _Checker:
    """Semantic checks; protobuf keeps no positions, so a field's line is found in the text."""

    def __init__(self, path: str, text: str, model_name: str, model_path: str) -> None:
        self.path, self.text, self.model_name, self.model_path = path, text, model_name, model_path

    def fail(self, fieldname: str, message: str) -> ConfigError:
        m = re.search(rf"\b{re.escape(fieldname)}\s*[:{{\[]", self.text) or re.search(
            rf'key\s*:\s*"{re.escape(fieldname)}"', self.text)  # a parameters entry
        line = self.text.count("\n", 0, m.start()) + 1 if m else None
        return ConfigError(self.path, line, fieldname, message)

    def check(self, msg: pb.ModelConfig) -> ModelConfig:
        if msg.name and msg.name != self.model_name:
            raise self.fail("name", f"'{msg.name}' must equal the model's directory name '{self.model_name}'")
        backend = self.backend(msg)
        if msg.max_batch_size < 0:
            raise self.fail("max_batch_size", f"must be >= 0, got {msg.max_batch_size}")
        which = msg.WhichOneof("scheduling_choice")
        if which == "sequence_batching":
            raise self.fail(which, f"{which} is not supported by gepool yet")
        if (which == "ensemble_scheduling") != (backend == BACKEND_ENSEMBLE):
            if backend == BACKEND_ENSEMBLE:
                raise self.fail("platform", "platform 'ensemble' needs ensemble_scheduling with its steps")
            raise self.fail("ensemble_scheduling", "ensemble_scheduling needs platform: \"ensemble\"")
        refuse_unsupported(msg, backend, self.fail)
        if backend == BACKEND_ENSEMBLE:
            refuse_for_ensemble(msg, self.fail)
        inputs = self.tensors(msg.input, "input")
        outputs = self.tensors(msg.output, "output")
        ensemble = None
        if backend == BACKEND_ENSEMBLE:
            ensemble = check_graph(self.model_name, parse_steps(msg.ensemble_scheduling, self.fail),
                                   [t.name for t in inputs], [t.name for t in outputs], self.fail)
        params = {k: v.string_value for k, v in msg.parameters.items()}
        self.check_parameters(params)
        config = ModelConfig(
            name=self.model_name,
            backend=backend,
            platform=msg.platform,
            max_batch_size=msg.max_batch_size,
            inputs=inputs,
            outputs=outputs,
            instance_groups=() if ensemble is not None else self.groups(msg, backend),
            dynamic_batching=self.batching(msg) if which == "dynamic_batching" else None,
            version_policy=self.versions(msg),
            model_warmup=self.warmups(msg, inputs),
            parameters=params,
            default_model_filename=msg.default_model_filename,
            source=self.path,
            response_cache=msg.response_cache.enable,
            ensemble=ensemble,
        )
        refuse_unimplemented(config, self.fail)
        return config

    def backend(self, msg: pb.ModelConfig) -> str:
        if msg.platform == "ensemble" and msg.backend:
            raise self.fail("backend", f"an ensemble has no backend (platform 'ensemble'), got '{msg.backend}'")
        if msg.backend:
            if msg.backend not in _BACKENDS:
                raise self.fail("backend", f"unknown backend '{msg.backend}' (gepool has {sorted(_BACKENDS)})")
            if msg.platform and _PLATFORMS.get(msg.platform) != msg.backend:
                raise self.fail("platform", f"platform '{msg.platform}' contradicts backend '{msg.backend}'")
            return msg.backend
        if msg.platform:
            if msg.platform not in _PLATFORMS:
                raise self.fail("platform", f"unsupported platform '{msg.platform}' (gepool has {sorted(_PLATFORMS)})")
            return _PLATFORMS[msg.platform]
        raise self.fail("backend", "set 'backend' (onnxruntime, python, ge) or 'platform' (onnxruntime_onnx)")

    def tensors(self, items, kind: str) -> tuple[TensorConfig, ...]:
        if not items:
            raise self.fail(kind, f"the model needs at least one {kind}")
        seen = set()
        out = []
        for t in items:
            if not t.name:
                raise self.fail(kind, f"an {kind} has no name")
            if t.name in seen:
                raise self.fail(kind, f"{kind} '{t.name}' is declared twice")
            seen.add(t.name)
            datatype = pb.DataType.Name(t.data_type).removeprefix("TYPE_")
            datatype = dtypes.BYTES if datatype == "STRING" else datatype
            if not dtypes.is_supported(datatype):
                raise self.fail("data_type", f"{kind} '{t.name}': data_type {pb.DataType.Name(t.data_type)} "
                                             f"is not supported")
            if not t.dims:
                raise self.fail("dims", f"{kind} '{t.name}' has no dims")
            if any(d == 0 or d < -1 for d in t.dims):
                raise self.fail("dims", f"{kind} '{t.name}': dims must be positive or -1, got {list(t.dims)}")
            if t.HasField("reshape"):
                raise self.fail("reshape", f"{kind} '{t.name}': reshape is not supported yet")
            if kind == "input":
                fmt = pb.ModelInput.Format.Name(t.format) if t.format else ""
                out.append(TensorConfig(t.name, datatype, tuple(t.dims), format=fmt))
            else:
                labels = self.labels(t.name, t.label_filename) if t.label_filename else ()
                out.append(TensorConfig(t.name, datatype, tuple(t.dims), label_filename=t.label_filename,
                                        labels=labels))
        return tuple(out)

    def labels(self, output: str, filename: str) -> tuple[str, ...]:
        try:
            return read_labels(self.model_path, filename)
        except ValueError as exc:
            raise self.fail("label_filename", f"output '{output}': {exc}") from None

    def groups(self, msg: pb.ModelConfig, backend: str) -> tuple[InstanceGroup, ...]:
        if not msg.instance_group:
            if backend == BACKEND_GE:
                return (InstanceGroup(count=1, kind=KIND_ASCEND, devices=(0,)),)
            return (InstanceGroup(count=1, kind="KIND_CPU"),)
        out = []
        for g in msg.instance_group:
            if g.count < 0:
                raise self.fail("count", f"instance_group count must be >= 0, got {g.count}")
            kind = pb.ModelInstanceGroup.Kind.Name(g.kind)
            if kind == "KIND_AUTO":
                kind = "KIND_CPU"
            devices = tuple(g.ascend_devices) or tuple(g.gpus)
            if backend == BACKEND_GE:
                if kind not in (KIND_ASCEND, "KIND_CPU") or (kind == "KIND_CPU" and g.HasField("kind")):
                    raise self.fail("kind", f"backend 'ge' runs on KIND_ASCEND instances, not {kind}")
                kind, devices = KIND_ASCEND, devices or (0,)
            elif kind == KIND_ASCEND:
                raise self.fail("kind", f"KIND_ASCEND needs backend 'ge', not '{backend}'")
            if any(d < 0 for d in devices):
                raise self.fail("ascend_devices", f"device ids must be >= 0, got {list(devices)}")
            policy = pb.ModelInstanceGroup.Policy.Name(g.policy) if g.policy else ""
            out.append(InstanceGroup(count=g.count or 1, kind=kind, devices=devices, policy=policy, name=g.name))
        return tuple(out)

    def batching(self, msg: pb.ModelConfig) -> DynamicBatching:
        db = msg.dynamic_batching
        if msg.max_batch_size == 0:
            raise self.fail("dynamic_batching", "needs max_batch_size > 0")
        preferred = tuple(db.preferred_batch_size) or (msg.max_batch_size,)  # Triton's normalisation
        for p in preferred:
            if p <= 0 or p > msg.max_batch_size:
                raise self.fail("preferred_batch_size",
                                f"{p} must be in 1..max_batch_size ({msg.max_batch_size})")
        levels = db.priority_levels
        if levels and not 1 <= db.default_priority_level <= levels:
            raise self.fail("default_priority_level",
                            f"must be in 1..priority_levels ({levels}), got {db.default_priority_level}")
        bad = [k for k in db.priority_queue_policy if not 1 <= k <= max(levels, 1)]
        if bad:
            raise self.fail("priority_queue_policy", f"levels {sorted(bad)} are outside 1..priority_levels ({levels})")

        def policy(p) -> QueuePolicy:
            return QueuePolicy(pb.ModelQueuePolicy.TimeoutAction.Name(p.timeout_action),
                               p.default_timeout_microseconds, p.allow_timeout_override, p.max_queue_size)

        return DynamicBatching(tuple(sorted(set(preferred))), db.max_queue_delay_microseconds, db.preserve_ordering,
                               preferred_given=bool(db.preferred_batch_size), priority_levels=levels,
                               default_priority_level=db.default_priority_level,
                               default_queue_policy=policy(db.default_queue_policy),
                               priority_queue_policy={k: policy(v) for k, v in db.priority_queue_policy.items()})

    def warmups(self, msg: pb.ModelConfig, inputs: tuple[TensorConfig, ...]) -> tuple[WarmupSample, ...]:
        out = []
        names = {t.name for t in inputs}
        for w in msg.model_warmup:
            if set(w.inputs) != names:
                raise self.fail("model_warmup", f"warmup '{w.name}' must give exactly the inputs {sorted(names)}, "
                                                f"not {sorted(w.inputs)}")
            if msg.max_batch_size and not 1 <= (w.batch_size or 1) <= msg.max_batch_size:
                raise self.fail("batch_size", f"warmup '{w.name}': batch_size {w.batch_size} is outside "
                                              f"1..max_batch_size ({msg.max_batch_size})")
            samples = {}
            for name, i in w.inputs.items():
                datatype = pb.DataType.Name(i.data_type).removeprefix("TYPE_")
                datatype = dtypes.BYTES if datatype == "STRING" else datatype
                kind = {"zero_data": "zero", "random_data": "random", "input_data_file": "file"}.get(
                    i.WhichOneof("input_data_type") or "", "zero")
                samples[name] = WarmupInput(datatype, tuple(i.dims), kind, i.input_data_file)
            out.append(WarmupSample(w.name or f"warmup{len(out)}", w.batch_size or 1, w.count or 1, samples))
        return tuple(out)

    def check_parameters(self, params: dict[str, str]) -> None:
        if params.get("batch_policy", BATCH_POLICIES[0]) not in BATCH_POLICIES:
            raise self.fail("batch_policy", f"batch_policy must be one of {', '.join(BATCH_POLICIES)}, "
                                            f"got '{params['batch_policy']}'")
        if "stream_num" in params and not (params["stream_num"].isdigit() and int(params["stream_num"]) >= 1):
            raise self.fail("stream_num", f"stream_num must be a whole number >= 1, got '{params['stream_num']}'")
        for key in ("memory_pool_size", "slot_bytes"):
            if key in params:
                try:
                    parse_size(params[key])
                except ValueError as exc:
                    raise self.fail(key, str(exc)) from None
        for key in ("execution_timeout_ms", "intra_op_thread_count"):
            if key in params and not (params[key].isdigit() and len(params[key]) <= 12):
                raise self.fail(key, f"{key} must be a whole number >= 0, got '{params[key]}'")

    def versions(self, msg: pb.ModelConfig) -> VersionPolicy:
        return version_policy(msg)


def version_policy(msg: pb.ModelConfig) -> VersionPolicy:
    """The message's version_policy (Triton's default: the latest one version)."""
    if not msg.HasField("version_policy"):
        return VersionPolicy()
    which = msg.version_policy.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy("all")
    if which == "specific":
        return VersionPolicy("specific", versions=tuple(msg.version_policy.specific.versions))
    return VersionPolicy("latest", num_versions=max(1, msg.version_policy.latest.num_versions))


# "triton": wait for preferred sizes up to max_queue_delay_microseconds, as Triton does;
# "adaptive": the same caps, but an idle worker only waits while a burst is still arriving (batcher.py)
BATCH_POLICIES = ("triton", "adaptive")

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'8G', '512M', '65536' -> bytes (binary units, as GE_BACKEND_SHARED_MEMORY_POOL_SIZE writes them)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"'{text}' is not a size (e.g. 65536, 512M, 8G)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]


def streams_per_worker(config: ModelConfig) -> int:
    """Batches one NPU worker runs at once: instances per device (count) x streams per instance."""
    count = max((g.count for g in config.instance_groups), default=1)
    return count * config.stream_num
