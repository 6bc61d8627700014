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

A compressor is chosen by `[compression] up = NAME`: a built-in, which a module of this package
lists in its `REGISTER = [Class, ...]` (each class's `name`), or a user's class
"package.module:Class" (common/util/plugins.py group "compressors"), both found by `COMPRESSORS`, a
common/util/registry.py `Registry`; its dataclass fields are its further `[compression]` keys
(common/config/options.py).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from fedhop.common.util.registry import Registry

__all__ = ["COMPRESSORS", "builtin_compressors", "compressor_class", "config_problem", "NONE"]   # the interface: base.py (imports torch)

NONE = "none"   # no compressor: tensors travel as they are


def _compressor_plugin(ref: str, cls: Any) -> type:
    """A plug-in compressor class, checked: its wire name and its dataclass of [compression] keys."""
    from fedhop.common.util.plugins import PluginError
    wire = getattr(cls, "name", None)
    if not (isinstance(wire, str) and re.fullmatch(r"[a-z][a-z0-9_]{0,31}", wire)) or wire in COMPRESSORS:
        raise PluginError(f"compressor '{ref}': its class attribute `name` (the prefix of its parts on the wire) "
                          f"must be 1-32 lower-case letters, digits or '_', starting with a letter, and not a "
                          f"built-in's; got {wire!r}")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise PluginError(f"compressor '{ref}' is not a dataclass (its fields are its [compression] keys)")
    return cls


#: the modules' `REGISTER = [Class, ...]` (imported on first use: they import torch) and the plug-ins
COMPRESSORS: Registry[type] = Registry("compressor", __name__, "compressors", plugin=_compressor_plugin,
                                          also=(NONE,))


def builtin_compressors() -> dict[str, type]:
    """The built-in compressor classes by name."""
    return COMPRESSORS.builtins()


def compressor_class(name: Any) -> type | None:
    """The class of compressor `name` (None for "none"): a built-in, or a user's plug-in
    "package.module:Class" (or an entry point of group fedhop.compressors).  UnknownName (a
    KeyError) for an unknown name; PluginError (a ValueError) for a plug-in that does not load or
    is no compressor."""
    if name == NONE:
        return None
    if not isinstance(name, str):
        raise COMPRESSORS.unknown(name)
    return COMPRESSORS.get(name)


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
