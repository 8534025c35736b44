"""Triton's classification extension: an output asked for with a class count returns its top classes as
BYTES "value:index[:label]" (std::to_string's %f for floats), per row, through a real pool."""

import os

import numpy as np
import pytest

from gepool import Pool
from gepool.common import errors
from gepool.scheduler.classify import top_classes
from tests import repo as test_repo

LABELS = ["cat", "dog", "", "bird"]  # five outputs: index 2 has an empty label, index 4 none


def test_top_classes_order_ties_and_format():
    x = np.array([[0.5, 2.0, 1.25, 2.0, -1.0]], np.float32)
    assert top_classes(x, 3, True, ()).tolist() == [[b"2.000000:1", b"2.000000:3", b"1.250000:2"]]
    assert top_classes(x[0], 9, False, tuple(LABELS)).tolist() == [
        b"2.000000:1:dog", b"2.000000:3:bird", b"1.250000:2", b"0.500000:0:cat", b"-1.000000:4"]
    ints = np.array([[3], [9]], np.int32)
    assert top_classes(ints, 1, True, ()).tolist() == [[b"3:0"], [b"9:0"]]
    assert top_classes(np.array([[1, 3, 2], [9, 7, 8]], np.uint8), 2, False, ()).tolist() == [b"9:3", b"8:5"]


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("class-models"))
    test_repo.make_models.make_tiny(repo, "tiny", width=5)
    test_repo.make_models.make_tiny(repo, "labelled", width=5)
    path = os.path.join(repo, "labelled", "config.pbtxt")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace('name: "OUTPUT0"', 'name: "OUTPUT0" label_filename: "labels.txt"'))
    with open(os.path.join(repo, "labelled", "labels.txt"), "w") as f:
        f.write("\n".join(LABELS) + "\n")
    test_repo.recorder(repo, "rec", preferred="4", delay_us=0)
    with Pool(repo) as pool:
        yield pool.client()


X = np.array([[0.1, 0.5, 0.3, 0.5, -1.0], [1.0, 0.0, 0.25, 0.0, 2.0]], np.float32)  # y = 2x + 1


def test_class_count_returns_top_classes_as_triton_does(classes):
    out = classes.infer("tiny", {"INPUT0": X}, [("OUTPUT0", 3)])["OUTPUT0"]
    assert out.shape == (2, 3)
    assert out.tolist() == [[b"2.000000:1", b"2.000000:3", b"1.600000:2"],
                            [b"5.000000:4", b"3.000000:0", b"1.500000:2"]]


def test_labels_come_from_label_filename(classes):
    out = classes.infer("labelled", {"INPUT0": X}, [("OUTPUT0", 5)])["OUTPUT0"]
    assert out[0].tolist() == [b"2.000000:1:dog", b"2.000000:3:bird", b"1.600000:2", b"1.200000:0:cat",
                               b"-1.000000:4"]
    raw = classes.infer("labelled", {"INPUT0": X}, ["OUTPUT0"])["OUTPUT0"]  # no class count: the tensor
    np.testing.assert_allclose(raw, X * 2 + 1)
    assert classes.infer("labelled", {"INPUT0": X}, [("OUTPUT0", 0)])["OUTPUT0"].dtype == np.float32


def test_a_class_count_past_the_elements_is_clamped_and_other_outputs_stay_raw(classes):
    got = classes.infer("rec", {"INPUT": np.array([[4.0, 1.0, 3.0, 2.0]], np.float32)},
                        [("OUTPUT", 10), "BATCH"])
    assert got["OUTPUT"].tolist() == [[b"4.000000:0", b"3.000000:2", b"2.000000:3", b"1.000000:1"]]
    assert got["BATCH"].tolist() == [[1]]


@pytest.mark.parametrize("outputs, words", [
    ([("OUTPUT0", -1)], "class_count must be >= 0"),
    ([("NOPE", 2)], r"unknown output \['NOPE'\]"),
    ([["OUTPUT0", "3"]], "a name or \\[name, class_count\\]"),
])
def test_bad_class_requests_are_refused_by_name(classes, outputs, words):
    with pytest.raises(errors.InvalidArgument, match=words):
        classes.infer("tiny", {"INPUT0": X}, outputs)
