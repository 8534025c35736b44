"""Checks gepool's ge backend on a real Ascend card and prints a report to send to the maintainers.

    python tools/ascend_check.py --om model.om --input x.npy [--input ...] --reference y.npy [...]
                                 [--device 0] [--streams 2] [--rtol 1e-3] [--atol 1e-3] [--json report.json]

Compiles nothing: it loads the given `.om`, writes a config.pbtxt from the model's own description, and
drives the backend's own code path (GeBackend over a real slot ring, as a worker does) through every
feature: each batch gear and the padding to a gear, several streams at once, the device's status and
memory, close() with batches in flight, and an execution timeout. Outputs are compared with the given
reference arrays, row by row (the reference holds the model's outputs for the given inputs, batch
first). Each phase runs in a child process with a deadline, so a hung card cannot hang the check.
Exit status: 0 when every check passed, 1 when one failed, 2 when the check could not run.
"""

import argparse
import json
import logging
import multiprocessing
import os
import platform
import queue
import sys
import tempfile
import time
import traceback

import numpy as np

PHASE_TIMEOUT_S = 600
TIMEOUT_CHECK_MS = 1  # an execution_timeout_ms no real batch meets: the timeout path must fire
WAIT_S = 120


class Harness:
    """A GeBackend fed through a real slot ring, the way the worker's loop feeds it."""

    def __init__(self, config, version_dir: str, device: str) -> None:
        from gepool.ipc.ring import Ring
        from gepool.workers.backends.ge import GeBackend

        self.config = config
        self.backend = GeBackend(config, version_dir, device, 1)
        slot_bytes = 4096 + sum(self._bytes(t) for t in (*config.inputs, *config.outputs))
        self.ring = Ring.create(f"/gepool.{os.getpid()}xascend-check", 2 * self.backend.stream_count + 2, slot_bytes)
        self.ring.segment.unlink()  # nothing else maps it: gone with this process whatever happens
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.lost: list[str] = []
        self.seq = 0
        self.free = list(range(len(self.ring.slots)))
        self.backend.start(lambda i, s: self.done.put(i), lambda reason: (self.lost.append(reason), self.done.put(-1)))

    def _bytes(self, t) -> int:
        from gepool.ipc import dtypes, layout

        rows = max(self.config.max_batch_size, 1)
        return layout.align(rows * int(np.prod(t.dims, dtype=np.int64)) * dtypes.itemsize(t.datatype)) + 256

    def submit(self, arrays: list[np.ndarray]) -> int:
        from gepool.ipc import dtypes, layout
        from gepool.ipc.ring import TensorDesc

        index = self.free.pop(0)
        slot = self.ring.slots[index]
        descs, pos = [], 0
        for a in arrays:
            a = np.ascontiguousarray(a)
            slot.data[pos:pos + a.nbytes] = a.tobytes()
            descs.append(TensorDesc(dtypes.from_numpy(a.dtype), a.shape, pos, a.nbytes))
            pos = layout.align(pos + a.nbytes)
        self.seq += 1
        slot.fill(self.seq, arrays[0].shape[0] if self.config.max_batch_size else 1, descs, time.monotonic())
        self.backend.submit(slot, index, self.seq, self._plan)
        return index

    def _plan(self, slot, batch: int, in_descs: list) -> list:
        from gepool.workers.execute import plan_outputs

        start = max(d.offset + d.nbytes for d in in_descs)
        return list(plan_outputs(self.config, batch, start, slot.data_bytes).values())

    def wait(self, count: int, timeout_s: float = WAIT_S) -> list[int]:
        """The slots of ``count`` completions (-1 for a lost device), pumping queued batches as the loop does."""
        out, deadline = [], time.monotonic() + timeout_s
        while len(out) < count:
            try:
                out.append(self.done.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                missing = count - len(out)
                raise TimeoutError(f"{missing} of {count} batches did not complete in {timeout_s:.0f} s") from None
            self.backend.pump()
        return out

    def result(self, index: int) -> tuple[list[np.ndarray], str]:
        slot = self.ring.slots[index]
        _, outs, error, _ = slot.result()
        arrays = [] if error else [slot.array(d).copy() for d in outs]
        slot.release()
        self.free.append(index)
        return arrays, error

    def close(self) -> float:
        t0 = time.monotonic()
        self.backend.close()
        return time.monotonic() - t0


# -- phases (each in its own process) ------------------------------------------------------
def describe(om: str, device: int) -> dict:
    """What the host and the .om say: SoC, run mode, CANN, inputs, outputs, dynamic mode."""
    import acl

    from gepool.workers import aclconst as C
    from gepool.workers.backends.ge_describe import batch_gears

    out: dict = {"soc": acl.get_soc_name(), "python": platform.python_version()}
    version = getattr(acl, "get_cann_version", None)
    out["cann"] = version(0)[0].get("version") if version else "absent (no acl.get_cann_version)"
    assert acl.init() in (0, C.REPEAT_INITIALIZE)
    out["devices"], _ = acl.rt.get_device_count()
    assert acl.rt.set_device(device) == 0, acl.get_recent_err_msg()
    ctx, ret = acl.rt.create_context(device)
    mode, _ = acl.rt.get_run_mode()
    out["run_mode"] = "ACL_DEVICE" if mode == C.RUN_MODE_DEVICE else "ACL_HOST"
    model_id, ret = acl.mdl.load_from_file(om)
    if ret:
        raise RuntimeError(f"acl.mdl.load_from_file failed with {ret}: {acl.get_recent_err_msg()}")
    desc = acl.mdl.create_desc()
    acl.mdl.get_desc(desc, model_id)
    mb, ret = acl.mdl.get_input_index_by_name(desc, C.DYNAMIC_TENSOR_NAME)
    mb = mb if ret == 0 else -1

    def tensors(count, name, dims, dtype, skip=-1):
        return [{"name": name(desc, i), "dims": dims(desc, i)[0]["dims"], "type": C.DATATYPES.get(dtype(desc, i))}
                for i in range(count) if i != skip]

    out["inputs"] = tensors(acl.mdl.get_num_inputs(desc), acl.mdl.get_input_name_by_index, acl.mdl.get_input_dims,
                            acl.mdl.get_input_data_type, mb)
    out["outputs"] = tensors(acl.mdl.get_num_outputs(desc), acl.mdl.get_output_name_by_index,
                             acl.mdl.get_output_dims, acl.mdl.get_output_data_type)
    try:
        out["gears"] = batch_gears(acl, desc) if mb >= 0 else []
    except ValueError as exc:
        out["refused"] = str(exc)
    acl.mdl.unload(model_id)
    acl.mdl.destroy_desc(desc)
    acl.rt.destroy_context(ctx)
    acl.rt.reset_device(device)
    acl.finalize()
    return out


def write_config(folder: str, om: str, info: dict, device: int, streams: int, timeout_ms: int) -> str:
    """A model folder for the .om: config.pbtxt from its description, the .om linked in as version 1."""
    gears = info.get("gears") or []
    first = info["inputs"][0]["dims"]
    max_batch = max(gears) if gears else (first[0] if first and first[0] > 0 else 0)

    def block(ts):
        return ", ".join(f'{{ name: "{t["name"]}" data_type: TYPE_{t["type"]} dims: [ '
                         f'{", ".join(map(str, t["dims"][1:] if max_batch else t["dims"]))} ] }}' for t in ts)

    version = os.path.join(folder, "model", "1")
    os.makedirs(version, exist_ok=True)
    os.symlink(os.path.abspath(om), os.path.join(version, "model.om"))
    weights = os.path.join(os.path.dirname(os.path.abspath(om)), "weight")
    if os.path.isdir(weights):  # --external_weight: the weight folder sits beside the .om
        os.symlink(weights, os.path.join(version, "weight"))
    path = os.path.join(folder, "model", "config.pbtxt")
    with open(path, "w") as f:
        f.write(f'backend: "ge"\nmax_batch_size: {max_batch}\ninput [ {block(info["inputs"])} ]\n'
                f'output [ {block(info["outputs"])} ]\n'
                f'instance_group [ {{ count: 1 kind: KIND_ASCEND ascend_devices: [ {device} ] }} ]\n'
                f'parameters {{ key: "stream_num" value: {{ string_value: "{streams}" }} }}\n'
                f'parameters {{ key: "execution_timeout_ms" value: {{ string_value: "{timeout_ms}" }} }}\n')
    return path


def serve(folder: str, device: int, inputs: list, refs: list, rtol: float, atol: float) -> list:
    """Gears, padding, streams, device status and a close() with batches in flight."""
    from gepool.common.config import parse_config

    config = parse_config(os.path.join(folder, "model", "config.pbtxt"), "model")
    checks: list = []
    t0 = time.monotonic()
    h = Harness(config, os.path.join(folder, "model", "1"), f"ascend:{device}")
    info = h.backend.info
    checks.append(("PASS", "load", f"{info['streams']} streams, gears {info['gears']}, timed event waits "
                   f"{'yes' if info['timed_waits'] else 'no (host watchdog)'}, {time.monotonic() - t0:.2f} s"))
    rows = len(inputs[0]) if config.max_batch_size else 1
    sizes = sorted({b for g in info["gears"] for b in (g, g - 1) if 0 < b <= min(rows, config.max_batch_size or 1)})
    for n in sizes:
        name = f"gear {n}" if n in info["gears"] else f"padding {n} -> {h.backend.gear_for(n)}"
        idx = h.submit([a[:n] if config.max_batch_size else a for a in inputs])
        h.wait(1)
        checks.append(compare(name, *h.result(idx), [r[:n] if config.max_batch_size else r for r in refs], rtol, atol))
    big = min(rows, info["gears"][-1]) if config.max_batch_size else 1
    batch = [a[:big] if config.max_batch_size else a for a in inputs]
    t1 = time.monotonic()
    idx = h.submit(batch)
    h.wait(1)
    h.result(idx)
    one = time.monotonic() - t1
    count = 2 * info["streams"]
    t1 = time.monotonic()
    slots = [h.submit(batch) for _ in range(count)]
    h.wait(count)
    many = time.monotonic() - t1
    bad = [r for r in (compare("", *h.result(i), [x[:big] if config.max_batch_size else x for x in refs], rtol, atol)
                       for i in slots) if r[0] != "PASS"]
    checks.append(("FAIL" if bad else "PASS", "streams", f"{count} batches of {big} on {info['streams']} streams in "
                   f"{many:.3f} s (one alone {one:.3f} s){'; ' + bad[0][2] if bad else ''}"))
    status = h.backend.device_status()
    health = status.get("health", "absent (no acl.rt.query_device_status)")
    checks.append(("FAIL" if health in ("ABNORMAL", "LOST") else "PASS", "device status",
                   f"health {health}; memory " + (f"{status['memory_used_bytes'] / 2**20:.1f} of "
                                                   f"{status['memory_total_bytes'] / 2**20:.1f} MiB used"
                                                   if "memory_total_bytes" in status else "absent") +
                   "; utilisation " + (f"{status['utilization']}" if "utilization" in status
                                       else "absent (no acl.rt.get_device_utilization_rate)")))
    for _ in range(info["streams"]):
        h.submit(batch)
    warnings = _Warnings()
    logging.getLogger("gepool.ge").addHandler(warnings)
    spent = h.close()
    checks.append(("FAIL" if warnings.seen else "PASS", "teardown in flight",
                   f"close() with {info['streams']} batches in flight returned in {spent:.2f} s, "
                   + ("; ".join(warnings.seen) if warnings.seen else "every stream drained, everything released")))
    return checks


def timeout(folder: str, device: int, inputs: list) -> list:
    """A batch under a 1 ms execution_timeout_ms: it must fail and report the device lost; close() must drain."""
    from gepool.common.config import parse_config

    config = parse_config(os.path.join(folder, "model", "config.pbtxt"), "model")
    config.parameters["execution_timeout_ms"] = str(TIMEOUT_CHECK_MS)
    h = Harness(config, os.path.join(folder, "model", "1"), f"ascend:{device}")
    big = min(len(inputs[0]), h.backend.gears[-1]) if config.max_batch_size else 1
    t0 = time.monotonic()
    idx = h.submit([a[:big] if config.max_batch_size else a for a in inputs])
    try:
        got = h.wait(2, timeout_s=30)  # the failed batch, then the lost device
    except TimeoutError:
        got = []
    took = time.monotonic() - t0
    _, error = h.result(idx)
    warnings = _Warnings()
    logging.getLogger("gepool.ge").addHandler(warnings)
    spent = h.close()
    if not h.lost:
        return [("SKIP", "execution timeout", f"the batch finished within {TIMEOUT_CHECK_MS} ms: path not exercised")]
    drained = "every stream drained" if not warnings.seen else "; ".join(warnings.seen)
    return [("PASS" if error and -1 in got and not warnings.seen else "FAIL", "execution timeout",
             f"failed in {took:.3f} s with: {error[:200]}; worker reported lost; close() took {spent:.2f} s, "
             f"{drained}")]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def compare(name: str, outs: list, error: str, refs: list, rtol: float, atol: float) -> tuple:
    if error:
        return ("FAIL", name, f"batch failed: {error}")
    diffs = []
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            return ("FAIL", name, f"output shape {list(o.shape)}, reference {list(r.shape)}")
        diffs.append(float(np.max(np.abs(o.astype(np.float64) - r))) if o.size else 0.0)
        if not np.allclose(o, r, rtol=rtol, atol=atol):
            return ("FAIL", name, f"max |diff| {max(diffs):.3g} over rtol {rtol} atol {atol}")
    return ("PASS", name, f"max |diff| {max(diffs, default=0.0):.3g}")


# -- driver --------------------------------------------------------------------------------
def _child(fn, args, out) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        out.put(("ok", fn(*args)))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


def phase(fn, *args, timeout_s: float = PHASE_TIMEOUT_S):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, out), daemon=True)
    proc.start()
    try:
        kind, value = out.get(timeout=timeout_s)
    except queue.Empty:
        kind, value = "error", f"no answer in {timeout_s:.0f} s (the card or the driver hung)"
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return kind, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--om", required=True)
    p.add_argument("--input", action="append", required=True, help=".npy per model input, in order, batch first")
    p.add_argument("--reference", action="append", required=True, help=".npy per model output, in order")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--timeout-ms", type=int, default=60_000, help="execution_timeout_ms for the serving checks")
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--atol", type=float, default=1e-3)
    p.add_argument("--json", help="also write the report here")
    a = p.parse_args(argv)
    inputs, refs = [np.load(f) for f in a.input], [np.load(f) for f in a.reference]
    print(f"gepool ascend check: {a.om} on device {a.device}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    kind, info = phase(describe, a.om, a.device)
    if kind != "ok":
        print(f"ERROR  describe  {info}")
        return 2
    print(f"host: soc {info['soc']}, run mode {info['run_mode']}, CANN {info['cann']}, {info['devices']} device(s), "
          f"Python {info['python']}")
    for side in ("inputs", "outputs"):
        print(f"{side}: " + "; ".join(f"{t['name']} {t['type']} {t['dims']}" for t in info[side]))
    mode = f"dynamic batch, gears {info['gears']}" if info.get("gears") else "static"
    print(f"mode: {info.get('refused') or mode}")
    checks = []
    if "refused" in info:
        checks.append(("FAIL", "load", info["refused"]))
    else:
        with tempfile.TemporaryDirectory(prefix="gepool-ascend-check-") as folder:
            write_config(folder, a.om, info, a.device, a.streams, a.timeout_ms)
            for fn, args in ((serve, (folder, a.device, inputs, refs, a.rtol, a.atol)),
                             (timeout, (folder, a.device, inputs))):
                kind, value = phase(fn, *args)
                checks.extend(value if kind == "ok" else [("FAIL", fn.__name__, value)])
    for status, name, detail in checks:
        print(f"{status:5}  {name:20}  {detail}")
    counts = {s: sum(1 for c in checks if c[0] == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"RESULT: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped. "
          "Send this whole output (or the --json file) to the gepool maintainers.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"host": info, "checks": [dict(zip(("status", "check", "detail"), c)) for c in checks]}, f,
                      indent=1)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
