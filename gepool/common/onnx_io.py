"""The inputs and outputs an ONNX file declares, read from its bytes without the onnx package.

ModelProto and GraphProto are walked on the protobuf wire over an mmap, so the weights (initializers,
most of a file's bytes) are skipped, never copied, and a file past protobuf's 2 GiB message limit
reads as well as a small one; only each graph input and output (a small ValueInfoProto) is handed to
the generated subset of onnx.proto. Every length is checked against what is left before it is used.
"""

import mmap
import os
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from gepool.common import onnx_subset_pb2 as pb

# ModelProto.graph; GraphProto's initializer, input, output, sparse_initializer; TensorProto.name;
# SparseTensorProto.values (a TensorProto carrying the name)
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_SPARSE_INITIALIZER = 5, 11, 12, 15
_TENSOR_NAME = 8
_SPARSE_VALUES = 1
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
MAX_VALUE_INFO_BYTES = 1 << 20  # one input's or output's declaration; real ones are a few dozen bytes
MAX_TENSORS = 4096  # inputs or outputs of one graph
MAX_NAME_BYTES = 4096

# TensorProto.DataType -> Triton's datatype name (as onnxruntime_backend's OnnxDataTypeToModelConfigDataType)
ONNX_DATATYPES = {1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64", 8: "BYTES",
                  9: "BOOL", 10: "FP16", 11: "FP64", 12: "UINT32", 13: "UINT64", 16: "BF16"}
ONNX_TYPE_NAMES = {14: "COMPLEX64", 15: "COMPLEX128", 17: "FLOAT8E4M3FN", 18: "FLOAT8E4M3FNUZ", 19: "FLOAT8E5M2",
                   20: "FLOAT8E5M2FNUZ", 21: "UINT4", 22: "INT4", 23: "FLOAT4E2M1"}


class OnnxFormatError(ValueError):
    """The file is not an ONNX model this reader can take apart; the message says where it broke."""


@dataclass(frozen=True)
class OnnxTensor:
    name: str
    datatype: str | None  # Triton's name ("FP32"); None: a type Triton has no name for (see onnx_type)
    dims: tuple[int, ...] | None  # -1 for a symbolic or unknown dim; None: the file gives no shape at all
    onnx_type: str = ""  # what the file says, for messages ("tensor(COMPLEX64)", "sequence", ...)


@dataclass(frozen=True)
class OnnxSignature:
    inputs: tuple[OnnxTensor, ...]
    outputs: tuple[OnnxTensor, ...]


def read_signature(path: str) -> OnnxSignature:
    """The graph inputs (initializers listed as inputs left out) and outputs of the ONNX file at ``path``."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise OnnxFormatError("the file is empty")
            # Only indices into the view travel between functions, and each slice is copied to bytes at
            # once: a slice still alive (held by a traceback) would make closing the mmap raise.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
                return _signature(view)
    except OSError as exc:
        raise OnnxFormatError(f"cannot read: {exc.strerror or exc}") from None


def _signature(buf: memoryview) -> OnnxSignature:
    graphs = [(s, e) for num, _, s, e in _fields(buf, 0, len(buf), "ModelProto") if num == _MODEL_GRAPH]
    if not graphs:
        raise OnnxFormatError("no graph in the file (is it an ONNX model?)")
    inputs, outputs, initializers = [], [], set()
    for start, end in graphs:  # protobuf merges a repeated embedded message; so does this reader
        for num, wire, s, e in _fields(buf, start, end, "GraphProto"):
            if wire != _LEN:
                continue
            if num in (_GRAPH_INPUT, _GRAPH_OUTPUT):
                into = inputs if num == _GRAPH_INPUT else outputs
                if len(into) >= MAX_TENSORS:
                    raise OnnxFormatError(f"more than {MAX_TENSORS} graph {'inputs' if into is inputs else 'outputs'}")
                into.append(_value_info(buf, s, e))
            elif num == _GRAPH_INITIALIZER:
                initializers.add(_tensor_name(buf, s, e))
            elif num == _GRAPH_SPARSE_INITIALIZER:
                for n, w, vs, ve in _fields(buf, s, e, "SparseTensorProto"):
                    if n == _SPARSE_VALUES and w == _LEN:
                        initializers.add(_tensor_name(buf, vs, ve))
    return OnnxSignature(tuple(t for t in inputs if t.name not in initializers), tuple(outputs))


def _tensor_name(buf: memoryview, start: int, end: int) -> str:
    name = ""
    for num, wire, s, e in _fields(buf, start, end, "TensorProto"):
        if num == _TENSOR_NAME and wire == _LEN:
            name = _text(buf, s, e, "an initializer's name")
    return name


def _value_info(buf: memoryview, start: int, end: int) -> OnnxTensor:
    if end - start > MAX_VALUE_INFO_BYTES:
        raise OnnxFormatError(f"a graph input or output declaration of {end - start} bytes "
                              f"(more than {MAX_VALUE_INFO_BYTES})")
    info = pb.ValueInfoProto()
    try:
        info.ParseFromString(bytes(buf[start:end]))
    except DecodeError as exc:
        raise OnnxFormatError(f"a graph input or output does not decode: {exc}") from None
    if not info.name or len(info.name.encode()) > MAX_NAME_BYTES:
        raise OnnxFormatError("a graph input or output has no name, or one too long")
    kind = info.type.WhichOneof("value")
    if kind != "tensor_type":
        return OnnxTensor(info.name, None, None, (kind or "no type").removesuffix("_type"))
    tensor = info.type.tensor_type
    datatype = ONNX_DATATYPES.get(tensor.elem_type)
    onnx_type = f"tensor({datatype or ONNX_TYPE_NAMES.get(tensor.elem_type, tensor.elem_type)})"
    if not tensor.HasField("shape"):
        return OnnxTensor(info.name, datatype, None, onnx_type)
    dims = tuple(d.dim_value if d.WhichOneof("value") == "dim_value" and d.dim_value >= 0 else -1
                 for d in tensor.shape.dim)
    return OnnxTensor(info.name, datatype, dims, onnx_type)


def _text(buf: memoryview, start: int, end: int, what: str) -> str:
    if end - start > MAX_NAME_BYTES:
        raise OnnxFormatError(f"{what} is {end - start} bytes long (more than {MAX_NAME_BYTES})")
    try:
        return bytes(buf[start:end]).decode("utf-8")
    except UnicodeDecodeError:
        raise OnnxFormatError(f"{what} is not UTF-8") from None


def _fields(buf: memoryview, pos: int, end: int, what: str):
    """(field number, wire type, value start, value end) of each field in buf[pos:end]."""
    while pos < end:
        key, pos = _varint(buf, pos, end, what)
        num, wire = key >> 3, key & 7
        if num == 0:
            raise OnnxFormatError(f"{what}: field number 0 at byte {pos}")
        if wire == _VARINT:
            _, after = _varint(buf, pos, end, what)
        elif wire == _I64:
            after = pos + 8
        elif wire == _I32:
            after = pos + 4
        elif wire == _LEN:
            length, pos = _varint(buf, pos, end, what)
            after = pos + length
        else:
            raise OnnxFormatError(f"{what}: wire type {wire} at byte {pos} (groups are not ONNX)")
        if after > end:
            raise OnnxFormatError(f"{what}: field {num} runs past the end of its message (truncated file?)")
        yield num, wire, pos, after
        pos = after


def _varint(buf: memoryview, pos: int, end: int, what: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise OnnxFormatError(f"{what}: truncated at byte {pos}")
        if shift > 63:
            raise OnnxFormatError(f"{what}: a varint longer than 10 bytes at byte {pos}")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
