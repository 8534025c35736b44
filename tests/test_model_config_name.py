"""Triton's --model-config-name: a model's configs/NAME.pbtxt where it has one, else its config.pbtxt."""

import json
import os
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest

from gepool import Pool
from gepool.common.errors import ConfigError
from gepool.common.repository import CONFIG_NAME, Reading, model_config, signature
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

TINY = """
    name: "tiny"
    platform: "onnxruntime_onnx"
    max_batch_size: {batch}
    input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
    output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
    instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def custom(repo: str, config_name: str, batch: int) -> None:
    os.makedirs(f"{repo}/tiny/configs", exist_ok=True)
    with open(f"{repo}/tiny/configs/{config_name}.pbtxt", "w") as f:
        f.write(TINY.format(batch=batch))


def test_the_named_custom_config_is_read_and_config_pbtxt_where_there_is_none(tmp_path):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo, max_batch=8)
    custom(repo, "h100", 2)
    custom(repo, "config", 3)
    folder = f"{repo}/tiny"
    assert model_config(folder, "tiny", Reading(config_name="h100")).max_batch_size == 2  # Triton's example 1
    assert model_config(folder, "tiny", Reading(config_name="config")).max_batch_size == 3  # example 2
    assert model_config(folder, "tiny", Reading(config_name="a100")).max_batch_size == 8  # none: config.pbtxt
    assert model_config(folder, "tiny").max_batch_size == 8  # example 3: no name given
    assert Reading(config_name="h100").config_path(folder) == f"{folder}/configs/h100.pbtxt"
    os.remove(f"{folder}/{CONFIG_NAME}")  # no config.pbtxt and no custom one: completed from the model file
    completed = model_config(folder, "tiny", Reading(config_name="a100", default_max_batch=5))
    assert completed.max_batch_size == 5
    os.mkdir(f"{folder}/configs/v100.pbtxt")  # there, but not a file: the model fails, as in Triton (not a fallback)
    with pytest.raises(ConfigError, match="v100.pbtxt.*is not a regular file"):
        model_config(folder, "tiny", Reading(config_name="v100"))
    os.symlink(f"{folder}/configs/nowhere", f"{folder}/configs/p4.pbtxt")  # dangling: not there (Triton's access())
    assert model_config(folder, "tiny", Reading(config_name="p4")).max_batch_size == 4


def test_a_poll_sees_a_custom_config_added_to_a_symlinked_configs_folder(tmp_path):
    repo = str(tmp_path / "models")
    test_repo.make_models.make_tiny(repo)
    shared = tmp_path / "shared-configs"
    shared.mkdir()
    os.symlink(shared, f"{repo}/tiny/configs")
    before = signature(repo, "tiny")
    (shared / "ascend.pbtxt").write_text(TINY.format(batch=2))
    assert signature(repo, "tiny") != before
    assert model_config(f"{repo}/tiny", "tiny", Reading(config_name="ascend")).max_batch_size == 2


@pytest.mark.parametrize("name", ["h 100", "../x", "a/b", ".hidden", "h100\n"])
def test_a_model_config_name_that_is_not_a_plain_file_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="model_config_name must be a file name without spaces"):
        Pool(str(tmp_path), model_config_name=name)


def test_a_poll_pool_follows_the_custom_config_as_it_comes_and_goes(tmp_path):
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo, max_batch=8)
    port = free_port()

    def served_batch() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/tiny/config", timeout=30) as answer:
            return json.loads(answer.read())["max_batch_size"]

    with Pool(repo, http_port=port, model_config_name="ascend", model_control_mode="poll", poll_secs=0.3):
        assert served_batch() == 8  # no configs/ascend.pbtxt yet: config.pbtxt
        custom(repo, "ascend", 2)  # Triton: custom configs may be added and removed while it runs
        assert wait_until(lambda: served_batch() == 2, 60)
        shutil.rmtree(f"{repo}/tiny/configs")
        assert wait_until(lambda: served_batch() == 8, 60)


def test_the_http_body_limit_fits_the_batches_the_configs_were_read_with(tmp_path):
    """The sidecar's default body limit is sized from the configs as the front reads them: a custom config's
    max_batch_size and --backend-config's default-max-batch-size (4 rows would allow about 1 MiB)."""
    httpclient = pytest.importorskip("tritonclient.http")
    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)
    custom(repo, "big", 40000)
    test_repo.make_models.make_tiny(repo, "auto")
    os.remove(f"{repo}/auto/{CONFIG_NAME}")  # completed from the file: max_batch_size is default-max-batch-size
    x = np.ones((40000, 16), np.float32)  # 2.56 MB of binary tensor data
    with Pool(repo, http_port=free_port(), model_config_name="big",
              backend_config=("onnxruntime,default-max-batch-size=40000",)) as pool:
        triton = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}", network_timeout=120)
        try:
            for model, name in (("tiny", "INPUT0"), ("auto", "INPUT0")):
                inp = httpclient.InferInput(name, list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=True)
                out = triton.infer(model, [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
                np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), np.full((40000, 16), 3.0, np.float32))
        finally:
            triton.close()


def test_a_load_request_with_any_parameter_but_unload_dependents_false_is_refused(tmp_path):
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    repo = str(tmp_path)
    test_repo.make_models.make_tiny(repo)
    with Pool(repo, http_port=free_port(), model_control_mode="explicit") as pool:
        for params, words in (({"config": ""}, "'config' or 'file:' override is not supported"),
                              ({"config": {}}, "'config' or 'file:' override is not supported"),
                              ({"bogus": "x"}, "unrecognized load parameter(s) ['bogus']"),
                              ({"unload_dependents": True}, "unload_dependents is not supported")):
            body = json.dumps({"parameters": params}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{pool.http_port}/v2/repository/models/tiny/load",
                                         data=body, method="POST")
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=30)
            assert info.value.code == 400 and words in info.value.read().decode(), params
        assert "tiny" not in pool.status["models"] or pool.status["models"]["tiny"]["state"] != "READY"
        triton = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
        try:
            triton.load_model("tiny")
            triton.unload_model("tiny")  # tritonclient sends unload_dependents false: taken
            with pytest.raises(InferenceServerException, match="unload_dependents is not supported"):
                triton.unload_model("tiny", unload_dependents=True)
        finally:
            triton.close()
