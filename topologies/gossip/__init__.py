"""The gossip topology (D-PSGD, Lian et al. 2017): clients on a graph mix their models with their
neighbours' every round.

The folder: this spec and its protocol methods; rule.py, the graph and the mixing weights;
driver.py, the server's control plane; client.py, a client process's part."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedhop.common.topologies.spec import TopologySpec
from fedhop.common.wire.methods import PARENT, PEER, Method

# the gossip topology's protocol methods (a client process serves them, client.py `gossip_handlers`)
GOSSIP_STEP = Method("gossip_step", {PARENT})     # a logical client's local steps from its own model
GOSSIP_SEND = Method("gossip_send", {PARENT})     # the process's post-step models to their graph neighbours
GOSSIP_SHARE = Method("gossip_share", {PEER})     # one post-step model to a neighbour (link client-client)
GOSSIP_MIX = Method("gossip_mix", {PARENT})       # the Metropolis-Hastings average (the model up at evaluations)


@dataclass
class GossipParams:
    """D-PSGD gossip learning: clients on a graph mix their models with their neighbours'
    (Metropolis-Hastings weights) every round (topologies/gossip/rule.py).

    `gossip_edges`: the graph's undirected edges [[0, 1], [1, 2], ...] between client ids.
    `gossip_degree`: d > 0 instead: a random d-regular graph from the stream
    "topology/gossip_graph" of run.seed (drawn once in each process, and the processes `fedhop run`
    forks start with it drawn: about 4 s with its weights at 1,000,000 clients, d = 4).  Neither: the ring
    0-1-...-(n-1)-0.
    """

    gossip_edges: list = field(default_factory=list)
    gossip_degree: int = field(default=0, metadata={"min": 0})


def check(cfg: Any) -> None:
    if cfg.transport.kind != "grpc":
        raise ValueError(f"transport.kind: got '{cfg.transport.kind}', but gossip exchanges each client's model with "
                         f"its neighbours in peer calls (allowed: grpc)")
    from fedhop.topologies.gossip.rule import check_config  # local: the gossip rule reads the validated params
    check_config(cfg)


SPEC = TopologySpec(
    name="gossip",
    listed=5,
    coded_uploads=False,   # models move by the gossip methods
    params=GossipParams,
    check=check,
    driver="fedhop.topologies.gossip.driver:GossipDriver",
    client_handlers=("fedhop.topologies.gossip.client:gossip_handlers",),
    peer_link="client-client",
    peer_note="models to graph neighbours",
    methods=(GOSSIP_STEP, GOSSIP_SEND, GOSSIP_SHARE, GOSSIP_MIX),
)
