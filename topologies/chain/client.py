"""The clients' side of the chain topology (WRWGD; topologies/chain/rule.py has the rule, topologies/chain/driver.py
the server's control plane).

A client process holds the walking model while one of its logical clients is the holder.
`walk_visit` (from the server, no tensors except on resume): run the holder's local steps from
the model, take the importance-weighted step w <- w + (p_i / pi_i) Delta_i, draw the next
client and hand the model to it with `walk_handoff` (link client-client), then answer with the
next holder.  `walk_handoff` (from a graph neighbour): the model, checked against the model's
spec, kept for the next visit.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

import torch

from fedhop.common.algorithms.local import get_params, set_params
from fedhop.common.processors.pipeline import model_chain
from fedhop.common.topologies.graphs import SEQ_METRIC_PREFIX, shown_row
from fedhop.common.transport.base import CallFailed, HandlerError, RemoteError, Request
from fedhop.common.transport.control import control_of
from fedhop.common.util.nodeids import client_id_of, client_node
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method
from fedhop.topologies.chain import WALK_HANDOFF, WALK_VISIT
from fedhop.topologies.chain.rule import WalkRule

if TYPE_CHECKING:
    from fedhop.client.host import ClientHost


log = logging.getLogger("fedhop.client")

MAX_PENDING_PER_PEER = 2   # hand-offs kept aside per calling process (an honest one has one in flight)


class WalkHost:
    """The walk's state in one client process: the model, when a hosted client holds it."""

    def __init__(self, host: ClientHost) -> None:
        self.host = host
        cfg = host.cfg
        sizes = [host.task.num_samples(c) for c in range(cfg.clients.count)]
        self.rule = WalkRule.from_config(cfg, sizes)
        params = get_params(host.task.build_model())   # the run's seeded initial model, as the server builds it
        self.spec = {k: (v.dtype, tuple(v.shape)) for k, v in params.items()}
        self.model_in = model_chain(self.spec, WALK_HANDOFF)   # every model that arrives (common/processors/pipeline.py)
        self.handoffs: set[tuple] = set()   # (round, hop, sender, process) of the hand-offs used
        # hand-offs received, kept aside until the server's visit names the one it continues:
        # (round, hop, sender client, calling process) -> model
        self.pending: dict[tuple, dict[str, torch.Tensor]] = {}
        self.hosts: dict[int, str] = {}   # client -> the process hosting it, as the server's visits name it
        self.latest: tuple[int, int] | None = None   # (round, hop) of the latest visit to this process
        self.initial = params
        self.model: dict[str, torch.Tensor] | None = None
        self.holder: int | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ walk_handoff
    def take_handoff(self, src: str, dst: str, round: int, hop: int, payload: Payload) -> Payload:
        """The model from the client `payload.scalars["from"]` (hosted by the calling process `src`,
        the authenticated caller) at hop `hop` of `round`.  Accepted only as the walk's rule has
        it: the sender a neighbour of the receiver in the graph, the receiver the sender's draw
        for that hop (`WalkRule.next_client` is a function of the seed, so every process can
        check it), not a hop before the latest this process has been visited at (STALE_HOP), not
        from a process that the server named as the host of another client (WRONG_SENDER), and at
        most once per (hop, sender).  The model is only kept aside: the server's next visit names
        the hand-off it continues (sender, its round and hop, and the process hosting the sender),
        and only the hand-off from that process is used, so a participant cannot hand its own
        model in for a hop, or a client, at which the walk does not move from it, nor displace
        the real hand-off."""
        sender, receiver = payload.scalars.get("from", -1), client_id_of(dst)
        if receiver not in self.host.client_ids:
            raise HandlerError("UNKNOWN_CLIENT", f"client {receiver} is not hosted by {self.host.node_id}")
        if not isinstance(sender, int) or isinstance(sender, bool) or sender not in self.rule.graph[receiver]:
            raise HandlerError("NOT_NEIGHBOUR", f"client {sender!r} (from {src}) is not a neighbour of client "
                                                f"{receiver} in the walk's graph (neighbours: "
                                                f"{shown_row(self.rule.graph[receiver])})")
        if self.rule.next_client(sender, round, hop) != receiver:
            raise HandlerError("NOT_NEXT", f"the walk does not move from client {sender} to client {receiver} at hop "
                                           f"{hop} of round {round} (from {src})")
        with self._lock:
            host_of_sender = self.hosts.get(sender)
            latest = self.latest
        if host_of_sender is not None and host_of_sender != src:
            raise HandlerError("WRONG_SENDER", f"client {sender} is hosted by {host_of_sender}, not by {src}: a "
                                               f"process hands over only its own clients' model")
        if latest is not None and (round, hop) < latest:
            raise HandlerError("STALE_HOP", f"hop {hop} of round {round} is before this process's latest visit "
                                            f"(round {latest[0]}, hop {latest[1]}); from {src}")
        model = self.model_in(payload, f"hand-off from {src}", round, src)
        key = (round, hop, sender, src)   # another process's forgery for the same hop cannot displace it
        with self._lock:
            if key in self.pending or key in self.handoffs:
                raise HandlerError("DUPLICATE", f"a hand-off from client {sender} for hop {hop} of round {round} was "
                                                f"already taken from {src}")
            mine = sorted(k for k in self.pending if k[3] == src)
            for old in mine[:max(0, len(mine) - MAX_PENDING_PER_PEER + 1)]:   # bounded per calling process
                del self.pending[old]
            self.pending[key] = {k: v.clone() for k, v in model.items()}
        return Payload()

    def _continued(self, client: int, scalars: dict) -> None:
        """Before a visit: take the model the server says this visit continues (under the lock).
        `from` == `client`: the model stayed here; otherwise the hand-off kept aside for
        (from_round, from_hop, from) from the process `from_node`."""
        sender = scalars.get("from")
        if sender is None or isinstance(sender, bool) or not isinstance(sender, int):
            return   # a visit that names no hand-off (the walk's start, a resume)
        node = scalars.get("from_node")
        if isinstance(node, str) and node:
            self.hosts[sender] = node
        if sender == client:
            return
        key = (scalars.get("from_round"), scalars.get("from_hop"), sender, node)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in key[:2]) or not isinstance(node, str):
            raise HandlerError("BAD_VISIT", f"the visit names the hand-off of client {sender} without its round, "
                                            f"hop and process ({key})")
        model = self.pending.pop(key, None)
        if model is not None:
            self.model, self.holder = model, client
            self.handoffs.add(key)
        else:
            self.model, self.holder = None, None
        for stale in [k for k in self.pending if (k[0], k[1]) <= (key[0], key[1])]:   # hops gone by, forgeries
            log.warning("%s: hand-off of client %s for hop %s of round %s from %s was never the walk's; dropped",
                        self.host.node_id, stale[2], stale[1], stale[0], stale[3])
            del self.pending[stale]

    # ------------------------------------------------------------------ walk_visit
    def visit(self, dst: str, round: int, hop: int, message: Payload) -> Payload:
        client = client_id_of(dst)
        if client not in self.host.client_ids:
            raise HandlerError("UNKNOWN_CLIENT", f"client {client} is not hosted by {self.host.node_id}")
        scalars = message.scalars
        with self._lock:
            self.latest = max(self.latest or (round, hop), (round, hop))
            if bool(scalars.get("resume")):
                resumed = self.model_in(message, f"round {round} resumed model", round)
                self.model, self.holder = {k: v.clone() for k, v in resumed.items()}, client
            elif bool(scalars.get("start")):
                self.model, self.holder = {k: v.clone() for k, v in self.initial.items()}, client
            else:
                self._continued(client, scalars)
            if self.holder != client or self.model is None:
                raise HandlerError("NOT_HOLDER", f"client {client} does not hold the walk's model (holder here: "
                                                 f"{self.holder})")
            model = self.model
        update = self.host.train(client, round, Payload(tensors=model), hop)
        scale = self.rule.scale(client)
        stepped = {k: model[k] + scale * update.tensors[k] for k in model}   # w <- w + (p_i / pi_i) Delta_i
        reply = Payload(scalars={"train_loss": float(update.scalars.get("train_loss", 0.0)), "skipped": -1})
        if bool(scalars.get("evaluate")):
            set_params(self.host.model, stepped)
            with torch.no_grad():
                for name, value in self.host.task.evaluate(self.host.model).items():
                    reply.scalars[SEQ_METRIC_PREFIX + name] = float(value)
        if bool(scalars.get("return_model")):
            reply.tensors = {k: v.clone() for k, v in stepped.items()}
        nxt = client
        if not bool(scalars.get("final")):
            peers = {p.client_id: p.address for p in control_of(message).walk_peers}
            nxt = self._hand_off(client, round, hop, stepped, peers, reply)
        with self._lock:
            if nxt == client:
                self.model = stepped
            elif self.holder == client:   # handed on: the next visit takes it from the hand-off
                if self.model is model:
                    self.model, self.holder = None, None
        reply.scalars["next"] = nxt
        return reply

    def _hand_off(self, client: int, round: int, hop: int, model: dict[str, torch.Tensor],
                  peers: dict[int, str], reply: Payload) -> int:
        """Draw the next client and pass the model to it; a failed pass keeps the model here."""
        nxt = self.rule.next_client(client, round, hop)
        if nxt == client:
            return client
        address = peers.get(nxt)
        if not isinstance(address, str) or not address:
            reply.scalars.update(skipped=nxt, skip_reason=f"no address for client {nxt}")
            return client
        fabric = self.host.fabric
        assert fabric is not None   # set once this process registered (client/runtime.py)
        try:
            fabric.call(address, client_node(nxt), WALK_HANDOFF,
                        Payload(tensors=model, scalars={"from": client}), round=round, step=hop,
                        timeout=self.host.cfg.run.call_timeout)
        except (CallFailed, RemoteError, PayloadError) as exc:
            reply.scalars.update(skipped=nxt, skip_reason=str(exc))
            return client
        return nxt


def walk_of(host: ClientHost) -> WalkHost:
    """The process's WalkHost, made on first use (client/host.py `extension`)."""
    return host.extension("chain", WalkHost)


def walk_handlers(host: ClientHost) -> dict[Method, Callable[[Request], Payload]]:
    """The chain topology's methods (WRWGD), named by the spec's `client_handlers`."""
    def visit(request: Request) -> Payload:
        env = request.envelope
        return walk_of(host).visit(env.dst, int(env.round), int(env.step), request.payload)

    def handoff(request: Request) -> Payload:
        env = request.envelope
        return walk_of(host).take_handoff(env.src, env.dst, int(env.round), int(env.step), request.payload)

    return {WALK_VISIT: visit, WALK_HANDOFF: handoff}
