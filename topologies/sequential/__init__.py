"""The sequential topology (Fed-CHS, Yan et al., Algorithm 1; docs/topologies.md): edges on a
graph pass one model.

The folder: this spec and its protocol methods; rule.py, the edge graph and the first holder;
driver.py, the server's control plane; edge.py, an edge's part (the round, the neighbour query,
the hand-off); group_paths.py, the model path over a transport with groups (torch.distributed).
How the model moves is this topology's own data plane, one class per transport style
(`SERVER_PATHS`, `EDGE_PATHS`, passed to common/transport/factory.py `data_plane`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedhop.common.topologies.spec import TopologySpec
from fedhop.common.wire.methods import NEIGHBOUR, PARENT, Method

# the sequential topology's protocol methods (an edge serves them, edge.py)
SEQ_ROUND = Method("seq_round", {PARENT})                 # the token holder's round
SEQ_HANDOFF = Method("seq_handoff", {NEIGHBOUR})          # the model w^{t+1} to the next edge (link edge-edge)
SEQ_FINAL = Method("seq_final", {PARENT}, request="empty")   # torch: the final model as a dist.send
SEQ_QUERY = Method("control.seq_query", {PARENT, NEIGHBOUR}, "control", request="empty")   # visit count c(m), D_A,m
SEQ_RESTORE = Method("control.seq_restore", {PARENT}, "control", request="per_client")    # a resumed run's visit count

# this topology's data planes: how Fed-CHS's model reaches and leaves the server, and moves at an
# edge, per transport style (common/transport/factory.py `Transport.style`)
SEQ_SERVER_PATH = "sequential server path"
SEQ_EDGE_PATH = "sequential edge path"
SERVER_PATHS = {"fanout": "fedhop.topologies.sequential.driver:ServerInlineModelPath",
                "group": "fedhop.topologies.sequential.group_paths:GroupSequentialPath"}
EDGE_PATHS = {"fanout": "fedhop.topologies.sequential.edge:EdgeInlineModelPath",
              "group": "fedhop.topologies.sequential.group_paths:GroupModelPath"}


@dataclass
class SequentialParams:
    """Fed-CHS (Yan et al., Algorithm 1; docs/topologies.md): edges on a graph pass one model.

    `graph`: "ring", "random" (a seeded connected graph with degrees <= `max_degree`, stream
    "topology/graph"), or explicit adjacency lists [[1, 4], [0, 2], ...] (undirected).
    `start`: the first edge m(0), an id or "random" (uniform, stream "topology/start").
    `steps_per_round`: K, the edge's aggregations per round.  `count_start`: false = the paper's
    literal pseudocode (c(m(0)) stays 0 until the walk returns), true = the start edge counts
    its first visit.

    `max_degree`: the largest degree of graph = "random"
    """

    graph: str | list = "ring"
    max_degree: int = field(default=3, metadata={"min": 1})
    start: int | str = "random"
    steps_per_round: int = field(default=20, metadata={"min": 1})
    count_start: bool = False


def check(cfg: Any) -> None:
    """What the loader refuses for a sequential run, before any process starts: an algorithm whose
    model does not walk the edges (the driver would fail the run at its first round), and a graph
    or first edge that cannot be (rule.py's refusals: "topology.graph: ...", "topology.start: ...")."""
    from fedhop.common.algorithms import algorithm_class, registry  # local: the registry imports torch
    try:
        sequential = bool(getattr(algorithm_class(cfg.algorithm.name), "sequential", False))
    except (KeyError, ValueError):   # an unknown name: the algorithm's own check names it
        sequential = True
    if not sequential:
        allowed = ", ".join(sorted(n for n, c in registry().items() if getattr(c, "sequential", False)))
        raise ValueError(f"algorithm.name: got '{cfg.algorithm.name}', but topology.kind = 'sequential' (Fed-CHS) "
                         f"passes one model along the edges, which needs an algorithm that walks it (allowed: "
                         f"{allowed})")
    from fedhop.topologies.sequential.rule import edge_graph, start_edge
    edge_graph(cfg)
    start_edge(cfg)


SPEC = TopologySpec(
    name="sequential",
    check=check,
    listed=2,
    params=SequentialParams,
    driver="fedhop.topologies.sequential.driver:SequentialDriver",
    plan="fedhop.common.topologies.plan:edge_plan",
    edge_role="fedhop.topologies.sequential.edge:SequentialEdge",
    edges=True,
    sequential_algorithms=True,
    peer_link="edge-edge",
    peer_note="sent to neighbour edges",
    methods=(SEQ_ROUND, SEQ_HANDOFF, SEQ_FINAL, SEQ_QUERY, SEQ_RESTORE),
)
