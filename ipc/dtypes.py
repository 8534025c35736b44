"""Triton datatype names, their numpy dtypes, and the small codes the slot header stores."""

import numpy as np

# Order fixes the one-byte code written into slot headers: append only.
DATATYPES: tuple[str, ...] = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64",
)
_NUMPY = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
_FROM_NUMPY = {dt: name for name, dt in _NUMPY.items()}
CODES = {name: i for i, name in enumerate(DATATYPES)}


def to_numpy(datatype: str) -> np.dtype:
    """The numpy dtype of a Triton datatype name; KeyError for names gepool cannot carry."""
    return _NUMPY[datatype]


def from_numpy(dtype: np.dtype) -> str:
    """The Triton datatype name of a numpy dtype, or a ValueError naming it."""
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"numpy dtype {np.dtype(dtype)} has no Triton datatype gepool can carry") from None


def is_supported(datatype: str) -> bool:
    return datatype in _NUMPY


def itemsize(datatype: str) -> int:
    return _NUMPY[datatype].itemsize
