"""A client process's side of the group data plane (common/transport/groups.py).

The round's calls arrive from the server (star) or from this process's edge (hierarchical and
sequential: the process's edge cluster group, once per edge iteration): `torch_init` joins the
transport's world, `torch_round` brings the message (on torch.distributed, as a broadcast beside
the call) and the sampled clients, `torch_reduce` takes the partial (a reduce beside the call).
The process pre-aggregates its own sampled logical clients with the algorithm's `aggregate`, as
an edge would, and contributes one partial.  A client's reply holding NaN or Inf is left out of
that partial and reported as a NON_FINITE failure (the server's `security.nan_policy` applies to
it as on the per-client fan-out).
"""
from __future__ import annotations

from typing import Any, Callable

from fedhop.common.transport.base import CallFailed, HandlerError, RemoteError, Request
from fedhop.common.transport.groups import GroupMember, worlds
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload, finite_or_raise
from fedhop.common.wire.methods import Method


class GroupWorker:
    def __init__(self, host) -> None:
        self.host = host
        self.member: GroupMember | None = None

    def ready(self) -> GroupMember:
        if self.member is None:
            raise HandlerError("NOT_READY", "torch_init has not been called")
        return self.member

    def init(self, payload: Payload) -> Payload:
        self.member = worlds(self.host.cfg.transport.kind).member(self.host.node_id, payload, self.host.ledger,
                                                                  self.host.run_id)
        return Payload(scalars={"rank": int(payload.scalars.get("rank", 0))})

    def round(self, round: int, payload: Payload) -> Payload:
        incoming = self.ready().receive(round, payload)
        replies, failures = {}, {}
        for cid in incoming.clients:
            try:
                reply = self.host.train(cid, round, incoming.message, incoming.step)
                try:   # as the fan-out's receiver would: a NaN reply leaves its client out, not the whole sum
                    finite_or_raise(reply, f"round {round} reply of client {cid}")
                except ValueError as exc:
                    raise PayloadError("NON_FINITE", str(exc)) from None
                replies[cid] = reply
            except (PayloadError, HandlerError, ValueError, RuntimeError) as exc:
                failures[cid] = str(exc)
        partial = self.host.algorithm.aggregate(sorted(replies.items())) if replies else None
        return self.ready().answer(partial, failures, self.host.algorithm.reply_reduce)

    def reduce(self, round: int, payload: Payload) -> Payload:
        return self.ready().contribute(round, payload)


__all__ = ["GroupWorker", "CallFailed", "RemoteError"]


def torch_handlers(host: Any) -> dict[Method, Callable[[Request], Payload]]:
    """The group data plane's methods a client process serves in a torch run (named by the torch
    transport's registration, common/transport/factory.py); `host` is its ClientHost."""
    def worker() -> GroupWorker:   # made on the first torch_* call (client/host.py `extension`)
        return host.extension("group", GroupWorker)

    return {
        Method.TORCH_INIT: lambda request: worker().init(request.payload),
        Method.TORCH_ROUND: lambda request: worker().round(int(request.envelope.round), request.payload),
        Method.TORCH_REDUCE: lambda request: worker().reduce(int(request.envelope.round), request.payload),
    }
