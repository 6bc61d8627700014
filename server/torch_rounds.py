"""The server's side of the torch.distributed data plane (common/transport/torchdist.py).

Star topology: rank 0 is the server, client process k (sorted by node id) is rank k + 1.
Each round costs one broadcast of the algorithm's message to every client process and one
reduce of their partial aggregates; the sampled clients, the tensor layout, failures and the
partials' scalars travel as gRPC control messages.
"""
from __future__ import annotations

import json
import logging

import torch

from common.algorithms.base import Payload, reduce_payloads
from common.codec import DTYPES, PayloadError
from common.transport.base import CallFailed, RemoteError
from common.transport.torchdist import Collectives, TorchParams, free_port, specs_of, specs_to_json

log = logging.getLogger("fedhop.server")

IDENTITY = {"wsum": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


class TorchRounds:
    def __init__(self, coordinator) -> None:
        self.c = coordinator
        cfg = coordinator.cfg
        if cfg.topology.kind != "star":
            raise ValueError(f"transport.kind = 'torch' supports topology.kind = 'star' so far, "
                             f"not '{cfg.topology.kind}'")
        self.params = getattr(cfg.transport, "params", None) or TorchParams()
        self.procs = sorted((n for n in coordinator.children.values() if n.role == "client"),
                            key=lambda n: n.node_id)
        self.peers = [p.node_id for p in self.procs]
        host = cfg.transport.host
        master = f"{host}:{self.params.master_port or free_port(host)}"
        self.coll = Collectives("server", 0, len(self.procs) + 1, coordinator.ledger, self.params,
                                coordinator.run_id)
        calls = {p.node_id: coordinator._pool.submit(
            coordinator.endpoint.call, p.address, p.node_id, "torch_init",
            Payload(scalars={"rank": i + 1, "world_size": len(self.procs) + 1, "master": master,
                             "backend": self.params.backend, "timeout": self.params.timeout}),
            round=0, timeout=self.params.timeout) for i, p in enumerate(self.procs)}
        self.coll.init(master)
        _, failed = coordinator._gather(calls, self.params.timeout)
        if failed:
            raise RuntimeError(f"torch.distributed set-up failed: {failed}")
        log.info("torch.distributed %s group of %d ranks at %s", self.params.backend, len(self.procs) + 1, master)

    def dispatch(self, round: int, sampled: list[int], message: Payload):
        c = self.c
        by_proc = {p: [] for p in self.peers}
        for cid in sampled:
            by_proc[c.client_home[cid].node_id].append(cid)
        control = {p.node_id: c._pool.submit(
            c.endpoint.call, p.address, p.node_id, "torch_round",
            Payload(scalars={**message.scalars, "clients": ",".join(map(str, by_proc[p.node_id])),
                             "specs": specs_to_json(specs_of(message.tensors))}),
            round=round, timeout=c.cfg.run.round_timeout) for p in self.procs}
        try:
            self.coll.broadcast(list(message.tensors.values()), round, self.peers)
        except RuntimeError as exc:
            raise CollectiveFailed(f"round {round}: broadcast failed: {exc}") from None
        replies, failed = c._gather(control, c.cfg.run.round_timeout)
        if failed:
            raise CollectiveFailed(f"round {round}: client processes {sorted(failed)} did not finish the round "
                                   f"({next(iter(failed.values()))}); a collective needs every rank")
        failures: dict[int, str] = {}
        layouts, scalar_parts = {}, []
        for node, reply in sorted(replies.items()):
            s = dict(reply.scalars)
            failures.update({int(k): v for k, v in json.loads(str(s.pop("failures_json", "{}"))).items()})
            if "layout" in s:
                layouts[node] = s.pop("layout")
                scalar_parts.append(Payload(scalars=s))
        if not layouts:
            return {}, failures
        layout_text = next(iter(layouts.values()))
        if any(text != layout_text for text in layouts.values()):
            raise PayloadError("LAYOUT_MISMATCH", f"round {round}: client processes report different tensors")
        layout = json.loads(layout_text)
        reduce_calls = {p.node_id: c._pool.submit(c.endpoint.call, p.address, p.node_id, "torch_reduce",
                                                  Payload(scalars={"layout": layout_text}), round=round,
                                                  timeout=c.cfg.run.round_timeout) for p in self.procs}
        groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, dtype, shape, op in layout:
            groups.setdefault(op, []).append((name, torch.full(tuple(shape), IDENTITY[op], dtype=DTYPES[dtype])))
        try:
            self.coll.reduce([(op, [t for _, t in items]) for op, items in sorted(groups.items())], round,
                             self.peers)
        except RuntimeError as exc:
            raise CollectiveFailed(f"round {round}: reduce failed: {exc}") from None
        _, failed = c._gather(reduce_calls, c.cfg.run.round_timeout)
        if failed:
            raise CollectiveFailed(f"round {round}: reduce control failed: {failed}")
        partial = reduce_payloads(scalar_parts, c.algorithm.reply_reduce)
        partial.tensors = {name: t for items in groups.values() for name, t in items}
        partial.tensors = {name: partial.tensors[name] for name, *_ in layout}
        return {0: partial}, failures


class CollectiveFailed(RuntimeError):
    pass


__all__ = ["TorchRounds", "CollectiveFailed", "CallFailed", "RemoteError"]
