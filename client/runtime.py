"""Start-up of a client process: serve, register with the parent, build the host, wait."""
from __future__ import annotations

import logging
import threading

import torch

from fedhop.client.host import ClientHost
from fedhop.common.config import Config, parent_config
from fedhop.common.transport.base import Endpoint, HandlerError, Request
from fedhop.common.transport.fabric import Fabric
from fedhop.common.transport.liveness import register_with_backoff
from fedhop.common.transport.placement import process_device
from fedhop.common.util.plugins import tell_refusal
from fedhop.common.util.text import MAX_ERROR_TEXT, one_line
from fedhop.common.wire import fedhop_pb2 as pb

log = logging.getLogger("fedhop.client")



class ClientProcess:
    """One client OS process (or, in unit tests, one in-memory stand-in for it)."""

    def __init__(self, endpoint: Endpoint, parent: str, client_ids: list[int], bind: str = "127.0.0.1:0",
                 device: str = "") -> None:
        self.endpoint = endpoint
        self.device_spec = device   # --device / FEDHOP_DEVICE; "" = the config's clients.device
        self.parent = parent
        self.client_ids = client_ids
        self.host: ClientHost | None = None
        self._ready = threading.Event()
        self.address = endpoint.serve(self._handle, bind)

    def _handle(self, request: Request):
        # the parent may call as soon as it has accepted our registration, while we are still
        # building the task from the config it sent: wait for that, briefly
        if not self._ready.wait(120.0) or self.host is None:
            raise HandlerError("NOT_READY", f"{self.endpoint.node_id} has not finished registering")
        return self.host.handle(request)

    def _request(self) -> pb.RegisterRequest:
        req = pb.RegisterRequest(node_id=self.endpoint.node_id, role="client", address=self.address,
                                 token=self.endpoint.token, run_id=self.endpoint.run_id)
        add = req.clients.add   # in place: a quarter of the time of building each LogicalClient apart
        for c in self.client_ids:
            add(client_id=c)
        return req

    def register(self, timeout: float = 60.0, deadline_s: float = 120.0) -> None:
        """Register with the parent, retrying with full-jitter backoff (common/transport/liveness.py)."""
        req = self._request()
        tls = getattr(getattr(self.endpoint, "credentials", None), "tls", None) is not None
        reply = register_with_backoff(self.endpoint, self.parent, req, deadline_s=deadline_s,
                                      call_timeout=min(timeout, 10.0), tls=tls)
        if not reply.accepted:
            raise RuntimeError(f"{self.endpoint.node_id}: registration refused by {self.parent}: {reply.message}")
        try:
            cfg = parent_config(reply.config_toml, self.endpoint.node_id, self.parent, role="client")
        except RuntimeError as exc:   # e.g. PLUGIN_NOT_ALLOWED: the parent is told before this process leaves
            tell_refusal(self.endpoint, self.parent, self._request(), reply.run_id, str(exc))
            raise
        try:
            self._set_up(cfg, reply)
        except Exception as exc:   # noqa: BLE001  # the parent's config did not build here (its data, its sizes)
            why = one_line(f"{self.endpoint.node_id}: cannot set up from {self.parent}'s config: "
                           f"{type(exc).__name__}: {exc}", MAX_ERROR_TEXT)
            log.debug("set-up failed", exc_info=True)
            tell_refusal(self.endpoint, self.parent, self._request(), reply.run_id, why)
            raise RuntimeError(why) from None

    def _set_up(self, cfg: Config, reply: pb.RegisterReply) -> None:
        """The endpoint's settings and the hosted clients (`ClientHost`) from the run's config."""
        self.endpoint.run_id = reply.run_id
        self.endpoint.chunk_bytes = cfg.transport.chunk_bytes
        self.endpoint.replies_per_bundle = cfg.transport.reply_bundle   # a served batch's replies (grpc.py, Batches)
        self.endpoint.wire_compression = cfg.transport.wire_compression   # from now on (grpc.py)
        torch.set_num_threads(cfg.run.torch_threads)
        self.endpoint.use_checksum(cfg.security.checksum)
        device = process_device(self.device_spec, cfg.clients.device, "clients.device")
        if device.type != "cpu":
            self.endpoint.device = device   # received tensors land there (common/transport/placement.py)
        log.info("%s trains on %s", self.endpoint.node_id, device)
        # the parent that accepted us is the only node whose train, state and shutdown calls we obey
        self.host = ClientHost(cfg, self.endpoint.node_id, self.client_ids, reply.run_id, self.endpoint.ledger,
                               parent=reply.node_id or "server", device=device)
        self.host.fabric = Fabric(self.endpoint, max_workers=4)
        self._ready.set()

    def reregister(self, timeout: float = 10.0) -> None:
        """Register again after the parent forgot us (marked dead, or restarted), keeping the
        hosted clients' state; a parent now serving another run is an error."""
        reply = self.endpoint.register(self.parent, self._request(), timeout)
        if not reply.accepted:
            raise RuntimeError(f"{self.endpoint.node_id}: re-registration refused by {self.parent}: {reply.message}")
        if reply.run_id != self.endpoint.run_id:
            raise RuntimeError(f"{self.endpoint.node_id}: {self.parent} now serves run '{reply.run_id}', "
                               f"not '{self.endpoint.run_id}'")

    def wait(self, idle_timeout: float | None = None) -> None:
        assert self.host is not None
        self.host.shutdown_event.wait(idle_timeout)
