"""Start-up of an edge process: serve, register with the server, wait for the cluster's
clients, announce them to the server, then serve rounds until shut down."""
from __future__ import annotations

import logging
import threading

from fedhop.common.config import parent_config
from fedhop.common.topologies import spec_for
from fedhop.common.transport.base import Endpoint, HandlerError, Request
from fedhop.common.transport.liveness import register_with_backoff
from fedhop.common.transport.placement import process_device
from fedhop.common.util.plugins import tell_refusal
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.edge.aggregator import EdgeAggregator

log = logging.getLogger("fedhop.edge")


class EdgeProcess:
    def __init__(self, endpoint: Endpoint, parent: str, bind: str = "127.0.0.1:0", device: str = "") -> None:
        self.endpoint = endpoint
        self.parent = parent
        self.device_spec = device   # --device / FEDHOP_DEVICE; "" = the config's edges.device
        self.aggregator: EdgeAggregator | None = None
        self.topology_role = None   # what the topology's spec adds beside the aggregator (`edge_role`)
        self._ready = threading.Event()
        # a client may arrive before this edge has its run from the server: it is held (its address
        # probe too, which names the run) until the edge knows it
        endpoint.registration_wait = self._hold_until_ready
        self.address = endpoint.serve(self._handle, bind, register_handler=self._register)

    @property
    def sequential(self):
        """The Fed-CHS role (topologies/sequential/edge.py) of a sequential run: this edge's `topology_role`."""
        return self.topology_role

    def _handle(self, request: Request):
        if self.aggregator is None:
            raise HandlerError("NOT_READY", f"{self.endpoint.node_id} has not finished registering")
        return self.aggregator.handle(request)

    def _register(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        if req.refusal:   # a client process refuses the run's config: the server fails the run
            return self._pass_refusal(req)
        assert self.aggregator is not None   # `_hold_until_ready` let the registration through
        return self.aggregator.handle_register(req)

    def _hold_until_ready(self, req: pb.RegisterRequest) -> str | None:
        """The endpoint's `registration_wait`: hold a registration for up to a minute until this
        edge has its run and config from the server, else refuse it (the client tries again)."""
        if self._ready.wait(60.0) and self.aggregator is not None:
            return None
        return f"{self.endpoint.node_id} is not registered with the server; cannot accept clients yet"

    def _pass_refusal(self, req: pb.RegisterRequest) -> pb.RegisterReply:
        """A child's refusal of the config, passed to the server in this edge's name (the
        server knows the edge; the refusal text names the client process and the plug-in)."""
        log.error("%s", req.refusal)
        known = self.aggregator is not None and any(node == req.node_id
                                                    for node, _ in list(self.aggregator.client_home.values()))
        if not known:
            return pb.RegisterReply(accepted=False, message=f"{req.node_id} is not a registered client process of "
                                                            f"{self.endpoint.node_id}")
        relay = pb.RegisterRequest(node_id=self.endpoint.node_id, role="edge", address=self.address,
                                   token=self.endpoint.token, run_id=self.endpoint.run_id,
                                   refusal=f"{req.refusal} (via {self.endpoint.node_id})")
        try:
            self.endpoint.register(self.parent, relay, 10.0)
        except Exception as exc:   # the server is gone: the edge's own timeouts end it
            log.warning("could not pass %s's refusal to %s: %s", req.node_id, self.parent, exc)
        return pb.RegisterReply(accepted=True, run_id=self.endpoint.run_id, message="refusal passed to the server")

    def register_with_parent(self, clients: list[int], timeout: float, attempts: int = 30) -> pb.RegisterReply:
        req = pb.RegisterRequest(node_id=self.endpoint.node_id, role="edge", address=self.address,
                                 token=self.endpoint.token, run_id=self.endpoint.run_id,
                                 clients=[pb.LogicalClient(client_id=c) for c in clients])
        tls = getattr(getattr(self.endpoint, "credentials", None), "tls", None) is not None
        reply = register_with_backoff(self.endpoint, self.parent, req, deadline_s=attempts * 4.0,
                                      call_timeout=min(timeout, 10.0), tls=tls)   # full-jitter backoff
        if not reply.accepted:
            raise RuntimeError(f"{self.endpoint.node_id}: registration refused by {self.parent}: {reply.message}")
        return reply

    def start(self, client_timeout: float = 120.0) -> None:
        reply = self.register_with_parent([], timeout=60.0)
        try:
            cfg = parent_config(reply.config_toml, self.endpoint.node_id, self.parent, role="edge")   # allow-list
        except RuntimeError as exc:   # e.g. PLUGIN_NOT_ALLOWED: the server is told before this edge leaves
            request = pb.RegisterRequest(node_id=self.endpoint.node_id, role="edge", address=self.address,
                                         token=self.endpoint.token)
            tell_refusal(self.endpoint, self.parent, request, reply.run_id, str(exc))
            raise
        self.endpoint.run_id = reply.run_id
        self.endpoint.chunk_bytes = cfg.transport.chunk_bytes
        self.endpoint.wire_compression = cfg.transport.wire_compression   # from now on (grpc.py)
        self.endpoint.use_checksum(cfg.security.checksum)   # before any client registers or any call comes
        device = process_device(self.device_spec, cfg.edges.device, "edges.device")
        if device.type != "cpu":
            self.endpoint.device = device   # received tensors land there (common/transport/placement.py)
        log.info("%s computes on %s", self.endpoint.node_id, device)
        aggregator = EdgeAggregator(cfg, self.endpoint, reply.run_id, reply.config_toml, parent=reply.node_id or "server",
                                    device=device)
        topology_role = spec_for(cfg.topology.kind).edge_role_class()   # e.g. topologies/sequential/edge.py (Fed-CHS)
        if topology_role is not None:
            self.topology_role = topology_role(aggregator)
        self.aggregator = aggregator
        self._ready.set()
        if not self.aggregator.wait_for_clients(client_timeout):
            missing = sorted(self.aggregator.members.difference(self.aggregator.client_home))
            raise RuntimeError(f"{self.endpoint.node_id}: clients {missing[:10]} never registered")
        self.register_with_parent(self.aggregator.cluster, timeout=60.0)

    def wait(self, timeout: float | None = None) -> None:
        assert self.aggregator is not None
        self.aggregator.shutdown_event.wait(timeout)
