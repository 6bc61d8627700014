"""The star topology's server part: a round of sampled clients (server/sampled.py
`SampledRoundDriver`) whose data plane is the transport's STAR_ROUND class (a fan-out to the
sampled clients over gRPC, a group round over torch.distributed)."""
from __future__ import annotations

from fedhop.common.transport.factory import STAR_ROUND
from fedhop.server.driver import driver_kind
from fedhop.server.sampled import SampledRoundDriver


@driver_kind("star")
class StarDriver(SampledRoundDriver):
    concept = STAR_ROUND
