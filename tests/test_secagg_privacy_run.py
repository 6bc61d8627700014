"""Central differential privacy on a SecAgg+ sum over real processes (`fedhop run` from a folder
outside the checkout; docs/privacy.md, "With secure aggregation"): with no noise the model equals
the plain SecAgg+ run's bit for bit, and the masked input carries one more coordinate (the
clipped-count bit); with noise and adaptive clipping, each round's epsilon is dp-accounting's, the
count of unclipped updates is numpy's, C moves by the paper's update, eps is on the progress line,
and the live page (its JSON and, in headless Chromium, its DOM) shows the epsilon run.db holds."""
from __future__ import annotations

import json
import math
import subprocess
import urllib.request

import dp_accounting
import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.deploy.tools.dashboard import serve, snapshot
from tests.helpers import db_rows
from tests.test_secagg_run import CLIP, COUNT, config, local_delta, run

try:   # the headless browser of tests/test_dashboard.py, where installed
    from tests.test_dashboard import CHROMIUM, FLAGS
except ImportError:   # pragma: no cover - the dashboard tests' module always imports
    CHROMIUM, FLAGS = None, []


def _masked_reply_bytes(db) -> set[int]:
    return {b for (b,) in db_rows(db, "SELECT tensor_bytes FROM messages WHERE recorder = 'server' "
                                      "AND method = 'secagg_masked.reply'")}


def test_without_noise_the_composition_is_the_plain_secure_run_bit_for_bit(tmp_path):
    """z = 0, C = secure_aggregation.clip = 2 (no update reaches the bound before quantization,
    2 - sqrt(4) 2 * 2 / 255): two rounds give the plain SecAgg+ run's model bit for bit; every
    round counts all 6 updates unclipped; each masked input is one 2-byte coordinate longer."""
    plain = run(tmp_path, "plain", config(True, rounds=2))
    private = run(tmp_path, "private", config(True, rounds=2, extra=(
        f'[privacy]\nmode = "central"\nclip_norm = {CLIP}\nnoise_multiplier = 0.0\n')))
    assert plain.returncode == 0 and private.returncode == 0, plain.stderr[-2000:] + private.stderr[-2000:]
    assert max(np.linalg.norm(local_delta(i)) for i in range(COUNT)) < CLIP - 2 * 2 * CLIP / 255
    w_plain = load_file(str(tmp_path / "plain" / "model.safetensors"))["w"]
    w_private = load_file(str(tmp_path / "private" / "model.safetensors"))["w"]
    assert w_private.dtype == w_plain.dtype and w_private.numpy().tobytes() == w_plain.numpy().tobytes()
    rows = db_rows(tmp_path / "private" / "run.db", "SELECT round, metrics_json FROM rounds ORDER BY round")
    assert [r for r, _ in rows] == [1, 2]
    for _, text in rows:
        metrics = json.loads(text)
        assert metrics["privacy_unclipped"] == COUNT and "epsilon" not in metrics   # z = 0: no finite epsilon
    d, element = 4, 2   # modulus_bits = 16
    assert _masked_reply_bytes(tmp_path / "plain" / "run.db") == {d * element}
    assert _masked_reply_bytes(tmp_path / "private" / "run.db") == {(d + 1) * element}
    summary = json.loads((tmp_path / "private" / "summary.json").read_text())
    assert summary["privacy"]["aggregation"].startswith("secure")


def test_noise_on_the_secure_sum_records_epsilon_on_the_progress_line_and_the_live_page(tmp_path):
    """z = 1.3 with adaptive clipping from C = 0.5 (3 of the 6 first-round updates lie within it,
    numpy), sigma_b = 1: epsilon after each of 3 rounds equals dp-accounting's RDP of that many
    Poisson-sampled Gaussian rounds at q = 1; C moves by C exp(-eta (b_bar - gamma)) from the
    recorded noisy count; the live page carries run.db's epsilon per round and the delta."""
    z, c0, eta, gamma, delta = 1.3, 0.5, 0.2, 0.5, 1e-4
    text = config(True, rounds=3, extra=(
        f'[privacy]\nmode = "central"\nclip_norm = {c0}\nnoise_multiplier = {z}\nclipping = "adaptive"\n'
        f'clipped_count_stddev = 1.0\nclip_lr = {eta}\ntarget_quantile = {gamma}\ndelta = {delta}\n'))
    done = run(tmp_path, "dp", text)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eps=" in done.stderr   # the progress line
    db = tmp_path / "dp" / "run.db"
    metrics = [json.loads(m) for _, m in db_rows(db, "SELECT round, metrics_json FROM rounds ORDER BY round")]
    assert len(metrics) == 3
    assert metrics[0]["privacy_unclipped"] == sum(np.linalg.norm(local_delta(i)) <= c0 for i in range(COUNT)) == 3
    clip = c0
    for r, m in enumerate(metrics, start=1):
        direct = dp_accounting.rdp.RdpAccountant()
        direct.compose(dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(z)), r)
        assert m["epsilon"] == pytest.approx(direct.get_epsilon(delta), rel=1e-9)
        assert m["privacy_clip_norm"] == pytest.approx(clip, rel=1e-12)
        clip = clip * math.exp(-eta * (m["privacy_noisy_unclipped"] / COUNT - gamma))
    # the live page: its JSON and its served HTML carry the epsilon run.db holds, per round, and delta
    state = snapshot(tmp_path / "dp")
    assert state["privacy"]["delta"] == delta and state["privacy"]["mode"] == "central"
    assert state["privacy"]["per_round"] == [[r, m["epsilon"]] for r, m in enumerate(metrics, start=1)]
    assert state["privacy"]["epsilon"] == metrics[-1]["epsilon"]
    server, url = serve(tmp_path / "dp")
    try:
        with urllib.request.urlopen(url + "api/state", timeout=30) as reply:
            assert json.loads(reply.read())["privacy"] == state["privacy"]
        if CHROMIUM is not None:
            dom = subprocess.run([CHROMIUM, *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=120,
                                 check=True).stdout
            assert f'data-epsilon="{metrics[-1]["epsilon"]}"' in dom
            for r, m in enumerate(metrics, start=1):
                assert f'data-round="{r}" data-epsilon="{m["epsilon"]}"' in dom
            assert f'id="delta">{delta}<' in dom
    finally:
        server.shutdown()
