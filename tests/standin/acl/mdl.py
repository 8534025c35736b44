"""acl.mdl: models, descriptions, datasets, execution (stand-in).

A stand-in ``.om`` is a JSON file: ``{"onnx": "net.onnx", "gears": [1, 2, 4, 8]}`` (or ``"batch": N``
for a fixed-batch model), computed with onnxruntime; ``"hw_gears": [[h, w], ...]`` or
``"dims_gears": [[...], ...]`` stand for models ATC compiled with --dynamic_image_size / --dynamic_dims
(they carry the same ascend_mbatch_shape_data input, and report no batch gears). Optional faults for
tests: ``exec_delay_ms``, ``fail_on_value`` / ``hang_on_value`` / ``abort_on_value`` (an execute whose
first input holds that value fails / never finishes / aborts its context, as an AI Core exception does),
``fail_load`` (an error code load_from_file returns).

Sources of the rules, cited beside each: the pyACL wrappers (hicann/runtime python/pyACL/mdl/mdl_wrap.cpp),
GE (hicann/ge api/acl/acl_model/model/model.cpp, runtime/v1/executor/ge_executor.cc,
runtime/v1/graph/load/model_manager/davinci_model.cc).
"""

import ctypes
import json
import os
import sys
import time

import numpy as np

from acl import _state as S
from acl._args import checked

MBATCH_NAME = "ascend_mbatch_shape_data"
_ACL_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int8): 2, np.dtype(np.int32): 3,
              np.dtype(np.uint8): 4, np.dtype(np.int16): 6, np.dtype(np.uint16): 7, np.dtype(np.uint32): 8,
              np.dtype(np.int64): 9, np.dtype(np.uint64): 10, np.dtype(np.float64): 11, np.dtype(np.bool_): 12}
_ORT_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8,
              "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(int16)": np.int16,
              "tensor(int64)": np.int64, "tensor(double)": np.float64, "tensor(bool)": np.bool_}


class _Tensor:
    def __init__(self, name: str, dtype, row_shape: tuple[int, ...]) -> None:
        self.name, self.dtype, self.row_shape = name, np.dtype(dtype), row_shape
        self.row_bytes = int(np.prod(row_shape)) * self.dtype.itemsize


class _Model:
    def __init__(self, path: str, spec: dict, context) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.session = ort.InferenceSession(os.path.join(os.path.dirname(os.path.realpath(path)), spec["onnx"]),
                                            opts, providers=["CPUExecutionProvider"])
        self.gears = list(spec.get("gears", []))
        self.hw_gears = [list(g) for g in spec.get("hw_gears", [])]
        self.dims_gears = [list(g) for g in spec.get("dims_gears", [])]
        self.dynamic = bool(self.gears or self.hw_gears or self.dims_gears)  # has ascend_mbatch_shape_data
        self.batch = max(self.gears) if self.gears else int(spec.get("batch", 1))
        self.spec, self.context = spec, context
        self.inputs = [_Tensor(a.name, _ORT_NUMPY[a.type], tuple(a.shape[1:])) for a in self.session.get_inputs()]
        self.outputs = [_Tensor(a.name, _ORT_NUMPY[a.type], tuple(a.shape[1:])) for a in self.session.get_outputs()]
        self.inflight = 0
        self.stream = None


class _Desc:
    def __init__(self) -> None:
        self.model: _Model | None = None


def _model(model_id: int):
    model = S.models.get(model_id)
    if model is None:
        return None, S.set_error(S.INVALID_MODEL_ID, f"model id {model_id} is not loaded")
    if S.current_context() is not model.context:
        return None, S.set_error(S.MODEL_CONTEXT, "the model was loaded in another context")
    return model, S.SUCCESS


@checked("mdl.load_from_file", str)
def load_from_file(path: str):
    ctx = S.current_context()
    if ctx is None:
        return 0, S.set_error(S.CONTEXT_NULL, "no current context in this thread")
    try:
        with open(path) as f:
            spec = json.load(f)
    except (OSError, ValueError) as exc:
        return 0, S.set_error(S.INVALID_FILE, f"cannot read model file {path}: {exc}")
    if spec.get("fail_load"):
        return 0, S.set_error(int(spec["fail_load"]), f"injected load failure for {path}")
    model = _Model(path, spec, ctx)
    model_id = S.new_id() & 0xFFFFFFFF
    S.models[model_id] = model
    return model_id, S.SUCCESS


@checked("mdl.unload", int)
def unload(model_id: int) -> int:
    model, ret = _model(model_id)
    if ret:
        return ret
    if model.inflight:
        with S.lock:
            S.stats["released_while_queued"] += 1
        return S.set_error(S.RESOURCE_NOT_MATCH, "model still has executions in flight")
    del S.models[model_id]
    return S.SUCCESS


def create_desc() -> int:
    handle = S.new_id()
    S.descs[handle] = _Desc()
    return handle


@checked("mdl.get_desc", int, int)
def get_desc(desc: int, model_id: int) -> int:
    d, model = S.descs.get(desc), S.models.get(model_id)
    if d is None or model is None:
        return S.set_error(S.INVALID_PARAM, "bad desc or model id")
    d.model = model
    return S.SUCCESS


@checked("mdl.destroy_desc", int)
def destroy_desc(desc: int) -> int:
    if S.descs.pop(desc, None) is None:
        return S.set_error(S.INVALID_PARAM, f"desc {desc:#x} does not exist")
    return S.SUCCESS


def _m(desc: int) -> _Model:
    return S.descs[desc].model


def get_num_inputs(desc: int) -> int:
    m = _m(desc)
    return len(m.inputs) + (1 if m.dynamic else 0)  # includes the dynamic-batch tensor


def get_num_outputs(desc: int) -> int:
    return len(_m(desc).outputs)


def _input(m: _Model, i: int):
    return None if i == len(m.inputs) and m.dynamic else m.inputs[i]


def get_input_size_by_index(desc: int, i: int) -> int:
    m = _m(desc)
    t = _input(m, i)
    return 8 if t is None else m.batch * t.row_bytes  # the largest gear


def get_output_size_by_index(desc: int, i: int) -> int:
    m = _m(desc)
    return m.batch * m.outputs[i].row_bytes


def _dims(m: _Model, t) -> tuple:
    if t is None:
        return {"name": MBATCH_NAME, "dimCount": 1, "dims": [1]}, S.SUCCESS
    dims = [-1 if m.gears else m.batch, *t.row_shape]
    return {"name": t.name, "dimCount": len(dims), "dims": dims}, S.SUCCESS


def get_input_dims(desc: int, i: int):
    m = _m(desc)
    return _dims(m, _input(m, i))


def get_output_dims(desc: int, i: int):
    m = _m(desc)
    return _dims(m, m.outputs[i])


def get_input_data_type(desc: int, i: int) -> int:
    m = _m(desc)
    t = _input(m, i)
    return 9 if t is None else _ACL_TYPES[t.dtype]


def get_output_data_type(desc: int, i: int) -> int:
    return _ACL_TYPES[_m(desc).outputs[i].dtype]


def get_input_name_by_index(desc: int, i: int) -> str:
    m = _m(desc)
    t = _input(m, i)
    return MBATCH_NAME if t is None else t.name


def get_output_name_by_index(desc: int, i: int) -> str:
    return _m(desc).outputs[i].name


@checked("mdl.get_input_index_by_name", int, str)
def get_input_index_by_name(desc: int, name: str):
    m = _m(desc)
    names = [t.name for t in m.inputs] + ([MBATCH_NAME] if m.dynamic else [])
    if name not in names:
        # the wrapper returns its size_t index as initialised, 0, beside the error (mdl_wrap.cpp)
        return 0, S.set_error(S.INVALID_PARAM, f"no input named {name}")
    return names.index(name), S.SUCCESS


@checked("mdl.get_dynamic_batch", int)
def get_dynamic_batch(desc: int):
    """A model without batch gears (static, dynamic HW or dims) reports batchCount 0 and ret 0."""
    m = _m(desc)
    return {"batchCount": len(m.gears), "batch": list(m.gears)}, S.SUCCESS


@checked("mdl.get_dynamic_hw", int, int)
def get_dynamic_hw(desc: int, index: int):
    """{"hwCount": n, "hw": [[h, w], ...]} (mdl_wrap.cpp WrapAclMdlGetDynamicHW)."""
    m = _m(desc)
    return {"hwCount": len(m.hw_gears), "hw": [list(g) for g in m.hw_gears]}, S.SUCCESS


@checked("mdl.get_input_dynamic_gear_count", int, int)
def get_input_dynamic_gear_count(desc: int, index: int):
    """(gear count, ret) for --dynamic_dims models (mdl_wrap.cpp WrapAclMdlGetInputDynamicGearCount)."""
    return len(_m(desc).dims_gears), S.SUCCESS


@checked("mdl.set_dynamic_batch_size", int, int, int, int)
def set_dynamic_batch_size(model_id: int, dataset: int, index: int, batch: int) -> int:
    """In GE's order (model.cpp aclmdlSetDynamicBatchSizeImpl, then ge_executor.cc SetDynamicBatchSize):
    the model id, batch 0, the dataset's buffer and its address, a length under 4 bytes, the gear; then
    the batch is written as 8 bytes where the buffer has them, else 4."""
    model, ret = _model(model_id)
    if ret:
        return ret
    if batch == 0:
        return S.set_error(S.INVALID_PARAM, "batchSize can't be zero")
    buffers = S.datasets.get(dataset)
    if buffers is None or not 0 <= index < len(buffers):
        return S.set_error(S.INVALID_PARAM, f"failed to get data buffer by index[{index}]")
    ptr, size = S.data_buffers[buffers[index]]
    if not ptr:
        return S.set_error(S.INVALID_PARAM, "data buffer addr cannot be null")
    if size < 4:
        return S.set_error(S.DYNAMIC_INPUT_LENGTH_INVALID, f"Dynamic input size [{size}] is less than [4]")
    if batch not in model.gears:
        return S.set_error(S.DYNAMIC_BATCH_SIZE_INVALID, f"batch {batch} is not a gear of {model.gears}")
    (ctypes.c_uint64 if size >= 8 else ctypes.c_uint32).from_address(ptr).value = batch
    return S.SUCCESS


def create_dataset() -> int:
    handle = S.new_id()
    S.datasets[handle] = []
    return handle


@checked("mdl.add_dataset_buffer", int, int)
def add_dataset_buffer(dataset: int, buffer: int):
    if dataset not in S.datasets or buffer not in S.data_buffers:
        return dataset, S.set_error(S.INVALID_PARAM, "bad dataset or buffer")
    S.datasets[dataset].append(buffer)
    return dataset, S.SUCCESS


def get_dataset_num_buffers(dataset: int) -> int:
    return len(S.datasets.get(dataset, []))


def get_dataset_buffer(dataset: int, i: int) -> int:
    buffers = S.datasets.get(dataset, [])
    return buffers[i] if 0 <= i < len(buffers) else 0


@checked("mdl.destroy_dataset", int)
def destroy_dataset(dataset: int) -> int:
    if S.datasets.pop(dataset, None) is None:
        return S.set_error(S.INVALID_PARAM, f"dataset {dataset:#x} does not exist")
    return S.SUCCESS


def _view(buffer: int, dtype, rows: int, row_shape: tuple, row_bytes: int):
    ptr, size = S.data_buffers[buffer]
    if size < rows * row_bytes:
        return None
    mem = S.find_memory(ptr, rows * row_bytes)
    if mem is None or mem.pinned:
        return None
    raw = (ctypes.c_ubyte * (rows * row_bytes)).from_address(ptr)
    return np.frombuffer(raw, dtype).reshape((rows, *row_shape))


@checked("mdl.execute_async", int, int, int, int)
def execute_async(model_id: int, in_ds: int, out_ds: int, stream_id: int) -> int:
    from acl.rt import _sleep_until_stopped, _stream

    model, ret = _model(model_id)
    if ret:
        return ret
    stream, ret = _stream(stream_id)
    if ret:
        return ret
    from acl.rt import aborted

    ret = aborted(stream.context)
    if ret:
        return ret
    ins, outs = S.datasets.get(in_ds), S.datasets.get(out_ds)
    if ins is None or outs is None or len(ins) != len(model.inputs) + model.dynamic:
        return S.set_error(S.INVALID_PARAM, "datasets do not match the model's inputs")
    if not model.dynamic:
        # GE checks user buffers when the task is issued: a static model's buffer may be up to 64 bytes
        # short of the model's size, no more (davinci_model.cc CheckUserAndModelSize, kDataMemAlignSizeCompare);
        # dynamic models are not checked ("dynamic is max size").
        for kind, tensors, bufs in (("input", model.inputs, ins), ("output", model.outputs, outs)):
            for t, buf in zip(tensors, bufs):
                size = S.data_buffers[buf][1]
                if size + 64 < model.batch * t.row_bytes:
                    return S.set_error(S.GE_PARAM_INVALID, f"{kind} {t.name}: the provided {size} bytes of buffer "
                                       f"size plus the aligned 64 bytes is less than the tensor size "
                                       f"{model.batch * t.row_bytes} bytes required by the model")
    with S.lock:
        if model.inflight and model.stream is not stream:
            return S.set_error(S.RESOURCE_NOT_MATCH, "one model id may not execute on two streams at once")
        model.inflight += 1
        model.stream = stream
    device = stream.context.device
    refs = (model_id, *{S.data_buffers[b][0] for b in ins + outs})

    def run() -> int:
        S.op_started("execute")
        try:
            return _execute(model, in_ds, out_ds, stream)
        finally:
            S.op_finished("execute")
            with S.lock:
                model.inflight -= 1
                S.stats["executes"] += 1
                S.stats["executes_per_device"][device] += 1

    def _execute(model, in_ds, out_ds, stream) -> int:
        batch = model.batch
        if model.gears:
            ptr, size = S.data_buffers[ins[len(model.inputs)]]
            batch = (ctypes.c_uint64 if size >= 8 else ctypes.c_uint32).from_address(ptr).value or model.batch
        feeds = {}
        for t, buf in zip(model.inputs, ins):
            view = _view(buf, t.dtype, batch, t.row_shape, t.row_bytes)
            if view is None:
                return S.set_error(S.EXEC_MODEL_DATA_SIZE_INVALID, f"input {t.name}: buffer too small or not on device")
            feeds[t.name] = view.copy()
        first = next(iter(feeds.values()))
        spec = model.spec
        if spec.get("exec_delay_ms"):
            time.sleep(spec["exec_delay_ms"] / 1000)
        if spec.get("hang_on_value") is not None and (first == spec["hang_on_value"]).any():
            _sleep_until_stopped(stream, 3600)
            return S.set_error(S.MODEL_EXECUTE, "the device stopped answering")
        if spec.get("fail_on_value") is not None and (first == spec["fail_on_value"]).any():
            return S.set_error(S.MODEL_EXECUTE, "injected execution failure (AI Core exception)")
        if spec.get("abort_on_value") is not None and (first == spec["abort_on_value"]).any():
            stream.context.aborted = True
            return S.set_error(S.AICORE_EXCEPTION, "injected AI Core exception: the context is aborted")
        results = model.session.run(None, feeds)
        for t, buf, value in zip(model.outputs, outs, results):
            view = _view(buf, t.dtype, batch, t.row_shape, t.row_bytes)
            if view is None:
                return S.set_error(S.EXEC_MODEL_DATA_SIZE_INVALID, f"output {t.name}: buffer too small")
            view[...] = value
        return S.SUCCESS

    stream.submit(run, refs)
    return S.SUCCESS


S.drop_absent(sys.modules[__name__], "mdl.")
