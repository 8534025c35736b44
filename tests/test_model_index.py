"""Model control as Triton's: the explicit-mode index lists every model folder with its state (never loaded:
the name alone; unloaded: UNAVAILABLE "unloaded"), a load of a name with no folder adds nothing, and a
repository that does not exist fails the start in every mode."""

import logging

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.scheduler.books import Workers
from gepool.scheduler.control import ModelControl
from gepool.scheduler.options import FrontOptions
from tests import repo as test_repo
from tests.conftest import free_port, wait_until


@pytest.fixture(scope="module")
def explicit(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("explicit-models"))
    test_repo.make_models.make_tiny(repo, "tiny")
    test_repo.make_models.make_tiny(repo, "other")
    with Pool(repo, model_control_mode="explicit", load_models=("tiny",), http_port=free_port(),
              grpc_port=free_port(), log_level=logging.WARNING) as pool:
        yield pool


def _index(client, ready: bool = False) -> list[dict]:
    return client.query("index", {"ready": ready})["models"]


def test_the_index_lists_every_folder_then_tracks_load_and_unload(explicit):
    c = explicit.client()
    assert _index(c) == [{"name": "other"}, {"name": "tiny", "version": "1", "state": "READY"}]
    assert _index(c, ready=True) == [{"name": "tiny", "version": "1", "state": "READY"}]
    c.unload("tiny")
    assert wait_until(lambda: _index(c)[1].get("state") == "UNAVAILABLE")
    assert _index(c) == [{"name": "other"},
                         {"name": "tiny", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
    c.load("other")
    c.load("tiny")
    assert _index(c) == [{"name": "other", "version": "1", "state": "READY"},
                         {"name": "tiny", "version": "1", "state": "READY"}]
    np.testing.assert_array_equal(c.infer("tiny", {"INPUT0": np.zeros((1, 16), np.float32)})["OUTPUT0"],
                                  np.ones((1, 16), np.float32))


def test_loading_a_name_with_no_folder_adds_nothing(explicit):
    c = explicit.client()
    before = _index(c)
    with pytest.raises(errors.ModelNotFound, match="no folder 'ghost'"):
        c.load("ghost")
    assert _index(c) == before and "ghost" not in c.status()["models"]


def test_tritonclient_reads_the_same_index(explicit):
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    c = explicit.client()
    with httpclient.InferenceServerClient(f"127.0.0.1:{explicit.http_port}") as triton:
        assert triton.get_model_repository_index() == _index(c)
        with pytest.raises(InferenceServerException, match="ghost"):
            triton.load_model("ghost")
        assert "ghost" not in {m["name"] for m in triton.get_model_repository_index()}


def test_grpc_reads_the_same_index(explicit):
    """RepositoryIndex lists what HTTP's index lists: every folder, one row per version (it listed the models held,
    one row each, so a folder never loaded was missing)."""
    grpcclient = pytest.importorskip("tritonclient.grpc")

    c = explicit.client()
    c.load("other")
    c.unload("other")
    assert wait_until(lambda: _index(c)[0].get("state") == "UNAVAILABLE")
    with grpcclient.InferenceServerClient(f"127.0.0.1:{explicit.grpc_port}") as triton:
        rows = [{key: value for key, value in (("name", m.name), ("version", m.version), ("state", m.state),
                                               ("reason", m.reason)) if value}
                for m in triton.get_model_repository_index().models]
    assert rows == _index(c) and rows[0] == {"name": "other", "version": "1", "state": "UNAVAILABLE",
                                             "reason": "unloaded"}, rows


@pytest.mark.parametrize("mode", ["none", "explicit", "poll"])
def test_a_missing_repository_fails_the_start_in_every_mode(tmp_path, mode):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        Pool(missing, model_control_mode=mode).start()
    control = ModelControl(FrontOptions(missing, "ipc:///nowhere", "x", model_control_mode=mode), Workers(), None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        control.start()
