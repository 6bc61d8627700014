"""The relay topology: a data-weighted random walk over the clients, relayed through the server
(the server-driven form of random-walk SGD; the peer-to-peer WRWGD of the Fed-CHS paper is the
`chain` topology, topologies/chain/driver.py).

One model walks over the clients.  The next client is drawn with probability D_j / D_A (a
Metropolis-Hastings walk on the complete client graph whose stationary law is the data
share; with proposals drawn from that law every move is accepted), so the expected update is
the gradient of F = sum_j (D_j / D_A) f_j and no importance weight is needed.  At each visit
the client runs `algorithm.local_steps` local steps from the model (one gradient step with
local_steps = 1) and the model moves by the client's update (`server_update` on a single
reply: w <- w + server_lr * Delta_j for FedAvg).

The server drives the walk: it sends the model to the visited client and takes the updated
model back, so a hop costs 2 model transfers on the client-server link (the peer-to-peer walk,
`chain`, costs 1 on the client-client link; docs/topologies.md).  Useful where clients cannot
reach each other (NAT, firewalls) but the walk's sampling is wanted.  A round is `hops_per_round`
visits drawn from the stream ("chain", round); a client that fails is passed over.
"""
from __future__ import annotations

import time

import numpy as np

from fedhop.common.topologies.graphs import topology_params, visit_counts
from fedhop.common.transport.base import CallFailed, RemoteError
from fedhop.common.transport.fabric import reply_chain
from fedhop.common.util.nodeids import client_node
from fedhop.common.util.rng import numpy_stream
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method
from fedhop.server.driver import DriverContext, RoundResult, RunFailed, TopologyDriver, driver_kind


@driver_kind("relay")
class RelayDriver(TopologyDriver):
    def __init__(self, ctx: DriverContext) -> None:
        super().__init__(ctx)
        cfg = ctx.run.cfg
        self.hops = topology_params(cfg).hops_per_round
        sizes = np.array([ctx.run.task.num_samples(c) for c in range(cfg.clients.count)], dtype=float)
        self.p = sizes / sizes.sum()
        self.walk: list[int] = []

    def summary(self) -> dict:
        return {"client_walk": list(self.walk), "client_walk_length": len(self.walk),
                "client_visits": visit_counts(self.walk)}

    def draw(self, round: int) -> list[int]:
        """This round's visited clients: i.i.d. draws j ~ D_j / D_A from the stream ("chain", round)."""
        rng = numpy_stream(self.ctx.run.cfg.run.seed, "chain", round)
        return [int(c) for c in rng.choice(len(self.p), size=self.hops, p=self.p)]

    def run_round(self, round: int) -> RoundResult:
        ctx, cfg = self.ctx, self.ctx.run.cfg
        algo, state = ctx.run.algorithm, ctx.model.state
        started = time.perf_counter()
        visits = self.draw(round)
        failures: dict[int, str] = {}
        loss_sum, done = 0.0, []
        for hop, cid in enumerate(visits):
            node = ctx.nodes.client_home.get(cid)
            try:
                if node is None:
                    raise CallFailed("UNAVAILABLE", f"client {cid} is not registered")
                reply = ctx.fabric.call(node.address, client_node(cid), Method.TRAIN, algo.broadcast(state, round),
                                        round=round, step=hop, timeout=cfg.run.call_timeout)
                reply = reply_chain(cfg, algo.reply_spec(state), Method.TRAIN, round=round, peer=client_node(cid))(
                    reply, f"round {round} hop {hop} reply of client {cid}")
            except (CallFailed, RemoteError, PayloadError) as exc:
                failures[cid] = str(exc)
                ctx.records.store.add_event("client_failed", node=client_node(cid), detail=f"hop {hop}: {exc}", round=round)
                continue
            algo.server_update(state, algo.aggregate([(cid, reply)]), round)
            loss_sum += float(reply.scalars.get("train_loss", 0.0))
            done.append(cid)
            self.walk.append(cid)
        if not done:
            raise RunFailed(f"round {round}: none of the {len(visits)} visited clients answered")
        metrics = ctx.records.round_metrics(round, Payload(scalars={"weight": 1.0, "train_loss": loss_sum / len(done)}))
        metrics["hops"] = float(len(done))
        result = RoundResult(round, sorted(set(visits)), sorted(set(done)), failures, metrics,
                             time.perf_counter() - started)
        ctx.records.record_round(result)
        return result
