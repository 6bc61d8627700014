"""The compressor family (issue 47): what a sender puts on the wire instead of a float tensor,
and the byte formula of each (docs/compression.md).

- base.py: the interface (`Compressor`: encode / decode / encoded_bytes) and the decoder's checks;
- sparse.py: top-k, random-k (unbiased), threshold, with the kept indices as the smallest of a
  uint32 list, a delta-varint stream or a bitmap, chosen per tensor;
- quantize.py: signSGD's sign, the scaled sign, b-bit stochastic rounding, natural compression,
  float16 and bfloat16 casts;
- qsgd.py: QSGD (common/processors/compress.py) as a member of the family;
- lowrank.py: PowerSGD, rank-r factors by one warm-started power-iteration step;
- payload.py: a message's tensors coded and decoded with one compressor, under the per-tensor
  policy (`[compression] min_numel`, `layers`), with error feedback (EF-SGD) around any
  compressor, its residual kept per sender;
- use.py: where the configured compressor applies (uploads of clients and edges);
- ef21.py: EF21's estimates at both ends of an upload, with the count that keeps them equal;
- downlink.py: the server's broadcasts (`[compression] down`) coded as differences to the model
  each process holds, with the resync rule for processes that skipped rounds.

A compressor is chosen by `[compression] up = NAME` (a built-in name below, or a user's class
"package.module:Class", common/util/plugins.py group "compressors"); its dataclass fields are its
further `[compression]` keys (common/config/options.py).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = ["builtin_compressors", "compressor_class", "config_problem", "NONE"]   # the interface: base.py (imports torch)

NONE = "none"   # no compressor: tensors travel as they are


def builtin_compressors() -> dict[str, type]:
    """The built-in compressor classes by name (imported on first use: they import torch)."""
    from fedhop.common.processors.compressors.lowrank import PowerSGD
    from fedhop.common.processors.compressors.qsgd import QSGD
    found: dict[str, type] = {"qsgd": QSGD, "powersgd": PowerSGD}
    try:
        from fedhop.common.processors.compressors import sparse
        found.update({c.name: c for c in (sparse.TopK, sparse.RandK, sparse.Threshold)})
    except ImportError:
        pass
    try:
        from fedhop.common.processors.compressors import quantize
        found.update({c.name: c for c in (quantize.Sign, quantize.ScaledSign, quantize.StochasticRounding,
                                          quantize.Natural, quantize.Float16, quantize.BFloat16)})
    except ImportError:
        pass
    return found


def compressor_class(name: Any) -> type | None:
    """The class of compressor `name` (None for "none"): a built-in, or a user's plug-in
    "package.module:Class" (or an entry point of group fedhop.compressors).  KeyError for an
    unknown name; PluginError (a ValueError) for a plug-in that does not load or is no compressor."""
    if name == NONE:
        return None
    found = builtin_compressors()
    if name in found:
        return found[name]
    from fedhop.common.util.plugins import entry_point_names, load_plugin
    from fedhop.common.util.suggest import did_you_mean
    try:
        cls = load_plugin(str(name), "compressors")
    except LookupError:
        allowed = sorted({NONE, *found, *entry_point_names("compressors")})
        raise KeyError(f"unknown compressor '{name}'{did_you_mean(str(name), allowed)} (allowed: "
                       f"{', '.join(allowed)}, or an import path 'package.module:Class')") from None
    from fedhop.common.util.plugins import PluginError
    wire = getattr(cls, "name", None)
    if not (isinstance(wire, str) and re.fullmatch(r"[a-z][a-z0-9_]{0,31}", wire)) or wire in found:
        raise PluginError(f"compressor '{name}': its class attribute `name` (the prefix of its parts on the wire) "
                          f"must be 1-32 lower-case letters, digits or '_', starting with a letter, and not a "
                          f"built-in's; got {wire!r}")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise PluginError(f"compressor '{name}' is not a dataclass (its fields are its [compression] keys)")
    return cls


def config_problem(cfg: Any) -> str | None:
    """The [compression] rules between sections (common/config/rules.py)."""
    comp = cfg.compression
    if comp.up == NONE:
        if comp.error_feedback != "none":
            return "config key 'compression.error_feedback': needs a compressor (compression.up is 'none')"
        return None
    if getattr(cfg.algorithm, "compress", "none") != "none":
        return (f"config key 'compression.up': '{comp.up}' and algorithm.compress = '{cfg.algorithm.compress}' "
                f"both code the uploads; set one (compression.up = 'qsgd' is algorithm.compress = 'qsgd')")
    return None


def layer_settings(cfg: Any) -> list[tuple[str, Any]]:
    """`[compression] layers` as (pattern, compressor or None for "plain"), in the order written;
    each table is the configured compressor with the table's keys on top.  The loader has checked
    every entry (common/config/rules.py `_check_compression_layers`)."""
    comp = cfg.compression
    out: list[tuple[str, Any]] = []
    for pattern, value in comp.layers.items():
        if value == "plain":
            out.append((pattern, None))
        elif isinstance(value, dict) and comp.params is not None:
            out.append((pattern, dataclasses.replace(comp.params, **value)))
        else:
            raise ValueError(f"compression.layers.{pattern!r}: got {value!r}, allowed: \"plain\" or a table of "
                             f"compression.up's keys")
    return out
