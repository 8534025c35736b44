"""Starts `gepool start` on the example repository, runs examples/client.py against it, stops it.

    python examples/demo.py      (run examples/make_models.py first)
"""

import os
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    repo = os.path.join(HERE, "models")
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='gepool-demo-')}/gepool.sock"
    server = subprocess.Popen([sys.executable, "-m", "gepool.cli", "start", "--model-repository", repo,
                               "--endpoint", endpoint, "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    try:
        for line in server.stdout:
            print(f"[gepool start] {line.rstrip()}")
            if line.startswith("gepool ready"):
                break
        else:
            return server.wait() or 1
        for extra in ([], ["--shared-memory"]):
            print(f"\n$ python examples/client.py --endpoint {endpoint} {' '.join(extra)}")
            client = [sys.executable, os.path.join(HERE, "client.py"), "--endpoint", endpoint, *extra]
            subprocess.run(client, check=True)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        print(f"\n[gepool start] stopped with exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
