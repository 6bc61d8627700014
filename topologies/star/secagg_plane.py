"""The star round with secure aggregation (docs/secure-aggregation.md): the sampled clients go
through SecAgg+'s four phases (one fan-out per phase, each its own method) instead of one train
call, and the round's result is one partial aggregate, the unmasked sum
(common/transport/secagg_round.py, the implementation an edge runs for its cluster too).
Under [privacy] (central or client mode) the masked inputs carry one more coordinate, each client's
clipped-count bit, and the partial its sum (common/privacy/secure_sum.py); the private
aggregate then noises the partial and sets the fixed denominator (common/privacy/mechanism.py).

A round without a sum records a `secagg_failed` event with the typed reason; the clients whose
calls failed are the round's failures (the others answered: the coordinator counts them as
returned, so the round is short as any round without results and run.on_short_round retries or
skips it)."""
from __future__ import annotations

from fedhop.common.privacy.secure_sum import extra_scalars, extras
from fedhop.common.security.secagg.settings import params_of
from fedhop.common.transport.fabric import Send
from fedhop.common.transport.secagg_round import secagg_round
from fedhop.common.util.nodeids import client_node
from fedhop.common.wire.message import Payload
from fedhop.server.driver import DriverContext
from fedhop.server.sampled import DataPlane, SampledRounds


class SecAggFanout(DataPlane):
    """Star over the fabric, one fan-out per SecAgg+ phase (module docstring)."""

    per_client = False

    def dispatch(self, round, sampled, message, arrivals):
        ctx = self.ctx
        store = ctx.records.store
        params = params_of(ctx.run.cfg.secure_aggregation, len(sampled), ctx.run.cfg.run.seed, ctx.run.cfg.compression)

        def target(cid: int, method: str, payload: Payload) -> Send:
            return Send(cid, ctx.nodes.client_home[cid].address, client_node(cid), method, payload,
                        who=f"round {round} {method} reply of client {cid}")

        out = secagg_round(ctx.fabric, params, round, sampled, message, target,
                           lambda cid: ctx.model.client_message(message, round, cid), round=round,
                           timeout=ctx.run.cfg.run.round_timeout, call_timeout=ctx.run.cfg.run.call_timeout,
                           extra=extras(ctx.run.cfg),   # [privacy]: b_i's coordinate
                           note=lambda line: store.add_event("secagg_phase", node="server", round=round, detail=line))
        if out.partial is None:
            store.add_event("secagg_failed", node="server", detail=out.failed or "", round=round)
            return {}, out.failures
        for cid, why in sorted(out.late.items()):
            store.add_event("secagg_late_dropout", node=client_node(cid), detail=why, round=round)
        out.partial.scalars.update(extra_scalars(out.extra_sums))   # [privacy]: sum_i b_i
        return {0: out.partial}, out.failures


def secagg_plane(ctx: DriverContext, rounds: SampledRounds) -> SecAggFanout | None:
    """The plane when the run asks for secure aggregation, else None (the transport's own)."""
    return SecAggFanout(ctx, rounds) if ctx.run.cfg.secure_aggregation.enabled else None
