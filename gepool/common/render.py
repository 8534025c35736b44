"""A model's config as Triton's ``GET /v2/models/{m}/config`` renders it (shared/reference/triton.md §4.4)."""

import inspect

from google.protobuf import descriptor, json_format

from gepool.common import model_config_pb2 as pb
from gepool.common.config import BACKEND_ENSEMBLE, BACKEND_GE, BACKEND_ONNX, ModelConfig, QueuePolicy
from gepool.ipc import dtypes

_INT64 = {descriptor.FieldDescriptor.TYPE_INT64, descriptor.FieldDescriptor.TYPE_UINT64,
          descriptor.FieldDescriptor.TYPE_SINT64, descriptor.FieldDescriptor.TYPE_FIXED64,
          descriptor.FieldDescriptor.TYPE_SFIXED64}


def render(config: ModelConfig) -> dict:
    """The served config as Triton renders it: snake_case, defaults filled (Triton's normalisation), enums
    as names, int64 fields as JSON numbers rather than strings. It shows what gepool applies, auto-completed
    fields included, since every field it accepts is in the typed config."""
    kwargs = {"preserving_proto_field_name": True}
    if "always_print_fields_with_no_presence" in inspect.signature(json_format.MessageToDict).parameters:
        kwargs["always_print_fields_with_no_presence"] = True
    else:  # protobuf < 5.26
        kwargs["including_default_value_fields"] = True
    msg = to_message(config)
    out = json_format.MessageToDict(msg, **kwargs)
    _int64_as_numbers(msg.DESCRIPTOR, out)
    return out


def to_message(config: ModelConfig) -> pb.ModelConfig:
    """The typed config back as Triton's ModelConfig message."""
    ensemble = config.backend == BACKEND_ENSEMBLE  # Triton names no backend for one, only its platform
    msg = pb.ModelConfig(name=config.name, backend="" if ensemble else config.backend,
                         max_batch_size=config.max_batch_size, default_model_filename=config.default_model_filename)
    msg.platform = config.platform or ("onnxruntime_onnx" if config.backend == BACKEND_ONNX else "")
    policy = config.version_policy
    if policy.kind == "all":
        msg.version_policy.all.SetInParent()
    elif policy.kind == "specific":
        msg.version_policy.specific.versions.extend(policy.versions)
    else:
        msg.version_policy.latest.num_versions = policy.num_versions
    for t in config.inputs:
        msg.input.add(name=t.name, data_type=_datatype(t.datatype), dims=t.dims,
                      format=pb.ModelInput.Format.Value(t.format) if t.format else 0)
    for t in config.outputs:
        msg.output.add(name=t.name, data_type=_datatype(t.datatype), dims=t.dims, label_filename=t.label_filename)
    for i, g in enumerate(config.instance_groups):
        group = msg.instance_group.add(name=g.name or f"{config.name}_{i}", count=g.count,
                                       kind=pb.ModelInstanceGroup.Kind.Value(g.kind))
        (group.ascend_devices if config.backend == BACKEND_GE else group.gpus).extend(g.devices)
        if g.policy:
            group.policy = pb.ModelInstanceGroup.Policy.Value(g.policy)
    db = config.dynamic_batching
    if db is not None:
        out = msg.dynamic_batching
        out.SetInParent()
        out.preferred_batch_size.extend(db.preferred_batch_size)
        out.max_queue_delay_microseconds = db.max_queue_delay_us
        out.preserve_ordering = db.preserve_ordering
        out.priority_levels, out.default_priority_level = db.priority_levels, db.default_priority_level
        _queue_policy(out.default_queue_policy, db.default_queue_policy)
        for level, p in db.priority_queue_policy.items():
            _queue_policy(out.priority_queue_policy[level], p)
    for key, value in config.parameters.items():
        msg.parameters[key].string_value = value
    for w in config.model_warmup:
        sample = msg.model_warmup.add(name=w.name, batch_size=w.batch_size, count=w.count)
        for name, i in w.inputs.items():
            inp = sample.inputs[name]
            inp.data_type, inp.dims[:] = _datatype(i.datatype), i.dims
            if i.data == "file":
                inp.input_data_file = i.file
            elif i.data == "random":
                inp.random_data = True
            else:
                inp.zero_data = True
    if config.ensemble is not None:
        scheduling = msg.ensemble_scheduling
        scheduling.SetInParent()
        for step in config.ensemble.steps:
            scheduling.step.add(model_name=step.model_name, model_version=step.model_version,
                                input_map=step.input_map, output_map=step.output_map)
    else:
        msg.response_cache.enable = config.response_cache
    return msg


def _queue_policy(out: pb.ModelQueuePolicy, p: QueuePolicy) -> None:
    out.timeout_action = pb.ModelQueuePolicy.TimeoutAction.Value(p.timeout_action)
    out.default_timeout_microseconds, out.allow_timeout_override = p.default_timeout_us, p.allow_timeout_override
    out.max_queue_size = p.max_queue_size


def _datatype(datatype: str) -> int:
    return pb.DataType.Value("TYPE_STRING" if datatype == dtypes.BYTES else f"TYPE_{datatype}")


def _int64_as_numbers(desc, d: dict) -> None:
    for f in desc.fields:
        if f.name not in d:
            continue
        value = d[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            for k, v in value.items():
                if vf.message_type is not None:
                    _int64_as_numbers(vf.message_type, v)
                elif vf.type in _INT64:
                    value[k] = int(v)
        elif f.message_type is not None:
            for item in value if isinstance(value, list) else [value]:
                _int64_as_numbers(f.message_type, item)
        elif f.type in _INT64:
            d[f.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
