"""fedhop's protocol methods: one table that the core and each topology or transport declare into
(DESIGN.md sections 2 and 9).

A method's wire string travels in the envelope's `method` field (and in the ledger's `method`
column; a reply is the method's string + ".reply").  Each method says

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
  unary RPC (`Register`, `Heartbeat`);
- `request`: the size class of its request, which a process checks on the header before it
  reads the data (common/transport/admission.py): "model" (a model message), "empty" (scalars
  or control data, no tensors) or "per_client" (one state per logical client the receiver hosts).

The core methods (train, ping, shutdown, state, the hierarchical and torch-plane rounds,
register, heartbeat) are declared here.  A topology declares its own in its spec's `methods`
(common/topologies/spec.py: gossip_*, walk_*, seq_* are the gossip, chain and sequential
topologies'), a transport in its registry entry's `methods` (common/transport/factory.py); making
the spec declares them into `METHODS`, the one table that authorization (the router and the
gRPC admission gate), `message_link` (the ledger), the live page and the docs read.  A
plug-in's methods are declared the same way and so authorized exactly like the built-ins'; a
name already declared with another meaning is refused, naming both owners.

`Method.TRAIN`, `Method.GOSSIP_STEP`, ... look a declared method up by its attribute name (its
wire string's last dotted part, upper case), `Method.parse(wire)` by its wire string, and
`for m in Method` runs over the table.  docs/architecture.md, "The protocol", lists the methods
with their typed control data.
"""
from __future__ import annotations

import threading
from enum import StrEnum
from typing import Any, Iterable, Iterator, Literal

from fedhop.common.wire.ledger import link_for

REPLY_SUFFIX = ".reply"
CORE = "core"   # the owner of the wire layer's own methods

RequestSize = Literal["model", "empty", "per_client"]
REQUEST_SIZES = ("model", "empty", "per_client")


class Caller(StrEnum):
    PARENT = "parent"          # the node this process registered with
    NEIGHBOUR = "neighbour"    # an edge adjacent to this edge in the Fed-CHS graph
    PEER = "peer"              # a process of this process's role (client process to client process)
    ANY = "any"                # any authenticated node


PARENT, NEIGHBOUR, PEER, ANY = Caller.PARENT, Caller.NEIGHBOUR, Caller.PEER, Caller.ANY


class MethodClash(ValueError):
    """A method declared under a name (or attribute name) that another owner declared differently."""


class _MethodTable(type):
    """`Method`'s metaclass: the class reads as the table of declared methods (`Method.TRAIN`,
    `for m in Method`, `len(Method)`, `"train" in Method`), as it did when it was an enum."""

    def __getattr__(cls, attr: str) -> "Method":
        if attr.startswith("__") or not attr.isupper():
            raise AttributeError(attr)
        found = METHODS.by_attr(attr)
        if found is None:
            raise AttributeError(f"no protocol method '{attr}' is declared (declared: "
                                 f"{', '.join(sorted(METHODS.attrs()))}); a topology's or transport's methods are "
                                 f"declared when its spec is made (common/topologies/, common/transport/factory.py)")
        return found

    def __iter__(cls) -> Iterator["Method"]:
        return iter(METHODS)

    def __len__(cls) -> int:
        return len(METHODS)

    def __contains__(cls, wire: object) -> bool:
        return isinstance(wire, str) and METHODS.get(wire) is not None


class Method(str, metaclass=_MethodTable):
    """A protocol method: its wire string, allowed callers, fixed link (or None), RPC and request
    size class (module docstring).  Making one declares nothing: a spec's `methods` (or `declare`)
    puts it in `METHODS`; it compares and hashes as its wire string."""

    callers: frozenset[Caller]
    link: str | None
    rpc: str
    request: RequestSize

    def __new__(cls, wire: str, callers: Iterable[Caller | str], link: str | None = None, rpc: str = "Exchange",
                request: RequestSize = "model") -> "Method":
        if not wire or wire != wire.strip() or wire.endswith(REPLY_SUFFIX):
            raise ValueError(f"method name {wire!r}: a non-empty wire string without spaces that does not end in "
                             f"'{REPLY_SUFFIX}'")
        try:
            who = frozenset(Caller(c) for c in callers)
        except ValueError:
            raise ValueError(f"method '{wire}': callers {sorted(map(str, callers))} (allowed: "
                             f"{', '.join(c.value for c in Caller)})") from None
        if not who:
            raise ValueError(f"method '{wire}': no allowed callers (allowed: {', '.join(c.value for c in Caller)})")
        if request not in REQUEST_SIZES:
            raise ValueError(f"method '{wire}': request = {request!r} (allowed: {', '.join(REQUEST_SIZES)})")
        member = str.__new__(cls, wire)
        member.callers, member.link, member.rpc, member.request = who, link, rpc, request
        return member

    @property
    def value(self) -> str:
        """The wire string (as the enum's `value` was)."""
        return str.__str__(self)

    @property
    def name(self) -> str:
        """The attribute name it is looked up by: `Method.<name>`."""
        return self.value.rsplit(".", 1)[-1].upper()

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"<Method {self.value}: {', '.join(sorted(c.value for c in self.callers))}>"

    def __copy__(self) -> "Method":
        return self

    def __deepcopy__(self, memo: Any) -> "Method":
        return self

    def meaning(self) -> tuple[frozenset[Caller], str | None, str, str]:
        """What two declarations of one name must agree on."""
        return self.callers, self.link, self.rpc, self.request

    @classmethod
    def parse(cls, wire: str) -> "Method | None":
        """The declared method a wire string names, or None (an unknown or misspelled method)."""
        return METHODS.get(wire)

    def reply(self) -> str:
        """The method string of this method's reply."""
        return self.value + REPLY_SUFFIX


class MethodTable:
    """The declared methods by wire string, with their owners (module docstring)."""

    def __init__(self) -> None:
        self._methods: dict[str, Method] = {}
        self._owners: dict[str, str] = {}
        self._attrs: dict[str, str] = {}   # attribute name -> wire string
        self._lock = threading.Lock()

    def declare(self, methods: Iterable[Method], owner: str) -> None:
        """Add `owner`'s methods (e.g. "topology 'gossip'").  A name already declared with the
        same meaning is kept as it is (a spec made twice, a plug-in loaded under two names);
        one declared with other callers, link, RPC or request size, or an attribute name taken
        by another wire string, raises MethodClash naming both owners, and nothing is added."""
        methods = list(methods)
        with self._lock:
            new: dict[str, Method] = {}
            for m in methods:
                if not isinstance(m, Method):
                    raise TypeError(f"{owner} declares {m!r}, not a fedhop.common.wire.methods.Method")
                held = self._methods.get(m.value) or new.get(m.value)
                if held is not None and held.meaning() != m.meaning():
                    first = self._owners.get(m.value, owner)
                    raise MethodClash(f"method '{m}' of {owner} (callers {_who(m)}, link {m.link}, rpc {m.rpc}) clashes "
                                      f"with '{m}' of {first} (callers {_who(held)}, link {held.link}, rpc {held.rpc})")
                twin = self._attrs.get(m.name) or next((w for w, n in new.items() if n.name == m.name), None)
                if twin is not None and twin != m.value:
                    raise MethodClash(f"method '{m}' of {owner} is looked up as Method.{m.name}, as '{twin}' of "
                                      f"{self._owners.get(twin, owner)} is")
                if held is None:
                    new[m.value] = m
            for wire, m in new.items():
                self._methods[wire], self._owners[wire], self._attrs[m.name] = m, owner, wire

    def withdraw(self, owner: str) -> list[Method]:
        """Remove `owner`'s methods (a test's throw-away spec); returns them.  A process's
        handlers for them are refused from then on as unknown methods."""
        with self._lock:
            gone = [self._methods.pop(w) for w in [w for w, o in self._owners.items() if o == owner]]
            for m in gone:
                del self._owners[m.value], self._attrs[m.name]
            return gone

    def get(self, wire: str) -> Method | None:
        return self._methods.get(wire)

    def by_attr(self, attr: str) -> Method | None:
        wire = self._attrs.get(attr)
        return None if wire is None else self._methods[wire]

    def attrs(self) -> list[str]:
        return list(self._attrs)

    def owner(self, wire: str) -> str | None:
        """Who declared `wire` (CORE, "topology 'gossip'", ...), or None."""
        return self._owners.get(wire)

    def owned_by(self, owner: str) -> list[Method]:
        return [m for w, m in self._methods.items() if self._owners[w] == owner]

    def __iter__(self) -> Iterator[Method]:
        return iter(list(self._methods.values()))

    def __len__(self) -> int:
        return len(self._methods)


def _who(m: Method) -> str:
    return "/".join(sorted(c.value for c in m.callers))


#: every declared method: the core's below, each topology's and transport's as its spec is made
METHODS = MethodTable()


def declare(methods: Iterable[Method], owner: str) -> None:
    """Declare `owner`'s methods into `METHODS` (`MethodTable.declare`)."""
    METHODS.declare(methods, owner)


# -- a client process (client/host.py, client/group_worker.py) -------------------------------------
TRAIN = Method("train", {PARENT})                        # local training of one logical client (dst client-ID)
PING = Method("ping", {ANY}, request="empty")            # reachability; no effect
# -- a client process and an edge ------------------------------------------------------------------
SHUTDOWN = Method("shutdown", {PARENT}, request="empty")      # an edge forwards it to its client processes
STATE_GET = Method("state_get", {PARENT}, request="empty")    # persistent client state for a checkpoint
STATE_SET = Method("state_set", {PARENT}, request="per_client")   # a resumed run's client state
TORCH_INIT = Method("torch_init", {PARENT})              # join the torch.distributed world
# -- a client process, transport.kind = "torch" (the group plane, common/transport/groups.py) -------
TORCH_ROUND = Method("torch_round", {PARENT})            # train sampled clients on the broadcast model
TORCH_REDUCE = Method("torch_reduce", {PARENT})          # contribute the partial to the reduce
# -- an edge, hierarchical (edge/aggregator.py, edge/group_edge.py) --------------------------------
EDGE_ROUND = Method("edge_round", {PARENT})              # kappa2 edge iterations with the sampled clients
TORCH_PROCS = Method("torch_procs", {PARENT}, request="empty")   # the edge's client processes (world layout)
TORCH_EDGE_ROUND = Method("torch_edge_round", {PARENT})  # edge_round with collectives
TORCH_EDGE_REDUCE = Method("torch_edge_reduce", {PARENT})  # the edge's partial into the server's reduce
# -- to a parent, each its own unary RPC -----------------------------------------------------------
REGISTER = Method("register", {ANY}, "control", "Register")      # request.node_id must be the caller
HEARTBEAT = Method("heartbeat", {ANY}, "control", "Heartbeat")   # request.node_id must be the caller

# -- a client process, [secure_aggregation] (client/secagg.py): SecAgg+'s phases, each its own method,
# obeyed from the parent (the server in the star, the client's edge behind edges); not core: the
# topologies that run secure aggregation declare them in their specs' `methods` (star, hierarchical)
SECAGG_ADVERTISE = Method("secagg_advertise", {PARENT})
SECAGG_SHARE = Method("secagg_share", {PARENT})
SECAGG_MASKED = Method("secagg_masked", {PARENT})
SECAGG_UNMASK = Method("secagg_unmask", {PARENT})
SECAGG_METHODS = (SECAGG_ADVERTISE, SECAGG_SHARE, SECAGG_MASKED, SECAGG_UNMASK)

declare((TRAIN, PING, SHUTDOWN, STATE_GET, STATE_SET, TORCH_INIT, TORCH_ROUND, TORCH_REDUCE, EDGE_ROUND, TORCH_PROCS,
         TORCH_EDGE_ROUND, TORCH_EDGE_REDUCE, REGISTER, HEARTBEAT), CORE)


def role_of(node_id: str) -> str:
    """'server' | 'edge' | 'client' from a node id such as 'edge-2' or 'client-17'."""
    return node_id.split("-", 1)[0] if node_id != "server" else "server"


def message_link(src: str, dst: str, method: str) -> str:
    """The ledger link of a call: the declared method's fixed link (`control` for the Fed-CHS
    neighbour query and restore), otherwise the link between the two nodes' roles.  Both ends
    apply the same rule, so the sender's and receiver's records agree."""
    known = METHODS.get(str(method))
    if known is not None and known.link is not None:
        return known.link
    return link_for(role_of(src), role_of(dst))
