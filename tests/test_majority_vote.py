"""signSGD with majority vote (Bernstein et al., ICML 2018, Algorithm 3) as the aggregation rule
`security.aggregation = "majority_vote"` (common/engine/robust.py): the rule against numpy's
sign(sum_i sign(x_i)) on held-out update sets (ties and zero entries included) and a closed form
that a weighted vote would fail; FedAvg runs in memory (star with partial participation, and
hierarchical, where each edge votes over its clients and the server over the edges' votes) whose
final model equals a numpy replay of the same participants, with every upload's bytes equal to
sign's formula ceil(d / 8); the combinations the rule refuses, one config line each.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import COUNT_KEY, WEIGHT_KEY, Payload, weighted_mean
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.engine.robust import robust_reduce
from fedhop.common.records.runstore import RunStore
from fedhop.common.topologies.graphs import cluster_assignment
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

# ----------------------------------------------------------------------------- the rule itself


def _payloads(values: np.ndarray, weights: np.ndarray) -> list[Payload]:
    return [Payload(tensors={"w": torch.tensor(values[i], dtype=torch.float32)},
                    scalars={WEIGHT_KEY: float(weights[i]), "train_loss": float(i)}) for i in range(len(values))]


@pytest.mark.parametrize("n, seed", [(1, 0), (2, 1), (4, 2), (5, 3), (8, 4)])
def test_vote_equals_numpy_sign_of_summed_signs(n, seed):
    """Held-out updates drawn from {-2.5, -1, 0, 0.5, 3}: zero entries (no vote) and, for even n,
    ties (the votes sum to 0: the result is 0); numpy's np.sign(np.sign(x).sum(0)) is the reference."""
    rng = np.random.default_rng(100 + seed)
    values = rng.choice([-2.5, -1.0, 0.0, 0.5, 3.0], size=(n, 7, 9))
    weights = rng.integers(1, 60, size=n).astype(float)
    expected = np.sign(np.sign(values).sum(axis=0))
    out = robust_reduce(_payloads(values, weights), {}, "majority_vote")
    got = weighted_mean(out, "w").numpy()
    np.testing.assert_array_equal(got, expected)
    assert set(np.unique(got)) <= {-1.0, 0.0, 1.0}
    assert out.scalars[WEIGHT_KEY] == pytest.approx(weights.sum()) and out.scalars[COUNT_KEY] == n
    if n % 2 == 0:   # the draw holds ties, so the 0 of a tie is checked, not assumed
        assert (expected == 0).any() and (np.sign(values).sum(axis=0) == 0).any()


def test_one_vote_per_update_whatever_its_weight_or_size():
    """Closed form: update 0 is +1000 with weight 100, updates 1 and 2 are -1 with weight 1.  The
    vote is sign(+1 - 1 - 1) = -1 in every coordinate; a sample-weighted vote would give
    sign(100 - 2) = +1, and the weighted mean (100000 - 2) / 102 > 0."""
    values = np.array([[1000.0, 1000.0], [-1.0, -1.0], [-1.0, -1.0]])
    weights = np.array([100.0, 1.0, 1.0])
    got = weighted_mean(robust_reduce(_payloads(values, weights), {}, "majority_vote"), "w").numpy()
    np.testing.assert_array_equal(got, [-1.0, -1.0])
    assert float(weighted_mean(robust_reduce(_payloads(values, weights), {}, "mean"), "w")[0]) > 0


def test_partials_vote_with_their_signs_and_other_fields_keep_their_reduction():
    """A hierarchical server's votes: each edge partial (weighted sum, with num_results) enters by
    its sign, one vote per edge; a `max` field is reduced as before."""
    votes = np.array([[1.0, -1.0, 0.0], [1.0, 1.0, -1.0], [-1.0, 1.0, 0.0]])   # the edges' votes
    weights = [40.0, 3.0, 7.0]
    partials = [Payload(tensors={"w": torch.tensor(v * w), "m": torch.tensor(float(i))},
                        scalars={WEIGHT_KEY: w, COUNT_KEY: 2}) for i, (v, w) in enumerate(zip(votes, weights))]
    out = robust_reduce(partials, {"m": "max"}, "majority_vote")
    np.testing.assert_array_equal(weighted_mean(out, "w").numpy(), [1.0, 1.0, -1.0])
    assert float(out.tensors["m"]) == 2.0 and out.scalars[COUNT_KEY] == 6


def test_config_installs_the_vote_at_server_and_edges():
    algo = build_algorithm(parse_config('[security]\naggregation = "majority_vote"\n'))
    assert not algo.streams()   # the vote needs every reply at once
    values = np.array([[3.0, -2.0, 0.0, 1.0], [-1.0, -4.0, 0.0, 2.0]])
    out = algo.aggregate(list(enumerate(_payloads(values, np.array([9.0, 1.0])))))
    np.testing.assert_array_equal(weighted_mean(out, "w").numpy(), [0.0, -1.0, 0.0, 1.0])


@pytest.mark.parametrize("text, line", [
    ('[topology]\nkind = "chain"\n',
     "config key 'security.aggregation': 'majority_vote' works in topology.kind = 'star' or 'hierarchical', "
     "got 'chain'"),
    ('[transport]\nkind = "torch"\n',
     "config key 'security.aggregation': 'majority_vote' needs every update apart, but transport.kind = 'torch' "
     "sums them in a collective; use transport.kind = 'grpc'"),
    ('[algorithm]\nname = "fedlga"\n',
     "config key 'security.aggregation': 'majority_vote' replaces the weighted mean, but algorithm 'fedlga' "
     "reduces its replies its own way; use 'mean'"),
    ('[security]\nkrum_m = 2\n',
     "config key 'security.krum_m': got 2, but only security.aggregation = 'multi_krum' averages m updates "
     "(aggregation is 'majority_vote')"),
])
def test_config_refuses_what_the_robust_rules_refuse(text, line):
    base = '[security]\naggregation = "majority_vote"\n'
    cfg_text = base + text.replace("[security]\n", "") if text.startswith("[security]") else base + text
    with pytest.raises(ConfigError) as exc:
        parse_config(cfg_text)
    assert str(exc.value) == line


# ----------------------------------------------------------------------------- runs
D = 203                                   # not a multiple of 8: the last byte of the bits is partial
RNG = np.random.default_rng(47)
CENTERS = RNG.normal(0, 2, size=(6, D))
CURV = RNG.uniform(0.5, 2.0, size=(6, D))
SIZES = [10, 30, 20, 5, 40, 15]
ROUNDS, STEPS, LR, ETA = 4, 3, 0.2, 0.05


def _config(topology: str, per_round: int, up: str, edge: str = "same") -> str:
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, local_steps=STEPS, lr=LR, server_lr=ETA,
                            processes=2, per_round=per_round, topology=topology)
    compression = f'\n[compression]\nup = "{up}"\n' + (f'edge = "{edge}"\n' if up != "none" else "")
    return text + compression + '\n[security]\naggregation = "majority_vote"\n'


def _client_signs(w: np.ndarray, i: int, up: str) -> np.ndarray:
    """Client i's FedAvg update from w (tests/helpers.py numpy_fedavg_round's local steps) as the
    server reads it: sign's decode (+1 where the update is >= 0, Bernstein et al.'s C(v) with
    sign(0) = +1) when the uploads are coded by "sign", else the update itself."""
    wi = w.astype(np.float64)
    for _ in range(STEPS):
        wi = wi - LR * CURV[i] * (wi - CENTERS[i])
    delta = wi - w
    return np.where(delta < 0, -1.0, 1.0) if up == "sign" else delta


def _vote(updates: list[np.ndarray], weights: list[float] | None = None) -> np.ndarray:
    """sign(sum_i sign(x_i)); with `weights` the sample-weighted vote the rule must NOT be."""
    ws = weights or [1.0] * len(updates)
    return np.sign(sum(w * np.sign(u) for w, u in zip(ws, updates)))


def _replay(history, up: str, clusters: list[list[int]] | None = None, edge: str = "same",
            weighted: bool = False) -> tuple[np.ndarray, int]:
    """numpy's run of the same participants: the server's float32 model, and how many ties (a vote
    summing to 0) the run's groups had.  Star: one vote over the round's participants.
    Hierarchical: each edge with participants votes over them; its vote travels coded by sign
    (a tie's 0 as +1) when edge = "same" and up = "sign", else as it is; the server votes over
    the edges' votes.  Then w <- w + eta * vote (FedAvg, server_lr eta)."""
    w = np.zeros(D, dtype=np.float32)
    ties = 0
    for result in history:
        signs = {i: _client_signs(w, i, up) for i in result.participants}
        weight = {i: float(SIZES[i]) for i in result.participants}
        if clusters is None:
            groups = [list(result.participants)]
        else:
            groups = [[i for i in cl if i in signs] for cl in clusters]
            groups = [g for g in groups if g]
        votes, vote_weights = [], []
        for g in groups:
            total = np.sign([signs[i] for i in g]).sum(axis=0)
            ties += int((total == 0).sum())
            votes.append(_vote([signs[i] for i in g], [weight[i] for i in g] if weighted else None))
            vote_weights.append(sum(weight[i] for i in g))
        if clusters is None:
            step = votes[0]
        else:
            if up == "sign" and edge == "same":
                votes = [np.where(v < 0, -1.0, 1.0) for v in votes]
            ties += int((np.sign(votes).sum(axis=0) == 0).sum())
            step = _vote(votes, vote_weights if weighted else None)
        w = (w + np.float32(ETA) * step.astype(np.float32)).astype(np.float32)
    return w.astype(np.float64), ties


def _upload_bytes(run_dir: Path) -> dict[str, set[int]]:
    store = RunStore(run_dir / "run.db")
    try:
        assert store.check_agreement().ok
        by_link: dict[str, set[int]] = {}
        for r in store.messages():
            if r["role"] == "sender" and r["direction"] == "up" and r["method"] in ("train.reply", "edge_round.reply"):
                by_link.setdefault(r["link"], set()).add(r["tensor_bytes"])
        return by_link
    finally:
        store.close()


def _check(coord, expected: np.ndarray, alternative: np.ndarray) -> None:
    assert len(coord.history) == ROUNDS
    got = coord.state.params["w"].double().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    # the model is a sum of +-eta steps, and a weighted vote would have ended elsewhere
    assert np.abs(got).max() > 0 and not np.allclose(got, alternative, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("up", ["sign", "none"])
def test_star_with_partial_participation_equals_numpy_vote(tmp_path, up):
    """4 of 6 clients a round: an even group, so some coordinates tie and stay where they are."""
    summary, coord = run_inmemory(parse_config(_config('kind = "star"', 4, up)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    assert all(len(r.participants) == 4 for r in coord.history)
    assert len({tuple(r.participants) for r in coord.history}) > 1   # the draw changes
    expected, ties = _replay(coord.history, up)
    assert ties > 0
    _check(coord, expected, _replay(coord.history, up, weighted=True)[0])
    ups = _upload_bytes(tmp_path)
    assert set(ups) == {"client-server"}
    assert ups["client-server"] == ({math.ceil(D / 8)} if up == "sign" else {4 * D})   # sign: one bit each


@pytest.mark.parametrize("edge", ["same", "none"])
def test_hierarchical_votes_per_edge_then_over_the_edges(tmp_path, edge):
    """2 edges of 3 clients, 4 of 6 clients sampled a round: each edge votes over its sampled
    clients (2 of them tie where they disagree), the server votes over the edges' votes.  With
    edge = "same" an edge's vote travels as sign's bits (a tie's 0 as +1), with "none" as float32."""
    cfg = parse_config(_config('kind = "hierarchical"\nedges = 2', 4, "sign", edge))
    summary, coord = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed", summary["error"]
    clusters = cluster_assignment(cfg)
    assert clusters == [[0, 1, 2], [3, 4, 5]]
    expected, ties = _replay(coord.history, "sign", clusters, edge)
    assert ties > 0
    _check(coord, expected, _replay(coord.history, "sign", clusters, edge, weighted=True)[0])
    if edge == "same":   # the tie rule on the edge-server link matters: 0 there would end elsewhere
        assert not np.allclose(expected, _replay(coord.history, "sign", clusters, "none")[0], rtol=1e-5, atol=1e-7)
    ups = _upload_bytes(tmp_path)
    assert ups["client-edge"] == {math.ceil(D / 8)}
    assert ups["edge-server"] == ({math.ceil(D / 8)} if edge == "same" else {4 * D})
