"""Triton python-backend models (``class TritonPythonModel``): execute(requests) -> one response per request."""

import copy
import json
import os

import numpy as np

from gepool.common.config import BACKEND_PYTHON, ModelConfig, TensorConfig
from gepool.common.render import render
from gepool.ipc import dtypes
from gepool.ipc.ring import Failure
from gepool.workers.backends import triton_python_backend_utils as pb_utils
from gepool.workers.backends.base import KIND_CPU, RequestSpan, SyncBackend
from gepool.workers.backends.python import Coroutines

_INSTANCE_KINDS = {KIND_CPU: "CPU", "KIND_MODEL": "MODEL"}


class TritonPythonBackend(SyncBackend):
    """Created by PythonBackend.open for a model.py that defines TritonPythonModel (not registered itself).

    Each batch is split back into its requests (the slot's request table gives their rows), the model
    answers each, and the answers are joined into the batch's outputs; a response with an error fails
    its request alone, an exception from execute fails the whole batch."""

    name = BACKEND_PYTHON
    kinds = (KIND_CPU, "KIND_MODEL")
    per_request = True

    def __init__(self, config: ModelConfig, version_dir: str, device: str, threads: int, model_cls: type) -> None:
        super().__init__(config, version_dir, device, threads)
        self.model_config = render(config)  # the config being served (auto-completed), as GET .../config shows it
        self.version = int(os.path.basename(os.path.normpath(version_dir)))
        self._check_auto_complete(model_cls)
        self.model = model_cls()
        self.runner = Coroutines()
        init = getattr(self.model, "initialize", None)
        if init is not None:
            group = (self.model_config.get("instance_group") or [{"name": f"{config.name}_0"}])[0]
            init({
                "model_config": json.dumps(self.model_config),
                "model_instance_kind": _INSTANCE_KINDS.get(config.instance_groups[0].kind, "CPU"),
                "model_instance_name": f"{group['name']}_0",
                "model_instance_device_id": device.split(":", 1)[1] if ":" in device else "0",
                "model_repository": os.path.dirname(os.path.normpath(version_dir)),
                "model_version": str(self.version),
                "model_name": config.name,
            })

    def close(self) -> None:
        self.runner.finalize(self.model)

    def _check_auto_complete(self, model_cls: type) -> None:
        """Triton lets auto_complete_config fill in the config; gepool loads the config.pbtxt as written, so
        a model whose auto-complete would change it is refused, naming what it changes."""
        hook = getattr(model_cls, "auto_complete_config", None)
        if hook is None:
            return
        given = pb_utils.ModelConfig(json.dumps(self.model_config))
        before = copy.deepcopy(given.as_dict())
        result = hook(given)
        after = result.as_dict() if isinstance(result, pb_utils.ModelConfig) else None
        if after is None:
            raise TypeError(f"auto_complete_config must return the pb_utils.ModelConfig, got {type(result).__name__}")
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if changed:
            raise ValueError(f"auto_complete_config of model '{self.config.name}' changes {', '.join(changed)}; "
                             f"gepool does not apply a python model's auto-complete yet: write the complete "
                             f"config into config.pbtxt")

    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """A batch as one request (warm-up); its error response raises."""
        batch = next(iter(inputs.values())).shape[0] if self.config.max_batch_size > 0 else 1
        span = RequestSpan(0, batch, tuple(t.name for t in self.config.outputs))
        results, failed = self.execute_requests(inputs, outputs, [span])
        if failed:
            raise RuntimeError(failed[0])
        return results

    def execute_requests(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None],
                         requests: list[RequestSpan]) -> tuple[dict[str, np.ndarray], dict[int, str]]:
        batched = self.config.max_batch_size > 0
        served = []
        for span in requests:
            tensors = [pb_utils.Tensor(name, arr[span.start:span.start + span.rows] if batched else arr)
                       for name, arr in inputs.items()]
            served.append(pb_utils.InferenceRequest._served(tensors, span.outputs, self.config.name, self.version))
        responses = self.runner.run(self.model.execute(served))  # Triton allows an async def execute
        if not isinstance(responses, list | tuple) or len(responses) != len(served):
            got = f"{len(responses)} responses" if isinstance(responses, list | tuple) else type(responses).__name__
            raise TypeError(f"execute() must return a list of one pb_utils.InferenceResponse per request: "
                            f"{len(served)} requests, got {got}")
        failed: dict[int, str] = {}
        arrays: list[dict[str, np.ndarray]] = []
        for k, (span, response) in enumerate(zip(requests, responses, strict=True)):
            if not isinstance(response, pb_utils.InferenceResponse):
                raise TypeError(f"execute() returned {type(response).__name__} for request {k}, "
                                f"not a pb_utils.InferenceResponse")
            got: dict[str, np.ndarray] = {}
            if response.has_error():
                failed[k] = Failure.of(response.error().message(), response.error().code())  # answered with its code
            else:
                try:
                    got = self._response_arrays(response, span, batched)
                except ValueError as exc:
                    failed[k] = str(exc)
            arrays.append(got)
        results = {}
        for t in self.config.outputs:
            self._agree(t, arrays, failed, batched)
        if len(failed) == len(requests):
            return {}, failed
        for t in self.config.outputs:
            results[t.name] = self._join(t, requests, arrays, failed, outputs.get(t.name), batched)
        return results, failed

    def _response_arrays(self, response, span: RequestSpan, batched: bool) -> dict[str, np.ndarray]:
        """One response's outputs, each checked against the config; a ValueError fails that request."""
        got = {}
        declared = {t.name: t for t in self.config.outputs}
        for tensor in response.output_tensors():
            t = declared.get(tensor.name())
            if t is None:
                raise ValueError(f"the response has output '{tensor.name()}', which config.pbtxt does not declare "
                                 f"(it has {sorted(declared)})")
            arr = tensor.as_numpy()
            is_bytes = t.datatype == dtypes.BYTES
            if (arr.dtype.kind not in "OS") if is_bytes else (arr.dtype != dtypes.to_numpy(t.datatype)):
                raise ValueError(f"output '{t.name}' is {arr.dtype}, config.pbtxt says TYPE_{_pbtype(t.datatype)}")
            dims = arr.shape[1:] if batched else arr.shape
            if batched and (arr.ndim == 0 or arr.shape[0] != span.rows):
                raise ValueError(f"output '{t.name}' has shape {list(arr.shape)}: its request has {span.rows} rows")
            if len(dims) != len(t.dims) or any(w not in (-1, d) for w, d in zip(t.dims, dims, strict=True)):
                raise ValueError(f"output '{t.name}' has dims {list(dims)}, config.pbtxt says {list(t.dims)}")
            got[t.name] = arr
        missing = [n for n in span.outputs if n not in got]
        if missing:
            raise ValueError(f"the response has no output {missing}, which the request asked for")
        return got

    @staticmethod
    def _agree(t: TensorConfig, arrays: list[dict], failed: dict[int, str], batched: bool) -> None:
        """Requests of one batch are answered from one array per output: their non-batch dims must agree
        (they differ only where config.pbtxt has -1). A request that disagrees with the first fails."""
        first = None
        for k, got in enumerate(arrays):
            if k in failed or t.name not in got:
                continue
            dims = got[t.name].shape[1:] if batched else got[t.name].shape
            if first is None:
                first = dims
            elif dims != first:
                failed[k] = (f"output '{t.name}' has dims {list(dims)}, another request of its batch gave "
                             f"{list(first)}: a batch's outputs must share their dims")

    @staticmethod
    def _join(t: TensorConfig, requests: list[RequestSpan], arrays: list[dict], failed: dict[int, str],
              view: np.ndarray | None, batched: bool) -> np.ndarray:
        """The batch's array for one output: each request's rows, filler for rows nobody answered."""
        given = [got[t.name] for k, got in enumerate(arrays) if k not in failed and t.name in got]
        dims = (given[0].shape[1:] if batched else given[0].shape) if given else tuple(max(d, 0) for d in t.dims)
        if not batched:
            return given[0] if given else _filler(t, dims)
        total = sum(s.rows for s in requests)
        out = view if view is not None and view.shape == (total, *dims) else None
        if out is None:
            out = np.empty((total, *dims), object if t.datatype == dtypes.BYTES else dtypes.to_numpy(t.datatype))
        for k, span in enumerate(requests):
            got = arrays[k].get(t.name) if k not in failed else None
            out[span.start:span.start + span.rows] = got if got is not None else _filler(t, (span.rows, *dims))
        return out


def _filler(t: TensorConfig, shape: tuple[int, ...]) -> np.ndarray:
    if t.datatype == dtypes.BYTES:
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtypes.to_numpy(t.datatype))


def _pbtype(datatype: str) -> str:
    return "STRING" if datatype == dtypes.BYTES else datatype
