"""The star topology: every client process under the server, sampled rounds (driver.py on server/sampled.py)."""
from __future__ import annotations

from dataclasses import dataclass

from fedhop.common.topologies.spec import TopologySpec
from fedhop.common.wire.methods import SECAGG_METHODS


@dataclass
class StarParams:
    pass


SPEC = TopologySpec(
    name="star",
    listed=0,
    params=StarParams,
    driver="fedhop.topologies.star.driver:StarDriver",
    plan="fedhop.common.topologies.plan:star_plan",
    robust="round",
    engine_rounds=True,
    coded_broadcasts=True,   # the server's fan-out codes each process's train message (compression.down)
    # secure aggregation's four phases ([secure_aggregation], secagg_plane.py; the clients' side client/secagg.py)
    methods=SECAGG_METHODS,
    client_handlers=("fedhop.client.secagg:secagg_handlers",),
)
