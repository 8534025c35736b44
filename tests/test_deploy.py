"""The Kubernetes and KServe kit in deploy/: every manifest validates, its flags are gepool's, and its probes
answer as it expects through a real ``gepool start`` during start-up, serving and the SIGTERM drain."""

import copy
import glob
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import yaml

from gepool.cli import build_parser
from gepool.scheduler.options import DRAIN_TIMEOUT_S
from gepool.scheduler.supervisor import STOP_GRACE_S, TERMINATE_GRACE_S
from tests import kserve_schema
from tests import repo as test_repo
from tests.conftest import free_port, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
K8S_VERSION = "1.37"  # the newest schemas kubernetes-validate ships
START_TIMEOUT_S = 120
# after SIGTERM: the grace (--exit-timeout-secs), the drain, then each worker's stop, terminate and kill
STOP_BUDGET_S = DRAIN_TIMEOUT_S + STOP_GRACE_S + 2 * TERMINATE_GRACE_S
KSERVE_PORT = 8080  # the port KServe's ingress and probes reach a runtime's container on

GATED_INIT_PY = '''
import os
import time

import numpy as np


class Model:
    def initialize(self, config):
        gate = config["parameters"]["gate_file"]
        deadline = time.monotonic() + 120
        while os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)

    def execute(self, inputs):
        return {"Y": inputs["X"] * 2}
'''


def documents(pattern: str) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, pattern))):
        with open(path) as f:
            out += [(os.path.relpath(path, ROOT), doc) for doc in yaml.safe_load_all(f) if doc]
    return out


def core_documents() -> list[tuple[str, dict]]:
    return documents("kubernetes/*.yaml")


def kserve_documents(kind: str) -> list[tuple[str, dict]]:
    return [(p, d) for p, d in documents("kserve/*.yaml") if d["kind"] == kind]


def containers() -> list[tuple[str, dict, dict]]:
    """(where, the container running gepool, the pod spec around it) of every manifest."""
    out = []
    for path, doc in core_documents():
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            out += [(f"{path}:{doc['metadata']['name']}", c, pod) for c in pod["containers"]]
    for path, doc in kserve_documents("ServingRuntime"):
        out += [(f"{path}:{doc['metadata']['name']}", c, doc["spec"]) for c in doc["spec"]["containers"]]
    return out


def flags(args: list[str]):
    """``gepool start ARGS`` as gepool's own parser reads them (a flag gepool lacks fails here)."""
    return build_parser().parse_args(["start", *args])


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


# -- the manifests validate ---------------------------------------------------------------------
@pytest.mark.parametrize("path, doc", core_documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_core_manifests_validate_against_kubernetes(path, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kserve_manifests_validate_against_kserve_and_kubernetes():
    runtimes, services = kserve_documents("ServingRuntime"), kserve_documents("InferenceService")
    assert runtimes and services
    for _, runtime in runtimes:
        jsonschema.validate(runtime, kserve_schema.SERVING_RUNTIME)
        kubernetes_validate.validate(kserve_schema.pod_of_runtime(runtime), K8S_VERSION, strict=True)
    for _, isvc in services:
        jsonschema.validate(isvc, kserve_schema.INFERENCE_SERVICE)
        kubernetes_validate.validate(kserve_schema.pod_of_predictor(isvc), K8S_VERSION, strict=True)


def test_the_validation_refuses_what_kubernetes_or_kserve_would_drop_or_refuse():
    (_, runtime), (_, isvc) = kserve_documents("ServingRuntime")[0], kserve_documents("InferenceService")[0]
    (_, deployment) = next((p, d) for p, d in core_documents() if d["kind"] == "Deployment")
    bad_runtimes = [
        lambda r: r["spec"].update(terminationGracePeriodSeconds=60),  # no such field: pruned silently
        lambda r: r["spec"].update(protocolVersions=["v3"]),
        lambda r: r["spec"]["supportedModelFormats"][0].pop("name"),
        lambda r: r["spec"].pop("containers"),
    ]
    for spoil in bad_runtimes:
        doc = copy.deepcopy(runtime)
        spoil(doc)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, kserve_schema.SERVING_RUNTIME)
    doc = copy.deepcopy(runtime)
    doc["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = [8080]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(kserve_schema.pod_of_runtime(doc), K8S_VERSION, strict=True)
    for spoil in (lambda d: d["spec"]["predictor"].update(scaleMetric="queue"),
                  lambda d: d["spec"]["predictor"]["model"].pop("modelFormat"),
                  lambda d: d["spec"].pop("predictor")):
        doc = copy.deepcopy(isvc)
        spoil(doc)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, kserve_schema.INFERENCE_SERVICE)
    doc = copy.deepcopy(deployment)
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# -- the manifests say what gepool does -----------------------------------------------------------
@pytest.mark.parametrize("where, container, pod", containers(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_container_gives_gepool_flags_and_its_checks_and_ports_agree(where, container, pod):
    args = flags(container["args"])
    assert args.model_repository == ["/mnt/models"]
    assert args.http_host == "0.0.0.0"  # the pod's IP, not the container's loopback
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    # nothing answers HTTP while the models load: a liveness probe alone would kill a slow start
    assert probes["startupProbe"] == probes["livenessProbe"]
    assert {port_number(container, p["port"]) for p in probes.values()} == {args.http_port}
    assert args.http_port in [p["containerPort"] for p in container["ports"]]
    if where.startswith("deploy/kserve"):
        assert args.http_port == KSERVE_PORT
        assert pod["annotations"]["prometheus.kserve.io/port"] == str(args.metrics_port)
    cpus = float(container["resources"]["limits"]["cpu"])
    assert 1 <= args.cpu_threads <= cpus  # onnxruntime would take every core of the node by default
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    shm = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert shm["emptyDir"]["medium"] == "Memory"  # the slot rings; a container's own /dev/shm is 64 MiB
    if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts  # the endpoint and lane sockets live under /tmp


def test_termination_grace_covers_the_exit_timeout_and_the_drain():
    for path, doc in core_documents():
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            exit_timeout = flags(pod["containers"][0]["args"]).exit_grace_s
            assert exit_timeout > 0, path
            assert pod["terminationGracePeriodSeconds"] >= exit_timeout + STOP_BUDGET_S, path
    runtimes = {doc["metadata"]["name"]: doc for _, doc in kserve_documents("ServingRuntime")}
    for path, isvc in kserve_documents("InferenceService"):
        predictor = isvc["spec"]["predictor"]
        runtime = runtimes[predictor["model"]["runtime"]]
        formats = [f["name"] for f in runtime["spec"]["supportedModelFormats"]]
        assert predictor["model"]["modelFormat"]["name"] in formats
        assert predictor["model"]["protocolVersion"] in runtime["spec"]["protocolVersions"]
        exit_timeout = flags(runtime["spec"]["containers"][0]["args"]).exit_grace_s
        assert exit_timeout > 0
        assert predictor["terminationGracePeriodSeconds"] >= exit_timeout + STOP_BUDGET_S, path


def test_runtimes_serve_onnx_and_om_over_protocol_v2_only():
    formats = {f["name"] for _, r in kserve_documents("ServingRuntime") for f in r["spec"]["supportedModelFormats"]}
    assert formats == {"onnx", "om"}
    for _, runtime in kserve_documents("ServingRuntime"):
        assert runtime["spec"]["protocolVersions"] == ["v2"]  # gepool has no gRPC port to offer
        assert flags(runtime["spec"]["containers"][0]["args"]).allow_http


# -- the container recipes ------------------------------------------------------------------------
def dockerfile(name: str) -> list[tuple[str, str]]:
    """(instruction, rest) of each line of deploy/docker/NAME, continuations joined."""
    with open(os.path.join(DEPLOY, "docker", name)) as f:
        text = re.sub(r"\\\n", " ", f.read())
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.ascend"])
def test_container_recipes_copy_what_exists_and_start_gepool_with_its_flags(name):
    lines = dockerfile(name)
    copied = [shlex.split(rest)[:-1] for op, rest in lines if op == "COPY"]
    for sources in copied:
        for src in sources:
            assert os.path.exists(os.path.join(ROOT, src)), f"{name} copies {src}, which is not in the repository"
    packages = {src for sources in copied for src in sources}
    assert {"gepool", "ipc", "scheduler", "workers", "setup.cfg"} <= packages  # what setup.cfg maps
    entry = json.loads(dict(lines)["ENTRYPOINT"])
    cmd = json.loads(dict(lines)["CMD"])
    assert entry[:2] == ["tini", "--"]  # SIGTERM reaches gepool; orphans are reaped
    assert flags(cmd).exit_grace_s > 0 and flags(cmd).http_host == "0.0.0.0"
    if name == "Dockerfile.ascend":
        assert entry[2] == "/usr/local/bin/gepool-ascend"
        script = os.path.join(DEPLOY, "docker", "ascend-entrypoint.sh")
        assert subprocess.run(["sh", "-n", script]).returncode == 0
        with open(script) as f:
            assert 'exec gepool start "$@"' in f.read()
    else:
        assert entry[2:] == ["gepool", "start"]


# -- the probes through a real gepool start --------------------------------------------------------
def probe(port: int, path: str) -> int | None:
    """The HTTP status a kubelet's probe would see; None when nothing accepts the connection."""
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (ConnectionError, urllib.error.URLError):
        return None


def infer_tiny(port: int) -> np.ndarray:
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                   "data": list(range(16))}]}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/tiny/infer", body),
                                timeout=30) as r:
        return np.array(json.loads(r.read())["outputs"][0]["data"], np.float32)


def probed_containers():
    wanted = {"deploy/kubernetes/gepool.yaml:gepool", "deploy/kserve/servingruntime.yaml:gepool"}
    return [pytest.param(c, id=where) for where, c, _ in containers() if where in wanted]


@pytest.mark.parametrize("container", probed_containers())
def test_probes_answer_as_the_manifest_expects_during_start_serving_and_drain(container, tmp_path):
    """The container's own args (its exit timeout among them), with a local repository and free ports:
    while a model loads nothing answers (the startup probe waits); then live and ready; on SIGTERM ready
    turns 400 at once while live stays 200 and requests are still served; then exit code 0."""
    repo, gate = str(tmp_path / "models"), str(tmp_path / "gate")
    test_repo.make_models.make_tiny(repo)
    test_repo.write(f"{repo}/slow_start/1/model.py", GATED_INIT_PY)
    test_repo.write(f"{repo}/slow_start/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 4
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        parameters {{ key: "gate_file" value: {{ string_value: "{gate}" }} }}
    """)
    open(gate, "w").close()
    http, metrics = free_port(), free_port()
    replace = {"--model-repository": repo, "--http-host": "127.0.0.1", "--http-port": str(http),
               "--metrics-port": str(metrics)}
    args = [f"{a.split('=', 1)[0]}={replace[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in replace else a
            for a in container["args"]]
    exit_timeout = flags(args).exit_grace_s
    live, ready = container["livenessProbe"]["httpGet"]["path"], container["readinessProbe"]["httpGet"]["path"]
    proc = subprocess.Popen([sys.executable, "-m", "gepool.cli", "start", *args, "--endpoint",
                             f"ipc://{tmp_path}/probe.sock", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("gepool starting on")
        time.sleep(0.5)  # the front is loading: the gated model cannot finish while the gate exists
        assert proc.poll() is None and probe(http, live) is None and probe(http, ready) is None
        os.unlink(gate)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not (line := proc.stdout.readline()).startswith("gepool ready on"):
            assert line, f"gepool start exited: {proc.communicate()}"
        # the sidecar reaches the front on its own once it listens: readiness follows within moments
        assert probe(http, live) == 200 and wait_until(lambda: probe(http, ready) == 200)
        np.testing.assert_array_equal(infer_tiny(http), 2 * np.arange(16, dtype=np.float32) + 1)

        signaled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: probe(http, ready) == 400)
        served = infer_tiny(http)  # not ready, yet still serving
        assert probe(http, live) == 200
        np.testing.assert_array_equal(served, 2 * np.arange(16, dtype=np.float32) + 1)
        code = proc.wait(math.ceil(exit_timeout + STOP_BUDGET_S))
        assert code == 0, proc.communicate()
        assert time.monotonic() - signaled >= exit_timeout  # it served the whole grace before draining
        assert probe(http, live) is None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
