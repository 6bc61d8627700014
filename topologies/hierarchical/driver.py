"""The hierarchical topology's server part (HierFAVG, Liu et al. 2020): a round of sampled
clients (server/sampled.py `SampledRoundDriver`) whose data plane is the transport's HIER_ROUND
class, one call (or group round) per edge of the sampled clients; each edge runs its kappa2
edge iterations (edge/aggregator.py) and answers with one partial aggregate."""
from __future__ import annotations

from fedhop.common.transport.factory import HIER_ROUND
from fedhop.server.driver import driver_kind
from fedhop.server.sampled import SampledRoundDriver


@driver_kind("hierarchical")
class HierarchicalDriver(SampledRoundDriver):
    concept = HIER_ROUND
