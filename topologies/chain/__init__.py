"""The chain topology (WRWGD): one model walks a graph of clients, handed client to client.

The folder: this spec and its protocol methods; rule.py, the walk's law and step; driver.py,
the server's control plane; client.py, a client process's part (the visit and the hand-off)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedhop.common.topologies.checks import per_client_calls
from fedhop.common.topologies.spec import TopologySpec
from fedhop.common.wire.methods import PARENT, PEER, Method

# algorithms whose client reply is a model update Delta the WRWGD walk can apply (rule.py)
WALK_ALGORITHMS = ("fedavg", "fedprox")

# the chain topology's protocol methods (a client process serves them, client.py `walk_handlers`)
WALK_VISIT = Method("walk_visit", {PARENT})       # the holder's visit: local steps, the draw, the hand-off
WALK_HANDOFF = Method("walk_handoff", {PEER})     # the walking model to the next client (link client-client)


@dataclass
class ChainParams:
    """WRWGD: one model walks a graph of clients, handed client to client (topologies/chain/rule.py).

    `graph`: "random" (seeded, connected, degrees <= `max_degree`), "ring", "complete", or
    adjacency lists ("complete" at any size: its rows are made as a hop needs them).  `stationary`: the
    walk's law pi ("data", "uniform" or per-client weights such as smoothness constants L_i).  `objective`: the weights p of F = sum p_i f_i
    ("uniform", the paper's 1/N, or "data").  `start`: the first client, an id or "random".
    `hops_per_round`: visits per round; each runs `algorithm.local_steps` local steps.

    `max_degree`: the largest degree of graph = "random"
    """

    graph: str | list = "random"
    max_degree: int = field(default=3, metadata={"min": 1})
    stationary: str | list = "data"
    objective: str | list = "uniform"
    start: int | str = "random"
    hops_per_round: int = field(default=10, metadata={"min": 1})


def check(cfg: Any) -> None:
    per_client_calls(cfg)
    if cfg.algorithm.name not in WALK_ALGORITHMS:
        raise ValueError(f"algorithm.name: got '{cfg.algorithm.name}', but topology.kind = 'chain' (WRWGD) steps the "
                         f"walking model by the visited client's local update (allowed: {', '.join(WALK_ALGORITHMS)})")
    from fedhop.common.topologies.graphs import topology_params
    from fedhop.topologies.chain.rule import WalkRule, start_client  # local: they read the validated topology params
    WalkRule.from_config(cfg, [1] * cfg.clients.count)   # the graph and the weights' lengths
    start_client(topology_params(cfg).start, cfg.clients.count, cfg.run.seed)   # an id in range, or "random"


SPEC = TopologySpec(
    name="chain",
    listed=3,
    coded_uploads=False,   # the walking model moves by walk_visit / walk_handoff
    params=ChainParams,
    check=check,
    driver="fedhop.topologies.chain.driver:WalkDriver",
    client_handlers=("fedhop.topologies.chain.client:walk_handlers",),
    peer_link="client-client",
    peer_note="hops between clients",
    methods=(WALK_VISIT, WALK_HANDOFF),
)
