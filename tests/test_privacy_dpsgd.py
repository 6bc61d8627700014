"""[privacy] mode = "dpsgd": sample-level DP-SGD inside the clients (common/privacy/dpsgd.py).  The
clipped per-example sum against per-example gradients taken one example at a time with autograd,
the noise's standard deviation z * C by a chi-square interval, and the recorded epsilon against
dp-accounting called directly per client."""
from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import stats

from fedhop.common.config import load_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.numerics.sampling import steps_per_epoch
from fedhop.common.privacy.dpsgd import SampleDP
from fedhop.common.privacy.noise import GaussianSource
from fedhop.common.tasks import build_task

P = 1e-6


def _setup(tmp_path, *sets: str):
    path = tmp_path / "c.toml"
    path.write_text('[data]\ndataset = "digits"\n[model]\nkind = "mlp"\nhidden = [8]\n'
                    '[algorithm]\nlocal_steps = 2\nbatch_size = 8\n[clients]\ncount = 6\nper_round = 3\n')
    cfg = load_config(path, ["privacy.mode=dpsgd", "privacy.clip_norm=1.0", *sets])
    task = build_task(cfg)
    model = task.build_model()
    data = task.client_data(0)
    batch = tuple(t[:8] for t in data.tensors)
    return cfg, task, model, batch


def _one_at_a_time(model, task, batch, clip):
    """sum_j g_j min(1, C / ||g_j||) with each g_j from its own backward pass."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in params}
    for j in range(batch[0].shape[0]):
        model.zero_grad()
        task.loss(model, tuple(t[j:j + 1] for t in batch)).backward()
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for _, p in params)))
        for n, p in params:
            total[n] += p.grad * min(1.0, clip / norm)
    model.zero_grad()
    return total


@pytest.mark.parametrize("clip", [1e9, 0.05])
def test_the_clipped_per_example_sum_matches_autograd_one_example_at_a_time(tmp_path, clip):
    cfg, task, model, batch = _setup(tmp_path)
    expected = _one_at_a_time(model, task, batch, clip)
    SampleDP(clip, 0.0, GaussianSource(False, 0, "t")).gradients(model, task, batch)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n] / 8, rtol=1e-4, atol=1e-7)
    if clip > 1e6:   # nothing clipped: the plain batch-mean gradient
        plain = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        task.loss(model, batch).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(plain[n], p.grad, rtol=1e-4, atol=1e-7)


def test_the_step_noise_has_std_z_times_c_over_b(tmp_path):
    cfg, task, model, batch = _setup(tmp_path)
    z, clip = 1.7, 0.3
    expected = _one_at_a_time(model, task, batch, clip)
    source = GaussianSource(False, 4, "noise")
    draws = []
    for _ in range(40):
        SampleDP(clip, z, source).gradients(model, task, batch)
        draws += [((p.grad - expected[n] / 8) * 8).double().reshape(-1) for n, p in model.named_parameters()]
    noise = torch.cat(draws).numpy()
    n = noise.size
    lo, hi = stats.chi2.ppf(P / 2, n) / n, stats.chi2.ppf(1 - P / 2, n) / n
    assert lo * (z * clip) ** 2 <= float(np.mean(noise ** 2)) <= hi * (z * clip) ** 2


def test_the_recorded_epsilon_is_the_largest_clients_from_dp_accounting(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\ndataset = "digits"\n[model]\nkind = "mlp"\nhidden = [8]\n'
                    '[algorithm]\nlocal_epochs = 1\nbatch_size = 16\n[clients]\ncount = 6\nper_round = 3\n'
                    '[run]\nrounds = 3\n')
    cfg = load_config(path, ["privacy.mode=dpsgd", "privacy.clip_norm=1.0", "privacy.noise_multiplier=1.3"])
    engine = RoundEngine(cfg)
    taken: dict[int, int] = {}
    for r in range(1, 4):
        sampled, _ = engine.train_round(r)
        for c in sampled:
            taken[c] = taken.get(c, 0) + 1
        best = 0.0
        for c, k in taken.items():
            n = engine.task.num_samples(c)
            acc = dp_accounting.rdp.RdpAccountant()
            acc.compose(dp_accounting.PoissonSampledDpEvent(16 / n, dp_accounting.GaussianDpEvent(1.3)),
                        k * steps_per_epoch(n, 16))
            best = max(best, acc.get_epsilon(1e-5))
        assert engine.last_privacy["epsilon"] == pytest.approx(best, rel=1e-9)
