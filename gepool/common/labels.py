"""An output's label file (Triton's label_filename): one label per line, read when the model loads."""

import os
import stat

MAX_LABEL_FILE_BYTES = 16 << 20


def read_labels(model_path: str, filename: str) -> tuple[str, ...]:
    """The lines of ``filename``, a regular file directly in the model folder (no link), of bounded size;
    raises ValueError saying what is wrong."""
    if not filename or "/" in filename or "\\" in filename or filename in (".", "..") or "\0" in filename:
        raise ValueError(f"'{filename}' must name a file in the model folder")
    path = os.path.join(model_path, filename)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot open {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_LABEL_FILE_BYTES:
            raise ValueError(f"{path} must be a regular file of at most {MAX_LABEL_FILE_BYTES} bytes")
        data = f.read(MAX_LABEL_FILE_BYTES + 1)
    if len(data) > MAX_LABEL_FILE_BYTES:
        raise ValueError(f"{path} grew past {MAX_LABEL_FILE_BYTES} bytes while read")
    try:
        return tuple(data.decode("utf-8").splitlines())
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
