"""Ensemble configs: parsed as Triton writes them, every graph and step error named, rendered as Triton does."""

import textwrap

import pytest

from gepool.common.config import parse_config
from gepool.common.ensemble import MAX_NESTING, check_nesting, check_steps
from gepool.common.errors import ConfigError
from gepool.common.render import render


def step(model: str, inputs: dict, outputs: dict, version: int = -1) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version} {ins} {outs} }}'


PIPE = [step("pre", {"X": "IN"}, {"Y": "mid"}), step("net", {"X": "mid"}, {"Y": "OUT"})]


def ensemble(steps=PIPE, extra: str = "", mbs: int = 8, out_type: str = "TYPE_FP32", head: str = "") -> str:
    return textwrap.dedent(f"""
        {head or 'platform: "ensemble"'}
        max_batch_size: {mbs}
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "OUT" data_type: {out_type} dims: [ 4 ] }} ]
        ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
        {extra}
    """)


def parse(tmp_path, text: str):
    folder = tmp_path / "ens"
    folder.mkdir(exist_ok=True)
    (folder / "config.pbtxt").write_text(text)
    return parse_config(str(folder / "config.pbtxt"), "ens")


def model(tmp_path, name: str, text: str):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(text))
    return parse_config(str(folder / "config.pbtxt"), name)


def step_model(tmp_path, name: str, in_type="TYPE_FP32", out_type="TYPE_FP32", in_dims="4", out_dims="4",
               mbs: int = 8, inputs: str = "X", outputs: str = "Y"):
    ins = ", ".join(f'{{ name: "{n}" data_type: {in_type} dims: [ {in_dims} ] }}' for n in inputs.split(","))
    outs = ", ".join(f'{{ name: "{n}" data_type: {out_type} dims: [ {out_dims} ] }}' for n in outputs.split(","))
    return model(tmp_path, name, f"""
        backend: "python"
        max_batch_size: {mbs}
        input [ {ins} ]
        output [ {outs} ]
    """)


def test_an_ensemble_parses_with_its_steps_in_order(tmp_path):
    reversed_steps = [PIPE[1], PIPE[0]]  # written out of order: the graph orders them
    cfg = parse(tmp_path, ensemble(reversed_steps))
    assert cfg.backend == "ensemble" and cfg.platform == "ensemble" and cfg.instance_groups == ()
    assert [s.model_name for s in cfg.ensemble.steps] == ["net", "pre"]
    assert cfg.ensemble.order == (1, 0)
    assert cfg.ensemble.steps[1].input_map == {"X": "IN"} and cfg.ensemble.steps[1].output_map == {"Y": "mid"}


@pytest.mark.parametrize("steps, field, words", [
    ([step("pre", {"X": "IN"}, {"Y": "mid"}), step("net", {"X": "nowhere"}, {"Y": "OUT"})], "input_map",
     ["step 2 ('net')", "'nowhere'", "no step and no ensemble input produces"]),
    ([step("pre", {"X": "IN"}, {"Y": "OUT"}), step("net", {"X": "IN"}, {"Y": "OUT"})], "output_map",
     ["step 2 ('net')", "'OUT'", "already produced by step 1 ('pre')"]),
    ([step("pre", {"X": "IN"}, {"Y": "IN"}), step("net", {"X": "IN"}, {"Y": "OUT"})], "output_map",
     ["step 1 ('pre')", "'IN'", "already produced by the ensemble input"]),
    ([step("pre", {"X": "IN"}, {"Y": "mid"})], "output", ["output 'OUT'", "produced by no step"]),
    ([step("a", {"X": "IN", "Z": "b_out"}, {"Y": "a_out"}), step("b", {"X": "a_out"}, {"Y": "b_out"}),
      step("c", {"X": "a_out"}, {"Y": "OUT"})], "ensemble_scheduling", ["step 1 ('a')", "cycle", "'b_out'"]),
    ([step("ens", {"X": "IN"}, {"Y": "OUT"})], "model_name", ["step 1 ('ens')", "cannot be a step of itself"]),
    (['{ model_name: "pre" output_map { key: "Y" value: "OUT" } }'], "input_map", ["step 1 ('pre') has no input_map"]),
    (['{ model_name: "pre" input_map { key: "X" value: "IN" } }'], "output_map", ["step 1 ('pre') has no output_map"]),
    (['{ model_name: "pre" model_namespace: "ns" input_map { key: "X" value: "IN" } output_map { key: "Y" '
      'value: "OUT" } }'], "model_namespace", ["model_namespace"]),
])
def test_graph_errors_name_the_ensemble_the_step_and_the_tensor(tmp_path, steps, field, words):
    with pytest.raises(ConfigError) as exc:
        parse(tmp_path, ensemble(steps))
    assert exc.value.field == field, exc.value
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))
    assert "ens" in str(exc.value)


@pytest.mark.parametrize("extra, field", [
    ("instance_group [ { count: 2 kind: KIND_CPU } ]", "instance_group"),
    ('parameters { key: "k" value: { string_value: "v" } }', "parameters"),
    ('default_model_filename: "model.py"', "default_model_filename"),
    ("response_cache { enable: true }", "response_cache"),
    ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 4 ] '
     'zero_data: true } } } ]', "model_warmup"),
])
def test_fields_an_ensemble_does_not_use_are_refused_by_name(tmp_path, extra, field):
    with pytest.raises(ConfigError) as exc:
        parse(tmp_path, ensemble(extra=extra))
    assert exc.value.field == field and "does not apply to an ensemble" in str(exc.value)


def test_dynamic_batching_cannot_go_with_ensemble_scheduling(tmp_path):
    with pytest.raises(ConfigError):  # one oneof: protobuf's parser refuses the pair
        parse(tmp_path, ensemble(extra="dynamic_batching { }"))


def test_platform_and_scheduling_go_together(tmp_path):
    with pytest.raises(ConfigError) as exc:
        parse(tmp_path, ensemble(head='backend: "python"'))
    assert exc.value.field == "ensemble_scheduling" and "platform" in str(exc.value)
    text = ensemble().replace(ensemble().split("ensemble_scheduling")[1], "").replace("ensemble_scheduling", "")
    with pytest.raises(ConfigError) as exc:
        parse(tmp_path, text)
    assert exc.value.field == "platform"
    with pytest.raises(ConfigError) as exc:
        parse(tmp_path, ensemble(head='platform: "ensemble" backend: "python"'))
    assert exc.value.field == "backend"


def test_steps_that_agree_pass(tmp_path):
    cfg = parse(tmp_path, ensemble())
    assert check_steps(cfg, {0: step_model(tmp_path, "pre"), 1: step_model(tmp_path, "net")}) is None


@pytest.mark.parametrize("pre, net, words", [
    ({}, {"in_type": "TYPE_INT32"}, ["step 2 ('net')", "input 'X' is INT32", "tensor 'mid'", "FP32"]),
    ({"out_dims": "5"}, {}, ["step 2 ('net')", "input 'X' has dims [4]", "tensor 'mid'", "[5]"]),
    ({}, {"out_type": "TYPE_INT64"}, ["output 'OUT' is FP32", "tensor 'OUT'", "step 2 ('net')", "INT64"]),
    ({"in_dims": "3"}, {}, ["step 1 ('pre')", "input 'X' has dims [3]", "tensor 'IN'", "the ensemble input"]),
    ({"inputs": "X,W"}, {}, ["step 1 ('pre')", "input 'W'", "is not mapped"]),
    ({"inputs": "Q"}, {}, ["step 1 ('pre')", "input_map names input 'X'"]),
    ({"outputs": "Q"}, {}, ["step 1 ('pre')", "output_map names output 'Y'"]),
    ({}, {"mbs": 4}, ["step 2 ('net')", "at most 4 rows", "max_batch_size 8"]),
    ({}, {"mbs": 0, "in_dims": "4"}, ["step 2 ('net')", "both must batch"]),
])
def test_step_mismatches_are_named(tmp_path, pre, net, words):
    cfg = parse(tmp_path, ensemble())
    problem = check_steps(cfg, {0: step_model(tmp_path, "pre", **pre), 1: step_model(tmp_path, "net", **net)})
    assert problem is not None and problem.startswith("ensemble 'ens'")
    for w in words:
        assert w in problem, (w, problem)


def test_a_variable_dim_agrees_with_a_fixed_one(tmp_path):
    cfg = parse(tmp_path, ensemble())
    assert check_steps(cfg, {0: step_model(tmp_path, "pre", out_dims="-1"), 1: step_model(tmp_path, "net")}) is None


def test_an_ensemble_renders_as_triton_does(tmp_path):
    out = render(parse(tmp_path, ensemble()))
    assert out["platform"] == "ensemble" and out["backend"] == "" and out["instance_group"] == []
    steps = out["ensemble_scheduling"]["step"]
    assert [(s["model_name"], s["model_version"], s["input_map"], s["output_map"]) for s in steps] == [
        ("pre", -1, {"X": "IN"}, {"Y": "mid"}), ("net", -1, {"X": "mid"}, {"Y": "OUT"})]
    assert "dynamic_batching" not in out


def test_a_step_without_model_version_runs_the_latest_and_a_number_pins_it(tmp_path):
    steps = ['{ model_name: "pre" input_map { key: "X" value: "IN" } output_map { key: "Y" value: "mid" } }',
             step("net", {"X": "mid"}, {"Y": "OUT"}, version=3)]
    cfg = parse(tmp_path, ensemble(steps))
    assert [s.model_version for s in cfg.ensemble.steps] == [-1, 3]
    with pytest.raises(ConfigError) as exc:
        parse(tmp_path, ensemble([PIPE[0], step("net", {"X": "mid"}, {"Y": "OUT"}, version=-2)]))
    assert exc.value.field == "model_version" and "step 2 ('net')" in str(exc.value)


def test_a_step_that_is_an_ensemble_is_checked_as_any_step(tmp_path):
    inner = model(tmp_path, "inner", ensemble().replace('"IN"', '"X"').replace('"OUT"', '"Y"'))
    assert inner.ensemble is not None
    cfg = parse(tmp_path, ensemble([step("inner", {"X": "IN"}, {"Y": "OUT"})]))
    assert check_steps(cfg, {0: inner}) is None
    wide = model(tmp_path, "wide", ensemble(mbs=4).replace('"IN"', '"X"').replace('"OUT"', '"Y"'))
    problem = check_steps(cfg, {0: wide})
    assert problem == ("ensemble 'ens' step 1 ('inner'): model 'wide' batches at most 4 rows, less than the "
                       "ensemble's max_batch_size 8")
    other = model(tmp_path, "other", ensemble(out_type="TYPE_INT32").replace('"IN"', '"X"').replace('"OUT"', '"Y"'))
    problem = check_steps(cfg, {0: other})
    assert "output 'OUT' is FP32, but tensor 'OUT' (output 'Y' of step 1 ('inner')) is INT32" in problem


def nesting(graph: dict[str, list[str]], name: str) -> str | None:
    return check_nesting(name, lambda e: graph.get(e, []))


def test_nesting_cycles_name_every_ensemble_on_them():
    graph = {"a": ["b"], "b": ["c", "d"], "c": ["a"], "d": []}
    assert nesting(graph, "a") == "circular dependency between ensembles: a -> b -> c -> a"
    assert nesting(graph, "c") == "circular dependency between ensembles: c -> a -> b -> c"
    assert nesting({"x": ["a"], **graph}, "x") == "circular dependency between ensembles: a -> b -> c -> a"
    assert nesting({"a": ["b"], "b": ["a"]}, "b") == "circular dependency between ensembles: b -> a -> b"
    assert nesting(graph, "d") is None


def test_a_diamond_of_ensembles_is_no_cycle():
    graph = {"top": ["l", "r"], "l": ["bottom"], "r": ["bottom"], "bottom": []}
    assert nesting(graph, "top") is None


def test_nesting_deeper_than_the_limit_is_named_with_its_chain():
    line = {f"e{i}": [f"e{i + 1}"] for i in range(1, MAX_NESTING + 1)}  # e1 -> ... -> e9
    assert MAX_NESTING == 8
    assert nesting(line, "e2") is None  # eight ensembles
    chain = " -> ".join(f"e{i}" for i in range(1, MAX_NESTING + 2))
    assert nesting(line, "e1") == f"ensembles nest 9 deep, past the limit of 8: {chain}"
    # the deep chain found through a branch that was checked first on a shallower path
    graph = {"top": ["e3", "e1"], **line}  # e3 .. e9 first: seven, with top eight
    assert nesting(graph, "top") == f"ensembles nest 10 deep, past the limit of 8: top -> {chain}"
