"""[privacy] behind edges (common/privacy/edges.py), at the level of the library: each edge's
clipping against numpy, the noise on the round's sum by a chi-square interval whether the server
adds it or the edges add their shares (with and without a failed edge), the adaptive count's noise
over many draws, and epsilon of local DP over kappa2 edge iterations against dp-accounting called
directly."""
from __future__ import annotations

import math
from types import SimpleNamespace

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import stats

from fedhop.common.config import load_config
from fedhop.common.privacy.edges import SHARE_KEY, release
from fedhop.common.privacy.mechanism import UNCLIPPED_KEY, PrivateAggregate, ServerPrivacy, clip_reply, settings
from fedhop.common.wire.message import COUNT_KEY, WEIGHT_KEY, Payload

P = 1e-6   # each statistical test's two-sided false-alarm probability
M = 6      # clients.per_round: the fixed denominator m


def _config(tmp_path, *sets: str):
    path = tmp_path / "c.toml"
    path.write_text('[data]\ndataset = "digits"\n[model]\nkind = "mlp"\nhidden = [8]\n'
                    '[algorithm]\nlocal_steps = 2\nbatch_size = 8\nweighting = "uniform"\n'
                    '[topology]\nkind = "hierarchical"\nedges = 3\n')
    return load_config(path, ["clients.count=24", f"clients.per_round={M}", *sets])


def _chi2_interval(n: int, var: float) -> tuple[float, float]:
    """The (1 - P) interval of the mean of n squared N(0, var) draws: sum x^2 / var ~ chi^2_n."""
    return var * stats.chi2.ppf(P / 2, n) / n, var * stats.chi2.ppf(1 - P / 2, n) / n


def _replies(rng, count: int, size: int, scale: float) -> list[tuple[int, Payload]]:
    return [(i, Payload(tensors={"w": torch.from_numpy(rng.normal(0, scale, size))}, scalars={WEIGHT_KEY: 1.0}))
            for i in range(count)]


def _numpy_clipped_sum(replies, clip: float) -> np.ndarray:
    """sum_i x_i min(1, C / ||x_i||), in numpy (McMahan et al. 2018, flat clipping)."""
    out = 0.0
    for _, p in replies:
        x = p.tensors["w"].numpy()
        out = out + x * min(1.0, clip / np.linalg.norm(x))
    return out


def _edge(s, seed: int) -> SimpleNamespace:
    """An edge's algorithm as the edge holds it: its private aggregate, which does not release."""
    return SimpleNamespace(aggregate=PrivateAggregate({}, s, seed))


def _round(s, seed, clusters, round: int, failed: tuple[int, ...] = ()
           ) -> tuple[Payload, list[Payload], PrivateAggregate]:
    """One round behind edges: each edge's clipped sum (and its noise share) as it leaves the edge,
    then the server's release over the partials of the edges that did not fail."""
    partials = []
    for e, replies in enumerate(clusters):
        edge = _edge(s, seed)
        partial = release(edge, edge.aggregate(replies), len(replies), e, round)
        if e not in failed:
            partials.append(partial)
    server = PrivateAggregate({}, s, seed)
    server.releases, server.round = True, round
    return server(list(enumerate(partials))), partials, server


def test_an_edge_clips_each_update_of_its_cluster_to_c(tmp_path):
    """Central mode: the edge's partial is sum_i clip(Delta_i) as numpy computes it, every clipped
    update within C, and the count of those already within C (the norms straddle C)."""
    cfg = _config(tmp_path, "privacy.mode=central", "privacy.clip_norm=3.0", "privacy.noise_multiplier=1.0")
    rng = np.random.default_rng(5)
    replies = [(i, Payload(tensors={"w": torch.from_numpy(rng.normal(0, s, 50))}, scalars={WEIGHT_KEY: 1.0}))
               for i, s in enumerate([0.1, 0.2, 0.9, 2.0, 0.05])]
    edge = _edge(settings(cfg), cfg.run.seed)
    partial = edge.aggregate(replies)
    np.testing.assert_allclose(partial.tensors["w"].numpy(), _numpy_clipped_sum(replies, 3.0), rtol=1e-12)
    norms = [np.linalg.norm(p.tensors["w"].numpy()) for _, p in replies]
    assert partial.scalars[UNCLIPPED_KEY] == sum(n <= 3.0 for n in norms) and 0 < sum(n <= 3.0 for n in norms) < 5
    assert partial.scalars[COUNT_KEY] == 5 and partial.scalars[WEIGHT_KEY] == 5.0
    # the norm of what each client adds never exceeds C
    for _, p in replies:
        clipped = edge.aggregate([(0, p)]).tensors["w"].numpy()
        assert np.linalg.norm(clipped) <= 3.0 * (1 + 1e-12)


@pytest.mark.parametrize("noise_at", ["server", "edges"])
@pytest.mark.parametrize("failed", [(), (1,)])
def test_the_rounds_sum_carries_noise_of_sd_z_c_wherever_it_is_added(tmp_path, noise_at, failed):
    """The released sum minus the clipped updates' sum (in numpy) has per-coordinate variance
    (z C)^2 inside its chi-square interval, whichever party adds it and with an edge failed (the
    server tops the missing share up); with noise_at = "edges" what the server receives from the
    edges carries (z C)^2 sum_e n_e / m and no partial is un-noised."""
    z, clip, size = 1.3, 0.8, 60_000
    cfg = _config(tmp_path, "privacy.mode=central", f"privacy.clip_norm={clip}", f"privacy.noise_multiplier={z}",
                  f"privacy.noise_at={noise_at}")
    s = settings(cfg)
    rng = np.random.default_rng(2)
    clusters = [_replies(rng, n, size, 0.01 if e else 1.0) for e, n in enumerate((3, 2, 1))]   # n_e sum to m
    out, partials, _ = _round(s, cfg.run.seed, clusters, 4, failed)
    kept = [c for e, c in enumerate(clusters) if e not in failed]
    clipped = sum(_numpy_clipped_sum(c, clip) for c in kept)
    assert out.scalars[WEIGHT_KEY] == M
    noise = out.tensors["w"].numpy() - clipped
    lo, hi = _chi2_interval(size, (z * clip) ** 2)
    assert lo <= float(np.mean(noise ** 2)) <= hi
    received = sum(p.tensors["w"].numpy() for p in partials) - clipped   # what the server saw before its own noise
    share = sum(len(c) for c in kept) / M if noise_at == "edges" else 0.0
    if share:
        lo, hi = _chi2_interval(size, (z * clip) ** 2 * share)
        assert lo <= float(np.mean(received ** 2)) <= hi
        assert sum(p.scalars[SHARE_KEY] for p in partials) == pytest.approx(share)
    else:
        assert np.abs(received).max() < 1e-9   # the server noises a sum it saw un-noised


def test_the_adaptive_count_carries_noise_of_sd_sigma_b_from_the_edges_shares(tmp_path):
    """Adaptive clipping with noise_at = "edges" and edge 1 failed: over 3000 rounds the count the
    edges send minus the true count of unclipped updates has variance sigma_b^2 sum_e n_e / m (the
    shares of the edges that answered), and the noisy count the server releases, after its top-up,
    sigma_b^2 (chi-square intervals); the server records no un-noised count."""
    sigma_b = 0.9
    cfg = _config(tmp_path, "privacy.mode=central", "privacy.clip_norm=1.0", "privacy.noise_multiplier=1.0",
                  "privacy.clipping=adaptive", f"privacy.clipped_count_stddev={sigma_b}", "privacy.noise_at=edges")
    s = settings(cfg)
    rng = np.random.default_rng(3)
    clusters = [_replies(rng, n, 4, 0.4) for n in (2, 1, 3)]
    true = sum(np.linalg.norm(p.tensors["w"].numpy()) <= 1.0 for e in (0, 2) for _, p in clusters[e])
    sent, released = [], []
    for r in range(1, 3001):
        _, partials, server = _round(s, cfg.run.seed, clusters, r, failed=(1,))
        sent.append(sum(float(p.scalars[UNCLIPPED_KEY]) for p in partials) - true)
        assert server.last is not None and server.last.unclipped is None and server.last.noisy_unclipped is not None
        released.append(server.last.noisy_unclipped - true)
    lo, hi = _chi2_interval(len(sent), sigma_b ** 2 * 5 / M)
    assert lo <= float(np.mean(np.square(sent))) <= hi
    lo, hi = _chi2_interval(len(released), sigma_b ** 2)
    assert lo <= float(np.mean(np.square(released))) <= hi


def test_local_dp_behind_edges_noises_each_iteration_apart_and_is_accounted_per_release(tmp_path):
    """Local DP with kappa2 = 3: each edge iteration's reply of a client gets its own noise (a
    stream per step), and epsilon after k participations is dp-accounting's k * kappa2 Gaussian
    releases composed."""
    z = 1.7
    cfg = _config(tmp_path, "privacy.mode=local", "privacy.clip_norm=1.0", f"privacy.noise_multiplier={z}",
                  "topology.kappa2=3", "privacy.delta=1e-6")
    s = settings(cfg)
    assert s.releases == 3
    reply = Payload(tensors={"w": torch.zeros(1000)}, scalars={WEIGHT_KEY: 1.0})
    draws = [clip_reply(s, reply, Payload(), {}, cfg.run.seed, 4, 2, step).tensors["w"].numpy() for step in range(3)]
    assert not np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[1], draws[2])
    for d in draws:
        lo, hi = _chi2_interval(d.size, z ** 2)
        assert lo <= float(np.mean(d ** 2)) <= hi
    server = ServerPrivacy(s, PrivateAggregate({}, s, cfg.run.seed))
    for r in range(1, 5):
        metrics = server.finish_round(r, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.GaussianDpEvent(z), r * 3)
        assert metrics["epsilon"] == pytest.approx(direct.get_epsilon(1e-6), rel=1e-9)


def test_central_dp_behind_edges_is_accounted_as_on_the_star(tmp_path):
    """Central mode behind edges: one Poisson-sampled Gaussian release a round at q = sampled / clients."""
    cfg = _config(tmp_path, "privacy.mode=client", "privacy.clip_norm=1.0", "privacy.noise_multiplier=0.9",
                  "privacy.noise_at=edges")
    s = settings(cfg)
    server = ServerPrivacy(s, PrivateAggregate({}, s, cfg.run.seed))
    for r, sampled in enumerate((6, 5, 6), start=1):
        metrics = server.finish_round(r, list(range(sampled)), list(range(sampled)))
    direct = dp_accounting.rdp.RdpAccountant()
    for sampled in (6, 5, 6):
        direct.compose(dp_accounting.PoissonSampledDpEvent(sampled / 24, dp_accounting.GaussianDpEvent(0.9)))
    assert metrics["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert server.summary()["noise_at"] == "edges" and math.isclose(metrics["privacy_sampling_rate"], 6 / 24)


def test_dpsgd_behind_edges_charges_each_client_kappa2_times_its_local_steps(tmp_path):
    """Sample-level DP-SGD with kappa2 = 2: a client that took part in k rounds ran 2 k times its
    local steps, each a Poisson-sampled Gaussian release at rate B / n (dp-accounting directly)."""
    z = 1.1
    cfg = _config(tmp_path, "privacy.mode=dpsgd", "privacy.clip_norm=1.0", f"privacy.noise_multiplier={z}",
                  "topology.kappa2=2")
    s = settings(cfg)
    work = {0: (3, 0.1), 1: (5, 0.25)}   # client: (local steps a round, B / n)
    server = ServerPrivacy(s, PrivateAggregate({}, s, cfg.run.seed), lambda c: work[c])
    server.finish_round(1, [0, 1], [0, 1])
    metrics = server.finish_round(2, [1], [1])
    expected = 0.0
    for c, k in ((0, 1), (1, 2)):
        steps, rate = work[c]
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z)), steps * k * 2)
        expected = max(expected, direct.get_epsilon(1e-5))
    assert metrics["epsilon"] == pytest.approx(expected, rel=1e-9)
