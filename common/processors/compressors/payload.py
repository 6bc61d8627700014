"""A message's tensors coded with one compressor, and decoded by its receiver.

Per-tensor policy: `[compression] layers` may send a tensor plain or code it with other keys of
the same compressor (the first name pattern it matches, `for_tensor`); otherwise a float tensor with at least `min_numel` elements is coded (flattened, as
float32); integer tensors, 0-dim values (a norm, a step size) and smaller tensors travel as they
are.  Part P of tensor NAME is the tensor "{compressor.name}.{P}:{NAME}" (base.py); the parts of
one tensor are coded in name order from one generator, so a seeded stream decides every draw.

With error feedback (`error_feedback = "ef"`) the coded value is v + e, the residual e of this sender and
tensor, and e becomes (v + e) - decode(encode(v + e)).

The receiver decodes against the reply spec (names, dtypes, shapes the algorithm expects):
anything a participant could get wrong (a part for a tensor the spec lacks, one for a tensor
sent plain as well, a tensor the policy leaves plain sent coded, parts a compressor refuses)
is a PayloadError naming the tensor, so the reply is left out of the round and nobody crashes.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Iterator, Mapping, MutableMapping, Sequence

import torch

from fedhop.common.processors.compressors.base import Compressor
from fedhop.common.processors.compressors.ef21 import COUNT_KEY, ESTIMATE, estimate, note_sent, sender_count
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload, SparseTensor

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
RESIDUAL_PREFIX = "ef_residual:"   # a client state's key of error feedback's residual of a tensor


Layers = Sequence[tuple[str, "Compressor | None"]]   # `[compression] layers`: (name pattern, its compressor or None: plain)


def for_tensor(name: str, compressor: Compressor, layers: Layers = ()) -> Compressor | None:
    """The compressor of tensor `name`: the first `layers` pattern (fnmatch) it matches decides
    (None: it travels plain), else `compressor`."""
    for pattern, chosen in layers:
        if fnmatch.fnmatchcase(name, pattern):
            return chosen
    return compressor


def part_name(compressor: Compressor, part: str, tensor: str) -> str:
    return f"{compressor.name}.{part}:{tensor}"


def coded(dtype: torch.dtype, numel: int, min_numel: int) -> bool:
    """Whether the per-tensor policy codes a tensor of `dtype` with `numel` elements."""
    return dtype.is_floating_point and numel >= max(1, min_numel)


class TensorMemory(MutableMapping[str, torch.Tensor]):
    """The memory a stateful compressor keeps for one tensor of one sender (PowerSGD's warm-start
    Q), stored in the sender's persistent state under "{compressor}_memory:{tensor}:{key}", so a
    client's is checkpointed with the rest of its state."""

    def __init__(self, state: MutableMapping[str, torch.Tensor], compressor: str, tensor: str) -> None:
        self._state = state
        self._prefix = f"{compressor}_memory:{tensor}:"

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._state[self._prefix + key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._state[self._prefix + key] = value

    def __delitem__(self, key: str) -> None:
        del self._state[self._prefix + key]

    def __iter__(self) -> Iterator[str]:
        return (k[len(self._prefix):] for k in list(self._state) if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def encode_payload(payload: Payload, default: Compressor, rng: torch.Generator, min_numel: int,
                   state: MutableMapping[str, torch.Tensor] | None = None, feedback: bool = False,
                   layers: Layers = (), ef21: bool = False) -> Payload:
    """`payload` with every tensor the policy codes replaced by its parts (module docstring).
    `state`: the sender's persistent state (a client's), where error feedback keeps its residuals
    (by RESIDUAL_PREFIX + tensor name, with `feedback`) and a stateful compressor its memory
    (`TensorMemory`); None: a sender that keeps none (then neither is possible).
    `ef21`: code v - g with the sender's EF21 estimate g, add the decoded difference to g and
    send the count of differences (ef21.py; needs `state`).

    A compressor that defines `encode_shaped(t, rng, memory)` gets the tensor in its own shape
    (as float32) and its memory; every other gets it flattened.  `layers`: per-tensor settings
    (`for_tensor`), else `default` codes every tensor the policy codes."""
    tensors: dict[str, torch.Tensor] = {}
    residuals = state if feedback else None
    for name in sorted(payload.tensors):
        t = payload.tensors[name]
        compressor = for_tensor(name, default, layers)
        if compressor is None or not coded(t.dtype, t.numel(), min_numel):
            tensors[name] = t
            continue
        v = t.detach().reshape(-1).cpu()
        g = estimate(state, name, v) if ef21 and state is not None else None
        if g is not None:   # EF21: code v - g (Richtarik et al. 2021, Alg. 1 line 5)
            v = v - g
        if residuals is not None:   # EF-SGD: code p = v + e (Stich et al. 2018, Alg. 1 line 4)
            e = residuals.get(RESIDUAL_PREFIX + name)
            if e is not None and e.shape == v.shape and e.dtype == v.dtype:
                v = v + e
        shaped = getattr(compressor, "encode_shaped", None)
        if shaped is not None:
            memory: MutableMapping[str, torch.Tensor] = (TensorMemory(state, compressor.name, name)
                                                         if state is not None else {})
            parts = shaped(v.to(torch.float32).reshape(t.shape), rng, memory)
        else:
            parts = compressor.encode(v.to(torch.float32), rng)
        if residuals is not None:   # e <- p - C(p), in the tensor's own dtype (Alg. 1 line 6)
            residuals[RESIDUAL_PREFIX + name] = v - compressor.decode(parts, v.numel()).to(v.dtype)
        if g is not None and state is not None:   # g <- g + C(v - g) (Alg. 1 line 6)
            state[ESTIMATE + name] = g + compressor.decode(parts, v.numel()).to(v.dtype)
        for part in sorted(parts):
            tensors[part_name(compressor, part, name)] = parts[part]
    scalars = dict(payload.scalars)
    if ef21 and state is not None:   # the count of differences this sender applied (ef21.py)
        count = sender_count(state) + 1
        note_sent(state, count)
        scalars[COUNT_KEY] = count
    return Payload(tensors=tensors, scalars=scalars, control=payload.control)


def coded_names(payload: Payload, default: Compressor) -> set[str]:
    """The tensors `payload` carries coded (as parts of `default`'s name)."""
    prefix = default.name + "."
    return {name.partition(":")[2] for name in payload.tensors if ":" in name and name.startswith(prefix)}


def decode_payload(payload: Payload, spec: Spec, default: Compressor, min_numel: int, layers: Layers = (),
                   sparse: bool = False) -> Payload:
    """The receiver's side of `encode_payload`: each coded tensor decoded into its spec's dtype
    and shape, on the device the message was placed on, by the compressor `for_tensor` gives it
    (the same class as `default`: `layers` only change its keys, or send a tensor plain).

    `sparse`: a compressor with `decode_sparse(parts, numel)` (the sparsifiers, sparse.py) hands
    its (indices, values) on as a `SparseTensor` in `Payload.sparse` instead of a dense tensor
    (for a reply that goes straight into a streaming fold: pipeline.py `reply_chain`)."""
    prefix = default.name + "."
    plain: dict[str, torch.Tensor] = {}
    parts_of: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in payload.tensors.items():
        head, sep, target = name.partition(":")
        if sep and head.startswith(prefix):
            parts_of.setdefault(target, {})[head[len(prefix):]] = t
        else:
            plain[name] = t
    if not parts_of:
        return payload
    tensors = dict(plain)
    nonzeros: dict[str, SparseTensor] = {}
    for target in sorted(parts_of):
        if target not in spec:
            raise PayloadError("BAD_NAME", f"{default.name} parts encode '{target}', which the reply spec lacks")
        if target in plain:
            raise PayloadError("BAD_NAME", f"'{target}' is sent both plain and as {default.name} parts")
        dtype, shape = spec[target]
        numel = math.prod(shape)
        compressor = for_tensor(target, default, layers)
        if compressor is None:
            raise PayloadError("BAD_NAME", f"'{target}' travels plain (compression.layers), not as {default.name} parts")
        if not coded(dtype, numel, min_numel):
            raise PayloadError("BAD_NAME", f"'{target}' ({dtype}{list(shape)}) travels plain under "
                                           f"compression.min_numel = {min_numel}, not as {compressor.name} parts")
        parts = parts_of[target]
        device = next(iter(parts.values())).device
        by_nonzeros = getattr(compressor, "decode_sparse", None) if sparse else None
        try:
            on_cpu = {p: t.cpu() for p, t in parts.items()}
            value = by_nonzeros(on_cpu, numel) if by_nonzeros is not None else compressor.decode(on_cpu, numel)
        except PayloadError:
            raise
        except Exception as exc:   # noqa: BLE001 - a plug-in decoder's failure on a participant's input
            raise PayloadError("BAD_SHAPE", f"{compressor.name} could not decode '{target}': "
                                            f"{type(exc).__name__}: {exc}") from None
        if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, torch.Tensor) for v in value):
            idx, val = value   # checked by ValidateReply (message.py `sparse_problem`)
            nonzeros[target] = SparseTensor(idx.to(device), val.to(dtype=dtype, device=device), tuple(shape))
            continue
        if not isinstance(value, torch.Tensor) or value.numel() != numel:
            raise PayloadError("BAD_SHAPE", f"{compressor.name} decoded '{target}' into something other than "
                                            f"{numel} values")
        tensors[target] = value.reshape(shape).to(dtype=dtype, device=device)
    return Payload(tensors=tensors, scalars=dict(payload.scalars), control=payload.control, sparse=nonzeros)
