"""The config.pbtxt fields that nothing in gepool implements, refused at load with the field's name.

Every other field of model_config.proto works: name, platform, backend, version_policy, max_batch_size,
input/output name, data_type, dims and format, instance_group name, kind, count, devices and the
load_balance policy, dynamic_batching (all but preserve_ordering), default_model_filename, parameters,
model_warmup, response_cache and output label_filename (parameters: gepool's own keys,
intra_op_thread_count, and anything a python model reads). ``refuse_unimplemented`` holds the fields
that are parsed into the typed config and wait for their implementation: drop a check there when its
feature lands.
"""

import re
from collections.abc import Callable

from gepool.common import model_config_pb2 as pb
from gepool.common.errors import ConfigError

Fail = Callable[[str, str], ConfigError]  # (field, message) -> the error, located in the config's text

_NOT_YET = "is not supported by gepool yet"
# Triton's model_config.proto fields that gepool's does not carry, by message: a config naming one is refused with
# these words, not protobuf's "has no field named" (which reads as a misspelling)
TRITON_ONLY_FIELDS = {
    "ModelConfig": {"batch_input": "batch_input (the ragged-batch inputs a backend computes)",
                    "batch_output": "batch_output (the outputs scattered to ragged requests)",
                    "model_metrics": "model_metrics (custom metric settings)",
                    "model_operations": "model_operations (custom operation libraries)",
                    "model_repository_agents": "model_repository_agents (repository agents such as checksum)"},
    "ModelEnsembling": {"max_inflight_requests": "ensemble_scheduling.max_inflight_requests"},
    "ModelOptimizationPolicy.Cuda": {"graph_spec": "optimization.cuda.graph_spec"},
    "ModelSequenceBatching": {name: f"sequence_batching.{name}" for name in
                              ("control_input", "direct", "iterative_sequence", "oldest", "state")},
}
_TENSOR_FLAGS = ("is_shape_tensor", "allow_ragged_batch", "optional", "is_non_linear_format_io")
# parameters Triton's onnxruntime backend reads that gepool's does not (it reads intra_op_thread_count)
_ORT_PARAMETERS = ("inter_op_thread_count", "execution_mode", "enable_mem_arena", "enable_mem_pattern",
                   "memory.enable_memory_arena_shrinkage", "session.use_device_allocator_for_initializers",
                   "cudnn_conv_algo_search", "gpu_mem_limit", "arena_extend_strategy", "do_copy_in_default_stream",
                   "use_ep_level_unified_stream")


def refuse_unsupported(msg: pb.ModelConfig, backend: str, fail: Fail) -> None:
    """Raises for the first field set in ``msg`` that gepool would otherwise accept and not apply."""
    if msg.runtime:
        raise fail("runtime", f"runtime '{msg.runtime}' {_NOT_YET} (backends are built in)")
    if msg.HasField("optimization"):
        for fd, _ in msg.optimization.ListFields():
            raise fail(fd.name, f"optimization.{fd.name} {_NOT_YET}: gepool runs onnxruntime on CPU and ACL on "
                                f"Ascend with their own settings, so it would be ignored")
    for name in ("cc_model_filenames", "metric_tags"):
        if getattr(msg, name):
            raise fail(name, f"{name} {_NOT_YET}")
    if msg.model_transaction_policy.decoupled:
        raise fail("decoupled", f"model_transaction_policy.decoupled {_NOT_YET}: every request gets one response")
    if msg.WhichOneof("scheduling_choice") == "dynamic_batching" and msg.dynamic_batching.preserve_ordering:
        raise fail("preserve_ordering", f"dynamic_batching.preserve_ordering {_NOT_YET}: responses leave in "
                                        f"the order their batches finish")
    for kind, items in (("input", msg.input), ("output", msg.output)):
        for t in items:
            for flag in _TENSOR_FLAGS:
                if flag in t.DESCRIPTOR.fields_by_name and getattr(t, flag):
                    raise fail(flag, f"{kind} '{t.name}': {flag} {_NOT_YET}")
    for g in msg.instance_group:
        _refuse_group(g, backend, fail)
    if backend == "onnxruntime":
        for key in _ORT_PARAMETERS:
            if key in msg.parameters:
                raise fail(key, f"parameter {key} {_NOT_YET}: gepool runs onnxruntime sequentially with its own "
                                f"arena settings, so it would be ignored")


def _refuse_group(g: pb.ModelInstanceGroup, backend: str, fail: Fail) -> None:
    # a kind the backend cannot run is refused by its placement hook (workers/backends), which knows them
    kind = pb.ModelInstanceGroup.Kind.Name(g.kind)
    if g.gpus and kind not in ("KIND_GPU", "KIND_AUTO") and backend != "ge":
        raise fail("gpus", f"instance_group gpus {list(g.gpus)} need kind KIND_GPU, not {kind}")
    if g.HasField("rate_limiter"):
        raise fail("rate_limiter", f"instance_group rate_limiter {_NOT_YET}")
    for name in ("secondary_devices", "profile", "host_policy", "passive"):
        if getattr(g, name):
            raise fail(name, f"instance_group {name} {_NOT_YET}")
    if g.policy == pb.ModelInstanceGroup.round_robin:
        raise fail("policy", f"instance_group policy round_robin {_NOT_YET}: gepool sends each batch to the "
                             f"instance with the least work outstanding (load_balance)")


# what Triton's ensemble scheduler has no use for: the steps' own models batch, place and warm up
_NOT_FOR_ENSEMBLES = ("instance_group", "model_warmup", "default_model_filename", "parameters", "response_cache")


def refuse_for_ensemble(msg: pb.ModelConfig, fail: Fail) -> None:
    """Raises for a field an ensemble would accept and not apply (its steps' models do that work)."""
    for name in _NOT_FOR_ENSEMBLES:
        present = msg.HasField(name) if name == "response_cache" else bool(getattr(msg, name))
        if present:
            raise fail(name, f"{name} does not apply to an ensemble (platform 'ensemble'): set it in the "
                             f"config of the step's model")


def refuse_unimplemented(config, fail: Fail) -> None:
    """Parsed, checked and kept in the typed config, but not served yet: one check per feature. None waits
    at present (response_cache and label_filename are served by the front); the next such field goes here."""
    del config, fail


def not_carried(detail: str, field: str | None) -> str:
    """protobuf's refusal of an unknown field, in gepool's words where Triton's message has the field."""
    found = re.search(r'Message type "gepool\.inference\.([\w.]+)" has no field named', detail)
    words = TRITON_ONLY_FIELDS.get(found.group(1), {}).get(field) if found else None
    return f"{words} {_NOT_YET}" if words else detail
