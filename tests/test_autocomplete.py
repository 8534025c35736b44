"""Config auto-complete from ONNX files as Triton does it, checked against what the `onnx` package reads."""

import os
import textwrap

import numpy as np
import pytest

from gepool import Pool
from gepool.common.autocomplete import DEFAULT_MAX_BATCH_SIZE
from gepool.common.errors import ConfigError
from gepool.common.render import render
from gepool.common.repository import Reading, load_source, load_sources, model_config
from tests.conftest import free_port

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

TRITON_TYPES = {TensorProto.FLOAT: "TYPE_FP32", TensorProto.INT64: "TYPE_INT64", TensorProto.FLOAT16: "TYPE_FP16",
                TensorProto.INT32: "TYPE_INT32", TensorProto.BOOL: "TYPE_BOOL"}


def save(path: str, inputs, outputs, nodes, initializers=(), ir_version: int = 8) -> str:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = ir_version
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(model, path)
    return path


def batching_model(repo, name="m", version=1):
    """Two inputs of different types and two outputs, every first dim symbolic; a weight initializer."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    return save(f"{repo}/{name}/{version}/model.onnx",
                [("x", TensorProto.FLOAT, ["batch", 4]), ("ids", TensorProto.INT64, ["batch", "seq"])],
                [("y", TensorProto.FLOAT, ["batch", 3]), ("ids_out", TensorProto.INT64, ["batch", "seq"])],
                [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Identity", ["ids"], ["ids_out"])],
                [w])


def fixed_model(repo, name="f"):
    return save(f"{repo}/{name}/1/model.onnx", [("x", TensorProto.FLOAT, [2, 5])], [("y", TensorProto.FLOAT, [2, 5])],
                [helper.make_node("Relu", ["x"], ["y"])])


def config(repo, name, text):
    with open(f"{repo}/{name}/config.pbtxt", "w") as f:
        f.write(textwrap.dedent(text))


def what_onnx_says(path: str, batch: bool) -> dict:
    """Inputs and outputs as the onnx package reads them, in config form (initializers left out)."""
    graph = onnx.load(path).graph
    inits = {t.name for t in graph.initializer}

    def rows(items):
        out = []
        for v in items:
            if v.name in inits:
                continue
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
            out.append({"name": v.name, "data_type": TRITON_TYPES[v.type.tensor_type.elem_type],
                        "dims": dims[1:] if batch else dims})
        return out

    return {"input": rows(graph.input), "output": rows(graph.output)}


def io(rendered: dict) -> dict:
    return {k: [{f: t[f] for f in ("name", "data_type", "dims")} for t in rendered[k]] for k in ("input", "output")}


def test_a_folder_with_only_model_onnx_is_completed_from_the_file(tmp_path):
    path = batching_model(tmp_path)
    cfg = model_config(str(tmp_path / "m"), "m")
    out = render(cfg)
    assert io(out) == what_onnx_says(path, batch=True)
    assert out["max_batch_size"] == DEFAULT_MAX_BATCH_SIZE == 4  # Triton's default-max-batch-size
    assert out["dynamic_batching"]["preferred_batch_size"] == [4]  # added, then normalised as Triton does
    assert (out["platform"], out["backend"], out["default_model_filename"]) == ("onnxruntime_onnx", "onnxruntime",
                                                                                "model.onnx")
    assert cfg.source == str(tmp_path / "m")  # errors name the folder: there is no config.pbtxt


def test_a_model_that_cannot_batch_gets_max_batch_size_0_and_full_dims(tmp_path):
    path = fixed_model(tmp_path)
    out = render(model_config(str(tmp_path / "f"), "f"))
    assert io(out) == what_onnx_says(path, batch=False) and out["input"][0]["dims"] == [2, 5]
    assert out["max_batch_size"] == 0 and "dynamic_batching" not in out


def test_a_partial_config_keeps_what_it_says_and_gets_the_rest(tmp_path):
    path = batching_model(tmp_path)
    config(tmp_path, "m", """
        max_batch_size: 16
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] },
                { name: "ids" data_type: TYPE_INT64 dims: [ 7 ] } ]
        instance_group [ { count: 2 kind: KIND_CPU } ]
    """)
    out = render(model_config(str(tmp_path / "m"), "m"))
    assert out["max_batch_size"] == 16 and "dynamic_batching" in out
    assert out["input"][1]["dims"] == [7]  # as written: the model's -1 takes any size
    assert io(out)["output"] == what_onnx_says(path, batch=True)["output"]
    assert out["instance_group"][0]["count"] == 2


def test_max_batch_size_1_gets_no_dynamic_batching(tmp_path):
    batching_model(tmp_path)
    config(tmp_path, "m", "max_batch_size: 1\n")
    cfg = model_config(str(tmp_path / "m"), "m")
    assert cfg.max_batch_size == 1 and cfg.dynamic_batching is None


def test_batching_asked_of_a_model_that_cannot_is_refused(tmp_path):
    fixed_model(tmp_path)
    config(tmp_path, "f", "max_batch_size: 8\n")
    with pytest.raises(ConfigError, match="does not support batching") as info:
        model_config(str(tmp_path / "f"), "f")
    assert info.value.field == "max_batch_size"


FULL = """
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    input { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }
    input { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] }
    output { name: "y" data_type: TYPE_FP32 dims: [ 3 ] }
"""


@pytest.mark.parametrize("old, new, words", [
    ('name: "x" data_type: TYPE_FP32', 'name: "x" data_type: TYPE_FP16', "input 'x': the configuration expects "
                                                                          "TYPE_FP16, m/1/model.onnx provides "
                                                                          "tensor(FP32)"),
    ("dims: [ 4 ]", "dims: [ 5 ]", "input 'x': the configuration declares dims [5]"),
    ("dims: [ 3 ]", "dims: [ -1 ]", "output 'y': the configuration declares dims [-1]"),  # outputs compare exactly
    ('name: "y"', 'name: "z"', "output 'z' is not in"),
    ('name: "ids"', 'name: "idx"', "input 'idx' is not in"),
    ('input { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] }', "", "expects 1 inputs"),
    ("max_batch_size: 8", "max_batch_size: 0", "input 'x': the configuration declares dims [4]"),
])
def test_a_config_the_model_file_contradicts_is_refused_naming_the_tensor(tmp_path, old, new, words):
    batching_model(tmp_path)
    assert old in FULL
    config(tmp_path, "m", FULL.replace(old, new))
    source = load_source(str(tmp_path), "m")
    assert source.config is None and words in source.error.replace(str(tmp_path) + "/", ""), source.error
    # the check does not depend on auto-complete: a complete config is checked all the same
    assert words in load_source(str(tmp_path), "m", Reading(auto_complete=False)).error.replace(str(tmp_path) + "/", "")


def test_the_matching_full_config_loads_unchanged(tmp_path):
    batching_model(tmp_path)
    config(tmp_path, "m", FULL)
    cfg = model_config(str(tmp_path / "m"), "m")
    assert [t.name for t in cfg.outputs] == ["y"]  # a subset of the outputs is allowed, as in Triton
    assert cfg.max_batch_size == 8 and cfg.dynamic_batching is None  # complete: nothing added


def test_every_served_version_is_checked_against_the_one_config(tmp_path):
    batching_model(tmp_path, version=2)
    fixed_model(tmp_path, name="m")  # version 1 of m: another signature
    config(tmp_path, "m", 'version_policy { all { } }\n')
    by_version = {s.version: s for s in load_sources(str(tmp_path), "m")}
    assert by_version[2].error is None and by_version[2].config.max_batch_size == 4
    assert "expects 2 inputs" in by_version[1].error and "m/1/model.onnx" in by_version[1].error


def test_initializers_listed_as_graph_inputs_are_not_inputs(tmp_path):
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    save(f"{tmp_path}/m/1/model.onnx", [("x", TensorProto.FLOAT, ["n", 4]), ("W", TensorProto.FLOAT, [4, 3])],
         [("y", TensorProto.FLOAT, ["n", 3])], [helper.make_node("MatMul", ["x", "W"], ["y"])], [w], ir_version=3)
    cfg = model_config(str(tmp_path / "m"), "m")
    assert [t.name for t in cfg.inputs] == ["x"] and cfg.max_batch_size == 4


def test_a_batch_only_tensor_needs_reshape_and_is_refused_clearly(tmp_path):
    save(f"{tmp_path}/m/1/model.onnx", [("x", TensorProto.FLOAT, ["n"])], [("y", TensorProto.FLOAT, ["n"])],
         [helper.make_node("Relu", ["x"], ["y"])])
    with pytest.raises(ConfigError, match="tensor 'x' has only the batch dimension"):
        model_config(str(tmp_path / "m"), "m")


def test_with_auto_complete_disabled_a_missing_or_partial_config_is_an_error(tmp_path):
    batching_model(tmp_path)
    assert "auto-complete is disabled" in load_source(str(tmp_path), "m", Reading(auto_complete=False)).error
    config(tmp_path, "m", 'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n')
    assert "at least one input" in load_source(str(tmp_path), "m", Reading(auto_complete=False)).error
    assert load_source(str(tmp_path), "m").error is None


def test_python_and_onnx_backends_are_told_by_their_file(tmp_path):
    batching_model(tmp_path)
    os.makedirs(tmp_path / "p" / "1")
    (tmp_path / "p" / "1" / "model.py").write_text("class Model:\n    pass\n")
    config(tmp_path, "p", 'input [ { name: "a" data_type: TYPE_FP32 dims: [1] } ]\n'
                          'output [ { name: "b" data_type: TYPE_FP32 dims: [1] } ]\n')
    assert model_config(str(tmp_path / "p"), "p").backend == "python"
    assert model_config(str(tmp_path / "m"), "m").backend == "onnxruntime"
    os.makedirs(tmp_path / "empty" / "1")
    with pytest.raises(ConfigError, match="no config.pbtxt, and its first version folder holds no model.onnx"):
        model_config(str(tmp_path / "empty"), "empty")


# -- through a real pool: the completed config is what is served and what GET .../config shows -----------

@pytest.fixture(scope="module")
def completed_pool(tmp_path_factory):
    repo = tmp_path_factory.mktemp("autocomplete")
    batching_model(repo, "auto")
    save(f"{repo}/partial/1/model.onnx", [("x", TensorProto.FLOAT, ["n", 4])], [("y", TensorProto.FLOAT, ["n", 4])],
         [helper.make_node("Relu", ["x"], ["y"])])
    config(repo, "partial", "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 100 }\n")
    with Pool(str(repo), http_port=free_port()) as pool:
        pool.repo = str(repo)
        yield pool


def test_the_pool_serves_and_shows_the_completed_config(completed_pool):
    httpclient = pytest.importorskip("tritonclient.http")
    import json
    import urllib.request

    pool = completed_pool
    assert pool.status["models"]["auto"]["state"] == "READY", pool.status["models"]["auto"]
    triton = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
    try:
        cfg = triton.get_model_config("auto")
        assert io(cfg) == what_onnx_says(f"{pool.repo}/auto/1/model.onnx", batch=True)
        assert cfg["max_batch_size"] == 4 and cfg["platform"] == "onnxruntime_onnx"
        with urllib.request.urlopen(f"http://127.0.0.1:{pool.http_port}/v2/models/auto/config") as r:
            assert json.loads(r.read()) == cfg
        partial = triton.get_model_config("partial")
        assert partial["max_batch_size"] == 8 and partial["input"] == [dict(partial["input"][0], dims=[4])]
        assert partial["dynamic_batching"]["max_queue_delay_microseconds"] == 100
        x = np.arange(12, dtype=np.float32).reshape(3, 4) - 6
        inp = httpclient.InferInput("x", [3, 4], "FP32")
        inp.set_data_from_numpy(x)
        result = triton.infer("partial", [inp])
        np.testing.assert_array_equal(result.as_numpy("y"), np.maximum(x, 0))
    finally:
        triton.close()


def test_a_pool_with_auto_complete_disabled_refuses_the_config_less_model(tmp_path):
    batching_model(tmp_path, "auto")
    fixed_model(tmp_path, "full")
    config(tmp_path, "full", 'platform: "onnxruntime_onnx"\n'
                             'input [ { name: "x" data_type: TYPE_FP32 dims: [2, 5] } ]\n'
                             'output [ { name: "y" data_type: TYPE_FP32 dims: [2, 5] } ]\n')
    with Pool(str(tmp_path), auto_complete_config=False) as pool:
        models = pool.status["models"]
        assert models["full"]["state"] == "READY"
        assert models["auto"]["state"] != "READY" and "auto-complete is disabled" in models["auto"]["reason"]


# -- Triton's --backend-config default-max-batch-size ---------------------------------------------------

def test_default_max_batch_size_is_what_a_batchable_model_gets_and_0_serves_it_unbatched(tmp_path):
    path = batching_model(tmp_path)
    eight = render(model_config(str(tmp_path / "m"), "m", Reading(default_max_batch=8)))
    assert eight["max_batch_size"] == 8 and eight["dynamic_batching"]["preferred_batch_size"] == [8]
    assert io(eight) == what_onnx_says(path, batch=True)
    none = render(model_config(str(tmp_path / "m"), "m", Reading(default_max_batch=0)))  # Triton's L0_backend_config
    assert none["max_batch_size"] == 0 and "dynamic_batching" not in none
    assert io(none) == what_onnx_says(path, batch=False)  # the batch dim stays in dims, as -1
    fixed_model(tmp_path)
    assert render(model_config(str(tmp_path / "f"), "f", Reading(default_max_batch=8)))["max_batch_size"] == 0
    config(tmp_path, "m", "max_batch_size: 16\n")  # a config that says it keeps it
    assert model_config(str(tmp_path / "m"), "m", Reading(default_max_batch=8)).max_batch_size == 16


@pytest.mark.parametrize("groups, expected", [
    ((), 4),
    (("default-max-batch-size=6",), 6),
    (("onnxruntime,default-max-batch-size=5",), 5),
    (("default-max-batch-size=7", "onnxruntime,default-max-batch-size=8"), 8),  # the backend's own group wins
    (("onnxruntime,default-max-batch-size=8", "default-max-batch-size=7"), 8),  # in either order
    (("default-max-batch-size=7", "default-max-batch-size=3"), 3),  # the last of a repeated group
    (("onnxruntime,default-max-batch-size=0",), 0),
])
def test_backend_config_groups_decide_the_default_max_batch_size(tmp_path, groups, expected):
    assert Pool(str(tmp_path), backend_config=groups).options.reading().default_max_batch == expected


@pytest.mark.parametrize("group, words", [
    (",default-max-batch-size=3", "No backend specified. --backend-config option format is"),  # tritonserver's
    ("default-max-batch-size=", "--backend-config option format is '<backend name>,<setting>=<value>'. Got "),
    ("default-max-batch-size", "--backend-config option format is"),
    ("onnxruntime,default-max-batch-size=", "--backend-config option format is"),
    ("onnxruntime,default-max-batch-size", "--backend-config option format is"),
    ("python,shm-default-byte-size=16777216", "gepool has no setting 'shm-default-byte-size' for backend 'python'"),
    ("tensorflow,default-max-batch-size=5", "no setting 'default-max-batch-size' for backend 'tensorflow'"),
    ("version=2", "no setting 'version' for every backend"),
    ("default-max-batch-size=-1", "default-max-batch-size must be an integer from 0 to 2147483647, not '-1'"),
    ("default-max-batch-size=4x", "must be an integer from 0 to 2147483647, not '4x'"),
    ("default-max-batch-size=\u0664", "must be an integer from 0"),  # an Arabic-Indic four: a digit, not ASCII
    ("default-max-batch-size=2147483648", "not '2147483648'"),  # past max_batch_size's int32
])
def test_a_backend_config_group_gepool_cannot_honour_is_refused_naming_it(tmp_path, group, words):
    with pytest.raises(ValueError, match=None) as raised:
        Pool(str(tmp_path), backend_config=[group])
    assert words in str(raised.value), str(raised.value)


def test_a_pool_serves_the_default_max_batch_size_it_was_given(tmp_path):
    httpclient = pytest.importorskip("tritonclient.http")
    batching_model(tmp_path, "auto")
    with Pool(str(tmp_path), http_port=free_port(),
              backend_config=("default-max-batch-size=2", "onnxruntime,default-max-batch-size=64")) as pool:
        triton = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
        try:
            cfg = triton.get_model_config("auto")
            assert cfg["max_batch_size"] == 64 and cfg["dynamic_batching"]["preferred_batch_size"] == [64]
            x = np.ones((64, 4), np.float32)  # a batch of 64 rows is in bounds (4 would be the default)
            ids = np.arange(64 * 3, dtype=np.int64).reshape(64, 3)
            inputs = [httpclient.InferInput("x", [64, 4], "FP32"), httpclient.InferInput("ids", [64, 3], "INT64")]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(ids)
            result = triton.infer("auto", inputs)
            np.testing.assert_array_equal(result.as_numpy("y"), np.full((64, 3), 4.0, np.float32))
            np.testing.assert_array_equal(result.as_numpy("ids_out"), ids)
        finally:
            triton.close()
