"""Writes the example model repository from fixed-seed numpy weights (needs the `onnx` package).

    python examples/make_models.py [OUT_DIR]      # default: examples/models

tiny         ONNX, y = 2x + 1 on FP32[16]: the latency probe
mlp          ONNX, 1024 -> 4096 -> 4096 -> 1000 with ReLU: big enough that batching pays on CPU
postprocess  python backend: softmax and arg-max over 1000 logits
classify     an ensemble run by the front: preprocess (python, normalise) -> mlp -> topk (python, top 5)
"""

import os
import textwrap

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
IR_VERSION = 8  # readable by onnxruntime builds from 1.10 on, as Ascend hosts may carry
OPSET = 17


def _save(graph, path: str) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="gepool")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(model, path)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text).lstrip())


def make_tiny(repo: str, name: str = "tiny", width: int = 16, max_batch: int = 8) -> None:
    """y = 2x + 1 on FP32[width] (the tests also make a wide one, whose requests pass 64 KiB)."""
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", width])
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [helper.make_node("Mul", ["INPUT0", "two"], ["scaled"]),
             helper.make_node("Add", ["scaled", "one"], ["OUTPUT0"])]
    _save(helper.make_graph(nodes, name, [x], [y], [two, one]), f"{repo}/{name}/1/model.onnx")
    _write(f"{repo}/{name}/config.pbtxt", f"""
        name: "{name}"
        platform: "onnxruntime_onnx"
        max_batch_size: {max_batch}
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {width} ] }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {width} ] }} ]
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        dynamic_batching {{ }}
    """)


def make_mlp(repo: str, sizes: tuple[int, ...] = (1024, 4096, 4096, 1000)) -> None:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1234)
    x = helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", sizes[0]])
    y = helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, ["batch", sizes[-1]])
    nodes, inits, prev = [], [], "INPUT"
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        w = (rng.standard_normal((n_in, n_out), dtype=np.float32) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal(n_out, dtype=np.float32) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(sizes) - 2
        out = "LOGITS" if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [out if last else f"g{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [out]))
        prev = out
    _save(helper.make_graph(nodes, "mlp", [x], [y], inits), f"{repo}/mlp/1/model.onnx")
    _write(f"{repo}/mlp/config.pbtxt", f"""
        name: "mlp"
        platform: "onnxruntime_onnx"
        max_batch_size: 32
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {sizes[0]} ] }} ]
        output [ {{ name: "LOGITS" data_type: TYPE_FP32 dims: [ {sizes[-1]} ] }} ]
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        dynamic_batching {{
          preferred_batch_size: [ 16, 32 ]
          max_queue_delay_microseconds: 5000
        }}
        parameters {{ key: "batch_policy" value: {{ string_value: "adaptive" }} }}
    """)


def make_postprocess(repo: str) -> None:
    _write(f"{repo}/postprocess/1/model.py", '''
        """Softmax and arg-max over a batch of logits: pre/post-processing in plain numpy."""

        import numpy as np


        class Model:
            def initialize(self, config):
                self.temperature = float(config["parameters"].get("temperature", "1.0"))

            def execute(self, inputs):
                logits = inputs["LOGITS"] / self.temperature
                z = np.exp(logits - logits.max(axis=1, keepdims=True))
                probs = (z / z.sum(axis=1, keepdims=True)).astype(np.float32)
                return {"PROBS": probs, "CLASS": probs.argmax(axis=1).astype(np.int64)[:, None]}

            def finalize(self):
                pass
    ''')
    _write(f"{repo}/postprocess/config.pbtxt", """
        name: "postprocess"
        backend: "python"
        max_batch_size: 32
        input [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 1000 ] } ]
        output [
          { name: "PROBS" data_type: TYPE_FP32 dims: [ 1000 ] },
          { name: "CLASS" data_type: TYPE_INT64 dims: [ 1 ] }
        ]
        dynamic_batching { max_queue_delay_microseconds: 500 }
        parameters { key: "temperature" value: { string_value: "1.0" } }
    """)


def make_all(repo: str) -> str:
    make_tiny(repo)
    make_mlp(repo)
    make_postprocess(repo)
    return repo


TOP_K = 5


def make_classify(repo: str, width: int = 1024, classes: int = 1000, max_batch: int = 32) -> None:
    """The ensemble ``classify``: ``preprocess`` (each row scaled to zero mean and unit variance) ->
    ``mlp`` -> ``topk`` (the TOP_K best classes and their softmax scores), scheduled by the front."""
    _write(f"{repo}/preprocess/1/model.py", '''
        """Normalises each row of a batch: zero mean, unit variance."""

        import numpy as np


        class Model:
            def execute(self, inputs):
                x = inputs["RAW"]
                mean = x.mean(axis=1, keepdims=True)
                std = x.std(axis=1, keepdims=True) + np.float32(1e-6)
                return {"NORMED": ((x - mean) / std).astype(np.float32)}
    ''')
    _write(f"{repo}/preprocess/config.pbtxt", f"""
        name: "preprocess"
        backend: "python"
        max_batch_size: {max_batch}
        input [ {{ name: "RAW" data_type: TYPE_FP32 dims: [ {width} ] }} ]
        output [ {{ name: "NORMED" data_type: TYPE_FP32 dims: [ {width} ] }} ]
        dynamic_batching {{ max_queue_delay_microseconds: 500 }}
    """)
    _write(f"{repo}/topk/1/model.py", f'''
        """The {TOP_K} best classes of each row of logits, best first, with their softmax scores."""

        import numpy as np


        def best_first(probs, k):
            """np.argsort(-probs, axis=1, kind="stable")[:, :k] (ties in index order) without sorting whole rows:
            each row's k largest are found by a partition, and only they are sorted."""
            n, c = probs.shape
            if n < 2 or c <= k:
                return np.argsort(-probs, axis=1, kind="stable")[:, :k]
            picked = probs >= np.partition(probs, c - k, axis=1)[:, c - k:c - k + 1]
            if not (picked.sum(axis=1) == k).all():  # a tie at the k-th value, or NaN: the whole sort decides
                return np.argsort(-probs, axis=1, kind="stable")[:, :k]
            idx = picked.nonzero()[1].reshape(n, k)  # each row's k, in index order
            order = np.argsort(-np.take_along_axis(probs, idx, axis=1), axis=1, kind="stable")
            return np.take_along_axis(idx, order, axis=1)


        class Model:
            def execute(self, inputs):
                logits = inputs["LOGITS"]
                z = np.exp(logits - logits.max(axis=1, keepdims=True))
                probs = z / z.sum(axis=1, keepdims=True)
                best = best_first(probs, {TOP_K})
                return {{"CLASSES": best.astype(np.int64),
                         "SCORES": np.take_along_axis(probs, best, axis=1).astype(np.float32)}}
    ''')
    _write(f"{repo}/topk/config.pbtxt", f"""
        name: "topk"
        backend: "python"
        max_batch_size: {max_batch}
        input [ {{ name: "LOGITS" data_type: TYPE_FP32 dims: [ {classes} ] }} ]
        output [
          {{ name: "CLASSES" data_type: TYPE_INT64 dims: [ {TOP_K} ] }},
          {{ name: "SCORES" data_type: TYPE_FP32 dims: [ {TOP_K} ] }}
        ]
        dynamic_batching {{ max_queue_delay_microseconds: 500 }}
    """)
    os.makedirs(f"{repo}/classify/1", exist_ok=True)  # Triton wants an ensemble's version folder, empty
    _write(f"{repo}/classify/config.pbtxt", f"""
        name: "classify"
        platform: "ensemble"
        max_batch_size: {max_batch}
        input [ {{ name: "IMAGE" data_type: TYPE_FP32 dims: [ {width} ] }} ]
        output [
          {{ name: "CLASSES" data_type: TYPE_INT64 dims: [ {TOP_K} ] }},
          {{ name: "SCORES" data_type: TYPE_FP32 dims: [ {TOP_K} ] }}
        ]
        ensemble_scheduling {{
          step [
            {{
              model_name: "preprocess"
              model_version: -1
              input_map {{ key: "RAW" value: "IMAGE" }}
              output_map {{ key: "NORMED" value: "normed" }}
            }},
            {{
              model_name: "mlp"
              model_version: -1
              input_map {{ key: "INPUT" value: "normed" }}
              output_map {{ key: "LOGITS" value: "logits" }}
            }},
            {{
              model_name: "topk"
              model_version: -1
              input_map {{ key: "LOGITS" value: "logits" }}
              output_map [
                {{ key: "CLASSES" value: "CLASSES" }},
                {{ key: "SCORES" value: "SCORES" }}
              ]
            }}
          ]
        }}
    """)


def make_examples(repo: str) -> str:
    """The example repository: the models of make_all, and the classify ensemble over mlp."""
    make_all(repo)
    make_classify(repo)
    return repo


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default=os.path.join(HERE, "models"),
                        help="where to write the repository (default: examples/models)")
    out = make_examples(parser.parse_args().out_dir)
    print(f"wrote the example repository to {out}")
