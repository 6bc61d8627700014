"""Secure aggregation over real processes (`fedhop run` from a folder outside the checkout): the
four phases as their own methods in the ledger with the byte formulas, the model against an
independent numpy computation of the dequantized sum and against the same run without secure
aggregation, a client process killed between phases, and the config's refusals."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.topologies.plan import plan_processes
from fedhop.deploy.launch.launcher import LocalRun
from tests.helpers import quadratic_config

COUNT = 6
RNG = np.random.default_rng(48)
CENTERS = RNG.normal(0, 1, size=(COUNT, 4))
CURV = RNG.uniform(0.5, 2.0, size=(COUNT, 4))
SIZES = [4] * COUNT
STEPS, LR, CLIP, QBITS, SEED = 3, 0.1, 2.0, 8, 5


def config(enabled: bool, rounds: int = 1, degree: int = 4, threshold: int = 3, processes: int = 2,
           extra: str = "", steps: int = STEPS) -> str:
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=steps, lr=LR, processes=processes,
                            extra_algorithm='weighting = "uniform"', seed=SEED)
    return text + f"""
[secure_aggregation]
enabled = {str(enabled).lower()}
degree = {degree}
threshold = {threshold}
modulus_bits = 16
clip = {CLIP}
quant_bits = {QBITS}
{extra}"""


def run(tmp_path, name: str, text: str) -> subprocess.CompletedProcess:
    (tmp_path / f"{name}.toml").write_text(text)
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", f"{name}.toml", "--out", name],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def numpy_quantized(pos: int, round_number: int, delta: np.ndarray) -> np.ndarray:
    """docs/secure-aggregation.md's rule written out: clip to L2 norm CLIP, map [-CLIP, CLIP] to
    [0, 2^QBITS - 1], stochastic rounding with PCG64 seeded (seed, round, protocol id, 0x9A)."""
    norm = np.linalg.norm(delta)
    x = delta * (CLIP / norm) if norm > CLIP else delta
    y = (x + CLIP) / (2 * CLIP) * (2 ** QBITS - 1)
    u = np.random.default_rng([SEED, round_number, pos, 0x9A]).random(y.shape)
    return (np.floor(y) + (u < y - np.floor(y))).astype(np.int64)


def local_delta(i: int) -> np.ndarray:
    w = np.zeros(4)
    for _ in range(STEPS):
        w = w - LR * CURV[i] * (w - CENTERS[i])
    return w


def server_rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def test_a_secure_round_is_the_quantized_sum_and_its_phases_cost_the_formulas(tmp_path):
    plain, secure = run(tmp_path, "plain", config(False)), run(tmp_path, "secure", config(True))
    assert plain.returncode == 0 and secure.returncode == 0, plain.stderr + secure.stderr
    w_plain = load_file(str(tmp_path / "plain" / "model.safetensors"))["w"].double().numpy()
    w_secure = load_file(str(tmp_path / "secure" / "model.safetensors"))["w"].double().numpy()
    levels = 2 ** QBITS - 1
    # the independent computation: every client's delta from w = 0 (numpy), quantized, summed as integers
    total = sum(numpy_quantized(i, 1, local_delta(i)) for i in range(COUNT))
    # the model carries the mean of the dequantized sum (uniform weights): read the integer sum back from it
    recovered = np.rint((w_secure * COUNT + COUNT * CLIP) * levels / (2 * CLIP)).astype(np.int64)
    assert recovered.tolist() == total.tolist()
    assert np.allclose(w_secure, (total * 2 * CLIP / levels - COUNT * CLIP) / COUNT, atol=1e-6)
    # against the plain run: the mean's error is below one quantization step per coordinate
    assert np.abs(w_secure - w_plain).max() <= 2 * CLIP / levels + 1e-6
    assert np.abs(w_plain - np.mean([local_delta(i) for i in range(COUNT)], axis=0)).max() < 1e-5
    # the ledger: each phase under its own method, the server's records per client against the formulas
    db = tmp_path / "secure" / "run.db"
    rows = server_rows(db, "select method, dst, src, tensor_bytes from messages where recorder = 'server' "
                           "and method like 'secagg%'")
    k, d, w = 4, 4, 2
    formula = {"secagg_advertise": 12, "secagg_advertise.reply": 64, "secagg_share": 4 + 68 * k,
               "secagg_share.reply": 4 + 128 * k, "secagg_masked": 4 * d + 4 + 128 * k,
               "secagg_masked.reply": d * w, "secagg_unmask": 8 + 4 * k, "secagg_unmask.reply": 4 + 48 * k}
    seen: dict[str, set[int]] = {}
    for method, dst, src, size in rows:
        seen.setdefault(method, set()).add(size)
    assert seen == {m: {b} for m, b in formula.items()}
    assert len(rows) == 8 * COUNT
    assert not server_rows(db, "select 1 from messages where method = 'train'")


def run_killing_one(tmp_path, threshold: int, rounds: int, policy: str):
    """6 clients on 3 processes, complete graph (k = 5); SIGKILL of the process of clients 2 and 3
    once round 2's share phase is recorded.  The clients' local work (1000 steps each, seconds per
    process) makes the masked-input phase, where the kill lands, the long one; the call and round
    deadlines are generous so that a loaded machine loses no live client's reply.  Returns the run.db
    path and the server's exit code."""
    text = config(True, rounds=rounds, degree=0, threshold=threshold, processes=3, steps=1000)
    text = text.replace("call_timeout = 30.0", "call_timeout = 120.0")
    text = text.replace("round_timeout = 60.0", f"round_timeout = 180.0\nmin_results = 3\non_short_round = \"{policy}\"")
    text = text.replace("[transport]", "[security]\nheartbeat_interval = 0.25\nheartbeat_timeout = 1.5\n"
                                       "parent_timeout = 3.0\n\n[transport]")
    cfg = parse_config(text)
    victim = plan_processes(cfg).clients[1]
    local = LocalRun(cfg, tmp_path / "run", workdir=tmp_path)
    server = local.start([])
    db = tmp_path / "run" / "run.db"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.proc.poll() is None:
            if db.exists() and server_rows(db, "select 1 from events where kind = 'secagg_phase' and round = 2 "
                                               "and detail like 'share:%'"):
                break
            time.sleep(0.01)
        child = next(c for c in local.children if c.name == victim.node_id)
        os.kill(child.proc.pid, signal.SIGKILL)
        code = server.proc.wait(timeout=240)
    finally:
        local.stop_all()
    return db, code


def test_a_client_process_killed_between_phases_leaves_a_complete_round(tmp_path):
    """t = 3 of k = 5: two clients lost in round 2's masked-input phase leave every secret 3
    holders; the round completes with the 4 others' sum, and so does the run."""
    db, code = run_killing_one(tmp_path, threshold=3, rounds=3, policy="retry")
    assert code == 0
    assert [r[0] for r in server_rows(db, "select round from rounds order by round")] == [1, 2, 3]
    assert server_rows(db, "select kind, detail from events where kind = 'secagg_failed'") == []
    phases = [d for (d,) in server_rows(db, "select detail from events where kind = 'secagg_phase' and round = 2 "
                                            "order by rowid")]
    assert phases == ["advertise: 6 of 6 clients replied", "share: 6 of 6 clients replied",
                      "masked: 4 of 6 clients replied", "unmask: 4 of 4 clients replied"]


def test_one_dropout_past_the_threshold_fails_the_round_with_its_reason(tmp_path):
    """t = 5 of k = 5 tolerates no dropout: round 2 fails with the typed reason, is skipped
    (run.on_short_round = "skip") with the model unchanged, and the run goes on to its end."""
    db, code = run_killing_one(tmp_path, threshold=5, rounds=2, policy="skip")
    assert code == 0
    failed = server_rows(db, "select round, detail from events where kind = 'secagg_failed'")
    # 4 clients left after the masked-input phase, below t = 5
    assert failed == [(2, "SECAGG_TOO_FEW_CLIENTS: 4 clients left after masked input, threshold 5")]
    assert server_rows(db, "select round from events where kind = 'round_skipped'") == [(2,)]
    assert [r[0] for r in server_rows(db, "select round from rounds order by round")] == [1]


@pytest.mark.parametrize("change,needle", [
    ("threshold = 3", "secure_aggregation"),
    ('weighting = "uniform"', "uniform"),
    ('kind = "grpc"', "transport.kind"),
    ('kind = "star"', "topology.kind"),
    ("[transport]", "security.aggregation"),
    ('name = "fedavg"', "summable"),
])
def test_unsupported_settings_are_one_line_exit_2(tmp_path, change, needle):
    text = config(True)
    bad = {"threshold = 3": "threshold = 5", 'weighting = "uniform"': 'weighting = "samples"',
           'kind = "grpc"': 'kind = "torch"', 'kind = "star"': 'kind = "gossip"',
           "[transport]": '[security]\naggregation = "median"\n\n[transport]', 'name = "fedavg"': 'name = "scaffold"'}[change]
    done = run(tmp_path, "bad", text.replace(change, bad))
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and needle in lines[0], done.stderr
