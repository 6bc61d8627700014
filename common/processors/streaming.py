"""Streaming aggregation: each reply folded into one accumulator as it arrives, in id order.

The default reduction (`reduce_payloads`, common/algorithms/base.py) is a sequential float sum
in client-id (or edge-id) order, and float addition is not associative, so a reply can only be
added once every lower id of the round is in.  `OrderedFold` keeps that order whatever the
arrival order (docs/architecture.md, "Streaming aggregation"):

- the round's keys (the sampled ids) are known when the requests go out; `turn` is the lowest
  key whose outcome is not yet known;
- `offer(key, reply)`: the reply is validated already (the inbound pipeline); when it is the
  turn's it is folded (`ReplyAccumulator.add`) and dropped, then every held reply whose turn
  has come is folded too; a reply ahead of its turn is held: in memory while the held replies
  stay within `budget_bytes`, beyond that written to a spill file (its raw tensor bytes; names,
  dtypes and shapes stay in memory) and read back, bit for bit, at its turn.  With
  `take=True` (the fabric) the fold takes the reply's tensors: `offer` empties `reply.tensors`
  once they are folded, held or spilled, so the reply's receive buffer is free (for the next
  reply, or a spilled one read back) whatever references to the Payload its caller holds;
- `skip(key)`: the key will not come (its call failed or was refused); the turn moves past it;
- `close()`: the deadline passed; every key not offered is skipped, a later offer is refused;
- `admit()` / `release()`: at most `window` replies are received and folded at once (a gRPC
  reply of more than one frame waits at its sender until a slot is free: common/transport/grpc.py,
  Pulled replies), whatever their ids.  A slot is taken when
  the reply's first frame arrives and given back once the reply is folded, spilled or refused,
  so with the default window of 1 the server holds one reply-sized buffer at a time;
- `receive_buffers`: a reply of at least `file_min_bytes` (HOLD_FLOOR_BYTES) is received into an
  unnamed file in the spill folder (common/wire/filebacked.py), verified and validated there,
  and read piece by piece as it is folded: that one buffer waits in the page cache, not in the
  server's memory, and a reply received so ahead of its turn is held as it is (it is on disk).

So the accumulator holds the exact bits `reduce_payloads` gives over the folded replies in id
order, and the server holds the accumulator plus the held replies (at most `budget_bytes` in
memory) and one reply being received (in a file when it is large), instead of one decoded reply
per participant.

What a collect-everything round decides after the last reply must be decided here while folding:

- scalar kinds: a reply whose scalar has another kind (number, text, flag) than the same scalar
  in the replies folded before it is not folded and refused (`rejected`, BAD_SCALAR); the round's
  kinds are those of its lowest folded id (a collected round takes the majority's,
  `consistent_results`; the two agree unless the lowest id is the odd one);
- NaN/Inf: every reply is finite (validated), so only the sum or the server step can overflow.
  A reply whose addition would make the sum NaN or Inf is left out (`rejected`,
  NON_FINITE_AGGREGATE; `ReplyAccumulator.add_if_finite` proves it cannot overflow from a bound on
  each sum, or checks every new element piece by piece before it adds) and the others still count, as a collected round leaves out the result that overflows
  it.  For a server step that overflows, the fold keeps each folded reply's weighted magnitude
  (`magnitudes`) so the worst can be named (common/processors/validation.py `finite_streamed`).
"""
from __future__ import annotations

import math
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping

import numpy as np
import torch

from fedhop.common.processors.validation import _kind
from fedhop.common.wire.codec import RECV_BUFFERS
from fedhop.common.wire.filebacked import FileBuffers, file_backed, file_buffers_on
from fedhop.common.wire.message import Payload, ReduceOp, ReplyAccumulator, SparseTensor

if TYPE_CHECKING:
    from fedhop.common.wire.fedhop_pb2 import Control

__all__ = ["OrderedFold", "StreamedResults", "scalars_only"]


def scalars_only(p: Payload) -> Payload:
    """What the round keeps of a folded reply: its scalars (weights, losses, compute seconds
    for the round's bookkeeping), no tensors."""
    return Payload(scalars=dict(p.scalars), control=p.control)


class StreamedResults(dict[Hashable, Payload]):
    """A round's results whose tensors went into `fold`: key -> `scalars_only` of each folded reply."""

    fold: "OrderedFold"


class OrderedFold:
    """Fold replies keyed by `keys` into one `ReplyAccumulator` in key order (module docstring).
    Thread-safe: `offer` and `skip` come from the fabric's workers."""

    def __init__(self, keys: list[Hashable], ops: Mapping[str, ReduceOp], budget_bytes: int = 0,
                 spill_dir: str | Path | None = None, window: int = 1, file_min_bytes: int | None = None) -> None:
        """`file_min_bytes`: a reply of at least this many bytes is received into a file, not
        memory (default HOLD_FLOOR_BYTES; common/wire/filebacked.py)."""
        if file_min_bytes is None:
            file_min_bytes = HOLD_FLOOR_BYTES
        self.keys = list(keys)   # the fold order: client ids sorted, or edges by index
        self._index = set(self.keys)
        self.acc = ReplyAccumulator(ops)
        self.budget_bytes = budget_bytes
        self._spill_root = spill_dir
        self._spill: Path | None = None
        self._pos = 0                                    # index of the turn in `keys`
        self._done: dict[Hashable, Payload | _Spilled | None] = {}  # outcome known: held, spilled, or None (folded/skipped)
        self._held_bytes = 0
        self._lock = threading.Lock()
        self._kinds: dict[str, str] = {}
        self.closed = False
        self.folded: list[Hashable] = []                # in fold order (= id order)
        self.stubs: dict[Hashable, Payload] = {}        # key -> scalars_only of its folded reply
        self.magnitudes: dict[Hashable, float] = {}     # key -> largest weighted value it added
        self.rejected: dict[Hashable, str] = {}         # key -> why it was not folded
        self.spilled = 0                                # replies that went through a spill file
        # where a large reply is received: an unnamed file in the spill folder (common/wire/filebacked.py)
        self.receive_buffers = FileBuffers(spill_dir, file_min_bytes, RECV_BUFFERS) if file_buffers_on() else None
        self.peak_held_bytes = 0
        self.window = window                            # replies received and folded at once (`admit`)
        self._receiving = 0
        self._slots = threading.Condition()
        self._mine = threading.local()                  # the slots this thread holds (`release`)

    def rekey(self, key_of: Callable[[Any], Hashable]) -> None:
        """Key the folded results by `key_of(key)` (an edge's node id -> its index)."""
        with self._lock:
            self.folded = [key_of(k) for k in self.folded]
            self.magnitudes = {key_of(k): v for k, v in self.magnitudes.items()}
            self.stubs = {key_of(k): v for k, v in self.stubs.items()}

    # ------------------------------------------------------------------ arrivals
    def offer(self, key: Hashable, reply: Payload, take: bool = False) -> bool:
        """Take `key`'s validated reply; False (nothing kept) when the fold is closed or `key` is
        not one of its keys or already known.  `take`: empty `reply.tensors` once they are folded,
        held or spilled (the caller keeps only the reply's scalars; module docstring)."""
        with self._lock:
            if self.closed or key in self._done or key not in self._index:
                return False
            if key == self.keys[self._pos]:
                self._fold(key, reply)
                if take:
                    reply.tensors.clear()   # folded: its buffer is free before any spilled reply is read back
                    reply.sparse.clear()
                self._done[key] = None
                self._advance()
            else:
                self._hold(key, reply)
                if take:
                    reply.tensors.clear()   # held (a copy of the dict) or on disk: the fold has what it needs
                    reply.sparse.clear()
            return True

    def admit(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until fewer than `window` replies are being received,
        and count this one in: a transport that reads replies as streams calls it when a reply's
        first frame arrives, before it allocates the reply's buffer, so further replies wait on
        the sender's side (gRPC pulls their data only once they are admitted), not in this process.  Any reply may
        take a free slot, in arrival order: a slow or hung lower id never holds the others up
        (they wait for their turn held or spilled).  The slot stays this thread's until `release`.
        False: the time ran out."""
        with self._slots:
            if not self._slots.wait_for(lambda: self._receiving < self.window, timeout=max(timeout, 0.0)):
                return False
            self._receiving += 1
            self._mine.held = getattr(self._mine, "held", 0) + 1
            return True

    def release(self) -> None:
        """Give back every slot this thread took (`admit`): its reply is folded, spilled or
        refused.  A no-op for a thread that holds none."""
        held = getattr(self._mine, "held", 0)
        if not held:
            return
        self._mine.held = 0
        with self._slots:
            self._receiving -= held
            self._slots.notify(held)

    def skip(self, key: Hashable) -> None:
        """`key` will not come (a failed or refused call)."""
        with self._lock:
            if self.closed or key in self._done or key not in self._index:
                return
            self._done[key] = None
            self._advance()

    def close(self) -> list[Hashable]:
        """The round is over: skip every key not offered (and fold what they held up); returns
        the keys that never came."""
        with self._lock:
            missing = [k for k in self.keys if k not in self._done]
            for k in missing:
                self._done[k] = None
            self._advance()
            self.closed = True
        self.cleanup()
        return missing

    def outcome(self, failures: Mapping[Hashable, str], late: str) -> tuple[StreamedResults, dict[Hashable, str]]:
        """After `close`: the folded keys' `scalars_only` results (carrying this fold) and, for
        every other key, why not: its failure, its refusal while folding, or `late`."""
        results = StreamedResults((k, self.stubs[k]) for k in self.folded)
        results.fold = self
        out = {k: self.rejected.get(k) or failures.get(k) or late for k in self.keys if k not in self.stubs}
        return results, out

    def result(self) -> Payload | None:
        """The reduction of the folded replies (None: none was folded)."""
        return self.acc.result() if self.acc.added else None

    def cleanup(self) -> None:
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None

    # ------------------------------------------------------------------ inside the lock
    def _advance(self) -> None:
        """Fold every held reply whose turn has come; move the turn past skipped keys."""
        while self._pos < len(self.keys) and self.keys[self._pos] in self._done:
            key = self.keys[self._pos]
            held = self._done[key]
            if held is not None:
                self._done[key] = None
                if isinstance(held, _Spilled):
                    reply = self._read(held)
                    self._fold(key, reply)
                    reply.tensors.clear()   # its buffer is free for the next one read back
                else:
                    if not any(file_backed(t) for t in held.tensors.values()):   # counted when held
                        self._held_bytes -= held.tensor_bytes()
                    self._fold(key, held)
                    held.tensors.clear()   # a file-backed reply's file is freed with its tensors
            self._pos += 1

    def _fold(self, key: Hashable, reply: Payload) -> None:
        bad = self._kind_problem(reply)
        if bad is not None:
            self.rejected[key] = f"BAD_SCALAR: result of {key}: {bad}"
            return
        overflow = self.acc.add_if_finite(reply)
        if overflow is not None:   # finite values whose sum is not: left out, the others still count
            self.rejected[key] = f"NON_FINITE_AGGREGATE: result of {key}: {overflow}; it was left out"
            return
        kinds = self._kinds
        for name, v in reply.scalars.items():
            if name not in kinds:
                kinds[name] = _kind(v)
        self.magnitudes[key] = self.acc.last_magnitude   # validation.py `_magnitude`, computed while adding
        self.folded.append(key)
        self.stubs[key] = scalars_only(reply)

    def _kind_problem(self, reply: Payload) -> str | None:
        for name, v in reply.scalars.items():
            want = self._kinds.get(name)
            if want is not None and _kind(v) != want:
                return f"scalar '{name}' is a {_kind(v)}, the round's lower ids sent a {want}"
        return None

    def _hold(self, key: Hashable, reply: Payload) -> None:
        size = reply.tensor_bytes()
        if any(file_backed(t) for t in reply.tensors.values()):   # received into a file: held as it is
            self._done[key] = Payload(tensors=dict(reply.tensors), scalars=reply.scalars, control=reply.control,
                                      sparse=dict(reply.sparse))
            self.spilled += 1
            return
        if self._held_bytes + size <= self.budget_bytes:   # a sparse reply is held as its nonzeros
            self._done[key] = Payload(tensors=dict(reply.tensors), scalars=reply.scalars, control=reply.control,
                                      sparse=dict(reply.sparse), flat=reply.flat)   # the same tensors: its flat view holds
            self._held_bytes += size
            self.peak_held_bytes = max(self.peak_held_bytes, self._held_bytes)
            return
        if self._spill is None:
            self._spill = Path(tempfile.mkdtemp(prefix="fedhop-fold-", dir=self._spill_root))
        path = self._spill / f"{key}.bin"
        layout = []
        with open(path, "wb") as f:   # raw tensor bytes; names, dtypes and shapes stay here
            for name, t in [*reply.tensors.items(), *_nonzeros(reply)]:
                flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(flat.numpy()))   # type: ignore[arg-type]  # numpy stubs: ndarray is a Buffer only for Python >= 3.12
                layout.append((name, t.dtype, tuple(t.shape), t.device))
        sparse_shapes = {name: sp.shape for name, sp in reply.sparse.items()}
        self._done[key] = _Spilled(str(path), layout, dict(reply.scalars), reply.control, sparse_shapes)
        self.spilled += 1

    @staticmethod
    def _read(spilled: "_Spilled") -> Payload:
        """A spilled reply as it was offered: its tensors in their order, bit for bit."""
        tensors = {}
        with open(spilled.path, "rb") as f:
            for name, dtype, shape, device in spilled.layout:
                n = math.prod(shape) * dtype.itemsize
                # a large tensor into a free receive buffer of its size (no fresh model-sized allocation)
                raw = RECV_BUFFERS.take(n) if n >= RECV_BUFFERS.min_bytes else np.empty(n, dtype=np.uint8)
                view = raw.data   # a memoryview of its bytes
                got = 0
                while got < n:
                    k = f.readinto(view[got:])
                    if not k:
                        raise OSError(f"spill file {spilled.path}: {n - got} bytes of '{name}' missing")
                    got += k
                tensors[name] = torch.from_numpy(raw).view(dtype).reshape(shape).to(device) \
                    if n else torch.empty(shape, dtype=dtype, device=device)
        Path(spilled.path).unlink(missing_ok=True)
        sparse = {name: SparseTensor(tensors.pop(_INDICES + name), tensors.pop(_VALUES + name), shape)
                  for name, shape in spilled.sparse_shapes.items()}
        return Payload(tensors=tensors, scalars=spilled.scalars, control=spilled.control, sparse=sparse)


# the spill file's entries of a tensor given by its nonzeros (names no reply tensor has: ':' is a coded part's)
_INDICES, _VALUES = "\0indices:", "\0values:"


def _nonzeros(reply: Payload) -> list[tuple[str, torch.Tensor]]:
    """The spill file's entries of `reply`'s tensors given by their nonzeros: indices, then values."""
    return [entry for name, sp in reply.sparse.items()
            for entry in ((_INDICES + name, sp.indices), (_VALUES + name, sp.values))]


@dataclass
class _Spilled:
    """A reply ahead of its turn, in a spill file (`sparse_shapes`: its tensors given by their
    nonzeros, written as their indices and values)."""

    path: str
    layout: list
    scalars: dict
    control: "Control | None"
    sparse_shapes: dict = field(default_factory=dict)


#: replies ahead of their turn are held in memory up to at least this many bytes before any is spilled:
#: a small model's replies never touch the disk, a large model's are bounded by `reply_budget`
HOLD_FLOOR_BYTES = 64 << 20


def reply_budget(spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], replies: float = 1.0) -> int:
    """The in-memory budget for replies that arrive ahead of their turn: `replies` replies' worth
    of tensor bytes under the reply spec, and never less than HOLD_FLOOR_BYTES (a constant, so the
    bound still does not grow with the number of clients).  A reply larger than HOLD_FLOOR_BYTES
    is never held in memory (the budget is then the floor): one held would add a model to the
    server's peak, and a spill file costs page cache, not the server's memory."""
    size = sum(math.prod(shape) * dtype.itemsize for dtype, shape in spec.values())
    if size > HOLD_FLOOR_BYTES:
        return HOLD_FLOOR_BYTES
    return max(HOLD_FLOOR_BYTES, int(replies * size))


class RoundMemory:
    """The server's resident memory over its rounds (summary.json `server_memory`): the RSS when
    the rounds begin and the peak since (Linux: VmHWM, reset at the start through
    /proc/self/clear_refs; elsewhere the process's lifetime peak, getrusage).  What the streaming
    fold bounds: the peak less the start is about the accumulator, one reply's receive buffer
    and gRPC's buffers, however many clients reply (docs/architecture.md, "Streaming aggregation")."""

    def __init__(self) -> None:
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.streamed_rounds = 0   # rounds whose replies were folded as they arrived
        self.spilled_replies = 0   # replies that waited for their turn in a spill file
        self.replies_in_files = 0  # replies received into a file, not memory (common/wire/filebacked.py)
        self.sparse_tensors = 0    # tensors folded by their nonzeros (a sparsifier's uploads: message.py SparseTensor)

    def note_fold(self, fold: "OrderedFold") -> None:
        self.streamed_rounds += 1
        self.spilled_replies += fold.spilled
        self.replies_in_files += fold.receive_buffers.made if fold.receive_buffers is not None else 0
        self.sparse_tensors += fold.acc.sparse_added

    @staticmethod
    def _status(field: bytes) -> int | None:
        """/proc/self/status's `field` ("VmRSS", "VmHWM": kB) in bytes; None where the file or the
        field is missing.  Read as bytes and searched: this runs after every round."""
        try:
            with open("/proc/self/status", "rb") as f:
                text = f.read()
        except OSError:
            return None
        at = text.find(b"\n" + field + b":")
        if at < 0:
            return None
        return int(text[at + len(field) + 2:text.index(b"kB", at)]) * 1024

    def begin(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
        except OSError:
            pass
        self.start_bytes = self._status(b"VmRSS") or self._rusage_peak()

    def note(self, *_: object) -> None:
        """After a round: the peak so far."""
        self.peak_bytes = self._status(b"VmHWM") or self._rusage_peak()

    @staticmethod
    def _rusage_peak() -> int:
        import resource
        import sys
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)

    def summary(self) -> dict:
        return {"server_memory": {"rss_at_first_round_bytes": self.start_bytes, "peak_rss_bytes": self.peak_bytes},
                "aggregation": {"streamed_rounds": self.streamed_rounds, "spilled_replies": self.spilled_replies,
                                "replies_in_files": self.replies_in_files,
                                "sparse_tensors_folded": self.sparse_tensors}}
