"""An edge's side of the torch.distributed data plane, hierarchical topology (HierFAVG).

World layout (made by server/torch_rounds.py, the same on every rank): rank 0 is the server,
ranks 1..E the edges (by edge index), then each edge's client processes (edge order, then node
id).  Groups, created in this order on every rank: the top group {server, every edge}, then one
cluster group {edge e, its client processes} per edge.

One round at this edge (same steps as the gRPC path, edge/aggregator.py `edge_round`):
  1. receive the server's message over the top group (`torch_edge_round`: the broadcast);
  2. for k = 0..kappa2-1: broadcast the current edge model over the cluster group, let the
     client processes train their sampled clients (control `torch_round` with step k), reduce
     their partial aggregates into this edge (`torch_reduce`), and apply the algorithm's
     `edge_step` between iterations;
  3. after kappa2 > 1 iterations, `edge_partial`; reduce the partial into the server over the
     top group (`torch_edge_reduce`).
Control (sampled clients, tensor layouts, failures, scalars) stays on gRPC.  A collective needs
every rank of its group, so a client process that fails or does not answer fails this edge's
round (a HandlerError the server turns into a failed run), within the collective timeout.
"""
from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, wait
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from fedhop.common.algorithms.base import Payload, reduce_payloads
from fedhop.common.control import control_of, failures_control, failures_of, world_layout
from fedhop.common.methods import Method
from fedhop.common.topology import edge_node
from fedhop.common.transport.base import CallFailed, HandlerError
from fedhop.common.validation import validate_reply
from fedhop.common.transport.fabric import gather
from fedhop.common.transport.grpc import RETRY_WINDOW
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.transport.torchdist import (STEP_KEY, Collectives, LayoutMismatch, TorchParams, buffers_by_name,
                                        build_groups, init_watching, layout_of, merge_layouts, reduce_buffers,
                                        specs_from_pb, specs_of)


class TorchEdge:
    def __init__(self, aggregator) -> None:
        self.agg = aggregator
        self.node_id: str = aggregator.endpoint.node_id
        self.top: Collectives | None = None       # server + edges, rooted at the server
        self.cluster: Collectives | None = None   # this edge + its client processes, rooted here
        self.procs: list[str] = []                # this cluster's client processes, in rank order
        self.partial: Payload | None = None
        self.world: Collectives | None = None     # the whole world (point-to-point sends of Fed-CHS)
        self.ranks: dict[str, int] = {}           # node id -> global rank (the server is 0)

    def processes(self) -> Payload:
        """This edge's client processes (the server lays out the world from every edge's answer)."""
        return Payload(control=pb.Control(processes=sorted(self.agg.processes)))

    def ready(self) -> None:
        if self.top is None:
            raise HandlerError("NOT_READY", f"{self.node_id}: torch_init has not been called")

    # ------------------------------------------------------------------ set-up
    def init(self, payload: Payload) -> Payload:
        """Join the world, forward each client process its rank, create every group."""
        s = payload.scalars
        params = TorchParams(backend=str(s["backend"]), timeout=float(s["timeout"]))
        layout = world_layout(control_of(payload).world)
        ranks: dict[str, int] = layout["ranks"]
        groups: list[list[int]] = layout["groups"]
        mine = int(layout["clusters"][self.node_id])
        self.procs = sorted((p for p in ranks if p in self.agg.processes), key=lambda p: ranks[p])
        if sorted(self.procs) != sorted(self.agg.processes):
            raise HandlerError("BAD_LAYOUT", f"{self.node_id}: the server's layout lists {self.procs}, this edge "
                                             f"serves {sorted(self.agg.processes)}")
        world = int(s["world_size"])
        common = {"world_size": world, "master": str(s["master"]), "backend": params.backend,
                  "timeout": params.timeout, "root_rank": ranks[self.node_id], "root_node": self.node_id}
        cluster = pb.Control(world=pb.TorchWorld(groups=[pb.RankGroup(ranks=g) for g in groups], group=mine))
        calls = {p: self.agg.fabric.submit(self.agg.fabric.call, self.agg.processes[p], p, Method.TORCH_INIT,
                                          Payload(scalars={**common, "rank": ranks[p]}, control=cluster), round=0,
                                          timeout=params.timeout)
                 for p in self.procs}
        coll = Collectives(self.node_id, ranks[self.node_id], world, self.agg.endpoint.ledger, params,
                           self.agg.run_id)
        try:
            init_watching(coll, str(s["master"]), calls, f"{self.node_id}: torch.distributed set-up failed")
            handles = build_groups(groups, params.timeout)
        except RuntimeError as exc:
            raise HandlerError("COLLECTIVE_FAILED", str(exc) if self.node_id in str(exc) else
                               f"{self.node_id}: torch.distributed set-up failed: {exc}") from None
        _, failed = self._gather(calls, params.timeout + 5.0)
        if failed:
            raise HandlerError("COLLECTIVE_FAILED", f"{self.node_id}: client processes {sorted(failed)} did not "
                                                    f"join torch.distributed ({next(iter(failed.values()))})")
        self.world, self.ranks = coll, {**ranks, "server": 0}
        self.top = coll.scoped(handles[0], 0, "server", "edge-server")
        self.cluster = coll.scoped(handles[mine], ranks[self.node_id], self.node_id, "client-edge")
        return Payload(scalars={"rank": coll.rank})

    # ------------------------------------------------------------------ rounds
    def round(self, round: int, payload: Payload) -> Payload:
        """Steps 1-2 of the module docstring; returns failures, the partial's layout and scalars."""
        self.ready()
        scalars = dict(payload.scalars)
        control = control_of(payload)
        sampled = list(control.clients)
        stray = [c for c in sampled if c not in self.agg.cluster]
        specs = specs_from_pb(control.specs)
        received = self._collective(lambda: self.top.broadcast(
            [torch.empty(shape, dtype=dtype) for _, dtype, shape in specs], round, peers=[self.node_id]),
            f"round {round}: broadcast from the server")
        if stray:
            raise HandlerError("UNKNOWN_CLIENT", f"clients {stray} are not in {self.node_id}'s cluster")
        message = Payload(tensors={name: t.cpu() for (name, _, _), t in zip(specs, received)}, scalars=scalars)
        start, failures, partial = message, {}, None
        kappa2 = getattr(self.agg.params, "kappa2", 1)
        for k in range(kappa2):   # HierFAVG (Liu et al. 2020, Algorithm 1): kappa2 edge aggregations
            live = [c for c in sampled if c not in failures]
            if not live:
                break
            part, failed = self.iteration(round, k, live, message)
            failures.update(failed)
            if part is None:
                break
            partial = part
            if k < kappa2 - 1:
                message = self.agg.algorithm.edge_step(message, partial)
        if partial is not None and kappa2 > 1:
            partial = self.agg.algorithm.edge_partial(start, message, partial)
        self.partial = partial
        out = Payload(control=failures_control(failures))
        if partial is not None:
            out.control.layout.extend(layout_of(partial.tensors, self.agg.algorithm.reply_reduce))
            out.scalars.update(partial.scalars)
        return out

    def iteration(self, round: int, step: int, clients: list[int], message: Payload):
        """One edge iteration over the cluster group: broadcast, train, reduce into this edge."""
        assert self.cluster is not None
        ep, timeout = self.agg.fabric, self.agg.cfg.run.round_timeout
        by_proc: dict[str, list[int]] = {p: [] for p in self.procs}
        for cid in clients:
            by_proc[self.agg.client_home[cid][0]].append(cid)
        specs = specs_of(message.tensors)
        control = {p: self.agg.fabric.submit(
            ep.call, self.agg.processes[p], p, Method.TORCH_ROUND,
            Payload(scalars={**message.scalars, STEP_KEY: step}, control=pb.Control(clients=by_proc[p], specs=specs)),
            round=round, step=step, timeout=timeout) for p in self.procs}
        where = f"round {round} edge iteration {step}"
        self._collective(lambda: self.cluster.broadcast(list(message.tensors.values()), round, self.procs, step),
                         f"{where}: broadcast to client processes", control)
        replies, failed = self._gather(control, timeout)
        if failed:
            raise HandlerError("COLLECTIVE_FAILED", f"{self.node_id}: client processes {sorted(failed)} did not finish "
                                                    f"{where} ({next(iter(failed.values()))}); a collective needs "
                                                    f"every rank")
        failures: dict[int, str] = {}
        layouts, scalar_parts = {}, []
        for node, reply in sorted(replies.items()):
            failures.update(failures_of(reply))
            if control_of(reply).layout:
                layouts[node] = control_of(reply).layout
                scalar_parts.append(Payload(scalars=dict(reply.scalars)))
        if not layouts:
            return None, failures
        try:
            layout = merge_layouts(layouts, f"{self.node_id} {where}: client processes")
        except LayoutMismatch as exc:
            raise HandlerError("LAYOUT_MISMATCH", str(exc)) from None
        reduce_calls = {p: self.agg.fabric.submit(ep.call, self.agg.processes[p], p, Method.TORCH_REDUCE,
                                                 Payload(scalars={STEP_KEY: step}, control=pb.Control(layout=layout)),
                                                 round=round, step=step, timeout=timeout) for p in self.procs}
        buffers = reduce_buffers(layout, None)
        self._collective(lambda: self.cluster.reduce(buffers, round, self.procs, step),
                         f"{where}: reduce from client processes", reduce_calls)
        _, failed = self._gather(reduce_calls, timeout)
        if failed:
            raise HandlerError("COLLECTIVE_FAILED", f"{self.node_id}: {where}: reduce control failed: {failed}")
        partial = reduce_payloads(scalar_parts, self.agg.algorithm.reply_reduce)
        partial.tensors = buffers_by_name(layout, buffers)
        return partial, failures

    def reduce(self, round: int, payload: Payload) -> Payload:
        """Step 3: this edge's partial (or the ops' identities) into the server over the top group."""
        self.ready()
        buffers = reduce_buffers(control_of(payload).layout, self.partial.tensors if self.partial is not None else None)
        self.partial = None
        self._collective(lambda: self.top.reduce(buffers, round, peers=[self.node_id]),
                         f"round {round}: reduce to the server")
        return Payload()

    # ------------------------------------------------------------------ helpers
    def _collective(self, fn, what: str, control: dict | None = None):
        """Run one collective; on failure (gloo: a peer gone, or the collective timeout) name the
        client processes whose control call of the same step failed too (a dead rank). A call to a
        dead process fails only once its not-delivered retries give up (RETRY_WINDOW), so the wait
        for those failures outlasts that window."""
        try:
            return fn()
        except RuntimeError as exc:
            wait(list((control or {}).values()), timeout=RETRY_WINDOW + 4.0, return_when=FIRST_EXCEPTION)
            _, failed = self._gather(control or {}, 0.0, pending_ok=True)
            dead = f"; client processes {sorted(failed)} failed: {next(iter(failed.values()))}" if failed else ""
            raise HandlerError("COLLECTIVE_FAILED", f"{self.node_id}: {what} failed: {exc}{dead}") from None

    @staticmethod
    def _gather(calls: dict, timeout: float, pending_ok: bool = False) -> tuple[dict, dict]:
        """Results and failures of control calls after at most `timeout` seconds (a call still
        pending is a failure unless `pending_ok`)."""
        return gather(calls, timeout, f"no answer within {timeout:g}s", pending_ok=pending_ok)


class TorchModelPath:
    """Fed-CHS's model over torch.distributed at an edge (edge/sequential.py `MODEL_PATHS`): each
    cluster step is a broadcast and a reduce in this edge's cluster group, a hand-off is a
    `dist.send` to the next edge's rank beside the `seq_handoff` control call (which makes the
    receiver post the matching `dist.recv`), and the final (or checkpoint) model waits here for
    `seq_final`, which sends it to the server (rank 0).  Every model received is drained from
    the wire before it is checked."""

    def __init__(self, edge) -> None:
        self.edge = edge                                   # edge/sequential.py's SequentialEdge
        self.final: dict[str, torch.Tensor] | None = None  # the model the server fetches with seq_final

    @property
    def torch(self) -> TorchEdge:
        torch_edge = self.edge.agg.torch()
        if torch_edge.world is None:
            raise HandlerError("NOT_READY", f"{torch_edge.node_id}: torch_init has not been called")
        return torch_edge

    def _entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(k, dtype, shape) for k, (dtype, shape) in self.edge.spec.items()]

    def cluster_step(self, round: int, step: int, message: Payload) -> tuple[Payload | None, dict[int, str]]:
        partial, failed = self.torch.iteration(round, step, list(self.edge.agg.cluster), message)
        if partial is not None:
            validate_reply(partial, self.edge.spec, f"round {round} step {step} reduced partial of "
                                                    f"{self.torch.node_id}'s client processes")
        return partial, failed

    def handoff_model(self, src: str, round: int, payload: Payload) -> dict[str, torch.Tensor]:
        te = self.torch
        if src not in te.ranks:
            raise HandlerError("NOT_NEIGHBOUR", f"{src} has no rank in the torch.distributed world")
        try:
            tensors = te.world.recv(self._entries(), te.ranks[src], src, round, "edge-edge")
        except RuntimeError as exc:
            raise HandlerError("COLLECTIVE_FAILED", f"{te.node_id}: hand-off from {src} failed: {exc}") from None
        return self.edge.model_in(Payload(tensors=tensors), f"hand-off from {src}")

    def resumed_model(self, round: int, message: Payload) -> dict[str, torch.Tensor]:
        te = self.torch
        try:
            tensors = te.world.recv(self._entries(), 0, "server", round, "edge-server")
        except RuntimeError as exc:
            raise HandlerError("COLLECTIVE_FAILED", f"{te.node_id}: the resumed model from the server did not "
                                                    f"arrive: {exc}") from None
        return self.edge.model_in(Payload(tensors=tensors), f"resumed model for round {round}")

    def send_model(self, round: int, peer: int, address: str, w: dict[str, torch.Tensor]) -> None:
        te, fabric, timeout = self.torch, self.edge.agg.fabric, self.edge.cfg.run.call_timeout
        node = edge_node(peer)
        call = fabric.submit(fabric.call, address, node, Method.SEQ_HANDOFF, Payload(), round=round, timeout=timeout)
        try:
            te.world.send([w[k] for k in self.edge.spec], te.ranks[node], node, round, "edge-edge")
        except RuntimeError as exc:
            raise CallFailed("COLLECTIVE_FAILED", f"dist.send failed: {exc}", node) from None
        try:
            call.result(timeout=timeout)
        except FutureTimeout:
            raise CallFailed("DEADLINE_EXCEEDED", f"no hand-off confirmation within {timeout:g}s", node) from None

    def final_model(self, w: dict[str, torch.Tensor], reply: Payload) -> None:
        self.final = dict(w)   # the server fetches it with `seq_final` (a dist.send)

    def send_final(self, round: int) -> Payload:
        te, final = self.torch, self.final
        if final is None:
            raise HandlerError("NO_TOKEN", f"{te.node_id} holds no final model for round {round}")
        try:
            te.world.send([final[k] for k in self.edge.spec], 0, "server", round, "edge-server")
        except RuntimeError as exc:
            raise HandlerError("COLLECTIVE_FAILED", f"{te.node_id}: sending the final model failed: {exc}") from None
        self.final = None
        return Payload()
