"""One options object: from ``gepool start``'s flags and ``Pool(...)``'s keywords through to the front."""

import logging
from dataclasses import fields

import pytest

from gepool.cli import build_parser
from gepool.cli.start import pool_options
from gepool.options import DEFAULT, OPTION_NAMES, PoolOptions
from gepool.scheduler.options import FrontOptions

# the front's own, set by no user (the sidecars' token and the regions page are made per pool by serve())
FRONT_ONLY = {"drain_timeout_s", "sidecar_token", "regions_fd"}
NOT_FLAGS = {"repository", "owner_id"}  # --model-repository gives the repository; the owner id is made per pool


def test_every_front_option_is_a_pool_option_and_every_pool_option_a_flag():
    """A field added to FrontOptions but not to PoolOptions (or to PoolOptions without its flag) fails here."""
    front = {f.name for f in fields(FrontOptions)}
    assert front - FRONT_ONLY <= OPTION_NAMES, sorted(front - FRONT_ONLY - OPTION_NAMES)
    dests = set(vars(build_parser().parse_args(["start", "--model-repository", "."])))
    assert OPTION_NAMES - NOT_FLAGS <= dests, sorted(OPTION_NAMES - NOT_FLAGS - dests)


def test_the_flags_become_options_that_survive_the_trip_to_the_front(tmp_path):
    args = build_parser().parse_args([
        "start", "--model-repository", str(tmp_path), "--endpoint", "tcp://127.0.0.1:*", "--cpu-threads", "3",
        "--log-info", "false", "--exit-timeout-secs", "2.5", "--model-control-mode", "explicit", "--load-model", "a",
        "--load-model", "b", "--repository-poll-secs", "4", "--busy-poll-us", "-1", "--disable-auto-complete-config",
        "--http-port", "9000", "--http-address", "0.0.0.0", "--grpc-address", "::1", "--metrics-address", "127.0.0.2",
        "--allow-metrics", "false", "--strict-readiness", "false",
        "--http-restricted-api", "inference:K=V", "--http-restricted-api", "logging,trace:A=B",
        "--http-max-input-size", "123456", "--grpc-port", "9001", "--grpc-restricted-protocol", "inference:k=v",
        "--max-queued-bytes", "1000000",
        "--model-load-timeout-secs", "7.5", "--cache-config", "local,size=4096", "--sidecars", "3",
        "--log-format", "ISO8601", "--id", "my-triton", "--allow-cpu-metrics", "false", "--allow-gpu-metrics", "0",
        "--log-file", "/var/log/triton.log", "--backend-config", "default-max-batch-size=8",
        "--backend-config=onnxruntime,default-max-batch-size=16", "--model-config-name", "ascend910"])
    options = pool_options(args)
    assert options == PoolOptions(
        repository=str(tmp_path), endpoint="tcp://127.0.0.1:*", cpu_threads=3, log_level=logging.WARNING,
        exit_grace_s=2.5, model_control_mode="explicit", load_models=("a", "b"), poll_secs=4.0, busy_poll_us=-1,
        auto_complete_config=False, http_port=9000, http_host="0.0.0.0", grpc_host="::1", metrics_host="127.0.0.2",
        metrics_port=0, strict_readiness=False,
        http_restricted_api=("inference:K=V", "logging,trace:A=B"), http_max_body_bytes=123456, grpc_port=9001,
        grpc_restricted_protocol=("inference:k=v",), max_queued_bytes=1_000_000, model_load_timeout_s=7.5,
        cache_size=4096, sidecars=3, log_format="ISO8601", server_id="my-triton", cpu_metrics=False,
        log_file="/var/log/triton.log",
        backend_config=("default-max-batch-size=8", "onnxruntime,default-max-batch-size=16"),
        model_config_name="ascend910")
    assert PoolOptions.decode(options.encode()) == options
    front = options.front_options()
    assert front.repository == str(tmp_path) and front.owner_id
    for f in fields(FrontOptions):
        if f.name not in FRONT_ONLY | {"repository", "owner_id"}:
            assert getattr(front, f.name) == getattr(options, f.name), f.name
    defaults = pool_options(build_parser().parse_args(["start", "--model-repository", str(tmp_path)]))
    assert (defaults.http_port, defaults.metrics_port, defaults.log_level) == (8000, 8002, logging.INFO)
    assert (defaults.grpc_port, defaults.cache_size, defaults.max_queued_bytes) == (8001, 0, 0)
    assert defaults.poll_secs == DEFAULT.poll_secs and defaults.auto_complete_config and defaults.strict_readiness
    assert [defaults.host_of(port) for port in ("http", "grpc", "metrics")] == ["127.0.0.1"] * 3
    assert [options.host_of(port) for port in ("http", "grpc", "metrics")] == ["0.0.0.0", "::1", "127.0.0.2"]
    old_flag = build_parser().parse_args(["start", "--model-repository", str(tmp_path), "--http-host", "0.0.0.0"])
    assert pool_options(old_flag).http_host == "0.0.0.0"  # gepool's own spelling stays


@pytest.mark.parametrize("given, error, words", [
    ({"model_control_mode": "sometimes"}, ValueError, "model_control_mode must be one of none, explicit, poll"),
    ({"http_restricted_api": ["inference"]}, ValueError, "option format is '<config name>:<setting>=<value>'"),
    ({"grpc_restricted_protocol": ["inference"]}, ValueError, "--grpc-restricted-protocol option format is"),
    ({"grpc_restricted_protocol": ["inference:a key=v"]}, ValueError, "'a key' cannot be a gRPC metadata key"),
    ({"http_host": ""}, ValueError, "http_host must be an address"),
    ({"log_format": "iso"}, ValueError, "log_format must be one of default, ISO8601"),
    ({"server_id": ""}, ValueError, "server_id must be a name"),
    ({"grpc_host": 5}, ValueError, "grpc_host must be a string, not 5"),
    ({"log_file": 1}, ValueError, "log_file must be a string, not 1"),
    ({"log_file": "a\0b"}, ValueError, "log_file must be a path of printable characters"),
    ({"log_file": "x\udcff.log"}, ValueError, "log_file must be a path of printable characters"),  # not UTF-8
    ({"backend_config": "default-max-batch-size=8"}, ValueError, "backend_config must be a list of strings"),
    ({"load_models": None}, ValueError, "load_models must be a list of strings, not None"),
    ({"http_port": 70000}, ValueError, "http_port must be a port number"),
    ({"poll_secs": 0}, ValueError, "poll_secs must be > 0"),
    ({"http_max_body_bytes": -1}, ValueError, "http_max_body_bytes must be >= 0"),
    ({"no_such_option": 1}, TypeError, "no_such_option"),
])
def test_a_bad_option_is_refused_at_once_naming_it(tmp_path, given, error, words):
    from gepool import Pool

    with pytest.raises(error, match=words):
        Pool(str(tmp_path), **given)


@pytest.mark.parametrize("flags, auto_complete", [
    ([], True), (["--disable-auto-complete-config"], False), (["--strict-model-config", "true"], False),
    (["--strict-model-config", "false"], True),
    (["--strict-model-config", "false", "--disable-auto-complete-config"], False),  # tritonserver's: disable wins
])
def test_tritonservers_deprecated_strict_model_config(tmp_path, flags, auto_complete):
    args = build_parser().parse_args(["start", "--model-repository", str(tmp_path), *flags])
    assert pool_options(args).auto_complete_config is auto_complete


@pytest.mark.parametrize("flags, words", [
    (["--pinned-memory-pool-byte-size", "268435456"], "--pinned-memory-pool-byte-size 268435456: gepool has no pinned"),
    (["--cuda-memory-pool-byte-size", "0:67108864"], "--cuda-memory-pool-byte-size 0:67108864: gepool has no CUDA"),
    (["--cuda-memory-pool-byte-size", "0:0", "--cuda-memory-pool-byte-size", "1:1"], "1:1: gepool has no CUDA"),
    (["--cuda-memory-pool-byte-size", "67108864"], "option format is '<GPU device ID>:<pool byte size>'. Got 67108864"),
    (["--cuda-memory-pool-byte-size", "0:-1"], "option format is '<GPU device ID>:<pool byte size>'. Got 0:-1"),
])
def test_gpu_memory_pools_can_only_be_sized_0(tmp_path, flags, words):
    from gepool.cli import UsageError

    args = build_parser().parse_args(["start", "--model-repository", str(tmp_path), *flags])
    with pytest.raises(UsageError) as raised:
        pool_options(args)
    assert words in str(raised.value), str(raised.value)
    zeros = ["--pinned-memory-pool-byte-size", "0", "--cuda-memory-pool-byte-size", "0:0"]  # no pool: as gepool is
    assert pool_options(build_parser().parse_args(["start", "--model-repository", str(tmp_path), *zeros]))


def test_gpu_metrics_can_only_be_turned_off(tmp_path):
    from gepool.cli import UsageError

    args = build_parser().parse_args(["start", "--model-repository", str(tmp_path), "--allow-gpu-metrics", "true"])
    with pytest.raises(UsageError, match="--allow-gpu-metrics true: gepool has no GPU metrics"):
        pool_options(args)
