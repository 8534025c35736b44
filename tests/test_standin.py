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
