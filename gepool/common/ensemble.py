"""Triton's ensemble_scheduling: the steps as typed objects, and the checks on the graph they form."""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gepool.common.errors import ConfigError

LATEST = -1  # a step's model_version: the latest ready version
MAX_NESTING = 8  # ensembles in one chain of steps that are ensembles, the outermost included


@dataclass(frozen=True)
class Step:
    """One step: run ``model_name`` with its inputs taken from ensemble tensors (``input_map``: model input
    -> ensemble tensor) and its outputs named as ensemble tensors (``output_map``: model output -> tensor)."""

    model_name: str
    model_version: int = LATEST
    input_map: dict[str, str] = field(default_factory=dict)
    output_map: dict[str, str] = field(default_factory=dict)
    reads: frozenset[str] = field(init=False, repr=False, compare=False)  # the ensemble tensors it reads

    def __post_init__(self) -> None:
        object.__setattr__(self, "reads", frozenset(self.input_map.values()))

    def label(self, index: int) -> str:
        """How messages name it: 1-based, with its model."""
        return f"step {index + 1} ('{self.model_name}')"


@dataclass(frozen=True)
class Ensemble:
    steps: tuple[Step, ...]
    order: tuple[int, ...]  # the steps in an order where each comes after every step it consumes from
    producer: dict[str, int] = field(default_factory=dict)  # ensemble tensor -> step index (-1: an input)


Fail = Callable[[str, str], ConfigError]


def parse_steps(msg, fail: Fail) -> tuple[Step, ...]:
    """The ensemble_scheduling message's steps as typed objects (no graph checks yet)."""
    steps = []
    for i, s in enumerate(msg.step):
        where = f"step {i + 1}"
        if not s.model_name:
            raise fail("model_name", f"{where} has no model_name")
        if s.model_namespace:
            raise fail("model_namespace", f"{where} ('{s.model_name}'): model_namespace is not supported by gepool "
                                          f"yet (one pool, one namespace)")
        if s.model_version < LATEST:
            raise fail("model_version", f"{where} ('{s.model_name}'): model_version must be -1 (latest) or a "
                                        f"version number, got {s.model_version}")
        if not s.input_map:
            raise fail("input_map", f"{where} ('{s.model_name}') has no input_map")
        if not s.output_map:
            raise fail("output_map", f"{where} ('{s.model_name}') has no output_map")
        # proto3 cannot tell an omitted model_version from 0, and no version is numbered 0: both mean latest
        version = s.model_version if s.model_version > 0 else LATEST
        steps.append(Step(s.model_name, version, dict(s.input_map), dict(s.output_map)))
    if not steps:
        raise fail("ensemble_scheduling", "an ensemble needs at least one step")
    return tuple(steps)


def check_graph(name: str, steps: tuple[Step, ...], inputs: list[str], outputs: list[str], fail: Fail) -> Ensemble:
    """The steps form a DAG from the ensemble's inputs to its outputs: every tensor produced once, every
    consumed tensor produced, every output produced by a step, no cycle, no step calling the ensemble."""
    producer: dict[str, int] = {t: -1 for t in inputs}
    for i, step in enumerate(steps):
        if step.model_name == name:
            raise fail("model_name", f"ensemble '{name}' {step.label(i)}: the ensemble cannot be a step of itself")
        for out, tensor in step.output_map.items():
            if tensor in producer:
                k = producer[tensor]
                first = "the ensemble input" if k == -1 else steps[k].label(k)
                raise fail("output_map", f"ensemble '{name}' {step.label(i)}: tensor '{tensor}' (its output '{out}') "
                                         f"is already produced by {first}")
            producer[tensor] = i
    for i, step in enumerate(steps):
        for inp, tensor in step.input_map.items():
            if tensor not in producer:
                raise fail("input_map", f"ensemble '{name}' {step.label(i)}: input '{inp}' reads tensor '{tensor}', "
                                        f"which no step and no ensemble input produces")
    for out in outputs:
        if producer.get(out, -1) == -1:
            raise fail("output", f"ensemble '{name}': output '{out}' is produced by no step")
    return Ensemble(steps, _order(name, steps, producer, fail), producer)


def _order(name: str, steps: tuple[Step, ...], producer: dict[str, int], fail: Fail) -> tuple[int, ...]:
    needs = [{producer[t] for t in s.input_map.values() if producer[t] >= 0} for s in steps]
    done: list[int] = []
    left = set(range(len(steps)))
    while left:
        ready = sorted(i for i in left if needs[i] <= set(done))
        if not ready:
            i = min(left)
            tensor = next(t for t in steps[i].input_map.values() if producer[t] in left)
            raise fail("ensemble_scheduling", f"ensemble '{name}' {steps[i].label(i)}: the steps form a cycle "
                                              f"through tensor '{tensor}'")
        done += ready
        left -= set(ready)
    return tuple(done)


def check_nesting(name: str, nested: Callable[[str], Iterable[str]]) -> str | None:
    """What is wrong with the ensembles under ensemble ``name`` (``nested(e)``: the ensembles ensemble
    ``e``'s steps name), or None: a circular dependency, or a chain deeper than MAX_NESTING, each with every
    ensemble on it named."""
    path = [name]
    deepest: dict[str, tuple[str, ...]] = {}  # a checked ensemble -> its deepest chain (nothing below loops)

    def visit(e: str) -> str | tuple[str, ...]:
        chain: tuple[str, ...] = ()
        for child in dict.fromkeys(nested(e)):
            if child in path:
                loop = " -> ".join([*path[path.index(child):], child])
                return f"circular dependency between ensembles: {loop}"
            if child not in deepest:
                path.append(child)
                below = visit(child)
                path.pop()
                if isinstance(below, str):
                    return below
                deepest[child] = below
            if len(deepest[child]) > len(chain):
                chain = deepest[child]
            if len(path) + len(deepest[child]) > MAX_NESTING:
                names = " -> ".join([*path, *deepest[child]])
                return (f"ensembles nest {len(path) + len(deepest[child])} deep, past the limit of "
                        f"{MAX_NESTING}: {names}")
        return (e, *chain)

    found = visit(name)
    return found if isinstance(found, str) else None


def _dims_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))


def check_steps(config, steps: Mapping[int, object]) -> str | None:
    """What makes the ensemble ``config`` unservable with these step model configs (step index -> the
    config of the model it would run now), or None. Datatypes and dims must agree between each tensor's
    producer and every consumer; a batching ensemble needs steps that batch at least as many rows."""
    ens = config.ensemble
    name = config.name
    tensor_type = {t.name: (t.datatype, t.dims, "the ensemble input") for t in config.inputs}
    for i, step in enumerate(ens.steps):
        cfg = steps[i]
        where = f"ensemble '{name}' {step.label(i)}"
        if (config.max_batch_size > 0) != (cfg.max_batch_size > 0):
            return (f"{where}: the ensemble's max_batch_size is {config.max_batch_size} and model "
                    f"'{cfg.name}''s is {cfg.max_batch_size}: both must batch, or neither")
        if cfg.max_batch_size < config.max_batch_size:
            return (f"{where}: model '{cfg.name}' batches at most {cfg.max_batch_size} rows, less than the "
                    f"ensemble's max_batch_size {config.max_batch_size}")
        names = {t.name for t in cfg.inputs}
        if set(step.input_map) != names:
            unknown = sorted(set(step.input_map) - names)
            if unknown:
                return f"{where}: input_map names input '{unknown[0]}', which model '{cfg.name}' does not have"
            return f"{where}: input '{sorted(names - set(step.input_map))[0]}' of model '{cfg.name}' is not mapped"
        outs = {t.name: t for t in cfg.outputs}
        for out, tensor in step.output_map.items():
            if out not in outs:
                return f"{where}: output_map names output '{out}', which model '{cfg.name}' does not have"
            tensor_type[tensor] = (outs[out].datatype, outs[out].dims, f"output '{out}' of {step.label(i)}")
    consumers = [(step.input_map.items(), steps[i].inputs, f"ensemble '{name}' {step.label(i)}: input")
                 for i, step in enumerate(ens.steps)]
    consumers.append((((t.name, t.name) for t in config.outputs), config.outputs, f"ensemble '{name}': output"))
    for pairs, declared, where in consumers:
        want = {t.name: t for t in declared}
        for inp, tensor in pairs:
            datatype, dims, origin = tensor_type[tensor]
            t = want[inp]
            if datatype != t.datatype:
                return (f"{where} '{inp}' is {t.datatype}, but tensor '{tensor}' ({origin}) is {datatype}")
            if not _dims_agree(dims, t.dims):
                return (f"{where} '{inp}' has dims {list(t.dims)}, but tensor '{tensor}' ({origin}) has "
                        f"{list(dims)}")
    return None
