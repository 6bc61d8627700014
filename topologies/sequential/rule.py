"""The sequential topology's graph of edges and its first holder (Fed-CHS, Yan et al., Algorithm 1):
the edge graph from `topology.graph` (a ring, a seeded random connected graph or adjacency
lists) and m(0) from `topology.start` (an id, or uniform from the stream "topology/start")."""
from __future__ import annotations

from typing import Any

from fedhop.common.topologies.graphs import check_graph, connected, random_graph, topology_params
from fedhop.common.util.rng import numpy_stream


def edge_graph(cfg: Any) -> list[list[int]]:
    """The edge graph of a sequential run as sorted adjacency lists (validated)."""
    params = topology_params(cfg)
    num = cfg.topology.edges
    spec = params.graph
    if isinstance(spec, list):
        if len(spec) != num:
            raise ValueError(f"topology.graph: {len(spec)} adjacency lists for topology.edges = {num}")
        return check_graph(spec, num, "topology.graph", "edge ids")
    if spec == "ring":
        adj = [sorted({(e - 1) % num, (e + 1) % num} - {e}) for e in range(num)]
    elif spec == "random":
        adj = random_graph(num, params.max_degree, cfg.run.seed)
    else:
        raise ValueError(f"topology.graph: got {spec!r}, allowed: \"ring\", \"random\" or adjacency lists [[1, 2], ...]")
    if not connected(adj):
        raise ValueError(f"topology.graph: the edge graph {adj} is not connected")
    return adj


def start_edge(cfg: Any) -> int:
    """m(0): `topology.start` as given, or uniform from the stream "topology/start"."""
    start = topology_params(cfg).start
    num = cfg.topology.edges
    if start == "random":
        return int(numpy_stream(cfg.run.seed, "topology/start").integers(num))
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < num:
        raise ValueError(f"topology.start: got {start!r}, allowed: \"random\" or an edge id 0..{num - 1}")
    return start
