"""No config.pbtxt field accepted and ignored: what gepool does not do is refused at load, naming the field."""

import os
import textwrap

import pytest

from gepool.common.config import parse_config
from gepool.common.errors import ConfigError
from gepool.common.labels import MAX_LABEL_FILE_BYTES
from gepool.common.repository import scan
from tests import repo as test_repo

BASE = """
backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""
ONNX = BASE.replace('backend: "python"', 'platform: "onnxruntime_onnx"')
GE = BASE.replace('backend: "python"', 'backend: "ge"')


def write(tmp_path, text: str) -> str:
    path = tmp_path / "config.pbtxt"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("base, extra, field", [
    (BASE, "model_transaction_policy { decoupled: true }", "decoupled"),
    (ONNX, 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }',
     "execution_accelerators"),
    (ONNX, 'optimization { execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }',
     "execution_accelerators"),
    (ONNX, "optimization { cuda { graphs: true } }", "cuda"),
    (ONNX, "optimization { graph { level: 1 } }", "graph"),
    (ONNX, "optimization { priority: PRIORITY_MAX }", "priority"),
    (ONNX, "optimization { input_pinned_memory { enable: false } }", "input_pinned_memory"),
    (ONNX, "optimization { eager_batching: true }", "eager_batching"),
    (BASE, "sequence_batching { }", "sequence_batching"),
    (BASE, "ensemble_scheduling { }", "ensemble_scheduling"),
    (BASE, "dynamic_batching { preserve_ordering: true }", "preserve_ordering"),
    (BASE, 'runtime: "model.py"', "runtime"),
    (BASE, 'cc_model_filenames { key: "7.5" value: "model.plan" }', "cc_model_filenames"),
    (BASE, 'metric_tags { key: "team" value: "a" }', "metric_tags"),
    (ONNX, "instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]", "gpus"),
    (BASE, 'instance_group [ { rate_limiter { resources [ { name: "R" count: 1 } ] } } ]', "rate_limiter"),
    (BASE, 'instance_group [ { profile: [ "0" ] } ]', "profile"),
    (BASE, 'instance_group [ { host_policy: "numa0" } ]', "host_policy"),
    (BASE, "instance_group [ { passive: true } ]", "passive"),
    (BASE, "instance_group [ { secondary_devices [ { device_id: 0 } ] } ]", "secondary_devices"),
    (GE, "instance_group [ { kind: KIND_ASCEND policy: round_robin } ]", "policy"),
    (ONNX, 'parameters { key: "execution_mode" value: { string_value: "1" } }', "execution_mode"),
    (ONNX, 'parameters { key: "enable_mem_arena" value: { string_value: "0" } }', "enable_mem_arena"),
    (BASE, 'parameters { key: "execution_timeout_ms" value: { string_value: "soon" } }', "execution_timeout_ms"),
    (ONNX, 'parameters { key: "intra_op_thread_count" value: { string_value: "-2" } }', "intra_op_thread_count"),
], ids=lambda v: v.split("\n")[1] if isinstance(v, str) and v.startswith("\n") else None)
def test_a_setting_nothing_applies_is_refused_naming_it(tmp_path, base, extra, field):
    path = write(tmp_path, base + extra + "\n")
    with pytest.raises(ConfigError) as info:
        parse_config(path, "m")
    assert info.value.field == field and field in info.value.message, str(info.value)
    assert info.value.line == base.count("\n") + 1  # located on the line that sets it


@pytest.mark.parametrize("extra, field", [
    ('model_operations { op_library_filename: [ "x.so" ] }', "model_operations"),
    ('model_repository_agents { agents [ { name: "checksum" } ] }', "model_repository_agents"),
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 source_input: "x" } ]',
     "batch_input"),
    ('batch_output [ { target_name: "y" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "x" } ]',
     "batch_output"),
    ("model_metrics { }", "model_metrics"),
    ('sequence_batching { control_input [ { name: "START" } ] }', "control_input"),
    ("sequence_batching { oldest { max_candidate_sequences: 4 } }", "oldest"),
    ('sequence_batching { state [ { input_name: "i" output_name: "o" } ] }', "state"),
    ("ensemble_scheduling { max_inflight_requests: 4 }", "max_inflight_requests"),
    ("optimization { cuda { graph_spec [ { batch_size: 1 } ] } }", "graph_spec"),
])
def test_a_triton_field_the_proto_does_not_carry_is_refused_as_unsupported(tmp_path, extra, field):
    """Not protobuf's 'has no field named', which reads as a misspelled field."""
    with pytest.raises(ConfigError) as info:
        parse_config(write(tmp_path, BASE + extra + "\n"), "m")
    assert info.value.field == field and info.value.line == BASE.count("\n") + 1, str(info.value)
    assert field in info.value.message and info.value.message.endswith("is not supported by gepool yet"), \
        str(info.value)
    assert "has no field named" not in info.value.message
    with pytest.raises(ConfigError, match='has no field named "model_operation"'):  # a misspelling stays one
        parse_config(write(tmp_path, BASE + "model_operation { }\n"), "m")


@pytest.mark.parametrize("kind, flag", [("input", "optional"), ("input", "allow_ragged_batch"),
                                        ("input", "is_shape_tensor"), ("output", "is_shape_tensor"),
                                        ("input", "is_non_linear_format_io"), ("output", "is_non_linear_format_io")])
def test_tensor_flags_nothing_applies_are_refused(tmp_path, kind, flag):
    name = "x" if kind == "input" else "y"
    text = BASE.replace(f'name: "{name}" ', f'name: "{name}" {flag}: true ')
    with pytest.raises(ConfigError) as info:
        parse_config(write(tmp_path, text), "m")
    assert info.value.field == flag and f"{kind} '{name}'" in info.value.message


def test_a_python_model_keeps_its_own_parameters(tmp_path):
    cfg = parse_config(write(tmp_path, BASE + 'parameters { key: "execution_mode" value: { string_value: "x" } }\n'),
                       "m")
    assert cfg.parameters == {"execution_mode": "x"}  # a python model may read any key it likes


@pytest.mark.parametrize("extra", ["", "instance_group [ { kind: KIND_ASCEND policy: load_balance } ]",
                                   "dynamic_batching { preserve_ordering: false }",
                                   "model_transaction_policy { decoupled: false }", "response_cache { enable: false }"])
def test_what_gepool_does_or_leaves_off_still_loads(tmp_path, extra):
    assert parse_config(write(tmp_path, GE + extra + "\n"), "m").backend == "ge"


def test_an_input_format_is_kept_and_shown(tmp_path):
    from gepool.common.render import render

    cfg = parse_config(write(tmp_path, BASE.replace('name: "x" ', 'name: "x" format: FORMAT_NCHW ')), "m")
    assert cfg.inputs[0].format == "FORMAT_NCHW" and render(cfg)["input"][0]["format"] == "FORMAT_NCHW"


LABELS = BASE.replace('name: "y" ', 'name: "y" label_filename: "labels.txt" ')


def test_labels_are_read_into_the_typed_config(tmp_path):
    (tmp_path / "labels.txt").write_text("cat\ndog\nbird\n")
    cfg = parse_config(write(tmp_path, LABELS), "m")
    assert cfg.outputs[0].label_filename == "labels.txt" and cfg.outputs[0].labels == ("cat", "dog", "bird")


def test_the_response_cache_is_kept_in_the_typed_config(tmp_path):
    assert parse_config(write(tmp_path, BASE + "response_cache { enable: true }\n"), "m").response_cache is True


@pytest.mark.parametrize("setup, label, words", [
    (lambda d: None, "labels.txt", "cannot open"),
    (lambda d: (d / "labels.txt").write_bytes(b"x" * (MAX_LABEL_FILE_BYTES + 1)), "labels.txt", "at most"),
    (lambda d: (d / "labels.txt").write_bytes(b"\xff\xfe"), "labels.txt", "not UTF-8"),
    (lambda d: os.mkfifo(d / "labels.txt"), "labels.txt", "regular file"),
    (lambda d: (d / "labels.txt").symlink_to("/etc/passwd"), "labels.txt", "cannot open"),
    (lambda d: None, "../labels.txt", "in the model folder"),
])
def test_a_bad_label_file_is_named(tmp_path, setup, label, words):
    setup(tmp_path)
    with pytest.raises(ConfigError, match=words) as info:
        parse_config(write(tmp_path, LABELS.replace("labels.txt", label)), "m")
    assert info.value.field == "label_filename"


def test_the_example_and_test_repositories_still_load(tmp_path):
    test_repo.make_models.make_all(str(tmp_path))
    test_repo.bytes_model(str(tmp_path))
    test_repo.recorder(str(tmp_path), "rec")
    found = {s.name: s.error for s in scan(str(tmp_path))}
    assert found and all(e is None for e in found.values()), found
