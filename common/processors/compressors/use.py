"""Where the configured compressor applies (`[compression]`, docs/compression.md): the uploads
of clients (replies to `train`) and of edges (`edge_round` partials), coded by the sender's
outbound chain and decoded by the parent's inbound chain (common/processors/pipeline.py).

Each sender's draws come from the stream ("compress", sender, round, step) of the run's seed.
With `error_feedback = "ef"` a client's residual is part of its persistent state (so a
checkpoint keeps it and a resume restores it), as is a stateful compressor's memory; an edge
keeps its own in `EdgeAggregator.upload_state`, which checkpoints also keep (edge/aggregator.py
`own_state`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping

import torch

from fedhop.common.processors.compressors import NONE, layer_settings
from fedhop.common.processors.compressors.base import Compressor
from fedhop.common.processors.compressors.ef21 import apply_upload
from fedhop.common.processors.compressors.payload import coded_names, decode_payload, encode_payload
from fedhop.common.util.rng import torch_stream
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload


@dataclass(frozen=True)
class UploadCoding:
    """The configured compressor and its policy."""

    compressor: Compressor
    min_numel: int
    feedback: bool
    edges: bool   # edges code their partials too
    layers: tuple[tuple[str, Compressor | None], ...] = ()   # [compression] layers (payload.py `for_tensor`)
    ef21: bool = False   # error_feedback = "ef21" (ef21.py)


def upload_coding(cfg: Any) -> UploadCoding | None:
    """The uploads' coding of config `cfg` (None: `compression.up = "none"`)."""
    comp = getattr(cfg, "compression", None)
    if comp is None or comp.up == NONE or comp.params is None:
        return None
    layers = tuple(layer_settings(cfg)) if comp.layers else ()
    return UploadCoding(comp.params, int(comp.min_numel), comp.error_feedback == "ef", comp.edge == "same", layers,
                        comp.error_feedback == "ef21")


def for_sender(coding: UploadCoding | None, edge: bool) -> UploadCoding | None:
    """The coding an upload of a client (`edge` False) or of an edge uses (None: plain)."""
    if coding is None or (edge and not coding.edges):
        return None
    return coding


def encode_upload(coding: UploadCoding, payload: Payload, seed: int, sender: str, round: int, step: int,
                  state: MutableMapping[str, torch.Tensor] | None) -> Payload:
    """`payload` coded by sender `sender` (`state`: its persistent state, for error feedback's
    residuals and a stateful compressor's memory)."""
    rng = torch_stream(seed, "compress", sender, round, step)
    return encode_payload(payload, coding.compressor, rng, coding.min_numel, state, coding.feedback, coding.layers,
                          coding.ef21)


def decode_upload(coding: UploadCoding, payload: Payload, spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                  memory: MutableMapping[str, torch.Tensor] | None = None, peer: str = "", who: str = "",
                  sparse: bool = False) -> Payload:
    """`payload` decoded against `spec`; with EF21 the parent's step too (`memory`: where the
    parent keeps its copies of each sender's estimate, `peer`: the sender).  `sparse`: a
    sparsifier's tensors as their nonzeros (payload.py `decode_payload`; never with EF21, whose
    step makes the reply its dense estimate)."""
    decoded = decode_payload(payload, spec, coding.compressor, coding.min_numel, coding.layers,
                             sparse=sparse and not coding.ef21)
    if not coding.ef21:
        return decoded
    if memory is None or not peer:
        raise PayloadError("EF21_DESYNC", f"{who}: an EF21 upload reached a receiver that keeps no copies")
    return apply_upload(decoded, coded_names(payload, coding.compressor), memory, peer, who)
