"""Every method of fedhop's protocol, as one enum (DESIGN.md sections 2 and 9).

A method's value is the string that travels in the envelope's `method` field (and in the
ledger's `method` column; a reply is the method's value + ".reply").  Each method says

- `callers`: who the receiving process obeys it from, relative to itself: its `PARENT` (the
  node it registered with: the server, or a client process's edge), a `NEIGHBOUR` (an edge
  adjacent to it in the Fed-CHS graph), a `PEER` (a process of its own role, itself
  included: a client process handing over the WRWGD walk's model), or `ANY` authenticated node.  The caller is the
  envelope's `src`, which the gRPC interceptor binds to the call's credential (the node token
  or the mTLS certificate's common name, common/security/auth.py);
- `link`: the ledger link of its messages when that is fixed ("control": bookkeeping the papers
  do not count), or None: the link between the two nodes' roles (common/wire/ledger.py `link_for`);
- `rpc`: the gRPC method that carries it: `Exchange` (or its one-chunk twin `Call`) for the
  methods a role serves through its `MethodRouter` (common/transport/router.py), or its own
  unary RPC (`Register`, `Heartbeat`).

docs/architecture.md, "The protocol", lists them with their typed control data.
"""
from __future__ import annotations

from enum import StrEnum

from fedhop.common.wire.ledger import link_for

REPLY_SUFFIX = ".reply"


class Caller(StrEnum):
    PARENT = "parent"          # the node this process registered with
    NEIGHBOUR = "neighbour"    # an edge adjacent to this edge in the Fed-CHS graph
    PEER = "peer"              # a process of this process's role (client process to client process)
    ANY = "any"                # any authenticated node


PARENT, NEIGHBOUR, PEER, ANY = Caller.PARENT, Caller.NEIGHBOUR, Caller.PEER, Caller.ANY


class Method(StrEnum):
    """A protocol method: its wire string, allowed callers, fixed link (or None) and RPC."""

    callers: frozenset[Caller]
    link: str | None
    rpc: str

    def __new__(cls, wire: str, callers: frozenset[Caller], link: str | None = None, rpc: str = "Exchange"):
        member = str.__new__(cls, wire)
        member._value_ = wire
        member.callers = frozenset(callers)
        member.link = link
        member.rpc = rpc
        return member

    # -- a client process (client/host.py, client/group_worker.py) ------------------------------
    TRAIN = "train", {PARENT}                        # local training of one logical client (dst client-ID)
    PING = "ping", {ANY}                             # reachability; no effect
    # -- a client process and an edge -----------------------------------------------------------
    SHUTDOWN = "shutdown", {PARENT}                  # an edge forwards it to its client processes
    STATE_GET = "state_get", {PARENT}                # persistent client state for a checkpoint
    STATE_SET = "state_set", {PARENT}                # a resumed run's client state
    TORCH_INIT = "torch_init", {PARENT}              # join the torch.distributed world
    # -- a client process, transport.kind = "torch" ---------------------------------------------
    TORCH_ROUND = "torch_round", {PARENT}            # train sampled clients on the broadcast model
    TORCH_REDUCE = "torch_reduce", {PARENT}          # contribute the partial to the reduce
    # -- an edge, hierarchical (edge/aggregator.py, edge/group_edge.py) -------------------------
    EDGE_ROUND = "edge_round", {PARENT}              # kappa2 edge iterations with the sampled clients
    TORCH_PROCS = "torch_procs", {PARENT}            # the edge's client processes (world layout)
    TORCH_EDGE_ROUND = "torch_edge_round", {PARENT}  # edge_round with collectives
    TORCH_EDGE_REDUCE = "torch_edge_reduce", {PARENT}  # the edge's partial into the server's reduce
    # -- an edge, sequential (Fed-CHS, edge/sequential.py) --------------------------------------
    SEQ_ROUND = "seq_round", {PARENT}                # the token holder's round
    SEQ_HANDOFF = "seq_handoff", {NEIGHBOUR}         # the model w^{t+1} to the next edge (link edge-edge)
    SEQ_FINAL = "seq_final", {PARENT}                # torch: the final model as a dist.send
    SEQ_QUERY = "control.seq_query", {PARENT, NEIGHBOUR}, "control"   # visit count c(m), data size D_A,m
    SEQ_RESTORE = "control.seq_restore", {PARENT}, "control"          # a resumed run's visit count
    # -- a client process, chain topology (WRWGD, client/walk.py) --------------------------------
    WALK_VISIT = "walk_visit", {PARENT}              # the holder's visit: local steps, the draw, the hand-off
    WALK_HANDOFF = "walk_handoff", {PEER}            # the walking model to the next client (link client-client)
    # -- a client process, gossip topology (D-PSGD, client/gossip.py) -----------------------------
    GOSSIP_STEP = "gossip_step", {PARENT}            # a logical client's local steps from its own model
    GOSSIP_SEND = "gossip_send", {PARENT}            # the process's post-step models to their graph neighbours
    GOSSIP_SHARE = "gossip_share", {PEER}            # one post-step model to a neighbour (link client-client)
    GOSSIP_MIX = "gossip_mix", {PARENT}              # the Metropolis-Hastings average (the model up at evaluations)
    # -- to a parent, each its own unary RPC ----------------------------------------------------
    REGISTER = "register", {ANY}, "control", "Register"      # request.node_id must be the caller
    HEARTBEAT = "heartbeat", {ANY}, "control", "Heartbeat"   # request.node_id must be the caller

    @classmethod
    def parse(cls, wire: str) -> "Method | None":
        """The method a wire string names, or None (an unknown or misspelled method)."""
        try:
            return cls(wire)  # type: ignore[call-arg]  # a lookup by value; mypy reads it as __new__
        except ValueError:
            return None

    def reply(self) -> str:
        """The method string of this method's reply."""
        return self.value + REPLY_SUFFIX


def role_of(node_id: str) -> str:
    """'server' | 'edge' | 'client' from a node id such as 'edge-2' or 'client-17'."""
    return node_id.split("-", 1)[0] if node_id != "server" else "server"


def message_link(src: str, dst: str, method: str) -> str:
    """The ledger link of a call: the method's fixed link (`control` for the Fed-CHS neighbour
    query and restore), otherwise the link between the two nodes' roles.  Both ends apply the
    same rule, so the sender's and receiver's records agree."""
    known = Method.parse(method)
    if known is not None and known.link is not None:
        return known.link
    return link_for(role_of(src), role_of(dst))
