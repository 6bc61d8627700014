"""The gossip topology: D-PSGD, every client mixing its model with its graph neighbours' each
round (topologies/gossip/rule.py has the graph and the rule, topologies/gossip/client.py the clients' side).

The server is the control plane only.  A round is three fan-outs, each a barrier:
`gossip_step` to every logical client (its local steps), `gossip_send` to every client process
(its clients' post-step models to their neighbours, peer to peer on the client-client link),
`gossip_mix` to every logical client (the Metropolis-Hastings average).  None carries a tensor
from the server.  In evaluation rounds (`run.eval_every`, and the last) the mix replies carry the
clients' models (link client-server): the server takes their plain mean x_bar as its model,
evaluates it and records the consensus distance (1/n) sum_i ||x_i - x_bar||^2.

Where each client lives is told once, not every round: a client's `gossip_step` names the process
hosting each of its neighbours, and a process's `gossip_send` the addresses of its clients'
neighbours, only when those changed since they were last told (the first round, and a process
registered again); otherwise the round's step and send messages are one shared empty message
each, encoded once, and the client processes keep what they were told (topologies/gossip/client.py).
A round's control plane is then O(n) however dense the graph.

Every client takes part in every round: a client or process that fails fails the run (its
neighbours cannot mix without it).  The models live in the client processes, so a gossip run
has no checkpoints (the config loader refuses `run.checkpoint_every`).
"""
from __future__ import annotations

import time

import torch

from fedhop.common.processors.pipeline import model_chain
from fedhop.common.topologies.graphs import graph_summary
from fedhop.common.transport.fabric import Send
from fedhop.common.util.nodeids import client_node
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.server.driver import ChildNode, DriverContext, RoundResult, RunFailed, TopologyDriver, driver_kind
from fedhop.topologies.gossip import GOSSIP_MIX, GOSSIP_SEND, GOSSIP_STEP
from fedhop.topologies.gossip.rule import MIX_STEP, SEND_STEP, GossipRule


@driver_kind("gossip")
class GossipDriver(TopologyDriver):
    def __init__(self, ctx: DriverContext) -> None:
        super().__init__(ctx)
        try:
            self.rule = GossipRule.from_config(ctx.run.cfg)
        except ValueError as exc:
            raise RunFailed(str(exc)) from None
        params = ctx.model.state.params
        self.model_in = model_chain({k: (v.dtype, tuple(v.shape)) for k, v in params.items()}, GOSSIP_MIX)
        self.models: dict[int, dict[str, torch.Tensor]] = {}   # the clients' models of the latest evaluation round
        # the registration (ChildNode) each client's home was last told to its neighbours and itself
        self.told: dict[int, ChildNode] = {}

    def summary(self) -> dict:
        return {**graph_summary(self.rule.graph), "gossip_edges": self.rule.edge_count}

    def _fan_out(self, round: int, sends: list[Send], what: str) -> dict:
        cfg = self.ctx.run.cfg
        timeout = cfg.run.round_timeout
        results, failures = self.ctx.fabric.send_and_receive(
            sends, round=round, timeout=timeout, call_timeout=timeout,
            timeout_reason=f"timeout: no result within run.round_timeout={timeout}s")
        if failures:
            key, why = sorted(failures.items(), key=lambda kv: str(kv[0]))[0]
            node = client_node(key) if isinstance(key, int) else str(key)
            self.ctx.records.store.add_event("client_failed", node=node, detail=f"{what}: {why}", round=round)
            raise RunFailed(f"round {round}: {what} failed at {node}: {why} (gossip needs every client)")
        return results

    def run_round(self, round: int) -> RoundResult:
        ctx, cfg = self.ctx, self.ctx.run.cfg
        started = time.perf_counter()
        n = cfg.clients.count
        home = ctx.nodes.client_home
        missing = [c for c in range(n) if c not in home]
        if missing:
            raise RunFailed(f"round {round}: clients {missing} are not registered")
        home = {c: home[c] for c in range(n)}
        untold = self._untold(home)
        known = Payload()   # shared by every client and process told nothing new: encoded once
        steps = self._fan_out(round, [Send(c, home[c].address, client_node(c), GOSSIP_STEP,
                                           self._step_message(c, home) if c in untold else known)
                                      for c in range(n)], "gossip_step")
        untold_nodes = {home[c].node_id for c in untold}
        sends = []
        for node in sorted({h.node_id: h for h in home.values()}.values(), key=lambda h: h.node_id):
            message = known
            if node.node_id in untold_nodes:
                near = sorted({j for c in node.clients for j in self.rule.graph[c]})
                peers = [pb.ClientAddress(client_id=j, address=home[j].address) for j in near]
                message = Payload(control=pb.Control(walk_peers=peers))
            sends.append(Send(node.node_id, node.address, node.node_id, GOSSIP_SEND, message, step=SEND_STEP))
        self._fan_out(round, sends, "gossip_send")
        self.told = home
        evaluate = self._evaluation_due(round)   # as the round engine's metrics evaluate
        mix = Payload(scalars={"return_model": evaluate})
        mixed = self._fan_out(round, [Send(c, home[c].address, client_node(c), GOSSIP_MIX, mix, step=MIX_STEP)
                                      for c in range(n)], "gossip_mix")
        losses = sum(float(steps[c].scalars.get("train_loss", 0.0)) for c in range(n))
        extra: dict[str, float] = {}
        if evaluate:
            extra["consensus_distance"] = self._take_models(round, mixed)
        metrics = ctx.records.round_metrics(round, Payload(scalars={"train_loss": losses, "weight": float(n)}))
        metrics.update(extra)
        result = RoundResult(round, list(range(n)), list(range(n)), {}, metrics, time.perf_counter() - started)
        ctx.records.record_round(result)
        return result

    def _untold(self, home: dict[int, ChildNode]) -> set[int]:
        """The clients to tell where their neighbours live this round: each client whose home
        changed since it was last told (its process knows nothing of it) and each neighbour of
        one.  Every client in the first round, none while no process registers again."""
        told = self.told
        moved = [c for c, node in home.items() if told.get(c) is not node]
        graph = self.rule.graph
        return set(moved).union(*(graph[c] for c in moved))

    def _step_message(self, client: int, home: dict) -> Payload:
        """gossip_step: no tensors; the process hosting each neighbour (`host:<j>`), the only
        one whose gossip_share for j the client's process will take."""
        return Payload(scalars={f"host:{j}": home[j].node_id for j in self.rule.graph[client]})

    def _evaluation_due(self, round: int) -> bool:
        cfg = self.ctx.run.cfg
        every = cfg.run.eval_every
        return round == cfg.run.rounds or bool(every and round % every == 0)

    def _take_models(self, round: int, replies: dict) -> float:
        """The clients' models checked, their mean x_bar as the server's model, and the consensus
        distance (1/n) sum_i ||x_i - x_bar||^2 (topologies/gossip/rule.py)."""
        try:
            models = {c: self.model_in(replies[c], f"round {round} model of client {c}", round, client_node(c))
                      for c in sorted(replies)}
        except PayloadError as exc:
            raise RunFailed(str(exc)) from None
        n = len(models)
        zero = torch.zeros((), dtype=torch.float64)   # sum's start: 0 + x is x, bit for bit, as with the int 0
        mean = {k: sum((m[k].double() for m in models.values()), zero) / n for k in self.model_in.spec}
        distance = sum(float(((m[k].double() - mean[k]) ** 2).sum()) for m in models.values() for k in mean) / n
        state = self.ctx.model.state
        params = state.params
        state.params = {k: mean[k].to(params[k].dtype) for k in params}
        self.models = {c: {k: v.clone() for k, v in m.items()} for c, m in models.items()}
        return distance
