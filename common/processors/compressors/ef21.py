"""EF21 (Richtarik, Sokolov and Fatkhullin, NeurIPS 2021, Alg. 1) around any compressor:
`[compression] error_feedback = "ef21"` (docs/compression.md, "Error feedback").

Sender i keeps an estimate g_i of its update (per tensor, zero at first).  Each upload codes the
difference to it, c_i = C(v_i - g_i), and both ends add the decoded difference:
g_i <- g_i + decode(c_i) at the sender (Alg. 1 line 6) and G_i <- G_i + decode(c_i) at its parent,
which hands the aggregation G_i, its copy of the sender's estimate (so with every client taking
part and equal weights the aggregate is EF21's g = g + mean_i c_i, line 8; with partial
participation it is the mean of the participants' estimates).

The two copies must stay equal, so each upload carries the sender's count of applied differences
(scalar COUNT_KEY).  The parent applies a difference only when the count is one more than its
own; otherwise a reply was lost on the way (the sender applied it, the parent never saw it) and
the upload is refused (`EF21_DESYNC`, the reply is left out of its round) and the parent asks the
sender to start again: its next message to that sender carries RESET_KEY, and both ends set the
estimate to zero and the count to 0 (the parent when it sends the reset, the sender when it
receives it).  A lost reset is found the same way, by the next count.

Where it lives: a sender's g_i and count in its persistent state (a client's is checkpointed; an
edge's too, edge/aggregator.py `own_state`); a parent's G_i per sender in its memory (the
server's state `extra`, an edge's `upload_state`: both checkpointed).
"""
from __future__ import annotations

from typing import MutableMapping

import torch

from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload

COUNT_KEY = "ef21_count"   # an upload's scalar: the sender's count after this difference
RESET_KEY = "ef21_reset"   # a message's scalar: the parent reset its copy; start again from zero
ESTIMATE = "ef21_g:"       # a sender's state: its estimate of tensor NAME ("ef21_g:NAME"), and COUNT_KEY
Memory = MutableMapping[str, torch.Tensor]


def estimate(state: Memory, name: str, like: torch.Tensor) -> torch.Tensor:
    """The sender's g_i of tensor `name` (zeros, flattened, at first)."""
    g = state.get(ESTIMATE + name)
    if g is None or g.shape != like.shape or g.dtype != like.dtype:
        return torch.zeros_like(like)
    return g


def sender_count(state: Memory) -> int:
    c = state.get(COUNT_KEY)
    return int(c) if c is not None else 0


def note_sent(state: Memory, count: int) -> None:
    state[COUNT_KEY] = torch.tensor(count, dtype=torch.int64)


def take_reset(message: Payload, state: Memory | None) -> Payload:
    """A sender's side of a reset: with RESET_KEY in `message`, its estimates and count go
    (in place, in `state`); the message without the scalar."""
    if RESET_KEY not in message.scalars:
        return message
    if state is not None:
        for key in [k for k in state if k.startswith(ESTIMATE) or k == COUNT_KEY]:
            del state[key]
    scalars = {k: v for k, v in message.scalars.items() if k != RESET_KEY}
    return Payload(tensors=message.tensors, scalars=scalars, control=message.control)


# ----------------------------------------------------------------------------- the parent's side
def _copy_key(peer: str, name: str) -> str:
    return f"ef21:{peer}:{name}"


def _count_key(peer: str) -> str:
    return f"ef21_count:{peer}"


def _reset_key(peer: str) -> str:
    return f"ef21_reset:{peer}"


def apply_upload(decoded: Payload, coded_names: set[str], memory: Memory, peer: str, who: str) -> Payload:
    """The parent's step on a decoded upload from `peer`: check its count, add each coded
    tensor's difference to the copy G_i and hand on G_i (clones) in place of the differences."""
    count = decoded.scalars.get(COUNT_KEY)
    if isinstance(count, bool) or not isinstance(count, int):
        raise PayloadError("BAD_SCALAR", f"{who}: an EF21 upload needs the integer scalar '{COUNT_KEY}', got {count!r}")
    held = memory.get(_count_key(peer))
    expected = (int(held) if held is not None else 0) + 1
    if count != expected:
        memory[_reset_key(peer)] = torch.tensor(1, dtype=torch.int64)
        raise PayloadError("EF21_DESYNC", f"{who}: EF21 difference number {count}, this end holds {expected - 1} "
                                          f"(a reply was lost): left out, the sender is reset with its next message")
    tensors = dict(decoded.tensors)
    for name in sorted(coded_names):
        d = decoded.tensors[name]
        g = memory.get(_copy_key(peer, name))
        g = (g.to(d.device) + d) if g is not None and g.shape == d.shape and g.dtype == d.dtype else d.clone()
        memory[_copy_key(peer, name)] = g
        tensors[name] = g.clone()
    memory[_count_key(peer)] = torch.tensor(count, dtype=torch.int64)
    scalars = {k: v for k, v in decoded.scalars.items() if k != COUNT_KEY}
    return Payload(tensors=tensors, scalars=scalars, control=decoded.control)


def message_for(message: Payload, memory: Memory, peer: str) -> Payload:
    """The parent's message to `peer`: with RESET_KEY when its last upload was refused as out of
    step, the parent's copy set to zero at the same time; else `message` itself."""
    if _reset_key(peer) not in memory:
        return message
    for key in [k for k in memory if k.startswith(f"ef21:{peer}:") or k in (_count_key(peer), _reset_key(peer))]:
        del memory[key]
    return Payload(tensors=message.tensors, scalars={**message.scalars, RESET_KEY: True}, control=message.control)
