"""Krum and multi-Krum as Blanchard, El Mhamdi, Guerraoui and Stainer define them ("Machine
Learning with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017, section 4; issue
44, item 4; red team partial 6.4: Krum in a star run dropped the test accuracy from 0.842 to
0.596 with one attacker).

Checked against an independent numpy implementation written from the paper: n updates, f
Byzantine; each update's score is the sum of its squared distances to its n - f - 2 closest
other updates; Krum returns the lowest-scoring update, multi-Krum the mean of the m lowest (m =
n - f unless `security.krum_m` says fewer); equal scores are taken in the replies' order.  Every
size n from 3 to 30 with several f each (the sizes are not those the implementation was tried
on), updates with a large common part (a full model rather than a delta: the distances are
then tiny beside the vectors' norms), groups too small for the rule (n <= 2f + 2: the
coordinate-wise median, recorded), configs that can be judged up front (one line, exit 2), and
the attack from real processes: one client sends its update sign-flipped and boosted 20x in a
star run with label-skewed (Dirichlet) data; multi-Krum ends close to the clean run's accuracy."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.engine.robust import RobustAggregate, robust_reduce
from fedhop.common.wire.message import weighted_mean


# ------------------------------------------------------------------ the paper, in numpy
def paper_scores(x: np.ndarray, f: int) -> np.ndarray:
    n = x.shape[0]
    assert n > 2 * f + 2
    d2 = np.array([[float(np.sum((x[i] - x[j]) ** 2)) for j in range(n)] for i in range(n)])
    return np.array([np.sort(np.delete(d2[i], i))[:n - f - 2].sum() for i in range(n)])


def paper_krum(x: np.ndarray, f: int) -> np.ndarray:
    scores = paper_scores(x, f)
    return x[int(np.lexsort((np.arange(len(scores)), scores))[0])]


def paper_multi_krum(x: np.ndarray, f: int, m: int) -> np.ndarray:
    scores = paper_scores(x, f)
    order = np.lexsort((np.arange(len(scores)), scores))
    return x[order[:m]].mean(axis=0)


def _payloads(x: np.ndarray, rng: np.random.Generator) -> list[Payload]:
    """Client replies with random sample counts: the rule must ignore them (unweighted)."""
    return [Payload(tensors={"w": torch.tensor(row, dtype=torch.float64)},
                    scalars={"weight": float(rng.integers(1, 50))}) for row in x]


def _sizes() -> list[tuple[int, int]]:
    out = []
    for n in range(3, 31):
        top = (n - 3) // 2                      # the largest f with n > 2f + 2
        out += [(n, f) for f in sorted({0, 1, top // 2, top}) if 0 <= f <= top]
    return out


@pytest.mark.parametrize("n, f", _sizes())
def test_krum_and_multi_krum_are_the_papers_rule_at_every_size(n, f):
    rng = np.random.default_rng(1000 * n + f)
    # a large common part (1e6) and small differences: the squared distances are summed
    # differences, not |a|^2 + |b|^2 - 2ab, which loses them
    x = 1e6 + rng.normal(size=(n, 9)) * 1e-3
    if n > 4:
        x[n - 1] = x[n - 2]                        # a tie: equal scores, taken in order
    bad = rng.choice(n - 2, size=f, replace=False)
    x[bad] += rng.normal(size=(f, 9)) * 10.0      # f Byzantine updates, far off
    payloads = _payloads(x, rng)
    got = weighted_mean(robust_reduce(payloads, {}, "krum", krum_f=f), "w").numpy()
    np.testing.assert_allclose(got, paper_krum(x, f), rtol=0, atol=1e-6)
    for m in sorted({0, 1, max(1, (n - f) // 2), n - f}):
        want = paper_multi_krum(x, f, m if m > 0 else n - f)
        got = weighted_mean(robust_reduce(payloads, {}, "multi_krum", krum_f=f, krum_m=m), "w").numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # m = n - f never reaches a Byzantine update here: they are far from every honest one
    chosen = weighted_mean(robust_reduce(payloads, {}, "multi_krum", krum_f=f), "w").numpy()
    np.testing.assert_allclose(chosen, np.delete(x, bad, axis=0).mean(axis=0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("n, f", [(4, 1), (6, 2), (2, 0), (8, 3)])
def test_a_group_of_at_most_2f_plus_2_falls_back_to_the_median_and_records_it(n, f):
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 5))
    aggregate = RobustAggregate({}, "multi_krum", 0.1, f)
    got = weighted_mean(aggregate([(i, p) for i, p in enumerate(_payloads(x, rng))]), "w").numpy()
    np.testing.assert_allclose(got, np.median(x, axis=0), rtol=0, atol=1e-9)
    [(node, detail)] = aggregate.drain()
    assert f"multi_krum needs {2 * f + 3} updates" in detail and f"had {n}" in detail, detail


QUAD = """
[run]
name = "k"
rounds = 1
[data]
dataset = "digits"
[model]
kind = "mlp"
[clients]
count = 10
per_round = {per}
[security]
aggregation = "{rule}"
krum_f = {f}
krum_m = {m}
"""


@pytest.mark.parametrize("rule, per, f, m, why", [
    ("multi_krum", 10, 1, 10, "multi-Krum averages at most n - f = 9 updates"),
    ("multi_krum", 10, 3, 0, "needs n > 2f + 2 = 8 updates per group, but a round samples"),
    ("krum", 10, 1, 3, "only security.aggregation = 'multi_krum' averages m updates"),
])
def test_a_config_that_cannot_hold_is_refused_up_front(rule, per, f, m, why):
    text = QUAD.format(rule=rule, per=per if f < 3 else 8, f=f, m=m)
    with pytest.raises(ConfigError, match="security"):
        parse_config(text)
    try:
        parse_config(text)
    except ConfigError as exc:
        assert why in str(exc) and "\n" not in str(exc), str(exc)


def test_multi_krum_config_is_refused_by_the_command_with_one_line(tmp_path):
    (tmp_path / "exp.toml").write_text(QUAD.format(rule="multi_krum", per=6, f=1, m=6))
    res = subprocess.run([sys.executable, "-m", "fedhop.server", "--config", "exp.toml", "--run-dir", "run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "security.krum_m" in lines[0] and "n - f = 5" in lines[0], res.stderr


def test_multi_krum_keeps_a_skewed_star_run_close_to_the_clean_one_under_attack(tmp_path):
    """Real processes (tests/poisoning.py): server, client process of clients 0-8, poisoner of
    client 9 (its FedAvg update x -20).  Dirichlet label skew (the default partition), where one
    client's update alone (Krum) is a poor step: multi-Krum averages the n - f = 9 lowest-scoring
    updates and ends within a few points of the clean mean run."""
    from tests.poisoning import poisoned_run
    from tests.test_poisoning import CFG, SCALE
    cfg = tmp_path / "exp.toml"
    cfg.write_text(CFG.replace('partition = "iid"\n', ""))
    clean = poisoned_run(cfg, tmp_path / "clean", "0-9", None, 1.0)
    attacked = poisoned_run(cfg, tmp_path / "multi", "0-8", "9", SCALE, ["security.aggregation=multi_krum"])
    mean = poisoned_run(cfg, tmp_path / "mean", "0-8", "9", SCALE, ["security.aggregation=mean"])
    assert clean["status"] == "completed" and attacked["status"] == "completed", attacked.get("error")
    clean_acc, acc = clean["final"]["test_accuracy"], attacked["final"]["test_accuracy"]
    assert clean_acc > 0.8
    assert mean["status"] != "completed" or mean["final"]["test_accuracy"] < 0.5   # the attack does bite
    assert acc >= clean_acc - 0.06, (acc, clean_acc)
