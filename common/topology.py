"""Topologies as data: which edge serves which clients, and each topology's own keys.

A topology is a `[topology]` config section.  Its common keys are `kind`, `edges` and
`assignment`; the keys that only one kind has live in that kind's params dataclass below and
are validated by the config loader (`register_options_schema("topology", "kind", ...)`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.rng import numpy_stream


@dataclass
class StarParams:
    pass


@dataclass
class HierarchicalParams:
    """HierFAVG (Liu et al. 2020): clients run kappa1 = `algorithm.local_steps` steps between
    edge aggregations; the server aggregates every `kappa2` edge aggregations."""

    kappa2: int = field(default=1, metadata={"min": 1})
    edges_per_round: int = field(default=0, metadata={"min": 0})  # 0 = every edge; else a seeded sample


TOPOLOGY_PARAMS: dict[str, type | None] = {
    "star": StarParams,
    "hierarchical": HierarchicalParams,
}


def topology_params_class(kind: str) -> type | None:
    return TOPOLOGY_PARAMS.get(kind)


def topology_params(cfg: Any) -> Any:
    """The validated params of cfg.topology (built from `options` if the loader did not)."""
    params = getattr(cfg.topology, "params", None)
    if params is not None:
        return params
    cls = topology_params_class(cfg.topology.kind)
    return cls(**cfg.topology.options) if cls is not None else None


def edge_node(edge: int) -> str:
    return f"edge-{edge}"


def edge_index(node_id: str) -> int:
    role, _, num = node_id.partition("-")
    if role != "edge" or not num.isdigit():
        raise ValueError(f"'{node_id}' is not an edge node id (expected edge-<n>)")
    return int(num)


def cluster_assignment(cfg: Any) -> list[list[int]]:
    """Client ids per edge.

    `assignment = "blocks"`: contiguous blocks of ids (edge e gets the e-th block; sizes differ
    by at most one).  `"shuffled"`: the same after a seeded permutation (stream
    "topology/assignment").  A list of lists: exactly those clients per edge.
    """
    count, edges = cfg.clients.count, cfg.topology.edges
    spec = cfg.topology.assignment
    if isinstance(spec, list):
        return [sorted(int(c) for c in group) for group in spec]
    if edges < 1:
        raise ValueError(f"topology.edges must be >= 1 for topology.kind = '{cfg.topology.kind}'")
    ids = list(range(count))
    if spec == "shuffled":
        ids = [int(i) for i in numpy_stream(cfg.run.seed, "topology/assignment").permutation(count)]
    elif spec != "blocks":
        raise ValueError(f"topology.assignment: got '{spec}', allowed: blocks, shuffled, or a list of client lists")
    base, extra = divmod(count, edges)
    out, start = [], 0
    for e in range(edges):
        size = base + (1 if e < extra else 0)
        out.append(sorted(ids[start:start + size]))
        start += size
    return out
