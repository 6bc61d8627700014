"""Validation of received results before they are used, and the typed rejection codes.

Where each check happens (docs/faults.md, "Hostile and corrupted inputs"):

- the codec (common/wire/codec.py), while decoding: frame order, declared sizes against the limit
  before any allocation (TOO_LARGE), dtype names (BAD_DTYPE), nbytes = prod(shape) * itemsize
  and totals (SIZE_MISMATCH), duplicate names (BAD_NAME), the data checksum, XXH3-64 (CHECKSUM_MISMATCH; CHECKSUM_MISSING where the run requires it);
- the endpoint (`common.transport.base.reply_problem`): the reply answers the call: same run
  (WRONG_RUN), same round and step (STALE_ROUND: a replayed old result), from the node called
  (WRONG_SENDER), the right method (BAD_METHOD);
- the parent (`validate_reply` here): the algorithm's reply spec, names, dtypes, shapes
  (BAD_NAME / BAD_DTYPE / BAD_SHAPE), extra tensors only as 0-dim floats (BAD_EXTRA), NaN/Inf
  (NON_FINITE), the weight scalar (MISSING_SCALAR / BAD_SCALAR), every scalar typed and ranged
  by the algorithm's `reply_scalars` (BAD_SCALAR: `num_results = "x"` never reaches `int()`),
  and, where the parent knows them (`ReplyLimits`), the weight against the most the sender's
  clients may claim (BAD_WEIGHT), `num_results` against the clients asked, `compute_seconds`
  against the call's deadline; and across one round's results, `consistent_results`: a scalar
  whose type differs from the other results' (BAD_SCALAR);
- the aggregate and the new model (`finite_step`): checked finite before they are kept; a
  round that would make them NaN/Inf is rolled back and the contributions that did it named
  (NON_FINITE_AGGREGATE);
- registration (common/transport/liveness.py): a logical client id claimed by two live nodes
  (DUPLICATE_CLIENT).

Every rejection is recorded in run.db as a `rejected_payload` event whose detail starts with the
code, and counted by code in summary.json (`rejections`).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, TypeGuard

import torch

from fedhop.common.wire.codec import PayloadError, ReplyBound, check_tensors
from fedhop.common.wire.message import (
    COMPUTE_KEY,
    COUNT_KEY,
    REPLY_SCALARS,
    WEIGHT_KEY,
    Payload,
    ScalarRule,
    _top,
    all_finite,
    sparse_problem,
    tensor_finite,
)

REJECTION_CODES: frozenset[str] = frozenset({
    "BAD_NAME", "BAD_DTYPE", "BAD_SHAPE", "BAD_EXTRA", "NON_FINITE", "SIZE_MISMATCH", "TOO_LARGE",
    "MALFORMED_FRAME", "MALFORMED_HEADER", "MALFORMED_SCALAR", "CHECKSUM_MISMATCH", "CHECKSUM_MISSING",
    "STALE_ROUND",
    "WRONG_RUN", "WRONG_SENDER", "BAD_METHOD", "MISSING_SCALAR", "BAD_SCALAR", "DUPLICATE_CLIENT",
    "BAD_WEIGHT", "NON_FINITE_AGGREGATE",
})
_CODE = re.compile(r"\b([A-Z][A-Z_]{3,})\b")
MAX_SCALARS = 256
MAX_NAME = 256
MAX_TEXT = 1 << 16
REPLY_SLACK = 64 << 10   # bytes a reply may carry beyond its spec's tensors   # an undeclared text scalar (declared ones: the algorithm's reply_scalars)


def rejection_code(text: str) -> str | None:
    """The first rejection code named in a failure message, or None (a lost call, a timeout)."""
    for m in _CODE.finditer(text or ""):
        if m.group(1) in REJECTION_CODES:
            return m.group(1)
    return None


def _number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class ReplyLimits:
    """What the parent knows of one reply before it arrives: the most weight its sender's
    clients may claim (None: unbounded), how many client results it may hold, and the call's
    deadline (no client computes longer than the parent waited)."""

    weight: float | None
    results: int
    seconds: float


def reply_bound(spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> ReplyBound:
    """The most a reply to a `train` or `edge_round` call may declare: the spec's tensor bytes plus
    REPLY_SLACK (extra 0-dim values; an undeclared tensor that fits is then named BAD_EXTRA by
    `validate_reply`); a header of MAX_SCALARS named scalars and tensor specs (a generous 1 KiB
    each, at least 256 KiB).  Enforced as the reply arrives (codec.FrameDecoder), before the
    receiver allocates its buffer."""
    data = sum(math.prod(shape) * dtype.itemsize for dtype, shape in spec.values())
    data += REPLY_SLACK
    return ReplyBound(data_bytes=data, header_bytes=max(256 << 10, 1024 * (len(spec) + 2 * MAX_SCALARS)))


def check_scalar(name: str, v, rule: ScalarRule, who: str) -> None:
    """BAD_SCALAR unless `v` has the rule's kind and lies within its range."""
    if rule.kind == "str":
        ok = isinstance(v, str)
    elif rule.kind == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
    else:
        ok = _number(v)
    if not ok:
        raise PayloadError("BAD_SCALAR", f"{who}: scalar '{name}' must be {'an' if rule.kind == 'int' else 'a'} "
                                         f"{rule.kind}, got {type(v).__name__} {str(v)[:40]!r}")
    if rule.kind != "str" and not math.isfinite(v):
        raise PayloadError("NON_FINITE", f"{who}: scalar '{name}' is {v}")
    if (rule.lo is not None and v < rule.lo) or (rule.hi is not None and v > rule.hi):
        raise PayloadError("BAD_SCALAR", f"{who}: scalar '{name}' = {v} is outside [{rule.lo}, {rule.hi}]")


def check_limits(reply: Payload, limits: ReplyLimits, who: str) -> None:
    """The reply's claims against what the parent knows of its sender (`ReplyLimits`)."""
    w = float(reply.scalars[WEIGHT_KEY])
    if limits.weight is not None and w > limits.weight * (1 + 1e-9):
        raise PayloadError("BAD_WEIGHT", f"{who}: weight {w:.6g} exceeds the {limits.weight:.6g} its clients hold")
    n = reply.scalars.get(COUNT_KEY, 1)
    if n > limits.results:   # type: ignore[operator]  # numeric: validate_reply checked REPLY_SCALARS first
        raise PayloadError("BAD_SCALAR", f"{who}: '{COUNT_KEY}' = {n} but {limits.results} clients were asked")
    secs = reply.scalars.get(COMPUTE_KEY, 0.0)
    if secs > limits.seconds:   # type: ignore[operator]  # numeric: validate_reply checked REPLY_SCALARS first
        raise PayloadError("BAD_SCALAR", f"{who}: '{COMPUTE_KEY}' = {secs:.6g} s exceeds the call's "
                                         f"{limits.seconds:.6g} s deadline")


def validate_reply(reply: Payload, spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], who: str,
                   scalars: Mapping[str, ScalarRule] = REPLY_SCALARS, limits: ReplyLimits | None = None) -> None:
    """Raise PayloadError unless `reply` is usable: the spec's tensors exactly, extra tensors only
    as 0-dim floats (values such as a norm that travel as tensors), every float finite, a finite
    non-negative numeric `weight`, a bounded number of scalars with bounded names, each scalar
    named in `scalars` of that kind and range (others: as the codec allows, texts bounded), and
    within `limits`."""
    check_tensors(reply, spec, who, allow_extra=True)
    finite = all_finite(reply)   # every decoded tensor at once where it can (message.FlatView)
    for name, t in reply.tensors.items():
        if len(name) > MAX_NAME:
            raise PayloadError("BAD_NAME", f"{who}: a tensor name of {len(name)} characters")
        if name not in spec and (t.dim() != 0 or not t.is_floating_point()):
            raise PayloadError("BAD_EXTRA", f"{who}: undeclared tensor '{name}' ({t.dtype}, shape {tuple(t.shape)}); "
                                            f"only 0-dim floats may travel beside the algorithm's reply spec")
        if not finite and not tensor_finite(t):
            raise PayloadError("NON_FINITE", f"{who}: tensor '{name}' holds NaN or Inf")
    for name, sp in reply.sparse.items():   # tensors given by their nonzeros (SparseTensor)
        if name not in spec:
            raise PayloadError("BAD_EXTRA", f"{who}: undeclared tensor '{name}' given by its nonzeros")
        bad = sparse_problem(sp)
        if bad is not None:
            raise PayloadError("BAD_SHAPE", f"{who}: tensor '{name}': {bad}")
        if not tensor_finite(sp.values):
            raise PayloadError("NON_FINITE", f"{who}: tensor '{name}' holds NaN or Inf")
    if len(reply.scalars) > MAX_SCALARS:
        raise PayloadError("BAD_SCALAR", f"{who}: {len(reply.scalars)} scalars (at most {MAX_SCALARS})")
    for name, v in reply.scalars.items():
        if len(name) > MAX_NAME:
            raise PayloadError("BAD_NAME", f"{who}: a scalar name of {len(name)} characters")
        if isinstance(v, float) and not math.isfinite(v):
            raise PayloadError("NON_FINITE", f"{who}: scalar '{name}' is {v}")
    if WEIGHT_KEY not in reply.scalars:
        raise PayloadError("MISSING_SCALAR", f"{who} lacks the '{WEIGHT_KEY}' scalar")
    w = reply.scalars[WEIGHT_KEY]
    if not _number(w) or w < 0:
        raise PayloadError("BAD_SCALAR", f"{who}: '{WEIGHT_KEY}' must be a non-negative number, got {w!r}")
    for name, v in reply.scalars.items():
        if name in scalars:
            check_scalar(name, v, scalars[name], who)
        elif isinstance(v, str) and len(v) > MAX_TEXT:
            raise PayloadError("BAD_SCALAR", f"{who}: scalar '{name}' is a text of {len(v)} characters")
    if limits is not None:
        check_limits(reply, limits, who)


def _kind(v) -> str:
    return "bool" if isinstance(v, bool) else "str" if isinstance(v, str) else "number"


def consistent_results(results: Mapping[int, Payload]) -> tuple[dict[int, Payload], dict[int, str]]:
    """Split one round's validated results into those whose scalar types agree with the majority
    (ties: the type of the lowest id) and the rest, rejected with BAD_SCALAR: a string where the
    others send a number would break the reduction."""
    order = sorted(results)
    # a decoded message's scalars come in the order of its protobuf map, which differed between
    # processes started on their own (fedhop bench scale): the names and types are compared as a set
    layouts = {frozenset(zip(p.scalars, map(type, p.scalars.values()))) for p in results.values()}
    if len(layouts) <= 1:   # the common case: every result has the same scalars of the same types
        return {cid: results[cid] for cid in order}, {}
    kinds: dict[str, Counter] = {}
    first: dict[str, str] = {}
    for cid in order:
        for name, v in results[cid].scalars.items():
            kinds.setdefault(name, Counter())[_kind(v)] += 1
            first.setdefault(name, _kind(v))
    want = {name: max(c, key=lambda k: (c[k], k == first[name])) for name, c in kinds.items()}
    kept, rejected = {}, {}
    for cid in order:
        bad = [n for n, v in results[cid].scalars.items() if _kind(v) != want[n]]
        if bad:
            rejected[cid] = (f"BAD_SCALAR: result of client {cid}: scalar '{bad[0]}' is a {_kind(results[cid].scalars[bad[0]])}, "
                             f"the round's other results send a {want[bad[0]]}")
        else:
            kept[cid] = results[cid]
    return kept, rejected


class ReplyLimiter:
    """`ReplyLimits` for replies from groups of clients, from what the server knows: each
    client's sample count from the seeded partition (its own copy of the task), the algorithm's
    `max_weight`, the call deadline."""

    def __init__(self, algorithm, task, seconds: float) -> None:
        self.algorithm, self.task, self.seconds = algorithm, task, seconds
        self._bound: dict[int, float | None] = {}
        # one client's limits by its weight bound (a star round asks for each sampled client's): a
        # few objects however many clients there are
        self._one: dict[float | None, ReplyLimits] = {}

    def weight_of(self, cid: int) -> float | None:
        if cid not in self._bound:
            try:
                samples = int(self.task.num_samples(cid))
            except (IndexError, KeyError, AttributeError, NotImplementedError):
                samples = None
            self._bound[cid] = None if samples is None else self.algorithm.max_weight(samples)
        return self._bound[cid]

    def limits(self, cids: list[int]) -> ReplyLimits:
        if len(cids) == 1:
            weight = self.weight_of(cids[0])
            one = self._one.get(weight)
            if one is None:
                one = self._one[weight] = self._limits(cids)
            return one
        return self._limits(cids)

    def _limits(self, cids: list[int]) -> ReplyLimits:
        bounds = [self.weight_of(c) for c in cids]
        weight = None if any(b is None for b in bounds) else float(sum(bounds))   # type: ignore[arg-type]  # no None: any() above
        return ReplyLimits(weight=weight, results=len(cids), seconds=self.seconds)


# ----------------------------------------------------------------------------- the aggregate
def _non_finite(tensors: Mapping[str, torch.Tensor], scalars: Mapping, what: str) -> str | None:
    for name, t in tensors.items():
        if not tensor_finite(t):
            return f"{what} tensor '{name}' holds NaN or Inf"
    for name, v in scalars.items():
        if isinstance(v, float) and not math.isfinite(v):
            return f"{what} scalar '{name}' is {v}"
    return None


def _magnitude(p: Payload) -> float:
    """The largest absolute value a result adds to a weighted sum (float64: no overflow here)."""
    w = 1.0 if COUNT_KEY in p.scalars else float(p.scalars.get(WEIGHT_KEY, 1.0))
    top = max((_top(t) for t in p.tensors.values()), default=0.0)   # no copy of the reply
    return top * w


def finite_step(algorithm, state, results: Mapping[int, Payload], round: int
                ) -> tuple[Payload | None, dict[int, str]]:
    """Aggregate `results` and apply the server step, keeping the aggregate and the new model
    finite.  Where either would hold NaN/Inf (or the step raises on them) the state is rolled
    back, the result with the largest weighted magnitude is named (NON_FINITE_AGGREGATE) and left
    out, and the step is retried without it.  Returns the aggregate used (None where no result
    is left) and the named results.  `state` None (an edge): the aggregate only."""
    backup = copy.deepcopy(state)
    kept = dict(results)
    blamed: dict[int, str] = {}
    while kept:
        try:
            aggregate = algorithm.aggregate(sorted(kept.items()))
            problem = _non_finite(aggregate.tensors, aggregate.scalars, "the aggregate's")
            if problem is None and state is not None:
                algorithm.server_update(state, aggregate, round)
                problem = _non_finite({**state.params, **state.extra}, state.scalars, "the new model's")
        except (ArithmeticError, ValueError, RuntimeError) as exc:
            problem = f"the server step failed ({type(exc).__name__}: {exc})"
        if problem is None:
            return aggregate, blamed
        for f in dataclasses.fields(state) if state is not None else ():   # roll back
            setattr(state, f.name, copy.deepcopy(getattr(backup, f.name)))
        worst = max(sorted(kept), key=lambda k: _magnitude(kept[k]))
        blamed[worst] = (f"NON_FINITE_AGGREGATE: round {round}: {problem}; the round was rolled back and the "
                         f"result of {worst} (largest weighted value {_magnitude(kept[worst]):.3g}) left out")
        del kept[worst]
    return None, blamed


def _checked_step(algorithm):
    """The algorithm's `server_update_checked` (a server step that checks the new state is finite
    before it changes it: common/algorithms/fedavg.py), where the class that defines it also
    defines the `server_update` in use; None otherwise (a subclass with its own step)."""
    def owner(attr: str):
        return next((c for c in type(algorithm).__mro__ if attr in vars(c)), None)
    cls = owner("server_update_checked")
    return getattr(algorithm, "server_update_checked") if cls is not None and cls is owner("server_update") else None


def finite_streamed(algorithm, state, aggregate: Payload | None, magnitudes: Mapping[int, float], round: int
                    ) -> tuple[Payload | None, dict[int, str]]:
    """`finite_step` for a round folded as its replies arrived (common/processors/streaming.py): the replies
    are gone, so a sum or a server step that is not finite cannot be retried without one of them.
    The state is rolled back, the folded result with the largest weighted magnitude
    (`magnitudes`, kept while folding: the one `finite_step` would leave out first) is named
    (NON_FINITE_AGGREGATE), and the aggregate is None: the round does not count (the server
    skips it, an edge answers without a partial).  `state` None (an edge): the aggregate only."""
    if aggregate is None:
        return None, {}
    checked = _checked_step(algorithm) if state is not None else None
    # the rollback copy of the state, unless the algorithm checks its step before it changes the state
    backup = copy.deepcopy(state) if state is not None and checked is None else None
    try:
        problem = _non_finite(aggregate.tensors, aggregate.scalars, "the aggregate's")
        if problem is None and checked is not None:
            problem = checked(state, aggregate, round)   # the state is unchanged where it names a problem
        elif problem is None and state is not None:
            algorithm.server_update(state, aggregate, round)
            problem = _non_finite({**state.params, **state.extra}, state.scalars, "the new model's")
    except (ArithmeticError, ValueError, RuntimeError) as exc:
        problem = f"the server step failed ({type(exc).__name__}: {exc})"
    if problem is None:
        return aggregate, {}
    for f in dataclasses.fields(state) if backup is not None else ():   # roll back
        setattr(state, f.name, getattr(backup, f.name))
    worst = max(sorted(magnitudes), key=lambda k: magnitudes[k])
    return None, {worst: (f"NON_FINITE_AGGREGATE: round {round}: {problem}; the round was rolled back, the "
                          f"result of {worst} (largest weighted value {magnitudes[worst]:.3g}) named, and the "
                          f"round left out (its replies were folded as they arrived)")}
