"""Request bodies alike but for one input's JSON data: the rest is read once, the data of each request alone.

A client sends the same JSON around different numbers, request after request. Where a body's first
``"data"`` key holds a flat list, the body less that list (and where it was) is the key of what
``kserve.parse_request`` made of it, learnt from an earlier such body: later ones
read only their list (with orjson, or as the full reading reads a long body's floats, with simdjson straight
into doubles), through the same ``kserve._from_json`` as every JSON input. A body is learnt only
where its reading cannot differ from the full one: orjson read it and it passed ``kserve._parse`` (not
the json module's exact reading, which may read the same text otherwise), it has one input, and the list
is that input's data (the body read again with either of two markers in its place finds that marker there);
and only when its shape comes a second time (a body whose id differs every time is never learnt). Anything
else, and any list that does not read or check, takes the full path, which names what is wrong.
"""

from __future__ import annotations

import dataclasses

import orjson

from gepool.common.errors import InvalidArgument
from gepool.http import jsonfast, kserve
from gepool.http.jsonfast import FAST_MIN_BYTES, FLOAT_DATATYPES

MAX_TEMPLATES = 64  # bodies of another shape past this start the book again (a bound, not a cache policy)
MAX_SEEN = 256  # bodies seen once, not learnt yet: a body is learnt when its shape comes again (an id that
# differs in every request makes every shape new, and learning costs a second reading)
_DATA = b'"data"'
_WHITESPACE = b" \t\n\r"  # JSON's
# two lists put in the found list's place: only where it is the input's data do both come back as its data (a
# request's own data may be either, not both)
_MARKS = (["\x00gepool", 1], ["\x00gepool", 2])
_MARK_TEXTS = tuple(orjson.dumps(m) for m in _MARKS)


class SeenOnce:
    """The keys seen once and not learnt yet, by their hash (a collision only makes a learning try early: what
    learns checks the request at hand); at most MAX_SEEN, past which the book starts again."""

    def __init__(self) -> None:
        self._hashes: set[int] = set()

    def again(self, key: bytes) -> bool:
        """Whether ``key`` was seen once before (it is then forgotten: it is learnt now), else noted."""
        hashed = hash(key)
        if hashed in self._hashes:
            self._hashes.discard(hashed)
            return True
        if len(self._hashes) >= MAX_SEEN:
            self._hashes.clear()
        self._hashes.add(hashed)
        return False

    def __len__(self) -> int:
        return len(self._hashes)


def _again_with(request: kserve.InferRequest, inputs: dict) -> kserve.InferRequest:
    """A learnt request with this request's inputs (and parameters of its own: a handler may add to them)."""
    return copied(request, inputs=inputs, parameters=dict(request.parameters))


def copied(obj, **changes):
    """``dataclasses.replace(obj, **changes)`` for a plain dataclass (not frozen, no slots, no __post_init__:
    tests/test_known_shapes.py checks the ones given here), at a third of its cost: the fields as they are."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **changes)
    return new


class Template:
    __slots__ = ("start", "name", "datatype", "shape", "request", "max_json", "max_input")

    def __init__(self, start: int, name: str, datatype: str, shape: list[int], request: kserve.InferRequest,
                 max_json: int, max_input: int) -> None:
        self.start, self.name, self.datatype, self.shape, self.request = start, name, datatype, shape, request
        self.max_json, self.max_input = max_json, max_input


class Binary:
    """A JSON header whose inputs all come as binary data: each input's name, datatype, shape, and where its
    bytes lie after the header."""

    __slots__ = ("inputs", "size", "request", "max_json", "max_input")

    def __init__(self, inputs: list[tuple[str, str, list[int], int, int]], size: int, request: kserve.InferRequest,
                 max_json: int, max_input: int) -> None:
        self.inputs, self.size, self.request, self.max_json, self.max_input = inputs, size, request, max_json, max_input


class Templates:
    """The shapes of body this gateway has seen, each with what it parsed to (one loop's own: not shared
    across threads)."""

    def __init__(self) -> None:
        self._known: dict[bytes, Template] = {}
        self._binary: dict[bytes, Binary] = {}
        self._seen = SeenOnce()

    def parse_binary(self, body: bytes, header_length: str, hlen: int, regions, max_json: int,
                     max_input: int) -> kserve.InferRequest:
        """``kserve.parse_request(body, header_length, ...)`` for a body of ``hlen`` bytes of JSON header (which
        ``header_length`` says) and then binary data: the same request, or the same error. A header whose inputs
        all come as binary data is learnt as a JSON body is (seen twice, read by orjson and passed); later
        bodies with the same header read only their tensors, through ``kserve.tensor_from_bytes``."""
        header = body[:hlen]
        known = self._binary.get(header)
        if known is not None and known.max_json == max_json and known.max_input == max_input \
                and len(body) - hlen == known.size:
            blob = memoryview(body)[hlen:]
            try:
                inputs = {name: kserve.tensor_from_bytes(name, datatype, shape, blob[pos:pos + size])
                          for name, datatype, shape, pos, size in known.inputs}
            except InvalidArgument:
                return kserve.parse_request(body, header_length, regions, max_json, max_input)
            return _again_with(known.request, inputs)
        req = kserve.parse_request(body, header_length, regions, max_json, max_input)
        if self._seen.again(header):
            self._learn_binary(header, body, hlen, req, max_json, max_input)
        return req

    def _learn_binary(self, header: bytes, body: bytes, hlen: int, req: kserve.InferRequest, max_json: int,
                      max_input: int) -> None:
        try:
            read = orjson.loads(header)  # as the full path read it first: that reading must have passed
            kserve._parse(body, hlen, read, None, max_input)
        except (orjson.JSONDecodeError, InvalidArgument):
            return
        inputs, pos = [], 0
        for item in read["inputs"]:  # (as _parse walks them: each one's bytes follow the last one's)
            size = (item.get("parameters") or {}).get("binary_data_size")
            if "data" in item or type(size) is not int:
                return
            inputs.append((item["name"], item["datatype"], list(item["shape"]), pos, size))
            pos += size
        if len(self._binary) >= MAX_TEMPLATES:
            self._binary.clear()
        self._binary[header] = Binary(inputs, pos, dataclasses.replace(req, inputs={}), max_json, max_input)

    def parse(self, body: bytes, regions, max_json: int, max_input: int) -> kserve.InferRequest:
        """``kserve.parse_request(body, None, regions, max_json, max_input)``: the same request, or the same
        error."""
        hole = _hole(body)
        if hole is None:
            return kserve.parse_request(body, None, regions, max_json, max_input)
        start, end = hole
        key = body[:start] + body[end:]
        known = self._known.get(key)
        # the same bytes before the list and after it (not only the same bytes in all: where they part matters)
        if known is not None and known.start == start and known.max_json == max_json \
                and known.max_input == max_input and len(body) <= max_json:
            try:
                if len(body) < FAST_MIN_BYTES or known.datatype not in FLOAT_DATATYPES:
                    data = orjson.loads(body[start:end])
                else:  # the full reading's: simdjson, straight into doubles
                    data = jsonfast.doubles(body[start:end])
                    if data is None:
                        raise InvalidArgument("not numbers only")  # (the full reading says what they are)
                arr = kserve._from_json(known.name, known.datatype, known.shape, data)
            except (orjson.JSONDecodeError, InvalidArgument):
                return kserve.parse_request(body, None, regions, max_json, max_input)  # names what is wrong
            return _again_with(known.request, {known.name: arr})
        req = kserve.parse_request(body, None, regions, max_json, max_input)
        if self._seen.again(key):
            self._learn(key, body, start, end, req, max_json, max_input)
        return req

    def _learn(self, key: bytes, body: bytes, start: int, end: int, req: kserve.InferRequest, max_json: int,
               max_input: int) -> None:
        if len(req.inputs) != 1:
            return
        try:
            header = orjson.loads(body)  # read as the full path read it first: that reading must have passed
            kserve._parse(body, len(body), header, None, max_input)
            marked = [orjson.loads(body[:start] + text + body[end:]) for text in _MARK_TEXTS]
        except (orjson.JSONDecodeError, InvalidArgument):
            return
        for read, mark in zip(marked, _MARKS):
            items = read.get("inputs") if type(read) is dict else None
            if type(items) is not list or len(items) != 1 or type(items[0]) is not dict \
                    or items[0].get("data") != mark:
                return
        (name,) = req.inputs
        item = marked[0]["inputs"][0]
        if item.get("name") != name:
            return
        if len(self._known) >= MAX_TEMPLATES:
            self._known.clear()
        # (its inputs are not kept: the first client's tensors would stay as long as the shape)
        self._known[key] = Template(start, name, item["datatype"], list(item["shape"]),
                                    dataclasses.replace(req, inputs={}), max_json, max_input)


def _hole(body: bytes) -> tuple[int, int] | None:
    """Where the first ``"data"`` key's flat list lies in ``body`` (its '[' and one past its ']'), or None. What
    it finds need not be an input's data, nor a key (the text may be in a string): ``_learn`` checks that it is
    the one input's data, and a body is read by its shape only where the bytes around the list are the same."""
    at = body.find(_DATA)
    if at < 0:
        return None
    after = at + len(_DATA)
    start = body.find(b"[", after)  # after the key, its colon and a list holding no list (flat data)
    if start < 0 or body[after:start].strip(_WHITESPACE) != b":":
        return None
    end = body.find(b"]", start)
    # no list in it, and no object (nothing for orjson to nest in: load_header's bound on depth is not needed)
    if end < 0 or body.find(b"[", start + 1, end) >= 0 or body.find(b"{", start + 1, end) >= 0:
        return None
    return start, end + 1
