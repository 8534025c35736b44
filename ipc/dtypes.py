"""Triton datatype names, their numpy dtypes, and the small codes the slot header stores.

BYTES tensors travel and sit in slots in Triton's serialized form: per element, a little-endian
uint32 length then the bytes, in row-major order. Concatenating two requests' blobs is therefore
the blob of their concatenated rows, which is all batching needs.
"""

import struct

import numpy as np

# Order fixes the one-byte code written into slot headers: append only.
DATATYPES: tuple[str, ...] = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
)
BYTES = "BYTES"
_LEN = struct.Struct("<I")
_NUMPY = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
_FROM_NUMPY = {dt: name for name, dt in _NUMPY.items()}
CODES = {name: i for i, name in enumerate(DATATYPES)}


def to_numpy(datatype: str) -> np.dtype:
    """The numpy dtype of a Triton datatype name (object for BYTES); KeyError for names gepool cannot carry."""
    return np.dtype(object) if datatype == BYTES else _NUMPY[datatype]


def from_numpy(dtype: np.dtype) -> str:
    """The Triton datatype name of a numpy dtype, or a ValueError naming it."""
    if isinstance(dtype, np.dtype) and (name := _FROM_NUMPY.get(dtype)) is not None:
        return name  # a numeric dtype, as _named finds it
    return _named(dtype)


def _named(dtype) -> str:
    """``from_numpy`` for any dtype-like: BYTES for object and string kinds, else the numeric map."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return BYTES
    try:
        return _FROM_NUMPY[dtype]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no Triton datatype gepool can carry") from None


def is_supported(datatype: str) -> bool:
    return datatype in _NUMPY or datatype == BYTES


def itemsize(datatype: str) -> int:
    """Bytes per element; BYTES has none (ValueError): its size is in its data."""
    if datatype == BYTES:
        raise ValueError("BYTES elements have no fixed size")
    return _NUMPY[datatype].itemsize


def serialize_bytes(arr: np.ndarray) -> bytes:
    """An object/bytes/str array in Triton's BYTES form (str is UTF-8 encoded)."""
    parts = []
    for item in np.asarray(arr, dtype=object).ravel():
        b = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += (_LEN.pack(len(b)), b)
    return b"".join(parts)


def bytes_offsets(buf, count: int) -> list[int]:
    """Where each of ``count`` serialized elements starts, plus the end; ValueError if the data is not
    exactly that many elements."""
    view = memoryview(buf)
    offsets, pos = [], 0
    for _ in range(count):
        offsets.append(pos)
        if pos + 4 > len(view):
            raise ValueError(f"BYTES data ends inside the length of element {len(offsets) - 1} of {count}")
        pos += 4 + _LEN.unpack_from(view, pos)[0]
        if pos > len(view):
            raise ValueError(f"BYTES element {len(offsets) - 1} runs past the {len(view)} bytes of data")
    if pos != len(view):
        raise ValueError(f"{len(view) - pos} bytes follow the {count} BYTES elements the shape holds")
    offsets.append(pos)
    return offsets


def uniform_bytes(buf, count: int) -> bool:
    """Whether ``buf`` is exactly ``count`` serialized elements of one length (checked in one pass of
    numpy, not element by element): the common case, where no walk is needed."""
    n = len(buf)
    if count <= 0 or n % count or n // count < 4:
        return count == 0 == n
    stride = n // count
    lengths = np.ndarray((count,), "<u4", buffer=buf, strides=(stride,))
    return bool((lengths == stride - 4).all())


def deserialize_bytes(buf, shape: tuple[int, ...]) -> np.ndarray:
    """Triton's BYTES form -> an object array of bytes with the given shape."""
    count = int(np.prod(shape)) if len(shape) else 1
    view = memoryview(buf)
    offsets = bytes_offsets(view, count)
    out = np.empty(count, dtype=object)
    for i in range(count):
        out[i] = bytes(view[offsets[i] + 4:offsets[i + 1]])
    return out.reshape(shape)
