"""``gepool bench --plot``: latency against throughput, and the server's batch sizes per level, as one PNG."""

from gepool.bench.report import batch_shares
from gepool.bench.results import level_label
from gepool.common import errors


def require_matplotlib():
    """matplotlib.pyplot on a file backend, or an InvalidArgument that says how to install it (called
    before a run, so a missing package does not cost a benchmark)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise errors.InvalidArgument("--plot needs matplotlib: pip install 'gepool[plot]'") from None
    return plt


def plot(report: dict, path: str) -> None:
    plt = require_matplotlib()
    levels = [lv for lv in report["levels"] if lv["latency_ms"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, marker in (("concurrency", "o"), ("rate", "s")):
        pts = [lv for lv in levels if lv["mode"] == mode]
        if not pts:
            continue
        x = [lv["throughput_rps"] for lv in pts]
        for p, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            left.plot(x, [lv["latency_ms"][p] for lv in pts], style, marker=marker, label=f"{p} ({mode})")
        for lv, xi in zip(pts, x):
            left.annotate(f"{'c' if mode == 'concurrency' else 'r'}{lv['level']:g}", (xi, lv["latency_ms"]["p99"]),
                          fontsize=7, xytext=(3, 3), textcoords="offset points")
    left.set_xlabel("throughput (requests/s)")
    left.set_ylabel("latency (ms)")
    left.set_title(f"{report['model']}: latency against throughput")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    shares = [dict(batch_shares(lv["server"]["batch_sizes"])) for lv in levels]
    sizes = sorted({s for share_of in shares for s in share_of})
    width = 0.8 / max(1, len(levels))
    for i, (lv, share_of) in enumerate(zip(levels, shares)):
        right.bar([j + i * width for j in range(len(sizes))], [share_of.get(s, 0.0) for s in sizes], width,
                  label=level_label(lv["mode"], lv["level"]))
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [str(s) for s in sizes])
    right.set_xlabel("batch size (rows) the server ran")
    right.set_ylabel("share of batches")
    right.set_title("batch sizes per level")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
