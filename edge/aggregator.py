"""An edge server: aggregator for its cluster's clients, client of the server.

Hierarchical round (HierFAVG, Liu et al. 2020, Algorithm 1): the server sends the broadcast
message and the ids of this edge's sampled clients; the edge runs `kappa2` edge iterations,
each a broadcast of the edge's current message to those clients (who run kappa1 =
`algorithm.local_steps` local steps) and a reduction of their replies; between iterations the
edge applies the algorithm's `edge_step` to its own model.  It answers the server with one
partial aggregate, so the server reduces edges exactly as it would reduce clients.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import Payload
from fedhop.common.algorithms.local import get_params
from fedhop.common.tasks import build_task
from fedhop.common.checkpoint import STATE_GET, STATE_SET, forward_client_state
from fedhop.common.codec import PayloadError
from fedhop.common.compress import compress_upload, decompress_upload
from fedhop.common.validation import ReplyLimiter, finite_step, reply_bound, validate_reply
from fedhop.common.config import Config
from fedhop.common.topology import cluster_assignment, edge_index, topology_params
from fedhop.common.transport.base import CallFailed, Endpoint, HandlerError, RemoteError, Request
from fedhop.common.wire import fedhop_pb2 as pb

log = logging.getLogger("fedhop.edge")


class EdgeAggregator:
    def __init__(self, cfg: Config, endpoint: Endpoint, run_id: str, config_toml: str) -> None:
        self.cfg = cfg
        self.endpoint = endpoint
        self.run_id = run_id
        self.config_toml = config_toml
        self.index = edge_index(endpoint.node_id)
        self.cluster = cluster_assignment(cfg)[self.index]
        self.algorithm = build_algorithm(cfg)
        self.params = topology_params(cfg)
        # the model's shapes, to validate client replies as the server does
        task = build_task(cfg)
        self.model_state = self.algorithm.init_state(get_params(task.build_model()))
        self.limiter = ReplyLimiter(self.algorithm, task, 2 * cfg.run.round_timeout)   # clients' claims bounded
        self.client_home: dict[int, tuple[str, str]] = {}  # client id -> (process node id, address)
        self.processes: dict[str, str] = {}                # process node id -> address
        self._cond = threading.Condition()
        self.shutdown_event = threading.Event()
        self.before_shutdown: list[Callable[[], None]] = []   # run before the reply to `shutdown`
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix=f"{endpoint.node_id}-call")

    # ------------------------------------------------------------------ registration of clients
    def handle_register(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        self.endpoint.record_control("register", req.node_id, self.endpoint.node_id, req.ByteSize(), "receiver",
                                     0.0, req.msg_id, self.run_id)
        token = self.endpoint.token
        foreign = [c.client_id for c in req.clients if c.client_id not in self.cluster]
        if token and req.token != token:
            reply = pb.RegisterReply(accepted=False, message="registration refused: wrong token")
        elif foreign:
            reply = pb.RegisterReply(accepted=False, message=f"clients {foreign} do not belong to "
                                                             f"{self.endpoint.node_id}'s cluster {self.cluster}")
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
            return self._cond.wait_for(lambda: set(self.cluster) <= set(self.client_home), timeout)

    # ------------------------------------------------------------------ calls from the server
    def handle(self, request: Request) -> Payload:
        env = request.envelope
        if env.run_id != self.run_id:
            raise HandlerError("WRONG_RUN", f"message for run '{env.run_id}', this edge serves '{self.run_id}'")
        if env.method == "edge_round":
            return self.edge_round(int(env.round), request.payload)
        if env.method.startswith("torch_"):   # transport.kind = "torch" (edge/torch_edge.py)
            from fedhop.edge.torch_edge import torch_edge_of
            return torch_edge_of(self).handle(env.method, int(env.round), request.payload)
        if env.method in (STATE_GET, STATE_SET):   # checkpoints: the cluster's client states (common/checkpoint.py)
            return forward_client_state(self.endpoint, dict(self.processes), dict(self.client_home), env.method,
                                        int(env.round), request.payload, self.cfg.run.call_timeout)
        if env.method == "shutdown":
            self.shutdown_clients(int(env.round))
            for hook in self.before_shutdown:   # e.g. stop heartbeats, before the server merges the ledgers
                hook()
            self.shutdown_event.set()
            return Payload(scalars={"clients": len(self.cluster)})
        raise HandlerError("UNKNOWN_METHOD", f"{self.endpoint.node_id} does not serve '{env.method}'")

    def edge_round(self, round: int, message: Payload) -> Payload:
        spec = message.scalars.pop("edge_clients", "")
        if not isinstance(spec, str):
            raise PayloadError("BAD_SCALAR", "edge_clients must be a comma-separated string of client ids")
        sampled = [int(c) for c in spec.split(",") if c]
        stray = [c for c in sampled if c not in self.cluster]
        if stray:
            raise HandlerError("UNKNOWN_CLIENT", f"clients {stray} are not in {self.endpoint.node_id}'s cluster")
        kappa2 = getattr(self.params, "kappa2", 1)
        start = message
        failures: dict[int, str] = {}
        partial: Payload | None = None
        for k in range(kappa2):
            live = [c for c in sampled if c not in failures]
            replies, failed = self._collect(live, round, k, message)
            failures.update(failed)
            if not replies:
                break
            partial, blamed = finite_step(self.algorithm, None, replies, round)   # NaN/Inf sums: offender out
            failures.update(blamed)
            if partial is None:
                break
            if k < kappa2 - 1:
                message = self.algorithm.edge_step(message, partial)
        if partial is None:
            raise HandlerError("NO_RESULTS", f"none of {self.endpoint.node_id}'s {len(sampled)} sampled clients "
                                             f"returned a result: {failures}")
        if kappa2 > 1:
            partial = self.algorithm.edge_partial(start, message, partial)
        partial.scalars["failures_json"] = json.dumps({str(c): why for c, why in sorted(failures.items())})
        return compress_upload(self.cfg, partial, self.endpoint.node_id, round, 0)   # QSGD uploads (common/compress.py)

    def _collect(self, clients: list[int], round: int, step: int, message: Payload, spec=None):
        """Send `message` to `clients` (one encoding), gather replies checked against `spec`
        (default: the algorithm's reply spec for this edge's model) and failures."""
        prepared = self.endpoint.prepare(message)
        futures = {c: self._pool.submit(self._train_one, c, round, step, prepared, spec) for c in clients}
        _, pending = wait(futures.values(), timeout=self.cfg.run.round_timeout)
        replies, failures = {}, {}
        for c, fut in futures.items():
            if fut in pending:
                failures[c] = f"timeout at {self.endpoint.node_id}"
                continue
            try:
                replies[c] = fut.result()
            except (CallFailed, RemoteError, PayloadError, HandlerError) as exc:
                failures[c] = str(exc)
        return replies, failures

    def _train_one(self, cid: int, round: int, step: int, prepared, spec=None) -> Payload:
        if cid not in self.client_home:
            raise HandlerError("UNKNOWN_CLIENT", f"client {cid} never registered with {self.endpoint.node_id}")
        _, address = self.client_home[cid]
        spec = spec if spec is not None else self.algorithm.reply_spec(self.model_state)
        reply = self.endpoint.call(address, f"client-{cid}", "train", round=round, step=step,
                                   timeout=self.cfg.run.call_timeout, prepared=prepared, expect=reply_bound(spec))
        reply = decompress_upload(self.cfg, reply, spec)   # QSGD
        validate_reply(reply, spec, f"round {round} step {step} reply of client {cid}", self.algorithm.reply_scalars(),
                       self.limiter.limits([cid]))
        return reply

    def shutdown_clients(self, round: int) -> None:
        for node, address in sorted(self.processes.items()):
            try:
                self.endpoint.call(address, node, "shutdown", Payload(), round=round, timeout=5.0)
            except (CallFailed, RemoteError) as exc:
                log.warning("shutdown of %s failed: %s", node, exc)
        self._pool.shutdown(wait=False, cancel_futures=True)
