"""The transport registry: `transport.kind` -> how a process builds its endpoint and its group worlds.

A transport is its own files plus one line in `TRANSPORTS`: the builder of its `Endpoint`
(common/transport/base.py: the messages, control and data, with their ledger records) and its
`Worlds` (common/transport/groups.py: how groups broadcast and reduce).  Entries name their
objects as "module:attribute" and are imported on first use, so a process imports only the
transport it runs (torch.distributed only where kind = "torch").

    endpoint = make_endpoint(cfg.transport.kind, "server", ledger, chunk_bytes=..., credentials=...)

- grpc: `GrpcEndpoint` (real sockets), groups as fan-outs of fabric calls;
- torch: the same gRPC endpoint for every message (registration, control, the round's calls),
  the tensors as torch.distributed collectives in its worlds (docs/torch_transport.md);
- inmemory: `InMemoryEndpoint` on an `InMemoryNetwork` (one process, unit tests: pass `network=`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.ledger import Ledger
    from fedhop.common.transport.base import Endpoint
    from fedhop.common.transport.groups import Worlds


@dataclass(frozen=True)
class Transport:
    """One transport kind: "module:attribute" of its endpoint builder and of its `Worlds`, and
    what the rest of fedhop must know of it without naming it:

    - `params`: the dataclass of its own `[transport]` keys (validated like every options table),
      or None when it takes none;
    - `sums_in_collective`: its groups reduce uploads as raw float sums inside a collective, so a
      coded upload (QSGD) cannot be summed and a robust rule never sees the updates apart;
    - `own_device`: a function (transport options) -> bool, true when each process must hold a
      device of its own (NCCL: one rank per GPU); None: never;
    - `one_process`: it connects endpoints inside one process only (unit tests): a launcher that
      starts processes refuses it.
    """

    endpoint: str   # a callable (node_id, ledger, **options) -> Endpoint
    worlds: str     # a Worlds instance
    params: str | None = None
    sums_in_collective: bool = False
    own_device: str | None = None
    one_process: bool = False


# a child process's endpoint (edge, client): it is reached over sockets before it has the run's
# config, and a torch run carries its messages on the same endpoint
PROCESS_TRANSPORT = "grpc"

TRANSPORTS: dict[str, Transport] = {
    "grpc": Transport("fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.common.transport.groups:FANOUT_WORLDS"),
    "torch": Transport("fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.common.transport.torch_groups:TORCH_WORLDS",
                       params="fedhop.common.transport.torchdist:TorchParams", sums_in_collective=True,
                       own_device="fedhop.common.transport.torchdist:rank_per_gpu"),
    "inmemory": Transport("fedhop.common.transport.inmemory:network_endpoint",
                          "fedhop.common.transport.groups:FANOUT_WORLDS", one_process=True),
}


class UnknownTransport(ValueError):
    """A `transport.kind` no entry of `TRANSPORTS` names."""


def transport(kind: str) -> Transport:
    """The registry entry of `kind`; UnknownTransport (one line, naming the known kinds) otherwise."""
    entry = TRANSPORTS.get(kind)
    if entry is None:
        raise UnknownTransport(f"transport.kind = {kind!r} is not a transport (known: {', '.join(sorted(TRANSPORTS))})")
    return entry


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def endpoint_builder(kind: str) -> Callable[..., "Endpoint"]:
    """The callable that builds transport `kind`'s endpoint (a class, or a function)."""
    return _load(transport(kind).endpoint)


def make_endpoint(kind: str, node_id: str, ledger: "Ledger", **options: Any) -> "Endpoint":
    """Process `node_id`'s endpoint of transport `kind`, recording into `ledger`.  `options` are
    the builder's keywords (chunk_bytes, max_message_bytes, credentials, ... for gRPC; network for
    the in-memory transport); one it does not take is a TypeError naming it."""
    return endpoint_builder(kind)(node_id, ledger, **options)


def params_of(kind: str) -> type | None:
    """The dataclass of transport `kind`'s own `[transport]` keys (None: it takes none, or the
    kind is unknown, which the config's `transport.kind` check reports)."""
    entry = TRANSPORTS.get(kind)
    return _load(entry.params) if entry is not None and entry.params else None


def sums_in_collective(kind: str) -> bool:
    """Whether transport `kind` sums uploads inside a collective (`Transport.sums_in_collective`)."""
    entry = TRANSPORTS.get(kind)
    return entry is not None and entry.sums_in_collective


def own_device_per_process(kind: str, options: dict[str, Any]) -> bool:
    """Whether every process of a run on transport `kind` with these options needs a device of
    its own (`Transport.own_device`)."""
    entry = TRANSPORTS.get(kind)
    return entry is not None and entry.own_device is not None and bool(_load(entry.own_device)(options))


def worlds_of(kind: str) -> "Worlds":
    """How transport `kind` sets up groups (common/transport/groups.py `Worlds`)."""
    return _load(transport(kind).worlds)


__all__ = ["TRANSPORTS", "PROCESS_TRANSPORT", "Transport", "UnknownTransport", "transport", "endpoint_builder", "make_endpoint",
           "worlds_of", "params_of", "sums_in_collective", "own_device_per_process"]
