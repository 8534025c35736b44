"""A serving process freezes what its start-up built, so a full collection while serving does not walk it."""

import gc
import os
import select
import subprocess
import sys
import textwrap

import pytest

from gepool.common import gc_policy

READY_WAIT_S = 120  # the sidecar's imports on a loaded machine


@pytest.fixture
def collector():
    """settle() changes this process's collector: it is put back as it was after the test."""
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()  # this test process goes on; its objects go back to the oldest generation


def test_settle_moves_what_is_alive_out_of_every_scanned_generation(collector):
    made_at_startup = [[i] for i in range(1000)]
    assert any(o is made_at_startup for o in gc.get_objects())
    frozen_before = gc.get_freeze_count()
    gc_policy.settle()
    assert gc.get_freeze_count() >= frozen_before + len(made_at_startup)
    assert not any(o is made_at_startup for o in gc.get_objects())  # no generation holds it: never scanned
    made_later = [0]
    assert any(o is made_later for o in gc.get_objects())


def test_after_settle_young_collections_come_only_after_many_allocations(collector):
    runs = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc_policy.settle()
    gc.callbacks.append(count)
    try:
        kept = [[i] for i in range(7_000)]  # ten times CPython's default threshold of 700
        assert runs == [] and len(kept) == 7_000
        kept += [[i] for i in range(gc_policy.YOUNG_THRESHOLD)]
        assert runs and runs[0] == 0  # past the threshold, the young generation is collected
    finally:
        gc.callbacks.remove(count)


def test_the_sidecar_settles_before_it_reports_ready(tmp_path):
    """The real sidecar entry point (no ports, a front that is not there): the freeze count when it writes
    'ready' to its pipe, read through a wrapper of os.write."""
    code = textwrap.dedent("""
        import gc, os, sys
        write = os.write
        def reporting(fd, data):
            if data == b"ready\\n":
                data = b"ready frozen=%d young=%d\\n" % (gc.get_freeze_count(), gc.get_threshold()[0])
            return write(fd, data)
        os.write = reporting
        from gepool.http.server import main
        sys.exit(main(sys.argv[1:]))
    """)
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--endpoint", f"ipc://{tmp_path}/nobody.sock", "--http-port", "0",
         "--metrics-port", "0", "--ready-fd", str(w)], pass_fds=(w,), stderr=subprocess.PIPE)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as pipe:
            assert select.select([pipe], [], [], READY_WAIT_S)[0], "the sidecar wrote nothing"
            line = pipe.readline()  # the one line is written whole: readline returns once it is in
        assert line.startswith(b"ready frozen="), (line, proc.stderr.read() if proc.poll() is not None else b"")
        frozen, young = (int(field.split(b"=")[1]) for field in line.split()[1:])
        assert frozen > 10_000  # the imports' modules, classes and functions at least
        assert young == gc_policy.YOUNG_THRESHOLD
    finally:
        proc.terminate()
        proc.wait(READY_WAIT_S)
        proc.stderr.close()
