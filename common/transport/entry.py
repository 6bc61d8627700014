"""`Transport`: everything fedhop knows about one transport kind, in one object, and the data
plane concepts its entry names classes for.

A transport is a folder transports/<kind>/ (the package `fedhop.transports.<kind>`) whose
`__init__` defines `TRANSPORT`, a `Transport` (common/transport/factory.py scans the folders
into `TRANSPORTS`).  This module is what such an `__init__` imports: it imports nothing of the
fabric, so scanning the folders while factory.py is being imported makes no cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from fedhop.common.wire.methods import Method

# the concepts a transport gives a data plane for (what each plane class implements: its role's docstring)
STAR_ROUND = "star round"                  # server: a star round's dispatch (server/sampled.py `DataPlane`)
HIER_ROUND = "hierarchical round"          # server: a hierarchical round's dispatch (`DataPlane`)
EDGE_STEP = "edge step"                    # edge: one HierFAVG edge iteration with its clients (edge/aggregator.py)
PLANE_CONCEPTS = (STAR_ROUND, HIER_ROUND, EDGE_STEP)
STYLES = ("fanout", "group")   # how a transport moves tensors (`Transport.style`)

#: the data planes of a transport that carries tensors inside its calls (gRPC, in-memory): fan-outs
FANOUT_PLANES: Mapping[str, str] = MappingProxyType({
    STAR_ROUND: "fedhop.server.sampled:ClientFanout",
    HIER_ROUND: "fedhop.server.sampled:EdgeFanout",
    EDGE_STEP: "fedhop.edge.aggregator:ClusterFanout",
})

#: the data planes of a transport with group collectives and peer sends (torch.distributed)
GROUP_PLANES: Mapping[str, str] = MappingProxyType({
    STAR_ROUND: "fedhop.server.group_rounds:GroupRounds",
    HIER_ROUND: "fedhop.server.group_rounds:HierGroupRounds",
    EDGE_STEP: "fedhop.edge.group_edge:GroupEdge",
})


@dataclass(frozen=True)
class Transport:
    """One transport kind: "module:attribute" of its endpoint builder, of its `Worlds` and of
    its data plane per concept (default: the fan-outs, tensors inside the calls), and what the
    rest of fedhop must know of it without naming it:

    - `style`: how it moves tensors, "fanout" (inside its calls) or "group" (collectives and peer
      sends): a topology's own data planes (`data_plane`'s `owned`) are chosen by it;
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
      (transports/inmemory/) deliver and count as gRPC frames them;
    - `listed`: where the kind stands in lists of kinds (messages, the reference): lower first;
    - `methods`: the transport's own protocol methods (common/wire/methods.py `Method`), declared
      into the method table when the entry is added (`add_transport`), as a topology's are by its
      spec.  The torch plane's torch_* methods are the core's (the group plane,
      common/transport/groups.py, names them for every transport).
    """

    endpoint: str   # a callable (node_id, ledger, **options) -> Endpoint
    worlds: str     # a Worlds instance
    planes: Mapping[str, str] = field(default_factory=lambda: FANOUT_PLANES)   # concept -> a class taking the role
    style: str = "fanout"
    params: str | None = None
    sums_in_collective: bool = False
    own_device: str | None = None
    one_process: bool = False
    handlers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    methods: tuple[Method, ...] = ()
    in_process: bool = False
    listed: int = 100
