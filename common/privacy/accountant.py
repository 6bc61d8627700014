"""Epsilon from a real accountant library: Google's dp-accounting (`dp_accounting`), its RDP
accountant (Mironov 2017; Mironov, Talwar, Zhang 2019 for the sampled Gaussian) or its PLD
accountant (privacy loss distributions, Koskela et al. 2020; Doroshenko et al. 2022).

One round is one release of a sampled Gaussian mechanism: the sum of the clipped updates of the
clients sampled with rate q_t = (clients sampled in round t) / (clients registered), noised with
multiplier z.  The rounds compose; epsilon is the accountant's at `privacy.delta` after each.

- sampling = "poisson": each round a `PoissonSampledDpEvent(q_t, GaussianDpEvent(z))` under
  add-or-remove-one adjacency (McMahan et al. 2018's accounting, and TensorFlow Federated's,
  with q = clients per round / clients);
- sampling = "fixed_size": `SampledWithoutReplacementDpEvent(N, m_t, GaussianDpEvent(z))`, the
  event of what fedhop's sampler does (m_t of N clients without replacement), under
  replace-one adjacency; only the RDP accountant supports it.

DP-SGD inside the clients (mode = "dpsgd", sample-level) is accounted per client too:
`sample_level_epsilon`, its local steps as Poisson-sampled Gaussian releases at rate B / n_i, and
the run records the largest over the clients.

Local DP (each client noises its own update) is accounted per client, without amplification by
sampling (the server knows who was sampled): `SelfComposedDpEvent(GaussianDpEvent(z), k)` for
the client that took part in the most rounds, k.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
from typing import Iterator, Sequence

import dp_accounting
from dp_accounting import pld, rdp

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed_size")
PLD_DISCRETIZATION = 1e-4   # dp-accounting's default value_discretization_interval for the PLD accountant


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The RDP accountant logs (through absl) each fractional order its series does not converge
    for and leaves it out of the minimum; those lines are noise in a run's log."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def make_accountant(kind: str, sampling: str = "poisson") -> dp_accounting.PrivacyAccountant:
    """A fresh accountant: RDP or PLD, under the adjacency the sampling event needs."""
    relation = (dp_accounting.NeighboringRelation.REPLACE_ONE if sampling == "fixed_size"
                else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    if kind == "rdp":
        return rdp.RdpAccountant(neighboring_relation=relation)
    if kind == "pld":
        if sampling == "fixed_size":
            raise ValueError("the PLD accountant does not support sampling without replacement; use rdp")
        return pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=PLD_DISCRETIZATION)
    raise ValueError(f"unknown accountant {kind!r} (allowed: {', '.join(ACCOUNTANTS)})")


def round_event(z: float, sampled: int, population: int, sampling: str = "poisson") -> dp_accounting.DpEvent:
    """One round's release: the sampled Gaussian mechanism with `sampled` of `population` clients."""
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier=z)
    if sampling == "fixed_size":
        return dp_accounting.SampledWithoutReplacementDpEvent(
            source_dataset_size=population, sample_size=sampled, event=gaussian)
    return dp_accounting.PoissonSampledDpEvent(sampling_probability=sampled / population, event=gaussian)


def epsilon(rounds: Sequence[tuple[int, int]], z: float, delta: float, kind: str = "rdp",
            sampling: str = "poisson") -> float:
    """Epsilon at `delta` after the rounds (sampled, population) composed, each with noise
    multiplier z; inf with z = 0 and any round, 0 with no round."""
    if not rounds:
        return 0.0
    if z <= 0:
        return math.inf
    acc = make_accountant(kind, sampling)
    with _quiet():
        for (sampled, population), count in _runs(rounds):
            acc.compose(round_event(z, sampled, population, sampling), count)
        return float(acc.get_epsilon(delta))


class RoundAccountant:
    """The accountant of one run, charged round by round (each round's event composed once, so a
    round costs one composition however long the run), and asked what one more round would cost."""

    def __init__(self, z: float, delta: float, kind: str = "rdp", sampling: str = "poisson") -> None:
        self.z, self.delta, self.kind, self.sampling = z, delta, kind, sampling
        self.rounds = 0
        self.history: list[tuple[int, int]] = []   # (sampled, population) of every round charged
        self._acc = make_accountant(kind, sampling)

    def restore(self, history: Sequence[tuple[int, int]]) -> None:
        """Charge the rounds of a resumed run (its checkpoint's history), consecutive equal rounds at once."""
        self.rounds, self.history = 0, []
        self._acc = make_accountant(self.kind, self.sampling)
        for (sampled, population), count in _runs(list(history)):
            self.history.extend([(sampled, population)] * count)
            self.rounds += count
            if self.z > 0:
                with _quiet():
                    self._acc.compose(round_event(self.z, sampled, population, self.sampling), count)

    def charge(self, sampled: int, population: int) -> float:
        """Compose one round of `sampled` of `population` clients; epsilon after it."""
        self.history.append((sampled, population))
        self.rounds += 1
        if self.z <= 0:
            return math.inf
        with _quiet():
            self._acc.compose(round_event(self.z, sampled, population, self.sampling))
        return self.epsilon()

    def epsilon(self) -> float:
        if self.rounds == 0:
            return 0.0
        if self.z <= 0:
            return math.inf
        with _quiet():
            return float(self._acc.get_epsilon(self.delta))

    def epsilon_if(self, sampled: int, population: int) -> float:
        """Epsilon after one more round of `sampled` of `population` clients, without charging it."""
        if self.z <= 0:
            return math.inf
        trial = copy.deepcopy(self._acc)
        with _quiet():
            trial.compose(round_event(self.z, sampled, population, self.sampling))
            return float(trial.get_epsilon(self.delta))


def local_epsilon(participations: int, z: float, delta: float, kind: str = "rdp") -> float:
    """Local DP: epsilon at `delta` of one client's `participations` noised releases (no sampling)."""
    return _repeated(dp_accounting.GaussianDpEvent(noise_multiplier=z), participations, z, delta, kind)


@functools.lru_cache(maxsize=4096)
def sample_level_epsilon(rate: float, steps: int, z: float, delta: float, kind: str = "rdp") -> float:
    """DP-SGD inside one client (mode = "dpsgd"): epsilon at `delta` of `steps` local steps, each the
    Gaussian mechanism on a batch of `rate` = B / n of the client's examples, accounted as Poisson
    sampling at that rate (the convention of Abadi et al. 2016 and Opacus for shuffled batches)."""
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise_multiplier=z))
    return _repeated(event, steps, z, delta, kind)


def _repeated(event: dp_accounting.DpEvent, count: int, z: float, delta: float, kind: str) -> float:
    """Epsilon at `delta` of `event` composed `count` times: 0 for none, inf without noise (z = 0)."""
    if count <= 0:
        return 0.0
    if z <= 0:
        return math.inf
    acc = make_accountant(kind)
    with _quiet():
        acc.compose(event, count)
        return float(acc.get_epsilon(delta))


CALIBRATION_BRACKET = (1e-3, 1e3)   # the noise multipliers `calibrate_noise` searches


def calibrate_noise(target_epsilon: float, delta: float, rounds: int, sampled: int, population: int,
                    kind: str = "rdp", sampling: str = "poisson", local: bool = False) -> float:
    """The smallest noise multiplier z whose epsilon after `rounds` rounds of `sampled` of
    `population` clients (local: `rounds` releases of one client) is at most `target_epsilon`:
    dp-accounting's `calibrate_dp_mechanism` (a bracketed search on the accountant itself)."""
    def event(z: float) -> dp_accounting.DpEvent:
        one = dp_accounting.GaussianDpEvent(noise_multiplier=z) if local else round_event(z, sampled, population,
                                                                                          sampling)
        return dp_accounting.SelfComposedDpEvent(one, rounds)

    low, high = CALIBRATION_BRACKET
    try:
        with _quiet():
            return float(dp_accounting.calibrate_dp_mechanism(
                lambda: make_accountant(kind, "poisson" if local else sampling), event, target_epsilon, delta,
                bracket_interval=dp_accounting.ExplicitBracketInterval(low, high), tol=1e-4))
    except (ValueError, RuntimeError):   # the search's bracket holds no solution
        pass

    def eps(z: float) -> float:
        acc = make_accountant(kind, "poisson" if local else sampling)
        with _quiet():
            acc.compose(event(z))
            return float(acc.get_epsilon(delta))

    if eps(high) > target_epsilon:
        why = f"even noise multiplier {high:g} gives epsilon {eps(high):.3g}: a larger target or fewer rounds"
    else:
        why = f"noise multiplier {low:g} already gives epsilon {eps(low):.3g}: set privacy.noise_multiplier yourself"
    raise ValueError(f"privacy.target_epsilon = {target_epsilon:g} over {rounds} rounds at delta {delta:g} is out of "
                     f"the calibration's reach ({low:g} to {high:g}): {why}")


def _runs(rounds: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    """Consecutive equal rounds grouped: ((sampled, population), count), so composition is one call per run."""
    out: list[tuple[tuple[int, int], int]] = []
    for r in rounds:
        if out and out[-1][0] == r:
            out[-1] = (r, out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out
