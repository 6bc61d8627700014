"""The hierarchical topology (HierFAVG, Liu et al. 2020): edges between the server and their
clusters of clients (driver.py `HierarchicalDriver`, edge/aggregator.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedhop.common.topologies.spec import TopologySpec
from fedhop.common.wire.methods import SECAGG_METHODS


@dataclass
class HierarchicalParams:
    """HierFAVG (Liu et al. 2020): clients run kappa1 = `algorithm.local_steps` steps between
    edge aggregations; the server aggregates every `kappa2` edge aggregations.

    `kappa2`: edge aggregations per server aggregation (one round)
    """

    kappa2: int = field(default=1, metadata={"min": 1})
    # 0: every edge takes part. k > 0: each round k edges are drawn (`round_edges`) and the
    # round's clients are sampled among theirs (partial participation of edge servers)
    edges_per_round: int = field(default=0, metadata={"min": 0})


def check(cfg: Any) -> None:
    """edges_per_round within the run's edges (kappa2 > 1 only for an algorithm with an edge step:
    the loader checks that, as `edge_steps_key` says)."""
    from fedhop.common.topologies.graphs import topology_params
    params = topology_params(cfg)
    topo = cfg.topology
    edges_per_round = getattr(params, "edges_per_round", 0)
    edges = len(topo.assignment) if isinstance(topo.assignment, list) else topo.edges
    if edges_per_round > edges:
        raise ValueError(f"topology.edges_per_round: got {edges_per_round}, but the run has {edges} edges "
                         f"(0 = every edge)")


SPEC = TopologySpec(
    name="hierarchical",
    listed=1,
    params=HierarchicalParams,
    check=check,
    edge_steps_key="kappa2",
    driver="fedhop.topologies.hierarchical.driver:HierarchicalDriver",
    plan="fedhop.common.topologies.plan:edge_plan",
    edges=True,
    robust="edge",
    coded_broadcasts=True,   # edge_round messages from the server, train messages from each edge (compression.down)
    # secure aggregation behind edges: each edge runs SecAgg+'s four phases for its cluster
    # ([secure_aggregation], secagg_edge.py; the clients' side client/secagg.py)
    methods=SECAGG_METHODS,
    edge_role="fedhop.topologies.hierarchical.secagg_edge:SecAggEdge",
    client_handlers=("fedhop.client.secagg:secagg_handlers",),
)
