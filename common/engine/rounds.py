"""The round rules without a transport: one engine for the server, the client hosts and every tool.

A star round (DESIGN.md section 4, common/algorithms/base.py) as a sequence of pure steps over
(cfg, task, algorithm, state); whoever moves the messages (the coordinator over a transport, or
`RoundEngine.train_round` in this process) calls the same steps in the same order:

    sampled  = engine.sample(round)                      # stream ("sampling", round), seeded
    shared, own = engine.messages(round, sampled)        # broadcast + straggler plan + each client's variant
    reply    = local_update(cfg, task, algo, model, cid, round, own[cid], states[cid])   # on the client
    reply    = compress_upload(...)                      # the client's upload (QSGD if configured)
    result   = engine.accept(round, who, reply)          # the server decodes and validates it
    aggregate = engine.finish_round(round, results, participants)   # aggregate, server step, note participants
    metrics  = engine.metrics(round, aggregate)          # train loss, evaluation when due

Each client's minibatch stream is ("client", id, "round", round[, "step", step]), so a result does
not depend on which process hosts the client; replies are reduced in client-id order.  So for the
same config `RoundEngine.run` gives the same model, bit for bit, as a gRPC or in-memory run of the
star topology (tests/test_rounds.py), in a tight loop without processes, encoding or ledger.

Not modelled here (they need measured bytes or a transport): the deadline and over-commitment
cuts of common/engine/vclock.py, failures, and the edge, sequential and chain topologies' own rounds.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence, cast

import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import Algorithm, ClientContext, ServerState
from fedhop.common.algorithms.local import bind_params, get_params, share_params
from fedhop.common.algorithms.vectorized import stack_size, why_not_vectorized
from fedhop.common.config.schema import Config, client_local_steps, resolve_clients_per_round
from fedhop.common.engine.heterogeneity import apply_straggler_plan, devices_params
from fedhop.common.engine.vclock import RoundClock
from fedhop.common.numerics.sampling import steps_per_epoch
from fedhop.common.privacy import mechanism as private
from fedhop.common.privacy.dpsgd import SampleDP
from fedhop.common.privacy.noise import GaussianSource
from fedhop.common.processors.compressors.downlink import VERSION_KEY, DownlinkSender, downlink_coding
from fedhop.common.processors.pipeline import reply_chain, upload
from fedhop.common.processors.streaming import OrderedFold
from fedhop.common.processors.validation import finite_step, finite_streamed
from fedhop.common.tasks import build_task
from fedhop.common.tasks.base import Task
from fedhop.common.tasks.placed import host_task
from fedhop.common.topologies import spec_for
from fedhop.common.topologies.graphs import sampling_pool
from fedhop.common.util.nodeids import client_node
from fedhop.common.util.rng import numpy_stream, torch_stream
from fedhop.common.wire.message import COMPUTE_KEY, Payload

RoundHook = Callable[[int, "RoundEngine", list[int], Payload], None]


def client_generator(seed: int, cid: int, round: int, step: int = 0) -> torch.Generator:
    """Client `cid`'s minibatch stream in `round`; step > 0: a later call of the same round (an
    edge iteration, a Fed-CHS step, a chain hop)."""
    if step == 0:
        return torch_stream(seed, "client", cid, "round", round)
    return torch_stream(seed, "client", cid, "round", round, "step", step)


def client_context(cfg: Config, task: Task, model: torch.nn.Module, cid: int, round: int, message: Payload,
                   state: dict[str, torch.Tensor], step: int = 0) -> ClientContext:
    """Client `cid`'s context for its local solver: its data, its generator, its step budget
    with the server's straggler plan applied, its persistent `state`."""
    ctx = ClientContext(client_id=cid, task=task, model=model, num_samples=task.num_samples(cid),
                        generator=client_generator(cfg.run.seed, cid, round, step), round=round,
                        local_steps=client_local_steps(cfg, cid), local_epochs=cfg.algorithm.local_epochs,
                        state=state)
    if private.enabled(cfg) and cfg.privacy.mode == "dpsgd":   # sample-level DP-SGD in the local solver
        s = private.settings(cfg)
        ctx.sample_dp = SampleDP(s.clip_norm, s.z, GaussianSource(s.secure, cfg.run.seed, "dpsgd", cid, "round", round,
                                                                   "step", step))
    apply_straggler_plan(ctx, message)  # the server's straggler draw: less local work (common/engine/heterogeneity.py)
    return ctx


def _released(cfg: Config, algorithm: Algorithm, reply: Payload, message: Payload, cid: int, round: int,
              step: int) -> Payload:
    """Client and local DP: the client clips (and noises) its own update."""
    if private.enabled(cfg):
        return private.clip_reply(private.settings(cfg), reply, message, algorithm.reply_reduce, cfg.run.seed, cid,
                                  round, step)
    return reply


def local_update(cfg: Config, task: Task, algorithm: Algorithm, model: torch.nn.Module, cid: int, round: int,
                 message: Payload, state: dict[str, torch.Tensor], step: int = 0) -> Payload:
    """One logical client's local solver on `message` (what client/host.py runs for a `train` call):
    its context, the server's straggler plan applied, `client_update`, and the solver's seconds
    in the reply (COMPUTE_KEY).  `state` is the client's persistent state, updated in place.
    Under [algorithm] vectorized, the vectorized solver with this one client (`local_updates`),
    so that a client's result does not depend on whether others trained beside it."""
    if cfg.algorithm.vectorized:
        return local_updates(cfg, task, algorithm, model, [(cid, round, message, state, step)])[0]
    ctx = client_context(cfg, task, model, cid, round, message, state, step)
    started = time.perf_counter()
    reply = algorithm.client_update(ctx, message)
    reply = _released(cfg, algorithm, reply, message, cid, round, step)
    reply.scalars[COMPUTE_KEY] = time.perf_counter() - started
    return reply


TrainItem = tuple[int, int, Payload, dict[str, torch.Tensor], int]   # (client, round, message, state, step)


def local_updates(cfg: Config, task: Task, algorithm: Algorithm, model: torch.nn.Module,
                  items: Sequence[TrainItem]) -> list[Payload]:
    """`local_update` of each item; under [algorithm] vectorized, the clients' local SGD in
    vectorized computations (`Algorithm.client_updates`, common/algorithms/vectorized.py), as few
    as [algorithm] vectorized_memory_mb allows (`stack_size`), each reply's COMPUTE_KEY its share
    of its stack's seconds."""
    if not cfg.algorithm.vectorized:
        return [local_update(cfg, task, algorithm, model, *item) for item in items]
    if not items:
        return []
    problem = why_not_vectorized(task, model)
    if problem is not None:
        raise ValueError(f"config key 'algorithm.vectorized': {problem}")
    ctxs = [client_context(cfg, task, model, cid, round, message, state, step)
            for cid, round, message, state, step in items]
    messages = [item[2] for item in items]
    size = stack_size(ctxs, cfg.algorithm.batch_size, cfg.algorithm.vectorized_memory_mb << 20)
    replies = [reply for s in range(0, len(ctxs), size)   # stacks within algorithm.vectorized_memory_mb
               for reply in algorithm.client_updates(ctxs[s:s + size], messages[s:s + size])]
    return [_released(cfg, algorithm, reply, message, cid, round, step)
            for reply, (cid, round, message, _, step) in zip(replies, items)]


Restrict = Callable[[Sequence[int], int], Sequence[int]]  # (pool, size) -> the pool to sample from
LeftOut = Callable[[dict[int, str], list[int]], list[int]]             # (blamed, participants) -> participants


class RoundEngine:
    """The server side of a round over (cfg, task, algorithm, state), and an in-process loop that
    plays every client too (`train_round`, `run`)."""

    def __init__(self, cfg: Config, task: Task | None = None, algorithm: Algorithm | None = None,
                 state: ServerState | None = None) -> None:
        self.cfg = cfg
        self.task = task if task is not None else build_task(cfg)
        self.algorithm = algorithm if algorithm is not None else build_algorithm(cfg)
        self.model = self.task.build_model()   # the server's copy: initial parameters, evaluation
        self.state = state if state is not None else self.algorithm.init_state(get_params(self.model))
        share_params(self.model, self.state.params)   # the model's parameters are the state's: one copy in memory
        # stragglers, device profiles, over-commitment (common/engine/vclock.py): counts read from the CPU task
        self.clock = RoundClock(cfg, host_task(self.task))
        self._client_model: torch.nn.Module | None = None
        self.client_states: dict[int, dict[str, torch.Tensor]] = {}
        coding = downlink_coding(cfg)   # `compression.down`: the reference model the clients train from
        self._downlink = DownlinkSender(coding, cfg.run.seed, lambda: self.state.extra) if coding is not None else None
        self.privacy = self._private() if private.enabled(cfg) else None   # [privacy]: the server's mechanism
        self.last_privacy: dict[str, float] = {}   # train_round's last privacy metrics

    def _private(self) -> private.ServerPrivacy:
        """The server's side of differential privacy (common/privacy/mechanism.py): this process releases
        the noised sum, and the round's broadcast carries this round's clipping norm."""
        aggregate = self.algorithm.aggregate
        assert isinstance(aggregate, private.PrivateAggregate)   # installed by build_algorithm
        aggregate.releases = True
        server = private.ServerPrivacy(aggregate.s, aggregate, self._local_work)
        plain = self.algorithm.broadcast

        def broadcast(state: ServerState, round: int) -> Payload:
            message = plain(state, round)
            extra = server.broadcast_scalars()
            return Payload(tensors=message.tensors, scalars={**message.scalars, **extra},
                           control=message.control) if extra else message
        self.algorithm.broadcast = broadcast   # type: ignore[method-assign]
        return server

    def _local_work(self, cid: int) -> tuple[int, float]:
        """(local steps a round, batch size / examples) of client `cid` as the config sets them (a
        straggler does fewer: the count is an upper bound), for DP-SGD's accountant."""
        n = self.task.num_samples(cid)
        batch = n if self.cfg.algorithm.batch_size <= 0 else min(self.cfg.algorithm.batch_size, n)
        steps = client_local_steps(self.cfg, cid)
        if steps <= 0:
            steps = self.cfg.algorithm.local_epochs * steps_per_epoch(n, batch)
        return steps, batch / n if n else 1.0

    def privacy_round(self, round: int, sampled: list[int], participants: list[int]) -> dict[str, float]:
        """After a private round's server step: the accountant charged, C moved, the round's privacy
        metrics; {} without [privacy]."""
        return self.privacy.finish_round(round, sampled, participants) if self.privacy is not None else {}

    # ------------------------------------------------------------------ server steps
    def sample(self, round: int, restrict: Restrict | None = None, attempt: int = 0) -> list[int]:
        """Seeded sampling without replacement: stream ("sampling", round), over every client or,
        with topology.edges_per_round > 0, over the clients of the round's edges; ceil(c * S)
        clients under over-commitment (at most the pool).  `restrict(pool, size)` may narrow the
        pool first (the server leaves out dead nodes' clients, common/transport/liveness.py `live_pool`).
        `attempt` > 0: the round's retry after a short attempt (run.on_short_round = "retry"),
        drawn from its own stream ("sampling", round, "attempt", attempt)."""
        pool = sampling_pool(self.cfg, round)
        size = min(len(pool), self.clock.sample_size(resolve_clients_per_round(self.cfg)))
        if restrict is not None:
            pool = restrict(pool, size)
            size = min(size, len(pool))
        rng = (numpy_stream(self.cfg.run.seed, "sampling", round) if attempt == 0 else
               numpy_stream(self.cfg.run.seed, "sampling", round, "attempt", attempt))
        return sorted(pool[int(i)] for i in rng.choice(len(pool), size=size, replace=False))

    def messages(self, round: int, sampled: list[int]) -> tuple[Payload, dict[int, Payload]]:
        """The round's shared message (the broadcast with the straggler plan) and what each sampled
        client receives (the shared object, or the client's own variant: Algorithm.client_message)."""
        shared = self.clock.begin_round(round, sampled, self.algorithm.broadcast(self.state, round))
        if self._downlink is not None:   # every client trains from the reference model (downlink.py), as over a transport
            plain = self._downlink.code(shared)("")
            shared = Payload(tensors=plain.tensors, scalars={k: v for k, v in plain.scalars.items() if k != VERSION_KEY},
                             control=plain.control)
        return shared, {cid: self.algorithm.client_message(self.state, shared, round, cid) for cid in sampled}

    def accept(self, round: int, who: str, reply: Payload, peer: str = "") -> Payload:
        """A reply of `peer` as the server uses it: decoded (and EF21's copy advanced) and
        validated against the reply spec; raises PayloadError naming `who` when it is unusable."""
        chain = reply_chain(self.cfg, self.algorithm.reply_spec(self.state), "train", round=round, peer=peer,
                            memory=self.state.extra)
        return chain(reply, f"round {round} {who}")

    def finish_round(self, round: int, results: Mapping[int, Payload], participants: list[int],
                     left_out: LeftOut | None = None, fold: OrderedFold | None = None) -> Payload | None:
        """Aggregate the results in id order, apply the server step and tell the algorithm whose
        results entered; returns the aggregate.  Where the aggregate or the new model would hold
        NaN/Inf the step is rolled back and retried without the offending result
        (common/processors/validation.py `finite_step`); `left_out(blamed, participants)` records them and
        returns the participants left (default: refuse the round).
        With `fold` the results were folded as they arrived (common/processors/streaming.py; `results` holds
        their scalars only): its aggregate is used, and where it or the new model is not finite
        the worst result is named and None is returned: the round does not count
        (`finite_streamed`)."""
        if self.privacy is not None:
            self.privacy.aggregate.round = round   # the round's noise stream
        if fold is not None:
            magnitudes = cast("Mapping[int, float]", fold.magnitudes)   # the server folds by client id
            aggregate, blamed = finite_streamed(self.algorithm, self.state, fold.result(), magnitudes, round)
        else:
            aggregate, blamed = finite_step(self.algorithm, self.state, results, round)
        if blamed:
            if left_out is None:
                raise ValueError(f"round {round}: {next(iter(blamed.values()))}")
            participants = left_out(blamed, participants)
        if aggregate is None:
            return None
        self.algorithm.note_participants(self.state, round, participants)
        return aggregate

    def metrics(self, round: int, aggregate: Payload) -> dict[str, float]:
        """The round's metrics: the clients' weighted train loss, and an evaluation every
        `run.eval_every` rounds and after the last."""
        metrics: dict[str, float] = {}
        weight = float(aggregate.scalars.get("weight", 0.0)) or 1.0
        if "train_loss" in aggregate.scalars:
            metrics["client_train_loss"] = float(aggregate.scalars["train_loss"]) / weight
        if self.evaluation_due(round):
            metrics.update(self.evaluate())
        return metrics

    def evaluation_due(self, round: int) -> bool:
        """Every `run.eval_every` rounds (0: never) and after the last."""
        every = self.cfg.run.eval_every
        return round == self.cfg.run.rounds or bool(every and round % every == 0)

    def evaluate(self) -> dict[str, float]:
        """The model's metrics, and each of the algorithm's other outputs' (Algorithm.outputs, e.g.
        C-FedDA's averaged iterate) as `NAME_METRIC`."""
        out = self._evaluate(self.state.params)
        for name, params in self.algorithm.outputs(self.state).items():
            out.update({f"{name}_{k}": v for k, v in self._evaluate(params).items()})
        bind_params(self.model, self.state.params)
        return out

    def _evaluate(self, params: dict[str, torch.Tensor]) -> dict[str, float]:
        bind_params(self.model, params)
        with torch.no_grad():
            return {k: float(v) for k, v in self.task.evaluate(self.model).items()}

    # ------------------------------------------------------------------ in-process rounds
    def streams(self, per_client: bool = True) -> bool:
        """Whether a round's replies may be folded as they arrive (common/processors/streaming.py) instead
        of collected: the algorithm's aggregation is the default weighted-sum fold
        (`Algorithm.streams`), and, for single clients' replies, no deadline or over-commitment
        cut (common/engine/vclock.py) may drop a result after it arrived."""
        if not self.algorithm.streams():
            return False
        params = devices_params(self.cfg)
        return not per_client or (params.deadline_seconds <= 0 and params.overcommit <= 1)

    def check_local(self) -> None:
        """Refuse what this loop cannot reproduce: cuts that need each message's measured bytes."""
        params = devices_params(self.cfg)
        if params.deadline_seconds > 0 or params.overcommit > 1:
            raise ValueError("RoundEngine.train_round: clients.deadline_seconds and clients.overcommit cut results "
                             "by measured message bytes; run such a config over a transport (deploy/launch/inmemory.py)")
        if not spec_for(self.cfg.topology.kind).engine_rounds:
            raise ValueError(f"RoundEngine.train_round plays star rounds; topology.kind = '{self.cfg.topology.kind}' "
                             f"has its own round protocol (run it over a transport)")

    def train_round(self, round: int) -> tuple[list[int], Payload]:
        """One whole star round in this process, every sampled client trained here in id order with
        its upload encoded and decoded as over a transport; returns (sampled, aggregate)."""
        if self._client_model is None:
            self.check_local()
            self._client_model = self.task.build_model()   # the client host's own model
        sampled = self.sample(round)
        _, own = self.messages(round, sampled)
        results = {}
        states = {cid: self.client_states.pop(cid, {}) for cid in sampled}
        replies = local_updates(self.cfg, self.task, self.algorithm, self._client_model,
                                [(cid, round, own[cid], states[cid], 0) for cid in sampled])
        for cid, reply in zip(sampled, replies):
            state = states[cid]
            reply = upload(self.cfg, reply, client_node(cid), round, 0, state=state)
            if state:   # kept only when it holds something (control variates, residuals)
                self.client_states[cid] = state
            results[cid] = self.accept(round, f"reply of client {cid}", reply, client_node(cid))
        aggregate = self.finish_round(round, results, sampled)
        self.last_privacy = self.privacy_round(round, sampled, sampled)
        return sampled, aggregate   # type: ignore[return-value]  # no fold, no left_out: None only with no client sampled

    def run(self, rounds: int | None = None, on_round: RoundHook | None = None) -> list[dict[str, Any]]:
        """Rounds 1..`rounds` (default run.rounds) in this process; returns the metrics of every
        round ({"round": r, ...}).  `on_round(round, engine, sampled, aggregate)` runs after each
        server step."""
        history = []
        for r in range(1, (rounds or self.cfg.run.rounds) + 1):
            sampled, aggregate = self.train_round(r)
            if on_round is not None:
                on_round(r, self, sampled, aggregate)
            history.append({"round": r, **self.metrics(r, aggregate), **self.last_privacy})
        return history
