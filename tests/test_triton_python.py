"""Triton python-backend models (TritonPythonModel + triton_python_backend_utils) served unchanged, through
gepool.Client and through the HTTP sidecar with tritonclient.http; an error response fails its request alone."""

import concurrent.futures
import json

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.common.config import parse_config
from gepool.workers.backends import create_backend
from tests import repo as test_repo
from tests.conftest import free_port

# Triton's python_backend examples/add_sub (model.py and config.pbtxt), statement for statement; its long
# explanatory comments and docstrings are left out.
ADD_SUB_PY = '''
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])

        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")

        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")

        self.output0_dtype = pb_utils.triton_string_to_numpy(
            output0_config["data_type"]
        )
        self.output1_dtype = pb_utils.triton_string_to_numpy(
            output1_config["data_type"]
        )

    def execute(self, requests):
        output0_dtype = self.output0_dtype
        output1_dtype = self.output1_dtype

        responses = []

        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")

            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )

            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(output1_dtype))

            inference_response = pb_utils.InferenceResponse(
                output_tensors=[out_tensor_0, out_tensor_1]
            )
            responses.append(inference_response)

        return responses

    def finalize(self):
        print("Cleaning up...")
'''

ADD_SUB_CONFIG = '''
name: "add_sub"
backend: "python"

input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
input [
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]

instance_group [{ kind: KIND_CPU }]
'''

# A batched model in the README's error-handling style: a request whose INPUT0 starts negative gets an
# error response; the others get INPUT0 + 1, and NREQ = how many requests their execute() call held.
PICKY_PY = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils

CODED = {-10.0: "UNKNOWN", -11.0: "INTERNAL", -12.0: "NOT_FOUND", -13.0: "INVALID_ARG", -14.0: "UNAVAILABLE",
         -15.0: "UNSUPPORTED", -16.0: "ALREADY_EXISTS", -17.0: "CANCELLED"}


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        self.model_config = json.loads(args["model_config"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if x[0, 0] in CODED:  # an error with its code, as python_backend's TritonError(message, code)
                name = CODED[x[0, 0]]
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("coded " + name, getattr(pb_utils.TritonError, name))))
                continue
            if x[0, 0] < 0:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative input " + str(float(x[0, 0])) + " refused")))
                continue
            outputs = [pb_utils.Tensor("OUTPUT0", x + 1),
                       pb_utils.Tensor("NREQ", np.full((x.shape[0], 1), len(requests), np.int32))]
            if "ARGS" in request.requested_output_names():
                text = json.dumps({k: v for k, v in self.args.items() if k != "model_config"})
                outputs.append(pb_utils.Tensor("ARGS", np.array([[text.encode()]] * x.shape[0], dtype=np.object_)))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
'''

PICKY_CONFIG = '''
name: "picky"
backend: "python"
max_batch_size: 16
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "NREQ" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 6 ] max_queue_delay_microseconds: 5000000 }
'''

# execute() raising fails the whole batch (warm-up's zeros pass)
BROKEN_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT0") for r in requests]
        if any((x.as_numpy() > 0).any() for x in xs):
            raise pb_utils.TritonModelException("the whole batch is lost")
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", x.as_numpy())]) for x in xs]
'''

BLS_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "INPUT0")
        if (x.as_numpy() > 0).any():
            call = pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["OUTPUT0"], inputs=[x])
            call.exec(decoupled=True)
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", x.as_numpy())])
                for _ in requests]
'''

AUTO_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [2]})
        auto_complete_model_config.set_max_batch_size(MAX_BATCH)
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
'''


def _one_model(repo: str, name: str, py: str, config: str) -> None:
    test_repo.write(f"{repo}/{name}/1/model.py", py)
    test_repo.write(f"{repo}/{name}/config.pbtxt", config)


def _simple_config(name: str, max_batch: int = 16, extra: str = "") -> str:
    return f'''
        name: "{name}"
        backend: "python"
        max_batch_size: {max_batch}
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        {extra}
    '''


@pytest.fixture(scope="module")
def triton_pool(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("triton-python"))
    _one_model(repo, "add_sub", ADD_SUB_PY, ADD_SUB_CONFIG)
    _one_model(repo, "picky", PICKY_PY, PICKY_CONFIG)
    _one_model(repo, "broken", BROKEN_PY, _simple_config("broken", extra="dynamic_batching { }"))
    _one_model(repo, "bls", BLS_PY, _simple_config("bls"))
    _one_model(repo, "auto_same", AUTO_PY.replace("MAX_BATCH", "16"), _simple_config("auto_same"))
    _one_model(repo, "auto_changes", AUTO_PY.replace("MAX_BATCH", "32"), _simple_config("auto_changes"))
    with Pool(repo, http_port=free_port(), grpc_port=free_port()) as pool:
        pool.repo = repo
        yield pool


def test_add_sub_from_tritons_readme_serves_unchanged(triton_pool):
    c = triton_pool.client()
    assert c.status()["models"]["add_sub"]["state"] == "READY"
    rng = np.random.default_rng(3)
    for _ in range(5):
        a, b = rng.random(4, dtype=np.float32), rng.random(4, dtype=np.float32)
        out = c.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)
        assert out["OUTPUT0"].dtype == np.float32 and out["OUTPUT0"].shape == (4,)


def test_add_sub_through_tritonclient_http(triton_pool):
    httpclient = pytest.importorskip("tritonclient.http")
    a = np.array([1, 2, 3, 4], np.float32)
    b = np.array([0.5, 0.25, 2, -1], np.float32)
    with httpclient.InferenceServerClient(f"127.0.0.1:{triton_pool.http_port}") as triton:
        inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
        result = triton.infer("add_sub", inputs, outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_an_error_response_fails_its_request_alone_in_a_shared_batch(triton_pool):
    c = triton_pool.client()
    xs = [np.array([[float(i), 10.0 + i]], np.float32) for i in range(6)]
    xs[1][0, 0] = xs[4][0, 0] = -3.0
    # six requests make one preferred batch of six: one execute() call, two of its responses errors
    futures = [c.infer_async("picky", {"INPUT0": x}, outputs=["OUTPUT0", "NREQ"]) for x in xs]
    for i, (x, fut) in enumerate(zip(xs, futures, strict=True)):
        if i in (1, 4):
            with pytest.raises(errors.ModelError, match=r"negative input -3\.0 refused"):
                fut.result(timeout=60)
            continue
        out = fut.result(timeout=60)
        np.testing.assert_array_equal(out["OUTPUT0"], x + 1)
        assert out["NREQ"].tolist() == [[6]]  # it ran in the batch beside the failed ones
        assert set(out) == {"OUTPUT0", "NREQ"}


def test_an_error_response_reaches_tritonclient_as_its_message(triton_pool):
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    x = np.arange(6, dtype=np.float32).reshape(3, 2)

    def call(data: np.ndarray):
        with httpclient.InferenceServerClient(f"127.0.0.1:{triton_pool.http_port}") as triton:
            inp = httpclient.InferInput("INPUT0", [3, 2], "FP32")
            inp.set_data_from_numpy(data)
            try:
                return triton.infer("picky", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
            except InferenceServerException as exc:
                return exc

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(call, [x, -x - 1, x, x, x, x]))
    assert isinstance(answers[1], InferenceServerException)
    assert "negative input -1.0 refused" in str(answers[1])
    for result in answers[:1] + answers[2:]:
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + 1)


# TritonError's code -> (gepool's error class, HTTP status, gRPC status) as Triton answers them (its http_server.cc
# HttpCodeFromError, grpc_utils.cc)
CODED = {-10.0: ("Unknown", 400, "UNKNOWN"), -11.0: ("ModelError", 500, "INTERNAL"),
         -12.0: ("NotFound", 404, "NOT_FOUND"), -13.0: ("InvalidArgument", 400, "INVALID_ARGUMENT"),
         -14.0: ("Unavailable", 503, "UNAVAILABLE"), -15.0: ("Unsupported", 501, "UNIMPLEMENTED"),
         -16.0: ("AlreadyExists", 400, "ALREADY_EXISTS"), -17.0: ("Cancelled", 400, "CANCELLED")}


def test_an_error_responses_code_is_the_status_it_is_answered_with(triton_pool):
    httpclient = pytest.importorskip("tritonclient.http")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    def over(client, url: str):
        def call(value: float) -> InferenceServerException:
            with client.InferenceServerClient(url) as triton:
                inp = client.InferInput("INPUT0", [1, 2], "FP32")
                inp.set_data_from_numpy(np.array([[value, 1.0]], np.float32))
                with pytest.raises(InferenceServerException) as answered:
                    triton.infer("picky", [inp])
            return answered.value
        return call

    c = triton_pool.client()
    before = c.stats()["picky"]["failures"]
    # every call at once: batches of the preferred six go without the model's 5 s delay
    library = {v: c.infer_async("picky", {"INPUT0": np.array([[v, 1.0]], np.float32)}) for v in CODED}
    with concurrent.futures.ThreadPoolExecutor(2 * len(CODED)) as pool:
        by_http = {v: pool.submit(over(httpclient, f"127.0.0.1:{triton_pool.http_port}"), v) for v in CODED}
        by_grpc = {v: pool.submit(over(grpcclient, f"127.0.0.1:{triton_pool.grpc_port}"), v) for v in CODED}
        http = {v: f.result(timeout=60) for v, f in by_http.items()}
        grpc = {v: f.result(timeout=60) for v, f in by_grpc.items()}
    for value, (name, http_status, grpc_status) in CODED.items():
        with pytest.raises(errors.GepoolError) as refused:
            library[value].result(timeout=60)
        assert type(refused.value) is getattr(errors, name) and "coded " in refused.value.message
        assert http[value].status() == str(http_status) and "coded " in http[value].message(), (name, http[value])
        assert grpc[value].status() == f"StatusCode.{grpc_status}", (name, grpc[value])
    assert c.stats()["picky"]["failures"] == before + 3 * len(CODED)  # each the model's failure, whatever its code


def test_args_and_requested_outputs_follow_triton(triton_pool):
    c = triton_pool.client()
    out = c.infer("picky", {"INPUT0": np.zeros((2, 2), np.float32)}, outputs=["ARGS"])
    assert set(out) == {"ARGS"}
    args = json.loads(out["ARGS"][0, 0])
    assert args["model_name"] == "picky" and args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU" and args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] == "picky_0_0"
    assert args["model_repository"] == f"{triton_pool.repo}/picky"


def test_an_exception_from_execute_fails_the_whole_batch(triton_pool):
    c = triton_pool.client()
    futures = [c.infer_async("broken", {"INPUT0": np.ones((1, 2), np.float32)}) for _ in range(3)]
    for fut in futures:
        with pytest.raises(errors.ModelError, match="the whole batch is lost"):
            fut.result(timeout=60)


def test_decoupled_bls_says_it_is_not_supported_yet(triton_pool):
    with pytest.raises(errors.ModelError, match=r"decoupled BLS \(InferenceRequest.exec\(decoupled=True\)\) is not "
                                                "supported by gepool yet"):
        triton_pool.client().infer("bls", {"INPUT0": np.ones((1, 2), np.float32)})


def test_auto_complete_config_that_changes_nothing_loads_and_one_that_changes_it_is_refused(triton_pool):
    c = triton_pool.client()
    models = c.status()["models"]
    assert models["auto_same"]["state"] == "READY"
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(c.infer("auto_same", {"INPUT0": x})["OUTPUT0"], x)
    assert models["auto_changes"]["state"] == "UNAVAILABLE"
    assert "auto_complete_config of model 'auto_changes' changes max_batch_size" in models["auto_changes"]["reason"]


def test_a_triton_model_warms_up_and_runs_in_process(tmp_path):
    _one_model(str(tmp_path), "picky", PICKY_PY, PICKY_CONFIG)
    config = parse_config(str(tmp_path / "picky" / "config.pbtxt"), "picky")
    backend = create_backend(config, str(tmp_path / "picky" / "1"), "cpu", 1)
    try:
        assert type(backend).per_request and backend.warmup() == 2  # preferred batch of 6, twice
        with pytest.raises(RuntimeError, match="negative input"):
            backend.execute({"INPUT0": -np.ones((2, 2), np.float32)}, {t.name: None for t in config.outputs})
    finally:
        backend.close()


def test_finalize_runs_when_the_instance_closes(tmp_path, capsys):
    _one_model(str(tmp_path), "add_sub", ADD_SUB_PY, ADD_SUB_CONFIG)
    config = parse_config(str(tmp_path / "add_sub" / "config.pbtxt"), "add_sub")
    backend = create_backend(config, str(tmp_path / "add_sub" / "1"), "cpu", 1)
    assert backend.warmup() == 2
    assert "Cleaning up..." not in capsys.readouterr().out
    backend.close()
    assert "Cleaning up..." in capsys.readouterr().out
