"""Ensembles served by a real pool: each step batched in its model's own queue, the outputs those of the
steps run one after another, errors named by step, and tritonclient unchanged."""

import os
import threading

import numpy as np
import pytest

from gepool import Client, Pool
from gepool.common import errors
from tests.conftest import free_port, wait_until
from tests.repo import ADD_PY, bytes_model, make_models, recorder, write

TOP_K = make_models.TOP_K

PLUS_PY = '''
import numpy as np


class Model:
    def execute(self, inputs):
        return {"OUTPUT": inputs["INPUT"] + np.float32(1)}
'''

# Each branch says it started, then waits (with a deadline) for the other branch to start: run one after
# the other, the first finds no partner and answers 0; run at once, both answer 1. The input's first value
# names the request (0, the warm-up's zeros, waits for nobody).
BRANCH_PY = '''
import os
import time

import numpy as np


class Model:
    def initialize(self, config):
        self.me = config["parameters"]["me"]
        self.other = config["parameters"]["other"]

    def execute(self, inputs):
        x = inputs["INPUT"]
        token = int(x[0, 0])
        if token == 0:
            return {"OUTPUT": np.zeros_like(x)}
        open(f"{self.me}.{token}", "w").close()
        deadline = time.monotonic() + 20
        while not os.path.exists(f"{self.other}.{token}") and time.monotonic() < deadline:
            time.sleep(0.005)
        return {"OUTPUT": np.full_like(x, np.float32(os.path.exists(f"{self.other}.{token}")))}
'''


def _reload_add_under_traffic(endpoint: str, c, repo: str, ensemble: str, x, clients: int) -> None:
    """Version 2 of step model 'add' is loaded while ``clients`` threads infer ``ensemble``: none fails, and
    the new version takes over."""
    stop, seen, failures = threading.Event(), set(), []

    def load() -> None:
        with Client(endpoint, timeout=60) as lc:
            while not stop.is_set():
                try:
                    seen.add(float(lc.infer(ensemble, {"X": x})["Y"][0, 0]))
                except errors.GepoolError as exc:
                    failures.append(str(exc))

    threads = [threading.Thread(target=load) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        write(f"{repo}/add/2/model.py", ADD_PY)
        c.load("add", timeout=120)
        wait_until(lambda: 2.0 in seen, timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures and seen <= {1.0, 2.0} and 2.0 in seen

def simple(repo: str, name: str, py: str, params: str = "", mbs: int = 16) -> None:
    write(f"{repo}/{name}/1/model.py", py)
    write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: {mbs}
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        dynamic_batching {{ max_queue_delay_microseconds: 500 }}
        {params}
    """)


def ensemble(repo: str, name: str, steps: str, outputs: str, in_type: str = "TYPE_FP32", mbs: int = 16) -> None:
    os.makedirs(f"{repo}/{name}/1", exist_ok=True)
    write(f"{repo}/{name}/config.pbtxt", f"""
        platform: "ensemble"
        max_batch_size: {mbs}
        input [ {{ name: "X" data_type: {in_type} dims: [ 4 ] }} ]
        output [ {outputs} ]
        ensemble_scheduling {{ step [ {steps} ] }}
    """)


def step(model: str, inputs: dict, outputs: dict) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {ins} {outs} }}'


Y = '{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }'
B = '{ name: "B" data_type: TYPE_INT32 dims: [ 1 ] }'
IMAGE = '{ name: "IMAGE" data_type: TYPE_FP32 dims: [ 1024 ] }'
TOPK = (f'{{ name: "CLASSES" data_type: TYPE_INT64 dims: [ {TOP_K} ] }}, '
        f'{{ name: "SCORES" data_type: TYPE_FP32 dims: [ {TOP_K} ] }}')
TOPK_MAP = {"CLASSES": "CLASSES", "SCORES": "SCORES"}


def nest(repo: str, name: str, steps: list[str], inputs: str, outputs: str, mbs: int = 32) -> None:
    os.makedirs(f"{repo}/{name}/1", exist_ok=True)
    write(f"{repo}/{name}/config.pbtxt", f"""
        platform: "ensemble"
        max_batch_size: {mbs}
        input [ {inputs} ]
        output [ {outputs} ]
        ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
    """)


def nested_ensembles(repo: str) -> None:
    """classify's three models, nested: deep = [nested]; nested = [prenet, topk]; prenet = [preprocess, mlp];
    and nests of batch8 and chain, a cycle, and a chain of nine ensembles over plus."""
    nest(repo, "prenet", [step("preprocess", {"RAW": "IMAGE"}, {"NORMED": "normed"}),
                          step("mlp", {"INPUT": "normed"}, {"LOGITS": "LOGITS"})],
         IMAGE, '{ name: "LOGITS" data_type: TYPE_FP32 dims: [ 1000 ] }')
    nest(repo, "nested", [step("prenet", {"IMAGE": "IMAGE"}, {"LOGITS": "logits"}),
                          step("topk", {"LOGITS": "logits"}, TOPK_MAP)], IMAGE, TOPK)
    nest(repo, "deep", [step("nested", {"IMAGE": "IMAGE"}, TOPK_MAP)], IMAGE, TOPK)
    ensemble(repo, "batch8in", step("batch8", {"X": "X"}, {"Y": "Y", "B": "B"}), f"{Y}, {B}")
    ensemble(repo, "chained", step("chain", {"X": "X"}, {"Y": "Y", "B": "B"}), f"{Y}, {B}")
    ensemble(repo, "cyc_a", step("cyc_b", {"X": "X"}, {"Y": "Y"}), Y)
    ensemble(repo, "cyc_b", step("cyc_a", {"X": "X"}, {"Y": "Y"}), Y)
    ensemble(repo, "d9", step("plus", {"INPUT": "X"}, {"OUTPUT": "Y"}), Y)
    for d in range(1, 9):
        ensemble(repo, f"d{d}", step(f"d{d + 1}", {"X": "X"}, {"Y": "Y"}), Y)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("ens"))
    make_models.make_mlp(repo)
    make_models.make_classify(repo)
    recorder(repo, "rec", preferred="8", delay_us=10_000_000)  # a batch of 8 goes at once, less waits 10 s
    recorder(repo, "failer", delay_us=0)  # the same model, each request run at once (it fails on -7)
    simple(repo, "plus", PLUS_PY)
    marks = str(tmp_path_factory.mktemp("marks"))
    for me, other in (("left", "right"), ("right", "left")):
        simple(repo, me, BRANCH_PY, f'parameters {{ key: "me" value: {{ string_value: "{marks}/{me}" }} }}\n'
                                    f'parameters {{ key: "other" value: {{ string_value: "{marks}/{other}" }} }}')
    ensemble(repo, "batch8", step("rec", {"INPUT": "X"}, {"OUTPUT": "Y", "BATCH": "B"}), f"{Y}, {B}")
    ensemble(repo, "chain", step("plus", {"INPUT": "X"}, {"OUTPUT": "mid"}) + ", "
             + step("failer", {"INPUT": "mid"}, {"OUTPUT": "Y", "BATCH": "B"}), f"{Y}, {B}")
    ensemble(repo, "fork", step("left", {"INPUT": "X"}, {"OUTPUT": "L"}) + ", "
             + step("right", {"INPUT": "X"}, {"OUTPUT": "R"}),
             '{ name: "L" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "R" data_type: TYPE_FP32 dims: [ 4 ] }')
    bytes_model(repo, "shout")
    os.makedirs(f"{repo}/shouted/1", exist_ok=True)
    write(f"{repo}/shouted/config.pbtxt", f"""
        platform: "ensemble"
        max_batch_size: 8
        input [ {{ name: "T" data_type: TYPE_STRING dims: [ 1 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_STRING dims: [ 1 ] }},
                 {{ name: "LEN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        ensemble_scheduling {{ step [ {step("shout", {"TEXT": "T"}, {"UPPER": "up"})},
                                      {step("shout", {"TEXT": "up"}, {"UPPER": "OUT", "LENGTH": "LEN"})} ] }}
    """)
    simple(repo, "tightplus", PLUS_PY, 'parameters { key: "slot_bytes" value: { string_value: "600" } }')
    ensemble(repo, "tight", step("tightplus", {"INPUT": "X"}, {"OUTPUT": "Y"}), Y)  # 1 row fits its slot, 8 do not
    ensemble(repo, "bad_type", step("plus", {"INPUT": "X"}, {"OUTPUT": "Y"}), Y, in_type="TYPE_INT32")
    ensemble(repo, "missing", step("nosuch", {"INPUT": "X"}, {"OUTPUT": "Y"}), Y)
    ensemble(repo, "cyclic", step("plus", {"INPUT": "X", "Z": "Y"}, {"OUTPUT": "Y"}), Y)
    nested_ensembles(repo)
    return repo


@pytest.fixture(scope="module")
def pool(repo):
    with Pool(repo, http_port=free_port(), grpc_port=free_port()) as p:
        yield p


@pytest.fixture(scope="module")
def client(pool):
    with pool.client() as c:
        yield c


def by_hand(client, x: np.ndarray) -> dict:
    normed = client.infer("preprocess", {"RAW": x})["NORMED"]
    logits = client.infer("mlp", {"INPUT": normed})["LOGITS"]
    return client.infer("topk", {"LOGITS": logits})


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_classify_equals_its_three_models_run_one_after_another(client, rows):
    x = np.random.default_rng(rows).random((rows, 1024), dtype=np.float32) * 255
    got = client.infer("classify", {"IMAGE": x})
    want = by_hand(client, x)
    assert got["CLASSES"].shape == (rows, TOP_K) and got["CLASSES"].dtype == np.int64
    np.testing.assert_array_equal(got["CLASSES"], want["CLASSES"])
    np.testing.assert_array_equal(got["SCORES"], want["SCORES"])


@pytest.mark.parametrize("kind", ["distinct", "ties", "nan"])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_the_example_topk_equals_a_stable_sort_of_each_row(client, rows, kind):
    rng = np.random.default_rng(rows)
    logits = rng.standard_normal((rows, 1000)).astype(np.float32)
    if kind == "ties":  # ties at and across the k-th place
        logits = rng.integers(0, 3, (rows, 1000)).astype(np.float32)
    if kind == "nan":
        logits[::2, rng.integers(0, 1000, 4)] = np.nan
    got = client.infer("topk", {"LOGITS": logits})
    with np.errstate(invalid="ignore"):
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = z / z.sum(axis=1, keepdims=True)
    best = np.argsort(-probs, axis=1, kind="stable")[:, :TOP_K]
    np.testing.assert_array_equal(got["CLASSES"], best)
    np.testing.assert_array_equal(got["SCORES"], np.take_along_axis(probs, best, axis=1))


def test_300_concurrent_ensemble_requests_from_3_clients_get_their_own_answers(pool):
    rng = np.random.default_rng(7)
    xs = [rng.random((1 + i % 3, 1024), dtype=np.float32) for i in range(300)]
    with pool.client() as c:
        wants = [by_hand(c, x)["CLASSES"] for x in xs[:30]]  # a sample checked against the models by hand
    clients = [pool.client() for _ in range(3)]
    try:
        futs = [clients[i % 3].infer_async("classify", {"IMAGE": x}) for i, x in enumerate(xs)]
        results = [f.result(timeout=120) for f in futs]
    finally:
        for c in clients:
            c.close()
    for i, (x, r) in enumerate(zip(xs, results)):
        assert r["CLASSES"].shape == (len(x), TOP_K)
        if i < 30:
            np.testing.assert_array_equal(r["CLASSES"], wants[i])
    # no cross-talk: the same input gives the same answer wherever it ran, different inputs their own
    assert len({r["CLASSES"].tobytes() + r["SCORES"].tobytes() for r in results}) == 300


def test_8_concurrent_ensemble_requests_reach_their_step_as_one_batch(pool):
    with pool.client() as c:
        futs = [c.infer_async("batch8", {"X": np.full((1, 4), i, np.float32)}) for i in range(8)]
        outs = [f.result(timeout=60) for f in futs]
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["Y"], np.full((1, 4), i, np.float32))
        assert out["B"].tolist() == [[8]]


def test_step_requests_batch_with_direct_requests_to_the_same_model(pool):
    with pool.client() as c:
        futs = [c.infer_async("batch8", {"X": np.full((1, 4), i, np.float32)}) if i % 2 else
                c.infer_async("rec", {"INPUT": np.full((1, 4), i, np.float32)}) for i in range(8)]
        outs = [f.result(timeout=60) for f in futs]
    assert [o["B" if i % 2 else "BATCH"].tolist() for i, o in enumerate(outs)] == [[[8]]] * 8


def test_independent_branches_run_at_the_same_time(client):
    out = client.infer("fork", {"X": np.full((1, 4), 5, np.float32)}, timeout=60)
    assert out["L"].tolist() == [[1.0] * 4] and out["R"].tolist() == [[1.0] * 4]  # each saw the other start


def test_a_failing_step_is_named_and_the_pool_keeps_serving(client):
    with pytest.raises(errors.ModelError) as exc:
        client.infer("chain", {"X": np.full((1, 4), -8, np.float32)})  # plus makes it -7: failer fails on it
    assert "ensemble 'chain' step 2 ('failer')" in str(exc.value) and "asked to fail" in str(exc.value)
    out = client.infer("chain", {"X": np.full((2, 4), 1, np.float32)})
    np.testing.assert_array_equal(out["Y"], np.full((2, 4), 2, np.float32))
    assert out["B"].tolist() == [[2], [2]]  # the failed step's worker ran the next batch


def test_an_ensemble_request_whose_input_lies_in_the_clients_arena(pool):
    """Its first steps read the input from the client's arena as a direct request's batch does; a step that
    refuses it says why, naming the step (before: an internal error, 'ArenaSpan' has no 'format')."""
    with pool.client(shared_memory=True, arena_bytes=1 << 22) as c:
        x = c.empty((3, 1024), np.float32)
        x[:] = np.random.default_rng(5).random((3, 1024), dtype=np.float32) * 255
        got = c.infer("classify", {"IMAGE": x})
        want = by_hand(c, np.array(x))
        np.testing.assert_array_equal(got["CLASSES"], want["CLASSES"])
        np.testing.assert_array_equal(got["SCORES"], want["SCORES"])
        del x, got
        small = c.empty((1, 4), np.float32)
        small[:] = 2
        np.testing.assert_array_equal(c.infer("tight", {"X": small})["Y"], np.full((1, 4), 3, np.float32))
        big = c.empty((8, 4), np.float32)
        big[:] = 1
        with pytest.raises(errors.RequestTooLarge) as exc:
            c.infer("tight", {"X": big})
        assert "ensemble 'tight' step 1 ('tightplus')" in str(exc.value) and "holds 600" in str(exc.value)
        del small, big


def test_an_ensemble_request_whose_arena_was_truncated_fails_naming_the_arena(pool):
    """Its step request reads the input out of the arena: a truncated arena fails it InvalidArgument, as a
    direct request's (before: the step ran on the zeros a short read leaves, and the ensemble answered)."""
    with pool.client(shared_memory=True, arena_bytes=1 << 22) as c:
        x = c.empty((1, 4), np.float32)
        x[:] = 2
        np.testing.assert_array_equal(c.infer("tight", {"X": x})["Y"], np.full((1, 4), 3, np.float32))
        os.truncate("/dev/shm" + c.arena.segment.name, 0)
        with pytest.raises(errors.InvalidArgument, match="was truncated") as exc:
            c.infer("tight", {"X": x}, timeout=60)
        assert c.arena.segment.name in str(exc.value)
        del x
    with pool.client() as other:
        np.testing.assert_array_equal(other.infer("tight", {"X": np.ones((1, 4), np.float32)})["Y"],
                                      np.full((1, 4), 2, np.float32))


def test_a_lone_ensemble_request_prewakes_the_worker_of_each_step(pool, client):
    """Sequential traffic: each step's worker is woken before its batch is admitted (the first as the
    request arrives, the next as the step before it completes), as a client's own requests' are."""
    if client.status()["polling"]["mode"] == "off":
        pytest.skip("the front does not poll on one CPU, nor prewake")
    x = np.random.default_rng(3).random((1, 1024), dtype=np.float32)
    client.infer("classify", {"IMAGE": x})  # the last batch held one request: traffic is sequential
    before = client.status()["polling"]["prewakes"]
    for _ in range(5):
        client.infer("classify", {"IMAGE": x})
    assert client.status()["polling"]["prewakes"] - before == 5 * 3


def test_bytes_tensors_pass_between_steps(client):
    out = client.infer("shouted", {"T": np.array([[b"ab"], [b"xyz"]], dtype=object)})
    assert out["OUT"].tolist() == [[b"AB"], [b"XYZ"]] and out["LEN"].tolist() == [[2], [3]]


def test_the_outputs_asked_for_are_the_ones_answered(client):
    x = np.random.default_rng(3).random((2, 1024), dtype=np.float32)
    out = client.infer("classify", {"IMAGE": x}, outputs=["SCORES"])
    assert list(out) == ["SCORES"] and out["SCORES"].shape == (2, TOP_K)


def test_a_bad_request_to_an_ensemble_is_refused_by_its_own_config(client):
    with pytest.raises(errors.InvalidArgument, match="IMAGE"):
        client.infer("classify", {"IMAGE": np.zeros((1, 5), np.float32)})
    with pytest.raises(errors.InvalidArgument, match="max_batch_size"):
        client.infer("classify", {"IMAGE": np.zeros((33, 1024), np.float32)})


def test_config_errors_found_at_load_make_the_ensemble_unavailable_naming_them(client, pool):
    rows = {r["name"]: r for r in client.query("index")["models"]}
    assert rows["classify"]["state"] == "READY"
    assert "step 1 ('plus')" in rows["bad_type"]["reason"] and "'X'" in rows["bad_type"]["reason"] \
        and "INT32" in rows["bad_type"]["reason"]
    assert rows["missing"]["state"] == "UNAVAILABLE" and "step 1 ('nosuch')" in rows["missing"]["reason"]
    assert "cycle" in rows["cyclic"]["reason"] and "'Y'" in rows["cyclic"]["reason"]
    with pytest.raises(errors.ModelNotReady, match="nosuch"):
        client.infer("missing", {"X": np.zeros((1, 4), np.float32)})


def test_ensemble_statistics_and_its_steps_own(client):
    before = client.stats()
    client.infer("classify", {"IMAGE": np.ones((2, 1024), np.float32)})
    after = client.stats()
    assert after["classify"]["requests"] == before["classify"]["requests"] + 1
    assert after["classify"]["batches"] == 0  # an ensemble runs no batch of its own
    for name in ("preprocess", "mlp", "topk"):
        assert after[name]["requests"] == before[name]["requests"] + 1
    ens = after["classify"]["histograms"]
    assert ens["compute"]["count"] == before["classify"]["histograms"]["compute"]["count"] + 1
    assert ens["compute"]["sum"] > before["classify"]["histograms"]["compute"]["sum"]


def test_metadata_and_config_of_an_ensemble(client):
    meta = client.model_metadata("classify")
    assert meta["platform"] == "ensemble" and [t["name"] for t in meta["outputs"]] == ["CLASSES", "SCORES"]
    cfg = client.query("config", {"model": "classify"})
    assert cfg["platform"] == "ensemble"
    assert [s["model_name"] for s in cfg["ensemble_scheduling"]["step"]] == ["preprocess", "mlp", "topk"]


def test_tritonclient_http_infers_an_ensemble_unchanged(pool, client):
    httpclient = pytest.importorskip("tritonclient.http")
    x = np.random.default_rng(11).random((3, 1024), dtype=np.float32)
    tc = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
    try:
        assert tc.is_model_ready("classify")
        inp = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = tc.infer("classify", [inp], outputs=[httpclient.InferRequestedOutput("CLASSES", binary_data=True)])
        np.testing.assert_array_equal(res.as_numpy("CLASSES"), by_hand(client, x)["CLASSES"])
        assert tc.get_model_config("classify")["platform"] == "ensemble"
        stats = tc.get_inference_statistics("classify")["model_stats"][0]
        assert int(stats["inference_stats"]["success"]["count"]) >= 1 and int(stats["inference_count"]) >= 3
        assert int(stats["execution_count"]) == 0  # an ensemble runs no batch; its steps' compute is its own
        infer = stats["inference_stats"]
        assert int(infer["compute_infer"]["count"]) == int(infer["success"]["count"])
        assert int(infer["compute_infer"]["ns"]) > 0
    finally:
        tc.close()


def test_tritonclient_grpc_reads_the_ensemble_and_infers_it(pool, client):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    x = np.random.default_rng(12).random((2, 1024), dtype=np.float32)
    tc = grpcclient.InferenceServerClient(f"127.0.0.1:{pool.grpc_port}")
    try:
        meta = tc.get_model_metadata("classify", as_json=True)
        assert meta["platform"] == "ensemble" and [t["name"] for t in meta["inputs"]] == ["IMAGE"]
        cfg = tc.get_model_config("classify", as_json=True)["config"]
        assert cfg["platform"] == "ensemble"
        assert [s["model_name"] for s in cfg["ensemble_scheduling"]["step"]] == ["preprocess", "mlp", "topk"]
        inp = grpcclient.InferInput("IMAGE", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = tc.infer("classify", [inp])
        np.testing.assert_array_equal(res.as_numpy("SCORES"), by_hand(client, x)["SCORES"])
    finally:
        tc.close()


# -- lifecycle: explicit model control ----------------------------------------------------------

def test_an_ensemble_follows_its_steps_through_unload_load_and_reload(tmp_path):
    repo = str(tmp_path)
    simple(repo, "add", ADD_PY)
    ensemble(repo, "pipe", step("add", {"INPUT": "X"}, {"OUTPUT": "Y"}), Y)
    with Pool(repo, model_control_mode="explicit", load_models=("add", "pipe")) as p, p.client() as c:
        x = np.zeros((1, 4), np.float32)
        assert c.infer("pipe", {"X": x})["Y"].tolist() == [[1.0] * 4]
        c.unload("add")
        row = next(r for r in c.query("index")["models"] if r["name"] == "pipe")
        assert row["state"] == "UNAVAILABLE" and "step 1 ('add')" in row["reason"] and "unloaded" in row["reason"]
        assert c.status()["models"]["pipe"]["state"] == "UNAVAILABLE"
        with pytest.raises(errors.ModelNotReady, match="unloaded"):
            c.infer("pipe", {"X": x})
        c.load("add", timeout=120)
        assert c.infer("pipe", {"X": x})["Y"].tolist() == [[1.0] * 4]
        _reload_add_under_traffic(p.endpoint, c, repo, "pipe", x, 3)


def test_a_timeout_applies_to_the_whole_pipeline_nested_ones_included(pool):
    with pool.client() as c, pytest.raises((errors.Timeout, errors.PoolUnavailable)) as exc:
        c.infer("batch8in", {"X": np.zeros((1, 4), np.float32)}, timeout=0.5)  # rec, two ensembles down
    assert "ensemble 'batch8in' step 1 ('batch8'): ensemble 'batch8' step 1 ('rec')" in str(exc.value) \
        or isinstance(exc.value, errors.PoolUnavailable)


def test_a_timeout_applies_to_the_whole_pipeline(pool):
    with pool.client() as c, pytest.raises((errors.Timeout, errors.PoolUnavailable)) as exc:
        c.infer("batch8", {"X": np.zeros((1, 4), np.float32)}, timeout=0.5)  # rec waits 10 s for 7 more
    assert "batch8" in str(exc.value) or isinstance(exc.value, errors.PoolUnavailable)


def test_requests_after_the_timeout_test_still_batch(pool):
    with pool.client() as c:
        futs = [c.infer_async("batch8", {"X": np.full((1, 4), i, np.float32)}, timeout=60) for i in range(8)]
        outs = [f.result(timeout=60) for f in futs]
    assert all(o["B"].tolist() == [[8]] for o in outs)


# -- nested ensembles ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("name", ["nested", "deep"])
def test_a_nested_ensemble_equals_its_models_run_one_after_another(client, name, rows):
    x = np.random.default_rng(100 + rows).random((rows, 1024), dtype=np.float32) * 255
    got = client.infer(name, {"IMAGE": x})
    want = by_hand(client, x)
    assert got["CLASSES"].shape == (rows, TOP_K)
    np.testing.assert_array_equal(got["CLASSES"], want["CLASSES"])
    np.testing.assert_array_equal(got["SCORES"], want["SCORES"])


def test_an_inner_ensembles_steps_batch_with_direct_requests(pool):
    with pool.client() as c:
        futs = [c.infer_async("batch8in", {"X": np.full((1, 4), i, np.float32)}, timeout=60) if i % 2 else
                c.infer_async("rec", {"INPUT": np.full((1, 4), i, np.float32)}, timeout=60) for i in range(8)]
        outs = [f.result(timeout=60) for f in futs]
    assert [o["B" if i % 2 else "BATCH"].tolist() for i, o in enumerate(outs)] == [[[8]]] * 8
    for i in range(1, 8, 2):
        np.testing.assert_array_equal(outs[i]["Y"], np.full((1, 4), i, np.float32))


def test_a_failing_inner_step_names_the_outer_step_and_the_inner_one(client):
    with pytest.raises(errors.ModelError) as exc:
        client.infer("chained", {"X": np.full((1, 4), -8, np.float32)})
    assert exc.value.message.startswith("ensemble 'chained' step 1 ('chain'): ensemble 'chain' step 2 ('failer'): "
                                        "model 'failer' failed:"), exc.value.message
    assert "asked to fail" in str(exc.value)
    out = client.infer("chained", {"X": np.full((2, 4), 1, np.float32)})
    np.testing.assert_array_equal(out["Y"], np.full((2, 4), 2, np.float32))


def test_nesting_cycles_and_depth_are_named(client):
    rows = {r["name"]: r for r in client.query("index")["models"]}
    assert rows["cyc_a"]["state"] == "UNAVAILABLE"
    assert rows["cyc_a"]["reason"] == "ensemble 'cyc_a': circular dependency between ensembles: cyc_a -> cyc_b -> cyc_a"
    assert rows["cyc_b"]["reason"] == "ensemble 'cyc_b': circular dependency between ensembles: cyc_b -> cyc_a -> cyc_b"
    assert rows["d1"]["state"] == "UNAVAILABLE" and rows["d1"]["reason"] == (
        "ensemble 'd1': ensembles nest 9 deep, past the limit of 8: " + " -> ".join(f"d{d}" for d in range(1, 10)))
    assert all(rows[f"d{d}"]["state"] == "READY" for d in range(2, 10))
    assert rows["nested"]["state"] == rows["deep"]["state"] == "READY"
    with pytest.raises(errors.ModelNotReady, match="circular dependency between ensembles"):
        client.infer("cyc_a", {"X": np.zeros((1, 4), np.float32)})
    out = client.infer("d2", {"X": np.zeros((1, 4), np.float32)})  # eight deep: served
    assert out["Y"].tolist() == [[1.0] * 4]


def test_each_ensemble_of_a_nest_counts_its_requests_and_its_steps_compute(client):
    before = client.stats()
    client.infer("deep", {"IMAGE": np.ones((2, 1024), np.float32)})
    after = client.stats()
    for name in ("deep", "nested", "prenet", "preprocess", "mlp", "topk"):
        assert after[name]["requests"] == before[name]["requests"] + 1, name
    for name in ("deep", "nested", "prenet"):
        assert after[name]["batches"] == before[name]["batches"] == 0
        grew = after[name]["histograms"]["compute"]["sum"] - before[name]["histograms"]["compute"]["sum"]
        assert grew > 0, name
    # the outer's compute is its steps' summed: the inner ensemble's, and topk's own
    inner = after["prenet"]["histograms"]["compute"]["sum"] - before["prenet"]["histograms"]["compute"]["sum"]
    outer = after["nested"]["histograms"]["compute"]["sum"] - before["nested"]["histograms"]["compute"]["sum"]
    assert outer > inner


def test_tritonclient_http_infers_a_nested_ensemble_and_reads_its_config_and_stats(pool, client):
    httpclient = pytest.importorskip("tritonclient.http")
    x = np.random.default_rng(13).random((3, 1024), dtype=np.float32)
    tc = httpclient.InferenceServerClient(f"127.0.0.1:{pool.http_port}")
    try:
        assert tc.is_model_ready("deep") and tc.is_model_ready("prenet") and not tc.is_model_ready("cyc_a")
        inp = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = tc.infer("deep", [inp])
        want = by_hand(client, x)
        np.testing.assert_array_equal(res.as_numpy("CLASSES"), want["CLASSES"])
        np.testing.assert_array_equal(res.as_numpy("SCORES"), want["SCORES"])
        cfg = tc.get_model_config("nested")
        assert cfg["platform"] == "ensemble" and cfg["backend"] == ""
        assert [(s["model_name"], s["model_version"], s["input_map"], s["output_map"])
                for s in cfg["ensemble_scheduling"]["step"]] == [
            ("prenet", -1, {"IMAGE": "IMAGE"}, {"LOGITS": "logits"}), ("topk", -1, {"LOGITS": "logits"}, TOPK_MAP)]
        for name in ("deep", "nested", "prenet"):
            stats = tc.get_inference_statistics(name)["model_stats"][0]
            assert stats["name"] == name and int(stats["execution_count"]) == 0
            assert int(stats["inference_stats"]["success"]["count"]) >= 1 and int(stats["inference_count"]) >= 3
            assert int(stats["inference_stats"]["compute_infer"]["ns"]) > 0
    finally:
        tc.close()


def test_a_model_deep_in_a_nest_unloads_and_reloads_under_every_ensemble_above_it(tmp_path):
    repo = str(tmp_path)
    simple(repo, "add", ADD_PY)
    ensemble(repo, "pipe", step("add", {"INPUT": "X"}, {"OUTPUT": "Y"}), Y)
    ensemble(repo, "outer", step("pipe", {"X": "X"}, {"Y": "Y"}), Y)
    with Pool(repo, model_control_mode="explicit", load_models=("add", "pipe", "outer")) as p, p.client() as c:
        x = np.zeros((1, 4), np.float32)
        assert c.infer("outer", {"X": x})["Y"].tolist() == [[1.0] * 4]
        c.unload("add")
        rows = {r["name"]: r for r in c.query("index")["models"]}
        for name in ("pipe", "outer"):
            assert rows[name]["state"] == "UNAVAILABLE"
            assert "ensemble 'pipe' step 1 ('add'): model 'add' is unloaded" in rows[name]["reason"]
        assert rows["outer"]["reason"].startswith("ensemble 'outer' step 1 ('pipe')")
        with pytest.raises(errors.ModelNotReady, match="unloaded"):
            c.infer("outer", {"X": x})
        c.load("add", timeout=120)
        assert c.infer("outer", {"X": x})["Y"].tolist() == [[1.0] * 4]
        _reload_add_under_traffic(p.endpoint, c, repo, "outer", x, 2)


def test_the_pool_counts_where_the_bytes_of_each_hop_went(client):
    before = client.status()["ensemble_copies"]
    client.infer("classify", {"IMAGE": np.ones((2, 1024), np.float32)})
    after = client.status()["ensemble_copies"]
    moved = {k: after[k] - before[k] for k in after}
    # each hop's tensor once: handed slot to slot, or copied out to wait (normed: 2 x 1024, logits: 2 x 1000 FP32)
    assert moved["out_bytes"] + moved["handed_bytes"] == 2 * 1024 * 4 + 2 * 1000 * 4
    assert moved["answered_bytes"] == 2 * TOP_K * (8 + 4)  # CLASSES and SCORES, from topk's slot
