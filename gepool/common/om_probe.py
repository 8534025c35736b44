"""The inputs, outputs and batch gears an Ascend .om declares, read by pyACL in a throwaway process.

The front never imports pyACL nor holds a device context: a short-lived interpreter initialises ACL,
loads the model, reads its description, releases everything and prints one JSON line, which is
checked here like any other hostile input. Where pyACL is absent the probe says so and nothing is
completed.
"""

import json
import subprocess
import sys
from dataclasses import dataclass

from gepool.common.onnx_io import OnnxSignature, OnnxTensor

PROBE_TIMEOUT_S = 120.0  # ACL init and a model load; a real NPU takes seconds
MAX_REPLY_BYTES = 1 << 20
MAX_TENSORS = 4096

# aclDataType -> Triton datatype (shared/reference/pyacl.md)
ACL_DATATYPES = {0: "FP32", 1: "FP16", 2: "INT8", 3: "INT32", 4: "UINT8", 6: "INT16", 7: "UINT16", 8: "UINT32",
                 9: "INT64", 10: "UINT64", 11: "FP64", 12: "BOOL", 27: "BF16"}
DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"  # the input that carries the gear, not a model input

_PROBE = r"""
import json, sys
try:
    import acl
    acl.mdl  # the PyPI package named acl is unrelated: pyACL has this module
except (ImportError, AttributeError):
    print(json.dumps({"no_acl": True}))
    sys.exit(0)
path, device = sys.argv[1], int(sys.argv[2])
steps = []

def call(name, result):
    ret = result[-1] if isinstance(result, tuple) else result
    if ret != 0:
        raise RuntimeError(f"acl.{name} returned {ret}: {acl.get_recent_err_msg()}")
    return result[0] if isinstance(result, tuple) and len(result) == 2 else None

def tensors(kind, desc, count, skip):
    out = []
    for i in range(count):
        name = getattr(acl.mdl, f"get_{kind}_name_by_index")(desc, i)
        if name in skip:
            continue
        dims = call(f"mdl.get_{kind}_dims", getattr(acl.mdl, f"get_{kind}_dims")(desc, i))["dims"]
        out.append({"name": name, "acl_type": getattr(acl.mdl, f"get_{kind}_data_type")(desc, i), "dims": dims})
    return out

try:
    ret = acl.init()
    if ret not in (0, 100002):
        raise RuntimeError(f"acl.init returned {ret}")
    call("rt.set_device", acl.rt.set_device(device)); steps.append("device")
    ctx = call("rt.create_context", acl.rt.create_context(device)); steps.append("context")
    model_id = call("mdl.load_from_file", acl.mdl.load_from_file(path)); steps.append("model")
    desc = acl.mdl.create_desc(); steps.append("desc")
    call("mdl.get_desc", acl.mdl.get_desc(desc, model_id))
    gears = sorted(call("mdl.get_dynamic_batch", acl.mdl.get_dynamic_batch(desc)).get("batch") or [])
    reply = {"inputs": tensors("input", desc, acl.mdl.get_num_inputs(desc), {sys.argv[3]}),
             "outputs": tensors("output", desc, acl.mdl.get_num_outputs(desc), set()), "gears": gears}
except Exception as exc:
    reply = {"error": str(exc)}
finally:
    if "desc" in steps:
        acl.mdl.destroy_desc(desc)
    if "model" in steps:
        acl.mdl.unload(model_id)
    if "context" in steps:
        acl.rt.destroy_context(ctx)
    if "device" in steps:
        acl.rt.reset_device(device)
    acl.finalize()
print(json.dumps(reply))
"""


class OmProbeError(ValueError):
    """pyACL could not describe the .om; the message says why."""


@dataclass(frozen=True)
class OmSignature:
    signature: OnnxSignature  # dims with the batch position, -1 where the .om has batch gears
    gears: tuple[int, ...]  # the batch sizes it was compiled for; () for a fixed batch


def read_om_signature(path: str, device: int = 0) -> OmSignature | None:
    """What the .om at ``path`` declares, or None where pyACL is not installed."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, path, str(device), DYNAMIC_TENSOR_NAME],
                              capture_output=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise OmProbeError(f"pyACL did not describe the model within {PROBE_TIMEOUT_S:.0f}s") from None
    out = proc.stdout[-MAX_REPLY_BYTES:].decode("utf-8", "replace").strip().splitlines()
    try:
        reply = json.loads(out[-1]) if out else None
    except json.JSONDecodeError:
        reply = None
    if not isinstance(reply, dict):
        why = proc.stderr[-500:].decode("utf-8", "replace").strip() or f"exit code {proc.returncode}"
        raise OmProbeError(f"the pyACL probe failed: {why}")
    if reply.get("no_acl"):
        return None
    if "error" in reply:
        raise OmProbeError(str(reply["error"])[:1000])
    try:
        return OmSignature(OnnxSignature(_tensors(reply["inputs"]), _tensors(reply["outputs"])),
                           tuple(sorted({int(g) for g in reply["gears"] if int(g) > 0})))
    except (KeyError, TypeError, ValueError) as exc:
        raise OmProbeError(f"the pyACL probe answered what is not a model description ({exc})") from None


def _tensors(items: list) -> tuple[OnnxTensor, ...]:
    if not isinstance(items, list) or len(items) > MAX_TENSORS:
        raise ValueError("a tensor list")
    out = []
    for t in items:
        name, dims = str(t["name"]), tuple(int(d) for d in t["dims"])
        datatype = ACL_DATATYPES.get(int(t["acl_type"]))
        out.append(OnnxTensor(name, datatype, dims, f"aclDataType {int(t['acl_type'])}"))
    return tuple(out)
