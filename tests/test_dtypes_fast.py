"""``dtypes.from_numpy``'s lookup of a numeric dtype against the general conversion it stands in front of."""

import numpy as np
import pytest

from gepool.ipc import dtypes

DTYPE_LIKES = [np.dtype(t) for t in ("?", "u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f2", "f4", "f8")]
DTYPE_LIKES += [d.newbyteorder() for d in DTYPE_LIKES[2:]]  # byte-swapped: not carried
DTYPE_LIKES += [np.dtype(object), np.dtype("S3"), np.dtype("U2"), np.dtype("c8"), np.dtype("M8[s]"),
                np.dtype([("a", "f4")]), np.dtype(("f4", (2,))), np.float32, np.int64, "float32", "f4", bool, object,
                "S", "U"]


def answer(f, dtype):
    try:
        return ("ok", f(dtype))
    except ValueError as exc:
        return ("refused", str(exc))


@pytest.mark.parametrize("dtype", DTYPE_LIKES, ids=repr)
def test_from_numpy_agrees_with_the_general_conversion(dtype):
    assert answer(dtypes.from_numpy, dtype) == answer(dtypes._named, dtype)


def test_every_datatype_round_trips():
    for name in dtypes.DATATYPES:
        assert dtypes.from_numpy(dtypes.to_numpy(name)) == name
