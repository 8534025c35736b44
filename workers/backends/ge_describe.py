"""What an `.om` says about itself, checked against config.pbtxt: inputs, outputs, and its dynamic mode."""

from gepool.common.config import ModelConfig
from gepool.workers import aclconst as C

NO_DYNAMIC_ARG = -1  # get_dynamic_hw / get_input_dynamic_gear_count: -1 = the model's own gears


def batch_gears(acl, desc: int) -> list[int]:
    """The batch gears of a model with the ascend_mbatch_shape_data input, or a ValueError naming its mode.

    ATC gives that input to models compiled with --dynamic_batch_size, --dynamic_image_size or
    --dynamic_dims alike; only the first reports batch gears (get_dynamic_batch then has batchCount > 0)."""
    info, ret = acl.mdl.get_dynamic_batch(desc)
    if ret == C.SUCCESS and info.get("batchCount", 0) > 0:
        return sorted(info["batch"])
    acl.get_recent_err_msg()
    serves = ("gepool's ge backend serves static models and dynamic batch (ATC --dynamic_batch_size) only: "
              "compile the model with a fixed shape or with batch gears")
    get_hw = getattr(acl.mdl, "get_dynamic_hw", None)
    if get_hw is not None:
        hw, ret = get_hw(desc, NO_DYNAMIC_ARG)
        if ret == C.SUCCESS and hw.get("hwCount", 0) > 0:
            raise ValueError(f"the .om was compiled with dynamic image size (ATC --dynamic_image_size, height x "
                             f"width gears {hw.get('hw')}); {serves}")
    gear_count = getattr(acl.mdl, "get_input_dynamic_gear_count", None)
    if gear_count is not None:
        count, ret = gear_count(desc, NO_DYNAMIC_ARG)
        if ret == C.SUCCESS and count > 0:
            raise ValueError(f"the .om was compiled with dynamic dims (ATC --dynamic_dims, {count} gears); {serves}")
    acl.get_recent_err_msg()
    raise ValueError(f"the .om has the {C.DYNAMIC_TENSOR_NAME} input but reports no batch, image-size or dims "
                     f"gears (a dynamic mode this CANN release does not describe); {serves}")


def check_model(acl, call, cfg: ModelConfig, desc: int, mbatch_index: int, n_inputs: int, n_outputs: int) -> list[int]:
    """Reads the model description and checks it against config.pbtxt; returns the batch gears."""
    real = [i for i in range(n_inputs) if i != mbatch_index]
    names = [acl.mdl.get_input_name_by_index(desc, i) for i in real]
    if len(real) != len(cfg.inputs) or n_outputs != len(cfg.outputs):
        raise ValueError(f"the .om has {len(real)} inputs and {n_outputs} outputs, config.pbtxt "
                         f"declares {len(cfg.inputs)} and {len(cfg.outputs)}")
    if mbatch_index >= 0:
        gears = batch_gears(acl, desc)
    else:
        dims = call("mdl.get_input_dims", acl.mdl.get_input_dims(desc, real[0]))["dims"]
        gears = [dims[0]] if cfg.max_batch_size > 0 else [1]
    for t, i in zip(cfg.inputs, real):
        if acl.mdl.get_input_name_by_index(desc, i) != t.name:
            raise ValueError(f"config input '{t.name}' is not the .om's input {i} (the .om has {names})")
        _check(call, cfg, t, acl.mdl.get_input_data_type(desc, i), acl.mdl.get_input_dims(desc, i), "input")
    for j, t in enumerate(cfg.outputs):
        _check(call, cfg, t, acl.mdl.get_output_data_type(desc, j), acl.mdl.get_output_dims(desc, j), "output")
    if cfg.max_batch_size > gears[-1]:
        raise ValueError(f"max_batch_size {cfg.max_batch_size} exceeds the largest batch the .om was "
                         f"compiled for ({gears[-1]}; gears {gears})")
    return gears


def _check(call, cfg: ModelConfig, t, acl_type: int, dims_ret, kind: str) -> None:
    datatype = C.DATATYPES.get(acl_type)
    if datatype != t.datatype:
        raise ValueError(f"{kind} '{t.name}': config says TYPE_{t.datatype}, the .om has aclDataType {acl_type}")
    dims = call(f"mdl.get_{kind}_dims", dims_ret)["dims"]
    want = list(t.dims)
    have = dims if cfg.max_batch_size == 0 else dims[1:]
    if len(have) != len(want) or any(w != -1 and w != h for w, h in zip(want, have)):
        raise ValueError(f"{kind} '{t.name}': config dims {list(t.dims)} do not match the .om's {dims}")
