"""The algorithm interface shared by every role and every transport.

An algorithm says *what* each party computes and *what it sends*; transports move the
`Payload`s it returns and count their bytes (DESIGN.md section 4). The same object is used
by the server (state, broadcast, server step), by edges (partial aggregation) and by the
client processes (local solver), so one module reads top to bottom beside its paper.

Flow of one star round (hierarchical rounds insert `aggregate` at the edges):

    msg   = algo.broadcast(state, round)                         # server -> each sampled client
    reply = algo.client_update(ctx, msg)                         # on the client
    part  = algo.aggregate([(cid, reply), ...])                  # server (or edge) reduces replies
    algo.server_update(state, part, round)                       # server step, mutates state

`aggregate` must be associative over disjoint groups of clients (a reduction of an
edge's partial results gives the same numbers as reducing all the clients at once) so
edges can pre-aggregate.  The default reduction follows `reply_reduce`: named tensors and
scalars combined by weighted sum, sum, max or min, with the total weight carried along.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

# the message types live in the wire layer (common/wire/message.py); re-exported for the algorithms
from fedhop.common.wire.message import (  # noqa: F401
    COMPUTE_KEY,
    COUNT_KEY,
    REPLY_SCALARS,
    WEIGHT_KEY,
    Payload,
    ReduceOp,
    ReplyAccumulator,
    Scalar,
    ScalarRule,
    finite_or_raise,
    reduce_payloads,
    tensor_finite,
    weighted_mean,
)

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.tasks import Task

@dataclass
class ServerState:
    """Everything the server side of an algorithm keeps between rounds.

    `params` is the global model; `extra` holds algorithm state tensors (optimizer moments,
    control variates, dual sums) and `scalars` holds counters.  Checkpoints save all three.
    """

    params: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)


@dataclass
class ClientContext:
    """One logical client as its local solver sees it.

    `state` persists across rounds in the client process (SCAFFOLD's control variate,
    FedDyn's gradient memory); `generator` is the client's own seeded RNG stream for
    minibatch sampling; `local_steps` is this client's step budget this round (0: use
    epochs).
    """

    client_id: int
    task: "Task"
    model: torch.nn.Module
    num_samples: int
    generator: torch.Generator
    round: int
    local_steps: int
    local_epochs: int
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Scalar] = field(default_factory=dict)  # extra per-round facts (e.g. straggler flag)
    # [privacy] mode = "dpsgd": the local solver's per-example clipped, noised gradients (common/privacy/dpsgd.py)
    sample_dp: Any = None


@dataclass
class AlgorithmParams:
    """Base for an algorithm's own hyper-parameters ([algorithm] keys beyond the common ones)."""


class Algorithm(ABC):
    """Base class. Subclasses set `name`, `Params` and implement `client_update`."""

    name: str = "base"
    Params: type[AlgorithmParams] = AlgorithmParams
    # how reply fields combine across clients; keys absent here default to "wsum" for
    # tensors and "wsum" for float scalars.
    reply_reduce: Mapping[str, ReduceOp] = {}
    # whether an edge may step its model between server rounds (hierarchical kappa2 > 1, via
    # edge_step); the config loader refuses kappa2 > 1 for an algorithm that sets this False
    edge_iterations: bool = True
    # whether the parties may exchange a part of the model (model.exchange != "all"): true for an
    # algorithm whose parties touch the model only through get_params / set_params
    # (common/algorithms/local.py), which then carry only the exchanged parameters; the config
    # loader refuses a partial exchange for an algorithm that leaves this False
    partial_exchange: bool = False
    # whether the algorithm applies `[algorithm] regularizer` and `reg` (a composite term R(w),
    # common/algorithms/composite.py); the config loader refuses them for a built-in one that does not
    composite_term: bool = False

    def __init__(self, cfg: Any, params: AlgorithmParams | None = None) -> None:
        """`cfg` is the validated `[algorithm]` section (common.config.AlgorithmConfig)."""
        self.cfg = cfg
        self.params = params if params is not None else self.Params()

    # ------------------------------------------------------------------ server side
    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        return ServerState(params={k: v.detach().clone() for k, v in params.items()})

    def broadcast(self, state: ServerState, round: int) -> Payload:
        """What every sampled client receives at the start of a round (default: the model)."""
        return Payload(tensors=dict(state.params))

    def client_message(self, state: ServerState, message: Payload, round: int, client: int) -> Payload:
        """What sampled `client` receives this round: the shared `message` (default), or an
        extension of it (more tensors or scalars) for this client only, e.g. a cached snapshot
        the client lacks.  The coordinator encodes each distinct object once; where one message
        serves a group (an edge's clients, a collective broadcast) it sends the group's largest
        variant, so a variant must be a superset of `message`."""
        return message

    def note_participants(self, state: ServerState, round: int, participants: list[int]) -> None:
        """After the server step: the clients whose results entered this round (they surely
        received its messages).  Default: nothing to remember."""

    def outputs(self, state: ServerState) -> dict[str, dict[str, torch.Tensor]]:
        """Named candidate outputs besides `state.params` (the model), each evaluated into the
        metrics as `NAME_METRIC` and saved as `model-NAME.safetensors` (default: none).  C-/MC-FedDA
        give "last" and "average" (the paper's weighted average of the server iterates)."""
        return {}

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Names, dtypes and shapes every client reply must carry (default: one delta per
        parameter).  The server rejects a reply that does not match before using it."""
        return {name: (t.dtype, tuple(t.shape)) for name, t in state.params.items()}

    def reply_scalars(self) -> dict[str, ScalarRule]:
        """Type and range of each named reply scalar (default: the common ones, REPLY_SCALARS).
        A scalar not named here must be a finite number."""
        return REPLY_SCALARS

    def max_weight(self, num_samples: int) -> float | None:
        """The largest `weight` a client holding `num_samples` samples may send (the bound
        `client_weight` implies); None: the algorithm's weights have no such bound."""
        if getattr(self.cfg, "weighting", "samples") == "uniform":
            return 1.0
        return float(num_samples)

    @abstractmethod
    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        """Run the local solver; return the reply (must include scalar `weight`)."""

    @classmethod
    def trains_together(cls) -> bool:
        """Whether `client_updates` trains several clients in one vectorized computation
        ([algorithm] vectorized = true, common/algorithms/vectorized.py); the config loader refuses
        the key for an algorithm that answers False."""
        return False

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of each client, computed together (only where `trains_together`)."""
        raise NotImplementedError(f"algorithm '{self.name}' does not train clients together")

    def aggregate(self, replies: Iterable[tuple[int, Payload]]) -> Payload:
        """Reduce replies (sorted by client or edge id by the caller) into one partial result."""
        return reduce_payloads([p for _, p in replies], self.reply_reduce)

    def streams(self) -> bool:
        """Whether this algorithm's aggregation is the default weighted-sum fold, so the server and
        the edges may fold each reply as it arrives (common/processors/streaming.py) instead of holding every
        reply: False where a subclass overrides `aggregate` or a robust rule replaces it
        (common/engine/robust.py: the median and Krum need every reply at once)."""
        return type(self).aggregate is Algorithm.aggregate and "aggregate" not in vars(self)

    @abstractmethod
    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        """Apply the server step for this round, mutating `state`."""

    # ------------------------------------------------------------------ edge side (hierarchical)
    def edge_step(self, message: Payload, partial: Payload) -> Payload:
        """An edge's intermediate aggregation (HierFAVG, kappa2 > 1): the edge model moves by
        the weighted mean of its clients' deltas, w_e <- w_e + sum_i p_i Delta_i.  Algorithms
        whose replies are not parameter deltas override this and `edge_partial`."""
        tensors = dict(message.tensors)
        for name, t in message.tensors.items():
            if name in partial.tensors:
                tensors[name] = t + weighted_mean(partial, name)
        return Payload(tensors=tensors, scalars=dict(message.scalars))

    def edge_partial(self, start: Payload, current: Payload, last: Payload) -> Payload:
        """What an edge returns after kappa2 > 1 iterations: its total model change
        (current + its last iteration's mean delta - start), as a partial aggregate of weight
        W_e (the weight of its last iteration's clients)."""
        weight = float(last.scalars[WEIGHT_KEY])
        tensors = {name: (current.tensors[name] + weighted_mean(last, name) - start.tensors[name]) * weight
                   for name in last.tensors if name in start.tensors}
        scalars = {k: v for k, v in last.scalars.items()}
        return Payload(tensors=tensors, scalars=scalars)

    # ------------------------------------------------------------------ helpers
    def client_weight(self, ctx: ClientContext) -> float:
        """Aggregation weight: the sample count, or 1 under `weighting = "uniform"`."""
        if getattr(self.cfg, "weighting", "samples") == "uniform":
            return 1.0
        return float(ctx.num_samples)


def params_dataclass_from(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """Build an algorithm's Params dataclass from config keys, naming any bad key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            raise KeyError(f"{where}: unknown key '{key}' (allowed: {', '.join(sorted(fields)) or 'none'})")
    return cls(**values)


@dataclass
class ClusterRound:
    """What one cluster's round of a sequential algorithm produced: the model after it, the
    clients that failed (id -> why), and the weighted training loss of the replies."""

    params: dict[str, torch.Tensor]
    failures: dict[int, str]
    loss_sum: float = 0.0
    weight_sum: float = 0.0


# one intra-round step of a cluster: (step k, message) -> the reduced replies (None: no client
# answered) and the clients that failed; the edge supplies it over its fabric or collectives
ClusterStep = Callable[[int, Payload], tuple[Payload | None, dict[int, str]]]


class SequentialAlgorithm(Algorithm):
    """An algorithm whose single model walks a graph of clusters (topology.kind = "sequential"):
    each round one cluster's edge runs `cluster_round` with its clients and hands the model to
    the neighbour `next_holder` ranks first.  The model never passes through the server, so
    there is no server step; the config loader pairs these algorithms with that topology."""

    sequential = True

    @abstractmethod
    def cluster_round(self, params: dict[str, torch.Tensor], step: ClusterStep, steps: int) -> ClusterRound:
        """One round at the holding cluster, from the model `params`."""

    @abstractmethod
    def next_holder(self, candidates: dict[int, tuple[int, int]]) -> list[int]:
        """The neighbours in the order the model should try them: `candidates` maps a
        neighbour's id to (its visit count, its cluster's data size)."""

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        raise RuntimeError(f"{self.name} has no server step: its model walks the edges (topology.kind = "
                           f"\"sequential\"), and the server only stores the final model")
