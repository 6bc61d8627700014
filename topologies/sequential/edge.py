"""Fed-CHS at one edge (Yan et al., Algorithm 1; digest shared/research/seed-004.md section 2).

The edges sit on a graph and pass one model token; the server never holds it.  The methods:

- `seq_round` (server -> the edge holding the token, round t, no tensors): run the round's K
  steps with this edge's clients (each a broadcast of w_k and one reply per client, reduced
  data-weighted, then the step: `FedCHS.cluster_round`), evaluate the model when the server asks, pick
  the next edge and hand the model to it.  The reply carries the round's metrics, the chosen
  edge and the skipped ones, and, in the last round (and checkpoint rounds), the model.  The first call
  (`start`) makes this edge m(0): it builds w^0 from the run's seeded initialisation, as every
  process can.
- `control.seq_query` (edge -> neighbour, a `control` message): the neighbour's visit count
  c(m') and cluster data size D_{A,m'}.
- `seq_handoff` (edge -> next edge, link edge-edge): the model w^{t+1}; the receiver counts
  the visit, c(m(t+1)) += 1, and holds the token for round t + 1.

- `seq_final` (server -> the last round's edge; transport.kind = "torch" only): send the final
  model to the server as a point-to-point `dist.send`.
- Checkpoints (docs/topologies.md): `seq_round` with `checkpoint` makes the holder also send the
  round's model to the server (in the reply, or kept for `seq_final` over torch); after a resume
  `control.seq_restore` (server only) sets this edge's visit count, and `seq_round` with `resume`
  brings the checkpoint's model (in the message, or as a dist.send from the server).

With `[transport] kind = "torch"` (docs/torch_transport.md) the tensors travel as
torch.distributed operations and the gRPC calls above carry only control: each step's
broadcast and reduce run in this edge's cluster group (edge/group_edge.py `GroupEdge.step`), the
hand-off is a `dist.send` to the next edge's rank (the `seq_handoff` call tells it to post the
matching `dist.recv`), and the final model is a `dist.send` to the server (rank 0).

Next edge: `FedCHS.next_holder` over the neighbours that answered the query
(least visits, largest D_A, smallest id).  If the chosen edge does not take the hand-off the
token goes to the next one in that order; every neighbour passed over is reported to the
server (which records a `handoff_skipped` event).  If no neighbour takes it the edge keeps
the token and runs the next round itself (counted as a visit).
"""
from __future__ import annotations

import logging
import math
import threading

import torch

from fedhop.common.algorithms.fedchs import FedCHS, NoClusterReplies, VisitCount
from fedhop.common.algorithms.local import get_params, set_params
from fedhop.common.processors.pipeline import model_chain
from fedhop.common.tasks import build_task
from fedhop.common.tasks.placed import place_task
from fedhop.common.topologies.graphs import SEQ_METRIC_PREFIX, topology_params
from fedhop.common.transport.base import CallFailed, HandlerError, RemoteError, Request
from fedhop.common.transport.control import control_of, failures_control
from fedhop.common.transport.fabric import Send
from fedhop.common.transport.factory import data_plane
from fedhop.common.util.nodeids import edge_node
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.topologies.sequential import (
    EDGE_PATHS,
    SEQ_EDGE_PATH,
    SEQ_FINAL,
    SEQ_HANDOFF,
    SEQ_QUERY,
    SEQ_RESTORE,
    SEQ_ROUND,
)
from fedhop.topologies.sequential.rule import edge_graph

log = logging.getLogger("fedhop.edge")


class SequentialEdge:
    def __init__(self, aggregator) -> None:
        self.agg = aggregator
        self.cfg = aggregator.cfg
        self.endpoint = aggregator.endpoint
        self.index = aggregator.index
        self.algorithm: FedCHS = aggregator.algorithm
        self.params = topology_params(self.cfg)
        self.neighbours = edge_graph(self.cfg)[self.index]
        self.task = place_task(build_task(self.cfg), aggregator.device)
        self.model = self.task.build_model()
        self.spec = self.algorithm.reply_spec(aggregator.model_state)
        self.data_size = sum(self.task.num_samples(c) for c in aggregator.cluster)   # D_{A,m}
        self.visits = VisitCount(self.params.count_start)   # c(m)
        self.token: dict[str, torch.Tensor] | None = None
        self.token_round = 0                              # the round the held token is for
        self.model_in = model_chain(self.spec, SEQ_HANDOFF)   # every model that arrives (common/processors/pipeline.py)
        # how the model moves: the transport's model path (common/transport/factory.py)
        self.path = data_plane(self.cfg.transport.kind, SEQ_EDGE_PATH, self.cfg.topology.kind, EDGE_PATHS)(self)
        self._lock = threading.Lock()
        self._routes()

    # ------------------------------------------------------------------ methods
    def _routes(self) -> None:
        """Add Fed-CHS's methods to the edge's router: hand-offs only from neighbours in the
        edge graph, the neighbour query from them or the server, the rest from the server."""
        router = self.agg.router
        router.set_neighbours(edge_node(e) for e in self.neighbours)
        router.register_all({
            SEQ_ROUND: lambda request: self.run_round(int(request.envelope.round), request.payload),
            SEQ_HANDOFF: lambda request: self.take_handoff(request.envelope.src, int(request.envelope.round),
                                                                  request.payload),
            SEQ_FINAL: lambda request: self.path.send_final(int(request.envelope.round)),
            SEQ_QUERY: self._query_call,
            SEQ_RESTORE: self._restore_call,
        })

    def _query_call(self, request: Request) -> Payload:
        with self._lock:
            return Payload(scalars={"visits": self.visits.value, "data_size": self.data_size})

    def _restore_call(self, request: Request) -> Payload:
        """A resumed run: the visit count at its checkpoint."""
        visits = request.payload.scalars.get("visits")
        if not isinstance(visits, int) or isinstance(visits, bool) or visits < 0:
            raise HandlerError("BAD_REQUEST", f"control.seq_restore needs a visit count >= 0, got {visits!r}")
        with self._lock:
            self.visits.value = visits
            return Payload(scalars={"visits": self.visits.value})

    def take_handoff(self, src: str, round: int, payload: Payload) -> Payload:
        # the router let only a neighbour in the edge graph call this (common/wire/methods.py)
        model = self.path.handoff_model(src, round, payload)
        with self._lock:
            self.token = {k: v.clone() for k, v in model.items()}
            self.token_round = round + 1
            self.visits.arrived()                         # c(m(t+1)) += 1
            return Payload(scalars={"visits": self.visits.value})

    # ------------------------------------------------------------------ one round
    def run_round(self, round: int, message: Payload) -> Payload:
        sc = message.scalars
        resumed = self.path.resumed_model(round, message) if sc.get("resume", False) else None
        with self._lock:
            if resumed is not None:   # the checkpoint's model; its visit was counted before the checkpoint
                self.token, self.token_round = resumed, round
            elif sc.get("start", False):
                self.token = {k: v.clone() for k, v in get_params(self.task.build_model()).items()}   # w^0
                self.token_round = round
                self.visits.started_here()
            if self.token is None or self.token_round != round:
                raise HandlerError("NO_TOKEN", f"{self.endpoint.node_id} holds no model for round {round}")
            w = self.token
            self.token = None
        try:
            done = self.algorithm.cluster_round(w, lambda k, message: self._step(round, k, message),
                                                self.params.steps_per_round)
        except NoClusterReplies as exc:
            raise HandlerError("NO_RESULTS", f"no client of {self.endpoint.node_id} answered step {exc.k} of round "
                                             f"{round}: {exc.failures}") from None
        w = done.params
        out = Payload(scalars={"edge": self.index}, control=failures_control(done.failures))
        if done.weight_sum:
            out.scalars["client_train_loss"] = done.loss_sum / done.weight_sum
        if sc.get("evaluate", False):
            set_params(self.model, w)
            with torch.no_grad():
                for name, value in self.task.evaluate(self.model).items():
                    if math.isfinite(float(value)):
                        out.scalars[SEQ_METRIC_PREFIX + name] = float(value)
        if sc.get("last", False) or sc.get("checkpoint", False):
            # the final model, or the model a checkpoint after this round saves: the only models
            # that reach the server
            self.path.final_model(w, out)
        if sc.get("last", False):
            out.scalars["next_edge"] = -1
            return out
        peers = {int(p.edge): p.address for p in control_of(message).peers}
        nxt, skipped, answers = self._hand_off(round, w, peers)
        out.scalars["next_edge"] = nxt
        assert out.control is not None   # failures_control made it
        out.control.skipped.extend(pb.SkippedEdge(edge=e, reason=why) for e, why in skipped)
        out.control.neighbours.extend(pb.NeighbourAnswer(edge=e, visits=v, data_size=d)
                                      for e, (v, d) in sorted(answers.items()))
        return out

    def _step(self, round: int, step: int, message: Payload) -> tuple[Payload | None, dict[int, str]]:
        """One intra-round step: the cluster's replies to `message`, reduced data-weighted (None
        when no client answered), and the clients that failed."""
        return self.path.cluster_step(round, step, message)

    # ------------------------------------------------------------------ selection and hand-off
    def _hand_off(self, round: int, w: dict[str, torch.Tensor], peers: dict[int, str]):
        """Query the neighbours (control), rank them, hand the model to the first that takes it.
        Returns (next edge, [(edge, why), ...] passed over, {edge: (visits, data size)})."""
        answers: dict[int, tuple[int, int]] = {}
        skipped: list[tuple[int, str]] = []
        query = Payload()
        replies, failures = self.agg.fabric.send_to_all(
            [Send(e, peers[e], edge_node(e), SEQ_QUERY, query) for e in self.neighbours if e in peers],
            round=round, call_timeout=self.cfg.run.call_timeout)
        for e in self.neighbours:   # in neighbour order, as the events list the passed-over edges
            if e not in peers:
                skipped.append((e, "not registered with the server"))
            elif e in failures:
                skipped.append((e, f"no answer to the neighbour query: {failures[e]}"))
            else:
                try:
                    answers[e] = (int(replies[e].scalars["visits"]), int(replies[e].scalars["data_size"]))
                except (KeyError, ValueError) as exc:
                    skipped.append((e, f"no answer to the neighbour query: {exc}"))
        # the hand-off stays serial: the next neighbour is tried only when the previous one refused the model
        for e in self.algorithm.next_holder(answers):
            try:
                self.path.send_model(round, e, peers[e], w)
                return e, skipped, answers
            except (CallFailed, RemoteError, PayloadError) as exc:
                skipped.append((e, f"hand-off failed: {exc}"))
        log.warning("round %d: no neighbour took the model; %s keeps it", round, self.endpoint.node_id)
        with self._lock:
            self.token, self.token_round = w, round + 1
            self.visits.arrived()
        return self.index, skipped, answers


class EdgeInlineModelPath:
    """The model inside the gRPC calls (transport.kind = "grpc", and the in-memory test
    transport): the cluster step is a fan-out through the fabric, the hand-off carries the
    tensors, the final (or checkpoint) model rides in the `seq_round` reply."""

    def __init__(self, edge: SequentialEdge) -> None:
        self.edge = edge

    def cluster_step(self, round: int, step: int, message: Payload) -> tuple[Payload | None, dict[int, str]]:
        """The fan-out transports' cluster step (edge/aggregator.py `ClusterFanout.step`, HierFAVG's
        too): the replies folded in client-id order, a sum that is not finite leaving its worst
        reply out (NON_FINITE_AGGREGATE, reported with the step's failures)."""
        agg = self.edge.agg
        return agg.plane.step(round, step, list(agg.cluster), message)

    def handoff_model(self, src: str, round: int, payload: Payload) -> dict[str, torch.Tensor]:
        return self.edge.model_in(payload, f"hand-off from {src}")

    def resumed_model(self, round: int, message: Payload) -> dict[str, torch.Tensor]:
        return self.edge.model_in(message, f"resumed model for round {round}")

    def send_model(self, round: int, peer: int, address: str, w: dict[str, torch.Tensor]) -> None:
        self.edge.agg.fabric.call(address, edge_node(peer), SEQ_HANDOFF, Payload(tensors=w), round=round,
                                  timeout=self.edge.cfg.run.call_timeout)

    def final_model(self, w: dict[str, torch.Tensor], reply: Payload) -> None:
        reply.tensors = dict(w)

    def send_final(self, round: int) -> Payload:
        raise HandlerError("BAD_REQUEST", f"{self.edge.endpoint.node_id}: {SEQ_FINAL.value} is for "
                                          f"transport.kind = 'torch'; the final model came in the round's reply")

