"""gepool's errors: each a class with a wire code and an HTTP status, rebuilt by code on the client.

Exceptions never cross a process boundary as objects: the front sends (code, message) and the
client raises the matching class. Anything unexpected reaches a client as INTERNAL while its
traceback stays in the log of the process where it happened.
"""

INTERNAL_MESSAGE = "internal error (the sidecar's log has the details)"  # all a client hears of a crash


class GepoolError(Exception):
    code = "INTERNAL"
    http_status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class InvalidArgument(GepoolError):
    code, http_status = "INVALID_ARGUMENT", 400


class AlreadyExists(GepoolError):
    """A name taken already (a shared-memory region registered twice): Triton's ALREADY_EXISTS, 400 over HTTP."""

    code, http_status = "ALREADY_EXISTS", 400


class ModelNotFound(GepoolError):
    code, http_status = "MODEL_NOT_FOUND", 400


class ModelNotReady(GepoolError):
    code, http_status = "MODEL_NOT_READY", 503


class PermissionDenied(GepoolError):
    """The caller may not do this (someone else's memory, a restricted API, an unidentified caller)."""

    code, http_status = "PERMISSION_DENIED", 403


class RequestTooLarge(GepoolError):
    code, http_status = "REQUEST_TOO_LARGE", 400


class Unavailable(GepoolError):
    code, http_status = "UNAVAILABLE", 503


class Timeout(GepoolError):
    """A request's queue timeout passed before it ran (Triton answers UNAVAILABLE, 503)."""

    code, http_status = "TIMEOUT", 503


class WorkerDied(GepoolError):
    code, http_status = "WORKER_DIED", 500


class ModelError(GepoolError):
    """The model itself raised while executing a batch."""

    code, http_status = "MODEL_ERROR", 500


class ProtocolMismatch(GepoolError):
    code, http_status = "PROTOCOL", 400


class PoolUnavailable(GepoolError):
    """No answer in time: raised on the client when no pool answered at the endpoint within its timeout,
    and sent by the front for a request it dropped from its queue once its client's timeout passed."""

    code, http_status = "POOL_UNAVAILABLE", 503


class Internal(GepoolError):
    code, http_status = "INTERNAL", 500


class Unknown(GepoolError):
    """A model's failure with TritonError.UNKNOWN: 400 over HTTP, UNKNOWN over gRPC, as Triton answers it."""

    code, http_status = "UNKNOWN", 400


class NotFound(GepoolError):
    """A model's failure with TritonError.NOT_FOUND: 404 over HTTP, NOT_FOUND over gRPC."""

    code, http_status = "NOT_FOUND", 404


class Unsupported(GepoolError):
    """A model's failure with TritonError.UNSUPPORTED: 501 over HTTP, UNIMPLEMENTED over gRPC."""

    code, http_status = "UNSUPPORTED", 501


class Cancelled(GepoolError):
    """A model's failure with TritonError.CANCELLED: 400 over HTTP, CANCELLED over gRPC."""

    code, http_status = "CANCELLED", 400


class ConfigError(Exception):
    """A config.pbtxt that cannot be served, located by file, line and field."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str) -> None:
        self.path, self.line, self.field, self.message = path, line, field, message
        where = f"{path}:{line}" if line else path
        what = f" field '{field}':" if field else ""
        super().__init__(f"{where}:{what} {message}")


_BY_CODE = {cls.code: cls for cls in GepoolError.__subclasses__()}
# pb_utils.TritonError's codes, in order (UNKNOWN = 0 ... CANCELLED = 7): what a python model's error answers as
TRITON_ERROR_CODES = ("UNKNOWN", "MODEL_ERROR", "NOT_FOUND", "INVALID_ARGUMENT", "UNAVAILABLE", "UNSUPPORTED",
                      "ALREADY_EXISTS", "CANCELLED")


# a model's failure with each code: a ModelError (counted as the backend's), answered with that code's status;
# a class, not an instance's attributes, so that an ensemble rewording it (type(err)(...)) keeps the code
_CODED_FAILURES = {code: type(f"ModelError{_BY_CODE[code].__name__}", (ModelError,),
                              {"code": code, "http_status": _BY_CODE[code].http_status})
                   for code in TRITON_ERROR_CODES if code != ModelError.code}


def model_failure(model: str, message: str) -> ModelError:
    """A model's failure of one request, answered with the TritonError code it gave (``message.code``: ipc's
    Failure), as Triton's python backend answers it; INTERNAL or none is MODEL_ERROR (500)."""
    code = getattr(message, "code", None)
    coded = TRITON_ERROR_CODES[code] if type(code) is int and 0 <= code < len(TRITON_ERROR_CODES) else None
    return _CODED_FAILURES.get(coded, ModelError)(f"model '{model}' failed: {message}")


def from_code(code: str, message: str) -> GepoolError:
    """The exception a client raises for an error reply."""
    return _BY_CODE.get(code, Internal)(message)
