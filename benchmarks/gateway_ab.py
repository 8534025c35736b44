"""Two versions of gepool under the gateway benchmark, alternating in one run: CPU per request by process.

    python benchmarks/gateway_ab.py --base REV [--head REV] [--rounds 3] [--seconds 8] [--models tiny,mlp]
        [--levels 64] [--tools wrk] [--base-http-server SERVER] [--head-http-server SERVER]
        [--base-path DIR] [--head-path DIR]
    python benchmarks/gateway_ab.py --base HEAD --head-http-server granian ...   (one tree, both servers)

Each round runs the head's ``benchmarks/gateway_bench.py`` on the base and on the head (the working tree
when no ``--head`` is given; base first in odd rounds, head first in even ones, so that a host's drifting
load falls on both alike), each on its own package: a revision is exported with ``git archive`` into a
temporary folder and laid out as the installed package (``gepool.ipc`` = ``ipc/``, ...) on PYTHONPATH,
ahead of the editable install. The table at the end gives, per model, tool and concurrency, the median
over the rounds of req/s and of each process's CPU microseconds per request (on a shared host the
CPU per request is the figure to compare, not req/s), and the head's change against the base, with each
round's own change beside it: a difference smaller than their spread is noise (an A/A run of one tree
against itself on a two-core host has given +7.8% for the sidecar's median).
``--base-http-server``/``--head-http-server`` choose the sidecar's HTTP server on each side
(``gateway_bench.py --http-server``; without one, each side's pool default; a tree from before that option has
only aiohttp). ``--base-path``/``--head-path`` put a folder on that side's PYTHONPATH after its package, ahead of
site-packages: one tree against itself with another release of a dependency (``pip install --target DIR
orjson==3.8.3``, then ``--base HEAD --base-path DIR``).
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACKAGES = {"ipc": "ipc", "scheduler": "scheduler", "workers": "workers"}  # setup.cfg's package_dir
ROW = re.compile(r"^(\w+)\s+(\w+)\s+(\d+)\s+([\d.]+|nan)\s+([\d.]+|nan)\s+([\d.]+|nan)\s+([\d.]+|nan)\s+(.*)$")


def tree(rev: str | None, into: str) -> str:
    """A source tree of ``rev`` (None: the working tree as it is), and the import root laid over it."""
    if rev is None:
        src = ROOT
    else:
        src = os.path.join(into, "src")
        os.makedirs(src)
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        tools = os.path.join(ROOT, ".perf_analyzer")  # untracked (.ci/run extracts it): the export lacks it
        if os.path.isdir(tools):
            os.symlink(tools, os.path.join(src, ".perf_analyzer"))
    pkg = os.path.join(into, "root", "gepool")
    os.makedirs(pkg)
    for entry in os.listdir(os.path.join(src, "gepool")):
        os.symlink(os.path.join(src, "gepool", entry), os.path.join(pkg, entry))
    for name, folder in PACKAGES.items():
        os.symlink(os.path.join(src, folder), os.path.join(pkg, name))
    return src



def ab_rounds(script: str, base: str | None, head: str | None, rounds: int, args_for, prefix: str):
    """Runs ``script --child ARGS`` (``args_for(label, round)``) from each version's own tree in turn, base
    first in even rounds and head first in odd ones, and yields (round, label, stdout, its RESULT floats)."""
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        versions = {}
        for label, rev in (("base", base), ("head", head)) if base else (("head", head),):
            into = os.path.join(work, label)
            tree(rev, into)
            versions[label] = os.path.join(into, "root")
        for r in range(rounds):
            for label, root in list(versions.items())[::1 if r % 2 == 0 else -1]:
                proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", *args_for(label, r)],
                                      capture_output=True, text=True, cwd=root, env=dict(os.environ, PYTHONPATH=root))
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"no result from {label}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
                yield r, label, proc.stdout, [float(v) for v in line.split()[1:]]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(src: str, root: str, args: argparse.Namespace, http_server: str | None, path: str | None = None) -> dict:
    """{(model, tool, conc): {"rps": .., label: cpu us}} from one run of ``src``'s gateway_bench on ``root``'s
    package (and ``path`` after it, ahead of site-packages)."""
    env = dict(os.environ, PYTHONPATH=root if path is None else root + os.pathsep + os.path.abspath(path))
    cmd = [sys.executable, os.path.join(src, "benchmarks", "gateway_bench.py"), "--seconds", str(args.seconds),
           "--levels", args.levels, "--models", args.models, "--tools", args.tools]
    if http_server:
        cmd += ["--http-server", http_server]
    # not from src: its gepool/ (without ipc/) would come first on sys.path
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    lines = proc.stdout.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("model tool"))
    except StopIteration:
        raise SystemExit(f"no table from {src}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}") from None
    labels = [h.removesuffix(" us") for h in re.findall(r"(\S+ us)", lines[start])]
    out = {}
    for line in lines[start + 1:]:
        m = ROW.match(line)
        if m is None:
            continue
        model, tool, conc, rps, _p50, p99, _batch, rest = m.groups()
        row = {"rps": float(rps), "p99_us": float(p99) * 1000}
        row.update(zip(labels, (float(v) for v in rest.split())))
        out[(model, tool, int(conc))] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the revision to compare against (e.g. main, a commit)")
    p.add_argument("--head", help="the revision measured against it (default: the working tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="per level, tool and version")
    p.add_argument("--models", default="tiny,mlp")
    p.add_argument("--levels", default="64")
    p.add_argument("--tools", default="wrk")
    p.add_argument("--base-http-server", help="the base's sidecar server: aiohttp, granian or httptools (default: "
                                              "its pool's)")
    p.add_argument("--head-http-server", help="the head's sidecar server (default: its pool's)")
    p.add_argument("--base-path", help="a folder on the base's PYTHONPATH ahead of site-packages (another release "
                                       "of a dependency, installed there with pip install --target)")
    p.add_argument("--head-path", help="the same for the head")
    args = p.parse_args()
    servers = {"base": args.base_http_server, "head": args.head_http_server}
    paths = {"base": args.base_path, "head": args.head_path}
    for label, path in paths.items():
        if path is not None and not os.path.isdir(path):
            p.error(f"--{label}-path {path}: not a folder")
    work = tempfile.mkdtemp(prefix="gepool-ab-")
    try:
        versions = {}
        for label, rev in (("base", args.base), ("head", args.head)):
            into = os.path.join(work, label)
            versions[label] = (tree(rev, into), os.path.join(into, "root"))
        results: dict[str, list[dict]] = {"base": [], "head": []}
        for r in range(args.rounds):
            order = list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]  # ABBA: drift cancels
            for label, (_, root) in order:
                # one harness for both: the head's script (a base's may lack a tool), each side's own package
                results[label].append(run(versions["head"][0], root, args, servers[label], paths[label]))
                for key, row in sorted(results[label][-1].items()):
                    print(f"round {r + 1} {label:4s} {' '.join(map(str, key)):14s} "
                          + " ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on = {label: (server or "its default server") + (f" with {paths[label]} first" if paths[label] else "")
          for label, server in servers.items()}
    print(f"\nmedians over {args.rounds} rounds (base {args.base} on {on['base']}, head {args.head or 'working tree'} "
          f"on {on['head']}; p99 latency and CPU per request in us)")
    keys = sorted(set().union(*(set(r) for r in results["base"] + results["head"])))
    for key in keys:
        fields = sorted({f for label in results for r in results[label] for f in r.get(key, {})},
                        key=lambda f: (f != "rps", f != "p99_us", f != "sidecar", f != "front", f))
        for f in fields:
            med = {label: statistics.median([r[key][f] for r in results[label] if key in r and f in r[key]])
                   for label in results}
            change = (med["head"] / med["base"] - 1) * 100 if med["base"] else float("nan")
            # each round's own change (its base and head ran back to back): where they disagree in sign, the
            # medians' difference is the host's noise, not the change's
            rounds = [f"{(h[key][f] / b[key][f] - 1) * 100:+.1f}" for b, h in zip(results["base"], results["head"])
                      if key in b and key in h and f in b[key] and f in h[key] and b[key][f]]
            print(f"{' '.join(map(str, key)):14s} {f:10s} base {med['base']:9.0f} head {med['head']:9.0f} "
                  f"{change:+6.1f}%  (rounds {' '.join(rounds)})")


if __name__ == "__main__":
    main()
