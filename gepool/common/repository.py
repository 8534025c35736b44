"""The model repository: ``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/<file>``."""

import os
from dataclasses import dataclass

from gepool.common import model_config_pb2 as pb
from gepool.common.autocomplete import (
    check_onnx,
    complete_backend_fields,
    complete_om,
    complete_onnx,
    first_version_files,
)
from gepool.common.backend_config import DEFAULT_MAX_BATCH_SIZE, default_max_batch_size
from gepool.common.config import BACKEND_GE, BACKEND_ONNX, ModelConfig, check_message, read_message, version_policy
from gepool.common.errors import ConfigError
from gepool.common.om_probe import OmProbeError, read_om_signature
from gepool.common.onnx_io import OnnxFormatError, OnnxSignature, read_signature

CONFIG_NAME = "config.pbtxt"
CUSTOM_CONFIGS = "configs"  # the folder of a model's custom configs, <name>.pbtxt (Triton's --model-config-name)


@dataclass(frozen=True)
class Reading:
    """How a model's config is read: completed from the model file (off: --disable-auto-complete-config), with
    the max_batch_size completion gives a model that can batch (--backend-config default-max-batch-size),
    from ``configs/<config_name>.pbtxt`` where the model has it (--model-config-name), else config.pbtxt."""

    auto_complete: bool = True
    default_max_batch: int = DEFAULT_MAX_BATCH_SIZE
    config_name: str = ""

    @classmethod
    def of(cls, auto_complete: bool, backend_config: tuple[str, ...], config_name: str) -> "Reading":
        """From a pool's options (``backend_config``: --backend-config's groups; ValueError for a bad one)."""
        return cls(auto_complete, default_max_batch_size(backend_config), config_name)

    def config_path(self, path: str) -> str:
        """The config file the model in folder ``path`` is read from (it may not exist): a custom one that exists,
        whatever it is (as Triton, which then fails to read anything but a file), else config.pbtxt."""
        if self.config_name:
            custom = os.path.join(path, CUSTOM_CONFIGS, self.config_name + ".pbtxt")
            if os.path.exists(custom):
                return custom
        return os.path.join(path, CONFIG_NAME)


@dataclass(frozen=True)
class ModelSource:
    """One model found in the repository: what to serve, or why it cannot be served."""

    name: str
    config: ModelConfig | None
    version: int | None = None
    version_dir: str | None = None
    error: str | None = None


def model_names(repository: str) -> list[str]:
    """The model directories in the repository."""
    if not os.path.isdir(repository):
        raise FileNotFoundError(f"model repository '{repository}' is not a directory")
    return sorted(n for n in os.listdir(repository)
                  if not n.startswith(".") and os.path.isdir(os.path.join(repository, n)))


def scan(repository: str, reading: Reading = Reading()) -> list[ModelSource]:
    """Every model directory in the repository (its highest selected version), loadable or with its error."""
    return [load_source(repository, name, reading) for name in model_names(repository)]


def signature(repository: str, name: str) -> tuple:
    """What a poll compares to see a model changed: its files' names, sizes and modification times (those of a
    symlinked configs/ folder too, which os.walk does not enter)."""
    try:
        root = model_dir(repository, name)
    except ValueError:
        return ()
    out: list[tuple] = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        out += _stats(root, folder, files)
    custom = os.path.join(root, CUSTOM_CONFIGS)
    if os.path.islink(custom) and os.path.isdir(custom):
        try:
            out += _stats(root, custom, os.listdir(custom))
        except OSError:
            pass
    return tuple(out)


def _stats(root: str, folder: str, files: list[str]) -> list[tuple]:
    out = []
    for f in sorted(files):
        try:
            st = os.stat(os.path.join(folder, f))
        except OSError:
            continue
        out.append((os.path.relpath(os.path.join(folder, f), root), st.st_size, st.st_mtime_ns))
    return out


def load_sources(repository: str, name: str, reading: Reading = Reading()) -> list[ModelSource]:
    """One source per version the version_policy selects (highest first), or a single one with the error.
    Each version's model file is checked against the one config (completed from the highest version)."""
    first = load_source(repository, name, reading)
    if first.error or first.config is None:
        return [first]
    path = os.path.dirname(first.version_dir)
    out = []
    for version in first.config.version_policy.select(_versions(path)):
        if version == first.version:
            out.append(first)
            continue
        version_dir = os.path.join(path, str(version))
        model_file = os.path.join(version_dir, first.config.model_filename)
        error = None if os.path.exists(model_file) else f"{model_file}: model file missing"
        if error is None:
            try:
                check_model_file(first.config, model_file)
            except ConfigError as exc:
                error = str(exc)
        out.append(ModelSource(name, first.config, version, version_dir, error))
    return out


def model_dir(repository: str, name: object) -> str:
    """The folder of model ``name``, refusing anything that would leave the repository: separators,
    '.'/'..', absolute paths, and symlinks whose target lies outside (what a load request may name)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or name.startswith("."):
        raise ValueError(f"model name {name!r} is not a plain directory name in the repository")
    root = os.path.realpath(repository)
    path = os.path.join(root, name)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root or real == root:
        raise ValueError(f"model '{name}' resolves to {real}, outside the model repository {root}")
    return path


def load_source(repository: str, name: str, reading: Reading = Reading()) -> ModelSource:
    """The model's highest selected version with its config (auto-completed unless told not to), or why
    it cannot be served."""
    try:
        path = model_dir(repository, name)
    except ValueError as exc:
        return ModelSource(str(name), None, error=str(exc))
    try:
        config = model_config(path, name, reading)
    except ConfigError as exc:
        return ModelSource(name, None, error=str(exc))
    versions = _versions(path)
    if not versions:
        return ModelSource(name, config, error=f"{path}: no version directory (e.g. {path}/1/)")
    selected = config.version_policy.select(versions)
    if not selected:
        return ModelSource(name, config, error=f"{path}: version_policy selects none of {sorted(versions)}")
    version = selected[0]  # the highest selected version is served
    version_dir = os.path.join(path, str(version))
    model_file = os.path.join(version_dir, config.model_filename)
    if not os.path.exists(model_file):
        return ModelSource(name, config, version, version_dir, error=f"{model_file}: model file missing")
    return ModelSource(name, config, version, version_dir)


def model_config(path: str, name: str, reading: Reading = Reading()) -> ModelConfig:
    """The typed config of the model in folder ``path``: its config.pbtxt (optional with auto-complete),
    the backend fields Triton's server fills in, and for an ONNX model what Triton's onnxruntime backend
    completes from the served version's file and checks against it, read as ``reading`` says. Raises
    ConfigError."""
    auto_complete = reading.auto_complete
    cfg_path = reading.config_path(path)
    exists = os.path.exists(cfg_path)
    if exists or not auto_complete:
        if not exists:
            raise ConfigError(cfg_path, None, None, "missing (auto-complete is disabled, so every model needs one)")
        msg, text = read_message(cfg_path)  # (which refuses a folder or a fifo on the descriptor it opens)
        source = cfg_path
    else:
        msg, text, source = pb.ModelConfig(), "", path
    complete_backend_fields(msg, name, first_version_files(path))
    if source == path and not msg.backend:
        raise ConfigError(path, None, "backend", f"model '{name}' has no {CONFIG_NAME}, and its first version folder "
                                                 f"holds no model.onnx, model.py or model.om to tell its backend by")
    signature, model_file = None, ""
    served = version_policy(msg).select(_versions(path))
    if msg.backend == BACKEND_ONNX:
        model_file = os.path.join(path, str(served[0]), msg.default_model_filename) if served else ""
        if model_file and os.path.isfile(model_file):
            signature = _signature(model_file, name)
            if auto_complete:
                complete_onnx(msg, signature, source, reading.default_max_batch)
    elif msg.backend == BACKEND_GE and auto_complete and not (msg.input and msg.output) and served:
        _complete_om(msg, os.path.join(path, str(served[0]), msg.default_model_filename or "model.om"), name, source)
    config = check_message(msg, source, text, name, model_path=path)
    if signature is not None:
        check_onnx(config, signature, model_file)
    return config


def _complete_om(msg: pb.ModelConfig, om_file: str, name: str, source: str) -> None:
    # Blocks the caller (the front's loop, when it loads a model) for the probe: seconds on a real NPU,
    # paid only by a .om whose config lacks inputs or outputs.
    if not os.path.isfile(om_file):
        return  # reported as a missing model file
    devices = [d for g in msg.instance_group for d in g.ascend_devices]
    try:
        om = read_om_signature(om_file, devices[0] if devices else 0)
    except OmProbeError as exc:
        raise ConfigError(om_file, None, None, f"model '{name}': cannot auto-complete from the .om: {exc}") from None
    if om is None:
        raise ConfigError(source, None, "input", f"model '{name}': the config lists no inputs or outputs, and "
                                                 f"auto-complete from a .om needs pyACL, which is not installed")
    complete_om(msg, om, source)


def check_model_file(config: ModelConfig, model_file: str) -> None:
    """Refuses a model file (of another version) that contradicts the config."""
    if config.backend == BACKEND_ONNX:
        check_onnx(config, _signature(model_file, config.name), model_file)


def _signature(model_file: str, name: str) -> OnnxSignature:
    try:
        return read_signature(model_file)
    except OnnxFormatError as exc:
        raise ConfigError(model_file, None, None, f"model '{name}' is not a readable ONNX model: {exc}") from None


def _versions(path: str) -> list[int]:
    try:
        return [int(v) for v in os.listdir(path) if v.isdigit() and os.path.isdir(os.path.join(path, v))]
    except OSError:
        return []
