"""Clipping a model update to an L2 bound C over all its tensors together (McMahan et al., ICLR
2018, Algorithm 1, ClipFn with flat clipping: Delta * min(1, S / ||Delta||)).

The norm is computed in float64 over every tensor of the update, so one bound covers the whole
update whatever its dtype; an update already within the bound is returned as it is (the same
tensors, bit for bit), and a longer one is scaled by C / ||Delta|| (its new norm is C up to the
rounding of that one product, which `clip_update` keeps at or below C).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch


def update_norm(tensors: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> float:
    """||Delta||_2 over the named float tensors (all of them by default), in float64."""
    total = 0.0
    for name in (names if names is not None else tensors):
        t = tensors[name]
        if t.is_floating_point():
            total += float(t.detach().double().pow(2).sum())
    return math.sqrt(total)


def clip_factor(norm: float, bound: float) -> float:
    """min(1, C / ||Delta||): 1 for an update within the bound (and for the zero update)."""
    if norm <= bound:
        return 1.0
    return bound / norm


def clip_update(tensors: Mapping[str, torch.Tensor], bound: float,
                names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], float, bool]:
    """(the update clipped to L2 norm `bound`, its norm before clipping, whether it was within the
    bound).  Tensors outside `names` are passed through unchanged.  A scaled update is scaled once
    more by the tiny factor that rounding may have left above the bound, so its norm never
    exceeds `bound` as `update_norm` computes it."""
    chosen = list(names) if names is not None else [n for n, t in tensors.items() if t.is_floating_point()]
    norm = update_norm(tensors, chosen)
    if norm <= bound:
        return dict(tensors), norm, True
    factor = clip_factor(norm, bound)
    out = dict(tensors)
    for name in chosen:
        out[name] = tensors[name] * factor
    for _ in range(4):   # rounding: at most a few ulps above the bound
        after = update_norm(out, chosen)
        if after <= bound:
            break
        shrink = bound / after * (1.0 - 4 * torch.finfo(out[chosen[0]].dtype).eps)
        for name in chosen:
            out[name] = out[name] * shrink
    return out, norm, False
