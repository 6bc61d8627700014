"""The transport registry: `transport.kind` -> its endpoint, its group worlds and its data planes.

A transport is its own files plus one line in `TRANSPORTS`: the builder of its `Endpoint`
(common/transport/base.py: the messages, control and data, with their ledger records), its
`Worlds` (common/transport/groups.py: how groups broadcast and reduce) and its `planes`: for
each *concept* of a role that moves tensors (`PLANE_CONCEPTS`: a star round, a hierarchical
round, an edge's HierFAVG step, Fed-CHS's model path at the server and at an edge), the class
that does it.  Entries name their objects as "module:attribute" and are imported on first use,
so a process imports only the transport it runs (torch.distributed only where kind = "torch"),
and common/ imports no role module: a role asks `data_plane(kind, concept)` and gets its class.

    endpoint = make_endpoint(cfg.transport.kind, "server", ledger, chunk_bytes=..., credentials=...)
    plane = data_plane(cfg.transport.kind, STAR_ROUND)(ctx)

- grpc: `GrpcEndpoint` (real sockets), groups as fan-outs of fabric calls;
- torch: the same gRPC endpoint for every message (registration, control, the round's calls),
  the tensors as torch.distributed collectives in its worlds (docs/torch_transport.md);
- inmemory: `InMemoryEndpoint` on an `InMemoryNetwork` (one process, unit tests: pass `network=`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from fedhop.common.wire.methods import Method, declare

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.transport.base import Endpoint
    from fedhop.common.transport.groups import Worlds
    from fedhop.common.wire.ledger import Ledger


# the concepts a transport gives a data plane for (what each plane class implements: its role's docstring)
STAR_ROUND = "star round"                  # server: a star round's dispatch (server/sampled.py `DataPlane`)
HIER_ROUND = "hierarchical round"          # server: a hierarchical round's dispatch (`DataPlane`)
EDGE_STEP = "edge step"                    # edge: one HierFAVG edge iteration with its clients (edge/aggregator.py)
SEQ_SERVER_PATH = "sequential server path"  # server: how Fed-CHS's model reaches and leaves the server
SEQ_EDGE_PATH = "sequential edge path"      # edge: how Fed-CHS's model moves at an edge
PLANE_CONCEPTS = (STAR_ROUND, HIER_ROUND, EDGE_STEP, SEQ_SERVER_PATH, SEQ_EDGE_PATH)

#: the data planes of a transport that carries tensors inside its calls (gRPC, in-memory): fan-outs
FANOUT_PLANES: Mapping[str, str] = MappingProxyType({
    STAR_ROUND: "fedhop.server.sampled:ClientFanout",
    HIER_ROUND: "fedhop.server.sampled:EdgeFanout",
    EDGE_STEP: "fedhop.edge.aggregator:ClusterFanout",
    SEQ_SERVER_PATH: "fedhop.server.sequential:ServerInlineModelPath",
    SEQ_EDGE_PATH: "fedhop.edge.sequential:EdgeInlineModelPath",
})

#: the data planes of a transport with group collectives and peer sends (torch.distributed)
GROUP_PLANES: Mapping[str, str] = MappingProxyType({
    STAR_ROUND: "fedhop.server.group_rounds:GroupRounds",
    HIER_ROUND: "fedhop.server.group_rounds:HierGroupRounds",
    EDGE_STEP: "fedhop.edge.group_edge:GroupEdge",
    SEQ_SERVER_PATH: "fedhop.server.group_rounds:GroupSequentialPath",
    SEQ_EDGE_PATH: "fedhop.edge.group_edge:GroupModelPath",
})


@dataclass(frozen=True)
class Transport:
    """One transport kind: "module:attribute" of its endpoint builder, of its `Worlds` and of
    its data plane per concept (default: the fan-outs, tensors inside the calls), and what the
    rest of fedhop must know of it without naming it:

    - `params`: the dataclass of its own `[transport]` keys (validated like every options table),
      or None when it takes none;
    - `sums_in_collective`: its groups reduce uploads as raw float sums inside a collective, so a
      coded upload (QSGD) cannot be summed and a robust rule never sees the updates apart;
    - `own_device`: a function (transport options) -> bool, true when each process must hold a
      device of its own (NCCL: one rank per GPU); None: never;
    - `one_process`: it connects endpoints inside one process only (unit tests): a launcher that
      starts processes refuses it;
    - `handlers`: per role ("client", "edge"), functions `(role object) -> {Method: handler}` whose
      methods that role's process serves in a run on this transport only (the torch plane's
      group set-up and rounds); a run on another transport refuses them as unknown methods;
    - `in_process`: the in-process engine (run.engine = "inprocess", deploy/launch/inprocess.py) can stand
      for it: every message it carries is one of the fan-out's calls, which the in-memory endpoints
      (common/transport/inmemory.py) deliver and count as gRPC frames them;
    - `methods`: the transport's own protocol methods (common/wire/methods.py `Method`), declared
      into the method table when the entry is added (`add_transport`), as a topology's are by its
      spec.  The torch plane's torch_* methods are the core's (the group plane,
      common/transport/groups.py, names them for every transport).
    """

    endpoint: str   # a callable (node_id, ledger, **options) -> Endpoint
    worlds: str     # a Worlds instance
    planes: Mapping[str, str] = field(default_factory=lambda: FANOUT_PLANES)   # concept -> a class taking the role
    params: str | None = None
    sums_in_collective: bool = False
    own_device: str | None = None
    one_process: bool = False
    handlers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    methods: tuple[Method, ...] = ()
    in_process: bool = False


# a child process's endpoint (edge, client): it is reached over sockets before it has the run's
# config, and a torch run carries its messages on the same endpoint
PROCESS_TRANSPORT = "grpc"

TRANSPORTS: dict[str, Transport] = {
    "grpc": Transport("fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.common.transport.groups:FANOUT_WORLDS",
                      in_process=True),
    "torch": Transport("fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.common.transport.torch_groups:TORCH_WORLDS",
                       GROUP_PLANES, params="fedhop.common.transport.torchdist:TorchParams",
                       sums_in_collective=True, own_device="fedhop.common.transport.torchdist:rank_per_gpu",
                       handlers={"client": ("fedhop.client.group_worker:torch_handlers",),
                                 "edge": ("fedhop.edge.group_edge:torch_handlers",)}),
    "inmemory": Transport("fedhop.common.transport.inmemory:network_endpoint",
                          "fedhop.common.transport.groups:FANOUT_WORLDS", one_process=True, in_process=True),
}


def add_transport(kind: str, entry: Transport) -> None:
    """Add (or replace) transport `kind`, declaring its `methods` (a clash with another owner's
    declaration raises MethodClash, common/wire/methods.py, and adds nothing)."""
    declare(entry.methods, f"transport '{kind}'")
    TRANSPORTS[kind] = entry


for _kind, _entry in TRANSPORTS.items():
    declare(_entry.methods, f"transport '{_kind}'")


class UnknownTransport(ValueError):
    """A `transport.kind` no entry of `TRANSPORTS` names."""


class NoDataPlane(ValueError):
    """A transport that gives no data plane for a concept (a topology it does not carry)."""


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


def config_problem(cfg: Any) -> str | None:
    """Why the config asks transport `cfg.transport.kind` for what it cannot carry (a one-line config
    error, raised by the config loader, common/config/rules.py), or None: a transport that sums
    uploads in a collective reduces raw float sums, and a coded upload (QSGD) cannot be summed.
    (A robust aggregation's need of every update apart is the robust rule's check,
    common/engine/robust.py `config_problem`.)  `transport.wire_compression` is gRPC's own channel
    compression: only the grpc transport compresses its calls with it (the torch transport's tensors
    travel in collectives that gRPC never sees).  The in-process engine (run.engine = "inprocess")
    stands only for a transport registered `in_process`."""
    kind = cfg.transport.kind
    wire = getattr(cfg.transport, "wire_compression", "none")
    if kind != "grpc" and wire != "none":
        return (f"config key 'transport.wire_compression': got '{wire}', but only transport.kind = 'grpc' "
                f"compresses its calls (transport.kind = '{kind}'; allowed there: 'none')")
    down = getattr(getattr(cfg, "compression", None), "down", "none")
    entry = TRANSPORTS.get(kind)
    if down != "none" and entry is not None and entry.planes.get(STAR_ROUND) != FANOUT_PLANES[STAR_ROUND]:
        return (f"config key 'compression.down': got '{down}', but transport.kind = '{kind}' broadcasts by its own "
                f"data plane, not the server's fan-out that codes each process's message (allowed there: 'none')")
    engine = getattr(getattr(cfg, "run", None), "engine", "processes")
    if engine == "inprocess" and entry is not None and not entry.in_process:
        return (f"config key 'run.engine': got 'inprocess', but transport.kind = '{kind}' carries the run between "
                f"processes by its own data plane, which the in-process engine does not emulate (allowed there: "
                f"'processes'; or transport.kind = 'grpc')")
    compress = getattr(cfg.algorithm, "compress", "none")
    if sums_in_collective(kind) and compress != "none":
        return (f"config key 'algorithm.compress': got '{compress}', but transport.kind = '{kind}' reduces uploads "
                f"as raw float sums in a collective (allowed there: 'none'); use transport.kind = 'grpc' for QSGD")
    return None


def own_device_per_process(kind: str, options: dict[str, Any]) -> bool:
    """Whether every process of a run on transport `kind` with these options needs a device of
    its own (`Transport.own_device`)."""
    entry = TRANSPORTS.get(kind)
    return entry is not None and entry.own_device is not None and bool(_load(entry.own_device)(options))


def handler_fns(kind: str, role: str) -> list[Callable[[Any], dict]]:
    """The functions `(role object) -> {Method: handler}` that transport `kind` adds to `role`'s
    methods (`Transport.handlers`), imported on first use."""
    return [_load(ref) for ref in transport(kind).handlers.get(role, ())]


def worlds_of(kind: str) -> "Worlds":
    """How transport `kind` sets up groups (common/transport/groups.py `Worlds`)."""
    return _load(transport(kind).worlds)


def transports_with(concept: str) -> list[str]:
    """The transport kinds that give a data plane for `concept`, sorted."""
    return sorted(kind for kind, entry in TRANSPORTS.items() if concept in entry.planes)


def data_plane(kind: str, concept: str, topology: str) -> Any:
    """Transport `kind`'s class for `concept` (PLANE_CONCEPTS), imported on first use; one it
    does not have is NoDataPlane, one line naming `topology` (the topology.kind that needs it)
    and the transports that carry it."""
    target = transport(kind).planes.get(concept)
    if target is None:
        raise NoDataPlane(f"topology.kind = '{topology}' does not run over transport.kind = '{kind}' "
                          f"(it runs over {', '.join(transports_with(concept))})")
    return _load(target)


__all__ = ["TRANSPORTS", "add_transport", "PROCESS_TRANSPORT", "Transport", "UnknownTransport", "NoDataPlane", "transport",
           "endpoint_builder", "make_endpoint", "worlds_of", "params_of", "sums_in_collective",
           "own_device_per_process", "handler_fns", "data_plane", "transports_with", "PLANE_CONCEPTS",
           "STAR_ROUND", "HIER_ROUND", "EDGE_STEP", "SEQ_SERVER_PATH", "SEQ_EDGE_PATH", "FANOUT_PLANES", "GROUP_PLANES"]
