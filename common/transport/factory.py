"""The transport registry: `transport.kind` -> its endpoint, its group worlds and its data planes.

A transport is one folder, transports/<kind>/ (the package `fedhop.transports.<kind>`), whose
`__init__` defines `TRANSPORT`, a `Transport` (common/transport/entry.py); `TRANSPORT_KINDS`, a
common/util/registry.py `Registry` (the shape of every family's table), finds every folder's entry
by scanning the package when this module is imported, and a plug-in by the same lookup;
`TRANSPORTS` is its table.  An entry
names the builder of its `Endpoint`
(common/transport/base.py: the messages, control and data, with their ledger records), its
`Worlds` (common/transport/groups.py: how groups broadcast and reduce) and its `planes`: for
each *concept* of a role that moves tensors (`PLANE_CONCEPTS`: a star round, a hierarchical
round, an edge's HierFAVG step), the class that does it.  A topology that moves tensors its own
way names its classes per transport *style* ("fanout": tensors inside the calls; "group":
collectives and peer sends) and passes them to `data_plane` (`owned`; e.g. Fed-CHS's model path,
topologies/sequential/).  Entries name their objects as "module:attribute" and are imported on first use,
so a process imports only the transport it runs (torch.distributed only where kind = "torch"),
and common/ imports no role module: a role asks `data_plane(kind, concept)` and gets its class.

    endpoint = make_endpoint(cfg.transport.kind, "server", ledger, chunk_bytes=..., credentials=...)
    plane = data_plane(cfg.transport.kind, STAR_ROUND)(ctx)

- grpc (transports/grpc/): `GrpcEndpoint` (real sockets; common/transport/grpc.py, the
  endpoint every child process speaks before it has a config), groups as fan-outs of fabric calls;
- torch (transports/torch/): the same gRPC endpoint for every message (registration, control,
  the round's calls), the tensors as torch.distributed collectives in its worlds
  (docs/torch_transport.md);
- inmemory (transports/inmemory/): `InMemoryEndpoint` on an `InMemoryNetwork` (one process: the
  in-process engine and unit tests; pass `network=`).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

from fedhop.common.transport.entry import (
    EDGE_STEP,
    FANOUT_PLANES,
    GROUP_PLANES,
    HIER_ROUND,
    PLANE_CONCEPTS,
    STAR_ROUND,
    STYLES,
    Transport,
)
from fedhop.common.util.registry import Registry, UnknownName
from fedhop.common.wire.methods import declare

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.transport.base import Endpoint
    from fedhop.common.transport.groups import Worlds
    from fedhop.common.wire.ledger import Ledger


# a child process's endpoint (edge, client): it is reached over sockets before it has the run's
# config, and a torch run carries its messages on the same endpoint
PROCESS_TRANSPORT = "grpc"

FOLDER_PACKAGE = "fedhop.transports"   # transports/ (pyproject.toml package-dir)


class UnknownTransport(UnknownName):
    """A `transport.kind` that is neither a folder nor a plug-in."""


class NoDataPlane(ValueError):
    """A transport that gives no data plane for a concept (a topology it does not carry)."""


def _folder_transport(kind: str, entry: object, module: str) -> Transport:
    """A folder's `TRANSPORT`, checked, its methods declared."""
    if not isinstance(entry, Transport):
        raise TypeError(f"transport folder '{module}' defines no TRANSPORT (a fedhop.common.transport.entry.Transport)")
    declare(entry.methods, f"transport '{kind}'")
    return entry


def _plugin_transport(kind: str, obj: object) -> Transport:
    """A plug-in's `Transport`, its methods declared (a clash raises MethodClash)."""
    if not isinstance(obj, Transport):
        from fedhop.common.util.plugins import PluginError  # local: plug-ins only
        raise PluginError(f"'{kind}' is not a fedhop.common.transport.entry.Transport (found: {type(obj).__name__})")
    declare(obj.methods, f"transport '{kind}'")
    return obj


#: the folders of `fedhop.transports` (each `__init__` defines `TRANSPORT`), in their entries'
#: `listed` order, then by name, and the plug-ins kept under their `transport.kind`.  Eager: every
#: folder's methods are declared when this module is imported.
TRANSPORT_KINDS: Registry[Transport] = Registry("transport", FOLDER_PACKAGE, "transports", attribute="TRANSPORT",
                                                folders=True, eager=True, check=_folder_transport,
                                                plugin=_plugin_transport, order=lambda kind, entry: entry.listed,
                                                what="TRANSPORT", error=UnknownTransport, keep=True)
TRANSPORT_KINDS.builtins()
TRANSPORTS: dict[str, Transport] = TRANSPORT_KINDS.table   # every kind known so far, built-ins first


def add_transport(kind: str, entry: Transport) -> None:
    """Add (or replace) transport `kind`, declaring its `methods` (a clash with another owner's
    declaration raises MethodClash, common/wire/methods.py, and adds nothing)."""
    declare(entry.methods, f"transport '{kind}'")
    TRANSPORT_KINDS.add(kind, entry)


def transport(kind: str) -> Transport:
    """The registry entry of `kind`: a built-in folder's, or a plug-in's (an import path
    "package.module:TRANSPORT" or an entry point of group `fedhop.transports`, loaded through
    common/util/plugins.py `load_plugin` and its allow-list on first use, then kept under `kind`
    with its methods declared).  UnknownTransport (one line, naming the known kinds) for a kind
    that is neither; PluginError (a ValueError) for a plug-in that does not load or is no `Transport`."""
    return TRANSPORT_KINDS.get(kind)


def known_transport(kind: str) -> Transport | None:
    """`transport(kind)`, or None for a kind that is not one or a plug-in that does not load (the
    config loader's check of `transport.kind`, through `params_of`, reports either in one line)."""
    try:
        return transport(kind)
    except ValueError:   # UnknownTransport, PluginError
        return None


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
    """The dataclass of transport `kind`'s own `[transport]` keys (None: it takes none).  The
    config loader asks it while it validates `transport.kind`: an unknown kind is UnknownTransport,
    a plug-in that does not load PluginError, either one line naming the key."""
    entry = transport(kind)   # an unknown kind: UnknownTransport, which the config loader reports
    return _load(entry.params) if entry.params else None


def sums_in_collective(kind: str) -> bool:
    """Whether transport `kind` sums uploads inside a collective (`Transport.sums_in_collective`)."""
    entry = known_transport(kind)
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
    entry = known_transport(kind)
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
    entry = known_transport(kind)
    return entry is not None and entry.own_device is not None and bool(_load(entry.own_device)(options))


def handler_fns(kind: str, role: str) -> list[Callable[[Any], dict]]:
    """The functions `(role object) -> {Method: handler}` that transport `kind` adds to `role`'s
    methods (`Transport.handlers`), imported on first use."""
    return [_load(ref) for ref in transport(kind).handlers.get(role, ())]


def worlds_of(kind: str) -> "Worlds":
    """How transport `kind` sets up groups (common/transport/groups.py `Worlds`)."""
    return _load(transport(kind).worlds)


def transports_with(concept: str, owned: Mapping[str, str] | None = None) -> list[str]:
    """The transport kinds that give a data plane for `concept` (theirs, or one of `owned` for their style), sorted."""
    return sorted(kind for kind, entry in TRANSPORTS.items()
                  if concept in entry.planes or entry.style in (owned or {}))


def data_plane(kind: str, concept: str, topology: str, owned: Mapping[str, str] | None = None) -> Any:
    """Transport `kind`'s class for `concept` (PLANE_CONCEPTS, or a topology's own concept),
    imported on first use: the transport's own, else the one of `owned` ("module:attr" per
    `Transport.style`, the topology's classes) for the transport's style.  A transport with
    neither is NoDataPlane, one line naming `topology` (the topology.kind that needs it) and the
    transports that carry it."""
    entry = transport(kind)
    target = entry.planes.get(concept) or (owned or {}).get(entry.style)
    if target is None:
        raise NoDataPlane(f"topology.kind = '{topology}' does not run over transport.kind = '{kind}' "
                          f"(it runs over {', '.join(transports_with(concept, owned))})")
    return _load(target)


__all__ = ["TRANSPORTS", "add_transport", "PROCESS_TRANSPORT", "Transport", "UnknownTransport", "NoDataPlane", "transport",
           "known_transport", "endpoint_builder", "make_endpoint", "worlds_of", "params_of", "sums_in_collective",
           "own_device_per_process", "handler_fns", "data_plane", "transports_with", "PLANE_CONCEPTS",
           "STAR_ROUND", "HIER_ROUND", "EDGE_STEP", "STYLES", "FANOUT_PLANES", "GROUP_PLANES"]
