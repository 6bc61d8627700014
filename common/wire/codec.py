"""Tensor codec: Payload <-> a header Envelope plus raw little-endian data frames.

Wire format (proto/fedhop.proto): a stream of `Frame` messages.  The first carries the
`Envelope` (tensor specs, scalars, routing); the next carry the tensors' bytes, concatenated
in spec order and cut into chunks of at most `chunk_bytes`; when the envelope says `checksum`,
a last 9-byte trailer frame carries the XXH3-64 of those bytes (`trailer_frame`).  The digest
trails the data so that the sender need not read the whole model before its first frame: each
frame is hashed right after it is cut, while it is in cache, and the trailer carries the digest
of them all (`_Cuts.digest`).

Copies, the cost that dominates on this machine (shared/research/limits.md):
- encode: tensor memory -> frame bytes is one copy per byte (`bytes.join` over memoryviews
  of the tensors); the frame is a valid protobuf `Frame{data}` message built by hand (tag
  0x12, varint length, bytes), so no second serialisation pass is made.  The frames are cut at
  encode time (they are the message's snapshot: a later in-place change of the tensors does not
  reach them) or, for tensors handed over (`hand_over`), as the send pulls them (`Frames`);
- decode: each data frame is copied once into one preallocated buffer; every tensor is then a
  zero-copy view of that buffer (a tensor whose offset is misaligned for its dtype is copied).
  A large buffer whose tensors are all gone is reused by the next message of its size
  (`RecvBuffers`): a fresh one costs its page faults again on every message, 0.3-0.9 CPU s/GB
  here, as much as the copy itself (docs/performance.md, "Large models").  A decoder given
  `FileBuffers` (a streamed round's large replies) writes the frames to an unnamed file instead
  and maps it when the message is whole (common/wire/filebacked.py).

Everything received is validated before use: declared sizes against the limit before any
allocation, dtype names, nbytes = prod(shape) * itemsize, total bytes, frame order, and the
XXH3-64 checksum of the data bytes when the sender's envelope says `checksum` (`encode(..., checksum=True)`,
the default; a message so marked whose trailer is missing or differs is refused
CHECKSUM_MISMATCH, and a receiver whose run has `security.checksum` on refuses a message with data
bytes that declares no checksum, CHECKSUM_MISSING: `FrameDecoder.require_checksum`): plaintext TCP has no end-to-end integrity check above the hop, so a corrupted
tensor byte would otherwise decode as a valid, wrong number.  The checksum is XXH3-64 (the
`xxhash` package, ~25 GB/s here; zlib's CRC-32 runs at ~5.5 GB/s and halved the codec's speed).
"""
from __future__ import annotations

import bisect
import collections
import math
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
import xxhash

from fedhop.common.util.text import MAX_ERROR_TEXT, one_line
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.filebacked import FileBuffers, FileSink
from fedhop.common.wire.message import CHUNK, FlatView, Payload, Scalar
from fedhop.common.wire.msgids import new_msg_id

if sys.byteorder != "little":  # pragma: no cover
    raise RuntimeError("fedhop's wire format is little-endian; this host is big-endian")

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "complex64": torch.complex64, "complex128": torch.complex128,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}

_TAG_HEADER = 0x0A  # Frame field 1 (header), wire type 2
_HEADER_PREFIX = bytes([_TAG_HEADER])
_TAG_DATA = 0x12    # Frame field 2 (data), wire type 2
_TAG_TRAILER = 0x19  # Frame field 3 (data_xxh3), wire type 1 (fixed64): the trailer
TRAILER_BYTES = 9    # a trailer frame: its tag and the 8-byte little-endian digest
# a tensor's dimensions at most: numpy's ndarray holds 64, a model's tensors a handful; more is refused
# (BAD_SHAPE) before numpy or torch would raise on it
MAX_DIMS = 32
DEFAULT_CHUNK = 4 * 1024 * 1024
FRAME_OVERHEAD = 5  # gRPC length-prefixed message framing, per message


class PayloadError(ValueError):
    """A received payload is malformed; `code` names the failure class for the ledger/events.
    The message often quotes the sender's own names (a tensor's, a scalar's): it is kept one
    bounded line (`one_line`), as it goes into the logs and run.db."""

    def __init__(self, code: str, message: str) -> None:
        code, message = one_line(code, 64), one_line(message, MAX_ERROR_TEXT)
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message


# ----------------------------------------------------------------------------- varints
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def varint_len(n: int) -> int:
    """len(_varint(n)) for n >= 0, without making the bytes: one byte per started 7 bits."""
    return (n.bit_length() + 6) // 7 or 1


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise PayloadError("MALFORMED_FRAME", "truncated or overlong varint in frame header")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


# ----------------------------------------------------------------------------- scalars
def scalar_to_pb(value: Scalar, out: pb.Scalar) -> None:
    if isinstance(value, bool):
        out.b = value
    elif isinstance(value, int):
        out.i = value
    elif isinstance(value, float):
        out.f = value
    elif isinstance(value, str):
        out.s = value
    else:
        raise TypeError(f"scalar of unsupported type {type(value).__name__}")


def scalar_from_pb(s: pb.Scalar) -> Scalar:
    kind = s.WhichOneof("value")
    if kind is None:
        raise PayloadError("MALFORMED_SCALAR", "scalar with no value")
    return getattr(s, kind)


# ----------------------------------------------------------------------------- encode
def trailer_frame(digest: int) -> bytes:
    """The trailer frame: a protobuf `Frame{data_xxh3}` (tag 0x19, the digest as fixed64)."""
    return bytes([_TAG_TRAILER]) + digest.to_bytes(8, "little")


#: the most data bytes a message may have for its tensors to be made from numpy views of its
#: receive buffer (`FrameDecoder.finish`); a larger one's buffer may be a file's mapping
SMALL_MESSAGE_BYTES = 4 << 20
#: the numpy dtype of each codec dtype numpy has (a received tensor is made from a numpy view)
_NUMPY_DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in
                                      ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8",
                                       "complex64", "complex128")}
_NUMPY_DTYPES["bool"] = np.dtype(np.bool_)


def tensor_bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview (copies only if it is not contiguous).  A CPU
    tensor of a dtype numpy has, contiguous, not empty and not requiring grad is numpy's view, in
    one torch call: `numpy()` refuses every other tensor (RuntimeError or TypeError, as
    memoryview's cast refuses a strided or empty array), which then goes torch's way below."""
    try:
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy stubs: ndarray is a Buffer only for Python >= 3.12
    except (RuntimeError, TypeError, ValueError):
        pass
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy stubs: ndarray is a Buffer only for Python >= 3.12


class SnapshotChanged(RuntimeError):
    """A handed-over tensor (`hand_over`) was changed in place while its message was being sent."""


class _Cuts:
    """The data frames of one message over its tensors' bytes (`views`, in spec order): frame k
    is bytes [k * chunk_bytes, (k + 1) * chunk_bytes) of their concatenation, a hand-built
    protobuf `Frame{data}` (tag 0x12, length varint, bytes), cut with one copy.  Each frame is cut
    once, on first use, and kept (a message sent to many peers is cut once); the views are let go
    once every frame is cut.  Concurrent calls may race to cut the same frame: both cut the same
    bytes and one is kept.  `guards`: (tensor, version) of handed-over tensors, checked at each
    cut so that bytes changed in place after encode are never sent.  `keep=False` (handed-over
    tensors only): no frame is kept, each send cuts its own as it pulls them, so a message sent
    to many peers never exists whole as frames (a copy per send instead of a model held).
    `checksum`: a trailer frame with the XXH3-64 of the bytes follows the data frames; its digest
    is made once per message (`digest`): by `encode` as it cuts a snapshot (`set_digest`) or, for
    handed-over tensors (`hash_in_order`), frame by frame as the sends cut them, each frame right
    after its cut by whichever send cuts the next one in order first."""

    __slots__ = ("views", "ends", "chunk_bytes", "total", "cut", "left", "guards", "lock", "keep",
                 "checksum", "_digest", "_hasher", "_hashed", "_hash_lock")

    def __init__(self, views: list[memoryview], chunk_bytes: int, guards: list | None = None,
                 keep: bool = True, checksum: bool = False) -> None:
        self.views: list[memoryview] | None = [v for v in views if len(v)]
        self.ends: list[int] = []
        total = 0
        for v in self.views:
            total += len(v)
            self.ends.append(total)
        self.chunk_bytes = chunk_bytes
        self.total = total
        self.cut: list[bytes | None] = [None] * -(-total // chunk_bytes)
        self.left = len(self.cut)
        self.guards = guards or []
        self.lock = threading.Lock()
        self.keep = keep or not guards   # a snapshot (nothing handed over) is always kept
        self.checksum = checksum and total > 0   # a message with no data bytes has no trailer
        self._digest: int | None = None
        self._hasher: "xxhash.xxh3_64 | None" = None   # `hash_in_order`: holds frames 0.._hashed-1
        self._hashed = 0
        self._hash_lock = threading.Lock()

    def set_digest(self, value: int) -> None:
        self._digest = value

    def hash_in_order(self) -> None:
        """Make the digest of handed-over tensors from their frames as the sends cut them: the
        send that cuts the next frame in order hashes it while it is in cache (`_hash_cut`), and
        `digest` hashes whatever no send did.  The header and the data frames need no digest, so
        no pass over the model comes before the first frame; only the trailer needs it."""
        self._hasher = xxhash.xxh3_64()

    def _data_of(self, k: int, frame: bytes) -> memoryview:
        """Frame k's data bytes (the frame without its tag and length)."""
        return memoryview(frame)[len(frame) - min(self.chunk_bytes, self.total - k * self.chunk_bytes):]

    def _hash_cut(self, k: int, frame: bytes) -> None:
        """Add frame k, just cut, to the digest if it is the next one in order and no other send
        is hashing (another send's cut of the same frame, or `digest`, would do it)."""
        if self._hashed != k or not self._hash_lock.acquire(blocking=False):
            return
        try:
            hasher = self._hasher
            if hasher is not None and self._hashed == k:
                hasher.update(self._data_of(k, frame))
                self._hashed = k + 1
                if self._hashed == len(self.cut):
                    self._digest, self._hasher = hasher.intdigest(), None
        finally:
            self._hash_lock.release()

    def digest(self) -> int:
        """The XXH3-64 of the message's data bytes.  For handed-over tensors, the frames no send
        has hashed yet (cut out of order, or not cut) are hashed here, from their kept frames or
        from the tensors; a tensor changed in place meanwhile (its version counter moved) fails
        it, as it fails a cut."""
        if self._digest is None and self._hasher is not None:
            with self._hash_lock:
                hasher = self._hasher
                if hasher is not None:
                    views = self.views   # read before the frames: None only once every frame is cut and kept
                    for k in range(self._hashed, len(self.cut)):
                        frame = self.cut[k]
                        if frame is not None:
                            hasher.update(self._data_of(k, frame))
                        else:
                            assert views is not None
                            start = k * self.chunk_bytes
                            for piece in self._pieces(views, start, min(start + self.chunk_bytes, self.total)):
                                hasher.update(piece)
                        self._hashed = k + 1
                    self._digest, self._hasher = hasher.intdigest(), None
        _check_guards(self.guards)   # kept until every frame is cut and kept: after that the frames are the snapshot
        if self._digest is None:
            raise RuntimeError("the message has no checksum")
        return self._digest

    def _pieces(self, views: list[memoryview], start: int, stop: int) -> list[memoryview]:
        """Views of bytes [start, stop) of the concatenated tensors."""
        i = bisect.bisect_right(self.ends, start)
        pieces = []
        while start < stop:
            begin = self.ends[i] - len(views[i])
            take = min(stop, self.ends[i]) - start
            pieces.append(views[i][start - begin:start - begin + take])
            start += take
            i += 1
        return pieces

    def __getitem__(self, k: int) -> bytes:
        frame = self.cut[k]
        if frame is not None:
            return frame
        views = self.views
        if views is None:   # another thread cut the last frame (and let the views go) meanwhile
            return self.cut[k]   # type: ignore[return-value]  # views go only once every frame is cut
        _check_guards(self.guards)
        start = k * self.chunk_bytes
        pieces = self._pieces(views, start, min(start + self.chunk_bytes, self.total))
        frame = b"".join([_data_prefix(sum(len(p) for p in pieces)), *pieces])   # the one copy of these bytes
        if self._hasher is not None:
            self._hash_cut(k, frame)
        if not self.keep:
            return frame
        with self.lock:
            if self.cut[k] is None:
                self.cut[k] = frame
                self.left -= 1
                if self.left == 0:
                    self.views, self.guards = None, []
            return self.cut[k]   # type: ignore[return-value]  # set just above (by this thread or another)


def _check_guards(guards: list) -> None:
    for t, version in guards:
        if t._version != version:
            raise SnapshotChanged("a handed-over tensor was changed in place while its message was being sent")


def hand_over(payload: Payload, keep_frames: bool = True) -> Payload:
    """Hand the payload's tensors over to the codec: the caller will not change them in place from
    now on, so `encode` neither snapshots them nor cuts frames before the send, but cuts each frame
    from the tensors' own memory as gRPC pulls it, in gRPC's sending thread.  A tensor changed in
    place after all (torch's version counter moved) makes the send fail (`SnapshotChanged`) rather
    than carry bytes other than those encoded.  The digest is made from the frames as they are cut
    (`_Cuts.hash_in_order`), so it vouches for the bytes on the wire: a write that bypasses the
    counter is caught by a receiver only where its send's bytes differ from those hashed (another
    send of the message).  `keep_frames=False`: a frame, once sent, is not kept for the next send
    of the same message (`_Cuts`): each send cuts its own, and no model-sized set of frames is
    held while the message goes to many peers.  Returns the payload."""
    for t in payload.tensors.values():
        t._fedhop_handed_over = t._version   # type: ignore[attr-defined]  # a marker `encode` reads with getattr
        t._fedhop_keep_frames = keep_frames   # type: ignore[attr-defined]
    return payload


class Frames(Sequence):
    """A message's frames, a read-only sequence of `bytes`: its header frame, then its data frames
    (`_Cuts`), cut at encode time or, for handed-over tensors, only when pulled, by the thread
    that pulls them (gRPC's sending thread); then, when the message is checksummed, its trailer
    (the digest, `_Cuts.digest`).  Cutting frames ahead of the send in helper threads was
    measured slower on two cores (docs/performance.md, "Frames cut and hashed by the sending
    thread").  The frames' lengths follow from the chunk layout (`lengths`) and are known
    without cutting or hashing.  The bytes are exactly those of an eager cut."""

    __slots__ = ("header", "_cuts", "_count", "_lengths", "_total")

    def __init__(self, header: bytes, data: "list[memoryview] | _Cuts", chunk_bytes: int = DEFAULT_CHUNK) -> None:
        self.header = header
        self._cuts = data if isinstance(data, _Cuts) else _Cuts(list(data), chunk_bytes)
        self._count = 1 + len(self._cuts.cut) + self._cuts.checksum
        self._lengths: list[int] | None = None
        self._total: int | None = None

    @property
    def chunk_bytes(self) -> int:
        return self._cuts.chunk_bytes

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError("frame index out of range")
        if i == 0:
            return self.header
        if i > len(self._cuts.cut):
            return trailer_frame(self._cuts.digest())
        return self._cuts[i - 1]

    def __iter__(self) -> Iterator[bytes]:
        yield self.header
        cuts = self._cuts
        for k in range(len(cuts.cut)):
            yield cuts[k]
        if cuts.checksum:
            yield trailer_frame(cuts.digest())

    def __eq__(self, other) -> bool:
        if isinstance(other, (Frames, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None   # type: ignore[assignment]  # unhashable, as a list is

    def __add__(self, other) -> list[bytes]:   # as a list would: frames of several messages, one bundle
        return [*self, *other]

    def __radd__(self, other) -> list[bytes]:
        return [*other, *self]

    def lengths(self) -> list[int]:
        """Every frame's length, from the chunk layout (nothing is cut; worked out once, as the
        ledger, the batch's grouping and its framing each ask)."""
        return list(self._layout())

    def total(self) -> int:
        """The frames' bytes in all (worked out once: both of a message's ledger records ask)."""
        if self._total is None:
            self._total = sum(self._layout())
        return self._total

    def _layout(self) -> list[int]:
        if self._lengths is None:
            total, chunk = self._cuts.total, self._cuts.chunk_bytes
            full, last = divmod(total, chunk)
            sizes = [chunk] * full + ([last] if last else [])
            trailer = [TRAILER_BYTES] if self._cuts.checksum else []
            self._lengths = [len(self.header), *(1 + varint_len(n) + n for n in sizes), *trailer]
        return self._lengths

    def with_header(self, header: bytes) -> "Frames":
        """The same data frames (the same snapshot) under another header frame."""
        return Frames(header, self._cuts)


def frame_lengths(frames: Sequence[bytes]) -> list[int]:
    """The frames' lengths; lazy `Frames` say them without cutting."""
    return frames.lengths() if isinstance(frames, Frames) else [len(f) for f in frames]


@dataclass
class Encoded:
    """The frames of one message, and their sizes for the ledger.  `frames` is a `Frames` (data
    cut lazily from the encode-time snapshot) or, for a message assembled from others' frames (a
    batch), a list."""

    frames: Sequence[bytes]
    envelope: pb.Envelope
    tensor_bytes: int
    framing: int | None = None   # gRPC framing bytes when sent bundled (`bundle_framing`); None: streamed
    # a message of a batch: how its call's replies come back (common/transport/base.py `ReplyBundles`)
    reply_bundles: Any = None
    _shared: bytes | None = field(default=None, repr=False, compare=False)   # `_shared_fields`, once made

    def frame_lengths(self) -> list[int]:
        return frame_lengths(self.frames)

    @property
    def payload_bytes(self) -> int:
        frames = self.frames
        return frames.total() if isinstance(frames, Frames) else sum(len(f) for f in frames)

    def with_header(self, envelope: pb.Envelope) -> "Encoded":
        """The same data frames under another header (one model sent to many clients is snapshot
        once; its frames are cut per call, as sent).  `envelope` holds routing fields only (what
        `make_envelope` gives); the tensor specs, scalars, control data and data size are this
        message's.  The header is the routing fields' bytes followed by this message's own fields,
        serialised once (`_shared_fields`): protobuf reads fields in any order, so it parses to
        the same envelope and has the same length as the merged envelope serialised."""
        if (envelope.tensors or envelope.scalars or envelope.HasField("control") or envelope.data_bytes
                or envelope.checksum):
            raise ValueError("with_header: the envelope must hold routing fields only")
        shared = self._shared_fields()
        header = _header_bytes(envelope.SerializeToString() + shared)
        envelope.MergeFromString(shared)
        if isinstance(self.frames, Frames):
            frames: Sequence[bytes] = self.frames.with_header(header)
        else:
            frames = [header, *self.frames[1:]]
        return Encoded(frames=frames, envelope=envelope, tensor_bytes=self.tensor_bytes)

    def _shared_fields(self) -> bytes:
        """This message's tensor specs, scalars, control data, data size and checksum flag,
        serialised (made once: a broadcast goes under one header per receiver)."""
        if self._shared is None:
            shared = pb.Envelope(data_bytes=self.envelope.data_bytes, checksum=self.envelope.checksum)
            shared.tensors.extend(self.envelope.tensors)
            for k, v in self.envelope.scalars.items():
                shared.scalars[k].CopyFrom(v)
            if self.envelope.HasField("control"):
                shared.control.CopyFrom(self.envelope.control)
            self._shared = shared.SerializeToString()
        return self._shared

    @property
    def framed_bytes(self) -> int:
        overhead = self.framing if self.framing is not None else FRAME_OVERHEAD * len(self.frames)
        return self.payload_bytes + overhead


def bundle_framing(frame_lengths) -> int:
    """The bytes a `FrameBundle` (one unary request of whole frames) adds to its frames on the
    wire: gRPC's 5-byte prefix once, and each frame's field tag and length varint."""
    return FRAME_OVERHEAD + sum(1 + varint_len(n) for n in frame_lengths)


def frame_framing(frame_lengths) -> int:
    """The bytes each frame adds inside a `FrameBundle` (its field tag and length varint): a
    message's share of a bundle that carries several (a batch); the bundle's 5-byte gRPC prefix
    is the first message's."""
    return sum(1 + varint_len(n) for n in frame_lengths)


def split_bundle(frames: list[bytes]) -> list[list[bytes]]:
    """The messages of a bundle that carries several (a batch: one call to one process for
    several logical clients), each a header frame and the data frames its envelope declares.
    A bundle that does not parse so comes back whole, as one message, for the decoder to reject
    with its usual typed error."""
    messages: list[list[bytes]] = []
    need, trailer = 0, False   # the open message's data bytes still to come, and whether its trailer is
    for frame in frames:
        try:
            mv = memoryview(frame)
            if mv[0] == _TAG_TRAILER:
                if trailer and need == 0 and len(mv) == TRAILER_BYTES:
                    trailer = False
                    messages[-1].append(frame)
                    continue
                return [frames]
            length, start = _read_varint(mv, 1)
            if mv[0] == _TAG_HEADER and need == 0 and not trailer:
                env = pb.Envelope.FromString(bytes(mv[start:start + length]))
                need, trailer = int(env.data_bytes), env.checksum
                messages.append([frame])
                continue
            if mv[0] != _TAG_HEADER and 0 < length <= need and messages:
                need -= length
                messages[-1].append(frame)
                continue
        except Exception:   # a truncated varint or header: not a batch this function can split
            pass
        return [frames]
    return messages if messages and need == 0 and not trailer else [frames]


def bundle_bytes(frames: Sequence[bytes]) -> bytes:
    """`FrameBundle(frames=frames)` serialized: field 1 (tag 0x0A), a length varint, the frame."""
    return b"".join(part for f in frames for part in (b"\x0a", _varint(len(f)), f))


def make_envelope(*, run_id: str, round: int, src: str, dst: str, method: str, step: int = 0,
                  token: str = "", msg_id: str | None = None) -> pb.Envelope:
    return pb.Envelope(run_id=run_id, round=round, step=step, src=src, dst=dst, method=method,
                       msg_id=msg_id or new_msg_id(), token=token)


def encode(payload: Payload, envelope: pb.Envelope, chunk_bytes: int = DEFAULT_CHUNK,
           checksum: bool = True) -> Encoded:
    """Fill `envelope` with the payload's specs and scalars, and make the message's `Frames`.

    The frames carry the values the tensors had at encode time, whatever the caller does to them
    later while a call is still sending (a message sent to many peers is encoded once and shared,
    `Encoded.with_header`).  By default the data frames are cut here, from the tensors' memory:
    the frames are then the snapshot (one copy, as the cut needs anyway), each hashed right after
    it is cut, while in cache.  Tensors handed over (`hand_over`) need no snapshot: their frames
    are cut only as the send pulls them (`Frames`) and, when they span more than one chunk, each
    is hashed right after that cut too (`_Cuts.hash_in_order`): only the trailer waits for the
    digest.

    `checksum`: end the message with a trailer frame holding the XXH3-64 of the data bytes, and
    say so in the envelope (the receiver verifies it)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    views: list[memoryview] = []
    guards: list | None = []
    keep = False   # handed-over tensors whose frames are cut per send (`hand_over(keep_frames=False)`)
    total = 0
    del envelope.tensors[:]
    layout = []
    for name, t in payload.tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor '{name}': dtype {t.dtype} is not supported by the codec")
        view = tensor_bytes_view(t)
        layout.append((name, t.dtype, t.shape))
        if guards is not None and getattr(t, "_fedhop_handed_over", None) == t._version:
            guards.append((t, t._version))
            keep = keep or getattr(t, "_fedhop_keep_frames", True)
        else:
            guards = None   # one tensor not handed over: the message is cut (snapshot) now
        views.append(view)
        total += len(view)
    if layout:
        envelope.MergeFromString(_specs_bytes(tuple(layout)))
    cuts = _Cuts(views, chunk_bytes, guards, keep=keep or not views, checksum=checksum)
    digest = xxhash.xxh3_64() if cuts.checksum else None
    if guards is None:
        for k in range(len(cuts.cut)):
            frame = cuts[k]
            if digest is not None:
                digest.update(cuts._data_of(k, frame))
    elif digest is not None and total > chunk_bytes:
        cuts.hash_in_order()
        digest = None
    elif digest is not None:
        for view in views:
            digest.update(view)
    if digest is not None:
        cuts.set_digest(digest.intdigest())
    envelope.scalars.clear()
    for name, value in payload.scalars.items():
        scalar_to_pb(value, envelope.scalars[name])
    if payload.control is not None and payload.control.ByteSize():   # empty control data is no control data
        envelope.control.CopyFrom(payload.control)
    else:
        envelope.ClearField("control")
    envelope.data_bytes = total
    envelope.checksum = cuts.checksum
    return Encoded(frames=Frames(_header_frame(envelope), cuts), envelope=envelope, tensor_bytes=total)


#: the serialized tensor specs of each layout encoded so far (`_specs_bytes`)
_SPECS: dict[tuple, bytes] = {}


def _specs_bytes(layout: tuple[tuple[str, torch.dtype, torch.Size], ...]) -> bytes:
    """An Envelope holding only the tensor specs of `layout` ((name, dtype, shape) in order),
    serialized: merged into a message's envelope it appends those specs, the same fields that
    adding each spec would set, in one parse instead of one protobuf call per tensor.  A run
    sends a few layouts over and over (the model, its update), so each is built once."""
    data = _SPECS.get(layout)
    if data is None:
        specs = pb.Envelope()
        for name, dtype, shape in layout:
            specs.tensors.add(name=name, dtype=DTYPE_NAMES[dtype], shape=list(shape),
                              nbytes=math.prod(shape) * ITEMSIZE[DTYPE_NAMES[dtype]])
        data = specs.SerializeToString()
        if len(_SPECS) >= 256:   # many layouts (names made per message): keep the memory bounded
            _SPECS.clear()
        _SPECS[layout] = data
    return data


def _header_frame(envelope: pb.Envelope) -> bytes:
    return _header_bytes(envelope.SerializeToString())


def _header_bytes(head: bytes) -> bytes:
    """A header frame holding the serialised envelope `head`."""
    return b"".join((_HEADER_PREFIX, _varint(len(head)), head))


_PREFIXES: dict[int, bytes] = {}


def _data_prefix(n: int) -> bytes:
    """A data frame's tag and length varint (cached: every full chunk has the same)."""
    prefix = _PREFIXES.get(n)
    if prefix is None:
        prefix = bytes([_TAG_DATA]) + _varint(n)
        if len(_PREFIXES) < 64:
            _PREFIXES[n] = prefix
    return prefix


# ----------------------------------------------------------------------------- decode
class RecvBuffers:
    """Receive buffers of large messages, each reused once nothing decoded from it is alive.

    A decoded message's tensors are views of its buffer (`FrameDecoder.finish`), so a buffer is
    free exactly when this pool holds its only reference: torch tensors made from it (views,
    reshapes) keep the numpy array alive through their storage.  `take(n)` hands out a free
    buffer of exactly `n` bytes, or a new one that the pool remembers; the pool remembers the
    `keep` most recent buffers of at least `min_bytes` (smaller ones come from malloc's heap,
    which reuses freed memory by itself).  A remembered buffer in use is never handed out, and
    every byte of a reused buffer is overwritten before a tensor sees it (`finish` checks that
    the frames filled the declared size), so reuse cannot show one message's bytes in another."""

    def __init__(self, keep: int = 2, min_bytes: int = 8 << 20) -> None:
        self.keep, self.min_bytes = keep, min_bytes
        self._bufs: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        self.reused = 0   # buffers handed out again (tests, benchmarks)

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes < self.min_bytes or self.keep <= 0:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            for i in range(len(self._bufs)):
                buf = self._bufs[i]
                # referenced by the deque, `buf` and getrefcount's argument only: nothing else holds it
                if buf.nbytes == nbytes and sys.getrefcount(buf) == 3:
                    del self._bufs[i]
                    self._bufs.append(buf)
                    self.reused += 1
                    return buf
            buf = np.empty(nbytes, dtype=np.uint8)
            self._bufs.append(buf)
            while len(self._bufs) > self.keep:
                self._bufs.popleft()   # forgotten here; freed once its tensors are
            return buf

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


def _keep_from_env() -> int:
    """FEDHOP_RECV_BUFFERS: how many large receive buffers a process remembers (default 2; 0
    turns reuse off, as before it existed: `fedhop bench large` compares the two)."""
    text = os.environ.get("FEDHOP_RECV_BUFFERS", "2")
    try:
        return max(0, int(text))
    except ValueError:
        raise ValueError(f"FEDHOP_RECV_BUFFERS={text!r}: expected a whole number of buffers (0 turns reuse off)") from None


#: the process's receive buffers (every FrameDecoder that is not given others)
RECV_BUFFERS = RecvBuffers(keep=_keep_from_env())


@dataclass
class Decoded:
    envelope: pb.Envelope
    payload: Payload
    payload_bytes: int
    frames: int
    tensor_bytes: int
    framing: int | None = None   # as Encoded.framing: set when the message arrived bundled

    @property
    def framed_bytes(self) -> int:
        return self.payload_bytes + (self.framing if self.framing is not None else FRAME_OVERHEAD * self.frames)


@dataclass(frozen=True)
class ReplyBound:
    """The most a reply may declare: its tensor data and its header frame (common/processors/validation.py
    `reply_bound` computes it from the algorithm's reply spec)."""

    data_bytes: int
    header_bytes: int


@dataclass(frozen=True)
class _Layout:
    """A header's tensor specs, checked (`_checked_layout`): each tensor's name, codec dtype,
    shape, bytes, offset in the data and the numpy dtype a view of the receive buffer makes it
    from (None: torch's way, `FrameDecoder.finish`); the data bytes they add up to; the one numpy
    float dtype of every tensor (the message's `FlatView`), None where there is not one."""

    specs: tuple[tuple[str, str, tuple[int, ...], int, int, "np.dtype | None"], ...]
    total: int
    flat_dtype: "np.dtype | None"


#: the layouts checked so far, by their specs' bytes as they travel (`_checked_layout`)
_LAYOUTS: dict[tuple[bytes, ...], _Layout] = {}
#: how many `_LAYOUTS` remembers (a process sees a few: its model's, its replies'); past it, it starts again
LAYOUTS_KEPT = 256
#: a header longer than this has its layout checked every time, not remembered
LAYOUT_HEADER_MAX = 64 << 10


def _checked_layout(env: pb.Envelope, header: memoryview) -> _Layout:
    """The tensor layout `env` declares, its specs checked (PayloadError names the first that is
    wrong).  Every message of a round carries the same few layouts, and a protobuf field read
    costs about what the check on it does: the specs' bytes, as the header carries them
    (`EnvelopeSpecs`), find a layout checked before.  The same bytes parse to the same specs,
    so a remembered layout is the one these specs make."""
    key: tuple[bytes, ...] | None = None
    if len(header) <= LAYOUT_HEADER_MAX:
        raw = pb.EnvelopeSpecs()
        raw.ParseFromString(header)   # the header parsed as an Envelope already: this parses too
        key = tuple(raw.tensors)
        known = _LAYOUTS.get(key)
        if known is not None:
            return known
    specs: list[tuple[str, str, tuple[int, ...], int, int, np.dtype | None]] = []
    total = 0
    flat_dtype: np.dtype | None = None
    for spec in env.tensors:
        name, dtype, shape, nbytes = spec.name, spec.dtype, tuple(spec.shape), spec.nbytes
        itemsize = ITEMSIZE.get(dtype)
        if itemsize is None:
            raise PayloadError("BAD_DTYPE", f"tensor '{name}': unknown dtype '{dtype}' "
                                            f"(allowed: {', '.join(DTYPES)})")
        if len(shape) > MAX_DIMS:
            raise PayloadError("BAD_SHAPE", f"tensor '{name}': {len(shape)} dimensions; at most {MAX_DIMS}")
        if shape and min(shape) < 0:
            raise PayloadError("BAD_SHAPE", f"tensor '{name}': negative dimension in {list(shape)}")
        expect = math.prod(shape) * itemsize
        if expect != nbytes:
            raise PayloadError("SIZE_MISMATCH",
                               f"tensor '{name}': shape {list(shape)} of {dtype} is "
                               f"{expect} bytes but {nbytes} are declared")
        np_dtype = _NUMPY_DTYPES.get(dtype)
        view = np_dtype if np_dtype is not None and expect and total % np_dtype.itemsize == 0 else None
        if not specs:
            flat_dtype = np_dtype if np_dtype is not None and np_dtype.kind == "f" else None
        elif np_dtype != flat_dtype:
            flat_dtype = None
        specs.append((name, dtype, shape, expect, total, view))
        total += expect
    if len({name for name, *_ in specs}) != len(specs):
        raise PayloadError("BAD_NAME", "duplicate tensor names in one message")
    layout = _Layout(tuple(specs), total, flat_dtype)
    if key is not None:
        if len(_LAYOUTS) >= LAYOUTS_KEPT:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


@dataclass
class FrameDecoder:
    """Consumes the frames of one message in order; `finish()` returns the decoded message."""

    max_payload_bytes: int = 1 << 31
    max_header_bytes: int | None = None   # a caller that knows the reply's shape bounds its header too
    # a server's check of an incoming request's header before any of its data is accepted or
    # allocated: raises PayloadError (a refused method or caller) or returns the most data bytes
    # the request's method may carry (common/transport/admission.py `RequestGate`)
    admit: Callable[[pb.Envelope], int] | None = None
    # the receiver's `security.checksum`: a message with data bytes must carry their XXH3-64, so a
    # sender (or anything on the path) cannot turn the check off by leaving the trailer out
    require_checksum: bool = False
    buffers: "RecvBuffers | FileBuffers | None" = None   # where the message's buffer comes from (None: RECV_BUFFERS)
    envelope: pb.Envelope | None = None
    _buffer: np.ndarray | None = None
    _sink: "FileSink | None" = None   # the message's file while its data arrives (common/wire/filebacked.py)
    _filled: int = 0
    _payload_bytes: int = 0
    _frames: int = 0
    _digest: "xxhash.xxh3_64 | None" = None
    _trailer: int | None = None   # the digest the trailer frame carried
    _layout: "_Layout | None" = None   # the header's tensor specs, checked (`_start`)

    @property
    def filled(self) -> int:
        """Tensor data bytes received so far."""
        return self._filled

    @property
    def payload_bytes(self) -> int:
        """Frame bytes fed so far (headers and data)."""
        return self._payload_bytes

    @property
    def frames(self) -> int:
        """Frames fed so far."""
        return self._frames

    @property
    def complete(self) -> bool:
        """The header, every data byte it declares and its trailer (when it says `checksum`) have arrived."""
        env = self.envelope
        return env is not None and self._filled == env.data_bytes and (not env.checksum or self._trailer is not None)

    def feed(self, frame: bytes) -> None:
        self._frames += 1
        self._payload_bytes += len(frame)
        mv = memoryview(frame)
        if len(mv) == 0:
            raise PayloadError("MALFORMED_FRAME", "empty frame")
        tag = mv[0]
        if self._trailer is not None:
            raise PayloadError("MALFORMED_FRAME", "a frame after the message's trailer")
        if tag == _TAG_TRAILER:
            self._take_trailer(mv)
            return
        length, start = _read_varint(mv, 1)
        if start + length != len(mv):
            raise PayloadError("MALFORMED_FRAME",
                               f"frame declares {length} bytes but carries {len(mv) - start}")
        if tag == _TAG_HEADER:
            if self.max_header_bytes is not None and length > self.max_header_bytes:
                raise PayloadError("TOO_LARGE", f"header frame of {length} bytes; the limit is {self.max_header_bytes}")
            if self.envelope is not None:
                raise PayloadError("MALFORMED_FRAME", "second header frame in one message")
            env = pb.Envelope()
            header = mv[start:]
            try:
                env.ParseFromString(header)
            except Exception as exc:  # protobuf's DecodeError
                raise PayloadError("MALFORMED_HEADER", f"cannot parse envelope: {exc}") from None
            self._start(env, header)
        elif tag == _TAG_DATA:
            if self.envelope is None:
                raise PayloadError("MALFORMED_FRAME", "data frame before the header frame")
            if self._filled + length > self.envelope.data_bytes:
                raise PayloadError("SIZE_MISMATCH",
                                   f"data frames exceed the declared {self.envelope.data_bytes} bytes")
            if self._sink is not None:
                try:
                    self._sink.write(self._filled, mv[start:])
                except OSError:   # the disk filled up after all: the message goes on in memory
                    try:
                        self._buffer, self._sink = self._sink.to_memory(self._filled), None
                    except OSError as exc:   # this process's own disk, not the sender's fault: not a rejection code
                        raise PayloadError("RECEIVE_FAILED", f"the message's receive file failed: {exc}") from None
            if self._sink is None:
                assert self._buffer is not None
                self._buffer[self._filled:self._filled + length] = np.frombuffer(
                    frame, dtype=np.uint8, count=length, offset=start)
            if self._digest is not None:   # while the frame is still in cache, not in a second pass at the end
                self._digest.update(mv[start:])
            self._filled += length
        else:
            raise PayloadError("MALFORMED_FRAME", f"unknown frame tag 0x{tag:02x}")

    def _take_trailer(self, mv: memoryview) -> None:
        env = self.envelope
        if env is None:
            raise PayloadError("MALFORMED_FRAME", "trailer frame before the header frame")
        if not env.checksum:
            raise PayloadError("MALFORMED_FRAME", "trailer frame in a message whose header declares no checksum")
        if len(mv) != TRAILER_BYTES:
            raise PayloadError("MALFORMED_FRAME", f"trailer frame of {len(mv)} bytes; a trailer is {TRAILER_BYTES}")
        if self._filled != env.data_bytes:
            raise PayloadError("SIZE_MISMATCH", f"trailer after {self._filled} of {env.data_bytes} declared data bytes")
        self._trailer = int.from_bytes(mv[1:], "little")

    def _start(self, env: pb.Envelope, header: memoryview) -> None:
        declared = int(env.data_bytes)
        if self.admit is not None:   # the method and caller first: a refused request's data is never read
            try:
                self.max_payload_bytes = min(self.max_payload_bytes, self.admit(env))
            except PayloadError:
                self.envelope = env   # routed: the refusal is recorded and answered to its sender
                raise
        if declared > self.max_payload_bytes:
            raise PayloadError("TOO_LARGE", f"message declares {declared} data bytes; the limit is "
                                            f"{self.max_payload_bytes}")
        if self.require_checksum and declared > 0 and not env.checksum:
            raise PayloadError("CHECKSUM_MISSING", f"message declares {declared} data bytes without their XXH3-64 "
                                                   "checksum; this run's security.checksum requires one")
        layout = _checked_layout(env, header)
        if layout.total != declared:
            raise PayloadError("SIZE_MISMATCH", f"tensor specs add up to {layout.total} bytes but the message "
                                                f"declares {declared}")
        self._layout = layout
        self.envelope = env
        taken = (self.buffers or RECV_BUFFERS).take(declared)
        if isinstance(taken, FileSink):
            self._sink = taken
        else:
            self._buffer = taken
        self._digest = xxhash.xxh3_64() if env.checksum else None

    def finish(self) -> Decoded:
        if self.envelope is None:
            raise PayloadError("MALFORMED_FRAME", "message ended before its header frame")
        env = self.envelope
        if self._filled != env.data_bytes:
            raise PayloadError("SIZE_MISMATCH", f"message ended after {self._filled} of "
                                                f"{env.data_bytes} declared data bytes")
        if env.checksum:
            assert self._digest is not None   # made when the header declared a checksum
            digest = self._digest.intdigest()   # over every data byte, frame by frame (`feed`)
            if self._trailer != digest:
                self._buffer = None   # refused: nothing will be made of these bytes
                if self._sink is not None:
                    self._sink.close()   # its file goes now
                    self._sink = None
                said = "no trailer" if self._trailer is None else f"a trailer of {self._trailer:016x}"
                raise PayloadError("CHECKSUM_MISMATCH", f"data bytes have XXH3-64 {digest:016x}, the sender's "
                                                        f"message ended with {said}: corrupted in transit")
        if self._sink is not None:   # the message's file, mapped as its buffer
            self._buffer, self._sink = self._sink.array(), None
        assert self._buffer is not None
        buffer, self._buffer = self._buffer, None   # the tensors hold it now: free for reuse once they are gone
        base: torch.Tensor | None = None
        # a small message's tensors from numpy views of the buffer; a large one's are views of one
        # tensor over the whole buffer, which a file-backed buffer's page release needs (filebacked.py)
        small = int(env.data_bytes) <= SMALL_MESSAGE_BYTES
        layout = self._layout
        assert layout is not None   # set with the envelope (`_start`)
        tensors: dict[str, torch.Tensor] = {}
        try:   # the specs passed the header's checks; anything numpy or torch still refuses is the sender's
            for name, dtype, shape, n, offset, view_dtype in layout.specs:
                if small and view_dtype is not None:
                    # a numpy view of the buffer made a tensor: the same memory, a few times cheaper
                    # than torch's slice, view and reshape
                    t = torch.from_numpy(np.ndarray(shape, view_dtype, buffer, offset))
                elif n == 0:
                    t = torch.empty(shape, dtype=DTYPES[dtype])
                else:
                    base = torch.from_numpy(buffer) if base is None else base
                    raw = base[offset:offset + n]
                    if offset % ITEMSIZE[dtype]:
                        raw = raw.clone()  # misaligned for this dtype: one copy
                    t = raw.view(DTYPES[dtype]).reshape(shape)
                tensors[name] = t
        except (ValueError, RuntimeError, TypeError) as exc:
            raise PayloadError("BAD_SHAPE", f"tensor specs that make no tensor: {exc}") from None
        scalars = {k: scalar_from_pb(v) for k, v in env.scalars.items()}
        control = env.control if env.HasField("control") else None
        payload = Payload(tensors=tensors, scalars=scalars, control=control)
        flat_dtype, total = layout.flat_dtype, layout.total
        if small and flat_dtype is not None and 0 < total <= CHUNK * flat_dtype.itemsize:
            payload.flat = FlatView(np.ndarray((total // flat_dtype.itemsize,), flat_dtype, buffer, 0),
                                    tuple(tensors.values()))
        return Decoded(envelope=env, payload=payload, payload_bytes=self._payload_bytes, frames=self._frames,
                       tensor_bytes=int(env.data_bytes))


def decode_frames(frames: Iterable[bytes], max_payload_bytes: int = 1 << 31,
                  max_header_bytes: int | None = None) -> Decoded:
    dec = FrameDecoder(max_payload_bytes=max_payload_bytes, max_header_bytes=max_header_bytes)
    for f in frames:
        dec.feed(f)
    return dec.finish()


# ----------------------------------------------------------------------------- expectations
def check_tensors(payload: Payload, expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                  who: str, allow_extra: bool = False) -> None:
    """Reject a payload whose tensor names, dtypes or shapes differ from `expected` (a tensor
    given by its nonzeros, `Payload.sparse`, by the dense tensor it stands for)."""
    missing = [n for n in expected if n not in payload.tensors and n not in payload.sparse]
    if missing:
        raise PayloadError("BAD_NAME", f"{who}: missing tensors {missing}")
    both = [n for n in payload.sparse if n in payload.tensors]
    if both:
        raise PayloadError("BAD_NAME", f"{who}: tensors {both} given both dense and by their nonzeros")
    if not allow_extra:
        extra = [n for n in [*payload.tensors, *payload.sparse] if n not in expected]
        if extra:
            raise PayloadError("BAD_NAME", f"{who}: unexpected tensors {extra}")
    for name, (dtype, shape) in expected.items():
        t = payload.tensors[name] if name in payload.tensors else payload.sparse[name]
        if t.dtype != dtype:
            raise PayloadError("BAD_DTYPE", f"{who}: tensor '{name}' is {t.dtype}, expected {dtype}")
        if tuple(t.shape) != tuple(shape):
            raise PayloadError("BAD_SHAPE", f"{who}: tensor '{name}' has shape {tuple(t.shape)}, "
                                            f"expected {tuple(shape)}")
