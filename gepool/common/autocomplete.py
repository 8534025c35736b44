"""Triton's config auto-complete: backend fields from the version folder, inputs and outputs from the model file.

The rules are Triton's: core's AutoCompleteBackendFields (always applied), and onnxruntime_backend's
AutoCompleteConfig / AutoCompleteMaxBatch / AutoCompleteIO (skipped with --disable-auto-complete-config)
and ValidateInputs / ValidateOutputs (always applied) for a config that the model file contradicts.
An Ascend .om is completed the same way from its pyACL description, its batch gears giving max_batch_size
(the GE worker checks the result against the .om when it loads the model).
"""

import os

from gepool.common import model_config_pb2 as pb
from gepool.common.backend_config import DEFAULT_MAX_BATCH_SIZE
from gepool.common.config import BACKEND_GE, BACKEND_ONNX, BACKEND_PYTHON, DEFAULT_FILENAMES, ModelConfig
from gepool.common.errors import ConfigError
from gepool.common.om_probe import OmSignature
from gepool.common.onnx_io import OnnxSignature, OnnxTensor
from gepool.ipc import dtypes

PLATFORM_ONNX = "onnxruntime_onnx"


def complete_backend_fields(msg: pb.ModelConfig, model_name: str, first_version_files: set[str] | None) -> None:
    """Fills name, backend, platform and default_model_filename as Triton's server does, from the files in
    the model's first version folder (None: it has none)."""
    if not msg.name:
        msg.name = model_name
    files = first_version_files or set()
    bare = not msg.platform and not msg.default_model_filename and first_version_files is not None
    for backend in (BACKEND_ONNX, BACKEND_PYTHON, BACKEND_GE):
        filename = DEFAULT_FILENAMES[backend]
        if not msg.backend and (msg.default_model_filename == filename or bare and filename in files
                                or backend == BACKEND_ONNX and msg.platform == PLATFORM_ONNX):
            msg.backend = backend
        if msg.backend == backend:
            if backend == BACKEND_ONNX and not msg.platform:
                msg.platform = PLATFORM_ONNX
            if backend != BACKEND_GE and not msg.default_model_filename:
                msg.default_model_filename = filename
            return


def complete_onnx(msg: pb.ModelConfig, signature: OnnxSignature, source: str,
                  default_max_batch: int = DEFAULT_MAX_BATCH_SIZE) -> None:
    """Fills max_batch_size (``default_max_batch`` for a model that can batch: --backend-config's
    default-max-batch-size), dynamic_batching, inputs and outputs from the model file, unless the config
    already lists both inputs and outputs (then it is only checked, by check_onnx)."""
    if msg.input and msg.output:
        return
    batchable = all(t.dims and t.dims[0] == -1 for t in signature.inputs + signature.outputs)
    _complete(msg, signature, source, batchable, default_max_batch)


def complete_om(msg: pb.ModelConfig, om: OmSignature, source: str) -> None:
    """complete_onnx for an Ascend .om: with batch gears the model batches (max_batch_size defaults to the
    largest gear); a fixed-batch .om is served unbatched unless the config sets max_batch_size."""
    if msg.input and msg.output:
        return
    batchable = bool(om.gears) or msg.max_batch_size > 0
    _complete(msg, om.signature, source, batchable, max(om.gears, default=0))


def _complete(msg: pb.ModelConfig, signature: OnnxSignature, source: str, batchable: bool,
              default_max_batch: int) -> None:
    untyped = [t for t in signature.inputs + signature.outputs if t.datatype is None or t.dims is None]
    if untyped:
        t = untyped[0]
        what = "no shape" if t.datatype and t.dims is None else f"type {t.onnx_type}"
        raise ConfigError(source, None, "input" if t in signature.inputs else "output",
                          f"cannot auto-complete from the model file: tensor '{t.name}' has {what}; "
                          f"declare the inputs and outputs in config.pbtxt")
    if batchable:
        if msg.max_batch_size == 0:
            msg.max_batch_size = default_max_batch
        if msg.max_batch_size > 1 and msg.WhichOneof("scheduling_choice") is None:
            msg.dynamic_batching.SetInParent()
    elif msg.max_batch_size != 0:
        raise ConfigError(source, None, "max_batch_size",
                          f"auto-complete failed: the model does not support batching (not every input and output "
                          f"has a variable first dimension) while max_batch_size is {msg.max_batch_size}")
    skip = 1 if msg.max_batch_size > 0 else 0
    for items, tensors in ((msg.input, signature.inputs), (msg.output, signature.outputs)):
        if items:
            continue
        for t in tensors:
            dims = t.dims[skip:]
            if not dims:
                if skip:  # Triton would declare dims [1] with an empty reshape, which gepool does not serve
                    raise ConfigError(source, None, "reshape",
                                      f"tensor '{t.name}' has only the batch dimension; Triton serves it through "
                                      f"reshape, which gepool does not support yet: declare it in config.pbtxt")
                dims = (1,)
            items.add(name=t.name, data_type=_datatype_value(t.datatype), dims=dims)


def check_onnx(config: ModelConfig, signature: OnnxSignature, model_file: str) -> None:
    """Refuses a config that the ONNX file contradicts, naming the tensor (Triton's ValidateInputs/Outputs)."""
    src = config.source
    model_inputs = {t.name: t for t in signature.inputs}
    model_outputs = {t.name: t for t in signature.outputs}
    if len(config.inputs) != len(signature.inputs):
        raise ConfigError(src, None, "input", f"the configuration expects {len(config.inputs)} inputs, "
                                              f"{model_file} provides {len(signature.inputs)} "
                                              f"({', '.join(sorted(model_inputs))})")
    for kind, declared, found in (("input", config.inputs, model_inputs), ("output", config.outputs, model_outputs)):
        for t in declared:
            model = found.get(t.name)
            if model is None:
                raise ConfigError(src, None, kind, f"{kind} '{t.name}' is not in {model_file}, whose {kind}s are "
                                                   f"{', '.join(sorted(found))}")
            _check_tensor(config, kind, t.name, t.datatype, t.dims, model, model_file)


def _check_tensor(config: ModelConfig, kind: str, name: str, datatype: str, dims: tuple[int, ...],
                  model: OnnxTensor, model_file: str) -> None:
    src = config.source
    if model.datatype != datatype:
        raise ConfigError(src, None, "data_type", f"{kind} '{name}': the configuration expects {_type_name(datatype)}, "
                                                  f"{model_file} provides {model.onnx_type}")
    if model.dims is None:
        return  # the file declares no shape: onnxruntime checks each request
    if not model.dims:  # a scalar: only dims of 1 may describe it
        if config.max_batch_size or any(d != 1 for d in dims):
            raise ConfigError(src, None, "dims", f"{kind} '{name}' is a scalar in {model_file}: declare dims [1] "
                                                 f"and max_batch_size 0, not {list(dims)}")
        return
    shape = model.dims
    if config.max_batch_size > 0:
        if shape[0] != -1:
            raise ConfigError(src, None, "max_batch_size",
                              f"{kind} '{name}' of {model_file} has shape {list(shape)}, whose first dimension is "
                              f"not variable, so the model does not batch while max_batch_size is "
                              f"{config.max_batch_size}")
        shape = shape[1:]
    exact = kind == "output"  # Triton compares outputs exactly; an input's -1 in the model takes any size
    if len(shape) != len(dims) or any(m != d for m, d in zip(shape, dims) if exact or m != -1):
        batch = " after the batch dimension" if config.max_batch_size > 0 else ""
        raise ConfigError(src, None, "dims", f"{kind} '{name}': the configuration declares dims {list(dims)}, "
                                             f"{model_file} has {list(shape)}{batch}")


def _datatype_value(datatype: str) -> int:
    return pb.DataType.Value(_type_name(datatype))


def _type_name(datatype: str) -> str:
    return "TYPE_STRING" if datatype == dtypes.BYTES else f"TYPE_{datatype}"


def first_version_files(model_path: str) -> set[str] | None:
    """The file names in the model's first version folder by name, as Triton's server inspects it."""
    try:
        versions = sorted(v for v in os.listdir(model_path) if os.path.isdir(os.path.join(model_path, v)))
        return set(os.listdir(os.path.join(model_path, versions[0]))) if versions else None
    except OSError:
        return None
