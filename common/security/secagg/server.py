"""The server's side of the four rounds: it relays the clients' keys and encrypted shares, collects
the masked inputs and reconstructs the secrets it needs to unmask their sum (Bonawitz et al. 2017,
Fig. 4; Bell et al. 2020 for the neighbour graph).

U1 ⊇ U2 ⊇ U3 ⊇ U4 are the clients that replied to each round.  The server checks after each round
that every secret it may need keeps at least t live holders among the owner's neighbours, and fails
(SecAggFailure, with the reason) as soon as one cannot; it never returns a sum it could not unmask
exactly.  Its unmasking plan asks, per client, for b_u when u ∈ U3 and for s_u^SK when u ∈ U2 minus
U3, never both (`plan_unmask` refuses an overlap)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import crypto, masks, messages, shamir
from .client import context
from .errors import (
    BAD_MESSAGE,
    NEIGHBOURHOOD_BELOW_THRESHOLD,
    TOO_FEW_CLIENTS,
    TOO_FEW_SHARES,
    SecAggFailure,
    SecAggRefusal,
)
from .graph import neighbours
from .params import SecAggParams


def plan_unmask(graph: dict[int, frozenset[int]], survivors: set[int], dropped: set[int]) -> dict[int, bytes]:
    """The unmasking request of every survivor v: (N(v) ∩ survivors, N(v) ∩ dropped).  A client in
    both sets would have both its secrets revealed: refused."""
    both = survivors & dropped
    if both:
        raise SecAggRefusal(f"clients {sorted(both)} both survived and dropped: revealing b_u and s_u^SK of one u")
    return {v: messages.unmask_request(sorted(graph[v] & survivors), sorted(graph[v] & dropped))
            for v in sorted(survivors)}


@dataclass
class Aggregate:
    """The unmasked result: the integer sum mod R of the quantized inputs of `clients` (U3)."""

    total: np.ndarray
    clients: list[int]


class SecAggServer:
    def __init__(self, params: SecAggParams, d: int, round_number: int = 0):
        problems = params.problems()
        if problems:
            raise ValueError(problems[0])
        self.params, self.d, self.round = params, d, round_number
        self.graph = neighbours(params.n, params.k, params.seed, round_number)
        self.u1: dict[int, tuple[bytes, bytes]] = {}      # advertised keys
        self.u2: dict[int, dict[int, bytes]] = {}         # sender -> {recipient: blob}
        self.u3: dict[int, np.ndarray] = {}               # masked inputs

    def _need(self, owners: set[int], live: set[int], phase: str) -> None:
        t = self.params.threshold
        if len(live) < t:
            raise SecAggFailure(TOO_FEW_CLIENTS, f"{len(live)} clients left after {phase}, threshold {t}")
        for u in sorted(owners):
            holders = len(self.graph[u] & live)
            if holders < t:
                raise SecAggFailure(NEIGHBOURHOOD_BELOW_THRESHOLD,
                                    f"client {u} has {holders} live neighbours after {phase}, threshold {t}")

    # round 0
    def advertise_requests(self) -> dict[int, bytes]:
        return {u: messages.advertise_request(self.round, u, self.params.n) for u in range(self.params.n)}

    def collect_advertise(self, replies: dict[int, bytes]) -> None:
        self.u1 = {u: messages.read_advertise_reply(raw) for u, raw in replies.items()}
        self._need(set(self.u1), set(self.u1), "advertise")

    # round 1
    def share_requests(self) -> dict[int, bytes]:
        return {u: messages.share_request({v: self.u1[v] for v in self.graph[u] if v in self.u1}) for u in self.u1}

    def collect_share(self, replies: dict[int, bytes]) -> None:
        self.u2 = {}
        for u, raw in replies.items():
            if u not in self.u1:
                raise SecAggFailure(BAD_MESSAGE, f"share reply from {u}, which did not advertise")
            sent = messages.read_blobs(raw, "share reply")
            expected = {v for v in self.graph[u] if v in self.u1}
            if set(sent) != expected:
                raise SecAggFailure(BAD_MESSAGE, f"client {u} shared to {sorted(sent)}, not {sorted(expected)}")
            self.u2[u] = sent
        self._need(set(self.u2), set(self.u2), "share")

    # round 2
    def masked_requests(self) -> dict[int, bytes]:
        """Each client of U2 gets the blobs its neighbours in U2 addressed to it."""
        return {v: messages.blobs({u: self.u2[u][v] for u in self.graph[v] if u in self.u2}) for v in self.u2}

    def collect_masked(self, replies: dict[int, bytes]) -> None:
        self.u3 = {}
        for u, raw in replies.items():
            if u not in self.u2:
                raise SecAggFailure(BAD_MESSAGE, f"masked input from {u}, which did not share")
            self.u3[u] = messages.read_masked_reply(raw, self.d, self.params.modulus_bits)
        self._need(set(self.u2), set(self.u3), "masked input")

    # round 3
    def unmask_requests(self) -> dict[int, bytes]:
        return plan_unmask(self.graph, set(self.u3), set(self.u2) - set(self.u3))

    def collect_unmask(self, replies: dict[int, bytes]) -> Aggregate:
        """Reconstruct b_u (u ∈ U3) and s_u^SK (u ∈ U2 minus U3) from the U4 replies, then unmask."""
        got: dict[int, dict[int, np.ndarray]] = {}            # owner -> {holder's point: share}
        for v, raw in replies.items():
            if v not in self.u3:
                raise SecAggFailure(BAD_MESSAGE, f"unmasking reply from {v}, which sent no masked input")
            for owner, share in messages.read_unmask_reply(raw).items():
                got.setdefault(owner, {})[v + 1] = share
        t, bits, ctx = self.params.threshold, self.params.modulus_bits, context(self.round)
        survivors, dropped = set(self.u3), set(self.u2) - set(self.u3)
        for u in sorted(survivors | dropped):
            if len(got.get(u, {})) < t:
                raise SecAggFailure(TOO_FEW_SHARES, f"{len(got.get(u, {}))} shares of client {u}'s secret, threshold {t}")
        self_seeds = {u: shamir.reconstruct(got[u], t, messages.SECRET_BYTES) for u in survivors}
        pairs = []
        for u in sorted(dropped):
            sk = crypto.private_from_bytes(shamir.reconstruct(got[u], t, messages.SECRET_BYTES))
            if crypto.public_bytes(sk) != self.u1[u][1]:
                raise SecAggFailure(TOO_FEW_SHARES, f"client {u}'s reconstructed key does not match its public key")
            pairs += [(v, u, crypto.agree(sk, self.u1[v][1], crypto.MASK_LABEL, ctx))
                      for v in sorted(self.graph[u] & survivors)]
        total = masks.unmask(self.u3, self_seeds, pairs, self.d, bits)
        return Aggregate(total, sorted(survivors))
