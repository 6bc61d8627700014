"""The relay topology: a data-weighted random walk relayed through the server (server/relay.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fedhop.common.topologies.chain import grpc_walk
from fedhop.common.topologies.spec import TopologySpec


@dataclass
class RelayParams:
    """A data-weighted random walk relayed through the server (server/relay.py): `hops_per_round`
    clients per round, each drawn with probability D_j / D_A (stream "chain", round).

    `hops_per_round`: clients visited per round
    """

    hops_per_round: int = field(default=10, metadata={"min": 1})


SPEC = TopologySpec(
    name="relay",
    params=RelayParams,
    check=grpc_walk,
    driver="fedhop.server.relay:RelayDriver",
)
