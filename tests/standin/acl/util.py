"""acl.util: host pointer helpers (stand-in)."""

import ctypes
import warnings

import numpy as np

_NPY = {0: np.bool_, 1: np.int8, 2: np.uint8, 3: np.int16, 4: np.uint16, 5: np.int32, 6: np.uint32, 7: np.int64,
        8: np.uint64, 9: np.longlong, 10: np.ulonglong, 11: np.float32, 12: np.float64, 23: np.float16}


def bytes_to_ptr(data) -> int:
    if not isinstance(data, bytes):
        raise ValueError("needs an byte as argument")
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value


def ptr_to_bytes(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


def numpy_to_ptr(arr) -> int:
    warnings.warn("numpy_to_ptr will be deprecated", Warning, stacklevel=2)
    return arr.ctypes.data


def ptr_to_numpy(ptr: int, shape: tuple, npy_type: int):
    warnings.warn("ptr_to_numpy will be deprecated", Warning, stacklevel=2)
    dtype = np.dtype(_NPY[npy_type])
    count = int(np.prod(shape))
    raw = (ctypes.c_ubyte * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype).reshape(shape)
