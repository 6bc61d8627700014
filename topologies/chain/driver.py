"""The chain topology: WRWGD, one model walking a graph of clients (topologies/chain/rule.py has the rule;
topologies/chain/client.py the clients' side).

The model travels client to client: the visited client runs its local steps, draws the next
client and hands the model to it (`walk_handoff`, link client-client, 4d bytes per move).  The
server is the control plane only: each hop it sends the holder a `walk_visit` call without
tensors (the holder's neighbours' addresses and what to do after its update) and the reply
names the next holder, the visit's training loss and, at evaluation rounds, the holder's
evaluation of the model.  The model reaches the server only at the end of the run and before
each checkpoint (the round's last holder returns it in its reply, link client-server).

A round is `topology.hops_per_round` visits.  A hand-off that fails leaves the model with the
holder (the walk stays; a `handoff_skipped` event).  A holder that fails loses the model and
fails the run; a checkpoint keeps the walk (holder, visits) and `--resume` hands the
checkpoint's model to that holder in its first visit.
"""
from __future__ import annotations

import time

from fedhop.common.processors.pipeline import model_chain
from fedhop.common.topologies.graphs import (
    SEQ_METRIC_PREFIX,
    graph_summary,
    shown_row,
    topology_params,
    visit_counts,
)
from fedhop.common.transport.base import CallFailed, RemoteError
from fedhop.common.util.nodeids import client_node
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.server.driver import DriverContext, RoundResult, RunFailed, TopologyDriver, driver_kind
from fedhop.topologies.chain import WALK_VISIT
from fedhop.topologies.chain.rule import WalkRule, start_client


@driver_kind("chain")
class WalkDriver(TopologyDriver):
    checkpoint_needs_state = True
    def __init__(self, ctx: DriverContext) -> None:
        super().__init__(ctx)
        cfg = ctx.run.cfg
        sizes = [ctx.run.task.num_samples(c) for c in range(cfg.clients.count)]
        try:
            self.rule = WalkRule.from_config(cfg, sizes)
            self.holder = start_client(topology_params(cfg).start, cfg.clients.count, cfg.run.seed)
        except ValueError as exc:
            raise RunFailed(str(exc)) from None
        self.hops = topology_params(cfg).hops_per_round
        self.walk: list[int] = []      # the client of every visit, in order
        self.moves = 0                 # hand-offs that moved the model to another client
        self.skips = 0
        self.resuming = False
        if ctx.records.restored_topology is not None:
            self.restore(ctx.records.restored_topology)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        return {"kind": "chain", "holder": self.holder, "walk": list(self.walk), "moves": self.moves,
                "skips": self.skips}

    def restore(self, state: dict) -> None:
        if state.get("kind") != "chain" or not 0 <= int(state.get("holder", -1)) < self.ctx.run.cfg.clients.count:
            raise RunFailed(f"the checkpoint's topology state is not a walk of this run's clients: {state}")
        self.holder, self.walk = int(state["holder"]), [int(c) for c in state["walk"]]
        self.moves, self.skips = int(state["moves"]), int(state["skips"])
        self.resuming = True

    def summary(self) -> dict:
        return {"client_walk": list(self.walk), "client_walk_length": len(self.walk), "walk_moves": self.moves,
                "handoff_skips": self.skips, **graph_summary(self.rule.graph), "client_visits": visit_counts(self.walk)}

    # ------------------------------------------------------------------ rounds
    def _visit_message(self, round: int, hop: int) -> Payload:
        ctx, cfg = self.ctx, self.ctx.run.cfg
        last_hop = hop == self.hops - 1
        final = last_hop and round == cfg.run.rounds
        every = cfg.run.eval_every
        scalars: dict = {"start": round == 1 and hop == 0 and not self.resuming, "resume": self.resuming,
                         "final": final, "return_model": final or (last_hop and self.checkpoint_due(round)),
                         "evaluate": last_hop and (final or bool(every and round % every == 0))}
        # the address of the client the walk moves to at this hop (the rule's seeded draw, which
        # the holder makes too), so a visit's size does not grow with the holder's degree
        home, nxt = ctx.nodes.client_home, self.rule.next_client(self.holder, round, hop)
        peers = [pb.ClientAddress(client_id=nxt, address=home[nxt].address)] if nxt != self.holder and nxt in home else []
        came = getattr(self, "came_from", None)   # the visit names the hand-off it continues (topologies/chain/client.py)
        if came is not None and not self.resuming:
            scalars.update({"from": came[0], "from_round": came[1], "from_hop": came[2], "from_node": came[3]})
        message = Payload(scalars=scalars, control=pb.Control(walk_peers=peers))
        if self.resuming:   # the checkpoint's model goes to its holder (link client-server)
            message.tensors = {k: v.clone() for k, v in ctx.model.state.params.items()}
        return message

    def run_round(self, round: int) -> RoundResult:
        ctx, cfg = self.ctx, self.ctx.run.cfg
        started = time.perf_counter()
        losses: list[float] = []
        metrics: dict[str, float] = {}
        visited: list[int] = []
        for hop in range(self.hops):
            holder = self.holder
            node = ctx.nodes.client_home.get(holder)
            if node is None:
                raise RunFailed(f"round {round}: client {holder}, which holds the model, is not registered")
            message = self._visit_message(round, hop)
            try:
                reply = ctx.fabric.call(node.address, client_node(holder), WALK_VISIT, message, round=round, step=hop,
                                        timeout=cfg.run.round_timeout)
            except (CallFailed, RemoteError, PayloadError) as exc:
                ctx.records.store.add_event("client_failed", node=client_node(holder), detail=f"hop {hop}: {exc}", round=round)
                raise RunFailed(f"round {round}: client {holder}, which holds the model, failed: {exc}") from None
            self.resuming = False
            nxt = self._next_of(reply, holder, round, hop)
            if bool(message.scalars["return_model"]):
                self._take_model(reply, holder, round)
            elif reply.tensors:
                raise RunFailed(f"round {round}: client {holder} sent model tensors to the server, which asked for "
                                f"none (only the last hop of the run and of checkpoint rounds returns the model)")
            visited.append(holder)
            self.walk.append(holder)
            losses.append(float(reply.scalars.get("train_loss", 0.0)))
            metrics.update({k[len(SEQ_METRIC_PREFIX):]: float(v) for k, v in reply.scalars.items()
                            if k.startswith(SEQ_METRIC_PREFIX)})
            if nxt != holder:
                self.moves += 1
            self.holder = nxt
            self.came_from = (holder, round, hop, node.node_id)
        metrics["client_train_loss"] = sum(losses) / len(losses)
        metrics["hops"] = float(len(visited))
        result = RoundResult(round, sorted(set(visited)), sorted(set(visited)), {}, metrics,
                             time.perf_counter() - started)
        ctx.records.record_round(result)
        return result

    def _next_of(self, reply: Payload, holder: int, round: int, hop: int) -> int:
        """The next holder the reply names (checked against the graph) and its skipped hand-off."""
        nxt = reply.scalars.get("next")
        if isinstance(nxt, bool) or not isinstance(nxt, int) or not self.rule.is_candidate(holder, nxt):
            raise RunFailed(f"round {round}: client {holder} named {nxt!r} as the next holder, not itself nor one "
                            f"of its neighbours ({shown_row(self.rule.graph[holder])})")
        skipped = reply.scalars.get("skipped", -1)
        if isinstance(skipped, int) and not isinstance(skipped, bool) and skipped >= 0:
            self.skips += 1
            self.ctx.records.store.add_event("handoff_skipped", node=client_node(skipped), round=round,
                                     detail=f"hop {hop}: client {holder} kept the model: "
                                            f"{reply.scalars.get('skip_reason', '')}")
        return nxt

    def _take_model(self, reply: Payload, holder: int, round: int) -> None:
        """The model the holder returned (the end of the run, or a checkpoint round): checked
        against the model's spec and finiteness, then the server's state."""
        state = self.ctx.model.state
        params = state.params
        spec = {k: (v.dtype, tuple(v.shape)) for k, v in params.items()}
        try:
            model = model_chain(spec, WALK_VISIT)(reply, f"round {round} model from client {holder}", round,
                                                       client_node(holder))
        except PayloadError as exc:
            raise RunFailed(str(exc)) from None
        state.params = {k: v.clone() for k, v in model.items()}
