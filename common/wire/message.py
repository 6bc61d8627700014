"""The messages every role, transport and algorithm exchange: `Payload` (named tensors, typed
scalars, the protocol's control data), the scalars every reply carries, and the reductions over
payloads (`reduce_payloads`, `ReplyAccumulator`) with the finiteness checks (DESIGN.md section 3).

The wire layer: it imports nothing of fedhop above common/wire, so the codec, the transports and
the fabric move and check messages without importing an algorithm; the algorithms import these
types (common/algorithms/base.py re-exports them for an algorithm's convenience).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping

import numpy as np
import torch

from fedhop.common.wire.filebacked import release

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.wire.fedhop_pb2 import Control

Scalar = float | int | bool | str
ReduceOp = Literal["wsum", "sum", "max", "min"]

WEIGHT_KEY = "weight"      # scalar every reply carries: the client's aggregation weight
COUNT_KEY = "num_results"  # scalar added by `aggregate`: how many client results are inside
COMPUTE_KEY = "compute_seconds"  # scalar the client host adds: local solver time (reduced by max)


@dataclass(frozen=True)
class ScalarRule:
    """What one reply scalar must be before any arithmetic touches it (common/processors/validation.py):
    `kind` "number" (int or float, finite), "int" or "str"; numbers within [lo, hi]."""

    kind: Literal["number", "int", "str"] = "number"
    lo: float | None = None
    hi: float | None = None


# the scalars every reply may carry; an algorithm adds its own in `reply_scalars`
REPLY_SCALARS: dict[str, ScalarRule] = {
    WEIGHT_KEY: ScalarRule("number", 0.0),
    COUNT_KEY: ScalarRule("int", 1),
    COMPUTE_KEY: ScalarRule("number", 0.0),
    "train_loss": ScalarRule("number"),
    "local_steps": ScalarRule("number", 0.0),   # a partial carries the weighted sum
}


@dataclass(frozen=True)
class SparseTensor:
    """A tensor of `dtype` and `shape` that is zero except at the flat positions `indices`
    (int64, strictly increasing, each < numel), where it holds `values` (`dtype`, one per index).

    What a sparsifier's upload (top-k, random-k, threshold: common/processors/compressors/sparse.py)
    decodes into where the reply goes straight into a streaming fold (`Payload.sparse`,
    `ReplyAccumulator`): the fold adds the values at their positions instead of a model-sized
    dense tensor that is mostly zeros."""

    indices: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def numel(self) -> int:
        """Elements of the dense tensor it stands for."""
        return math.prod(self.shape)

    def nbytes(self) -> int:
        """Bytes it holds (indices and values)."""
        return (self.indices.numel() * self.indices.element_size()
                + self.values.numel() * self.values.element_size())

    def dense(self) -> torch.Tensor:
        """The dense tensor: zeros with `values` at `indices`."""
        out = torch.zeros(self.numel(), dtype=self.dtype, device=self.device)
        out[self.indices] = self.values
        return out.reshape(self.shape)


def sparse_problem(s: SparseTensor) -> str | None:
    """What makes `s` unusable (None: nothing): indices not int64[k] strictly increasing within
    [0, numel), values not [k] on the indices' device."""
    idx, val = s.indices, s.values
    if idx.dtype != torch.int64 or idx.dim() != 1 or val.dim() != 1 or val.numel() != idx.numel():
        return (f"indices {idx.dtype}{list(idx.shape)} and values {val.dtype}{list(val.shape)} "
                f"are not int64[k] and [k]")
    if idx.device != val.device:
        return "indices and values on different devices"
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= s.numel() or bool((idx[1:] <= idx[:-1]).any())):
        return f"indices not strictly increasing within [0, {s.numel()})"
    return None


@dataclass
class Payload:
    """What one message carries: named tensors and typed scalars (DESIGN.md section 3).

    `sparse`: tensors given by their nonzeros (`SparseTensor`), set only by a reply chain whose
    reply goes straight into a streaming fold (common/processors/pipeline.py `reply_chain`); a
    name is in `tensors` or in `sparse`, never both.  Everything else sees dense tensors only."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)
    # the protocol's structured control data (proto/fedhop.proto `Control`, common/transport/control.py),
    # set by the roles, never by an algorithm; None: the message has none
    control: "Control | None" = None
    sparse: dict[str, SparseTensor] = field(default_factory=dict)
    # the codec's flat view of a decoded message's tensors (`FlatView`); never set by hand
    flat: "FlatView | None" = field(default=None, compare=False, repr=False)

    def tensor_bytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.tensors.values())
                + sum(s.nbytes() for s in self.sparse.values()))


#: elements per piece when a large tensor is folded (`ReplyAccumulator`): 4 MB of float32 scratch
CHUNK = 1 << 20


_FINFO: dict[torch.dtype, torch.finfo] = {}


def _finfo(dtype: torch.dtype) -> torch.finfo:
    """torch.finfo(dtype), made once per dtype (it is asked for every tensor of every reply)."""
    info = _FINFO.get(dtype)
    if info is None:
        info = _FINFO[dtype] = torch.finfo(dtype)
    return info


@dataclass(frozen=True)
class FlatView:
    """Every tensor of a decoded message as one flat numpy array (common/wire/codec.py
    `FrameDecoder.finish`), where they are of one float dtype, adjacent in the message's buffer
    and at most CHUNK elements in all: a check or a reduction over all of them is then one
    numpy call instead of one per tensor (a reply's finiteness, its largest magnitude, its
    weighted term).  It describes `tensors` (the decoded tensor objects, in message order) only:
    `of` hands it out while the payload still holds exactly those, so a processor that replaced
    or added a tensor makes it void."""

    array: np.ndarray
    tensors: tuple[torch.Tensor, ...]

    @staticmethod
    def of(p: "Payload") -> "FlatView | None":
        flat = p.flat
        if flat is None or p.sparse or len(p.tensors) != len(flat.tensors):
            return None
        for t, mine in zip(p.tensors.values(), flat.tensors):
            if t is not mine:
                return None
        return flat

    def finite(self) -> bool:
        return bool(np.isfinite(self.array).all())

    def top(self) -> float:
        """max |x| over every tensor (NaN where one holds NaN, as `_top`)."""
        a = self.array
        return max(abs(float(a.max())), abs(float(a.min()))) if a.size else 0.0


def all_finite(p: "Payload") -> bool | None:
    """True where the payload's decoded tensors are all finite by one check over their flat view,
    False where they are not, None where it has no flat view (check each tensor)."""
    flat = FlatView.of(p)
    return None if flat is None else flat.finite()


def _top(t: torch.Tensor) -> float:
    """max |t| as a Python float (two reductions, no copy of `t`); 0 for an empty tensor.  A
    large contiguous tensor is read piece by piece, each piece's pages given back after it when
    `t` lies in a file-backed receive buffer (common/wire/filebacked.py)."""
    if not t.numel():
        return 0.0
    if t.numel() > CHUNK and t.is_contiguous() and t.device.type == "cpu":
        flat = t.detach().view(-1)
        top = 0.0
        for s in range(0, flat.numel(), CHUNK):
            piece = flat[s:s + CHUNK]
            piece_top = max(abs(float(piece.max())), abs(float(piece.min())))
            release(flat, s, s + piece.numel())
            if math.isnan(piece_top):
                return piece_top   # as the whole tensor's max would say
            top = max(top, piece_top)
        return top
    return max(abs(float(t.max())), abs(float(t.min())))


#: the dtypes whose weighted sums `ReplyAccumulator._combine_flat` makes with numpy (the same bits as
#: torch's), each with the largest weight it takes there: a larger one is infinite in the dtype, a
#: cast numpy warns about, and goes torch's way
_NUMPY_FOLD = {np.dtype(np.float32): float(np.finfo(np.float32).max), np.dtype(np.float64): math.inf}


class ReplyAccumulator:
    """The default reduction (`reduce_payloads`) one payload at a time: `add` folds a payload into
    the running sums with exactly the operations `reduce_payloads` applies to it, so adding the
    same payloads in the same order gives the same bits (float sums are not associative: the
    order is the caller's to fix, common/processors/streaming.py folds in id order).  Holds one payload's
    worth of tensors however many are added, and folds a large tensor in CHUNK-element pieces
    through a small scratch buffer (`scratch`): the weighted term `t * w` of a large reply never
    exists whole.  The pieces are the same elementwise operations on the same values, so the
    bits do not depend on the chunking."""

    def __init__(self, ops: Mapping[str, ReduceOp]) -> None:
        self.ops = ops
        self.out = Payload()
        self.total_weight = 0.0
        self.count = 0
        self.added = 0   # payloads folded
        # name -> an upper bound on max |running sum| (float64, rounding included; inf: unknown)
        self._bound: dict[str, float] = {}
        # the largest weighted value the last `add_if_finite` added (common/processors/validation.py `_magnitude`)
        self.last_magnitude = 0.0
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        # the running sums as views of one flat tensor, where `_combine_flat` made them: (the
        # replies' (name, shape) layout, the flat tensor, its views in that order, the flat
        # tensor's numpy array: the same memory)
        self._flat: tuple[tuple, torch.Tensor, tuple[torch.Tensor, ...], np.ndarray] | None = None
        self.sparse_added = 0   # tensors folded by their nonzeros (`Payload.sparse`)

    def add(self, p: Payload) -> None:
        """Fold `p` in: a `wsum` field adds weight * field, a partial result (it carries
        `num_results`) adds its already weighted fields."""
        out = self.out
        if WEIGHT_KEY not in p.scalars:
            raise ValueError(f"reply lacks the '{WEIGHT_KEY}' scalar")
        w = float(p.scalars[WEIGHT_KEY])
        is_partial = COUNT_KEY in p.scalars
        self.total_weight += w
        self.count += int(p.scalars[COUNT_KEY]) if is_partial else 1
        self.added += 1
        for name, t in p.tensors.items():
            out.tensors[name] = self._combine(name, t, w, is_partial)
            self._bound[name] = math.inf   # not tracked here: a later `add_if_finite` checks every element
        for name, s in p.sparse.items():
            out.tensors[name] = self._combine_sparse(name, s, w, is_partial)
            self._bound[name] = math.inf
        self._fold_scalars(out.scalars, p, w, is_partial)

    def add_if_finite(self, p: Payload) -> str | None:
        """`add`, unless `p` would make a running sum NaN or Inf (finite values whose sum
        overflows): then nothing changes and the reason is returned, so the caller leaves `p` out
        and goes on with the others, as `finite_step` leaves out a result that overflows the sum.

        Without a model-sized copy: a running bound on each sum's largest magnitude (the triangle
        inequality, widened for rounding) shows, for any sum far from its dtype's largest value,
        that the addition cannot overflow, and it is made in place.  Otherwise the new sums are
        computed chunk by chunk into the scratch buffer and checked first, then made in place
        (the same operations on the same values: the same bits as `add`)."""
        out = self.out
        if WEIGHT_KEY not in p.scalars:
            raise ValueError(f"reply lacks the '{WEIGHT_KEY}' scalar")
        w = float(p.scalars[WEIGHT_KEY])
        is_partial = COUNT_KEY in p.scalars
        flat = FlatView.of(p)   # a decoded reply's tensors as one array: one reduction for all
        if flat is not None and not is_partial and not p.sparse and self._add_flat_if_finite(flat, p, w):
            return None
        tops = (dict.fromkeys(p.tensors, flat.top()) if flat is not None else   # each tensor's bound from the largest
                {name: _top(t) for name, t in p.tensors.items()})
        tops.update({name: _top(s.values) for name, s in p.sparse.items()})
        self.last_magnitude = max(tops.values(), default=0.0) * (1.0 if is_partial else w)
        bounds: dict[str, float] = {}
        for name, t in [*p.tensors.items(), *((n, s.values) for n, s in p.sparse.items())]:
            bounds[name] = self._next_bound(name, t, tops[name], w, is_partial)
            if not t.is_floating_point() or bounds[name] <= _finfo(t.dtype).max:
                continue
            # near the dtype's limit: every element
            problem = (self._check(name, t, w, is_partial) if name in p.tensors
                       else self._check_sparse(name, p.sparse[name], w, is_partial))
            if problem is not None:
                return problem
            bounds[name] = math.inf
        scalars = dict(out.scalars)
        self._fold_scalars(scalars, p, w, is_partial)
        for name, v in scalars.items():
            if isinstance(v, float) and not math.isfinite(v):
                return f"adding it makes scalar '{name}' of the sum {v}"
        if not math.isfinite(self.total_weight + w):
            return "adding it makes the summed weight Inf"
        if flat is None or not self._all_wsum(p, is_partial) or not self._combine_flat(flat, p, w):
            for name, t in p.tensors.items():
                out.tensors[name] = self._combine(name, t, w, is_partial)
        for name, sp in p.sparse.items():
            out.tensors[name] = self._combine_sparse(name, sp, w, is_partial)
        self._bound.update(bounds)
        out.scalars = scalars
        self.total_weight += w
        self.count += int(p.scalars[COUNT_KEY]) if is_partial else 1
        self.added += 1
        return None

    def _add_flat_if_finite(self, flat: FlatView, p: Payload, w: float) -> bool:
        """`add_if_finite` of a client result whose tensors are one flat view (`FlatView`) and
        whose fields are all `wsum`, when the bounds show at once that no sum can overflow: the
        same bounds (`_next_bound`'s formula with the one largest magnitude), scalars and
        arithmetic (`_combine_flat`) in fewer steps; every reply of a cross-device round comes
        this way.  False, having changed nothing, where a check needs the general way, which
        then reaches the same outcome."""
        out = self.out
        if not self._all_wsum(p, False):
            return False
        top = flat.top()
        if not math.isfinite(top):
            return False
        info = _finfo(next(iter(p.tensors.values())).dtype)   # the view's one float dtype
        grow = 1.0 + 4 * info.eps
        term = top * abs(w) * grow
        sums, known = out.tensors, self._bound
        bounds = {name: ((known.get(name, 0.0) if name in sums else 0.0) + term) * grow for name in p.tensors}
        if max(bounds.values()) > info.max:   # near the dtype's limit: every element, the general way
            return False
        scalars = dict(out.scalars)
        self._fold_scalars(scalars, p, w, False)
        if (any(isinstance(v, float) and not math.isfinite(v) for v in scalars.values())
                or not math.isfinite(self.total_weight + w)):
            return False
        if not self._combine_flat(flat, p, w):
            return False
        self.last_magnitude = top * w
        known.update(bounds)
        out.scalars = scalars
        self.total_weight += w
        self.count += 1
        self.added += 1
        return True

    # ------------------------------------------------------------------ the tensor arithmetic
    def _weighted(self, name: str, is_partial: bool) -> bool:
        return self.ops.get(name, "wsum") == "wsum" and not is_partial

    def _next_bound(self, name: str, t: torch.Tensor, top: float, w: float, is_partial: bool) -> float:
        """An upper bound on max |sum| after adding `t` (float64; inf where none is known).  `top`
        is max |t|; fl(x) <= |x| (1 + eps) for each of the (at most two) roundings, widened to 4 eps."""
        if not t.is_floating_point() or not math.isfinite(top):
            return math.inf
        op = self.ops.get(name, "wsum")
        term = top * abs(w) if self._weighted(name, is_partial) else top
        prev = self._bound.get(name, 0.0) if name in self.out.tensors else 0.0
        grow = 1.0 + 4 * _finfo(t.dtype).eps
        if op in ("max", "min"):
            return max(prev, term) * grow
        return (prev + term * grow) * grow

    def _term(self, name: str, t: torch.Tensor, w: float, is_partial: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """What `t` adds to the running field: weight * t for a `wsum` field of a client result."""
        if not self._weighted(name, is_partial):
            return t if out is None else out.copy_(t)
        return t * w if out is None else torch.mul(t, w, out=out)

    def _op(self, name: str, acc: torch.Tensor, term: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """acc (+, max, min) term into `out` (which may be `acc`: in place)."""
        op = self.ops.get(name, "wsum")
        if op in ("wsum", "sum"):
            return torch.add(acc, term, out=out)
        if op == "max":
            return torch.maximum(acc, term, out=out)
        if op == "min":
            return torch.minimum(acc, term, out=out)
        raise ValueError(f"unknown reduce op {op!r} for {name!r}")  # pragma: no cover - guarded by ReduceOp

    def _pieces(self, acc: torch.Tensor, t: torch.Tensor):
        """(acc piece, t piece, scratch piece) over CHUNK-element pieces of the flat tensors."""
        a, b = acc.view(-1), t.reshape(-1)
        scratch = self._scratch.get(t.dtype)
        if scratch is None:
            scratch = self._scratch[t.dtype] = torch.empty(CHUNK, dtype=t.dtype)
        for s in range(0, a.numel(), CHUNK):
            e = min(s + CHUNK, a.numel())
            yield a[s:e], b[s:e], scratch[:e - s]
            release(b, s, e)   # a file-backed reply's piece, once used (common/wire/filebacked.py)

    def _chunked(self, acc: torch.Tensor | None, t: torch.Tensor) -> bool:
        return (acc is not None and t.numel() > CHUNK and acc.shape == t.shape and acc.dtype == t.dtype
                and acc.device.type == "cpu" and t.device.type == "cpu" and acc.is_contiguous() and t.is_contiguous())

    def _combine(self, name: str, t: torch.Tensor, w: float, is_partial: bool) -> torch.Tensor:
        """The running field `name` with `t` combined in (weighted by `w` for a `wsum` field of a
        client result), in place; a large field piece by piece through the scratch buffer."""
        acc = self.out.tensors.get(name)
        if acc is None and self._chunked(t, t) and t.is_floating_point():   # the first term, piece by piece
            acc = torch.empty_like(t)
            for a, b, _ in self._pieces(acc, t):
                self._term(name, b, w, is_partial, out=a)
            return acc
        if acc is None:
            term = self._term(name, t, w, is_partial)
            return term.clone() if term is t else term
        if not self._chunked(acc, t):
            return self._op(name, acc, self._term(name, t, w, is_partial), out=acc)
        weighted = self._weighted(name, is_partial)
        for a, b, s in self._pieces(acc, t):
            self._op(name, a, torch.mul(b, w, out=s) if weighted else b, out=a)
        return acc

    def _all_wsum(self, p: Payload, is_partial: bool) -> bool:
        """Whether `p` is a client result (not a partial) whose every tensor is a `wsum` field:
        what `_combine_flat` needs."""
        return not is_partial and (not self.ops or all(self.ops.get(name, "wsum") == "wsum" for name in p.tensors))

    def _combine_flat(self, flat: FlatView, p: Payload, w: float) -> bool:
        """`_combine` of every tensor of a decoded client result at once, over its flat view: the
        running sums are views of one flat tensor, and weight * reply is added to it in two calls
        (the same elementwise operations on the same values as tensor by tensor: the same bits).
        The caller has checked `_all_wsum`.  False, having changed nothing, where the running sums
        were not made here or are of another layout: then tensor by tensor.

        For float32 and float64 the two calls are numpy's, on the flat arrays: torch's `t * w`
        rounds w to the tensor's dtype and multiplies in it (its opmath type is the dtype), which
        is numpy's product with `dtype.type(w)`, and a sum is one IEEE addition in both.  In a
        server that runs Python between its replies, a reply's first torch call costs several
        times its run in a loop (docs/performance.md, "A reply's fold in numpy"); numpy's are
        cheaper there.  float16 stays with torch, which multiplies it in float32, and so does a
        weight beyond the dtype's range (`_NUMPY_FOLD`)."""
        layout = tuple((name, t.shape) for name, t in p.tensors.items())
        values = flat.array
        scale = values.dtype.type(w) if abs(w) <= _NUMPY_FOLD.get(values.dtype, -1.0) else None
        out = self.out.tensors
        if not out:   # the first term: weight * reply, a new flat tensor whose views are the sums
            array = np.multiply(values, scale) if scale is not None else (torch.from_numpy(values) * w).numpy()
            acc = torch.from_numpy(array)
            views, offset = [], 0
            for name, shape in layout:
                n = math.prod(shape)
                views.append(acc[offset:offset + n].view(shape))
                offset += n
            out.update(zip(p.tensors, views))
            self._flat = (layout, acc, tuple(views), array)
            return True
        mine = self._flat
        if (mine is None or mine[0] != layout or mine[3].dtype != values.dtype
                or any(out.get(name) is not v for (name, _), v in zip(layout, mine[2])) or len(out) != len(layout)):
            return False
        if scale is not None:
            np.add(mine[3], np.multiply(values, scale), out=mine[3])
        else:
            torch.add(mine[1], torch.from_numpy(values) * w, out=mine[1])
        return True

    def _combine_sparse(self, name: str, s: SparseTensor, w: float, is_partial: bool) -> torch.Tensor:
        """`_combine` of a tensor given by its nonzeros: a sum adds the weighted values at their
        positions (index_add_).  The same bits as combining `s.dense()`: at a kept position the
        same product and sum; elsewhere the dense fold adds w * 0 = +0, which changes nothing
        but a running -0 into +0 (equal values).  The first term is the zeros with the weighted
        values written in, as `t * w` makes them.  A max or min field compares every element with
        the zeros too: it combines `s.dense()`."""
        if self.ops.get(name, "wsum") not in ("wsum", "sum"):
            return self._combine(name, s.dense(), w, is_partial)
        self.sparse_added += 1
        term = self._term(name, s.values, w, is_partial)
        acc = self.out.tensors.get(name)
        if acc is None:
            acc = torch.zeros(s.shape, dtype=s.dtype, device=s.device)
            acc.view(-1)[s.indices] = term
            return acc
        if not acc.is_contiguous():
            acc = acc.contiguous()
        acc.view(-1).index_add_(0, s.indices, term)
        return acc

    def _check_sparse(self, name: str, s: SparseTensor, w: float, is_partial: bool) -> str | None:
        """`_check` of a tensor given by its nonzeros: only the kept positions change."""
        if self.ops.get(name, "wsum") not in ("wsum", "sum"):
            return self._check(name, s.dense(), w, is_partial)
        term = self._term(name, s.values, w, is_partial)
        acc = self.out.tensors.get(name)
        new = term if acc is None else acc.reshape(-1)[s.indices] + term
        return None if tensor_finite(new) else f"adding it makes tensor '{name}' of the sum NaN or Inf"

    def _check(self, name: str, t: torch.Tensor, w: float, is_partial: bool) -> str | None:
        """Whether combining `t` into field `name` keeps it finite, computed (not kept) piece by piece."""
        problem = f"adding it makes tensor '{name}' of the sum NaN or Inf"
        acc = self.out.tensors.get(name)
        if acc is None and self._chunked(t, t):   # the first term, piece by piece through the scratch buffer
            for _, b, s in self._pieces(t, t):
                if not tensor_finite(self._term(name, b, w, is_partial, out=s)):
                    return problem
            return None
        if acc is None:
            return None if tensor_finite(self._term(name, t, w, is_partial)) else problem
        if not self._chunked(acc, t):
            term = self._term(name, t, w, is_partial)
            return None if tensor_finite(self._op(name, acc, term, out=torch.empty_like(acc))) else problem
        for a, b, s in self._pieces(acc, t):
            self._op(name, a, self._term(name, b, w, is_partial, out=s), out=s)
            if not tensor_finite(s):
                return problem
        return None

    def _fold_scalars(self, target: dict[str, Scalar], p: Payload, w: float, is_partial: bool) -> None:
        """Fold `p`'s scalars into `target` (the running scalars, or a copy of them)."""
        for name, v in p.scalars.items():
            if name in (WEIGHT_KEY, COUNT_KEY):
                continue
            if isinstance(v, (str, bool)):
                target.setdefault(name, v)
                continue
            op = self.ops.get(name, "max" if name == COMPUTE_KEY else "wsum")
            value = v if (op != "wsum" or is_partial) else v * w
            if name not in target:
                target[name] = value
            elif op in ("wsum", "sum"):
                target[name] += value   # type: ignore[operator]  # numeric: a str scalar is kept by setdefault above
            elif op == "max":
                target[name] = max(target[name], value)
            elif op == "min":
                target[name] = min(target[name], value)

    def result(self) -> Payload:
        """The reduction so far, carrying the summed `weight` and `num_results`."""
        if not self.added:
            raise ValueError("cannot aggregate an empty list of replies")
        self.out.scalars[WEIGHT_KEY] = self.total_weight
        self.out.scalars[COUNT_KEY] = self.count
        return self.out


def reduce_payloads(payloads: list[Payload], ops: Mapping[str, ReduceOp]) -> Payload:
    """Combine payloads field by field, in the given order (fixed order = reproducible bits).

    A `wsum` field of the result is sum_i weight_i * field_i, where weight_i is the payload's
    `weight` scalar.  Payloads that are themselves partial results (they carry `num_results`)
    are already weighted, so they are summed, not weighted again.  Result carries the summed
    `weight` and `num_results`.  One `ReplyAccumulator` fold over the list.
    """
    if not payloads:
        raise ValueError("cannot aggregate an empty list of replies")
    acc = ReplyAccumulator(ops)
    for p in payloads:
        acc.add(p)
    return acc.result()


def weighted_mean(aggregate: Payload, name: str) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i for a `wsum` field of an aggregate."""
    return aggregate.tensors[name] / float(aggregate.scalars[WEIGHT_KEY])


_NUMPY_FLOATS = frozenset({torch.float16, torch.float32, torch.float64})


def tensor_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t` (a tensor that is not floating point always passes).  A CPU tensor of
    a dtype numpy has is checked by numpy's isfinite on the same memory: the same answer as
    `torch.isfinite(t).all()` at a quarter of its cost per small tensor (every reply's tensors
    pass here; docs/performance.md)."""
    if not t.is_floating_point():
        return True
    if t.numel() > CHUNK and t.is_contiguous():   # piece by piece: no mask the size of a large tensor
        flat = t.detach().view(-1)
        for s in range(0, flat.numel(), CHUNK):
            if not tensor_finite(flat[s:s + CHUNK]):
                return False
            release(flat, s, s + CHUNK)   # a file-backed reply's pages, once checked (common/wire/filebacked.py)
        return True
    if t.device.type == "cpu" and t.dtype in _NUMPY_FLOATS:
        try:
            return bool(np.isfinite(t.detach().numpy()).all())
        except RuntimeError:   # a view numpy cannot share (a negative-bit view): torch's own check
            pass
    return bool(torch.isfinite(t).all())


def finite_or_raise(payload: Payload, who: str) -> None:
    """Reject NaN/Inf in any float tensor or scalar (DESIGN.md section 3)."""
    for name, t in (() if all_finite(payload) else payload.tensors.items()):
        if not tensor_finite(t):
            raise ValueError(f"{who}: tensor '{name}' holds NaN or Inf")
    for name, v in payload.scalars.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{who}: scalar '{name}' is {v}")
