"""A topology-driver plug-in: the star topology with clients taken in turn instead of at random.

Round r (from 1) of a run with N clients and k = clients.per_round takes the k clients

    (start + (r - 1) k + j) mod N,   j = 0, ..., k - 1

so every client is served once every ceil(N / k) rounds whatever the seed.  Everything else
is the star round (server/sampled.py): the same message, fan-out, aggregation and server step.
The process plan is the star plan (the driver declares no `process_plan`), so each client process
registers with the server.  Unlike the built-in sampling, a client of a process the server knows
dead is still drawn in its turn (its result is then a failure of the round).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fedhop.common.config import resolve_clients_per_round
from fedhop.topologies.star.driver import StarDriver


@dataclass
class RoundRobinParams:
    start: int = field(default=0, metadata={"min": 0})   # [topology] start = ...: the first client of round 1


class RoundRobinStar(StarDriver):
    Params = RoundRobinParams

    def sample(self, round: int) -> list[int]:
        cfg = self.ctx.run.cfg
        n, k = cfg.clients.count, resolve_clients_per_round(cfg)
        first = cfg.topology.params.start + (round - 1) * k
        return sorted({(first + j) % n for j in range(k)})
