"""QSGD (Alistarh et al., NeurIPS 2017): an unbiased, s-level stochastic quantizer for uploads.

Definition (their Eq. in Sec. 3.1), for v in R^d and s >= 1 levels:

    Q_s(v)_i = ||v||_2 * sign(v_i) * xi_i / s,
    xi_i = l_i + 1 with probability r_i - l_i, else l_i,   r_i = s |v_i| / ||v||_2,  l_i = floor(r_i),

so E[Q_s(v)] = v.  Here the uniform draws are `u = torch.rand(d, generator=g)` (float32) and
xi_i = l_i + (u_i < r_i - l_i); a zero vector encodes to all-zero levels.

Encoded form of one float tensor NAME with d elements (what travels and what the ledger counts):

- `qsgd_norm:NAME`: float32, 0-dim, ||v||_2 computed in float32 (4 bytes);
- `qsgd:NAME`: uint8, shape (ceil(d * b / 8),), the d codes packed MSB-first, b = 1 + ceil(log2(s + 1))
  bits each: the top bit is the sign (1 = negative), the low b - 1 bits the level xi_i in 0..s;
  the last byte is zero-padded.

So one tensor costs 4 + ceil(d * (1 + ceil(log2(s + 1))) / 8) bytes instead of 4 d (32 + d b bits
before byte padding: the digest's "naive" cost, seed-004 section 3.2).

Buckets (QSGD Sec. 3.1, "bucketing"; `qsgd_bucket = B` > 0): the flattened tensor is cut into
n = ceil(d / B) consecutive buckets (the last may be shorter), each quantized with its own norm,
so the variance bound scales with B instead of d (their Lemma 3.1 with d -> B).  Then
`qsgd_norm:NAME` is float32 of shape (n,) and one tensor costs 4 n + ceil(d b / 8) bytes.
B = 0 (the default) is one bucket of the whole tensor with the 0-dim norm above.  Decoding gives
float32 norm * (level / s) with the sign applied; the receiver takes the shape from the
algorithm's reply spec.  Only float tensors with at least 2 elements are quantized; 0-dim
values (a norm, a step size) and integer tensors travel unchanged.

Use: `[algorithm] compress = "qsgd"`, `qsgd_levels = s`, `qsgd_bucket = B`.  A client compresses its reply to a
`train` call (client/host.py), an edge its partial aggregate (edge/aggregator.py), each from the
stream ("qsgd", sender, round, step); the parent decodes before it validates (server, edge).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from fedhop.common.util.rng import torch_stream
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload

CODE_PREFIX = "qsgd:"
NORM_PREFIX = "qsgd_norm:"


def bits_per_element(levels: int) -> int:
    """b = 1 sign bit + ceil(log2(s + 1)) level bits."""
    if levels < 1:
        raise ValueError(f"algorithm.qsgd_levels: got {levels}, must be >= 1")
    return 1 + math.ceil(math.log2(levels + 1))


def num_buckets(numel: int, bucket: int) -> int:
    """n = ceil(d / B) norms; B = 0: one norm for the whole tensor."""
    return 1 if bucket <= 0 else -(-numel // bucket)


def encoded_bytes(numel: int, levels: int, bucket: int = 0) -> int:
    """Bytes of one encoded tensor: 4 per bucket norm + the packed codes."""
    return 4 * num_buckets(numel, bucket) + (numel * bits_per_element(levels) + 7) // 8


def _per_element(norms: torch.Tensor, numel: int, bucket: int) -> torch.Tensor:
    """Each element's bucket norm (float32[d])."""
    if bucket <= 0:
        return norms.reshape(()).expand(numel)
    return norms.repeat_interleave(bucket)[:numel]


def quantize(v: torch.Tensor, levels: int, generator: torch.Generator,
             bucket: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norms, negative bool[d], level int64[d]) of Q_s(v) for flattened v; norms is float32
    0-dim (bucket 0) or float32[ceil(d / bucket)], one per bucket."""
    flat = v.detach().reshape(-1).to(torch.float32)
    d = flat.numel()
    if bucket <= 0:
        norms = torch.linalg.vector_norm(flat)
    else:
        padded = torch.zeros(num_buckets(d, bucket) * bucket, dtype=torch.float32)
        padded[:d] = flat
        norms = torch.linalg.vector_norm(padded.reshape(-1, bucket), dim=1)
    u = torch.rand(d, generator=generator, dtype=torch.float32)
    norm = _per_element(norms, d, bucket)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    r = torch.where(norm > 0, levels * flat.abs() / safe, torch.zeros_like(flat))   # a zero bucket: all levels 0
    low = torch.floor(r)
    level = (low + (u < (r - low)).to(low.dtype)).clamp_(0, levels).to(torch.int64)
    return norms, flat < 0, level


def dequantize(norm: torch.Tensor, negative: torch.Tensor, level: torch.Tensor, levels: int,
               bucket: int = 0) -> torch.Tensor:
    """Q_s(v) from its parts, float32: bucket norm * level / s, negated where the sign bit is set."""
    out = _per_element(norm.to(torch.float32), level.numel(), bucket) * (level.to(torch.float32) / levels)
    return torch.where(negative, -out, out)


def pack_codes(negative: torch.Tensor, level: torch.Tensor, levels: int) -> torch.Tensor:
    """The b-bit codes (sign << (b-1) | level), MSB-first, packed into uint8."""
    b = bits_per_element(levels)
    code = (negative.to(torch.int64) << (b - 1)) | level
    shifts = np.arange(b - 1, -1, -1, dtype=np.int64)
    bits = ((code.numpy()[:, None] >> shifts[None, :]) & 1).astype(np.uint8).reshape(-1)
    return torch.from_numpy(np.packbits(bits))


def unpack_codes(packed: torch.Tensor, numel: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_codes`: (negative bool[numel], level int64[numel])."""
    b = bits_per_element(levels)
    want = (numel * b + 7) // 8
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != want:
        raise PayloadError("BAD_SHAPE", f"QSGD codes: expected uint8[{want}] for {numel} elements at s={levels}, "
                                        f"got {packed.dtype}{list(packed.shape)}")
    bits = np.unpackbits(packed.numpy(), count=numel * b).reshape(numel, b).astype(np.int64)
    code = (bits << np.arange(b - 1, -1, -1, dtype=np.int64)[None, :]).sum(1)
    level = torch.from_numpy(code & ((1 << (b - 1)) - 1))
    if bool((level > levels).any()):
        raise PayloadError("BAD_SHAPE", f"QSGD codes: a level above s={levels}")
    return torch.from_numpy((code >> (b - 1)).astype(bool)), level


def _compressible(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() >= 2


def compress_payload(payload: Payload, levels: int, generator: torch.Generator, bucket: int = 0) -> Payload:
    """Replace every float tensor with >= 2 elements by its QSGD encoding (tensors in name order)."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(payload.tensors):
        t = payload.tensors[name]
        if not _compressible(t):
            tensors[name] = t
            continue
        norm, negative, level = quantize(t, levels, generator, bucket)
        tensors[NORM_PREFIX + name] = norm
        tensors[CODE_PREFIX + name] = pack_codes(negative, level, levels)
    return Payload(tensors=tensors, scalars=dict(payload.scalars), control=payload.control)


def decompress_payload(payload: Payload, spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                       levels: int, bucket: int = 0) -> Payload:
    """Decode the QSGD tensors of a received payload into the shapes and dtypes of `spec`.
    A payload with no encoded tensors is returned unchanged (the validator then checks it)."""
    if not any(n.startswith(CODE_PREFIX) for n in payload.tensors):
        return payload
    tensors: dict[str, torch.Tensor] = {}
    for name, t in payload.tensors.items():
        if name.startswith(NORM_PREFIX):
            continue
        if not name.startswith(CODE_PREFIX):
            tensors[name] = t
            continue
        target = name[len(CODE_PREFIX):]
        if target not in spec:
            raise PayloadError("BAD_NAME", f"QSGD tensor '{name}' encodes '{target}', which the reply spec lacks")
        dtype, shape = spec[target]
        numel = math.prod(shape)
        want = () if bucket <= 0 else (num_buckets(numel, bucket),)
        norm = payload.tensors.get(NORM_PREFIX + target)
        if norm is None or norm.dtype != torch.float32 or tuple(norm.shape) != want:
            raise PayloadError("BAD_NAME", f"QSGD tensor '{name}' comes without a float32{list(want)} "
                                           f"'{NORM_PREFIX}{target}'")
        if not bool(torch.isfinite(norm).all()) or bool((norm < 0).any()):
            raise PayloadError("NON_FINITE", f"QSGD norm of '{target}' is not finite and >= 0")
        negative, level = unpack_codes(t.cpu(), numel, levels)   # numpy bit unpacking, on the CPU
        value = dequantize(norm.cpu(), negative, level, levels, bucket).to(dtype).reshape(shape)
        tensors[target] = value.to(t.device)    # where the message was placed (common/transport/placement.py)
    return Payload(tensors=tensors, scalars=dict(payload.scalars), control=payload.control)


# ----------------------------------------------------------------------------- config hooks
def upload_levels(cfg: Any) -> int | None:
    """s when `[algorithm] compress = "qsgd"` (uploads are quantized), else None."""
    if getattr(cfg.algorithm, "compress", "none") != "qsgd":
        return None
    return int(cfg.algorithm.qsgd_levels)


def compress_upload(cfg: Any, payload: Payload, sender: str, round: int, step: int) -> Payload:
    """What a sender puts on the wire for an upload: the payload itself, or its QSGD encoding
    drawn from the stream ("qsgd", sender, round, step)."""
    levels = upload_levels(cfg)
    if levels is None:
        return payload
    return compress_payload(payload, levels, torch_stream(cfg.run.seed, "qsgd", sender, round, step),
                            int(cfg.algorithm.qsgd_bucket))


def decompress_upload(cfg: Any, payload: Payload, spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Payload:
    """The parent's side of `compress_upload` (before `validate_reply`)."""
    levels = upload_levels(cfg)
    if levels is None:
        return payload
    return decompress_payload(payload, spec, levels, int(cfg.algorithm.qsgd_bucket))
