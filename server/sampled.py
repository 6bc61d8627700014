"""The star and hierarchical topologies: rounds of sampled clients (FedAvg's round, HierFAVG's).

A round samples clients, sends them the algorithm's message, gathers their results (or, in the
hierarchical topology, one partial aggregate per edge) and completes the round in the
Coordinator (aggregation, server step, metrics).  How the message reaches the clients is the
round's data plane, the transport's class for the driver's `concept` (STAR_ROUND or HIER_ROUND,
common/transport/factory.py `data_plane`):

- gRPC (and the in-memory test transport): a fan-out through the fabric, to the sampled
  clients (star, `ClientFanout`) or to the edges of the sampled clients (hierarchical,
  `EdgeFanout`, edge/aggregator.py);
- torch.distributed: one group round per round (a broadcast and a reduce over collectives),
  to the client processes (star) or to the edges (hierarchical) (server/group_rounds.py).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

from fedhop.common.processors.compressors.downlink import DownlinkSender, downlink_coding
from fedhop.common.processors.compressors.ef21 import message_for as ef21_reset_message
from fedhop.common.processors.compressors.use import upload_coding
from fedhop.common.processors.pipeline import ReplyChains
from fedhop.common.processors.streaming import OrderedFold, StreamedResults, reply_budget
from fedhop.common.transport.control import control_of, failures_of, sampled_clients
from fedhop.common.transport.fabric import Send, reply_chain
from fedhop.common.transport.factory import STAR_ROUND, NoDataPlane, data_plane
from fedhop.common.util.nodeids import client_node, edge_index
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method
from fedhop.server.driver import DriverContext, RoundResult, RunFailed, TopologyDriver


class SampledRounds(Protocol):
    """What only the sampled rounds use of the server's engine, beside the `DriverContext`
    (the Coordinator implements it: server/coordinator.py): streaming folds, failed calls,
    short rounds under run.on_short_round, and the end of a round (aggregation, the server
    step, evaluation, its record)."""

    def streams(self, per_client: bool = True) -> bool:
        """Whether the round's replies are folded as they arrive (common/processors/streaming.py)."""
    def note_failures(self, round: int, failures: dict[int, str], per_client: bool) -> None:
        """Failed calls that look like a dead process make its node suspect."""
    def is_short(self, sampled: list[int], results: dict, failures: dict[int, str]) -> bool:
        """Whether a round's results are fewer than run.min_results."""
    def short_round(self, round: int, attempt: int, sampled: list[int], failures: dict[int, str]) -> str:
        """A short attempt under run.on_short_round: "complete", "retry" or "skip"."""
    def complete_round(self, round: int, sampled: list[int], results: dict[int, Payload], failures: dict[int, str],
                       message: Payload, started: float, dispatched: float, arrivals: dict[int, float],
                       per_client: bool = True) -> RoundResult | None:
        """Settle the clock, aggregate, step, evaluate and record the round (None: skipped)."""


class DataPlane(ABC):
    """How one round's message reaches the sampled clients and their results come back.
    `per_client`: the results are one reply per client (not partial aggregates).  A plane is
    made with the driver's context and the engine's sampled rounds (`SampledRounds`)."""

    per_client: bool = True

    def __init__(self, ctx: DriverContext, rounds: SampledRounds) -> None:
        self.ctx, self.rounds = ctx, rounds
        cfg = ctx.run.cfg
        coding = downlink_coding(cfg)   # coded broadcasts (`compression.down`, downlink.py)
        self.downlink = (DownlinkSender(coding, cfg.run.seed, lambda: ctx.model.state.extra)
                         if coding is not None else None)

    @abstractmethod
    def dispatch(self, round: int, sampled: list[int], message: Payload,
                 arrivals: dict[int, float]) -> tuple[dict[int, Payload], dict[int, str]]:
        """Results keyed by client id (or by a partial's index), failures by client id."""


class ClientFanout(DataPlane):
    """Star over the fabric: each sampled client gets its message (its own variant where the
    algorithm has one, Algorithm.client_message; each distinct message is encoded once).
    With `compression.down` the broadcast is coded per receiving process against the model it
    holds (common/processors/compressors/downlink.py)."""

    def dispatch(self, round, sampled, message, arrivals):
        ctx, cfg, model, home = self.ctx, self.ctx.run.cfg, self.ctx.model, self.ctx.nodes.client_home
        algorithm = ctx.run.algorithm
        spec, rules = algorithm.reply_spec(model.state), algorithm.reply_scalars()
        down = self.downlink
        for_receiver = down.code(message) if down is not None else (lambda receiver: message)
        receiver = {cid: home[cid].node_id for cid in sampled}
        fold = round_fold(ctx, self.rounds, sampled, spec, per_client=True)
        ef21 = uses_ef21(cfg)
        chains = ReplyChains(cfg, spec, Method.TRAIN, rules, round=round, memory=model.state.extra,
                             folded=fold is not None)

        def arrived(cid: int) -> None:
            arrivals[cid] = time.perf_counter()

        requests = []
        for cid in sampled:
            node = client_node(cid)
            requests.append(Send(cid, home[cid].address, node, Method.TRAIN,
                                 ef21_message(ctx, ef21, model.client_message(for_receiver(receiver[cid]), round, cid),
                                              node),
                                 inbound=chains.chain(node, model.reply_limits([cid])),
                                 who=f"round {round} reply of client {cid}", on_reply=arrived))
        timeout = cfg.run.round_timeout
        results, failures = ctx.fabric.send_and_receive(
            requests, round=round, timeout=timeout, call_timeout=cfg.run.call_timeout,
            timeout_reason=f"timeout: no result within run.round_timeout={timeout}s", fold=fold)
        if down is not None:   # a process that answered holds the new reference; any other gets a resync next
            answered: dict[str, bool] = {}
            for cid in sampled:
                answered[receiver[cid]] = answered.get(receiver[cid], False) or cid in results
            down.delivered(answered)
        return results, failures


class EdgeFanout(DataPlane):
    """Hierarchical over the fabric: one `edge_round` call per edge with sampled clients, each
    answered by the edge's partial aggregate and the failures among its clients."""

    per_client = False

    def dispatch(self, round, sampled, message, arrivals):
        ctx, cfg, model, nodes, store = self.ctx, self.ctx.run.cfg, self.ctx.model, self.ctx.nodes, self.ctx.records.store
        algorithm = ctx.run.algorithm
        by_edge: dict[str, list[int]] = {}
        for cid in sampled:
            by_edge.setdefault(nodes.client_home[cid].node_id, []).append(cid)
        spec, rules = algorithm.reply_spec(model.state), algorithm.reply_scalars()
        down = self.downlink
        for_receiver = down.code(message) if down is not None else (lambda receiver: message)
        requests = []
        fold = round_fold(ctx, self.rounds, sorted(by_edge, key=edge_index), spec, per_client=False)
        ef21 = uses_ef21(cfg)
        for node_id, cids in sorted(by_edge.items()):
            shared = ef21_message(ctx, ef21, model.group_message(for_receiver(node_id), round, cids), node_id)
            payload = Payload(tensors=shared.tensors, scalars=shared.scalars, control=sampled_clients(cids))
            check = reply_chain(cfg, spec, Method.EDGE_ROUND, rules, model.reply_limits(cids),   # the edge speaks for its clients
                                round=round, peer=node_id, memory=model.state.extra, folded=fold is not None)
            requests.append(Send(node_id, nodes.children[node_id].address, node_id, Method.EDGE_ROUND, payload,
                                 inbound=check, who=f"round {round} partial of {node_id}"))
        timeout = cfg.run.round_timeout * 2
        partials, edge_failures = ctx.fabric.send_and_receive(
            requests, round=round, timeout=timeout, call_timeout=timeout,
            timeout_reason=f"timeout: no result within run.round_timeout={cfg.run.round_timeout}s", fold=fold)
        if down is not None:   # an edge that answered holds the new reference
            down.delivered({node_id: node_id in partials for node_id in by_edge})
        failures: dict[int, str] = {}
        for node_id, why in edge_failures.items():
            store.add_event("edge_failed", node=node_id, detail=why, round=round)
            for cid in by_edge[node_id]:
                failures[cid] = f"edge {node_id} failed: {why}"
            if " replied NO_RESULTS:" in why:   # none of its sampled clients answered: avoid them until it says more
                nodes.unavailable.setdefault(node_id, set()).update(by_edge[node_id])
        results: dict = {}
        if isinstance(partials, StreamedResults):   # folded in edge-index order; the round keys partials by index
            partials.fold.rekey(edge_index)
            results = StreamedResults()
            results.fold = partials.fold
        for node_id, partial in partials.items():
            failures.update({c: f"at {node_id}: {why}" for c, why in failures_of(partial).items()})
            control = control_of(partial)
            reported = set(control.clients)   # its clients whose processes it judges dead (edge/aggregator.py)
            if reported != nodes.unavailable.get(node_id, set()):
                store.add_event("clients_unavailable", node=node_id, round=round,
                                    detail=f"{len(reported)} clients on dead or suspect processes "
                                           f"{', '.join(control.processes[:10]) or '-'}: {sorted(reported)[:20]}")
            nodes.unavailable[node_id] = reported
            results[edge_index(node_id)] = partial
        return results, failures


def ef21_message(ctx: DriverContext, ef21: bool, message: Payload, peer: str) -> Payload:
    """The message to `peer`, with EF21's reset when its last upload was out of step (`ef21`:
    the run uses EF21; common/processors/compressors/ef21.py; the server's copies live in its
    state's extra)."""
    return ef21_reset_message(message, ctx.model.state.extra, peer) if ef21 else message


def uses_ef21(cfg) -> bool:
    coding = upload_coding(cfg)
    return coding is not None and coding.ef21


def round_fold(ctx: DriverContext, rounds: SampledRounds, keys: list, spec, per_client: bool) -> OrderedFold | None:
    """The round's streaming fold over `keys` in aggregation order (common/processors/streaming.py), or None
    where the round collects every reply (`SampledRounds.streams`): replies ahead of their turn
    are kept in memory up to one reply's bytes, spilled to the run directory beyond."""
    if not rounds.streams(per_client):
        return None
    return OrderedFold(keys, ctx.run.algorithm.reply_reduce, budget_bytes=reply_budget(spec, 1.0),
                       spill_dir=ctx.run.run_dir)


class SampledRoundDriver(TopologyDriver):
    """A round of sampled clients; its data plane is the transport's class for `concept`.
    Beside the context it takes the engine's `rounds` (`SampledRounds`, given by `create`)."""

    concept: ClassVar[str] = STAR_ROUND   # common/transport/factory.py PLANE_CONCEPTS
    rounds: SampledRounds

    def __init__(self, ctx: DriverContext) -> None:
        super().__init__(ctx)
        self.plane: DataPlane | None = None

    @classmethod
    def create(cls, ctx: DriverContext, rounds: SampledRounds) -> TopologyDriver:
        driver = cls(ctx)   # a subclass's own __init__ takes the context only, as every driver's
        driver.rounds = rounds
        return driver

    def start(self) -> None:
        try:
            factory = data_plane(self.ctx.run.cfg.transport.kind, self.concept, self.kind)
        except NoDataPlane as exc:
            raise RunFailed(str(exc)) from None
        try:
            self.plane = factory(self.ctx, self.rounds)
        except (RuntimeError, ValueError) as exc:   # a torch.distributed world that could not be set up
            raise RunFailed(str(exc)) from None

    def summary(self) -> dict:
        """With coded broadcasts: how many messages were coded differences and how many plain
        resyncs (the first round's included), and the reference's last version."""
        down = getattr(self.plane, "downlink", None)
        if down is None:
            return {}
        return {"downlink": {"coded_messages": down.coded_sends, "plain_messages": down.resyncs,
                             "reference_version": down.version}}

    def sample(self, round: int) -> list[int]:
        """The round's clients, sorted (a subclass may choose them its own way)."""
        return self.ctx.nodes.sample(round)

    def resample(self, round: int, attempt: int) -> list[int]:
        """The clients of retry `attempt` (>= 1) of a short round: a seeded draw of its own among
        the clients with a live process (Coordinator.sample)."""
        return self.ctx.nodes.sample(round, attempt)

    def run_round(self, round: int) -> RoundResult | None:
        """The round; an attempt short of run.min_results (its clients' processes died) is
        retried on a new sample or skipped, by run.on_short_round (`SampledRounds.short_round`):
        None when skipped."""
        ctx, rounds = self.ctx, self.rounds
        algorithm = ctx.run.algorithm
        assert self.plane is not None   # made by start
        attempt = 0
        while True:
            started = time.perf_counter()
            sampled = self.sample(round) if attempt == 0 else self.resample(round, attempt)
            message = ctx.clock.begin_round(round, sampled, algorithm.broadcast(ctx.model.state, round))
            dispatched = time.perf_counter()
            arrivals: dict[int, float] = {}
            results, failures = self.plane.dispatch(round, sampled, message, arrivals)
            rounds.note_failures(round, failures, self.plane.per_client)
            short = rounds.is_short(sampled, results, failures)
            action = rounds.short_round(round, attempt, sampled, failures) if short else "complete"
            if action == "skip":
                return None
            if action == "complete":
                return rounds.complete_round(round, sampled, results, failures, message, started, dispatched,
                                          arrivals, per_client=self.plane.per_client)
            attempt += 1
