"""The star topology: every client process under the server, sampled rounds (server/sampled.py)."""
from __future__ import annotations

from dataclasses import dataclass

from fedhop.common.topologies.spec import TopologySpec


@dataclass
class StarParams:
    pass


SPEC = TopologySpec(
    name="star",
    params=StarParams,
    driver="fedhop.server.sampled:StarDriver",
    plan="fedhop.common.topologies.plan:star_plan",
    robust="round",
    engine_rounds=True,
    coded_broadcasts=True,   # the server's fan-out codes each process's train message (compression.down)
)
