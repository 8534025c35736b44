"""ModelInferRequests alike but for their raw_input_contents: the rest is read once, each call's tensors alone.

A client sends the same request around other tensor bytes, call after call. The request less its
``raw_input_contents``, serialized deterministically, is the key of what ``tensors.parse`` made of it,
learnt the second time the key comes from a request whose every input came from those contents (none in
shared memory or in typed ``contents``). A later request with that key and as many contents reads only them,
through ``kserve.tensor_from_bytes`` as the full reading does; one that does not read takes the full reading,
which names what is wrong. Equal keys are equal messages but for the contents, so the rest reads the same.
"""

from __future__ import annotations

import dataclasses

from gepool.common.errors import InvalidArgument
from gepool.grpc import grpc_service_pb2 as pb
from gepool.grpc import tensors
from gepool.http import kserve
from gepool.http.templates import SeenOnce

MAX_CALLS = 64  # requests of another shape past this start the book again (a bound, not a cache policy)


class Call:
    __slots__ = ("call", "inputs", "max_input")

    def __init__(self, call: tensors.InferCall, inputs: list[tuple[str, str, list[int]]], max_input: int) -> None:
        self.call, self.inputs, self.max_input = call, inputs, max_input


class Calls:
    """The shapes of request this gateway has seen (one loop's own: not shared across threads)."""

    def __init__(self) -> None:
        self._known: dict[bytes, Call] = {}
        self._seen = SeenOnce()

    def parse(self, request: pb.ModelInferRequest, regions, max_input: int) -> tensors.InferCall:
        """``tensors.parse(request, regions, max_input)``: the same call, or the same error."""
        contents = list(request.raw_input_contents)
        if not contents:
            return tensors.parse(request, regions, max_input)
        request.ClearField("raw_input_contents")
        try:
            key = request.SerializeToString(deterministic=True)
        finally:
            request.raw_input_contents.extend(contents)  # (the request is whole again for the full reading)
        known = self._known.get(key)
        if known is not None and known.max_input == max_input and len(contents) == len(known.inputs):
            try:
                inputs = {name: kserve.tensor_from_bytes(name, datatype, shape, data)
                          for (name, datatype, shape), data in zip(known.inputs, contents)}
            except InvalidArgument:
                return tensors.parse(request, regions, max_input)  # names what is wrong
            return dataclasses.replace(known.call, inputs=inputs)
        call = tensors.parse(request, regions, max_input)
        if self._seen.again(key):
            self._learn(key, request, contents, call, max_input)
        return call

    def _learn(self, key: bytes, request: pb.ModelInferRequest, contents: list[bytes], call: tensors.InferCall,
               max_input: int) -> None:
        items = request.inputs
        if not len(items) == len(contents) == len(call.inputs):
            return
        inputs = []
        for item in items:  # (as tensors.parse walks them: each takes the next contents, in order)
            if item.HasField("contents") or "shared_memory_region" in item.parameters:
                return
            inputs.append((item.name, item.datatype, tensors._shape(item.name, item.shape, item.datatype, max_input)))
        if len(self._known) >= MAX_CALLS:
            self._known.clear()
        # (its inputs are not kept: the first caller's tensors would stay as long as the shape)
        self._known[key] = Call(dataclasses.replace(call, inputs={}), inputs, max_input)
