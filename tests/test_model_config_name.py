"""Triton's --model-config-name: a model's configs/NAME.pbtxt where it has one, else its config.pbtxt."""

import json
import os
import shutil
import urllib.request

import pytest

from gepool import Pool
from gepool.common.repository import CONFIG_NAME, Reading, model_config
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
    os.mkdir(f"{folder}/configs/v100.pbtxt")  # a folder of that name is not a config
    assert model_config(folder, "tiny", Reading(config_name="v100")).max_batch_size == 4


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
