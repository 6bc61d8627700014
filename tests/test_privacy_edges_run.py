"""[privacy] behind edges over real processes (`fedhop run` from a folder outside the checkout:
server, edge and client processes on gRPC): with no noise and a bound no update reaches the
final model equals a plain hierarchical run's bit for bit; a noisy run with adaptive clipping
and the noise added by the edges records each round's epsilon as dp-accounting computes it and C
as the paper's update computes it in numpy; local DP over kappa2 edge iterations is accounted
per release; bad combinations are one line and exit 2."""
from __future__ import annotations

import json
import subprocess

import dp_accounting
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import db_rows
from tests.test_privacy_run import _run as star_run

EDGES = '[topology]\nkind = "hierarchical"\nedges = 2\n'   # beside tests/test_privacy_run.py's config


def _run(cwd, name: str, privacy: str, *extra: str) -> subprocess.CompletedProcess:
    """tests/test_privacy_run.py's run (12 clients, 4 a round, 3 rounds) behind two edges."""
    return star_run(cwd, name, EDGES + privacy, *extra)


def _model(path) -> dict[str, np.ndarray]:
    return load_file(str(path / "model.safetensors"))


def _rows(path) -> list[tuple[int, dict]]:
    return [(r, json.loads(t)) for r, t in db_rows(path / "run.db", "SELECT round, metrics_json FROM rounds ORDER BY round")]


def test_private_runs_behind_edges_give_the_plain_model_without_noise_and_record_epsilon_with_it(tmp_path):
    plain = _run(tmp_path, "plain", "")
    central = _run(tmp_path, "central", '[privacy]\nmode = "central"\nclip_norm = 1e12\nnoise_multiplier = 0.0\n'
                                         'noise_at = "edges"\n')
    client = _run(tmp_path, "client", '[privacy]\nmode = "client"\nclip_norm = 1e12\nnoise_multiplier = 0.0\n')
    noisy = _run(tmp_path, "noisy", '[privacy]\nmode = "central"\nclip_norm = 0.05\nnoise_multiplier = 0.8\n'
                                     'clipping = "adaptive"\nclipped_count_stddev = 1.0\nclip_lr = 0.3\n'
                                     'target_quantile = 0.6\ndelta = 1e-4\nnoise_at = "edges"\n')
    for res in (plain, central, client, noisy):
        assert res.returncode == 0, res.stderr[-3000:]
    base = _model(tmp_path / "plain")
    for name in ("central", "client"):
        other = _model(tmp_path / name)
        assert base.keys() == other.keys()
        for k in base:
            assert base[k].tobytes() == other[k].tobytes(), (name, k)
    other = _model(tmp_path / "noisy")
    assert any(base[k].tobytes() != other[k].tobytes() for k in base)   # the comparison can fail
    rows = _rows(tmp_path / "noisy")
    assert [r for r, _ in rows] == [1, 2, 3]
    z_update = (0.8 ** -2 - 2.0 ** -2) ** -0.5   # Andrew et al. Section 3.1's split, sigma_b = 1
    assert z_update > 0.8
    expected_clip = 0.05
    for r, metrics in rows:
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.PoissonSampledDpEvent(4 / 12, dp_accounting.GaussianDpEvent(0.8)), r)
        assert metrics["epsilon"] == pytest.approx(direct.get_epsilon(1e-4), rel=1e-9)
        assert metrics["privacy_clip_norm"] == pytest.approx(expected_clip, rel=1e-12)
        assert "privacy_unclipped" not in metrics   # the edges noised the count: the server never had it
        expected_clip *= np.exp(-0.3 * (metrics["privacy_noisy_unclipped"] / 4 - 0.6))
    summary = json.loads((tmp_path / "noisy" / "summary.json").read_text())["privacy"]
    assert summary["noise_at"] == "edges" and summary["clip_norm_final"] == pytest.approx(expected_clip, rel=1e-12)
    assert summary["epsilon"] == pytest.approx(rows[-1][1]["epsilon"])
    assert "eps=" in noisy.stderr   # the progress line


def test_local_dp_over_edge_iterations_is_accounted_per_release(tmp_path):
    """kappa2 = 2 and every client sampled each round: after r rounds each client released 2 r
    noised updates; epsilon is dp-accounting's Gaussian mechanism composed 2 r times."""
    res = _run(tmp_path, "local", '[privacy]\nmode = "local"\nclip_norm = 0.5\nnoise_multiplier = 2.0\n'
                                   'delta = 1e-5\n', "--set=topology.kappa2=2", "--set=clients.per_round=12")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path / "local")
    assert [r for r, _ in rows] == [1, 2, 3]
    for r, metrics in rows:
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.GaussianDpEvent(2.0), 2 * r)
        assert metrics["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("privacy,sets,key", [
    ('mode = "central"', ["topology.kappa2=2"], "topology.kappa2"),
    ('mode = "client"', ["topology.edges_per_round=1"], "topology.edges_per_round"),
    ('mode = "central"', ["compression.up=qsgd"], "compression.up"),
    ('mode = "local"\nnoise_at = "edges"', [], "privacy.noise_at"),
    ('mode = "central"\nnoise_at = "edges"', ["topology.kind=star", "topology.edges=0"], "privacy.noise_at"),
    ('mode = "none"\nclip_norm = 0.0\nnoise_multiplier = 0.0\nnoise_at = "edges"', [], "privacy.noise_at"),
])
def test_a_bad_combination_behind_edges_is_one_line_and_exit_2(tmp_path, privacy, sets, key):
    res = _run(tmp_path, "bad", f"[privacy]\n{privacy}\nclip_norm = 1.0\nnoise_multiplier = 1.0\n"
               if "clip_norm" not in privacy else f"[privacy]\n{privacy}\n", *[f"--set={s}" for s in sets])
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1, err
