"""An NPU's health and utilisation as pyACL reports them; a call this CANN release lacks is left out, never zero."""

from gepool.workers import aclconst as C

HEALTHY, ABNORMAL, LOST = "HEALTHY", "ABNORMAL", "LOST"


def device_status(acl, device_id: int) -> dict:
    """What the worker reports about its device (call from a thread whose context is current):

    - ``utilization_ratio``: AI Core (cube) utilisation, 0..1, and ``utilization`` with every unit pyACL
      gives (acl.rt.get_device_utilization_rate, newer CANN only);
    - ``memory_used_bytes`` / ``memory_total_bytes`` (acl.rt.get_mem_info, HBM, or DDR where the SoC
      has no HBM);
    - ``health``: HEALTHY or ABNORMAL (acl.rt.query_device_status, newer CANN only).
    """
    out: dict = {}
    for query in (_utilization, _memory, _health):
        try:
            query(acl, device_id, out)
        except (TypeError, ValueError, KeyError):  # a release whose call has another shape: left out
            pass
    return out


def _utilization(acl, device_id: int, out: dict) -> None:
    util = getattr(acl.rt, "get_device_utilization_rate", None)
    if util is None:
        return
    info, ret = util(device_id)
    if ret == C.SUCCESS and isinstance(info, dict):
        units = {k.removesuffix("_utilization"): v / 100 for k, v in info.items()
                 if k.endswith("_utilization") and isinstance(v, int) and 0 <= v <= 100}
        if "cube" in units:
            out["utilization_ratio"] = units["cube"]
        if units:
            out["utilization"] = units


def _memory(acl, device_id: int, out: dict) -> None:
    mem = getattr(acl.rt, "get_mem_info", None)
    if mem is None:
        return
    for attr in (C.MEM_HBM, C.MEM_DDR):
        free, total, ret = mem(attr)
        if ret == C.SUCCESS and total > 0:
            out["memory_used_bytes"], out["memory_total_bytes"] = total - free, total
            break
    acl.get_recent_err_msg()  # a failed HBM query must not stick to a later error's message


def _health(acl, device_id: int, out: dict) -> None:
    status = getattr(acl.rt, "query_device_status", None)
    if status is None:
        return
    value, ret = status(device_id)
    if ret == C.SUCCESS:
        out["health"] = HEALTHY if value == C.DEVICE_STATUS_NORMAL else ABNORMAL
