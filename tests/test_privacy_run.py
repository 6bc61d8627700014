"""[privacy] over real processes: `fedhop run` from a folder outside the checkout records each
round's epsilon in run.db, summary.json and the progress line; with no noise and a bound no update
reaches, the final model equals a plain run's bit for bit (the plumbing adds nothing); bad
privacy keys are one line and exit 2."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import db_rows, max_round, wait_until

CONFIG = """[run]
name = "{name}"
seed = 3
rounds = 3
[algorithm]
name = "fedavg"
lr = 0.1
local_steps = 3
batch_size = 16
weighting = "uniform"
[data]
dataset = "digits"
[model]
kind = "mlp"
hidden = [16]
[clients]
count = 12
per_round = 4
processes = 2
{privacy}"""


def _run(cwd, name: str, privacy: str, *extra: str) -> subprocess.CompletedProcess:
    (cwd / f"{name}.toml").write_text(CONFIG.format(name=name, privacy=privacy))
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", f"{name}.toml", "--out", name,
                           *extra], cwd=cwd, capture_output=True, text=True, timeout=400)


def test_a_private_run_records_epsilon_each_round(tmp_path):
    res = _run(tmp_path, "dp", '[privacy]\nmode = "central"\nclip_norm = 0.5\nnoise_multiplier = 1.2\n'
                              'delta = 1e-4\n')
    assert res.returncode == 0, res.stderr[-3000:]
    rows = db_rows(tmp_path / "dp" / "run.db", "SELECT round, metrics_json FROM rounds ORDER BY round")
    assert [r for r, _ in rows] == [1, 2, 3]
    for r, text in rows:
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.PoissonSampledDpEvent(4 / 12, dp_accounting.GaussianDpEvent(1.2)), r)
        metrics = json.loads(text)
        assert metrics["epsilon"] == pytest.approx(direct.get_epsilon(1e-4), rel=1e-9)
        assert metrics["privacy_clip_norm"] == 0.5
    summary = json.loads((tmp_path / "dp" / "summary.json").read_text())
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(json.loads(rows[-1][1])["epsilon"])
    assert privacy["rounds_accounted"] == 3 and privacy["noise_source"].startswith("seeded")
    assert privacy["mode"] == "central" and privacy["denominator"].startswith("fixed")
    assert "eps=" in res.stderr   # the progress line
    rep = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "report", "dp", "--out", "rep"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    header, _, row = rep.stdout.splitlines()[:3]
    assert "epsilon" in header.split()
    assert f"{privacy['epsilon']:.4g}" in row.split()   # the report's epsilon column: the run's
    assert (tmp_path / "rep" / "metric_vs_epsilon.png").stat().st_size > 0


def _direct_rdp(q: float, z: float, rounds: int, delta: float) -> float:
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return acc.get_epsilon(delta)


def test_a_target_epsilon_stops_the_run_before_it_is_passed(tmp_path):
    """z = 1.0, q = 1/3: epsilon after 2 rounds is under 4.8 and after 3 over it (checked against
    dp-accounting here), so a target of 4.8 stops a 3-round run after round 2, completed."""
    after2, after3 = _direct_rdp(4 / 12, 1.0, 2, 1e-5), _direct_rdp(4 / 12, 1.0, 3, 1e-5)
    assert after2 < 4.8 < after3
    res = _run(tmp_path, "budget", '[privacy]\nmode = "central"\nclip_norm = 0.5\nnoise_multiplier = 1.0\n'
                                   'target_epsilon = 4.8\n')
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "budget" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert summary["privacy"]["stopped_at_target"] is True
    assert summary["privacy"]["epsilon"] == pytest.approx(after2, rel=1e-9)
    events = db_rows(tmp_path / "budget" / "run.db", "SELECT kind FROM events WHERE kind = 'privacy_budget_spent'")
    assert len(events) == 1


def test_a_resumed_private_run_goes_on_accounting_from_its_checkpoint(tmp_path):
    """A run stopped (SIGTERM) after round 2 and resumed: rounds 3 and 4 record epsilon of 3 and 4
    composed rounds, as one uninterrupted run does (an accountant restarted at zero would not)."""
    (tmp_path / "long.toml").write_text(CONFIG.format(name="long", privacy=(
        '[privacy]\nmode = "central"\nclip_norm = 0.5\nnoise_multiplier = 1.5\nclipping = "adaptive"\n'
        'clipped_count_stddev = 1.0\n')).replace("rounds = 3", "rounds = 4\ncheckpoint_every = 1"))
    proc = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "long.toml", "--out", "long",
                             "--quiet"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        db = tmp_path / "long" / "run.db"
        wait_until("round 2 recorded", lambda: db.exists() and max_round(db) >= 2, [proc], timeout=300)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = json.loads((tmp_path / "long" / "summary.json").read_text())
    if stopped["status"] == "completed":   # the signal landed after the last round: nothing to resume
        pytest.skip("the run had finished before the stop arrived")
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "--resume", "long", "--quiet"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = db_rows(tmp_path / "long" / "run.db", "SELECT round, metrics_json FROM rounds ORDER BY round")
    assert [r for r, _ in rows] == [1, 2, 3, 4]
    metrics = [json.loads(m) for _, m in rows]
    for r, m in enumerate(metrics, start=1):
        assert m["epsilon"] == pytest.approx(_direct_rdp(4 / 12, 1.5, r, 1e-5), rel=1e-9)
    for before, after in zip(metrics, metrics[1:]):   # C goes on from the checkpoint's, by the paper's update
        expected = before["privacy_clip_norm"] * np.exp(-0.2 * (before["privacy_noisy_unclipped"] / 4 - 0.5))
        assert after["privacy_clip_norm"] == pytest.approx(expected, rel=1e-12)
    assert json.loads((tmp_path / "long" / "summary.json").read_text())["privacy"]["rounds_accounted"] == 4


def test_a_dpsgd_run_records_the_clients_sample_level_epsilon(tmp_path):
    res = _run(tmp_path, "sgd", '[privacy]\nmode = "dpsgd"\nclip_norm = 1.0\nnoise_multiplier = 1.1\n'
                               'secure_noise = true\n')
    assert res.returncode == 0, res.stderr[-3000:]
    rows = db_rows(tmp_path / "sgd" / "run.db", "SELECT round, metrics_json FROM rounds ORDER BY round")
    eps = [json.loads(m)["epsilon"] for _, m in rows]
    assert len(eps) == 3 and all(b >= a > 0 for a, b in zip(eps, eps[1:]))
    privacy = json.loads((tmp_path / "sgd" / "summary.json").read_text())["privacy"]
    assert privacy["mode"] == "dpsgd" and privacy["epsilon"] == pytest.approx(eps[-1])
    assert privacy["noise_source"].startswith("os.urandom")


def test_no_noise_and_an_unreachable_bound_give_the_plain_model_bit_for_bit(tmp_path):
    plain = _run(tmp_path, "plain", "")
    private = _run(tmp_path, "open", '[privacy]\nmode = "central"\nclip_norm = 1e12\nnoise_multiplier = 0.0\n')
    client = _run(tmp_path, "client", '[privacy]\nmode = "client"\nclip_norm = 1e12\nnoise_multiplier = 0.0\n')
    for res in (plain, private, client):
        assert res.returncode == 0, res.stderr[-3000:]
    base = load_file(str(tmp_path / "plain" / "model.safetensors"))
    for name in ("open", "client"):
        other = load_file(str(tmp_path / name / "model.safetensors"))
        assert base.keys() == other.keys()
        for k in base:
            assert base[k].tobytes() == other[k].tobytes(), (name, k)
    # and a small bound does change it: the comparison can fail
    clipped = _run(tmp_path, "clipped", '[privacy]\nmode = "central"\nclip_norm = 1e-3\n')
    assert clipped.returncode == 0, clipped.stderr[-3000:]
    other = load_file(str(tmp_path / "clipped" / "model.safetensors"))
    assert any(base[k].tobytes() != other[k].tobytes() for k in base)


BAD = [
    ('mode = "none"\nnoise_multiplier = 1.0\n', "privacy.noise_multiplier"),
    ('mode = "central"\nnoise_multiplier = 1.0\n', "privacy.clip_norm"),
    ('mode = "central"\nclip_norm = 1.0\ndelta = 1.5\n', "privacy.delta"),
    ('mode = "central"\nclip_norm = 1.0\ndelta = 0.0\n', "privacy.delta"),
    ('mode = "central"\nclip_norm = 1.0\nnoise_multiplier = -1.0\n', "privacy.noise_multiplier"),
    ('mode = "central"\nclip_norm = 1.0\ntarget_epsilon = 3.0\n', "privacy.target_epsilon"),
    ('mode = "central"\nclip_norm = 1.0\nnoise_multiplier = 1.0\ntarget_epsilon = 3.0\non_target = "calibrate"\n',
     "privacy.noise_multiplier"),
    ('mode = "local"\nclip_norm = 1.0\nclipping = "adaptive"\n', "privacy.clipping"),
    ('mode = "central"\nclip_norm = 1.0\nnoise_multiplier = 1.0\nclipping = "adaptive"\n'
     'clipped_count_stddev = 0.4\n', "privacy.clipped_count_stddev"),
    ('mode = "central"\nclip_norm = 1.0\nsampling = "fixed_size"\naccountant = "pld"\n', "privacy.sampling"),
    ('mode = "centrall"\nclip_norm = 1.0\n', "privacy.mode"),
    ('mode = "dpsgd"\nclip_norm = 1.0\nnoise_multiplier = 0.5\nclipping = "adaptive"\n', "privacy.clipping"),
    ('mode = "central"\nclip_norm = 1.0\nnoise = 1.0\n', "privacy.noise"),
]


@pytest.mark.parametrize("privacy,key", BAD)
def test_a_bad_privacy_key_is_one_line_and_exit_2(tmp_path, privacy, key):
    res = _run(tmp_path, "bad", "[privacy]\n" + privacy)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("sets,key", [
    (["algorithm.name=scaffold"], "privacy.mode"),   # no model delta alone
    (["algorithm.weighting=samples"], "algorithm.weighting"),
    (["topology.kind=relay"], "privacy.mode"),   # a random walk: no round sum to clip and noise
    (["security.aggregation=median"], "security.aggregation"),
    (["compression.up=topk", "privacy.mode=client"], "compression.up"),
])
def test_privacy_with_what_it_cannot_protect_is_refused(tmp_path, sets, key):
    args = [f"--set={s}" for s in sets]
    res = _run(tmp_path, "bad", '[privacy]\nmode = "central"\nclip_norm = 1.0\nnoise_multiplier = 1.0\n', *args)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1, err
