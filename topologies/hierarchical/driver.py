"""The hierarchical topology's server part (HierFAVG, Liu et al. 2020): a round of sampled
clients (server/sampled.py `SampledRoundDriver`) whose data plane is the transport's HIER_ROUND
class, one call (or group round) per edge of the sampled clients; each edge runs its kappa2
edge iterations (edge/aggregator.py) and answers with one partial aggregate.  With
`[secure_aggregation] enabled` each edge runs SecAgg+ for its cluster (secagg_edge.py) and an
edge whose protocol round had no sum is recorded as a `secagg_failed` event (`SecAggVerdicts`)."""
from __future__ import annotations

import re

from fedhop.common.transport.factory import HIER_ROUND
from fedhop.common.transport.secagg_round import FAILED
from fedhop.server.driver import DriverContext, driver_kind
from fedhop.server.sampled import DataPlane, SampledRoundDriver, SampledRounds

# a client's failure when its edge failed (server/sampled.py EdgeFanout): "edge NODE failed: ... replied CODE: why",
# why ending in secagg_edge.py's "clients dropped: [ids])"
EDGE_FAILED = re.compile(r"^edge (\S+) failed: .*? replied " + FAILED + r": (.*\(.*; clients dropped: \[([\d, ]*)\]\))$", re.S)


class SecAggVerdicts(DataPlane):
    """The transport's HIER_ROUND plane, with each edge's failed SecAgg+ round recorded as a
    `secagg_failed` event naming the edge and the typed reason.  As in the star, a failed round's
    failures are the clients that dropped; the edge's others answered (so the round is short as
    any round without results, and run.on_short_round retries or skips it)."""

    def __init__(self, ctx: DriverContext, rounds: SampledRounds, inner: DataPlane) -> None:
        super().__init__(ctx, rounds)
        self.inner = inner
        self.per_client = inner.per_client

    def dispatch(self, round, sampled, message, arrivals):
        results, failures = self.inner.dispatch(round, sampled, message, arrivals)
        verdicts: dict[str, str] = {}
        for cid, why in list(failures.items()):
            found = EDGE_FAILED.match(why)
            if found is None:
                continue
            verdicts[found.group(1)] = found.group(2)
            if str(cid) not in found.group(3).replace(" ", "").split(","):
                del failures[cid]   # it answered every phase it was asked
        for node_id, why in sorted(verdicts.items()):
            self.ctx.records.store.add_event("secagg_failed", node=node_id, detail=why, round=round)
        return results, failures


@driver_kind("hierarchical")
class HierarchicalDriver(SampledRoundDriver):
    concept = HIER_ROUND

    def start(self) -> None:
        super().start()
        if self.ctx.run.cfg.secure_aggregation.enabled and self.plane is not None:
            self.plane = SecAggVerdicts(self.ctx, self.rounds, self.plane)
