"""The model repository: ``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/<file>``."""

import os
from dataclasses import dataclass

from gepool.common.config import ModelConfig, parse_config
from gepool.common.errors import ConfigError

CONFIG_NAME = "config.pbtxt"


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


def scan(repository: str) -> list[ModelSource]:
    """Every model directory in the repository (its highest selected version), loadable or with its error."""
    return [load_source(repository, name) for name in model_names(repository)]


def signature(repository: str, name: str) -> tuple:
    """What a poll compares to see a model changed: its files' names, sizes and modification times."""
    try:
        root = model_dir(repository, name)
    except ValueError:
        return ()
    out = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            try:
                st = os.stat(os.path.join(folder, f))
            except OSError:
                continue
            out.append((os.path.relpath(os.path.join(folder, f), root), st.st_size, st.st_mtime_ns))
    return tuple(out)


def load_sources(repository: str, name: str) -> list[ModelSource]:
    """One source per version the version_policy selects (highest first), or a single one with the error."""
    first = load_source(repository, name)
    if first.error or first.config is None:
        return [first]
    path = os.path.dirname(first.version_dir)
    versions = [int(v) for v in os.listdir(path) if v.isdigit() and os.path.isdir(os.path.join(path, v))]
    out = []
    for version in first.config.version_policy.select(versions):
        version_dir = os.path.join(path, str(version))
        model_file = os.path.join(version_dir, first.config.model_filename)
        error = None if os.path.exists(model_file) else f"{model_file}: model file missing"
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


def load_source(repository: str, name: str) -> ModelSource:
    try:
        path = model_dir(repository, name)
    except ValueError as exc:
        return ModelSource(str(name), None, error=str(exc))
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        return ModelSource(name, None, error=f"{cfg_path}: missing (gepool needs an explicit config)")
    try:
        config = parse_config(cfg_path, name)
    except ConfigError as exc:
        return ModelSource(name, None, error=str(exc))
    versions = [int(v) for v in os.listdir(path) if v.isdigit() and os.path.isdir(os.path.join(path, v))]
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
