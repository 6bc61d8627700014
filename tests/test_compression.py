"""`[compression]` end to end (common/processors/compressors/, docs/compression.md): every built-in
compressor's bytes on every upload link equal its formula (the ledger of a run, star and
hierarchical, with partial participation); EF-SGD's model and per-client residuals equal an
independent numpy run after the last round (residuals read from the checkpoint); a user's
compressor from a folder outside the checkout runs over gRPC processes with its bytes counted;
bad keys are one line.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.checkpoint import latest_checkpoint
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

D = 1000
RNG = np.random.default_rng(11)
CENTERS = RNG.normal(0, 2, size=(6, D))
CURV = RNG.uniform(0.5, 2.0, size=(6, D))
SIZES = [10, 30, 20, 5, 40, 15]

# each built-in compressor's keys and its bytes for one d = 1000 float tensor, written from the
# formulas of docs/compression.md, independently of the code
BYTES = {
    "qsgd": ("levels = 3", 4 + math.ceil(D * 3 / 8)),                # a norm + 3-bit codes
    "topk": ("ratio = 0.5", 4 * 500 + math.ceil(D / 8)),             # k = 500 values + a bitmap (smallest)
    "randk": ("ratio = 0.5\nvalues = \"float16\"", 2 * 500 + math.ceil(D / 8)),
    "threshold": ("threshold = 0.0", 4 * D + math.ceil(D / 8)),      # every value kept: a full bitmap
    "sign": ("", math.ceil(D / 8)),                                  # one bit each
    "scaled_sign": ("", 4 + math.ceil(D / 8)),                       # ||v||_1 / d + the bits
    "rounding": ("bits = 4", 8 + math.ceil(4 * D / 8)),              # lo, hi + 4-bit codes
    "natural": ("", math.ceil(9 * D / 8)),                           # sign + 8-bit exponent
    "fp16": ("", 2 * D),
    "bf16": ("", 2 * D),
}


def config(compression: str, topology: str = 'kind = "star"', per_round: int | None = 3, rounds: int = 3,
           extra_run: str = "") -> str:
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=3, lr=0.2, processes=2,
                            per_round=per_round, topology=topology)
    if extra_run:
        text = text.replace("[run]\n", f"[run]\n{extra_run}\n", 1)
    return text + f"\n[compression]\n{compression}\n"


def uploads(run_dir: Path) -> list[dict]:
    store = RunStore(run_dir / "run.db")
    try:
        assert store.check_agreement().ok
        return [r for r in store.messages() if r["role"] == "sender" and r["direction"] == "up"
                and r["method"] in ("train.reply", "edge_round.reply")]
    finally:
        store.close()


@pytest.mark.parametrize("name", sorted(BYTES))
def test_every_upload_costs_its_compressors_formula(tmp_path, name):
    keys, size = BYTES[name]
    summary, coord = run_inmemory(parse_config(config(f'up = "{name}"\n{keys}')), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    ups = uploads(tmp_path)
    assert len(ups) == 3 * 3 and {r["link"] for r in ups} == {"client-server"}   # 3 of 6 clients, 3 rounds
    assert {r["tensor_bytes"] for r in ups} == {size}
    assert np.isfinite(coord.state.params["w"].numpy()).all()


@pytest.mark.parametrize("name, edge", [("topk", "same"), ("natural", "same"), ("sign", "none")])
def test_edges_code_their_partials_as_configured(tmp_path, name, edge):
    keys, size = BYTES[name]
    cfg = parse_config(config(f'up = "{name}"\nedge = "{edge}"\n{keys}', 'kind = "hierarchical"\nedges = 2',
                              per_round=None))
    summary, _ = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed", summary["error"]
    by_link: dict[str, set[int]] = {}
    for r in uploads(tmp_path):
        by_link.setdefault(r["link"], set()).add(r["tensor_bytes"])
    assert by_link["client-edge"] == {size}
    assert by_link["edge-server"] == ({size} if edge == "same" else {4 * D})   # float32 when sent plain


def topk32(p: np.ndarray, k: int) -> np.ndarray:
    """numpy top-k of float32(p) by magnitude, ties to the lower index, values float32."""
    p32 = p.astype(np.float32)
    keep = np.lexsort((np.arange(p.size), -np.abs(p32)))[:k]
    out = np.zeros_like(p)
    out[keep] = p32[keep].astype(np.float64)
    return out


def test_error_feedback_model_and_residuals_equal_numpy(tmp_path):
    """EF-SGD (Stich et al. 2018, Alg. 1) with top-1% on FedAvg, 3 of 6 clients a round: the
    server's model and each client's residual after the last round equal numpy's run of the same
    participants; the residuals are read from the client hosts' persistent states."""
    rounds, k, lr, steps = 5, 10, 0.2, 3
    cfg = parse_config(config('up = "topk"\nratio = 0.01\nerror_feedback = "ef"', rounds=rounds))
    processes: list = []
    summary, coord = run_inmemory(cfg, tmp_path, before_run=lambda net, procs, c: processes.extend(procs))
    assert summary["status"] == "completed", summary["error"]
    w = np.zeros(D)
    residual = {i: np.zeros(D) for i in range(6)}
    for result in coord.history:
        coded, weights = [], []
        for i in result.participants:
            wi = w.copy()
            for _ in range(steps):
                wi = wi - lr * CURV[i] * (wi - CENTERS[i])
            p = (wi - w) + residual[i]          # Alg. 1 line 4: p = update + e
            c = topk32(p, k)
            residual[i] = p - c                 # line 6: e = p - C(p)
            coded.append(c)
            weights.append(SIZES[i])
        share = np.asarray(weights, float) / sum(weights)
        w = w + sum(s * c for s, c in zip(share, coded))
    assert len(coord.history) == rounds
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), w, rtol=1e-5, atol=1e-5)
    states = {cid: state for proc in processes for cid, state in proc.host.states.items()}
    seen = {i for r in coord.history for i in r.participants}
    assert seen and all(np.abs(residual[i]).sum() > 0 for i in seen)
    for i in seen:
        got = states[i]["ef_residual:w"].double().numpy()
        np.testing.assert_allclose(got, residual[i], rtol=1e-5, atol=1e-5)
    for i in set(range(6)) - seen:   # never sampled: no residual kept
        assert "ef_residual:w" not in states.get(i, {})


def test_config_lines_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'compression.ratoi'.*did you mean 'ratio'"):
        parse_config(config('up = "topk"\nratoi = 0.1'))
    with pytest.raises(ConfigError, match=r"compression.up.*unknown compressor 'tpok'.*did you mean 'topk'"):
        parse_config(config('up = "tpok"'))
    with pytest.raises(ConfigError, match=r"compression.layers.'w'.ratoi.*did you mean 'ratio'"):
        parse_config(config('up = "topk"\n[compression.layers]\n"w" = {ratoi = 0.5}'))
    with pytest.raises(ConfigError, match=r"compression.layers.'w'.*allowed: \"plain\""):
        parse_config(config('up = "topk"\n[compression.layers]\n"w" = 3'))
    with pytest.raises(ConfigError, match=r"compression.error_feedback.*needs a compressor"):
        parse_config(config('error_feedback = "ef"'))
    with pytest.raises(ConfigError, match=r"compression.ratio.*0.0"):
        parse_config(config('up = "topk"\nratio = 0.0'))
    with pytest.raises(ConfigError, match=r"both code the uploads"):
        parse_config(config('up = "topk"').replace('name = "fedavg"', 'name = "fedavg"\ncompress = "qsgd"'))
    gossip = quadratic_config(CENTERS, CURV, SIZES, topology='kind = "gossip"')
    with pytest.raises(ConfigError, match=r"compression.up.*gossip.*its own methods"):
        parse_config(gossip + '\n[compression]\nup = "sign"\n')


PLUGIN = textwrap.dedent('''
    """A toy compressor: every value as float16, scaled."""
    from dataclasses import dataclass, field
    from typing import ClassVar

    import torch

    from fedhop.common.processors.compressors.base import expect


    @dataclass(frozen=True)
    class Halves:
        """Values times `scale`, as float16."""

        name: ClassVar[str] = "halves"
        unbiased: ClassVar[bool] = False
        scale: float = field(default=1.0, metadata={"min_exclusive": 0.0, "help": "multiplier before the cast"})

        def encode(self, v, rng):
            return {"h": (v * self.scale).to(torch.float16)}

        def decode(self, parts, numel):
            return expect(parts, "h", torch.float16, (numel,), "halves").to(torch.float32) / self.scale

        def encoded_bytes(self, numel, parts):
            return 2 * numel
''')


def fedhop_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_users_compressor_runs_over_grpc_with_its_bytes_counted(tmp_path):
    """`fedhop run` from a folder outside the checkout, the plug-in module beside the config: the
    server and both client processes load it, and each upload costs its 2 d bytes.  With error
    feedback, every client's residual (what float16 lost) is in the run's checkpoint."""
    (tmp_path / "mycomp.py").write_text(PLUGIN)
    (tmp_path / "exp.toml").write_text(config('up = "mycomp:Halves"\nscale = 2.0\nerror_feedback = "ef"',
                                              per_round=None, rounds=3, extra_run="checkpoint_every = 1"))
    done = fedhop_run(tmp_path, "exp.toml", "--out", "run", "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    ups = uploads(tmp_path / "run")
    assert len(ups) == 6 * 3 and {r["tensor_bytes"] for r in ups} == {2 * D}
    ckpt = latest_checkpoint(tmp_path / "run")
    residuals = [ckpt.client_states[i]["ef_residual:w"].double().numpy() for i in range(6)]
    assert all(np.isfinite(e).all() and 0 < np.abs(e).max() < 1e-2 for e in residuals)   # float16's rounding
    (tmp_path / "bad.toml").write_text(config('up = "mycomp:Halves"\nscal = 2.0'))
    bad = fedhop_run(tmp_path, "bad.toml", "--out", "run2", "--quiet")
    assert bad.returncode == 2
    lines = [ln for ln in bad.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "compression.scal" in lines[0] and "did you mean 'scale'" in lines[0], bad.stderr
    assert not (tmp_path / "run2" / "run.db").exists()


def test_a_sweep_spec_varies_compressor_settings(tmp_path):
    """`fedhop sweep` takes compressor keys as any dotted key: a grid over compression.ratio (and
    the compressor itself) is checked against the base config at load, and a misspelt one is one
    line naming it."""
    from fedhop.deploy.tools.sweep_spec import SweepSpecError, check_base_config, load_spec, setting_error
    (tmp_path / "base.toml").write_text(config('up = "topk"'))
    (tmp_path / "sweep.toml").write_text(textwrap.dedent('''
        [sweep]
        config = "base.toml"
        seeds = [0, 1]
        [grid]
        "compression.ratio" = [0.01, 0.1]
        "compression.error_feedback" = ["none", "ef"]
    '''))
    spec = load_spec(tmp_path / "sweep.toml")
    check_base_config(spec)
    assert setting_error(spec, "", ["compression.ratio=0.1", 'compression.error_feedback="ef"']) is None
    assert "compression.ratio" in (setting_error(spec, "", ["compression.ratio=2.0"]) or "")
    (tmp_path / "bad.toml").write_text((tmp_path / "sweep.toml").read_text().replace('"compression.ratio"',
                                                                                     '"compression.ratoi"'))
    with pytest.raises(SweepSpecError, match=r"compression.ratoi"):
        check_base_config(load_spec(tmp_path / "bad.toml"))


@pytest.mark.parametrize("keys, layers, size", [
    ("ratio = 0.01", '"w" = {ratio = 0.5}', 4 * 500 + math.ceil(D / 8)),   # the layer's k wins
    ("ratio = 0.5", '"w" = "plain"', 4 * D),                             # sent as it is
    ("ratio = 0.5", '"x*" = "plain"\n"*" = {ratio = 0.5, values = "bfloat16"}', 2 * 500 + math.ceil(D / 8)),
])
def test_layers_set_a_tensors_own_keys_or_send_it_plain(tmp_path, keys, layers, size):
    """`[compression.layers]`: the first pattern a tensor's name matches decides its keys (or
    "plain"); the config round-trips through the TOML a child process receives."""
    from fedhop.common.config import config_to_toml
    cfg = parse_config(config(f'up = "topk"\n{keys}\n[compression.layers]\n{layers}'))
    assert parse_config(config_to_toml(cfg)).compression == cfg.compression
    summary, _ = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed", summary["error"]
    assert {r["tensor_bytes"] for r in uploads(tmp_path)} == {size}
