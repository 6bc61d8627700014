"""The server's side of the sequential topology (Fed-CHS; edge.py is the edges' side).

The server is only the control plane here (DESIGN.md section 2): each round it sends the
token's round call `seq_round` (no tensors; the first one is the start token) to the edge that
holds the model, and the reply brings the round's metrics (computed by that edge on the model
it holds: the task's held-out evaluation, every `run.eval_every` rounds), the next edge and the
neighbours passed over.  Only in the last round does the reply carry a model: the final one,
which the server stores and evaluates; and in a round that a checkpoint follows, so that the
checkpoint holds the model (with the walk: `checkpoint_state`; `--resume` continues it,
docs/topologies.md).  Every hand-off and every skip is an event in run.db;
summary.json gets `edge_sequence`, `edge_graph`, `edge_data_sizes` and `edge_visits`.
"""
from __future__ import annotations

import json
import time
from collections import Counter

from fedhop.common.processors.pipeline import model_chain
from fedhop.common.topologies.graphs import SEQ_METRIC_PREFIX, cluster_assignment
from fedhop.common.transport.base import CallFailed, RemoteError
from fedhop.common.transport.control import control_of, failures_of
from fedhop.common.transport.fabric import Send
from fedhop.common.transport.factory import data_plane
from fedhop.common.util.nodeids import client_node, edge_node
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.server.driver import DriverContext, RoundResult, RunFailed, TopologyDriver, driver_kind
from fedhop.topologies.sequential import SEQ_QUERY, SEQ_RESTORE, SEQ_ROUND, SEQ_SERVER_PATH, SERVER_PATHS
from fedhop.topologies.sequential.rule import edge_graph, start_edge


@driver_kind("sequential")
class SequentialDriver(TopologyDriver):
    checkpoint_needs_state = True

    def __init__(self, ctx: DriverContext) -> None:
        super().__init__(ctx)
        cfg = ctx.run.cfg
        if not getattr(ctx.run.algorithm, "sequential", False):
            raise RunFailed(f"topology.kind = 'sequential' needs a sequential algorithm (its model walks the edges: "
                            f"fedchs), got '{cfg.algorithm.name}'")
        try:   # how the model reaches the server and leaves it: the transport's model path
            self.path = data_plane(cfg.transport.kind, SEQ_SERVER_PATH, self.kind, SERVER_PATHS)(ctx)
        except (RuntimeError, ValueError) as exc:   # no model path (NoDataPlane), or a torch.distributed world
            raise RunFailed(str(exc)) from None       # that could not be set up
        try:
            self.graph = edge_graph(cfg)
            self.start_edge = start_edge(cfg)
        except ValueError as exc:
            raise RunFailed(str(exc)) from None
        self.clusters = cluster_assignment(cfg)
        self.data_sizes = [sum(ctx.run.task.num_samples(c) for c in cluster) for cluster in self.clusters]
        self.holder = self.start_edge
        self.sequence: list[int] = []
        self.skips = 0
        self.visits: list[int | None] = []   # c(m) of every edge at the last checkpoint (None: no answer)
        self.resuming = False                # the next round starts from the checkpoint's model
        if ctx.records.restored_topology is not None:
            self.restore(ctx.records.restored_topology)

    # ------------------------------------------------------------------ checkpoints
    # checkpoint_due (TopologyDriver): a checkpoint follows the round, so that round's holder must
    # send its model to the server (the last round's model comes anyway)
    def checkpoint_state(self) -> dict:
        """What a checkpoint saves of the walk (beside the model, which the server now holds)."""
        return {"kind": "sequential", "holder": self.holder, "sequence": list(self.sequence),
                "skips": self.skips, "visits": list(self.visits)}

    def restore(self, state: dict) -> None:
        # visits are pulled at every checkpoint before the last round; a last round's checkpoint
        # may hold none, and leaves no round to run
        if state.get("kind") != "sequential" or len(state.get("visits", [])) not in (0, len(self.graph)):
            raise RunFailed(f"the checkpoint's topology state does not fit this run's {len(self.graph)} edges: "
                                 f"{state}")
        self.holder, self.sequence, self.skips = int(state["holder"]), list(state["sequence"]), int(state["skips"])
        self.visits = list(state["visits"])
        self.resuming = True

    def _pull_visits(self, round: int) -> list[int | None]:
        """Every edge's visit count c(m), asked with `control.seq_query` (a dead edge: None)."""
        nodes = {e: self.ctx.nodes.children.get(edge_node(e)) for e in range(len(self.graph))}
        query = Payload()
        replies, _ = self.ctx.fabric.send_to_all([Send(e, node.address, node.node_id, SEQ_QUERY, query)
                                                  for e, node in nodes.items() if node is not None],
                                                 round=round, call_timeout=self.ctx.run.cfg.run.call_timeout)
        out: list[int | None] = []
        for e in nodes:
            try:
                out.append(int(replies[e].scalars["visits"]))
            except (KeyError, ValueError):   # never registered, no answer, or no count in it
                out.append(None)
        return out

    def _restore_visits(self, round: int) -> None:
        """A resumed run: give every (fresh) edge its visit count from the checkpoint."""
        sends = []
        for e, visits in enumerate(self.visits):
            node = self.ctx.nodes.children.get(edge_node(e))
            if node is not None and visits is not None:
                sends.append(Send(e, node.address, node.node_id, SEQ_RESTORE,
                                  Payload(scalars={"visits": int(visits)})))
        _, failures = self.ctx.fabric.send_to_all(sends, round=round, call_timeout=self.ctx.run.cfg.run.call_timeout)
        for send in sends:   # in edge order, as the calls were listed
            if send.key in failures:
                self.ctx.records.store.add_event("restore_failed", node=send.dst, round=round,
                                           detail=f"visit count not restored: {failures[send.key]}")

    def summary(self) -> dict:
        visits = Counter(self.sequence)
        return {"edge_sequence": list(self.sequence), "edge_graph": self.graph, "edge_data_sizes": self.data_sizes,
                "edge_start": self.start_edge, "edge_visits": [visits.get(e, 0) for e in range(len(self.graph))],
                "handoff_skips": self.skips}

    def run_round(self, round: int) -> RoundResult:
        ctx, cfg = self.ctx, self.ctx.run.cfg
        children, store, state = ctx.nodes.children, ctx.records.store, ctx.model.state
        started = time.perf_counter()
        if round != len(self.sequence) + 1:
            raise RunFailed(f"round {round}: the sequential topology cannot resume mid-run (the model lives "
                                 f"on the edges)")
        holder = self.holder
        node = children.get(edge_node(holder))
        if node is None:
            raise RunFailed(f"round {round}: {edge_node(holder)}, which holds the model, never registered")
        peers = [pb.EdgeAddress(edge=e, address=children[edge_node(e)].address) for e in self.graph[holder]
                 if edge_node(e) in children]
        last = round == cfg.run.rounds
        due = self.checkpoint_due(round)
        every = cfg.run.eval_every
        message = Payload(scalars={"start": round == 1 and not self.resuming, "resume": self.resuming,
                                   "last": last, "checkpoint": due,
                                   "evaluate": last or bool(every and round % every == 0)},
                          control=pb.Control(peers=peers))
        if self.resuming:
            self._restore_visits(round)
            message.tensors = {k: v.clone() for k, v in state.params.items()}
        try:
            reply = self.path.call_round(node, round, message, resumed=self.resuming)
        except (CallFailed, RemoteError, PayloadError) as exc:
            store.add_event("edge_failed", node=node.node_id, detail=str(exc), round=round)
            raise RunFailed(f"round {round}: {node.node_id}, which holds the model, failed: {exc}") from None
        self.resuming = False
        if last or due:   # the final model, or the one the checkpoint after this round saves
            what = "final model" if last else f"round {round} model for the checkpoint"
            try:
                spec = {k: (v.dtype, tuple(v.shape)) for k, v in state.params.items()}
                model = model_chain(spec, SEQ_ROUND)(self.path.final_model(node, round, reply, spec),
                                                            f"the {what} from {node.node_id}", round, node.node_id)
            except PayloadError as exc:
                raise RunFailed(str(exc)) from None
            state.params = {k: v.clone() for k, v in model.items()}
        elif reply.tensors:
            raise RunFailed(f"round {round}: {node.node_id} sent model tensors to the server, which asked "
                                 f"for none (only the last round and checkpoint rounds carry the model)")
        cluster = self.clusters[holder]
        failures = failures_of(reply)
        for cid, why in sorted(failures.items()):
            store.add_event("client_failed", node=client_node(cid), detail=f"at {node.node_id}: {why}", round=round)
        nxt = int(reply.scalars.get("next_edge", -1))
        control = control_of(reply)
        for skip in control.skipped:
            self.skips += 1
            store.add_event("handoff_skipped", node=edge_node(skip.edge), round=round,
                            detail=f"{node.node_id} passed over {edge_node(skip.edge)}: {skip.reason}")
        if not last:
            answers = {str(a.edge): [a.visits, a.data_size] for a in sorted(control.neighbours, key=lambda a: a.edge)}
            store.add_event("handoff", node=node.node_id, round=round,
                            detail=json.dumps({"from": holder, "to": nxt, "neighbours": answers}))
        metrics = {k[len(SEQ_METRIC_PREFIX):]: float(v) for k, v in reply.scalars.items()
                   if k.startswith(SEQ_METRIC_PREFIX)}
        if "client_train_loss" in reply.scalars:
            metrics["client_train_loss"] = float(reply.scalars["client_train_loss"])
        metrics["edge"] = float(holder)
        self.sequence.append(holder)
        self.holder = nxt
        if due:
            self.visits = self._pull_visits(round)
        participants = sorted(set(cluster) - set(failures))
        result = RoundResult(round, list(cluster), participants, failures, metrics, time.perf_counter() - started)
        ctx.records.record_round(result)
        return result


class ServerInlineModelPath:
    """The model inside the gRPC calls (transport.kind = "grpc", and the in-memory test
    transport): a resumed run's model rides in the first `seq_round` message, the final (or
    checkpoint) model in the holder's reply."""

    def __init__(self, ctx: DriverContext) -> None:
        self.ctx = ctx

    def call_round(self, node, round: int, message: Payload, resumed: bool) -> Payload:
        return self.ctx.fabric.call(node.address, node.node_id, SEQ_ROUND, message, round=round,
                                      timeout=self.ctx.run.cfg.run.round_timeout * 2)

    def final_model(self, node, round: int, reply: Payload, spec) -> Payload:
        return reply
