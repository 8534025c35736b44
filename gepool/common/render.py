"""A model's config as Triton's ``GET /v2/models/{m}/config`` renders it (shared/reference/triton.md §4.4)."""

import inspect

from google.protobuf import descriptor, json_format, text_format

from gepool.common import model_config_pb2 as pb
from gepool.common.config import BACKEND_ONNX, parse_config


def render_config(path: str, model_name: str) -> dict:
    """The model's config as Triton's ``GET /v2/models/{m}/config`` renders it: snake_case, defaults filled
    (Triton's normalisation), enums as names, and int64 fields as JSON numbers rather than strings."""
    with open(path, encoding="utf-8") as f:
        msg = text_format.Parse(f.read(), pb.ModelConfig())
    cfg = parse_config(path, model_name)
    msg.name = model_name
    if cfg.backend == BACKEND_ONNX:
        msg.platform, msg.backend = msg.platform or "onnxruntime_onnx", "onnxruntime"
    if msg.HasField("dynamic_batching") and not msg.dynamic_batching.preferred_batch_size:
        msg.dynamic_batching.preferred_batch_size.append(msg.max_batch_size)
    if not msg.HasField("version_policy"):
        msg.version_policy.latest.num_versions = 1
    if not msg.instance_group:
        msg.instance_group.add(count=1)
    for i, g in enumerate(msg.instance_group):
        g.name = g.name or f"{model_name}_{i}"
        group = cfg.instance_groups[i]
        g.kind = pb.ModelInstanceGroup.Kind.Value(group.kind)
        g.count = group.count
    kwargs = {"preserving_proto_field_name": True}
    if "always_print_fields_with_no_presence" in inspect.signature(json_format.MessageToDict).parameters:
        kwargs["always_print_fields_with_no_presence"] = True
    else:  # protobuf < 5.26
        kwargs["including_default_value_fields"] = True
    out = json_format.MessageToDict(msg, **kwargs)
    int64 = {descriptor.FieldDescriptor.TYPE_INT64, descriptor.FieldDescriptor.TYPE_UINT64,
             descriptor.FieldDescriptor.TYPE_SINT64, descriptor.FieldDescriptor.TYPE_FIXED64,
             descriptor.FieldDescriptor.TYPE_SFIXED64}

    def fix(desc, d: dict) -> None:
        for f in desc.fields:
            if f.name not in d:
                continue
            value = d[f.name]
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                vf = f.message_type.fields_by_name["value"]
                for k, v in value.items():
                    if vf.message_type is not None:
                        fix(vf.message_type, v)
                    elif vf.type in int64:
                        value[k] = int(v)
            elif f.message_type is not None:
                for item in value if isinstance(value, list) else [value]:
                    fix(f.message_type, item)
            elif f.type in int64:
                d[f.name] = [int(v) for v in value] if isinstance(value, list) else int(value)

    fix(msg.DESCRIPTOR, out)
    return out
