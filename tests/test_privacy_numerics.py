"""[privacy] numerics (common/privacy/): the noise's standard deviation against z * C / m by a
chi-square interval, clipping's bound over random updates, the recorded epsilon against
dp-accounting called directly, and adaptive clipping's C against the paper's update in numpy."""
from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import stats

from fedhop.common.config import load_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.privacy import accountant
from fedhop.common.privacy.adaptive import next_clip_norm, update_noise_multiplier
from fedhop.common.privacy.clip import clip_update, update_norm
from fedhop.common.privacy.mechanism import PrivateAggregate, settings
from fedhop.common.privacy.noise import GaussianSource, secure_standard_normal
from fedhop.common.wire.message import WEIGHT_KEY, Payload

P = 1e-6   # each statistical test's two-sided false-alarm probability


def _chi2_interval(n: int, std: float) -> tuple[float, float]:
    """The (1 - P) interval of the sample variance of n N(0, std^2) draws (known mean 0):
    sum x^2 / std^2 ~ chi^2_n."""
    lo, hi = stats.chi2.ppf(P / 2, n), stats.chi2.ppf(1 - P / 2, n)
    return std ** 2 * lo / n, std ** 2 * hi / n


def _config(tmp_path, *sets: str):
    return load_config(_example(tmp_path), ["algorithm.weighting=uniform", "clients.count=20", "clients.per_round=5",
                                            *sets])


def _example(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\ndataset = "digits"\n[model]\nkind = "mlp"\nhidden = [8]\n'
                    '[algorithm]\nlocal_steps = 2\nbatch_size = 8\n')
    return path


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("z,clip", [(1.1, 0.5), (3.0, 2.0)])
def test_the_servers_noise_has_std_z_times_c_over_m(tmp_path, secure, z, clip):
    """The released mean minus the mean of the clipped updates is the noise / m: its variance,
    over 200,000 coordinates, lies in the chi-square interval of (z C / m)^2."""
    cfg = _config(tmp_path, "privacy.mode=central", f"privacy.clip_norm={clip}", f"privacy.noise_multiplier={z}",
                  f"privacy.secure_noise={'true' if secure else 'false'}")
    s = settings(cfg)
    agg = PrivateAggregate({}, s, cfg.run.seed)
    agg.releases, agg.round = True, 3
    rng = np.random.default_rng(1)
    updates = [torch.from_numpy(rng.normal(0, 1, 100_000)) for _ in range(3)]   # 3 replies of 5 sampled: m = 5
    replies = [(i, Payload(tensors={"w": u, "b": u[:100_000] * 0.5}, scalars={WEIGHT_KEY: 1.0}))
               for i, u in enumerate(updates)]
    out = agg(replies)
    assert out.scalars[WEIGHT_KEY] == 5.0   # the fixed denominator m = clients.per_round
    clipped = [clip_update(p.tensors, clip)[0] for _, p in replies]
    for name in ("w", "b"):
        noise = (out.tensors[name] - sum(c[name] for c in clipped)).numpy() / 5.0
        lo, hi = _chi2_interval(noise.size, z * clip / 5.0)
        assert lo <= float(np.mean(noise ** 2)) <= hi


def test_secure_draws_are_standard_normal():
    """os.urandom through Box-Muller: the mean and variance of 400,000 draws within their (1 - P) bounds,
    and a Kolmogorov-Smirnov test against N(0, 1) not rejected at P."""
    x = secure_standard_normal(400_001)
    assert x.shape == (400_001,)
    n = x.size
    assert abs(x.mean()) <= stats.norm.ppf(1 - P / 2) / math.sqrt(n)
    lo, hi = _chi2_interval(n, 1.0)
    assert lo <= float(np.mean(x ** 2)) <= hi
    assert stats.kstest(x, "norm").pvalue > P


def test_seeded_noise_repeats_and_secure_noise_does_not():
    a = GaussianSource(False, 7, "server", "round", 1).standard_normal(1000)
    b = GaussianSource(False, 7, "server", "round", 1).standard_normal(1000)
    c = GaussianSource(True, 7, "server", "round", 1).standard_normal(1000)
    d = GaussianSource(True, 7, "server", "round", 1).standard_normal(1000)
    assert np.array_equal(a, b) and not np.array_equal(c, d)


def test_a_clipped_update_never_exceeds_c_and_a_short_one_is_unchanged():
    rng = np.random.default_rng(11)
    for trial in range(400):
        dtype = (torch.float32, torch.float64)[trial % 2]
        scale = 10.0 ** rng.uniform(-4, 4)
        tensors = {f"t{k}": torch.from_numpy(rng.normal(0, scale, size=rng.integers(1, 50, size=2))).to(dtype)
                   for k in range(int(rng.integers(1, 5)))}
        bound = float(10.0 ** rng.uniform(-3, 3))
        out, norm, within = clip_update(tensors, bound)
        assert update_norm(out) <= bound
        assert norm == pytest.approx(math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors.values())))
        assert within == (norm <= bound)
        if within:
            assert all(out[k] is tensors[k] for k in tensors)   # the same tensors, bit for bit
        else:   # the direction is kept: out = tensors * (C / norm)
            assert update_norm(out) == pytest.approx(bound, rel=1e-5)
            for k in tensors:
                assert torch.allclose(out[k].double(), tensors[k].double() * (bound / norm), rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.37])
@pytest.mark.parametrize("z", [0.7, 1.1, 3.0])
def test_epsilon_equals_dp_accountings_called_directly(kind, q, z):
    """Held-out rates and multipliers: fedhop's epsilon after 25 rounds of m = q N clients (N = 1000)
    against dp-accounting's accountant composed by hand, 25 rounds of the Poisson-sampled Gaussian."""
    population, rounds, delta = 1000, 25, 1e-5
    sampled = round(q * population)
    ours = accountant.epsilon([(sampled, population)] * rounds, z, delta, kind)
    direct = (dp_accounting.rdp.RdpAccountant() if kind == "rdp" else dp_accounting.pld.PLDAccountant())
    direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    assert ours == pytest.approx(direct.get_epsilon(delta), rel=1e-9)


@pytest.mark.parametrize("q,z", [(0.01, 0.7), (0.37, 1.1)])
def test_fixed_size_sampling_equals_dp_accountings_event(q, z):
    population = 1000
    sampled = round(q * population)
    ours = accountant.epsilon([(sampled, population)] * 10, z, 1e-6, "rdp", "fixed_size")
    direct = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_accounting.SampledWithoutReplacementDpEvent(population, sampled,
                                                                  dp_accounting.GaussianDpEvent(z)), 10)
    assert ours == pytest.approx(direct.get_epsilon(1e-6), rel=1e-9)


def test_the_engines_recorded_epsilon_is_the_accountants_round_by_round(tmp_path):
    cfg = _config(tmp_path, "run.rounds=4", "privacy.mode=central", "privacy.clip_norm=1.0",
                  "privacy.noise_multiplier=1.3", "privacy.delta=1e-4")
    history = RoundEngine(cfg).run()
    for r, row in enumerate(history, start=1):
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.PoissonSampledDpEvent(5 / 20, dp_accounting.GaussianDpEvent(1.3)), r)
        assert row["epsilon"] == pytest.approx(direct.get_epsilon(1e-4), rel=1e-9)
        assert row["privacy_sampling_rate"] == 0.25


def test_calibrated_noise_spends_the_target_epsilon(tmp_path):
    cfg = _config(tmp_path, "run.rounds=6", "privacy.mode=central", "privacy.clip_norm=1.0",
                  "privacy.target_epsilon=2.0", "privacy.on_target=calibrate")
    z = settings(cfg).z
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(z)), 6)
    assert direct.get_epsilon(1e-5) <= 2.0 + 1e-6
    slightly_less = dp_accounting.rdp.RdpAccountant()
    slightly_less.compose(dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(z * 0.99)), 6)
    assert slightly_less.get_epsilon(1e-5) > 2.0   # the smallest such z, to 1 %


def test_the_adaptive_noise_split_costs_what_z_costs():
    for z, sigma_b in [(0.5, 0.5), (1.0, 5.0), (3.0, 2.0)]:
        zd = update_noise_multiplier(z, sigma_b)
        assert (zd ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z)
        assert zd > z
    with pytest.raises(ValueError):
        update_noise_multiplier(1.0, 0.5)


@pytest.mark.parametrize("mode", ["central", "client"])
def test_adaptive_clip_norm_follows_the_papers_update_from_the_recorded_counts(tmp_path, mode):
    """C_{t+1} = C_t exp(-eta (b_bar_t - gamma)), b_bar_t = noisy count / m, computed in numpy from the
    noisy counts the engine recorded; the first C is privacy.clip_norm, and the noiseless counts
    are the updates within C (at most m)."""
    cfg = _config(tmp_path, "run.rounds=6", f"privacy.mode={mode}", "privacy.clip_norm=0.05",
                  "privacy.noise_multiplier=0.4", "privacy.clipping=adaptive", "privacy.clip_lr=0.3",
                  "privacy.target_quantile=0.6", "privacy.clipped_count_stddev=0.5")
    history = RoundEngine(cfg).run()
    clips = np.array([row["privacy_clip_norm"] for row in history])
    noisy = np.array([row["privacy_noisy_unclipped"] for row in history])
    expected = np.empty_like(clips)
    expected[0] = 0.05
    for t in range(1, len(clips)):
        expected[t] = expected[t - 1] * np.exp(-0.3 * (noisy[t - 1] / 5 - 0.6))
    np.testing.assert_allclose(clips, expected, rtol=1e-12)
    assert all(0 <= row["privacy_unclipped"] <= 5 for row in history)
    assert not np.allclose(clips, clips[0])   # it moved
    assert next_clip_norm(2.0, 3.0, 5, 0.3, 0.6) == pytest.approx(2.0)   # b_bar = gamma: C stays


@pytest.mark.parametrize("target, side", [(0.001, "even noise multiplier"), (1e300, "already gives epsilon")])
def test_a_target_epsilon_out_of_reach_is_one_line_naming_the_key(target, side):
    """A target no noise multiplier of the search's bracket meets (too small: even the largest
    spends more; too large: the smallest already spends less) is a ValueError naming the key and
    the epsilon at that end of the bracket, as dp-accounting computes it directly, not the search's
    own "did not bracket a solution"."""
    rounds, sampled, population, delta = 30, 10, 50, 1e-5
    with pytest.raises(ValueError) as exc:
        accountant.calibrate_noise(target, delta, rounds, sampled, population)
    text = str(exc.value)
    assert text.startswith(f"privacy.target_epsilon = {target:g} over {rounds} rounds") and side in text, text
    low, high = accountant.CALIBRATION_BRACKET
    z = high if target < 1 else low
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        sampled / population, dp_accounting.GaussianDpEvent(noise_multiplier=z)), rounds))
    assert f"{acc.get_epsilon(delta):.3g}" in text, text
