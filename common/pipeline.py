"""The payload pipeline: what happens to a payload between the algorithm and the wire.

- Outbound, `upload`: what a child sends to its parent (a client's reply, an edge's partial),
  QSGD-coded when `algorithm.compress = "qsgd"` (common/compress.py).
- Inbound, `ReplyPipeline`: a parent's view of such a reply: decoded, then checked against the
  algorithm's reply spec (names, dtypes, shapes, finiteness, the weight; common/validation.py).
- Inbound, `ModelPipeline`: a whole model that moves between nodes (hand-offs, final and
  resumed models), checked against the model's spec and for finiteness where it arrives: in
  the model paths of the sequential and chain topologies (edge/sequential.py, server/sequential.py,
  client/walk.py, server/walk.py).

The fabric applies the inbound side to every reply it gathers (common/transport/fabric.py);
the in-process round engine applies the same pipeline (common/rounds.py), so both see the same
bits.  Form and size checks while frames arrive are the codec's (common/codec.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from fedhop.common.codec import PayloadError, check_tensors
from fedhop.common.compress import compress_upload, decompress_upload
from fedhop.common.transport.base import ReplyBound
from fedhop.common.validation import ReplyLimits, reply_bound, validate_reply
from fedhop.common.wire.message import REPLY_SCALARS, Payload, ScalarRule, tensor_finite

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class ReplyPipeline:
    """Inbound processors for a reply: QSGD decompression (common/compress.py), then validation
    by form and meaning (common/validation.py): the algorithm's reply spec (names, dtypes,
    shapes, finiteness), its reply scalars typed and ranged (`scalars`, default the common
    ones), and the claims the sender may make (`limits`: its weight bounded by what the parent
    knows of its clients).  `bound` is what the reply may declare, enforced as it arrives."""

    cfg: Any
    spec: Spec
    scalars: Mapping[str, ScalarRule] | None = None
    limits: ReplyLimits | None = None

    @property
    def bound(self) -> ReplyBound:
        return reply_bound(self.spec)

    def __call__(self, reply: Payload, who: str) -> Payload:
        reply = decompress_upload(self.cfg, reply, self.spec)
        validate_reply(reply, self.spec, who, self.scalars if self.scalars is not None else REPLY_SCALARS,
                       self.limits)
        return reply


@dataclass(frozen=True)
class ModelPipeline:
    """The inbound processor of a whole model moving between nodes (a Fed-CHS hand-off, a
    WRWGD walk step, a final or resumed model): exactly the model's tensor names, dtypes and
    shapes (`spec`), every value finite.  Returns the model's tensors; raises PayloadError
    (BAD_NAME, BAD_DTYPE, BAD_SHAPE, NON_FINITE) naming `what`."""

    spec: Spec

    def __call__(self, payload: Payload, what: str) -> dict[str, torch.Tensor]:
        check_tensors(payload, self.spec, what)
        if not all(tensor_finite(t) for t in payload.tensors.values()):
            raise PayloadError("NON_FINITE", f"{what} holds NaN or Inf")
        return {name: payload.tensors[name] for name in self.spec}


def upload(cfg: Any, payload: Payload, sender: str, round: int, step: int = 0) -> Payload:
    """The outbound processor of a child's reply to its parent: QSGD when configured."""
    return compress_upload(cfg, payload, sender, round, step)
