"""Triton's ``triton_python_backend_utils`` (pb_utils) API, for TritonPythonModel files served by gepool.

The worker puts this module in ``sys.modules`` under Triton's name before it runs a model.py, so
``import triton_python_backend_utils as pb_utils`` there finds it. It has the names Triton's module
has (tensors, requests, responses, errors, config helpers, auto-complete's ModelConfig, Logger) and
BLS (``InferenceRequest(...).exec()`` and ``async_exec()``, through the worker's pool handle); the model
loading API, decoupled BLS and decoupled transactions raise TritonModelException saying they are not
supported yet.
"""

import json
import logging
import struct

import numpy as np

from gepool.common.errors import TRITON_ERROR_CODES

_log = logging.getLogger("gepool.model")

NOT_YET = "is not supported by gepool yet"
# gepool's error codes -> TritonError's, for the error response of a BLS call: TritonError's own, and gepool's
# others as Triton would have classed them
_ERROR_CODES = {**{code: i for i, code in enumerate(TRITON_ERROR_CODES)}, "MODEL_NOT_FOUND": 2,
                "MODEL_NOT_READY": 4, "POOL_UNAVAILABLE": 4, "TIMEOUT": 4, "REQUEST_TOO_LARGE": 3}

TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": bool, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
# TRITONSERVER_DataType numbers (TYPE_INVALID = 0 ... TYPE_BYTES = 13)
_TYPE_NUMBERS = [(1, np.bool_), (2, np.uint8), (3, np.uint16), (4, np.uint32), (5, np.uint64), (6, np.int8),
                 (7, np.int16), (8, np.int32), (9, np.int64), (10, np.float16), (11, np.float32),
                 (12, np.float64), (13, np.object_)]

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


def triton_to_numpy_type(data_type: int):
    return next((np_type for number, np_type in _TYPE_NUMBERS if number == data_type), None)


def numpy_to_triton_type(data_type) -> int | None:
    if data_type == np.bytes_:
        return 13
    return next((number for number, np_type in _TYPE_NUMBERS if data_type == np_type), None)


def triton_string_to_numpy(triton_type_string: str):
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray):
    """Each element as a 4-byte little-endian length and its bytes, in C order (Triton's BYTES wire form)."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.ravel(order="C"):
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += [struct.pack("<I", len(data)), data]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    items, pos, buf = [], 0, memoryview(encoded_tensor).cast("B")
    while pos < len(buf):
        (length,) = struct.unpack_from("<I", buf, pos)
        items.append(bytes(buf[pos + 4:pos + 4 + length]))
        pos += 4 + length
    return np.array(items, dtype=np.object_)


class TritonError:
    """An error for one response: ``InferenceResponse(error=TritonError("..."))`` fails that request alone."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        if message is None:
            raise TypeError("TritonError needs a message")
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message


class TritonModelException(Exception):
    """Raised by a model (or by this module) for a failure of initialize, execute or finalize."""

    def message(self) -> str:
        return str(self)


class Tensor:
    """A named array: an input of a request (a view of the batch) or an output of a response."""

    def __init__(self, name: str, numpy_array: np.ndarray) -> None:
        array = np.asarray(numpy_array)
        if array.dtype.kind == "U" or array.dtype == np.void:
            raise TritonModelException(f"tensor '{name}': dtype {array.dtype} is not supported by the python "
                                       f"backend; use np.object_ (of bytes) for strings")
        if numpy_to_triton_type(array.dtype) is None and numpy_to_triton_type(array.dtype.type) is None:
            raise TritonModelException(f"tensor '{name}': dtype {array.dtype} has no Triton datatype")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int:
        return numpy_to_triton_type(self._array.dtype) or numpy_to_triton_type(self._array.dtype.type)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self):
        return self._array.__dlpack__()

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, tensor) -> "Tensor":
        if not hasattr(tensor, "__dlpack__"):
            raise TritonModelException(f"Tensor.from_dlpack('{name}', ...): gepool takes an object with "
                                       f"__dlpack__ (a CPU array); a bare DLPack capsule {NOT_YET}")
        return Tensor(name, np.from_dlpack(tensor))


class InferenceRequest:
    """A request as ``execute(requests)`` receives it, or one a model builds to call another model (BLS)."""

    def __init__(self, request_id: str = "", correlation_id: int | str = 0, inputs: list | None = None,
                 requested_output_names: list | None = None, model_name: str | None = None,
                 model_version: int = -1, flags: int = 0, timeout: int = 0, preferred_memory=None,
                 trace=None, parameters: dict | None = None) -> None:
        if inputs is None or requested_output_names is None or model_name is None:
            raise TypeError("InferenceRequest needs inputs, requested_output_names and model_name")
        self._request_id, self._correlation_id = request_id, correlation_id
        self._inputs, self._outputs = list(inputs), set(requested_output_names)
        self._model_name, self._model_version = model_name, model_version
        self._flags, self._timeout = flags, timeout
        self._parameters = json.dumps(parameters or {})
        self._trace, self._preferred_memory = trace, preferred_memory

    @classmethod
    def _served(cls, inputs: list[Tensor], requested: tuple[str, ...], model_name: str,
                model_version: int) -> "InferenceRequest":
        return cls(inputs=inputs, requested_output_names=list(requested), model_name=model_name,
                   model_version=model_version)

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def requested_output_names(self) -> set[str]:
        return self._outputs

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return self._parameters

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self):
        raise TritonModelException(f"decoupled responses (InferenceRequest.get_response_sender) {NOT_YET}")

    def set_release_flags(self, flags: int) -> None:
        raise TritonModelException(f"request rescheduling (InferenceRequest.set_release_flags) {NOT_YET}")

    def exec(self, decoupled: bool = False) -> "InferenceResponse":
        """Runs the request on its model in the pool and waits (BLS); a failure of the call comes back as
        an error response (``has_error()``), not an exception."""
        model, inputs, outputs, version, timeout = self._bls_call(decoupled, "exec")
        from gepool import bls
        from gepool.common.errors import GepoolError

        try:
            result = bls.installed().infer(model, inputs, outputs, version=version, timeout=timeout)
        except GepoolError as exc:
            return _error_response(exc)
        return _response(result)

    def async_exec(self, decoupled: bool = False):
        """Sends the request now and returns an awaitable (for an ``async def execute``) that resolves to
        its InferenceResponse; several in flight run at once."""
        import asyncio

        model, inputs, outputs, version, timeout = self._bls_call(decoupled, "async_exec")
        from gepool import bls
        from gepool.common.errors import GepoolError

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise TritonModelException("InferenceRequest.async_exec() is awaited inside an async def "
                                       "execute; call exec() from a plain execute") from None
        try:
            pending = bls.installed().infer_async(model, inputs, outputs, version=version, timeout=timeout)
        except GepoolError as exc:
            pending = None
            failed = exc

        async def response() -> InferenceResponse:
            if pending is None:
                return _error_response(failed)
            try:
                return _response(await pending)
            except GepoolError as exc:
                return _error_response(exc)

        return response()

    def _bls_call(self, decoupled: bool, how: str) -> tuple:
        """(model, inputs, outputs, version, timeout) of this request as a BLS call; what gepool cannot
        run is refused, named."""
        if decoupled:
            raise TritonModelException(f"decoupled BLS (InferenceRequest.{how}(decoupled=True)) {NOT_YET}")
        for what, given in (("flags", self._flags), ("correlation_id", self._correlation_id),
                            ("parameters", self._parameters != "{}"), ("trace", self._trace is not None),
                            ("preferred_memory", self._preferred_memory is not None)):
            if given:
                raise TritonModelException(f"a BLS request with {what} {NOT_YET}")
        model = self._model_name
        if isinstance(model, bytes | np.bytes_):
            model = model.decode("utf-8")
        if not isinstance(model, str):
            raise TritonModelException(f"model_name must be a string, got {type(model).__name__}")
        inputs = {}
        for t in self._inputs:
            if not isinstance(t, Tensor):
                raise TritonModelException(f"inputs must be pb_utils.Tensor objects, got {type(t).__name__}")
            inputs[t.name()] = t.as_numpy()
        outputs = sorted(self._outputs) or None  # none named: every output, as Triton answers
        version = None if self._model_version in (-1, None) else int(self._model_version)
        timeout = self._timeout / 1e6 if self._timeout else None  # Triton's timeout is in microseconds
        return model, inputs, outputs, version, timeout


class InferenceResponse:
    """One request's answer: its output tensors, or an error that fails that request alone."""

    def __init__(self, output_tensors: list | None = None, error: TritonError | None = None,
                 parameters: dict | None = None) -> None:
        output_tensors = [] if output_tensors is None else output_tensors
        if not isinstance(output_tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"error must be a TritonError, got {type(error).__name__}")
        self._outputs, self._error = output_tensors, error
        self._parameters = json.dumps(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


def _response(outputs: dict) -> InferenceResponse:
    return InferenceResponse([Tensor(name, array) for name, array in outputs.items()])


def _error_response(exc: Exception) -> InferenceResponse:
    code = _ERROR_CODES.get(getattr(exc, "code", ""), TritonError.INTERNAL)
    return InferenceResponse(error=TritonError(getattr(exc, "message", str(exc)), code))


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def load_model(model_name: str, config: str = "", files: dict | None = None) -> None:
    raise TritonModelException(f"the model loading API (pb_utils.load_model) {NOT_YET}")


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    raise TritonModelException(f"the model loading API (pb_utils.unload_model) {NOT_YET}")


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    raise TritonModelException(f"the model loading API (pb_utils.is_model_ready) {NOT_YET}")


class Logger:
    """Triton's model logger, onto gepool's log."""

    class LogLevel:
        INFO, WARNING, ERROR, VERBOSE = range(4)

    _LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        _log.log(Logger._LEVELS.get(level, logging.INFO), "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        _log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug("%s", message)


class ModelConfig:
    """What ``auto_complete_config`` receives and returns: the config as a dict, and the setters Triton
    allows there (max batch size, dynamic batching, inputs, outputs, transaction policy)."""

    def __init__(self, model_config: str) -> None:
        self._config = json.loads(model_config)

    def as_dict(self) -> dict:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if self._config.get("max_batch_size", 0) > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {self._config['max_batch_size']}, but "
                             f"auto_complete_config of model '{self._name}' specified {max_batch_size}")
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(f"configuration of model '{self._name}' specifies {other}; auto_complete_config "
                                 f"cannot set dynamic_batching")
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict) -> None:  # noqa: A002 (Triton's parameter name)
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(f"model transaction policy of model '{self._name}' has properties other than "
                             f"'decoupled': {sorted(unknown)}")
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            want = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != want:
                raise ValueError(f"auto_complete_config of model '{self._name}' changes decoupled, which is "
                                 f"already {policy['decoupled']}")
            policy["decoupled"] = want

    @property
    def _name(self) -> str:
        return self._config.get("name", "")

    def _add(self, kind: str, tensor: dict, allowed: tuple[str, ...]) -> None:
        label = tensor.get("name", "")
        extra = sorted(set(tensor) - set(allowed))
        if extra:
            raise ValueError(f"{kind} '{label}' in auto_complete_config of model '{self._name}' has properties "
                             f"other than {', '.join(allowed)}: {extra}")
        for required in ("name", "data_type", "dims"):
            if required not in tensor:
                raise ValueError(f"{kind} '{label}' in auto_complete_config of model '{self._name}' is missing "
                                 f"'{required}'")
        for current in self._config.setdefault(kind, []):
            if current["name"] != tensor["name"]:
                continue
            if current.get("data_type", "TYPE_INVALID") not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(f"model '{self._name}': configuration expects datatype {current['data_type']} "
                                 f"for {kind} '{label}', the model provides {tensor['data_type']}")
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(f"model '{self._name}', tensor '{label}': the model expects dims {tensor['dims']} "
                                 f"but the configuration specifies {current['dims']}")
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(f"model '{self._name}', tensor '{label}': the model expects optional "
                                 f"{tensor['optional']} but the configuration specifies {current['optional']}")
            current.update(tensor)
            return
        self._config[kind].append(tensor)
