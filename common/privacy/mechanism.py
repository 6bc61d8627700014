"""The private mechanism a run applies (`[privacy]`, docs/privacy.md), between the algorithm's
replies and its server step.

- central (McMahan et al., ICLR 2018, Algorithm 1, DP-FedAvg): the server clips each client's
  update Delta_i to C (clip.py) and releases the noised sum
      Delta = (sum_i clip(Delta_i) + N(0, (z C)^2 I)) / m
  with m the number of clients the round samples (clients.per_round): the paper's
  fixed-denominator estimator f~_f = sum_k w_k Delta_k / (q W) with w_k = 1 and q W = (m / N) N
  = m, whose sensitivity C / m does not depend on how many replies arrived (a dropped client
  leaves the denominator as it is, so the estimate stays unbiased and the noise's share of it
  stays z C / m);
- client: each client clips its own update before it uploads it (mechanism `clip_reply`), and
  the server adds the same noise to the sum (a trusted aggregator that never needs to see an
  update longer than C: it clips once more, which leaves a clipped update as it is);
- local: each client clips its update and adds N(0, (z C)^2 I) to it itself; the server
  averages what arrives (over the replies' count) and adds nothing;
- dpsgd: sample-level DP-SGD inside each client (dpsgd.py); the server aggregates as usual and
  records the largest per-client sample-level epsilon.

With secure aggregation (`[secure_aggregation]`, SecAgg+) the server sees only the sum, so in
central and client modes alike each client clips its own update, in its masked-input phase, before
SecAgg+ quantizes it (client/secagg.py: to the bound that keeps the dequantized
update within C, common/security/secagg/quantize.py `private_bound`), and reports b_i as one more
integer coordinate of its masked input; the server receives the unmasked sum as one partial
result (with the sum of the b_i) and adds the same noise with the same fixed denominator.

Adaptive clipping (adaptive.py) rides on central and client: b_i = 1[||Delta_i|| <= C] is
counted (by the server in central mode, reported by the client as the `dp_unclipped` scalar in
client mode), the server adds N(0, sigma_b^2) to the count and moves C for the next round; the
clients learn C from the round's broadcast (the `dp_clip_norm` scalar).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping

import torch

from fedhop.common.privacy.adaptive import next_clip_norm, update_noise_multiplier
from fedhop.common.privacy.clip import clip_update
from fedhop.common.privacy.edges import edges_noise, top_up_share
from fedhop.common.privacy.noise import GaussianSource, add_noise
from fedhop.common.wire.message import COUNT_KEY, WEIGHT_KEY, Payload, ReduceOp, reduce_payloads

CLIP_KEY = "dp_clip_norm"        # broadcast scalar: this round's C (client and local modes)
UNCLIPPED_KEY = "dp_unclipped"   # reply scalar: b_i = 1 where the client's update was within C (client mode)


@dataclass(frozen=True)
class PrivacySettings:
    """`[privacy]` resolved for a run: the noise multiplier z (configured, or calibrated to the
    target epsilon), the update's share z_Delta under adaptive clipping, sigma_b, and the
    round's expected clients m of the population N."""

    mode: str
    clipping: str
    clip_norm: float
    z: float
    z_update: float
    sigma_b: float
    expected: int
    population: int
    rounds: int
    delta: float
    accountant: str
    sampling: str
    target_epsilon: float
    on_target: str
    secure: bool
    quantile: float
    clip_lr: float
    calibrated: bool = False
    noise_at: str = "server"   # behind edges: who adds the noise of the sum (common/privacy/edges.py)
    edges: bool = False        # the topology's edges receive the clients' updates (and clip in central mode)
    releases: int = 1          # releases of a client's update a round (hierarchical: kappa2 edge iterations)
    secure_sum: bool = False   # [secure_aggregation]: the server receives the clients' updates only summed

    @property
    def adaptive(self) -> bool:
        return self.clipping == "adaptive"

    @property
    def server_noise(self) -> bool:
        """Whether the server adds the noise to the sum (central and client modes)."""
        return self.mode in ("central", "client")

    @property
    def clients_clip(self) -> bool:
        """Whether the clients clip their own updates to C: client and local modes, and central
        mode under secure aggregation (the server never sees an update to clip)."""
        return self.mode in ("client", "local") or (self.mode == "central" and self.secure_sum)


def enabled(cfg: Any) -> bool:
    return getattr(getattr(cfg, "privacy", None), "mode", "none") != "none"


def settings(cfg: Any) -> PrivacySettings:
    """The run's resolved privacy settings (the calibration, where asked, done once per process:
    every process computes the same z from the same config)."""
    from fedhop.common.config.schema import resolve_clients_per_round
    from fedhop.common.privacy.edges import releases_per_round
    from fedhop.common.topologies import spec_for
    p = cfg.privacy
    m = resolve_clients_per_round(cfg)
    edges = spec_for(cfg.topology.kind).robust == "edge"
    releases = releases_per_round(cfg)
    sigma_b = p.clipped_count_stddev or m / 20.0
    z, calibrated = p.noise_multiplier, False
    if p.target_epsilon > 0 and p.on_target == "calibrate":
        local = p.mode == "local"   # a client's releases: kappa2 a round behind edges
        z = _calibrated(p.target_epsilon, p.delta, cfg.run.rounds * (releases if local else 1), m, cfg.clients.count,
                        p.accountant, p.sampling, local)
        calibrated = True
    z_update = update_noise_multiplier(z, sigma_b) if p.clipping == "adaptive" else z
    return PrivacySettings(mode=p.mode, clipping=p.clipping, clip_norm=p.clip_norm, z=z, z_update=z_update,
                           sigma_b=sigma_b, expected=m, population=cfg.clients.count, rounds=cfg.run.rounds,
                           delta=p.delta, accountant=p.accountant, sampling=p.sampling,
                           target_epsilon=p.target_epsilon, on_target=p.on_target, secure=p.secure_noise,
                           quantile=p.target_quantile, clip_lr=p.clip_lr, calibrated=calibrated,
                           noise_at=p.noise_at, edges=edges, releases=releases,
                           secure_sum=bool(getattr(getattr(cfg, "secure_aggregation", None), "enabled", False)))


@lru_cache(maxsize=8)
def _calibrated(target: float, delta: float, rounds: int, sampled: int, population: int, kind: str,
                sampling: str, local: bool) -> float:
    from fedhop.common.privacy.accountant import calibrate_noise
    return calibrate_noise(target, delta, rounds, sampled, population, kind, sampling, local)


def update_names(tensors: Mapping[str, torch.Tensor], ops: Mapping[str, ReduceOp]) -> list[str]:
    """The tensors of a reply that make up the update: the floating-point ones reduced by weighted sum."""
    return [n for n, t in tensors.items() if t.is_floating_point() and ops.get(n, "wsum") == "wsum"]


# ----------------------------------------------------------------------------- the client's side
def clip_reply(s: PrivacySettings, reply: Payload, message: Payload, ops: Mapping[str, ReduceOp], seed: int,
               client: int, round: int, step: int = 0) -> Payload:
    """A client's reply under client or local mode: its update clipped to this round's C (the
    broadcast's `dp_clip_norm`, else privacy.clip_norm), b_i reported (client mode), and in local
    mode N(0, (z C)^2) added from the client's own stream ("privacy", "client", id, "round", r),
    with ("step", k) after it for a later call of the round (an edge iteration k > 0: each
    release its own noise).  Under secure aggregation the central and client modes' clipping is
    the masked-input phase's (before quantization: client/secagg.py), so the reply leaves here
    unchanged."""
    if s.mode not in ("client", "local") or (s.secure_sum and s.mode == "client"):
        return reply
    bound = float(message.scalars.get(CLIP_KEY, s.clip_norm))
    names = update_names(reply.tensors, ops)
    tensors, _, within = clip_update(reply.tensors, bound, names)
    scalars = dict(reply.scalars)
    if s.mode == "client":
        scalars[UNCLIPPED_KEY] = 1.0 if within else 0.0
    else:
        names_of_stream: tuple[str | int, ...] = ("client", client, "round", round) + (("step", step) if step else ())
        source = GaussianSource(s.secure, seed, *names_of_stream)
        tensors = add_noise(tensors, s.z * bound, source, names)
    return Payload(tensors=tensors, scalars=scalars, control=reply.control)


# ----------------------------------------------------------------------------- the server's side
@dataclass
class Release:
    """What the server's mechanism released in a round: C, the replies, the noisy count."""

    clip_norm: float
    replies: int
    unclipped: float | None   # None where the edges noised the count before the server saw it
    noisy_unclipped: float | None


class PrivateAggregate:
    """An algorithm's `aggregate` under privacy (installed by `build_algorithm`): each client's
    update clipped to C (central and client modes; a no-op for an update already within C), the
    replies summed in order, and, where this process releases the sum (`releases`: the server),
    the noise added and the fixed denominator m set as the weight.  Replaces the streaming fold
    (every reply is clipped before it is summed)."""

    def __init__(self, ops: Mapping[str, ReduceOp], s: PrivacySettings, seed: int) -> None:
        self.ops, self.s, self.seed = ops, s, seed
        self.clip_norm = s.clip_norm
        self.releases = False   # set by the server's engine (common/engine/rounds.py)
        self.round = 0
        self.last: Release | None = None

    def __call__(self, replies: Iterable[tuple[int, Payload]]) -> Payload:
        items = [p for _, p in replies]
        kept, unclipped = [], 0.0
        for p in items:
            if COUNT_KEY in p.scalars or self.s.mode in ("local", "dpsgd"):   # a partial, or noised already
                kept.append(p)
                unclipped += float(p.scalars.get(UNCLIPPED_KEY, 0.0))
                continue
            tensors, _, within = clip_update(p.tensors, self.clip_norm, update_names(p.tensors, self.ops))
            b = float(p.scalars[UNCLIPPED_KEY]) if self.s.mode == "client" and UNCLIPPED_KEY in p.scalars \
                else (1.0 if within else 0.0)
            unclipped += b
            kept.append(Payload(tensors=tensors, scalars={**p.scalars, UNCLIPPED_KEY: b}, control=p.control))
        out = reduce_payloads(kept, self.ops)
        if not self.releases:
            return out
        source = GaussianSource(self.s.secure, self.seed, "server", "round", self.round)
        noisy = None
        share = top_up_share(self.s, out)   # the variance fraction left to the server (1: all of it)
        if self.s.server_noise:
            out.tensors.update(add_noise(out.tensors, self.s.z_update * self.clip_norm * math.sqrt(share), source,
                                         update_names(out.tensors, self.ops)))
            out.scalars[WEIGHT_KEY] = float(self.s.expected)   # the fixed denominator q W = m
            if self.s.adaptive:
                noisy = unclipped + source.scalar(self.s.sigma_b * math.sqrt(share))
        out.scalars[UNCLIPPED_KEY] = unclipped
        self.last = Release(self.clip_norm, len(items), None if edges_noise(self.s) else unclipped, noisy)
        return out


class ServerPrivacy:
    """The server's side of a private run: the current C (in the aggregate), the accountant charged
    round by round, each client's participations (local DP), and the per-round records."""

    def __init__(self, s: PrivacySettings, aggregate: PrivateAggregate,
                 local_work: Callable[[int], tuple[int, float]] | None = None) -> None:
        """`local_work(client)`: (local steps a round, batch size / examples) of a client, for DP-SGD."""
        from fedhop.common.privacy.accountant import RoundAccountant
        self.s, self.aggregate, self.local_work = s, aggregate, local_work
        self.accountant = RoundAccountant(s.z, s.delta, s.accountant, s.sampling)
        self.participations: dict[int, int] = {}
        self.epsilon = 0.0
        self.stopped = False

    def broadcast_scalars(self) -> dict[str, float]:
        """What the round's message carries for the clients where they clip (`clients_clip`) and
        for the edges that clip (central mode behind edges): C."""
        carries = self.s.clients_clip or (self.s.edges and self.s.mode == "central")
        return {CLIP_KEY: self.aggregate.clip_norm} if carries else {}

    def _local(self, most: int) -> float:
        from fedhop.common.privacy.accountant import local_epsilon
        return local_epsilon(most * self.s.releases, self.s.z, self.s.delta, self.s.accountant)

    def _sample_level(self, participations: Mapping[int, int]) -> float:
        """DP-SGD: the largest sample-level epsilon over the clients that took part (common/privacy/dpsgd.py)."""
        from fedhop.common.privacy.accountant import sample_level_epsilon
        assert self.local_work is not None
        out = 0.0
        for c, k in participations.items():
            steps, rate = self.local_work(c)
            out = max(out, sample_level_epsilon(rate, steps * k * self.s.releases, self.s.z, self.s.delta,
                                                self.s.accountant))
        return out

    def would_exceed(self) -> bool:
        """Whether one more round of the expected m clients would take epsilon past
        privacy.target_epsilon (on_target = "stop"); local DP counts it against the client that took
        part most (the worst case)."""
        if not (self.s.target_epsilon > 0 and self.s.on_target == "stop"):
            return False
        if self.s.mode == "local":
            nxt = self._local(max(self.participations.values(), default=0) + 1)
        elif self.s.mode == "dpsgd":
            nxt = self._sample_level({c: k + 1 for c, k in self.participations.items()} or
                                     {c: 1 for c in range(self.s.population)})
        else:
            nxt = self.accountant.epsilon_if(self.s.expected, self.s.population)
        return nxt > self.s.target_epsilon

    def finish_round(self, round: int, sampled: list[int], participants: list[int]) -> dict[str, float]:
        """After a round's server step: charge the accountant, move C (adaptive), and the round's
        metrics (run.db's rounds, the progress line, summary.json)."""
        release = self.aggregate.last
        for c in participants:
            self.participations[c] = self.participations.get(c, 0) + 1
        self.epsilon = self.accountant.charge(len(sampled), self.s.population)
        if self.s.mode == "local":
            self.epsilon = self._local(max(self.participations.values(), default=0))
        elif self.s.mode == "dpsgd":
            self.epsilon = self._sample_level(self.participations)
        metrics: dict[str, float] = {} if math.isinf(self.epsilon) else {"epsilon": self.epsilon}   # no noise: none
        metrics.update({
            "privacy_sampling_rate": len(sampled) / self.s.population,
            "privacy_noise_multiplier": self.s.z,
            "privacy_clip_norm": release.clip_norm if release is not None else self.aggregate.clip_norm,
        })
        if release is not None and self.s.mode in ("central", "client") and release.unclipped is not None:
            metrics["privacy_unclipped"] = release.unclipped
        if self.s.adaptive and release is not None and release.noisy_unclipped is not None:
            metrics["privacy_noisy_unclipped"] = release.noisy_unclipped
            metrics["privacy_unclipped_fraction"] = release.noisy_unclipped / self.s.expected
            self.aggregate.clip_norm = next_clip_norm(release.clip_norm, release.noisy_unclipped, self.s.expected,
                                                      self.s.clip_lr, self.s.quantile)
        self.aggregate.last = None
        return metrics

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the mechanism (JSON): the rounds charged, each client's
        participations, the current C, whether the target stopped the run."""
        return {"rounds": [list(r) for r in self.accountant.history], "clip_norm": self.aggregate.clip_norm,
                "participations": [[c, k] for c, k in sorted(self.participations.items())],
                "stopped": self.stopped}

    def restore(self, state: Mapping[str, Any]) -> None:
        """A resumed run's mechanism as its checkpoint left it (`checkpoint_state`): the accountant
        charged with every round before it, C, and the participations."""
        self.accountant.restore([(int(a), int(b)) for a, b in state.get("rounds", [])])
        self.aggregate.clip_norm = float(state.get("clip_norm", self.s.clip_norm))
        self.participations = {int(c): int(k) for c, k in state.get("participations", [])}
        self.stopped = bool(state.get("stopped", False))
        if self.s.mode == "local":
            self.epsilon = self._local(max(self.participations.values(), default=0))
        elif self.s.mode == "dpsgd":
            self.epsilon = self._sample_level(self.participations)
        else:
            self.epsilon = self.accountant.epsilon()

    def summary(self) -> dict[str, Any]:
        """summary.json's `privacy` section."""
        return {"mode": self.s.mode, "clipping": self.s.clipping, "noise_multiplier": self.s.z,
                "update_noise_multiplier": self.s.z_update, "calibrated": self.s.calibrated,
                "clip_norm_initial": self.s.clip_norm, "clip_norm_final": self.aggregate.clip_norm,
                "delta": self.s.delta, "epsilon": finite_or_none(self.epsilon), "accountant": self.s.accountant,
                "sampling": self.s.sampling, "rounds_accounted": self.accountant.rounds,
                "noise_source": "os.urandom (secure)" if self.s.secure else "seeded (run.seed)",
                "target_epsilon": self.s.target_epsilon or None, "stopped_at_target": self.stopped,
                "denominator": "fixed: clients.per_round" if self.s.server_noise else "replies",
                "noise_at": ("edges" if edges_noise(self.s) else "server") if self.s.server_noise else "clients",
                "releases_per_round": self.s.releases,
                "aggregation": "secure (SecAgg+): noise on the unmasked sum" if self.s.secure_sum else "plain"}


def finite_or_none(x: float) -> float | None:
    """JSON has no infinity: an unbounded epsilon (no noise) is recorded as null."""
    return x if math.isfinite(x) else None
