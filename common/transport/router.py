"""A role's handler registry: one handler per protocol method, and who may call it (DESIGN.md section 9).

A role registers a handler for each method it serves; `dispatch` answers an incoming request
by its method, after two checks, each refused with a typed error reply (the endpoint records
the request as a rejected message in this process's ledger):

- `UNKNOWN_METHOD`: the envelope names no declared method (common/wire/methods.py `METHODS`: the
  core's, and those the run's topology and transport declare in their specs), or one this role
  does not serve;
- `NOT_ALLOWED`: the caller is not among the method's declared callers (`Method.callers`) for
  this process: not its parent, not a neighbour in the graph.  The caller is the envelope's
  `src`; under node tokens or mutual TLS the gRPC interceptor has already checked that `src` is
  the authenticated caller (common/security/auth.py), so a participant cannot borrow its parent's name.

A refusal is also logged and passed to `on_refused` (the role's hook for an event).  A plug-in
topology's methods go through the same two checks: the router reads only the method table.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, NoReturn

from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Caller, Method, role_of

log = logging.getLogger("fedhop.protocol")

NOT_ALLOWED, UNKNOWN_METHOD = "NOT_ALLOWED", "UNKNOWN_METHOD"


@dataclass
class Peers:
    """The nodes this process obeys: its parent (the node it registered with) and, for a
    Fed-CHS edge, its neighbours in the edge graph."""

    parent: str
    neighbours: frozenset[str] = field(default_factory=frozenset)
    owner: str = ""   # this process's node id (a PEER is a node of its role)

    def relations(self, node: str) -> set[Caller]:
        """What `node` is to this process."""
        out = {Caller.ANY}
        if node == self.parent:
            out.add(Caller.PARENT)
        if node in self.neighbours:
            out.add(Caller.NEIGHBOUR)
        if self.owner and role_of(node) == role_of(self.owner):   # itself too: it may host the next client
            out.add(Caller.PEER)
        return out


def allowed(method: Method, caller: str, peers: Peers) -> bool:
    return bool(method.callers & peers.relations(caller))


RouteHandler = Callable[[Request], Payload]
RefusedHook = Callable[[Request, str, str], None]   # (request, code, reason)


class MethodRouter:
    """Handlers by method for one process (module docstring)."""

    def __init__(self, owner: str, peers: Peers, on_refused: RefusedHook | None = None) -> None:
        self.owner = owner
        self.peers = peers if peers.owner else Peers(peers.parent, peers.neighbours, owner)
        self.on_refused = on_refused
        self._handlers: dict[Method, RouteHandler] = {}

    def register(self, method: Method | str, handler: RouteHandler) -> None:
        """Serve `method` (a declared method, or its wire string) with `handler`; the declaration in
        the method table, not the object given, decides who may call it."""
        declared = Method.parse(str(method))
        if declared is None:
            raise ValueError(f"{self.owner} cannot serve '{method}': no topology, transport or the core declares it "
                             f"(a topology declares its methods in its spec's `methods`, common/topologies/spec.py)")
        if isinstance(method, Method) and method.meaning() != declared.meaning():
            raise ValueError(f"{self.owner} serves '{method}' with callers {sorted(c.value for c in method.callers)}, "
                             f"but it is declared with {sorted(c.value for c in declared.callers)}")
        method = declared
        if method.rpc != "Exchange":
            raise ValueError(f"{method} is its own RPC ({method.rpc}), not served through Exchange")
        self._handlers[method] = handler

    def register_all(self, handlers: Mapping[str, RouteHandler]) -> None:
        for method, handler in handlers.items():
            self.register(method, handler)

    @property
    def methods(self) -> frozenset[Method]:
        return frozenset(self._handlers)

    def set_neighbours(self, nodes: Iterable[str]) -> None:
        self.peers = Peers(self.peers.parent, frozenset(nodes), self.peers.owner)

    def dispatch(self, request: Request) -> Payload:
        env = request.envelope
        method = Method.parse(env.method)
        if method is None or method not in self._handlers:
            self._refuse(request, UNKNOWN_METHOD, f"{self.owner} does not serve '{env.method}'")
        if not allowed(method, env.src, self.peers):
            who = " or ".join(sorted(c.value for c in method.callers))
            self._refuse(request, NOT_ALLOWED, f"{self.owner} obeys '{method}' only from its {who} "
                                               f"(parent: {self.peers.parent}), not from '{env.src}'")
        return self._handlers[method](request)

    def _refuse(self, request: Request, code: str, reason: str) -> NoReturn:
        env = request.envelope
        log.warning("refused %s (round %d) from %s: %s: %s", env.method, env.round, env.src or "?", code, reason)
        if self.on_refused is not None:
            try:
                self.on_refused(request, code, reason)
            except Exception:   # a broken hook must not open the door
                log.exception("on_refused hook failed")
        raise HandlerError(code, reason)
