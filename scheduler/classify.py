"""Triton's classification extension: an output asked for with a class count comes back as its top classes."""

import numpy as np

from gepool.common.config import ModelConfig
from gepool.common.errors import InvalidArgument

# Triton's TopkClassifications: integer and FP32/FP64 outputs; anything else is refused with its words
CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"})


def requested_outputs(outputs: object, config: ModelConfig) -> tuple[set[str] | None, dict[str, int] | None]:
    """(names, classification counts) from an Infer's ``outputs``: None (all), or a list whose items are
    a name or ``[name, class_count]`` (class_count 0: the raw tensor). Raises InvalidArgument."""
    if outputs is None:
        return None, None
    if type(outputs) is not list:
        raise InvalidArgument("outputs must be null or a list of names")
    names: set[str] = set()
    counts: dict[str, int] = {}
    by_name = {t.name: t for t in config.outputs}
    for item in outputs:
        if type(item) is str:
            name, count = item, 0
        elif type(item) is list and len(item) == 2 and type(item[0]) is str and type(item[1]) is int:
            name, count = item
        else:
            raise InvalidArgument(f"each output must be a name or [name, class_count], got {item!r}")
        if name not in by_name:
            raise InvalidArgument(f"unknown output ['{name}'] for model '{config.name}' "
                                  f"(it has {sorted(by_name)})")
        if count < 0:
            raise InvalidArgument(f"output '{name}': class_count must be >= 0, got {count}")
        if count:
            datatype = by_name[name].datatype
            if datatype not in CLASSIFIABLE:
                raise InvalidArgument(f"output '{name}': class result not available for output due to "
                                      f"unsupported type '{datatype}'")
            counts[name] = count
        names.add(name)
    return names, counts or None


def top_classes(piece: np.ndarray, count: int, batched: bool, labels: tuple[str, ...]) -> np.ndarray:
    """Per batch row (the whole tensor when the model does not batch), the ``count`` largest values as
    Triton writes them: b"value:index" or b"value:index:label", the value as C's std::to_string prints it
    (``%f`` for floats), the largest first and, among equal values, the lower index first. Shape
    [rows, k] (batched) or [k], k = min(count, elements per row)."""
    rows = piece.reshape(piece.shape[0], -1) if batched else piece.reshape(1, -1)
    n = rows.shape[1]
    k = min(count, n)
    # a stable sort of the reversed row, reversed back: descending, ties in index order
    order = (n - 1 - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1])[:, :k]
    floating = rows.dtype.kind == "f"
    out = np.empty((rows.shape[0], k), dtype=object)
    for r in range(rows.shape[0]):
        row = rows[r]
        for j, idx in enumerate(order[r].tolist()):
            value = row[idx]
            text = f"{float(value):f}:{idx}" if floating else f"{int(value)}:{idx}"
            if idx < len(labels) and labels[idx]:
                text += ":" + labels[idx]
            out[r, j] = text.encode()
    return out if batched else out[0]


def classify(config: ModelConfig, names: list[str], pieces: list[np.ndarray], counts: dict[str, int]) -> list:
    """The pieces of a response, those asked for with a class count replaced by their top classes."""
    batched = config.max_batch_size > 0
    labels = {t.name: t.labels for t in config.outputs}
    return [top_classes(p, counts[n], batched, labels[n]) if n in counts else p for n, p in zip(names, pieces)]
