"""Robust aggregation rules (common/engine/robust.py) against independent numpy computations, and the
config keys that select them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import COUNT_KEY, WEIGHT_KEY, Payload, weighted_mean
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.engine.robust import robust_reduce


def _replies(n: int, seed: int = 0, shape=(3, 4)) -> tuple[list[Payload], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(n, *shape))
    weights = rng.integers(1, 50, size=n).astype(float)
    payloads = [Payload(tensors={"w": torch.tensor(values[i], dtype=torch.float64)},
                        scalars={WEIGHT_KEY: float(weights[i]), "train_loss": float(i)}) for i in range(n)]
    return payloads, values, weights


@pytest.mark.parametrize("n", [5, 6])
def test_median_matches_numpy(n):
    payloads, values, weights = _replies(n)
    out = robust_reduce(payloads, {}, "median")
    np.testing.assert_allclose(weighted_mean(out, "w").numpy(), np.median(values, axis=0), rtol=1e-12)
    assert out.scalars[WEIGHT_KEY] == pytest.approx(weights.sum())
    assert out.scalars[COUNT_KEY] == n


@pytest.mark.parametrize("n,trim", [(10, 0.2), (7, 0.1), (9, 0.34), (3, 0.1)])
def test_trimmed_mean_matches_numpy(n, trim):
    """k = floor(trim * n) values dropped at each end, at least one (7 at 0.1: one, not none)."""
    payloads, values, _ = _replies(n, seed=n)
    k = max(1, int(np.floor(trim * n)))
    expected = np.sort(values, axis=0)[k:n - k].mean(axis=0)
    out = robust_reduce(payloads, {}, "trimmed_mean", trim=trim)
    np.testing.assert_allclose(weighted_mean(out, "w").numpy(), expected, rtol=1e-12)


def _krum_numpy(values: np.ndarray, f: int) -> int:
    flat = values.reshape(len(values), -1)
    n = len(flat)
    scores = []
    for i in range(n):
        d = sorted(float(((flat[i] - flat[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(d[:n - f - 2]))
    return int(np.argmin(scores))


@pytest.mark.parametrize("f", [1, 2])
def test_krum_picks_the_numpy_choice_and_never_the_outlier(f):
    payloads, values, _ = _replies(9, seed=3)
    payloads[4].tensors["w"] = payloads[4].tensors["w"] + 1e6   # the attacker
    values[4] += 1e6
    chosen = _krum_numpy(values, f)
    assert chosen != 4
    out = robust_reduce(payloads, {}, "krum", krum_f=f)
    np.testing.assert_allclose(weighted_mean(out, "w").numpy(), values[chosen], rtol=1e-12)


def test_one_huge_update_ruins_the_mean_but_not_the_robust_rules():
    payloads, values, _ = _replies(7, seed=5)
    payloads[0].tensors["w"] = torch.full((3, 4), 1e9, dtype=torch.float64)
    honest = values[1:]
    mean = weighted_mean(robust_reduce(payloads, {}, "mean"), "w")
    assert float(mean.abs().max()) > 1e7
    for rule in ("median", "trimmed_mean", "krum"):
        got = weighted_mean(robust_reduce(payloads, {}, rule, trim=0.15), "w").numpy()
        assert np.all(got <= honest.max(axis=0) + 1e-9) and np.all(got >= honest.min(axis=0) - 1e-9), rule


def test_partials_enter_as_their_means():
    """Hierarchical: an edge's partial (weighted sum, carrying num_results) counts as its mean."""
    means = np.array([[1.0, 2.0], [3.0, -1.0], [100.0, 100.0]])
    weights = [4.0, 6.0, 1.0]
    partials = [Payload(tensors={"w": torch.tensor(m * w)}, scalars={WEIGHT_KEY: w, COUNT_KEY: 2})
                for m, w in zip(means, weights)]
    out = robust_reduce(partials, {}, "median")
    np.testing.assert_allclose(weighted_mean(out, "w").numpy(), np.median(means, axis=0))
    assert out.scalars[COUNT_KEY] == 6


def test_non_wsum_fields_keep_their_reduction():
    payloads, _, _ = _replies(5)
    for i, p in enumerate(payloads):
        p.tensors["m"] = torch.tensor(float(i))
    out = robust_reduce(payloads, {"m": "max"}, "median")
    assert float(out.tensors["m"]) == 4.0


def test_config_selects_the_rule_for_server_and_edges():
    cfg = parse_config('[security]\naggregation = "trimmed_mean"\ntrim = 0.2\n')
    algo = build_algorithm(cfg)
    payloads, values, _ = _replies(10, seed=9)
    out = algo.aggregate(list(enumerate(payloads)))
    expected = np.sort(values, axis=0)[2:8].mean(axis=0)
    np.testing.assert_allclose(weighted_mean(out, "w").numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("text,needle", [
    ('[security]\naggregation = "median"\n[topology]\nkind = "chain"\n', "star"),
    ('[security]\naggregation = "krum"\n[transport]\nkind = "torch"\n', "collective"),
    ('[security]\naggregation = "median"\n[algorithm]\nname = "fedlga"\n', "its own way"),
    ('[security]\naggregation = "avg"\n', "security.aggregation"),
    ('[security]\ntrim = 0.5\n', "security.trim"),
])
def test_config_refuses_rules_where_they_cannot_apply(text, needle):
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    assert needle in str(exc.value)
