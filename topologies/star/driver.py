"""The star topology's server part: a round of sampled clients (server/sampled.py
`SampledRoundDriver`) whose data plane is the transport's STAR_ROUND class (a fan-out to the
sampled clients over gRPC, a group round over torch.distributed)."""
from __future__ import annotations

from fedhop.common.transport.factory import STAR_ROUND
from fedhop.server.driver import driver_kind
from fedhop.server.sampled import SampledRoundDriver

from .secagg_plane import secagg_plane


@driver_kind("star")
class StarDriver(SampledRoundDriver):
    concept = STAR_ROUND

    def start(self) -> None:
        """The transport's fan-out, or with `[secure_aggregation] enabled` SecAgg+'s four phases
        (secagg_plane.py)."""
        super().start()
        self.plane = secagg_plane(self.ctx, self.rounds) or self.plane
