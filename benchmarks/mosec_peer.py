"""Mosec serving ONNX models with onnxruntime, one route per model taking a KServe v2 JSON body (peers.py).

    GEPOOL_PEER_REPO=DIR GEPOOL_PEER_MODELS=tiny,mlp GEPOOL_PEER_THREADS=1 GEPOOL_PEER_MAX_BATCH=32 \\
    GEPOOL_PEER_WAIT_MS=1 python benchmarks/mosec_peer.py --address 127.0.0.1 --port P --path DIR

Runs under the peer's interpreter (``pip install mosec onnxruntime``); ``peers.start_mosec`` starts it.
Its own settings come from the environment, since Mosec reads the command line as its own. Each model
``<name>/1/model.onnx`` (one FP32 input with a batch dimension) is served at
``POST /v2/models/<name>/infer`` by one worker that Mosec's batcher feeds up to the max batch, waiting
at most the given milliseconds; a request answers ``{"model_name", "outputs": [{name, datatype, shape,
data}]}`` as KServe v2 does, so the same wrk body loads gepool, PyTriton and this peer.
"""

import os

import numpy as np
from mosec import Runtime, Server, Worker
from mosec.errors import ValidationError


class OrtWorker(Worker):
    """One model's onnxruntime session; ``forward`` runs a batch of KServe v2 requests at once."""

    def __init__(self) -> None:
        super().__init__()
        import onnxruntime as ort

        self.model = os.environ["GEPOOL_PEER_MODEL"]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(os.environ.get("GEPOOL_PEER_THREADS", "1"))
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = os.path.join(os.environ["GEPOOL_PEER_REPO"], self.model, "1", "model.onnx")
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        (self.input,), (self.output,) = self.session.get_inputs(), self.session.get_outputs()

    def tensor(self, body: dict) -> np.ndarray:
        try:
            (tensor,) = body["inputs"]
            return np.asarray(tensor["data"], np.float32).reshape(tensor["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValidationError(f"expected one KServe v2 input tensor: {exc}") from None

    def forward(self, data: list[dict]) -> list[dict]:
        xs = [self.tensor(body) for body in data]
        y = self.session.run([self.output.name], {self.input.name: np.concatenate(xs)})[0]
        outs = np.split(y, np.cumsum([len(x) for x in xs])[:-1])
        return [{"model_name": self.model, "outputs": [{"name": self.output.name, "datatype": "FP32",
                                                        "shape": list(o.shape), "data": o.ravel().tolist()}]}
                for o in outs]


def main() -> None:
    server = Server()
    routes = {}
    for name in os.environ.get("GEPOOL_PEER_MODELS", "tiny,mlp").split(","):
        env = {k: v for k, v in os.environ.items() if k.startswith("GEPOOL_PEER_")} | {"GEPOOL_PEER_MODEL": name}
        runtime = Runtime(OrtWorker, num=1, max_batch_size=int(os.environ.get("GEPOOL_PEER_MAX_BATCH", "32")),
                          max_wait_time=int(os.environ.get("GEPOOL_PEER_WAIT_MS", "1")), env=[env])
        routes[f"/v2/models/{name}/infer"] = [runtime]
    server.register_runtime(routes)
    server.run()


if __name__ == "__main__":
    main()
