"""The pyACL stand-in itself behaves as the reference says pyACL does, so the backend's tests mean something."""

import ctypes
import json
import os
import subprocess
import sys

import pytest

from tests import ge_repo

SCRIPT = r'''
import ctypes, json, sys, time
import numpy as np
import acl
out = {}
out["init"] = [acl.init(), acl.init()]
assert acl.rt.set_device(0) == 0
ctx, ret = acl.rt.create_context(0)
out["ctx"] = (isinstance(ctx, int) and ctx != 0, ret)
try:
    acl.rt.malloc("x", 0)
except TypeError as e:
    out["typeerror"] = str(e)
model_id, ret = acl.mdl.load_from_file(sys.argv[1])
desc = acl.mdl.create_desc(); acl.mdl.get_desc(desc, model_id)
idx, ret = acl.mdl.get_input_index_by_name(desc, "ascend_mbatch_shape_data")
out["mbatch_index"] = idx
out["gears"] = acl.mdl.get_dynamic_batch(desc)[0]
out["dims"] = acl.mdl.get_input_dims(desc, 0)[0]["dims"]
size = acl.mdl.get_input_size_by_index(desc, 0)
ins, outs = acl.mdl.create_dataset(), acl.mdl.create_dataset()
dev_in, _ = acl.rt.malloc(size, 0); mb, _ = acl.rt.malloc(8, 0)
osize = acl.mdl.get_output_size_by_index(desc, 0); dev_out, _ = acl.rt.malloc(osize, 0)
for ds, p, n in ((ins, dev_in, size), (ins, mb, 8), (outs, dev_out, osize)):
    acl.mdl.add_dataset_buffer(ds, acl.create_data_buffer(p, n))
out["bad_gear"] = acl.mdl.set_dynamic_batch_size(model_id, ins, idx, 3)
host, _ = acl.rt.malloc_host(size); hout, _ = acl.rt.malloc_host(osize)
x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
ctypes.memmove(host, x.ctypes.data, x.nbytes)
out["too_big_copy"] = acl.rt.memcpy(dev_in, 4, host, 8, 1)
s1, _ = acl.rt.create_stream(); s2, _ = acl.rt.create_stream()
acl.rt.memcpy_async(dev_in, size, host, size, 1, s1)
acl.mdl.set_dynamic_batch_size(model_id, ins, idx, 8)
acl.mdl.execute_async(model_id, ins, outs, s1)
out["second_stream"] = acl.mdl.execute_async(model_id, ins, outs, s2)
acl.rt.memcpy_async(hout, osize, dev_out, osize, 2, s1)
early = np.frombuffer((ctypes.c_ubyte * osize).from_address(hout), np.float32).copy()
out["early_all_zero"] = bool((early == 0).all())  # nothing ran before a synchronize
out["sync"] = acl.rt.synchronize_stream(s1)
late = np.frombuffer((ctypes.c_ubyte * osize).from_address(hout), np.float32)
out["late_nonzero"] = bool((late != 0).any())
out["finalize"] = [acl.finalize(), acl.finalize()]
print(json.dumps(out))
'''


def test_standin_follows_the_reference(tmp_path):
    ge_repo.net(str(tmp_path / "net.onnx"))
    om = tmp_path / "model.om"
    om.write_text(json.dumps({"onnx": "net.onnx", "gears": [1, 2, 4, 8], "exec_delay_ms": 200}))
    env = dict(os.environ, PYTHONPATH=ge_repo.STANDIN)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(om)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["init"] == [0, 100002]
    assert out["ctx"] == [True, 0]
    assert out["typeerror"] == "acl.rt.malloc args parse failed"
    assert out["mbatch_index"] == 1 and out["gears"] == {"batchCount": 4, "batch": [1, 2, 4, 8]}
    assert out["dims"] == [-1, 16]
    assert out["bad_gear"] == 145013
    assert out["too_big_copy"] != 0
    assert out["second_stream"] != 0  # one model id on two streams at once
    assert out["early_all_zero"] and out["late_nonzero"] and out["sync"] == 0
    assert out["finalize"] == [0, 100037]


def test_bytes_to_ptr_needs_bytes():
    sys.path.insert(0, ge_repo.STANDIN)
    try:
        from acl import util

        data = b"abcdef"
        assert ctypes.string_at(util.bytes_to_ptr(data), 6) == data
        with pytest.raises(ValueError, match="needs an byte"):
            util.bytes_to_ptr(bytearray(b"x"))
    finally:
        sys.path.remove(ge_repo.STANDIN)
        for name in [m for m in sys.modules if m == "acl" or m.startswith("acl.")]:
            del sys.modules[name]


STRICT = r'''
import ctypes, json, sys
import numpy as np
import acl
out = {}
acl.init(); acl.rt.set_device(0); ctx, _ = acl.rt.create_context(0)
out["no_error_yet"] = acl.get_recent_err_msg()
for name, call in (("mdl", lambda: acl.mdl.load_from_file(5)), ("rt", lambda: acl.rt.malloc("x", 0))):
    try:
        call()
    except TypeError as e:
        out["parse_" + name] = str(e)
static, _ = acl.mdl.load_from_file(sys.argv[1])
desc = acl.mdl.create_desc(); acl.mdl.get_desc(desc, static)
out["miss"] = list(acl.mdl.get_input_index_by_name(desc, "ascend_mbatch_shape_data"))
out["err_once"] = [acl.get_recent_err_msg() is not None, acl.get_recent_err_msg()]
size = acl.mdl.get_input_size_by_index(desc, 0); osize = acl.mdl.get_output_size_by_index(desc, 0)
s, _ = acl.rt.create_stream(); ev, _ = acl.rt.create_event()
def datasets(in_size, out_size, extra=()):
    ins, outs = acl.mdl.create_dataset(), acl.mdl.create_dataset()
    for ds, n in [(ins, in_size), *extra, (outs, out_size)]:
        p, _ = acl.rt.malloc(max(n, 1), 0)
        acl.mdl.add_dataset_buffer(ds, acl.create_data_buffer(p, n))
    return ins, outs
ins, outs = datasets(size - 64, osize)
out["short_by_64"] = acl.mdl.execute_async(static, ins, outs, s)
ins, outs = datasets(size - 65, osize)
out["short_by_65"] = acl.mdl.execute_async(static, ins, outs, s)  # refused when issued, not when run
acl.rt.synchronize_stream(s)
host, _ = acl.rt.malloc_host(size + 64); dev, _ = acl.rt.malloc(size, 0)
out["unaligned_copy"] = acl.rt.memcpy_async(dev, size, host + 8, 64, 1, s)
out["timeouts"] = []
for t in (0, -2, 100, -1):
    acl.rt.record_event(ev, s)
    out["timeouts"].append(acl.rt.synchronize_event_with_timeout(ev, t))
gears, _ = acl.mdl.load_from_file(sys.argv[2])
gdesc = acl.mdl.create_desc(); acl.mdl.get_desc(gdesc, gears)
idx, _ = acl.mdl.get_input_index_by_name(gdesc, "ascend_mbatch_shape_data")
gins, gouts = acl.mdl.create_dataset(), acl.mdl.create_dataset()
gsize = acl.mdl.get_input_size_by_index(gdesc, 0)
p, _ = acl.rt.malloc(gsize, 0); acl.mdl.add_dataset_buffer(gins, acl.create_data_buffer(p, gsize // 2))
mb, _ = acl.rt.malloc(4, 0); acl.mdl.add_dataset_buffer(gins, acl.create_data_buffer(mb, 4))
tiny, _ = acl.rt.malloc(4, 0); tiny_ds = acl.mdl.create_dataset()
acl.mdl.add_dataset_buffer(tiny_ds, acl.create_data_buffer(p, gsize))
acl.mdl.add_dataset_buffer(tiny_ds, acl.create_data_buffer(tiny, 2))
out["batch_zero"] = acl.mdl.set_dynamic_batch_size(gears, gins, idx, 0)
out["length_before_gear"] = acl.mdl.set_dynamic_batch_size(gears, tiny_ds, idx, 3)
out["four_bytes"] = acl.mdl.set_dynamic_batch_size(gears, gins, idx, 2)
out["four_bytes_value"] = ctypes.c_uint32.from_address(mb).value
gosize = acl.mdl.get_output_size_by_index(gdesc, 0)
op, _ = acl.rt.malloc(gosize, 0)
acl.mdl.add_dataset_buffer(gouts, acl.create_data_buffer(op, gosize))
out["dynamic_unchecked"] = acl.mdl.execute_async(gears, gins, gouts, s)
out["busy_destroy"] = acl.rt.destroy_stream(s)
out["free_queued"] = acl.rt.free(p)
out["sync"] = acl.rt.synchronize_stream(s)
print(json.dumps(out))
'''


def test_standin_is_as_strict_as_cann(tmp_path):
    ge_repo.net(str(tmp_path / "net.onnx"))
    static, gears = tmp_path / "static.om", tmp_path / "gears.om"
    static.write_text(json.dumps({"onnx": "net.onnx", "batch": 4}))
    gears.write_text(json.dumps({"onnx": "net.onnx", "gears": [1, 2, 4], "exec_delay_ms": 300}))
    env = dict(os.environ, PYTHONPATH=ge_repo.STANDIN, ACL_STANDIN_SOC="Ascend910B3")
    proc = subprocess.run([sys.executable, "-c", STRICT, str(static), str(gears)], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["no_error_yet"] is None
    assert out["parse_mdl"] == "acl.mdl.load_from_file args parse failed!"
    assert out["parse_rt"] == "acl.rt.malloc args parse failed"
    assert out["miss"][0] == 0 and out["miss"][1] != 0
    assert out["err_once"] == [True, None]  # read once, then cleared
    assert out["short_by_64"] == 0 and out["short_by_65"] == 145000
    assert out["unaligned_copy"] == 107008
    assert out["timeouts"] == [107000, 107000, 0, 0]
    assert out["batch_zero"] == 100000 and out["length_before_gear"] == 145012
    assert out["four_bytes"] == 0 and out["four_bytes_value"] == 2
    assert out["dynamic_unchecked"] == 0
    assert out["busy_destroy"] != 0 and out["free_queued"] != 0 and out["sync"] == 0


def test_standin_ascend310_takes_only_infinite_waits(tmp_path):
    script = ("import acl, json; acl.init(); acl.rt.set_device(0); acl.rt.create_context(0); "
              "s, _ = acl.rt.create_stream(); e, _ = acl.rt.create_event(); acl.rt.record_event(e, s); "
              "print(json.dumps([acl.rt.synchronize_event_with_timeout(e, 100), "
              "acl.rt.synchronize_event_with_timeout(e, -1), acl.get_soc_name()]))")
    env = dict(os.environ, PYTHONPATH=ge_repo.STANDIN, ACL_STANDIN_SOC="Ascend310")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [107000, 0, "Ascend310"]


def test_standin_mem_info_is_the_devices_and_refuses_an_unknown_attr(tmp_path):
    (tmp_path / "device0.json").write_text(json.dumps({"other_bytes": 1 << 20}))
    script = ("import acl, json; acl.init(); acl.rt.set_device(0); acl.rt.create_context(0); "
              "p, _ = acl.rt.malloc(4096, 0); "
              "print(json.dumps([acl.rt.get_mem_info(1), acl.rt.get_mem_info(10), acl.get_recent_err_msg()]))")
    env = dict(os.environ, PYTHONPATH=ge_repo.STANDIN, ACL_STANDIN_CONTROL_DIR=str(tmp_path),
               ACL_STANDIN_DEVICE_MEMORY=str(64 << 20))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (free, total, ret), bad, err = json.loads(proc.stdout)
    assert (total, ret) == (64 << 20, 0) and free == (64 << 20) - (1 << 20) - 4096  # another process's 1 MiB
    assert bad == [0, 0, 100000] and "aclrtMemAttr" in err
