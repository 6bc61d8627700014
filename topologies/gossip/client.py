"""The clients' side of the gossip topology (D-PSGD; topologies/gossip/rule.py has the graph and the
mixing rule, topologies/gossip/driver.py the server's control plane).

Each hosted client's model x_i lives in this process between rounds (it starts as the run's
seeded initial model).  A round is three calls from the server, each answered without waiting
for another process, so no handler thread ever blocks on a peer's handler:

1. `gossip_step` (per logical client): the local steps from x_i; x_i^{1/2} = x_i + Delta_i is kept.
   The message names the process hosting each neighbour when the server has not told it before
   (topologies/gossip/driver.py); what it was told is kept for the later rounds.
2. `gossip_send` (once per process): every hosted client's x_i^{1/2} to each of its graph
   neighbours in a `gossip_share` message (link client-client), 256 hosted clients' shares at a
   time; with `transport.batch` the shares to one process share its calls' bundles, as a
   server's requests to one client process do (common/transport/grpc.py, Batches), else each
   is a call of its own.  One call at a time, so a peer's per-caller call slots are never
   exceeded; a neighbour hosted in this same process is called over the transport too, so the
   link carries 2 x 4d x |E| tensor bytes a round whatever the placement.  The neighbours'
   addresses come with the call when they are new to this process and are kept for later rounds.
3. `gossip_mix` (per logical client): x_i <- W_ii x_i^{1/2} + sum_j W_ij x_j^{1/2}; in an
   evaluation round the reply carries x_i (link client-server) for the server's consensus average.

`gossip_share` (from a peer process): the sending client must be a neighbour of the receiving
one and hosted by the calling process (as the server's `gossip_step` named it), the round the
current one, once per (round, sender, receiver); the model is checked against the model's spec
and finiteness before it is kept.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

import torch

from fedhop.common.algorithms.local import get_params
from fedhop.common.processors.pipeline import model_chain
from fedhop.common.transport.base import Batched, CallFailed, HandlerError, RemoteError, Request
from fedhop.common.transport.control import control_of
from fedhop.common.util.nodeids import client_id_of, client_node
from fedhop.common.wire.codec import Encoded, PayloadError
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method
from fedhop.topologies.gossip import GOSSIP_MIX, GOSSIP_SEND, GOSSIP_SHARE, GOSSIP_STEP
from fedhop.topologies.gossip.rule import SEND_STEP, GossipRule

if TYPE_CHECKING:
    from fedhop.client.host import ClientHost

Model = dict[str, torch.Tensor]
#: hosted clients whose shares are encoded and sent together (`GossipHost.send`): the frames held
#: at once are this many models, whatever the number of clients a process hosts
SHARE_WINDOW = 256


def _called(call: Callable[[], Payload]) -> Payload | Exception:
    """A call's reply, or the exception a failed call raises (as `Endpoint.call_many` gives them)."""
    try:
        return call()
    except (CallFailed, RemoteError, PayloadError) as exc:
        return exc


class GossipHost:
    """The gossip state of one client process: each hosted client's model, its post-step model
    of the current round, and the neighbours' post-step models received for it."""

    def __init__(self, host: ClientHost) -> None:
        self.host = host
        self.rule = GossipRule.from_config(host.cfg)
        # the run's seeded initial model, as the server builds it, on the process's device (where the
        # endpoint also puts every arriving share: common/transport/base.py), as the walk keeps its model
        initial = get_params(host.task.build_model())
        self.spec = {k: (v.dtype, tuple(v.shape)) for k, v in initial.items()}
        self.model_in = model_chain(self.spec, GOSSIP_SHARE)
        self.models: dict[int, Model] = {c: {k: v.clone() for k, v in initial.items()} for c in host.client_ids}
        self.half: dict[int, tuple[int, Model]] = {}            # client -> (round, x_i^{1/2})
        self.inbox: dict[tuple[int, int, int], Model] = {}      # (round, receiver, sender) -> x_sender^{1/2}
        self.hosts: dict[int, str] = {}   # neighbour client -> the process hosting it, as the server named it
        self.peers: dict[int, str] = {}   # neighbour client -> its process's address, as the server named it
        self.round = 0
        self._lock = threading.Lock()

    def _hosted(self, node_id: str) -> int:
        client = client_id_of(node_id)
        if client not in self.host.hosted:
            raise HandlerError("UNKNOWN_CLIENT", f"client {client} is not hosted by {self.host.node_id}")
        return client

    # ------------------------------------------------------------------ gossip_step
    def step(self, dst: str, round: int, message: Payload) -> Payload:
        client = self._hosted(dst)
        hosts = {}
        for j in self.rule.graph[client]:
            node = message.scalars.get(f"host:{j}")
            if node is None:
                continue   # told in an earlier round (checked below)
            if not isinstance(node, str) or not node:
                raise HandlerError("BAD_STEP", f"round {round}: gossip_step names no process for client {j}, a "
                                               f"neighbour of client {client}")
            hosts[j] = node
        with self._lock:
            unknown = [j for j in self.rule.graph[client] if j not in hosts and j not in self.hosts]
            if unknown:
                raise HandlerError("BAD_STEP", f"round {round}: no process was ever named for clients {unknown}, "
                                               f"neighbours of client {client}")
            if round > self.round:   # a new round: shares left from an earlier one are dropped, once
                self.round = round
                for stale in [k for k in self.inbox if k[0] < round]:
                    del self.inbox[stale]
            self.hosts.update(hosts)
            model = self.models[client]
        update = self.host.train(client, round, Payload(tensors=model), 0)
        half = {k: model[k] + update.tensors[k] for k in model}   # x_i^{1/2} = x_i + Delta_i
        with self._lock:
            self.half[client] = (round, half)
        return Payload(scalars={"train_loss": float(update.scalars.get("train_loss", 0.0))})

    # ------------------------------------------------------------------ gossip_send
    def send(self, round: int, message: Payload) -> Payload:
        told = {p.client_id: p.address for p in control_of(message).walk_peers}
        with self._lock:
            self.peers.update(told)
            peers = self.peers   # only added to, by this method: lookups below need no copy
        for client in self.host.client_ids:   # every share is checked sendable before the first goes
            with self._lock:
                got = self.half.get(client)
            if got is None or got[0] != round:
                raise HandlerError("NOT_STEPPED", f"client {client} took no local step in round {round}")
            for j in self.rule.graph[client]:
                if not peers.get(j):
                    raise HandlerError("NO_ADDRESS", f"round {round}: no address for client {j}, a neighbour of "
                                                     f"client {client}")
        sent = 0
        ids = list(self.host.client_ids)
        for start in range(0, len(ids), SHARE_WINDOW):
            sent += self._send_window(round, ids[start:start + SHARE_WINDOW], peers)
        return Payload(scalars={"shares": sent})

    def _send_window(self, round: int, clients: list[int], peers: dict[int, str]) -> int:
        """The shares of `clients` (their post-step models to each neighbour), each model encoded
        once; with `transport.batch` the shares to one process go in its calls' bundles
        (`Endpoint.call_many`), one call at a time, else each in a call of its own."""
        fabric = self.host.fabric
        assert fabric is not None   # set once this process registered (client/runtime.py)
        endpoint, timeout = fabric.endpoint, self.host.cfg.run.call_timeout
        by_address: dict[str, list[tuple[int, int, Encoded]]] = {}
        for client in clients:
            with self._lock:
                half = self.half[client][1]
            prepared = endpoint.prepare(Payload(tensors=half, scalars={"from": client}))
            for j in self.rule.graph[client]:
                by_address.setdefault(peers[j], []).append((client, j, prepared))
        for address, shares in by_address.items():
            if self.host.cfg.transport.batch:
                results = endpoint.call_many(address, [Batched(client_node(j), GOSSIP_SHARE, prepared)
                                                       for _, j, prepared in shares],
                                             round=round, step=SEND_STEP, timeout=timeout)
            else:
                results = [_called(lambda: endpoint.call(address, client_node(j), GOSSIP_SHARE, round=round,
                                                         step=SEND_STEP, timeout=timeout, prepared=prepared))
                           for _, j, prepared in shares]
            for (client, j, _), result in zip(shares, results):
                if isinstance(result, Exception):
                    raise HandlerError("SHARE_FAILED", f"round {round}: client {client}'s model did not reach "
                                                       f"client {j}: {result}")
        return sum(len(shares) for shares in by_address.values())

    # ------------------------------------------------------------------ gossip_share
    def take_share(self, src: str, dst: str, round: int, payload: Payload) -> Payload:
        receiver = self._hosted(dst)
        sender = payload.scalars.get("from", -1)
        if not isinstance(sender, int) or isinstance(sender, bool) or sender not in self.rule.graph[receiver]:
            raise HandlerError("NOT_NEIGHBOUR", f"client {sender!r} (from {src}) is not a neighbour of client "
                                                f"{receiver} in the gossip graph ({self.rule.graph[receiver]})")
        with self._lock:
            current, host_of_sender = self.round, self.hosts.get(sender)
        if host_of_sender != src:
            raise HandlerError("WRONG_SENDER", f"client {sender} is hosted by {host_of_sender}, not by {src}: a "
                                               f"process shares only its own clients' models")
        if round != current:
            raise HandlerError("WRONG_ROUND", f"a share for round {round} from {src}; this process is in round "
                                              f"{current}")
        model = self.model_in(payload, f"round {round} model of client {sender} from {src}", round, src)
        key = (round, receiver, sender)
        with self._lock:
            if key in self.inbox:
                raise HandlerError("DUPLICATE", f"client {sender}'s model for client {receiver} in round {round} "
                                                f"was already taken (from {src})")
            self.inbox[key] = {k: v.clone() for k, v in model.items()}
        return Payload()

    # ------------------------------------------------------------------ gossip_mix
    def mix(self, dst: str, round: int, message: Payload) -> Payload:
        client = self._hosted(dst)
        with self._lock:
            got = self.half.get(client)
            if got is None or got[0] != round:
                raise HandlerError("NOT_STEPPED", f"client {client} took no local step in round {round}")
            missing = [j for j in self.rule.graph[client] if (round, client, j) not in self.inbox]
            if missing:
                raise HandlerError("MISSING_SHARE", f"round {round}: client {client} has no model from neighbours "
                                                    f"{missing}")
            neighbours = {j: self.inbox.pop((round, client, j)) for j in self.rule.graph[client]}
            del self.half[client]
        mixed = self.rule.mix(client, got[1], neighbours)
        with self._lock:
            self.models[client] = mixed
        reply = Payload()
        if bool(message.scalars.get("return_model")):
            reply.tensors = {k: v.clone() for k, v in mixed.items()}
        return reply


def gossip_of(host: ClientHost) -> GossipHost:
    """The process's GossipHost, made on first use (client/host.py `extension`)."""
    return host.extension("gossip", GossipHost)


def gossip_handlers(host: ClientHost) -> dict[Method, Callable[[Request], Payload]]:
    """The gossip topology's methods (D-PSGD), named by the spec's `client_handlers`."""
    def step(request: Request) -> Payload:
        return gossip_of(host).step(request.envelope.dst, int(request.envelope.round), request.payload)

    def send(request: Request) -> Payload:
        return gossip_of(host).send(int(request.envelope.round), request.payload)

    def share(request: Request) -> Payload:
        env = request.envelope
        return gossip_of(host).take_share(env.src, env.dst, int(env.round), request.payload)

    def mix(request: Request) -> Payload:
        return gossip_of(host).mix(request.envelope.dst, int(request.envelope.round), request.payload)

    return {GOSSIP_STEP: step, GOSSIP_SEND: send, GOSSIP_SHARE: share, GOSSIP_MIX: mix}
