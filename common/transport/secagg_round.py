"""One SecAgg+ round over the fabric, run by an aggregator for the clients under it: the star's
server for a round's sampled clients (topologies/star/secagg_plane.py), an edge for its cluster's
(topologies/hierarchical/secagg_edge.py).  Both run this one implementation; they differ only in
where a client's calls go (`Target`) and where the round's notes are written.

Client `sampled[i]` is protocol id i.  Each phase is one fan-out under the phase's own method
(common/wire/methods.py); a client whose call fails in a phase (dead process, error,
timeout) has dropped from that phase on, and the server side (common/security/secagg/server.py)
recovers the exact sum while every secret keeps `threshold` live holders.  Otherwise, or when the
round's clients are too few for the parameters, there is no sum: `Outcome.failed` is the typed
reason line ("SECAGG_<REASON>: detail").

The partial: the dequantized sum of the unmasked clients' deltas, with `weight` = `num_results` =
their number (uniform weighting: each weight is 1, so the weight needs no masking), which the
algorithm's server step reads as the mean of the deltas (common/wire/message.py, partial results)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fedhop.common.security.secagg.errors import SecAggFailure
from fedhop.common.security.secagg.messages import PHASES
from fedhop.common.security.secagg.params import SecAggParams
from fedhop.common.security.secagg.server import Aggregate, SecAggServer
from fedhop.common.transport.fabric import Fabric, Send
from fedhop.common.wire.message import COUNT_KEY, WEIGHT_KEY, Payload

from .secagg_wire import BY_PHASE, unflatten, unwrap, wrap

FAILED = "SECAGG_FAILED"   # the error code of an edge round whose SecAgg+ round has no sum

#: (client id, method, payload) -> the Send that carries it to the client
Target = Callable[[int, str, Payload], Send]


@dataclass
class Outcome:
    """What one round gives its aggregator: the partial (None when it failed), the clients that
    dropped before unmasking (the round's failures) and in unmasking (`late`: their inputs are in
    the sum) and the typed reason of a failed round."""

    partial: Payload | None = None
    failures: dict[int, str] = field(default_factory=dict)
    late: dict[int, str] = field(default_factory=dict)
    failed: str | None = None
    extra_sums: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))   # of the `extra` coordinates


def protocol_round(round: int, step: int, steps: int) -> int:
    """The protocol's round number (it binds keys and blobs, seeds the graph and the rounding) of
    edge iteration `step` of `steps` in server round `round`: (round - 1) * steps + step + 1, so
    with one iteration per round it is the round itself and no two iterations share one."""
    return (round - 1) * steps + step + 1


def secagg_round(fabric: Fabric, params: SecAggParams, number: int, sampled: list[int], message: Payload,
                 target: Target, model_for: Callable[[int], Payload], *, round: int, timeout: float,
                 call_timeout: float, note: Callable[[str], None] = lambda line: None, extra: int = 0) -> Outcome:
    """The four phases with `sampled` (params.n of them); `model_for(client)`: the model its
    masked-input request carries; `round`: the run's round (the calls' envelope); `note` is
    told each phase as it completes ("share: 6 of 6 clients replied"); `extra`: integer
    coordinates each masked input carries after the update (common/privacy/secure_sum.py
    `extras`), whose unmasked sums are `Outcome.extra_sums`."""
    out = Outcome()
    problems = params.problems()   # a round sampled among fewer live clients than the config's
    if problems:
        out.failed = f"SECAGG_PARAMETERS: {problems[0]} ({params.n} clients)"
        return out
    names = sorted(message.tensors)
    d = sum(message.tensors[k].numel() for k in names)
    server = SecAggServer(params, d + extra, number)
    steps = {"advertise": (server.advertise_requests, server.collect_advertise),
             "share": (server.share_requests, server.collect_share),
             "masked": (server.masked_requests, server.collect_masked),
             "unmask": (server.unmask_requests, server.collect_unmask)}
    result: Aggregate | None = None
    try:
        for phase in PHASES:
            make, collect = steps[phase]
            requests = make()
            method = BY_PHASE[phase]
            sends = [target(sampled[pos], method, wrap(raw, model_for(sampled[pos]) if phase == "masked" else None))
                     for pos, raw in sorted(requests.items())]
            by_client = {cid: pos for pos, cid in enumerate(sampled)}
            results, failed = fabric.send_and_receive(
                sends, round=round, timeout=timeout, call_timeout=call_timeout,
                timeout_reason=f"timeout: no {method} reply within {timeout}s")
            replies = {}
            for cid, payload in results.items():
                try:
                    replies[by_client[cid]] = unwrap(payload)
                except ValueError as exc:
                    failed[cid] = str(exc)
            for cid, why in failed.items():
                (out.late if phase == "unmask" else out.failures)[cid] = f"secagg {phase}: {why}"
            result = collect(replies)
            note(f"{phase}: {len(replies)} of {len(requests)} clients replied")
    except SecAggFailure as exc:
        out.failed = f"SECAGG_{exc.reason.upper()}: {exc.detail}"
        return out
    assert result is not None
    m = len(result.clients)
    total = params.integer_code.decode_sum(result.total[:d], m)
    out.extra_sums = np.asarray(result.total[d:])
    out.partial = Payload(tensors=unflatten(total, message.tensors, names), scalars={WEIGHT_KEY: float(m), COUNT_KEY: m})
    return out
