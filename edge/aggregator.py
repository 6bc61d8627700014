"""An edge server: aggregator for its cluster's clients, client of the server.

Hierarchical round (HierFAVG, Liu et al. 2020, Algorithm 1): the server sends the broadcast
message and the ids of this edge's sampled clients; the edge runs `kappa2` edge iterations,
each a broadcast of the edge's current message to those clients (who run kappa1 =
`algorithm.local_steps` local steps) and a reduction of their replies; between iterations the
edge applies the algorithm's `edge_step` to its own model.  It answers the server with one
partial aggregate, so the server reduces edges exactly as it would reduce clients.

The iterations are one loop (`EdgeAggregator.hierfavg`) for every transport; what varies is one
iteration's exchange with the clients, the transport's EDGE_STEP plane
(common/transport/factory.py): `ClusterFanout` here (a fan-out through the fabric, the round
arriving as `edge_round`), or edge/group_edge.py `GroupEdge` (a group round in this edge's
cluster group, the round arriving in the server's group).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, ClassVar

import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.local import get_params
from fedhop.common.config import Config
from fedhop.common.privacy import edges as dp_edges
from fedhop.common.processors.compressors.downlink import DownlinkReceiver, DownlinkSender, downlink_coding
from fedhop.common.processors.compressors.ef21 import message_for as ef21_reset_message
from fedhop.common.processors.compressors.ef21 import take_reset
from fedhop.common.processors.compressors.use import upload_coding
from fedhop.common.processors.streaming import OrderedFold, reply_budget
from fedhop.common.processors.validation import ReplyLimiter, finite_step, finite_streamed
from fedhop.common.records.checkpoint import forward_client_state, split_node_state, with_node_state
from fedhop.common.tasks import build_task
from fedhop.common.tasks.placed import place_task
from fedhop.common.topologies.graphs import cluster_assignment, topology_params
from fedhop.common.transport.base import Endpoint, HandlerError, Request
from fedhop.common.transport.control import control_of, failures_control, without_control
from fedhop.common.transport.fabric import Fabric, Send, reply_chain, upload
from fedhop.common.transport.factory import EDGE_STEP, data_plane, handler_fns
from fedhop.common.transport.liveness import unreachable
from fedhop.common.transport.router import MethodRouter, Peers
from fedhop.common.util.nodeids import client_node, edge_index
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method

log = logging.getLogger("fedhop.edge")
SHUTDOWN_TIMEOUT = 5.0   # seconds a client process may take to answer its shut-down


class EdgeAggregator:
    def __init__(self, cfg: Config, endpoint: Endpoint, run_id: str, config_toml: str, parent: str = "server",
                 device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device if device is not None else torch.device("cpu")   # edges.device
        self.endpoint = endpoint
        self.run_id = run_id
        self.config_toml = config_toml
        self.index = edge_index(endpoint.node_id)
        self.cluster = cluster_assignment(cfg)[self.index]
        self.members = frozenset(self.cluster)   # membership checks in O(1): a cluster may hold 500,000 clients
        self.algorithm = build_algorithm(cfg)
        self.params = topology_params(cfg)
        self.upload_state: dict[str, torch.Tensor] = {}   # error feedback and compressor memory of this edge's partials
        # the model's shapes, to validate client replies as the server does
        task = place_task(build_task(cfg), self.device)
        self.model_state = self.algorithm.init_state(get_params(task.build_model()))
        self.limiter = ReplyLimiter(self.algorithm, task, 2 * cfg.run.round_timeout)   # clients' claims bounded
        self.client_home: dict[int, tuple[str, str]] = {}  # client id -> (process node id, address)
        self.processes: dict[str, str] = {}                # process node id -> address
        self._cond = threading.Condition()
        self.shutdown_event = threading.Event()
        self.before_shutdown: list[Callable[[], None]] = []   # run before the reply to `shutdown`
        self.fabric = Fabric(endpoint, max_workers=32, batch=cfg.transport.batch)
        # coded broadcasts (`compression.down`, downlink.py): the server's reference this edge holds, and
        # this edge's own reference towards its client processes (both in checkpoints: `own_state`)
        coding = downlink_coding(cfg)
        self.downlink_in = DownlinkReceiver(coding) if coding is not None else None
        self.downlink_state: dict[str, torch.Tensor] = {}
        self.downlink_out = (DownlinkSender(coding, cfg.run.seed, lambda: self.downlink_state, endpoint.node_id)
                             if coding is not None else None)
        self._plane: Any = None   # this edge's EDGE_STEP plane (`plane`), made on first use
        self.router = self._routes(parent)

    # ------------------------------------------------------------------ registration of clients
    def handle_register(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        self.endpoint.record_control("register", req.node_id, self.endpoint.node_id, req.ByteSize(), "receiver",
                                     0.0, req.msg_id, self.run_id)
        token = self.endpoint.token
        foreign = [c.client_id for c in req.clients if c.client_id not in self.members]
        if token and req.token != token:
            reply = pb.RegisterReply(accepted=False, message="registration refused: wrong token")
        elif foreign:
            reply = pb.RegisterReply(accepted=False, message=f"clients {_first(foreign)} do not belong to "
                                                             f"{self.endpoint.node_id}'s cluster "
                                                             f"{_first(self.cluster)} ({len(self.cluster)} clients)")
        else:
            with self._cond:
                self.processes[req.node_id] = req.address
                for c in req.clients:
                    self.client_home[c.client_id] = (req.node_id, req.address)
                self._cond.notify_all()
            reply = pb.RegisterReply(accepted=True, run_id=self.run_id, config_toml=self.config_toml)
        reply.node_id = self.endpoint.node_id
        self.endpoint.record_control("register.reply", self.endpoint.node_id, req.node_id, reply.ByteSize(),
                                     "sender", 0.0, req.msg_id + ".reply", self.run_id)
        return reply

    def wait_for_clients(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.members.issubset(self.client_home.keys()), timeout)

    # ------------------------------------------------------------------ calls from the server
    def _routes(self, parent: str) -> MethodRouter:
        """The methods every edge serves, each obeyed only from the server (its parent); the
        sequential topology adds its own (topologies/sequential/edge.py)."""
        router = MethodRouter(self.endpoint.node_id, Peers(parent))
        router.register_all({
            Method.EDGE_ROUND: lambda request: self.edge_round(int(request.envelope.round), request.payload),
            Method.SHUTDOWN: self._shutdown_call,
            # checkpoints: the cluster's client states (common/records/checkpoint.py)
            Method.STATE_GET: self._client_state_call,
            Method.STATE_SET: self._client_state_call,
        })
        for handlers in handler_fns(self.cfg.transport.kind, "edge"):   # the transport's (its group plane)
            router.register_all(handlers(self))
        return router

    @property
    def plane(self) -> Any:
        """This edge's exchange with its clients: the transport's EDGE_STEP plane, made on first use."""
        if self._plane is None:
            self._plane = data_plane(self.cfg.transport.kind, EDGE_STEP, self.cfg.topology.kind)(self)
        return self._plane

    def use_plane(self, plane: Any) -> None:
        """A topology's own EDGE_STEP plane in place of the transport's (its spec's `edge_role`,
        e.g. secure aggregation behind edges, topologies/hierarchical/secagg_edge.py)."""
        self._plane = plane

    def group(self) -> Any:
        """This edge's side of the group data plane (the torch_* methods): the transport's
        EDGE_STEP plane where it joins groups; a transport that fans out has none."""
        plane = self.plane
        if not plane.joins_groups:
            raise HandlerError("BAD_REQUEST", f"{self.endpoint.node_id}: transport.kind = "
                                              f"'{self.cfg.transport.kind}' has no group data plane")
        return plane

    def handle(self, request: Request) -> Payload:
        env = request.envelope
        if env.run_id != self.run_id:
            raise HandlerError("WRONG_RUN", f"message for run '{env.run_id}', this edge serves '{self.run_id}'")
        return self.router.dispatch(request)

    def _client_state_call(self, request: Request) -> Payload:
        """A checkpoint's state_get: its client processes' states and this edge's own (error
        feedback of its partials, its broadcast reference); a resume's state_set: both back."""
        env = request.envelope
        own, payload = split_node_state(request.payload)
        if env.method == Method.STATE_SET and own:
            self.restore_own_state(own)
        reply = forward_client_state(self.endpoint, dict(self.processes), dict(self.client_home), env.method,
                                     int(env.round), payload, self.cfg.run.call_timeout)
        return with_node_state(reply, self.own_state()) if env.method == Method.STATE_GET else reply

    def own_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this edge: 'upload/KEY' and 'downlink/KEY'."""
        return {**{f"upload/{k}": t for k, t in self.upload_state.items()},
                **{f"downlink/{k}": t for k, t in self.downlink_state.items()}}

    def restore_own_state(self, own: dict[str, torch.Tensor]) -> None:
        for name, t in own.items():
            part, _, key = name.partition("/")
            if part == "upload" and key:
                self.upload_state[key] = t
            elif part == "downlink" and key:
                self.downlink_state[key] = t
            else:
                raise PayloadError("BAD_NAME", f"edge state tensor '{name}' is neither 'upload/KEY' nor 'downlink/KEY'")

    def _shutdown_call(self, request: Request) -> Payload:
        self.shutdown_clients(int(request.envelope.round))
        for hook in self.before_shutdown:   # e.g. stop heartbeats, before the server merges the ledgers
            hook()
        self.shutdown_event.set()
        return Payload(scalars={"clients": len(self.cluster)})

    def edge_round(self, round: int, message: Payload) -> Payload:
        """A round that arrives as a call (the fan-out transports): the iterations, then one
        partial (QSGD-coded where configured) with the failures and unavailable clients."""
        if self.downlink_in is not None:   # a coded broadcast: the server's reference model it brings
            message = self.downlink_in.receive(message, f"round {round} message to {self.endpoint.node_id}")
        message = take_reset(message, self.upload_state)   # EF21: the server reset its copy of this edge's estimate
        sampled = list(control_of(message).clients)   # the server's sample in this edge's cluster
        message = without_control(message)           # what the clients get: the server's tensors and scalars
        self.check_sampled(sampled)
        dp_edges.begin_round(self.algorithm, message)   # [privacy]: the round's clipping norm C
        partial, failures = self.hierfavg(round, sampled, message)
        if partial is None:
            raise HandlerError("NO_RESULTS", f"none of {self.endpoint.node_id}'s {len(sampled)} sampled clients "
                                             f"returned a result: {failures}")
        partial = dp_edges.release(self.algorithm, partial, len(sampled), self.index, round)   # noise_at = "edges"
        partial.control = failures_control(failures)
        gone = self.unavailable_processes()   # reported to the server, which samples around their clients
        if gone:   # not a walk over every hosted client each round
            partial.control.clients.extend(sorted(c for c, (node, _) in self.client_home.items() if node in gone))
        partial.control.processes.extend(sorted(gone))
        # coded where configured (common/processors/pipeline.py); error feedback's residuals kept in memory
        return upload(self.cfg, partial, self.endpoint.node_id, round, 0, Method.EDGE_ROUND,
                      state=self.upload_state)

    def check_sampled(self, sampled: list[int]) -> None:
        stray = [c for c in sampled if c not in self.members]
        if stray:
            raise HandlerError("UNKNOWN_CLIENT", f"clients {_first(stray)} are not in {self.endpoint.node_id}'s cluster")

    def hierfavg(self, round: int, sampled: list[int], message: Payload) -> tuple[Payload | None, dict[int, str]]:
        """HierFAVG's kappa2 edge iterations (Liu et al. 2020, Algorithm 1) from the server's
        `message`: each one the transport's exchange with the live sampled clients
        (`plane.step`: their partial and failures), then `edge_step` to the edge model between
        iterations.  An iteration without a partial (no client answered, or every answer left
        out as NaN/Inf) ends them; the edge then answers with the last partial it has.  With
        kappa2 > 1 the answer is the algorithm's `edge_partial`: the edge model's change, from
        the model that last partial was trained from.  Returns the partial (None when the first
        iteration had none) and the failures by client."""
        kappa2 = getattr(self.params, "kappa2", 1)
        start = base = message   # base: the edge model the last partial was trained from
        failures: dict[int, str] = {}
        partial: Payload | None = None
        for k in range(kappa2):
            live = [c for c in sampled if c not in failures]
            if not live:
                break
            part, failed = self.plane.step(round, k, live, message)
            failures.update(failed)
            if part is None:
                break
            partial, base = part, message
            if k < kappa2 - 1:
                message = self.algorithm.edge_step(message, partial)
        if partial is not None and kappa2 > 1:
            partial = self.algorithm.edge_partial(start, base, partial)   # (base + its mean delta) - start
        return partial, failures

    def collect(self, clients: list[int], round: int, step: int, message: Payload, stream: bool = False):
        """Send `message` to `clients` (one encoding), gather replies checked against the
        algorithm's reply spec for this edge's model, and failures.  `stream`: fold
        the replies in client-id order as they arrive (common/processors/streaming.py); the replies are then
        a StreamedResults of their scalars."""
        spec = self.algorithm.reply_spec(self.model_state)
        rules = self.algorithm.reply_scalars()
        failures: dict[int, str] = {}
        requests = []
        down = self.downlink_out
        for_receiver = down.code(message) if down is not None else (lambda receiver: message)
        coding = upload_coding(self.cfg)
        ef21 = coding is not None and coding.ef21
        for c in clients:
            if c not in self.client_home:
                failures[c] = f"UNKNOWN_CLIENT: client {c} never registered with {self.endpoint.node_id}"
                continue
            check = reply_chain(self.cfg, spec, Method.TRAIN, rules, self.limiter.limits([c]), round=round,
                                peer=client_node(c), memory=self.upload_state,   # EF21: the edge's copies
                                folded=stream)
            to_client = for_receiver(self.client_home[c][0])
            if ef21:
                to_client = ef21_reset_message(to_client, self.upload_state, client_node(c))
            requests.append(Send(c, self.client_home[c][1], client_node(c), Method.TRAIN, to_client, step=step,
                                 inbound=check, who=f"round {round} step {step} reply of client {c}"))
        fold = (OrderedFold(list(sorted(req.key for req in requests)), self.algorithm.reply_reduce, reply_budget(spec, 1.0))
                if stream else None)   # in client-id order, as `finite_step` aggregates
        replies, failed = self.fabric.send_and_receive(requests, round=round, timeout=self.cfg.run.round_timeout,
                                                       call_timeout=self.cfg.run.call_timeout,
                                                       timeout_reason=f"timeout at {self.endpoint.node_id}", fold=fold)
        failures.update(failed)
        self.suspect_failed(failed)
        if down is not None:   # a process with an answering client holds the edge's new reference
            answered: dict[str, bool] = {}
            for req in requests:
                node = self.client_home[req.key][0]
                answered[node] = answered.get(node, False) or req.key in replies
            down.delivered(answered)
        return replies, failures

    def suspect_failed(self, failed: dict[int, str]) -> None:
        """Client processes whose calls failed as a dead process's do (common/transport/liveness.py
        `unreachable`): suspect at once in this edge's liveness monitor, and so reported to the
        server in the next reply (`edge_round`)."""
        monitor = getattr(self.endpoint, "liveness", None)
        if monitor is None:
            return
        for c, why in sorted(failed.items()):
            if c in self.client_home and unreachable(why):
                monitor.suspect(self.client_home[c][0], why)

    def unavailable_processes(self) -> set[str]:
        """This cluster's client processes that the liveness monitor marked dead or suspect."""
        monitor = getattr(self.endpoint, "liveness", None)
        if monitor is None:
            return set()
        return monitor.unavailable_nodes() & set(self.processes)

    def shutdown_clients(self, round: int) -> None:
        bye = Payload()
        _, failures = self.fabric.send_to_all([Send(node, address, node, Method.SHUTDOWN, bye)
                                               for node, address in sorted(self.processes.items())],
                                              round=round, call_timeout=SHUTDOWN_TIMEOUT)
        for node, why in sorted(failures.items()):
            log.warning("shutdown of %s failed: %s", node, why)
        self.fabric.close()


class ClusterFanout:
    """The EDGE_STEP plane of the fan-out transports (gRPC, in-memory): one edge iteration is
    a fan-out of the message to the clients through the fabric (`EdgeAggregator.collect`,
    folded as the replies arrive where the algorithm streams), their replies aggregated in
    client-id order; a sum holding NaN/Inf leaves its worst reply out (common/processors/validation.py)."""

    joins_groups: ClassVar[bool] = False

    def __init__(self, aggregator: EdgeAggregator) -> None:
        self.agg = aggregator

    def step(self, round: int, step: int, clients: list[int], message: Payload
             ) -> tuple[Payload | None, dict[int, str]]:
        agg = self.agg
        replies, failures = agg.collect(clients, round, step, message, stream=agg.algorithm.streams())
        if not replies:
            return None, failures
        fold = getattr(replies, "fold", None)   # folded as they arrived (common/processors/streaming.py)
        if fold is not None:   # a sum that is not finite: the worst named, no partial this time
            partial, blamed = finite_streamed(agg.algorithm, None, fold.result(), fold.magnitudes, round)
        else:
            partial, blamed = finite_step(agg.algorithm, None, replies, round)   # NaN/Inf sums: offender out
        failures.update(blamed)
        return partial, failures


def _first(ids: list[int], shown: int = 10) -> str:
    """At most `shown` of `ids` for a message, with how many more there are."""
    return str(ids) if len(ids) <= shown else f"{ids[:shown]} and {len(ids) - shown} more"
