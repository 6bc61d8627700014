"""Coded broadcasts (`[compression] down`, docs/compression.md "Downlink"): the server sends each
receiver a coded difference to the model it holds, and every receiver ends each round with the
server's reference model bit for bit.

The rule, for every broadcast tensor the per-tensor policy codes (payload.py `coded`, `for_tensor`):

- The server keeps x_hat, the reference model, and its version v (one more per coded broadcast).
  A broadcast b (the algorithm's message) is coded as C(b - x_hat) from the stream
  ("compress", SENDER, "down", v), and x_hat becomes `advance(x_hat, decode(C))`:
  float32 on the CPU, then the tensor's dtype.  The reference tracks b with the coding error
  carried into the next difference (as error feedback does for uploads).
- A receiver (a client process) that holds version u < v gets the coded differences of
  versions u + 1 .. v in order, while the server still keeps them: it keeps the latest ones
  as long as their bytes together stay below the reference's plain bytes.  Any other receiver
  gets x_hat itself, plain: a resync, which the ledger counts as the plain message it is.
  Either way the receiver computes x_hat with the same `advance` on the same values, so every
  client trains from the same model, bit for bit, whichever rounds it skipped.
- The server learns what a receiver holds from the round's replies: one that answered holds
  the new version; one that did not is sent a resync next time.  A receiver asked to apply a
  difference to a version it does not hold refuses the call (STALE_BASE), and gets a resync next.
- A broadcast whose coded tensors differ from the reference's (names, shapes, dtypes) resets
  the reference to it: every receiver gets that round's message plain.
- Tensors the policy leaves plain (integers, small tensors, "plain" layers) and a client's own
  extra tensors (Algorithm.client_message) travel as they are.

In the hierarchical topology the server codes each edge's `edge_round` message (the edge is the
receiver), and each edge, a sender of its own, codes its `train` messages to its client
processes (each of the round's edge iterations is a broadcast).

The server's reference is kept in its state's `extra` (so a checkpoint saves it and a resume
continues from it); an edge's in its own state, which checkpoints pull too (edge/aggregator.py
`own_state`).  After a resume every receiver is sent a resync.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping

import torch

from fedhop.common.processors.compressors import NONE
from fedhop.common.processors.compressors.base import Compressor
from fedhop.common.processors.compressors.payload import Layers, TensorMemory, coded, for_tensor
from fedhop.common.util.rng import torch_stream
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload

#: the scalars of a coded broadcast: the version the receiver holds after it, and (a difference
#: only) the version it must hold before
VERSION_KEY = "down_version"
BASE_KEY = "down_base"
REF_PREFIX = "down_ref:"            # the server state's extra: the reference of tensor NAME
VERSION_STATE = "down_ref_version"  # ... and its version (a 0-dim int64 tensor)
MEMORY_PREFIX = "down_"             # a stateful compressor's memory: "down_{compressor}_memory:NAME:KEY"


@dataclass(frozen=True)
class DownlinkCoding:
    """The broadcasts' compressor and the per-tensor policy it shares with the uploads."""

    compressor: Compressor
    min_numel: int
    layers: Layers = ()

    def codes(self, name: str, t: torch.Tensor) -> Compressor | None:
        """The compressor of broadcast tensor `name` (None: it travels plain)."""
        compressor = for_tensor(name, self.compressor, self.layers)
        if compressor is None or not coded(t.dtype, t.numel(), self.min_numel):
            return None
        return compressor


def downlink_coding(cfg: Any) -> DownlinkCoding | None:
    """The broadcasts' coding of config `cfg` (None: `compression.down = "none"`)."""
    comp = getattr(cfg, "compression", None)
    if comp is None or getattr(comp, "down", NONE) == NONE:
        return None
    params = getattr(comp, "down_params", None)
    if params is None:
        return None
    layers: Layers = ()
    if comp.down == "same" and comp.layers:
        from fedhop.common.processors.compressors import layer_settings
        layers = tuple(layer_settings(cfg))
    return DownlinkCoding(params, int(comp.min_numel), layers)


def part_name(version: int, compressor: Compressor, part: str, tensor: str) -> str:
    """Part `part` of version `version`'s coded difference of tensor `tensor`."""
    return f"down{version}.{compressor.name}.{part}:{tensor}"


def advance(reference: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """The reference after one coded difference: one rule for the server and every receiver."""
    flat = reference.reshape(-1).to(torch.float32) + decoded.reshape(-1).to(torch.float32)
    return flat.to(reference.dtype).reshape(reference.shape)


def _layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(n, t.dtype, tuple(t.shape)) for n, t in sorted(tensors.items())]


class DownlinkSender:
    """A sender's side (the server's, or an edge's towards its clients): the reference, its
    recent coded differences, and what each receiver holds.

    `extra`: a callable giving where the reference is kept (the server state's `extra`, whose
    dict is replaced on resume, so it is looked up each time; an edge's own dict)."""

    def __init__(self, coding: DownlinkCoding, seed: int,
                 extra: Callable[[], MutableMapping[str, torch.Tensor]], sender: str = "server") -> None:
        self.coding = coding
        self.seed = seed
        self.sender = sender   # whose stream: ("compress", sender, "down", version)
        self._extra = extra
        self.history: list[tuple[int, dict[str, dict[str, torch.Tensor]], int]] = []   # (version, parts, bytes)
        self.holds: dict[str, int] = {}   # receiver -> the version it holds (learnt from replies)
        self.resyncs = 0       # plain messages (x_hat itself): the first round's, resyncs, after a reset
        self.coded_sends = 0   # messages of coded differences

    # -- the reference --------------------------------------------------------------------
    def reference(self) -> dict[str, torch.Tensor]:
        extra = self._extra()
        return {k[len(REF_PREFIX):]: v for k, v in extra.items() if k.startswith(REF_PREFIX)}

    @property
    def version(self) -> int:
        v = self._extra().get(VERSION_STATE)
        return int(v) if v is not None else 0

    def _store(self, reference: dict[str, torch.Tensor], version: int) -> None:
        extra = self._extra()
        for k in [k for k in extra if k.startswith(REF_PREFIX)]:
            del extra[k]
        for name, t in reference.items():
            extra[REF_PREFIX + name] = t
        extra[VERSION_STATE] = torch.tensor(version, dtype=torch.int64)

    # -- one broadcast -----------------------------------------------------------------------
    def code(self, message: Payload) -> Callable[[str], Payload]:
        """Code broadcast `message`; returns the message for a receiver (by name), one object per
        version held (each distinct message is encoded once)."""
        codes = {n: c for n, t in message.tensors.items() if (c := self.coding.codes(n, t)) is not None}
        current = {n: message.tensors[n].detach().cpu() for n in codes}
        reference = self.reference()
        ref_layout = _layout(reference)
        version = self.version + 1
        if not codes or ref_layout != _layout(current) or self.version == 0:
            # no reference yet, or a broadcast of other tensors: it becomes the reference, plain for all
            self._store({n: t.clone() for n, t in current.items()}, version)
            self.history.clear()
            plain = self._plain(message, version)

            def everyone_plain(receiver: str) -> Payload:
                self.resyncs += 1
                return plain
            return everyone_plain
        parts_of: dict[str, dict[str, torch.Tensor]] = {}
        new_reference: dict[str, torch.Tensor] = {}
        rng = torch_stream(self.seed, "compress", self.sender, "down", version)
        size = 0
        for name in sorted(codes):
            compressor = codes[name]
            ref = reference[name].cpu()
            diff = current[name].to(torch.float32) - ref.to(torch.float32)
            shaped = getattr(compressor, "encode_shaped", None)
            if shaped is not None:
                memory = TensorMemory(self._extra(), MEMORY_PREFIX + compressor.name, name)
                parts = shaped(diff, rng, memory)
            else:
                parts = compressor.encode(diff.reshape(-1), rng)
            parts_of[name] = parts
            size += sum(p.numel() * p.element_size() for p in parts.values())
            new_reference[name] = advance(ref, compressor.decode(parts, ref.numel()))
        self._store(new_reference, version)
        self.history.append((version, parts_of, size))
        plain_bytes = sum(t.numel() * t.element_size() for t in new_reference.values())
        kept_bytes = sum(s for _, _, s in self.history)
        while self.history and kept_bytes >= plain_bytes:
            kept_bytes -= self.history.pop(0)[2]   # keep the differences while they cost less than the model itself
        plain = self._plain(message, version)
        by_base: dict[int, Payload] = {}

        def for_receiver(receiver: str) -> Payload:
            base = self.holds.get(receiver)
            kept = [v for v, _, _ in self.history]
            if base is None or base + 1 not in kept:
                self.resyncs += 1
                return plain
            self.coded_sends += 1
            if base not in by_base:
                by_base[base] = self._difference(message, base, version, codes)
            return by_base[base]
        return for_receiver

    def _plain(self, message: Payload, version: int) -> Payload:
        """The message with the reference's tensors (x_hat) in place of the broadcast's coded ones."""
        reference = self.reference()
        tensors = {n: (reference[n] if n in reference else t) for n, t in message.tensors.items()}
        return Payload(tensors=tensors, scalars={**message.scalars, VERSION_KEY: version}, control=message.control)

    def _difference(self, message: Payload, base: int, version: int, codes: Mapping[str, Compressor]) -> Payload:
        """The coded differences of versions base + 1 .. `version` (`codes`: each coded tensor's
        compressor), and the message's plain tensors."""
        tensors = {n: t for n, t in message.tensors.items() if n not in codes}
        for v, parts_of, _ in self.history:
            if v <= base:
                continue
            for name, parts in parts_of.items():
                compressor = codes[name]
                for part, t in parts.items():
                    tensors[part_name(v, compressor, part, name)] = t
        return Payload(tensors=tensors, scalars={**message.scalars, VERSION_KEY: version, BASE_KEY: base},
                       control=message.control)

    def delivered(self, sent: dict[str, bool]) -> None:
        """After the round: each receiver that was sent the message, and whether any of its
        clients answered (then it holds the new version; else it gets a resync next)."""
        for receiver, answered in sent.items():
            if answered:
                self.holds[receiver] = self.version
            else:
                self.holds.pop(receiver, None)


class DownlinkReceiver:
    """A client process's side: the reference it holds and its version (shared by its clients;
    a round's first call applies the difference, the others find it applied)."""

    def __init__(self, coding: DownlinkCoding) -> None:
        self.coding = coding
        self.version = 0
        self.reference: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def receive(self, message: Payload, who: str) -> Payload:
        """The broadcast as the algorithm expects it (x_hat in place of the coded tensors); a
        message without the downlink's scalars is returned as it is."""
        if VERSION_KEY not in message.scalars:
            return message
        scalars = dict(message.scalars)
        version = _version(scalars.pop(VERSION_KEY), VERSION_KEY, who)
        base = _version(scalars.pop(BASE_KEY), BASE_KEY, who) if BASE_KEY in scalars else None
        with self._lock:
            if base is None:
                return self._resync(message, scalars, version)
            return self._apply(message, scalars, base, version, who)

    def _resync(self, message: Payload, scalars: dict, version: int) -> Payload:
        codes = {n for n, t in message.tensors.items() if self.coding.codes(n, t) is not None}
        self.reference = {n: message.tensors[n].detach().cpu().clone() for n in codes}
        self.version = version
        return Payload(tensors=dict(message.tensors), scalars=scalars, control=message.control)

    def _apply(self, message: Payload, scalars: dict, base: int, version: int, who: str) -> Payload:
        plain: dict[str, torch.Tensor] = {}
        parts_by: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for name, t in message.tensors.items():
            head, sep, target = name.partition(":")
            v_text, dot, rest = head.partition(".")
            if sep and dot and v_text.startswith("down") and v_text[4:].isdigit():
                compressor_name, _, part = rest.partition(".")
                if target not in self.reference:
                    raise PayloadError("BAD_NAME", f"{who}: a coded difference of '{target}', which the "
                                                   f"reference lacks")
                parts_by.setdefault(int(v_text[4:]), {}).setdefault(target, {})[part] = t
            else:
                plain[name] = t
        if self.version != version:
            if self.version != base:
                raise PayloadError("STALE_BASE", f"{who}: a difference to version {base}, this process holds "
                                                 f"version {self.version}")
            if sorted(parts_by) != list(range(base + 1, version + 1)):
                raise PayloadError("BAD_NAME", f"{who}: differences of versions {sorted(parts_by)}, expected "
                                               f"{base + 1}..{version}")
            reference = dict(self.reference)
            for v in sorted(parts_by):
                if set(parts_by[v]) != set(reference):
                    raise PayloadError("BAD_NAME", f"{who}: version {v} codes {sorted(parts_by[v])[:5]}, the "
                                                   f"reference holds {sorted(reference)[:5]}")
                for name, parts in parts_by[v].items():
                    compressor = self.coding.codes(name, reference[name])
                    if compressor is None:
                        raise PayloadError("BAD_NAME", f"{who}: '{name}' travels plain, not coded")
                    try:
                        decoded = compressor.decode({p: t.cpu() for p, t in parts.items()}, reference[name].numel())
                    except PayloadError:
                        raise
                    except Exception as exc:   # noqa: BLE001 - a participant's input never crashes the process
                        raise PayloadError("BAD_SHAPE", f"{who}: {compressor.name} could not decode '{name}': "
                                                        f"{type(exc).__name__}: {exc}") from None
                    if not isinstance(decoded, torch.Tensor) or decoded.numel() != reference[name].numel():
                        raise PayloadError("BAD_SHAPE", f"{who}: '{name}' decoded into the wrong number of values")
                    reference[name] = advance(reference[name], decoded)
            self.reference, self.version = reference, version
        tensors = {**plain, **{n: t.clone() for n, t in self.reference.items()}}
        return Payload(tensors=tensors, scalars=scalars, control=message.control)


def _version(value: Any, key: str, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PayloadError("BAD_SCALAR", f"{who}: scalar '{key}' must be a version number, got {value!r}")
    return value
