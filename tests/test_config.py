"""config.pbtxt parsing: Triton's field names, Ascend fields, and errors that name file, line and field."""

import os
import textwrap
import threading

import pytest

from gepool.common.config import parse_config, parse_size
from gepool.common.errors import ConfigError
from gepool.common.repository import scan

ASCEND = """
backend: "ge"
max_batch_size: 16
input [ { name: "input" data_type: TYPE_FP32 dims: [3, 224, 224] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [1000] } ]
instance_group [ { count: 2 kind: KIND_ASCEND ascend_devices: [0, 1] } ]
dynamic_batching { preferred_batch_size: [4, 8] max_queue_delay_microseconds: 1000 }
"""


def write(tmp_path, text, name="m"):
    path = tmp_path / "config.pbtxt"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_ascend_config_parses_as_written(tmp_path):
    cfg = parse_config(write(tmp_path, ASCEND), "m")
    assert cfg.backend == "ge"
    assert cfg.max_batch_size == 16
    assert cfg.inputs[0].dims == (3, 224, 224) and cfg.inputs[0].datatype == "FP32"
    assert cfg.instance_groups[0].kind == "KIND_ASCEND"
    assert cfg.instance_groups[0].devices == (0, 1)
    assert cfg.instance_count == 4  # count applies to each listed device
    assert cfg.dynamic_batching.preferred_batch_size == (4, 8)
    assert cfg.dynamic_batching.max_queue_delay_us == 1000
    assert cfg.model_filename == "model.om"


def test_load_balance_policy_and_repeated_blocks(tmp_path):
    cfg = parse_config(write(tmp_path, """
        backend: "ge"
        max_batch_size: 4
        input { name: "a" data_type: TYPE_INT64 dims: [-1] }
        input { name: "b" data_type: TYPE_FP16 dims: [2, 2] }
        output { name: "c" data_type: TYPE_FP32 dims: [1] }
        instance_group [ { count: 4 kind: KIND_ASCEND ascend_devices: [0,1,2,3] policy: load_balance } ]
        parameters { key: "stream_num" value: { string_value: "4" } }
        version_policy { latest { num_versions: 2 } }
    """), "m")
    assert [t.name for t in cfg.inputs] == ["a", "b"]
    assert not cfg.inputs[0].fixed and cfg.inputs[1].row_bytes() == 8
    assert cfg.instance_groups[0].policy == "load_balance"
    assert cfg.parameters == {"stream_num": "4"}
    assert cfg.stream_num == 4
    assert cfg.version_policy.select([1, 3, 2]) == [3, 2]
    assert cfg.dynamic_batching is None


def test_empty_dynamic_batching_prefers_max_batch_size(tmp_path):
    cfg = parse_config(write(tmp_path, """
        backend: "python"
        max_batch_size: 6
        input [ { name: "x" data_type: TYPE_FP32 dims: [1] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [1] } ]
        dynamic_batching { }
    """), "m")
    assert cfg.dynamic_batching.preferred_batch_size == (6,)


@pytest.mark.parametrize("text, line, field, words", [
    ('backend: "python"\nmax_batch_size: 4\nbogus_field: 3\n', 3, "bogus_field", "no field named"),
    ('backend: "python"\nmax_batch_size: 4\ninput [ { name: "x" data_type: TYPE_FP99 dims: [1] } ]\n', 3, None,
     "TYPE_FP99"),
    ('backend: "python"\nmax_batch_size: 2\ninput [ { name: "x" data_type: TYPE_FP32 dims: [1] } ]\n'
     'output [ { name: "y" data_type: TYPE_FP32 dims: [1] } ]\n'
     'dynamic_batching { preferred_batch_size: [ 4 ] }\n', 5, "preferred_batch_size", "1..max_batch_size"),
    ('backend: "tensorflow"\n', 1, "backend", "unknown backend"),
    ('backend: "python"\nmax_batch_size: 2\n\ninput [ { name: "x" data_type: TYPE_FP32 dims: [0] } ]\n'
     'output [ { name: "y" data_type: TYPE_FP32 dims: [1] } ]\n', 4, "dims", "positive or -1"),
    ('backend: "python"\nmax_batch_size: 2\ninput [ { name: "x" data_type: TYPE_FP32 dims: [1] } ]\n', None,
     "output", "at least one output"),
    ('name: "other"\nbackend: "python"\n', 1, "name", "directory name"),
])
def test_errors_name_file_line_and_field(tmp_path, text, line, field, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        parse_config(path, "m")
    err = info.value
    assert err.path == path
    assert words in str(err)
    if line is not None:
        assert err.line == line and f"{path}:{line}" in str(err)
    if field is not None:
        assert err.field == field and f"'{field}'" in str(err)


def test_scan_reports_broken_models_beside_good_ones(tmp_path):
    (tmp_path / "good" / "1").mkdir(parents=True)
    (tmp_path / "good" / "1" / "model.py").write_text("class Model:\n    def execute(self, x):\n        return x\n")
    (tmp_path / "good" / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [1] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [1] } ]\n')
    (tmp_path / "good" / "3").mkdir()
    (tmp_path / "good" / "3" / "model.py").write_text("")
    (tmp_path / "noconfig" / "1").mkdir(parents=True)
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "config.pbtxt").write_text((tmp_path / "good" / "config.pbtxt").read_text())
    (tmp_path / "nofile" / "1").mkdir()
    found = {s.name: s for s in scan(str(tmp_path))}
    assert found["good"].error is None and found["good"].version == 3
    assert "has no config.pbtxt" in found["noconfig"].error
    assert "model file missing" in found["nofile"].error


@pytest.mark.parametrize("text, value", [("65536", 65536), ("512M", 512 << 20), ("8G", 8 << 30), ("4k", 4096)])
def test_sizes(text, value):
    assert parse_size(text) == value


def test_bad_size():
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_ge_defaults_come_from_the_environment(tmp_path, monkeypatch):
    path = write(tmp_path, ASCEND)
    monkeypatch.setenv("GE_BACKEND_STREAM_NUM", "3")
    monkeypatch.setenv("GE_BACKEND_SHARED_MEMORY_POOL_SIZE", "8G")
    cfg = parse_config(path, "m")
    assert (cfg.stream_num, cfg.memory_pool_size) == (3, 8 << 30)
    path = write(tmp_path, ASCEND + 'parameters { key: "stream_num" value: { string_value: "5" } }\n'
                 'parameters { key: "memory_pool_size" value: { string_value: "512M" } }\n')
    cfg = parse_config(path, "m")
    assert (cfg.stream_num, cfg.memory_pool_size) == (5, 512 << 20)


def test_ge_without_instance_group_runs_on_device_0(tmp_path):
    cfg = parse_config(write(tmp_path, ASCEND.replace(
        "instance_group [ { count: 2 kind: KIND_ASCEND ascend_devices: [0, 1] } ]", "")), "m")
    assert cfg.instance_groups[0].kind == "KIND_ASCEND" and cfg.instance_groups[0].devices == (0,)


@pytest.mark.parametrize("extra, field", [
    ('parameters { key: "stream_num" value: { string_value: "zero" } }', "stream_num"),
    ('parameters { key: "memory_pool_size" value: { string_value: "big" } }', "memory_pool_size"),
    ('parameters { key: "batch_policy" value: { string_value: "eager" } }', "batch_policy"),
])
def test_bad_parameters_are_named(tmp_path, extra, field):
    with pytest.raises(ConfigError) as info:
        parse_config(write(tmp_path, ASCEND + extra + "\n"), "m")
    assert info.value.field == field and info.value.line == 8


def test_ascend_kind_needs_the_ge_backend(tmp_path):
    with pytest.raises(ConfigError, match="KIND_ASCEND needs backend 'ge'"):
        parse_config(write(tmp_path, ASCEND.replace('backend: "ge"', 'platform: "onnxruntime_onnx"')), "m")


@pytest.mark.parametrize("name", ["../etc", "/etc", "a/b", "..", ".", "", ".hidden", "x\0y", 7])
def test_model_names_cannot_leave_the_repository(tmp_path, name):
    from gepool.common.repository import model_dir

    with pytest.raises(ValueError, match="repository|plain directory"):
        model_dir(str(tmp_path), name)


def test_a_symlink_out_of_the_repository_is_refused(tmp_path):
    from gepool.common.repository import load_source, model_dir, scan

    outside = tmp_path / "outside"
    (outside / "1").mkdir(parents=True)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "escape").symlink_to(outside)
    (repo / "inside").symlink_to(repo / "real", target_is_directory=True)
    (repo / "real").mkdir()
    with pytest.raises(ValueError, match="outside the model repository"):
        model_dir(str(repo), "escape")
    assert model_dir(str(repo), "inside").endswith("inside")  # a link that stays inside is fine
    assert "outside the model repository" in load_source(str(repo), "escape").error
    assert "outside the model repository" in {s.name: s for s in scan(str(repo))}["escape"].error


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir])
def test_a_config_that_is_not_a_regular_file_is_refused_on_the_descriptor_read(tmp_path, make):
    # parse_config itself, with no check of the path before it: one made between a check and the open (a
    # fifo swapped in) must be refused, not waited on
    path = str(tmp_path / "config.pbtxt")
    make(path)
    outcome: list = []

    def read() -> None:
        try:
            parse_config(path, "m")
        except ConfigError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # hung on the fifo: let it go before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("reading a fifo config waited for a writer")
    assert outcome and "is not a regular file" in outcome[0], outcome
