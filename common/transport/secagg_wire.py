"""Secure aggregation's messages (docs/secure-aggregation.md): a phase's protocol bytes
(common/security/secagg/messages.py) travel as one uint8 tensor, PROTOCOL, under the phase's own
method (`BY_PHASE`, common/wire/methods.py); the masked-input request carries the model beside it."""
from __future__ import annotations

import numpy as np
import torch

from fedhop.common.security.secagg.messages import PHASES
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import SECAGG_METHODS

PROTOCOL = "secagg"   # the tensor that holds a phase's protocol bytes
BY_PHASE = dict(zip(PHASES, SECAGG_METHODS))


def wrap(raw: bytes, base: Payload | None = None) -> Payload:
    """`raw` as the PROTOCOL tensor, beside `base`'s tensors and scalars."""
    tensors = dict(base.tensors) if base is not None else {}
    tensors[PROTOCOL] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    return Payload(tensors=tensors, scalars=dict(base.scalars) if base is not None else {})


def unwrap(payload: Payload) -> bytes:
    t = payload.tensors.get(PROTOCOL)
    if t is None or t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"no '{PROTOCOL}' uint8 vector in the message")
    return t.numpy().tobytes()


def flatten(tensors: dict[str, torch.Tensor], names: list[str]) -> np.ndarray:
    """The named tensors as one float64 vector, in `names`' order."""
    return np.concatenate([tensors[n].detach().cpu().reshape(-1).to(torch.float64).numpy() for n in names])


def unflatten(vector: np.ndarray, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for n in names:
        size = like[n].numel()
        out[n] = torch.from_numpy(vector[at:at + size].copy()).to(like[n].dtype).reshape(like[n].shape)
        at += size
    return out
