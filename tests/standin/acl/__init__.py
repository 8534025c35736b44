"""A stand-in for CANN's pyACL (`import acl`) for tests on hosts without an NPU.

It follows the real module's shape and conventions (shared/reference/pyacl.md §0 and §10):
sub-modules rt, mdl, util; functions only, no constants; int handles; ``(value, ret)`` tuples
with ret last; bare getters; TypeError "acl.<sub>.<name> args parse failed" on bad argument
types. Production code never imports this package: tests put it on sys.path for workers.
Set ACL_STANDIN_REPORT_DIR to get a JSON report (leaks, overlap counts) per process at finalize.
"""

from acl import _state as S
from acl import mdl, rt, util  # noqa: F401  (sub-modules as attributes, like the C extension)
from acl._args import checked


@checked("init", optional=(str,))
def init(config_path: str = "") -> int:
    with S.lock:
        S.stats["init_calls"] += 1
        if S.initialized:
            return S.set_error(S.REPEAT_INITIALIZE, "acl.init called twice")
        S.initialized, S.finalized = True, False
        return S.SUCCESS


@checked("finalize")
def finalize() -> int:
    with S.lock:
        if not S.initialized:
            return S.set_error(S.REPEAT_FINALIZE, "acl.finalize without init")
        S.initialized, S.finalized = False, True
        for s in S.streams.values():
            s.stop()
        S.write_report(True)
        return S.SUCCESS


def get_recent_err_msg() -> str | None:
    """The calling thread's last error text, cleared by reading it ("获取并清空", docs/zh/api_ref/
    13_exception_handling.md); None when there is none (py_init_acl.cpp builds "s" from a NULL)."""
    text = getattr(S.local, "err", None)
    S.local.err = None
    return text or None


def get_soc_name() -> str:
    return S.SOC


@checked("create_data_buffer", int, int)
def create_data_buffer(ptr: int, size: int) -> int:
    handle = S.new_id()
    S.data_buffers[handle] = [ptr, size]
    return handle


@checked("destroy_data_buffer", int)
def destroy_data_buffer(buffer: int) -> int:
    if S.data_buffers.pop(buffer, None) is None:
        return S.set_error(S.INVALID_PARAM, f"data buffer {buffer:#x} does not exist")
    return S.SUCCESS


@checked("get_data_buffer_addr", int)
def get_data_buffer_addr(buffer: int) -> int:
    return S.data_buffers.get(buffer, [0, 0])[0]


@checked("get_data_buffer_size", int)
def get_data_buffer_size(buffer: int) -> int:
    return S.data_buffers.get(buffer, [0, 0])[1]


@checked("update_data_buffer", int, int, int)
def update_data_buffer(buffer: int, ptr: int, size: int) -> int:
    if buffer not in S.data_buffers:
        return S.set_error(S.INVALID_PARAM, f"data buffer {buffer:#x} does not exist")
    S.data_buffers[buffer] = [ptr, size]
    return S.SUCCESS
