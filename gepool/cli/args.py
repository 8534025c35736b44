"""Option types and the user error the ``gepool`` command reports as one line with exit code 2."""

import argparse

import numpy as np

ENDPOINT_FORMS = "ipc://PATH, tcp://HOST:PORT or HOST:PORT"


class UsageError(Exception):
    """A user error: the command line is wrong, or names a file, folder or endpoint that is not there."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr (a UsageError), not usage and a paragraph."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def boolean(text: str) -> bool:
    """A boolean flag's value as tritonserver reads one: true/on/1 or false/off/0, any case."""
    low = text.lower()
    if low in ("true", "on", "1"):
        return True
    if low in ("false", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"takes true or false, not '{text}'")


def verbosity(text: str) -> int:
    """--log-verbose: a level >= 0, or true/false (1/0), as tritonserver's."""
    low = text.lower()
    if low in ("true", "false"):
        return int(low == "true")
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"takes a level (0: off, 1 or more: verbose) or true/false, not '{text}'")
    return int(text)


def byte_count(text: str) -> int:
    """A size in bytes: a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"takes a number of bytes >= 1, not '{text}'")
    return int(text)


def endpoint(text: str) -> str:
    """ipc://PATH or tcp://HOST:PORT as given; HOST:PORT becomes tcp://HOST:PORT."""
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    rest = text.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if sep and host and (port.isdigit() and 0 < int(port) < 65536 or port == "*"):
        return f"tcp://{rest}"
    raise argparse.ArgumentTypeError(f"an endpoint looks like {ENDPOINT_FORMS}, not '{text}'")


def add_endpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", type=endpoint, metavar="ENDPOINT",
                   help=f"the pool's endpoint: {ENDPOINT_FORMS} (default: ipc in your runtime folder)")


def processes(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1 or 'auto', not '{text}'")
    return int(text)


def load_inputs(items: list[str]) -> dict[str, np.ndarray]:
    """--input NAME=FILE.npy, each loaded now, so that a typo is an error before anything is sent."""
    given = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--input takes NAME=FILE.npy, not '{item}'")
        try:
            given[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--input {name}: cannot load '{path}': {exc}") from None
    return given


def say(text: object) -> None:
    """``gepool: error: TEXT`` on stderr, on one line whatever the text holds."""
    tell(f"gepool: error: {' '.join(str(text).split())}")


def tell(line: str) -> None:
    """One line on stderr, and on the console too where --log-file took stderr: why the command ends."""
    import os
    import sys

    from gepool.common.logsettings import console

    print(line, file=sys.stderr, flush=True)
    if console() >= 0:
        try:
            os.write(console(), (line + "\n").encode(errors="backslashreplace"))
        except OSError:
            pass
