"""Load a pool at concurrency levels or Poisson rates and report latency, throughput and the server's view."""

from gepool.bench.display import Display, Progress, TerminalDisplay, format_progress
from gepool.bench.http import bench_http
from gepool.bench.library import bench, pool_setup
from gepool.bench.load import make_inputs, poisson_arrivals, request_rows, run_level
from gepool.bench.plot import plot, require_matplotlib
from gepool.bench.report import batch_shares, format_report
from gepool.bench.results import Level, batch_counts, level_label, percentiles, server_window
from gepool.bench.sweep import TIE_SHARE, best_trial, format_sweep, sweep

__all__ = ["TIE_SHARE", "Display", "Level", "Progress", "TerminalDisplay", "batch_counts", "batch_shares", "bench",
           "bench_http", "best_trial", "format_progress", "format_report", "format_sweep", "level_label",
           "make_inputs", "percentiles", "plot", "poisson_arrivals", "pool_setup", "request_rows",
           "require_matplotlib", "run_level", "server_window", "sweep"]
