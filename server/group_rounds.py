"""The server's group data planes: a round as one group broadcast and reduce (common/transport/groups.py).

- `GroupRounds` (star): the group of the client processes, rooted at the server.  Each process
  pre-aggregates its sampled clients (client/group_worker.py) and contributes one partial.
- `HierGroupRounds` (hierarchical): the group of the edges, rooted at the server; each edge runs
  kappa2 cluster rounds in its own group (edge/group_edge.py) and contributes its partial.
- the sequential topology's model path builds on these worlds (topologies/sequential/group_paths.py).

The transport's `Worlds` (common/transport/groups.py `worlds`) sets the groups up; with
torch.distributed the tensors move as collectives and the control as fabric calls.  The
summation order differs from the per-client fan-out (per process, then across processes), so
results equal it within float rounding, not bit for bit (docs/torch_transport.md).
"""
from __future__ import annotations

import logging

from fedhop.common.processors.pipeline import reduced_chain
from fedhop.common.transport.groups import Group, GroupFailed, Member, worlds
from fedhop.common.util.nodeids import edge_index
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method
from fedhop.server.driver import DriverContext, RunFailed
from fedhop.server.sampled import DataPlane, SampledRounds

log = logging.getLogger("fedhop.server")


class CollectiveFailed(RunFailed):
    pass


def _failed_run(exc: GroupFailed) -> CollectiveFailed:
    return CollectiveFailed(str(exc) if exc.code == "COLLECTIVE_FAILED" else f"{exc.code}: {exc.detail}")


def group_members(ctx: DriverContext, role: str) -> list[Member]:
    nodes = [n for n in ctx.nodes.children.values() if n.role == role]
    key = (lambda n: edge_index(n.node_id)) if role == "edge" else (lambda n: n.node_id)
    return [Member(n.node_id, n.address) for n in sorted(nodes, key=key)]


class _GroupPlane(DataPlane):
    """A round of sampled clients as one group round rooted at the server."""

    per_client = False
    what = ""   # the members, in the reduced partial's name
    reduce_method = Method.TORCH_REDUCE   # the method whose members' partials are reduced

    def __init__(self, ctx: DriverContext, rounds: SampledRounds, group: Group, timeout: float,
                 prefix_failures: bool) -> None:
        super().__init__(ctx, rounds)
        self.group = group
        self.timeout = timeout
        self.prefix_failures = prefix_failures

    def dispatch(self, round: int, sampled: list[int], message: Payload, arrivals: dict[int, float]):
        ctx, algorithm = self.ctx, self.ctx.run.algorithm
        message = ctx.model.group_message(message, round, sampled)
        clients: dict[str, list[int]] = {m.node_id: [] for m in self.group.members}
        for cid in sampled:
            clients[ctx.nodes.client_home[cid].node_id].append(cid)
        try:
            result = self.group.round(round, message, clients, ops=algorithm.reply_reduce, timeout=self.timeout,
                                      reduce_timeout=ctx.run.cfg.run.round_timeout, where=f"round {round}")
        except GroupFailed as exc:
            raise _failed_run(exc) from None
        failures = result.all_failures(prefix=self.prefix_failures)
        if result.partial is None:
            return {}, failures
        try:
            reduced_chain(algorithm.reply_spec(ctx.model.state), self.reduce_method, round=round)(
                result.partial, f"round {round} reduced partial of the {self.what}")
        except PayloadError as exc:
            raise CollectiveFailed(str(exc)) from None
        return {0: result.partial}, failures


class GroupRounds(_GroupPlane):
    """Star: the group of the client processes (module docstring)."""

    what = "client processes"

    def __init__(self, ctx: DriverContext, rounds: SampledRounds) -> None:
        procs, cfg = group_members(ctx, "client"), ctx.run.cfg
        group = worlds(cfg.transport.kind).star(ctx.fabric, procs, cfg.transport, ctx.records.ledger, ctx.run.run_id)
        log.info("group of the server and %d client processes (transport %s)", len(procs), cfg.transport.kind)
        super().__init__(ctx, rounds, group, cfg.run.round_timeout, prefix_failures=False)


class HierGroupRounds(_GroupPlane):
    """Hierarchical (HierFAVG): the group of the edges; each edge runs its cluster rounds."""

    what = "edges"
    reduce_method = Method.TORCH_EDGE_REDUCE

    def __init__(self, ctx: DriverContext, rounds: SampledRounds) -> None:
        cfg = ctx.run.cfg
        compress = getattr(cfg.algorithm, "compress", "none")
        up = cfg.compression.up
        if up != "none":   # uploads are reduced as raw float sums here, never coded
            raise ValueError(f"compression.up = '{up}' is not supported with transport.kind = "
                             f"'{cfg.transport.kind}' and topology.kind = 'hierarchical' (allowed: 'none'); "
                             f"use transport.kind = 'grpc'")
        if compress != "none":
            raise ValueError(f"algorithm.compress = '{compress}' is not supported with transport.kind = "
                             f"'{cfg.transport.kind}' and topology.kind = 'hierarchical' (allowed: 'none'); "
                             f"use transport.kind = 'grpc'")
        world = worlds(cfg.transport.kind).edges(ctx.fabric, group_members(ctx, "edge"), cfg.transport,
                                                  ctx.records.ledger, ctx.run.run_id)
        log.info("edges' world: %s", world.description)
        super().__init__(ctx, rounds, world.top, cfg.run.round_timeout * 2, prefix_failures=True)


__all__ = ["GroupRounds", "HierGroupRounds", "CollectiveFailed", "group_members"]
