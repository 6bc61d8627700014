"""The sequential topology (Fed-CHS, Yan et al., Algorithm 1; docs/topologies.md): edges on a
graph pass one model (server/sequential.py, edge/sequential.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fedhop.common.topologies.spec import TopologySpec
from fedhop.common.wire.methods import NEIGHBOUR, PARENT, Method

# the sequential topology's protocol methods (an edge serves them, edge/sequential.py)
SEQ_ROUND = Method("seq_round", {PARENT})                 # the token holder's round
SEQ_HANDOFF = Method("seq_handoff", {NEIGHBOUR})          # the model w^{t+1} to the next edge (link edge-edge)
SEQ_FINAL = Method("seq_final", {PARENT}, request="empty")   # torch: the final model as a dist.send
SEQ_QUERY = Method("control.seq_query", {PARENT, NEIGHBOUR}, "control", request="empty")   # visit count c(m), D_A,m
SEQ_RESTORE = Method("control.seq_restore", {PARENT}, "control", request="per_client")    # a resumed run's visit count


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


SPEC = TopologySpec(
    name="sequential",
    params=SequentialParams,
    driver="fedhop.server.sequential:SequentialDriver",
    plan="fedhop.common.topologies.plan:edge_plan",
    edge_role="fedhop.edge.sequential:SequentialEdge",
    edges=True,
    sequential_algorithms=True,
    peer_link="edge-edge",
    peer_note="sent to neighbour edges",
    methods=(SEQ_ROUND, SEQ_HANDOFF, SEQ_FINAL, SEQ_QUERY, SEQ_RESTORE),
)
