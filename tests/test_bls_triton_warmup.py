"""Warmups that call each other through Triton's BLS (``pb_utils.InferenceRequest(...).exec()``) are refused at
once, as the pool handle's are, and a warmup whose callee is merely loading waits for it: a real pool."""

import re

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from tests.test_bls_deadlock import WARM_TIMEOUT_S, WIDTH, _model

# Its warmup's zeros call CALLEE (none: echo) with a timeout, after an initialize that takes load_s; a failed
# call's error response is passed on as the request's own, as Triton's BLS examples do.
TRITON_WARM_CALL_PY = '''
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        p = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.callee, self.timeout_us = p.get("callee", ""), int(float(p["timeout_s"]) * 1e6)
        time.sleep(float(p.get("load_s", "0")))

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if not self.callee or x.any():
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", x.copy())]))
                continue
            call = pb_utils.InferenceRequest(model_name=self.callee, requested_output_names=["OUTPUT"],
                                             inputs=[pb_utils.Tensor("INPUT", x)], timeout=self.timeout_us)
            response = call.exec()
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            out = pb_utils.get_output_tensor_by_name(response, "OUTPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''


def test_triton_warmups_calling_each_other_are_refused_at_once_and_one_waits_for_a_loading_callee(tmp_path):
    """tring_a's and tring_b's warmups call each other with exec() while both load: the cycle is refused at once
    (long before WARM_TIMEOUT_S), both models are UNAVAILABLE with the cycle in their reasons; twaiter's warmup
    calls tslow, still in its initialize, waits, and both come up READY and serve."""
    repo = str(tmp_path)
    t = str(WARM_TIMEOUT_S)
    _model(repo, "tring_a", TRITON_WARM_CALL_PY, {"callee": "tring_b", "timeout_s": t})
    _model(repo, "tring_b", TRITON_WARM_CALL_PY, {"callee": "tring_a", "timeout_s": t})
    _model(repo, "twaiter", TRITON_WARM_CALL_PY, {"callee": "tslow", "timeout_s": t})
    _model(repo, "tslow", TRITON_WARM_CALL_PY, {"timeout_s": t, "load_s": "1"})
    with Pool(repo) as pool:
        models = pool.status["models"]
        assert models["twaiter"]["state"] == "READY" and models["tslow"]["state"] == "READY", models
        assert [models[m]["state"] for m in ("tring_a", "tring_b")] == ["UNAVAILABLE"] * 2, models
        reasons = [models[m]["reason"] for m in ("tring_a", "tring_b")]
        cycle = re.compile(r"\((tring_\w) \(worker \d+, warming up\) -> (tring_\w) \(worker \d+, warming up\) -> \1 ")
        assert all("warmup 'default1' failed" in r and cycle.search(r) for r in reasons), reasons
        assert "timed out" not in " ".join(reasons).lower(), reasons  # refused, not waited out
        c = pool.client()
        x = np.ones((1, WIDTH), np.float32)
        np.testing.assert_array_equal(c.infer("twaiter", {"INPUT": x})["OUTPUT"], x)
        zeros = np.zeros((2, WIDTH), np.float32)  # twaiter's BLS path, now to a READY tslow
        np.testing.assert_array_equal(c.infer("twaiter", {"INPUT": zeros})["OUTPUT"], zeros)
        with pytest.raises(errors.ModelNotReady, match="tring_a"):
            c.infer("tring_a", {"INPUT": x})
