"""Validation of received results before they are used, and the typed rejection codes.

Where each check happens (docs/faults.md, "Hostile and corrupted inputs"):

- the codec (common/codec.py), while decoding: frame order, declared sizes against the limit
  before any allocation (TOO_LARGE), dtype names (BAD_DTYPE), nbytes = prod(shape) * itemsize
  and totals (SIZE_MISMATCH), duplicate names (BAD_NAME), the data checksum, XXH3-64 (CHECKSUM_MISMATCH);
- the endpoint (`common.transport.base.reply_problem`): the reply answers the call: same run
  (WRONG_RUN), same round and step (STALE_ROUND: a replayed old result), from the node called
  (WRONG_SENDER), the right method (BAD_METHOD);
- the parent (`validate_reply` here): the algorithm's reply spec, names, dtypes, shapes
  (BAD_NAME / BAD_DTYPE / BAD_SHAPE), extra tensors only as 0-dim floats (BAD_EXTRA), NaN/Inf
  (NON_FINITE), the weight scalar (MISSING_SCALAR / BAD_SCALAR); and across one round's
  results, `consistent_results`: a scalar whose type differs from the other results' (BAD_SCALAR);
- registration (common/liveness.py): a logical client id claimed by two live nodes
  (DUPLICATE_CLIENT).

Every rejection is recorded in run.db as a `rejected_payload` event whose detail starts with the
code, and counted by code in summary.json (`rejections`).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Mapping

import torch

from fedhop.common.algorithms.base import WEIGHT_KEY, Payload
from fedhop.common.codec import PayloadError, check_tensors

REJECTION_CODES: frozenset[str] = frozenset({
    "BAD_NAME", "BAD_DTYPE", "BAD_SHAPE", "BAD_EXTRA", "NON_FINITE", "SIZE_MISMATCH", "TOO_LARGE",
    "MALFORMED_FRAME", "MALFORMED_HEADER", "MALFORMED_SCALAR", "CHECKSUM_MISMATCH", "STALE_ROUND",
    "WRONG_RUN", "WRONG_SENDER", "BAD_METHOD", "MISSING_SCALAR", "BAD_SCALAR", "DUPLICATE_CLIENT",
})
_CODE = re.compile(r"\b([A-Z][A-Z_]{3,})\b")
MAX_SCALARS = 256
MAX_NAME = 256


def rejection_code(text: str) -> str | None:
    """The first rejection code named in a failure message, or None (a lost call, a timeout)."""
    for m in _CODE.finditer(text or ""):
        if m.group(1) in REJECTION_CODES:
            return m.group(1)
    return None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def validate_reply(reply: Payload, spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], who: str) -> None:
    """Raise PayloadError unless `reply` is usable: the spec's tensors exactly, extra tensors only
    as 0-dim floats (values such as a norm that travel as tensors), every float finite, a finite
    non-negative numeric `weight`, a bounded number of scalars with bounded names."""
    check_tensors(reply, spec, who, allow_extra=True)
    for name, t in reply.tensors.items():
        if len(name) > MAX_NAME:
            raise PayloadError("BAD_NAME", f"{who}: a tensor name of {len(name)} characters")
        if name not in spec and (t.dim() != 0 or not t.is_floating_point()):
            raise PayloadError("BAD_EXTRA", f"{who}: undeclared tensor '{name}' ({t.dtype}, shape {tuple(t.shape)}); "
                                            f"only 0-dim floats may travel beside the algorithm's reply spec")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
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


def _kind(v) -> str:
    return "bool" if isinstance(v, bool) else "str" if isinstance(v, str) else "number"


def consistent_results(results: Mapping[int, Payload]) -> tuple[dict[int, Payload], dict[int, str]]:
    """Split one round's validated results into those whose scalar types agree with the majority
    (ties: the type of the lowest id) and the rest, rejected with BAD_SCALAR: a string where the
    others send a number would break the reduction."""
    kinds: dict[str, Counter] = {}
    first: dict[str, str] = {}
    for cid in sorted(results):
        for name, v in results[cid].scalars.items():
            kinds.setdefault(name, Counter())[_kind(v)] += 1
            first.setdefault(name, _kind(v))
    want = {name: max(c, key=lambda k: (c[k], k == first[name])) for name, c in kinds.items()}
    kept, rejected = {}, {}
    for cid in sorted(results):
        bad = [n for n, v in results[cid].scalars.items() if _kind(v) != want[n]]
        if bad:
            rejected[cid] = (f"BAD_SCALAR: result of client {cid}: scalar '{bad[0]}' is a {_kind(results[cid].scalars[bad[0]])}, "
                             f"the round's other results send a {want[bad[0]]}")
        else:
            kept[cid] = results[cid]
    return kept, rejected
