"""The four rounds in one process, with dropouts injected at every phase, and the bytes of every
message (the length of the bytes actually built, per phase, per client, each way).

`drop[phase]` is the set of clients that receive that phase's request and never reply (a client
that dropped stays dropped).  Used by the tests and by benchmarks/secagg_bytes.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .client import SecAggClient
from .messages import PHASES
from .params import SecAggParams
from .server import Aggregate, SecAggServer


@dataclass
class Simulation:
    aggregate: Aggregate
    clients: dict[int, SecAggClient]
    server: SecAggServer
    down: dict[str, dict[int, int]] = field(default_factory=dict)   # phase -> client -> request bytes
    up: dict[str, dict[int, int]] = field(default_factory=dict)     # phase -> client -> reply bytes
    relayed: dict[str, dict[int, bytes]] = field(default_factory=dict)   # phase -> client -> request as sent
    replies: dict[str, dict[int, bytes]] = field(default_factory=dict)   # phase -> client -> reply as sent


def simulate_round(params: SecAggParams, updates: dict[int, np.ndarray], drop: dict[str, set[int]] | None = None,
                   round_number: int = 0, stop_before: str | None = None, bound: float | None = None,
                   extras: dict[int, np.ndarray] | None = None) -> Simulation:
    """Run the rounds (up to `stop_before`, a phase, when given); raises SecAggFailure when the
    dropouts exceed what the threshold recovers.  `bound` and `extras`: SecAggClient.masked's (the
    L2 bound before quantization; integer coordinates appended to each client's input)."""
    drop = drop or {}
    extras = extras or {}
    d = next(iter(updates.values())).shape[0] + (len(next(iter(extras.values()))) if extras else 0)
    server = SecAggServer(params, d, round_number)
    clients = {u: SecAggClient(params) for u in range(params.n)}
    sim = Simulation(aggregate=Aggregate(np.zeros(0, np.uint64), []), clients=clients, server=server)
    calls = {"advertise": (server.advertise_requests, lambda c, raw: c.advertise(raw), server.collect_advertise),
             "share": (server.share_requests, lambda c, raw: c.share(raw), server.collect_share),
             "masked": (server.masked_requests, None, server.collect_masked),
             "unmask": (server.unmask_requests, lambda c, raw: c.unmask(raw), server.collect_unmask)}
    gone: set[int] = set()
    for phase in PHASES:
        if phase == stop_before:
            break
        make, answer, collect = calls[phase]
        requests = make()
        gone |= drop.get(phase, set())
        sim.relayed[phase] = requests
        sim.down[phase] = {u: len(raw) for u, raw in requests.items()}
        replies = {}
        for u, raw in requests.items():
            if u in gone:
                continue
            replies[u] = (clients[u].masked(raw, updates[u], bound, extras.get(u)) if answer is None
                          else answer(clients[u], raw))
        sim.replies[phase] = replies
        sim.up[phase] = {u: len(raw) for u, raw in replies.items()}
        result = collect(replies)
        if result is not None:
            sim.aggregate = result
    return sim
