"""Central differential privacy on a SecAgg+ sum (docs/privacy.md, "With secure aggregation"),
the library parts: the bound before quantization keeps every dequantized update within C (and
clipping to C alone does not), the clipped-count bit travels as an extra masked coordinate whose
unmasked sum is the count exactly (with dropouts), the server's noise on the unmasked partial has
the configured standard deviation z C (chi-square interval at P = 1e-6) with the fixed denominator,
and the accountant's epsilon is dp-accounting's; the config's refusals."""
from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import stats

from fedhop.common.config import load_config
from fedhop.common.config.schema import ConfigError
from fedhop.common.privacy.mechanism import UNCLIPPED_KEY, PrivateAggregate, ServerPrivacy, settings
from fedhop.common.privacy.secure_sum import client_input, extras, split_sum
from fedhop.common.security.secagg import quantize
from fedhop.common.security.secagg.params import SecAggParams
from fedhop.common.security.secagg.simulate import simulate_round
from fedhop.common.wire.message import COUNT_KEY, WEIGHT_KEY, Payload

P = 1e-6   # the statistical test's two-sided false-alarm probability


def _config(tmp_path, *sets: str):
    path = tmp_path / "c.toml"
    path.write_text('[data]\ndataset = "digits"\n[model]\nkind = "mlp"\nhidden = [8]\n'
                    '[algorithm]\nlocal_steps = 2\nbatch_size = 8\nweighting = "uniform"\n'
                    '[clients]\ncount = 20\nper_round = 5\n'
                    '[secure_aggregation]\nenabled = true\nclip = 4.0\nquant_bits = 10\nmodulus_bits = 32\n')
    return load_config(path, list(sets))


def test_the_bound_before_quantization_keeps_the_dequantized_update_within_c():
    """Over 2,000 random updates of d = 64 coordinates, norms around C: clipped to B =
    C - sqrt(d) 2 clip / L, stochastically rounded with 6 bits, the dequantized update's norm never
    exceeds C; clipped to C itself, rounding takes some past C (the slack is needed)."""
    d, clip, bits, c = 64, 1.0, 6, 0.8
    rng = np.random.default_rng(7)
    bound = quantize.private_bound(c, d, clip, 2 * clip / 63)
    assert bound == pytest.approx(c - 8 * 2 / 63)
    worst_bounded, worst_plain = 0.0, 0.0
    for i in range(2000):
        x = rng.normal(0, 1, d) * rng.uniform(0.05, 0.3)
        for b, which in ((bound, "bounded"), (c, "plain")):
            q = quantize.quantize(x, clip, bits, np.random.default_rng([i, 1]), b)
            norm = float(np.linalg.norm(quantize.dequantize_sum(q, 1, clip, bits)))
            if which == "bounded":
                worst_bounded = max(worst_bounded, norm)
            else:
                worst_plain = max(worst_plain, norm)
    assert worst_bounded <= c * (1 + 1e-12)
    assert worst_plain > c
    # a bound at or above clip is clip's: the plain SecAgg+ clip, the same integers bit for bit
    x = rng.normal(0, 1, d)
    plain = quantize.quantize(x, clip, bits, np.random.default_rng(3))
    assert np.array_equal(quantize.quantize(x, clip, bits, np.random.default_rng(3), 5.0), plain)


@pytest.mark.parametrize("phase", [None, "masked", "unmask"])
def test_the_clipped_count_is_an_extra_coordinate_summed_exactly(phase):
    """Seven clients, complete graph (k = 6), t = 4, two dropping in `phase`: the unmasked vector is the exact sum of
    the survivors' quantized, bounded updates (numpy, independently) followed by the sum of their
    bits b_i = 1[||x_i|| <= C]."""
    n, d, c = 7, 30, 1.0
    params = SecAggParams(n=n, degree=0, threshold=4, modulus_bits=24, clip=2.0, quant_bits=12, seed=11)
    rng = np.random.default_rng(5)
    ups = {u: rng.normal(0, 1, d) * (0.1 if u % 2 else 0.5) for u in range(n)}   # norms ~0.55 and ~2.7
    bound = quantize.private_bound(c, d, params.clip, params.integer_code.step)
    bits = {u: np.array([int(np.linalg.norm(x) <= c)]) for u, x in ups.items()}
    assert 0 < sum(int(b[0]) for b in bits.values()) < n
    drop = {phase: {1, 4}} if phase else {}
    sim = simulate_round(params, ups, drop, round_number=2, bound=bound, extras=bits)
    survivors = sim.aggregate.clients
    assert survivors == (sorted(set(range(n)) - {1, 4}) if phase == "masked" else list(range(n)))
    expected = np.zeros(d, dtype=np.int64)
    for u in survivors:   # docs/secure-aggregation.md's quantization, written out
        x = ups[u] * min(1.0, bound / np.linalg.norm(ups[u]))
        y = (x + params.clip) / (2 * params.clip) * (2 ** params.quant_bits - 1)
        low = np.floor(y)
        expected += (low + (np.random.default_rng([params.seed, 2, u, 0x9A]).random(d) < y - low)).astype(np.int64)
    total = sim.aggregate.total.astype(np.int64)
    assert total[:d].tolist() == expected.tolist()
    assert int(total[d]) == sum(int(bits[u][0]) for u in survivors)
    summed, scalars = split_sum(sim.aggregate.total, len(survivors), d, params)
    assert scalars == {UNCLIPPED_KEY: float(total[d])}
    assert np.allclose(summed, expected * (2 * params.clip / (2 ** params.quant_bits - 1))
                       - len(survivors) * params.clip)


def test_a_client_clips_to_the_rounds_c_and_reports_its_bit(tmp_path):
    cfg = _config(tmp_path, "privacy.mode=central", "privacy.clip_norm=1.5", "privacy.noise_multiplier=1.0")
    assert extras(cfg) == 1
    params = SecAggParams(n=5, degree=0, threshold=3, clip=4.0, quant_bits=10, modulus_bits=32)
    flat = np.full(100, 0.2)   # norm 2
    bound, bit = client_input(cfg, params, Payload(scalars={"dp_clip_norm": 2.5}), flat)
    assert bound == pytest.approx(2.5 - 10 * 8 / 1023) and bit.tolist() == [1]
    bound, bit = client_input(cfg, params, Payload(), flat)   # no broadcast C: privacy.clip_norm
    assert bound == pytest.approx(1.5 - 10 * 8 / 1023) and bit.tolist() == [0]
    with pytest.raises(ValueError, match="quant_bits"):
        client_input(cfg, SecAggParams(n=5, degree=0, threshold=3, clip=4.0, quant_bits=3), Payload(), flat)
    local = _config(tmp_path, "privacy.mode=local", "privacy.clip_norm=1.5", "privacy.noise_multiplier=1.0")
    assert extras(local) == 0 and client_input(local, params, Payload(), flat) == (None, None)


@pytest.mark.parametrize("z,c,adaptive", [(1.1, 0.5, False), (2.5, 3.0, False), (1.1, 0.5, True)])
def test_the_noise_on_the_unmasked_sum_has_std_z_times_c(tmp_path, z, c, adaptive):
    """The server's aggregate of one SecAgg+ partial (the unmasked sum of 4 of 5 sampled clients):
    its tensor minus the partial's is N(0, (z C)^2) noise (adaptive clipping, sigma_b = 1:
    z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 in place of z), the sum of squares over 200,000
    coordinates in the chi-square interval at P = 1e-6; the weight is the fixed denominator m = 5
    and the count passes through."""
    cfg = _config(tmp_path, "privacy.mode=central", f"privacy.clip_norm={c}", f"privacy.noise_multiplier={z}",
                  *(["privacy.clipping=adaptive", "privacy.clipped_count_stddev=1.0"] if adaptive else []))
    s = settings(cfg)
    if adaptive:
        z = (z ** -2 - 2.0 ** -2) ** -0.5
        assert s.z_update == pytest.approx(z, rel=1e-12)
    assert s.secure_sum and s.clients_clip
    agg = PrivateAggregate({}, s, cfg.run.seed)
    agg.releases = True
    rng = np.random.default_rng(2)
    draws = []
    for r in range(1, 5):   # four rounds: four streams of 50,000 draws
        agg.round = r
        summed = torch.from_numpy(rng.normal(0, 1, 50_000))
        partial = Payload(tensors={"w": summed}, scalars={WEIGHT_KEY: 4.0, COUNT_KEY: 4, UNCLIPPED_KEY: 3.0})
        out = agg([(0, partial)])
        assert out.scalars[WEIGHT_KEY] == 5.0 and out.scalars[UNCLIPPED_KEY] == 3.0
        draws.append((out.tensors["w"] - summed).numpy())
    noise = np.concatenate(draws)
    stat = float(np.sum(noise ** 2)) / (z * c) ** 2
    assert stats.chi2.ppf(P / 2, noise.size) < stat < stats.chi2.ppf(1 - P / 2, noise.size)


def test_the_accountant_records_dp_accountings_epsilon(tmp_path):
    cfg = _config(tmp_path, "privacy.mode=central", "privacy.clip_norm=1.0", "privacy.noise_multiplier=1.3",
                  "privacy.delta=1e-5")
    s = settings(cfg)
    agg = PrivateAggregate({}, s, cfg.run.seed)
    agg.releases = True
    server = ServerPrivacy(s, agg)
    assert server.broadcast_scalars() == {"dp_clip_norm": 1.0}   # the clients clip: they are told C
    for r, sampled in enumerate([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 3, 5, 7, 9]], start=1):
        agg.round = r
        agg([(0, Payload(tensors={"w": torch.zeros(3)}, scalars={WEIGHT_KEY: 5.0, COUNT_KEY: 5, UNCLIPPED_KEY: 4.0}))])
        metrics = server.finish_round(r, sampled, sampled)
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.PoissonSampledDpEvent(5 / 20, dp_accounting.GaussianDpEvent(1.3)), r)
        assert metrics["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
        assert metrics["privacy_unclipped"] == 4.0
    assert server.summary()["aggregation"].startswith("secure")


@pytest.mark.parametrize("sets,needle", [
    (["privacy.mode=central", "privacy.clip_norm=5.0", "privacy.noise_multiplier=1.0"], "privacy.clip_norm"),
    (["privacy.mode=client", "privacy.clip_norm=4.5", "privacy.noise_multiplier=1.0"], "secure_aggregation.clip"),
])
def test_a_clip_norm_beyond_the_quantization_range_is_refused(tmp_path, sets, needle):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, *sets)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mode,extra", [("central", ["privacy.clipping=adaptive", "privacy.clipped_count_stddev=1.0"]),
                                        ("central", []), ("client", []), ("local", []), ("dpsgd", [])])
def test_every_privacy_mode_composes_with_secure_aggregation(tmp_path, mode, extra):
    cfg = _config(tmp_path, f"privacy.mode={mode}", "privacy.clip_norm=1.0", "privacy.noise_multiplier=0.5", *extra)
    assert settings(cfg).secure_sum and extras(cfg) == (1 if mode in ("central", "client") else 0)
