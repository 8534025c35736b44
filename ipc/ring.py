"""The slot ring: fixed-size slots in one shared-memory segment, owned by state, not by locks.

Layout of the segment (``slots`` slots back to back, each ``SLOT_HEADER + data_bytes``)::

    +--------------------------- slot 0 ---------------------------+--- slot 1 ---+ ...
    | header (4 KiB)                         | data area            |
    | magic, layout version, STATE, seq,     | inputs, then outputs |
    | batch, counts, status, timings,        | each 256-B aligned   |
    | tensor table (32 x descriptor), error, |                      |
    | arena name (direct batches), request   |                      |
    | count; page 2: the request table       |                      |
    +----------------------------------------+----------------------+

The request table describes a batch request by request, for workers whose backend answers each
request on its own (``per_request``): the front writes each request's rows and the outputs its client
asked for; the worker may mark single requests failed, with their messages, before DONE or FAILED.

A direct batch (one request whose tensors lie in its client's arena) leaves the data area unused:
the header names the arena, and its table entries, flagged ``in_arena``, hold arena offsets for the
inputs and for the outputs the front planned, where the worker writes.

States and their single writers::

    FREE --front fills inputs--> FILLED --worker--> RUNNING --worker--> DONE | FAILED
      ^                                                                      |
      +---------------- front reads outputs, answers requests ---------------+

Each transition has exactly one writer; the doorbell record written after a write (run from the
front, done from the worker) is the ordering point between processes, so nobody polls a state. The
payload is always written before the state word, so a reader that sees a state also sees what it
promises. The sequence number lets the front reject a DONE that names a slot it has since reused.
"""

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from gepool.ipc import dtypes, layout
from gepool.ipc.shm import Segment

MAGIC = b"GEPS"
LAYOUT_VERSION = 2
SLOT_HEADER = 8192
MAX_TENSORS = 32
MAX_DIMS = 8
ERROR_BYTES = 1024
MAX_REQUESTS = 256  # requests one batch can describe in its request table
REQUEST_ERROR_BYTES = 1024  # the failed requests' messages, shared among them

FREE, FILLED, RUNNING, DONE, FAILED = range(5)
STATE_NAMES = ("FREE", "FILLED", "RUNNING", "DONE", "FAILED")

# magic, layout version, state, seq, batch, n_inputs, n_outputs, status, error length,
# t_filled, t_started, t_finished (time.monotonic() of the writer: same clock host-wide)
_FIXED = struct.Struct("<4sHHQIHHiH2xddd")
_STATE = struct.Struct("<H")
_STATE_AT = 6
_N_OUT = struct.Struct("<H")
_N_OUT_AT = 22
_COUNTS = struct.Struct("<HH")  # n_inputs, n_outputs
_COUNTS_AT = 20
_STATUS = struct.Struct("<iH")  # status, error length
_STATUS_AT = 24
_TIMES = struct.Struct("<dd")  # t_started, t_finished
_TIMES_AT = 40
_TENSOR = struct.Struct(f"<BBB5xQQ{MAX_DIMS}q")  # dtype code, ndim, in the arena (0/1), offset, nbytes, shape
_TABLE_AT = 64
_ERROR_AT = _TABLE_AT + MAX_TENSORS * _TENSOR.size
# The client arena a direct batch's tensors lie in: name length, then the name (length 0: none).
_ARENA = struct.Struct("<B63s")
_ARENA_AT = _ERROR_AT + ERROR_BYTES
assert _FIXED.size <= _TABLE_AT and _FIXED.size == _TIMES_AT + _TIMES.size
_REQ_COUNT = struct.Struct("<HH")  # requests in the table (0: none given), requests failed
_REQ_COUNT_AT = _ARENA_AT + _ARENA.size
_REQUEST = struct.Struct("<IIBxH")  # rows, requested outputs (bit i: config output i), failed, error length
_REQUESTS_AT = 4096
_REQ_ERRORS_AT = _REQUESTS_AT + MAX_REQUESTS * _REQUEST.size
assert _REQ_COUNT_AT + _REQ_COUNT.size <= _REQUESTS_AT
assert _REQ_ERRORS_AT + REQUEST_ERROR_BYTES <= SLOT_HEADER

MAX_FAILURE_CODE = 253  # a Failure's code travels in the request's failed byte, as 2 + code


class Failure(str):
    """One request's failure message, and ``code``: the code the model failed it with (a python model's
    ``pb_utils.TritonError`` code), None where it gave none."""

    code: int | None = None

    @classmethod
    def of(cls, message: str, code: int | None) -> "Failure":
        failure = cls(message)
        failure.code = code
        return failure


class TensorDesc(NamedTuple):
    """One tensor in a slot's data area (offset relative to the data area), or, in a direct batch, in
    the client's arena the slot names (offset relative to the arena)."""

    datatype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    in_arena: bool = False


@dataclass(frozen=True)
class RingHandle:
    """What a worker needs to map a ring the front created."""

    name: str
    slots: int
    data_bytes: int


class Slot:
    """A view of one slot; methods are named for the side that may call them."""

    def __init__(self, buf: memoryview, index: int, data_bytes: int) -> None:
        self.index = index
        self.header = buf[:SLOT_HEADER]
        self.data = buf[SLOT_HEADER:SLOT_HEADER + data_bytes]
        self.data_bytes = data_bytes

    @property
    def state(self) -> int:
        return _STATE.unpack_from(self.header, _STATE_AT)[0]

    def set_state(self, state: int) -> None:
        _STATE.pack_into(self.header, _STATE_AT, state)

    # front ---------------------------------------------------------------------------
    def fill(self, seq: int, batch: int, inputs: list[TensorDesc], t_filled: float,
             outputs: list[TensorDesc] = (), arena: str = "", requests: list[tuple[int, int]] = ()) -> None:
        """Records the batch whose inputs the front has copied in; moves FREE -> FILLED. A direct batch
        names the client ``arena`` its inputs lie in and the ``outputs`` places the worker writes to;
        ``requests`` lists (rows, requested-output mask) per request, for a per-request worker."""
        if len(requests) > MAX_REQUESTS:
            raise ValueError(f"a slot's request table holds at most {MAX_REQUESTS} requests, got {len(requests)}")
        _REQ_COUNT.pack_into(self.header, _REQ_COUNT_AT, len(requests), 0)
        for i, (rows, mask) in enumerate(requests):
            _REQUEST.pack_into(self.header, _REQUESTS_AT + i * _REQUEST.size, rows, mask, 0, 0)
        _FIXED.pack_into(self.header, 0, MAGIC, LAYOUT_VERSION, self.state, seq, batch, len(inputs), len(outputs),
                         0, 0, t_filled, 0.0, 0.0)
        self._write_table(0, inputs)
        self._write_table(len(inputs), outputs)
        name = arena.encode()
        if len(name) > _ARENA.size - 1:
            raise ValueError(f"arena name {arena!r} is longer than {_ARENA.size - 1} bytes")
        _ARENA.pack_into(self.header, _ARENA_AT, len(name), name)
        self.set_state(FILLED)  # last: the payload above is what FILLED promises

    def release(self) -> None:
        """DONE/FAILED -> FREE once every request of the batch is answered."""
        self.set_state(FREE)

    # worker --------------------------------------------------------------------------
    def raw(self, desc: TensorDesc) -> memoryview:
        return self.data[desc.offset:desc.offset + desc.nbytes]

    def read(self) -> tuple[int, int, list[TensorDesc]]:
        """(seq, batch size, input descriptors) of a FILLED slot."""
        magic, version, _, seq, batch, n_in, _, _, _, _, _, _ = _FIXED.unpack_from(self.header, 0)
        if magic != MAGIC or version != LAYOUT_VERSION:
            raise ValueError(f"slot {self.index}: bad magic {magic!r} or layout version {version}")
        return seq, batch, self._read_table(0, n_in)

    def batch_key(self) -> bytes:
        """The header bytes that fix a FILLED batch's layout (magic, batch size, counts, tensor table,
        arena): two batches with equal keys in one slot have the same tensors at the same places."""
        n_in, n_out = _COUNTS.unpack_from(self.header, _COUNTS_AT)
        end = _TABLE_AT + min(n_in + n_out, MAX_TENSORS) * _TENSOR.size
        return b"".join((self.header[:6], self.header[16:24], self.header[_TABLE_AT:end],
                         self.header[_ARENA_AT:_ARENA_AT + _ARENA.size]))

    def direct(self) -> tuple[str, list[TensorDesc]]:
        """(arena name, output places) of a FILLED direct batch; ("", []) for a batch in the slot."""
        length, name = _ARENA.unpack_from(self.header, _ARENA_AT)
        if not length:
            return "", []
        n_in, n_out = _COUNTS.unpack_from(self.header, _COUNTS_AT)
        return name[:length].decode(), self._read_table(n_in, n_out)

    def requests(self) -> list[tuple[int, int]]:
        """(rows, requested-output mask) per request of a FILLED slot; [] when the front gave none."""
        count = _REQ_COUNT.unpack_from(self.header, _REQ_COUNT_AT)[0]
        if count > MAX_REQUESTS:
            raise ValueError(f"slot {self.index}: request table of {count} entries (at most {MAX_REQUESTS})")
        return [_REQUEST.unpack_from(self.header, _REQUESTS_AT + i * _REQUEST.size)[:2] for i in range(count)]

    def fail_requests(self, messages: dict[int, str]) -> None:
        """Marks single requests of the batch failed, each with its message (the failed share
        REQUEST_ERROR_BYTES) and the code of a ``Failure``; call before finish() or fail(), whose state write
        publishes it."""
        count = _REQ_COUNT.unpack_from(self.header, _REQ_COUNT_AT)[0]
        if any(not 0 <= i < count for i in messages):
            raise ValueError(f"slot {self.index}: failed request indices {sorted(messages)} outside 0..{count - 1}")
        share = REQUEST_ERROR_BYTES // max(1, len(messages))
        pos = _REQ_ERRORS_AT
        for i in sorted(messages):
            text = messages[i].encode("utf-8", "replace")[:share]
            self.header[pos:pos + len(text)] = text
            rows, mask = _REQUEST.unpack_from(self.header, _REQUESTS_AT + i * _REQUEST.size)[:2]
            code = getattr(messages[i], "code", None)
            bad = 2 + code if type(code) is int and 0 <= code <= MAX_FAILURE_CODE else 1  # (1: failed, no code)
            _REQUEST.pack_into(self.header, _REQUESTS_AT + i * _REQUEST.size, rows, mask, bad, len(text))
            pos += len(text)
        _REQ_COUNT.pack_into(self.header, _REQ_COUNT_AT, count, len(messages))

    def finish(self, n_inputs: int, outputs: list[TensorDesc], t_started: float, t_finished: float) -> None:
        """Records the outputs the worker wrote; moves RUNNING -> DONE."""
        self._write_table(n_inputs, outputs)
        _N_OUT.pack_into(self.header, _N_OUT_AT, len(outputs))
        _STATUS.pack_into(self.header, _STATUS_AT, 0, 0)
        _TIMES.pack_into(self.header, _TIMES_AT, t_started, t_finished)
        self.set_state(DONE)

    def fail(self, message: str, t_started: float, t_finished: float) -> None:
        """Records why the batch failed; moves RUNNING -> FAILED."""
        text = message.encode("utf-8", "replace")[:ERROR_BYTES]
        self.header[_ERROR_AT:_ERROR_AT + len(text)] = text
        _STATUS.pack_into(self.header, _STATUS_AT, 1, len(text))
        _TIMES.pack_into(self.header, _TIMES_AT, t_started, t_finished)
        self.set_state(FAILED)

    # both ----------------------------------------------------------------------------
    def result(self) -> tuple[int, list[TensorDesc], str, tuple[float, float, float]]:
        """(seq, output descriptors, error text, (t_filled, t_started, t_finished))."""
        _, _, _, seq, _, n_in, n_out, status, err_len, t0, t1, t2 = _FIXED.unpack_from(self.header, 0)
        error = bytes(self.header[_ERROR_AT:_ERROR_AT + err_len]).decode("utf-8", "replace") if status else ""
        return seq, self._read_table(n_in, n_out), error, (t0, t1, t2)

    def request_errors(self) -> dict[int, str]:
        """{request index: its Failure} for the requests the worker failed one by one (usually none)."""
        count, failed = _REQ_COUNT.unpack_from(self.header, _REQ_COUNT_AT)
        if not failed:
            return {}
        out, pos = {}, _REQ_ERRORS_AT
        for i in range(min(count, MAX_REQUESTS)):
            _, _, bad, length = _REQUEST.unpack_from(self.header, _REQUESTS_AT + i * _REQUEST.size)
            if bad:
                length = min(length, _REQ_ERRORS_AT + REQUEST_ERROR_BYTES - pos)
                out[i] = Failure.of(bytes(self.header[pos:pos + length]).decode("utf-8", "replace"),
                                    bad - 2 if bad >= 2 else None)
                pos += length
        return out

    def array(self, desc: TensorDesc, arena: memoryview | None = None) -> np.ndarray:
        """A numpy view of one tensor (in ``arena`` if it lies there); it keeps the mapping alive, so
        drop it before closing. (BYTES come back as a new object array: they have no fixed-size view.)"""
        data = self.data
        if desc.in_arena:
            if arena is None:
                raise ValueError(f"slot {self.index}: a tensor lies in an arena, and none is mapped")
            data = arena
        if desc.datatype == dtypes.BYTES:
            return dtypes.deserialize_bytes(data[desc.offset:desc.offset + desc.nbytes], desc.shape)
        dtype = dtypes.to_numpy(desc.datatype)
        count = desc.nbytes // dtype.itemsize
        return np.frombuffer(data, dtype, count, desc.offset).reshape(desc.shape)

    def _write_table(self, first: int, descs: list[TensorDesc]) -> None:
        if first + len(descs) > MAX_TENSORS:
            raise ValueError(f"a slot holds at most {MAX_TENSORS} tensors")
        for i, d in enumerate(descs):
            if len(d.shape) > MAX_DIMS:
                raise ValueError(f"a slot tensor has at most {MAX_DIMS} dims, got {len(d.shape)}")
            shape = tuple(d.shape) + (0,) * (MAX_DIMS - len(d.shape))
            _TENSOR.pack_into(self.header, _TABLE_AT + (first + i) * _TENSOR.size,
                              dtypes.CODES[d.datatype], len(d.shape), d.in_arena, d.offset, d.nbytes, *shape)

    def _read_table(self, first: int, count: int) -> list[TensorDesc]:
        out = []
        for i in range(first, first + count):
            code, ndim, in_arena, offset, nbytes, *shape = _TENSOR.unpack_from(self.header,
                                                                               _TABLE_AT + i * _TENSOR.size)
            if not in_arena and offset + nbytes > self.data_bytes:  # an arena's bounds are checked on use
                raise ValueError(f"slot {self.index}: tensor {i} lies past the data area")
            out.append(TensorDesc(dtypes.DATATYPES[code], tuple(shape[:ndim]), offset, nbytes, bool(in_arena)))
        return out


class Ring:
    """``slots`` slots in one segment; the front creates it, one worker attaches."""

    def __init__(self, segment: Segment, slots: int, data_bytes: int) -> None:
        self.segment = segment
        self.data_bytes = data_bytes
        stride = SLOT_HEADER + data_bytes
        mv = memoryview(segment.buf)
        self.slots = [Slot(mv[i * stride:(i + 1) * stride], i, data_bytes) for i in range(slots)]

    @classmethod
    def create(cls, name: str, slots: int, data_bytes: int) -> "Ring":
        data_bytes = layout.align(max(data_bytes, 1), 4096)
        seg = Segment.create(name, slots * (SLOT_HEADER + data_bytes))
        ring = cls(seg, slots, data_bytes)
        for slot in ring.slots:
            _FIXED.pack_into(slot.header, 0, MAGIC, LAYOUT_VERSION, FREE, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0)
        return ring

    @classmethod
    def attach(cls, handle: RingHandle) -> "Ring":
        return cls(Segment.attach(handle.name), handle.slots, handle.data_bytes)

    def handle(self) -> RingHandle:
        return RingHandle(self.segment.name, len(self.slots), self.data_bytes)

    def close(self) -> None:
        """Drops the slot views, then the mapping (views first, or unmapping is refused)."""
        for slot in self.slots:
            for view in (slot.header, slot.data):
                try:
                    view.release()
                except BufferError:  # a numpy view still points here; the mapping outlives it
                    pass
        self.slots = []
        self.segment.close()
