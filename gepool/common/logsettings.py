"""Log settings in the terms of Triton's logging extension, and their effect on this process's logging."""

import errno
import logging
import os
import stat
import sys
import time
from dataclasses import asdict, dataclass

from gepool.common.errors import InvalidArgument

FORMATS = ("default", "ISO8601")
ISO8601_DATE = "%Y-%m-%dT%H:%M:%SZ"  # Triton's ISO8601 log timestamps, in UTC
MAX_VERBOSE = (1 << 32) - 1  # Triton's log_verbose_level is a uint32
# Triton's switches, least severe first; gepool logs by threshold, so a level is on with every more severe one
_SWITCHES = (("log_verbose_level", logging.DEBUG), ("log_info", logging.INFO), ("log_warning", logging.WARNING),
             ("log_error", logging.ERROR))
SETTINGS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")


@dataclass(frozen=True)
class LogSettings:
    """The least severe level logged, Triton's verbose level (1 or more: DEBUG is logged), format and log file
    (every process's standard error, where its log goes; "": the console's)."""

    level: int = logging.INFO
    verbose: int = 0
    format: str = "default"
    file: str = ""

    @classmethod
    def of_level(cls, level: int, fmt: str = "default", file: str = "") -> "LogSettings":
        return cls(level, 1 if level <= logging.DEBUG else 0, fmt, file)

    @classmethod
    def from_wire(cls, body: object) -> "LogSettings":
        if not isinstance(body, dict) or not all(type(body.get(k)) is t for k, t in
                                                 (("level", int), ("verbose", int), ("format", str),
                                                  ("file", str))):
            raise InvalidArgument(f"log settings must be {{level, verbose, format, file}}, got {body!r:.200}")
        return cls(body["level"], body["verbose"], body["format"], body["file"])

    def as_wire(self) -> dict:
        return asdict(self)

    def as_triton(self) -> dict:
        """The $log_setting_response of Triton's logging extension."""
        return {"log_file": self.file, "log_info": self.level <= logging.INFO,
                "log_warning": self.level <= logging.WARNING, "log_error": self.level <= logging.ERROR,
                "log_verbose_level": self.verbose,
                "log_format": self.format}

    def updated(self, request: object) -> "LogSettings":
        """These settings with a $log_setting_request applied (a setting left out, or null, stays as it
        is); InvalidArgument names a setting that is unknown, of the wrong type, or not possible here."""
        if not isinstance(request, dict):
            raise InvalidArgument("the log setting request must be a JSON object")
        for key in request:
            if key not in SETTINGS:
                raise InvalidArgument(f"unknown log setting '{key}' (the settings: {', '.join(SETTINGS)})")
        given = {k: v for k, v in request.items() if v is not None}
        if "log_file" in given:
            raise InvalidArgument("log file location can not be updated through network protocol")
        on = {"log_verbose_level": self.verbose > 0, **{k: v for k, v in self.as_triton().items()
                                                          if k in ("log_info", "log_warning", "log_error")}}
        verbose = self.verbose
        for key, _ in _SWITCHES[1:]:
            if key in given:
                if type(given[key]) is not bool:
                    raise InvalidArgument(f"log setting '{key}' must be true or false, got {given[key]!r:.100}")
                on[key] = given[key]
        if "log_verbose_level" in given:
            verbose = given["log_verbose_level"]
            if type(verbose) is not int or not 0 <= verbose <= MAX_VERBOSE:
                raise InvalidArgument(f"log setting 'log_verbose_level' must be an integer from 0 to {MAX_VERBOSE}, "
                                      f"got {verbose!r:.100}")
            on["log_verbose_level"] = verbose > 0
        fmt = given.get("log_format", self.format)
        if fmt not in FORMATS:
            raise InvalidArgument(f"invalid argument for log_format, got: {fmt!r:.100} (one of {', '.join(FORMATS)})")
        for (lower, _), (higher, _) in zip(_SWITCHES, _SWITCHES[1:]):
            if on[lower] and not on[higher]:
                raise InvalidArgument(f"{higher} false with {lower} on: gepool logs every level from the least "
                                      f"severe one logged on, so {higher} false needs {lower} off too")
        level = next((lv for key, lv in _SWITCHES if on[key]), logging.CRITICAL)
        return LogSettings(level, verbose, fmt, self.file)

    def apply(self) -> None:
        """Sets this process's root logger to these settings (its handlers' date format too)."""
        root = logging.getLogger()
        root.setLevel(self.level)
        for handler in root.handlers:
            formatter = handler.formatter
            if formatter is None:
                continue
            iso = self.format == "ISO8601"
            formatter.datefmt = ISO8601_DATE if iso else None
            formatter.converter = time.gmtime if iso else time.localtime


_stderr_file = ""  # the file this process's standard error was pointed at by log_to_file ("": as it started)
_console = -1  # this process's standard error as it started, once log_to_file has pointed it elsewhere


def log_to_file(path: str) -> None:
    """Points this process's standard error (its log, and every child's it starts from now on) at the end of
    the file ``path``, as Triton's --log-file: appended to, created readable by this user only. OSError where
    it cannot be: a path that cannot be opened for writing, a symbolic link (another user could have made it
    point at a file of ours), or a regular file another user owns (which that user could read)."""
    global _stderr_file, _console
    if path == _stderr_file:
        return
    # non-blocking: a fifo no one reads fails here (ENXIO) instead of hanging the start
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno in _WHY:
            raise OSError(exc.errno, _WHY[exc.errno]) from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        os.set_blocking(fd, True)
        sys.stderr.flush()  # what was written before goes where it was meant to
        if _console < 0:
            _console = os.dup(2)  # (not inherited: only this process tells its console why it ends)
        os.dup2(fd, 2)  # (dup2 leaves the new descriptor 2 inheritable, as a standard error is)
    finally:
        os.close(fd)
    _stderr_file = path


_WHY = {errno.ENXIO: "it is a fifo or socket that no process reads",
        errno.ELOOP: "it is a symbolic link (give the file it points to)"}


def console() -> int:
    """This process's standard error as it started, where log_to_file pointed it elsewhere; else -1."""
    return _console


def printable(text: str) -> str:
    """``text`` for a log line: as it is, or escaped where it holds a line break or another control character
    (a client's path must not write a line of its own into the log)."""
    return text if text.isprintable() else ascii(text)[1:-1]
