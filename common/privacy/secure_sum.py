"""Central differential privacy on a securely aggregated sum (docs/privacy.md, "With secure
aggregation"): the client's half and the server's half of the composition of `[privacy]` (modes
central and client, fixed or adaptive clipping) with SecAgg+.

- client: its update x (flattened, float64) is clipped to B = min(C - sqrt(d) 2 clip / L, clip)
  before SecAgg+ quantizes it (common/security/secagg/quantize.py `private_bound`), so the
  dequantized update's norm is at most C whatever the rounding; b = 1[||x|| <= C] (Andrew et al.
  2021's clipped-count bit) goes into the masked input as one more integer coordinate, which
  Andrew et al. note is compatible with secure aggregation: the server learns only sum_i b_i;
- server: the unmasked vector's last coordinate is sum_i b_i, the others the quantized sum; the
  partial result carries the count as `dp_unclipped`, and the private aggregate
  (common/privacy/mechanism.py `PrivateAggregate`) adds N(0, (z C)^2) to the dequantized sum with
  the fixed denominator m and the noisy count, as in plain central DP.

Local DP and DP-SGD compose without any of this (each client's update is private before it is
masked); `extras` is then 0."""
from __future__ import annotations

from typing import Any

import numpy as np

from fedhop.common.privacy.mechanism import CLIP_KEY, UNCLIPPED_KEY, enabled, settings
from fedhop.common.security.secagg import quantize
from fedhop.common.security.secagg.params import SecAggParams
from fedhop.common.wire.message import Payload


def extras(cfg: Any) -> int:
    """Integer coordinates each masked input carries beyond the update: 1 (b_i) where the server
    noises the sum (privacy.mode central or client), else 0."""
    return 1 if enabled(cfg) and settings(cfg).server_noise else 0


def client_input(cfg: Any, params: SecAggParams, message: Payload,
                 flat: np.ndarray) -> tuple[float | None, np.ndarray | None]:
    """(the L2 bound before quantization, the extra coordinates [b_i]) of a client's masked input,
    (None, None) without server-noised privacy.  C is the round's (`dp_clip_norm` in the message,
    else privacy.clip_norm).  Raises ValueError where B <= 0 (rounding alone could move the
    update by C: more secure_aggregation.quant_bits are needed for this model's d coordinates)."""
    if not extras(cfg):
        return None, None
    c = float(message.scalars.get(CLIP_KEY, settings(cfg).clip_norm))
    bound = quantize.private_bound(c, flat.shape[0], params.clip, params.integer_code.step)
    if bound <= 0:
        raise ValueError(f"privacy.clip_norm C = {c:g} leaves no room for quantization: sqrt(d) * 2 clip / L = "
                         f"{c - bound:g} with d = {flat.shape[0]}, secure_aggregation.quant_bits = "
                         f"{params.quant_bits}")
    within = float(np.linalg.norm(flat)) <= c
    return bound, np.array([1 if within else 0], dtype=np.int64)


def split_sum(total: np.ndarray, count: int, d: int, params: SecAggParams) -> tuple[np.ndarray, dict[str, float]]:
    """The unmasked integer vector of `count` clients as (the dequantized sum of the d update
    coordinates, the partial result's privacy scalars: `extra_scalars` of the coordinates after d)."""
    return params.integer_code.decode_sum(total[:d], count), extra_scalars(total[d:])


def extra_scalars(sums: np.ndarray) -> dict[str, float]:
    """The partial result's privacy scalars from the unmasked sums of the `extras` coordinates:
    `dp_unclipped` = sum_i b_i where present."""
    return {UNCLIPPED_KEY: float(sums[0])} if sums.shape[0] else {}
