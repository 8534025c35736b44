"""The front's loop runs its housekeeping tick on its own deadlines and cadence, not on every queue timer."""

import os
import subprocess
import sys
import textwrap

from tests.repo import make_models

REQUESTS = 40

# A front in this process (as tools/front_calls.py runs one), its tick counted, its cadence set past the
# run: every tick left is one that an event or a deadline caused. The client sends requests one at a time;
# each waits in the queue for its delay, so each is dispatched by a timer.
SCRIPT = textwrap.dedent("""
    import logging, os, signal, sys, threading
    import numpy as np
    import gepool
    from gepool import pool
    from gepool.ipc import naming
    from gepool.scheduler import core, loop
    from gepool.scheduler.front import Front, FrontOptions

    loop.TICK_S = 1000.0
    ticks = [0]
    counted = core.Core.tick
    def tick(self, now):
        ticks[0] += 1
        return counted(self, now)
    core.Core.tick = tick
    repo, requests, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    endpoint = f"ipc://{folder}/front.sock"
    opts = FrontOptions(repository=repo, endpoint=endpoint, owner_id=naming.new_owner_id(), busy_poll_us=-1,
                        log_level=logging.WARNING)
    ready, seen = threading.Event(), []
    def client():
        ready.wait()
        try:
            with gepool.Client(endpoint) as c:
                c.infer("tiny", {"INPUT0": np.ones((1, 16), np.float32)})  # connected, the model warm
                before = ticks[0]
                for i in range(requests):
                    out = c.infer("tiny", {"INPUT0": np.full((1, 16), i, np.float32)})["OUTPUT0"]
                    seen.append(float(out[0, 0]) == 2 * i + 1)
                print(f"TICKS {ticks[0] - before} ANSWERED {sum(seen)}", flush=True)
        finally:
            os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=client, daemon=True).start()
    Front(opts, pool.start_worker, lambda status: ready.set(), place=pool.place_workers).run()
""")


def test_a_queue_timer_does_not_run_the_housekeeping_tick(tmp_path):
    repo = str(tmp_path / "repo")
    make_models.make_tiny(repo)
    config = os.path.join(repo, "tiny", "config.pbtxt")
    with open(config) as f:
        text = f.read()
    assert "dynamic_batching { }" in text
    with open(config, "w") as f:  # a lone request waits 2 ms for more: a timer sends it
        f.write(text.replace("dynamic_batching { }",
                             "dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 2000 }"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, repo, str(REQUESTS), str(tmp_path)], capture_output=True,
                          text=True, timeout=180)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TICKS")), None)
    assert line is not None, proc.stdout + proc.stderr
    _, ticks, _, answered = line.split()
    assert int(answered) == REQUESTS
    # before: a tick for each request's timer; now the workers' statistics (every 2 s) are what ticks
    assert int(ticks) < REQUESTS // 2, line
