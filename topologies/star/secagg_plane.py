"""The star round with secure aggregation (docs/secure-aggregation.md): the sampled clients go
through SecAgg+'s four phases (one fan-out per phase, each its own method) instead of one train
call, and the round's result is one partial aggregate, the unmasked sum.

Client `sampled[i]` is protocol id i.  A client whose call fails in a phase (dead process, error,
timeout) has dropped from that phase on; the server side (common/security/secagg/server.py)
recovers the exact sum while every secret keeps `threshold` live holders, and otherwise the round
has no result: a `secagg_failed` event names the typed reason, the clients whose calls failed are
the round's failures (the others answered: the coordinator counts them as returned, so the round is
short as any round without results and run.on_short_round retries or skips it).

The partial: the dequantized sum of the unmasked clients' deltas, with `weight` = `num_results` =
their number (uniform weighting: each weight is 1, so the weight needs no masking), which the
algorithm's server step reads as the mean of the deltas (common/wire/message.py, partial results).
Under [privacy] (central or client mode) the masked inputs carry one more coordinate, each client's
clipped-count bit, and the partial its sum (secagg_privacy.py); the private aggregate then noises
the partial and sets the fixed denominator (common/privacy/mechanism.py)."""
from __future__ import annotations

from fedhop.common.security.secagg.errors import SecAggFailure
from fedhop.common.security.secagg.server import SecAggServer
from fedhop.common.security.secagg.settings import params_of
from fedhop.common.transport.fabric import Send
from fedhop.common.util.nodeids import client_node
from fedhop.common.wire.message import COUNT_KEY, WEIGHT_KEY, Payload
from fedhop.server.driver import DriverContext
from fedhop.server.sampled import DataPlane, SampledRounds

from .secagg_privacy import extras, split_sum
from .secagg_wire import BY_PHASE, unflatten, unwrap, wrap

PHASES = ("advertise", "share", "masked", "unmask")


class SecAggFanout(DataPlane):
    """Star over the fabric, one fan-out per SecAgg+ phase (module docstring)."""

    per_client = False

    def dispatch(self, round, sampled, message, arrivals):
        ctx = self.ctx
        n = len(sampled)
        names = sorted(message.tensors)
        d = sum(message.tensors[k].numel() for k in names)
        params = params_of(ctx.run.cfg.secure_aggregation, n, ctx.run.cfg.run.seed, ctx.run.cfg.compression)
        problems = params.problems()   # a round sampled among fewer live clients than the config's
        if problems:
            why = f"SECAGG_PARAMETERS: {problems[0]} ({n} clients sampled)"
            ctx.records.store.add_event("secagg_failed", node="server", detail=why, round=round)
            return {}, {}
        server = SecAggServer(params, d + extras(ctx.run.cfg), round)   # [privacy]: b_i's coordinate (secagg_privacy.py)
        collect = {"advertise": server.collect_advertise, "share": server.collect_share,
                   "masked": server.collect_masked, "unmask": server.collect_unmask}
        make = {"advertise": server.advertise_requests, "share": server.share_requests,
                "masked": server.masked_requests, "unmask": server.unmask_requests}
        failures: dict[int, str] = {}
        late: dict[int, str] = {}   # dropped in unmasking: their inputs are in the sum
        result = None
        try:
            for phase in PHASES:
                requests = make[phase]()
                replies, failed = self._fan_out(round, phase, sampled, requests, message)
                for pos, why in failed.items():
                    (late if phase == "unmask" else failures)[sampled[pos]] = f"secagg {phase}: {why}"
                result = collect[phase](replies)
                ctx.records.store.add_event("secagg_phase", node="server", round=round,
                                    detail=f"{phase}: {len(replies)} of {len(requests)} clients replied")
        except SecAggFailure as exc:
            why = f"SECAGG_{exc.reason.upper()}: {exc.detail}"
            ctx.records.store.add_event("secagg_failed", node="server", detail=why, round=round)
            return {}, failures
        for cid, why in sorted(late.items()):
            ctx.records.store.add_event("secagg_late_dropout", node=client_node(cid), detail=why, round=round)
        assert result is not None
        m = len(result.clients)
        total, private = split_sum(result.total, m, d, params)
        partial = Payload(tensors=unflatten(total, message.tensors, names),
                          scalars={WEIGHT_KEY: float(m), COUNT_KEY: m, **private})
        return {0: partial}, failures

    def _fan_out(self, round: int, phase: str, sampled: list[int], requests: dict[int, bytes], message: Payload):
        """One phase's calls to the protocol ids in `requests`; replies and failures by protocol id."""
        ctx = self.ctx
        method = BY_PHASE[phase]
        sends = []
        for pos, raw in sorted(requests.items()):
            cid = sampled[pos]
            base = ctx.model.client_message(message, round, cid) if phase == "masked" else None
            sends.append(Send(pos, ctx.nodes.client_home[cid].address, client_node(cid), method, wrap(raw, base),
                              who=f"round {round} {method} reply of client {cid}"))
        timeout = ctx.run.cfg.run.round_timeout
        results, failures = ctx.fabric.send_and_receive(
            sends, round=round, timeout=timeout, call_timeout=ctx.run.cfg.run.call_timeout,
            timeout_reason=f"timeout: no {method} reply within run.round_timeout={timeout}s")
        replies = {}
        for pos, payload in results.items():
            try:
                replies[pos] = unwrap(payload)
            except ValueError as exc:
                failures[pos] = str(exc)
        return replies, failures


def secagg_plane(ctx: DriverContext, rounds: SampledRounds) -> SecAggFanout | None:
    """The plane when the run asks for secure aggregation, else None (the transport's own)."""
    return SecAggFanout(ctx, rounds) if ctx.run.cfg.secure_aggregation.enabled else None

