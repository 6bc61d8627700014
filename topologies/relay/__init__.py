"""The relay topology: a data-weighted random walk relayed through the server (driver.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fedhop.common.topologies.checks import per_client_calls
from fedhop.common.topologies.spec import TopologySpec


@dataclass
class RelayParams:
    """A data-weighted random walk relayed through the server (topologies/relay/driver.py): `hops_per_round`
    clients per round, each drawn with probability D_j / D_A (stream "chain", round).

    `hops_per_round`: clients visited per round
    """

    hops_per_round: int = field(default=10, metadata={"min": 1})


SPEC = TopologySpec(
    name="relay",
    listed=4,
    params=RelayParams,
    check=per_client_calls,
    driver="fedhop.topologies.relay.driver:RelayDriver",
    ef21_uploads=False,   # each hop's reply is decoded by the driver, which keeps no sender's EF21 estimate
)
