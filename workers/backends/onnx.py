"""onnxruntime on CPU: inputs are numpy views of the slot, outputs are bound to the slot (I/O binding)."""

import os

import numpy as np

from gepool.common.config import BACKEND_ONNX, ModelConfig
from gepool.workers.backends import register
from gepool.workers.backends.base import SyncBackend

# Spinning threads burn a core while idle; on small hosts the front and clients need it more.
DEFAULT_ALLOW_SPINNING = "0"
MAX_CACHED_BINDINGS = 256  # (slot, batch shape) pairs; a model with variable dims may see many
_ORT_TYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",  # (Triton's onnxruntime backend: ONNX STRING is TYPE_STRING)
}


def _as_text(name: str, arr: np.ndarray) -> np.ndarray:
    """A BYTES input as onnxruntime's Python API takes a string tensor: str elements (it writes a bytes
    element as its repr, b'...'), each decoded as UTF-8; ValueError naming the first that is not."""
    out = np.empty(arr.size, dtype=object)
    for i, item in enumerate(arr.ravel()):
        try:
            out[i] = item.decode("utf-8") if isinstance(item, bytes) else str(item)
        except UnicodeDecodeError:
            raise ValueError(f"input '{name}': element {i} is not UTF-8 text, and onnxruntime's Python API takes "
                             f"the elements of a string tensor as text") from None
    return out.reshape(arr.shape)


@register
class OnnxBackend(SyncBackend):
    name = BACKEND_ONNX
    # Reads inputs and writes outputs through pointers (I/O binding), so a client's arena serves as
    # well as a slot. (The python backend hands the model writable arrays, which in a direct batch
    # would be the client's own input.)
    arena_io = True

    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int) -> None:
        super().__init__(config, version_dir, device, threads)
        import onnxruntime as ort  # here, not at import: the front imports this module to place workers

        params = config.parameters
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(params.get("intra_op_thread_count", threads))
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning",
                                      params.get("allow_spinning", DEFAULT_ALLOW_SPINNING))
        path = os.path.join(version_dir, config.model_filename)
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self.info = {"threads": opts.intra_op_num_threads}
        self._check(self.session.get_inputs(), config.inputs, "input")
        self._check(self.session.get_outputs(), config.outputs, "output")
        self._bindings: dict[tuple, object] = {}  # onnxruntime IOBinding per layout
        # an I/O binding takes no string tensor: such a model runs with run(), its text as str
        self._strings = any(a.type == "tensor(string)" for a in (*self.session.get_inputs(),
                                                                  *self.session.get_outputs()))

    def _check(self, args, declared, kind: str) -> None:
        """Config and model must agree, or every request would fail later with a worse message."""
        actual = {a.name: a for a in args}
        for t in declared:
            arg = actual.get(t.name)
            if arg is None:
                raise ValueError(f"{kind} '{t.name}' of config.pbtxt is not in the model (it has {sorted(actual)})")
            dtype = _ORT_TYPES.get(arg.type)
            if dtype != t.datatype:
                raise ValueError(f"{kind} '{t.name}': config says TYPE_{t.datatype}, the model has {arg.type}")
            shape = list(arg.shape)
            expect = ([-1] if self.config.max_batch_size > 0 else []) + list(t.dims)
            if len(shape) != len(expect):
                raise ValueError(f"{kind} '{t.name}': config gives rank {len(expect)} (with batch dim), "
                                 f"the model has shape {shape}")
            for want, have in zip(expect, shape, strict=True):
                if want != -1 and isinstance(have, int) and have != want:
                    raise ValueError(f"{kind} '{t.name}': config dims {expect} do not match model shape {shape}")
        if kind == "input" and len(actual) != len(declared):
            missing = sorted(set(actual) - {t.name for t in declared})
            raise ValueError(f"the model has inputs the config does not declare: {missing}")

    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        if self._strings:
            return self._run(inputs, outputs)
        inputs = {name: np.ascontiguousarray(arr) for name, arr in inputs.items()}
        all_bound = all(v is not None for v in outputs.values())
        key = None
        if all_bound:
            # Slots sit at fixed addresses, so a batch shape recurs with the same pointers: its binding
            # can be reused as is, which saves the bind calls on every batch.
            key = tuple((a.ctypes.data, a.shape) for a in inputs.values()) + tuple(
                (v.ctypes.data, v.shape) for v in outputs.values())
        binding = self._bindings.get(key) if key else None
        if binding is None:
            binding = self.session.io_binding()
            for name, arr in inputs.items():
                binding.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
            for name, view in outputs.items():
                if view is not None:
                    binding.bind_output(name, "cpu", 0, view.dtype, view.shape, view.ctypes.data)
                else:
                    binding.bind_output(name, "cpu")
            if key:
                if len(self._bindings) >= MAX_CACHED_BINDINGS:
                    self._bindings.clear()
                self._bindings[key] = binding
        self.session.run_with_iobinding(binding)
        if all_bound:
            return outputs
        produced = binding.get_outputs()
        result = {}
        for i, (name, view) in enumerate(outputs.items()):
            result[name] = view if view is not None else produced[i].numpy()
        return result

    def _run(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """A model with string tensors: BYTES inputs passed as text, string outputs given back as UTF-8 bytes."""
        feed = {name: _as_text(name, arr) if arr.dtype == object else np.ascontiguousarray(arr)
                for name, arr in inputs.items()}
        result = {}
        for (name, view), got in zip(outputs.items(), self.session.run(list(outputs), feed), strict=True):
            if got.dtype == object:
                text = np.empty(got.size, dtype=object)
                for i, item in enumerate(got.ravel()):  # (one by one: numpy would make a list of bytes S-typed,
                    text[i] = item.encode("utf-8") if isinstance(item, str) else item  # dropping trailing NULs)
                got = text.reshape(got.shape)
            result[name] = got if view is None else view
            if view is not None:
                np.copyto(view, got)
        return result
