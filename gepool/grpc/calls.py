"""ModelInferRequests alike but for their raw_input_contents: the rest is read once, each call's tensors alone.

A client sends the same request around other tensor bytes (and, often, another id), call after call. The request
less its ``raw_input_contents`` and its ``id``, serialized deterministically, is the key of what ``tensors.parse``
(which reads no id) made of it,
learnt the second time the key comes from a request whose every input came from those contents (none in
shared memory or in typed ``contents``). A later request with that key and as many contents reads only them,
through ``kserve.tensor_from_bytes`` as the full reading does; one that does not read takes the full reading,
which names what is wrong. Equal keys are equal messages but for the contents and the id, so the rest reads
the same.

A client's own bytes say as much, sooner: a learnt request whose contents were its last fields (as every
protobuf serializer writes them: field 7 follows the others) keeps its bytes before them, less its id (field 3,
where serializers put it: after fields 1 and 2), and a later message that is exactly those bytes around an id
of its own (or none) and then as many contents, nothing else, is that request with that id around other
contents, with no protobuf parse at all (``known``).
"""

from __future__ import annotations

import dataclasses

from gepool.common.errors import InvalidArgument
from gepool.grpc import grpc_service_pb2 as pb
from gepool.grpc import tensors
from gepool.http import kserve
from gepool.http.templates import SeenOnce, copied

MAX_CALLS = 64  # requests of another shape past this start the book again (a bound, not a cache policy)
MAX_PREFIXES = 8  # learnt requests' bytes before their contents, looked at in turn (the newest first)
MAX_PREFIX_BYTES = 4096
CONTENTS_TAG = 0x3A  # raw_input_contents: field 7, length-delimited
ID_TAG = 0x1A  # id: field 3, length-delimited


class Call:
    __slots__ = ("call", "inputs", "max_input")

    def __init__(self, call: tensors.InferCall, inputs: list[tuple[str, str, list[int]]], max_input: int) -> None:
        self.call, self.inputs, self.max_input = call, inputs, max_input


class Prefix:
    """A learnt request's bytes before its id (``head``) and from its id to its contents (``tail``)."""

    __slots__ = ("head", "tail", "known", "model", "version")

    def __init__(self, head: bytes, tail: bytes, known: Call, model: str, version: str) -> None:
        self.head, self.tail, self.known, self.model, self.version = head, tail, known, model, version


class Calls:
    """The shapes of request this gateway has seen (one loop's own: not shared across threads)."""

    def __init__(self) -> None:
        self._known: dict[bytes, Call] = {}
        self._seen = SeenOnce()
        self._prefixes: list[Prefix] = []

    def known(self, raw: bytes, max_input: int) \
            -> tuple[tensors.InferCall, tensors.InferCall, tuple[str, str, str]] | None:
        """What ``tensors.parse`` makes of the serialized request ``raw``, with no shared memory, where its bytes
        before its contents are a learnt request's: (the call, the call less its inputs, the request's id, model
        name and version as it gave them). None where they are not, or its contents do not read (the full
        reading then names what is wrong)."""
        end = len(raw)
        for prefix in self._prefixes:
            if not raw.startswith(prefix.head) or prefix.known.max_input != max_input:
                continue
            at, request_id = len(prefix.head), ""
            if at < end and raw[at] == ID_TAG:
                length, at = _varint(raw, at + 1)
                if length is None or at + length > end:
                    continue
                try:
                    request_id = raw[at:at + length].decode("utf-8")  # (a proto3 string: the parse checks it too)
                except UnicodeDecodeError:
                    continue
                at += length
            if not raw.startswith(prefix.tail, at):
                continue
            found = _around(raw, at + len(prefix.tail), prefix.known)
            if found is not None:
                return found, prefix.known.call, (request_id, prefix.model, prefix.version)
            # (another learnt request's bytes may start with this one's: a request with outputs, say, and the
            # same without)
        return None

    def parse(self, request: pb.ModelInferRequest, regions, max_input: int, raw: bytes | None = None) \
            -> tensors.InferCall:
        """``tensors.parse(request, regions, max_input)``: the same call, or the same error. ``raw``: the
        request's bytes, where a learnt request may be known by them later."""
        contents = list(request.raw_input_contents)
        if not contents:
            return tensors.parse(request, regions, max_input)
        request_id = request.id
        request.ClearField("raw_input_contents")
        request.ClearField("id")
        try:
            key = request.SerializeToString(deterministic=True)
        finally:  # (the request is whole again for the full reading)
            request.raw_input_contents.extend(contents)
            request.id = request_id
        known = self._known.get(key)
        if known is not None and known.max_input == max_input and len(contents) == len(known.inputs):
            try:
                inputs = {name: kserve.tensor_from_bytes(name, datatype, shape, data)
                          for (name, datatype, shape), data in zip(known.inputs, contents)}
            except InvalidArgument:
                return tensors.parse(request, regions, max_input)  # names what is wrong
            return copied(known.call, inputs=inputs)
        call = tensors.parse(request, regions, max_input)
        if self._seen.again(key):
            self._learn(key, request, contents, call, max_input, raw)
        return call

    def _learn(self, key: bytes, request: pb.ModelInferRequest, contents: list[bytes], call: tensors.InferCall,
               max_input: int, raw: bytes | None) -> None:
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
        known = self._known[key] = Call(dataclasses.replace(call, inputs={}), inputs, max_input)
        found = None if raw is None else layout(raw, len(contents))
        split, after_id, start = found or (0, 0, MAX_PREFIX_BYTES + 1)
        if start - (after_id - split) <= MAX_PREFIX_BYTES:  # (the bytes kept: all but the id and the contents)
            if len(self._prefixes) >= MAX_PREFIXES:
                self._prefixes.pop()
            self._prefixes.insert(0, Prefix(raw[:split], raw[after_id:start], known, request.model_name,
                                            request.model_version))


def _around(raw: bytes, at: int, known: Call) -> tensors.InferCall | None:
    """``known``'s call with the contents that ``raw`` holds from ``at`` on, if it holds as many as the call has
    inputs and nothing else, and they read; else None."""
    end, inputs = len(raw), {}
    for name, datatype, shape in known.inputs:
        if at >= end or raw[at] != CONTENTS_TAG:
            return None
        length, at = _varint(raw, at + 1)
        if length is None or at + length > end:
            return None
        try:
            inputs[name] = kserve.tensor_from_bytes(name, datatype, shape, raw[at:at + length])
        except InvalidArgument:
            return None
        at += length
    return copied(known.call, inputs=inputs) if at == end else None


def layout(raw: bytes, count: int) -> tuple[int, int, int] | None:
    """Where a serialized request's id lies or would lie (its start and end: the same where it has none, before
    its first field past 3), and where its raw_input_contents start, if they are its last ``count`` top-level
    fields and the id is a string field at most once; else None (or where its bytes do not parse as
    protobuf's wire format)."""
    at, end, first, seen, split, after_id = 0, len(raw), None, 0, None, None
    while at < end:
        begin = at
        tag, at = _varint(raw, at)
        if tag is None:
            return None
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _varint(raw, at)
            if value is None:
                return None
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            length, at = _varint(raw, at)
            if length is None:
                return None
            at += length
        else:  # (groups: not in this message)
            return None
        if first is not None and field != 7:  # another field after the contents
            return None
        if field == 7:
            if wire != 2:
                return None
            first = begin if first is None else first
            seen += 1
        elif field == 3:
            if wire != 2 or split is not None:  # (twice, or after a field past it: not where serializers put it)
                return None
            split, after_id = begin, at
        elif field > 3 and split is None:
            split = after_id = begin
    if at != end or first is None or seen != count:
        return None
    if split is None:
        split = after_id = first
    return split, after_id, first


def _varint(raw: bytes, at: int) -> tuple[int | None, int]:
    """The base-128 varint at ``at`` (what ``tensors.varint`` writes) and where it ends; None where it runs out
    or is over 64 bits."""
    value = shift = 0
    while at < len(raw) and shift < 64:
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    return None, at
