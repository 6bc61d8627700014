"""Exchange only what trains (issue 32, item 4): model.freeze and model.exchange.

A two-layer MLP whose hidden layer is frozen is, for its output layer, softmax regression on fixed
features h = relu(W1 x + b1).  So FedAvg and SCAFFOLD over real processes are checked against an
independent float64 numpy computation of the same rounds on the output layer alone, with the
frozen layer unchanged; the ledger's tensor bytes per message against the count of the trainable
parameters; checkpoints and model.safetensors against the whole model; and the defaults against
today's messages.
"""
from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_frozen,
    list_checkpoints,
    load_checkpoint,
)
from fedhop.common.tasks import build_task
from fedhop.common.util import plugins
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import resume_local, run_local

SIZES = [7, 12, 5, 9]          # samples per client (FedAvg's weights)
D, H, C = 5, 4, 3              # features, frozen hidden width, classes
STEPS, LR = 3, 0.5
FROZEN = ("layers.0.weight", "layers.0.bias")
TRAINED = ("out.weight", "out.bias")


def _write_data(folder: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(32)
    clients = [(rng.normal(0, 1, size=(n, D)).astype(np.float32), rng.integers(0, C, size=n)) for n in SIZES]
    clients[0][1][:C] = np.arange(C)   # every class appears, so the task has C outputs
    np.savez(folder / "data.npz", **{f"{k}_{i}": a for i, (x, y) in enumerate(clients) for k, a in (("x", x), ("y", y))})
    return clients


def _config(algorithm: str = "fedavg", rounds: int = 3, model: str = 'freeze = ["layers.0.*"]\nexchange = "trainable"',
            processes: int = 2) -> str:
    return f"""
[run]
seed = 3
rounds = {rounds}
eval_every = 0
call_timeout = 60.0
round_timeout = 120.0
[algorithm]
name = "{algorithm}"
lr = {LR}
local_steps = {STEPS}
batch_size = 0
[data]
dataset = "npz"
path = "data.npz"
[model]
kind = "mlp"
hidden = [{H}]
{model}
[clients]
count = {len(SIZES)}
processes = {processes}
"""


def _softmax_grad(W: np.ndarray, b: np.ndarray, h: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of the mean cross-entropy of softmax(h W^T + b) in (W, b)."""
    z = h @ W.T + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p.T @ h / len(y), p.mean(axis=0)


def numpy_rounds(clients, init: dict[str, np.ndarray], rounds: int, scaffold: bool) -> tuple[np.ndarray, np.ndarray]:
    """FedAvg (McMahan et al. 2017) or SCAFFOLD option II (Karimireddy et al. 2020, Alg. 1) on the
    output layer, every client every round, full-batch steps, sample weights; the hidden layer
    is the frozen W1, b1 of `init`."""
    W1, b1 = init["layers.0.weight"].astype(np.float64), init["layers.0.bias"].astype(np.float64)
    feats = [(np.maximum(x.astype(np.float64) @ W1.T + b1, 0.0), y) for x, y in clients]
    W, b = init["out.weight"].astype(np.float64), init["out.bias"].astype(np.float64)
    c = [np.zeros_like(W), np.zeros_like(b)]
    ci = [[np.zeros_like(W), np.zeros_like(b)] for _ in clients]
    n = np.asarray(SIZES, dtype=float)
    for _ in range(rounds):
        dys, dcs = [], []
        for i, (h, y) in enumerate(feats):
            Wi, bi = W.copy(), b.copy()
            for _ in range(STEPS):
                gW, gb = _softmax_grad(Wi, bi, h, y)
                if scaffold:                                          # line 10: g - c_i + c
                    gW, gb = gW - ci[i][0] + c[0], gb - ci[i][1] + c[1]
                Wi, bi = Wi - LR * gW, bi - LR * gb
            dys.append((Wi - W, bi - b))
            if scaffold:                                              # line 12, option II
                new = [ci[i][0] - c[0] + (W - Wi) / (STEPS * LR), ci[i][1] - c[1] + (b - bi) / (STEPS * LR)]
                dcs.append((new[0] - ci[i][0], new[1] - ci[i][1]))
                ci[i] = new
        W = W + sum(w * d[0] for w, d in zip(n, dys)) / n.sum()           # server_lr = 1 (line 16)
        b = b + sum(w * d[1] for w, d in zip(n, dys)) / n.sum()
        if scaffold:                                                  # line 17, every client: q_i = n_i / n
            c = [c[0] + sum(w * d[0] for w, d in zip(n, dcs)) / n.sum(), c[1] + sum(w * d[1] for w, d in zip(n, dcs)) / n.sum()]
    return W, b


def _initial(text: str) -> dict[str, np.ndarray]:
    """The run's seeded initial model, as every process builds it (data.npz in the working folder)."""
    model = build_task(parse_config(text)).build_model()
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}


def _train_bytes(db: Path) -> dict[str, set[int]]:
    """Distinct tensor bytes of the train calls' requests (down) and replies (up)."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT direction, tensor_bytes FROM messages WHERE method IN ('train', 'train.reply')"
                           ).fetchall()
    finally:
        con.close()
    out: dict[str, set[int]] = {}
    for direction, nbytes in rows:
        out.setdefault(direction, set()).add(int(nbytes))
    return out


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's folder outside the repository, with the data beside the config."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_frozen_layer_over_grpc_matches_numpy(user_dir, algorithm):
    clients = _write_data(user_dir)
    text = _config(algorithm)
    Path("run.toml").write_text(text)
    assert run_local("run.toml", ["run.checkpoint_every=2"], "run", quiet=True, show_table=False) == 0
    run = user_dir / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["transport"] == "grpc", summary.get("error")
    init = _initial(text)
    model = load_file(str(run / "model.safetensors"))
    assert set(model) == set(FROZEN) | set(TRAINED)                         # the whole model
    for name in FROZEN:                                                      # frozen: as built, bit for bit
        assert np.array_equal(model[name].numpy(), init[name]), name
    W, b = numpy_rounds(clients, init, 3, scaffold=algorithm == "scaffold")
    assert np.abs(model["out.weight"].numpy() - init["out.weight"]).max() > 1e-2   # it trained
    np.testing.assert_allclose(model["out.weight"].double().numpy(), W, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model["out.bias"].double().numpy(), b, rtol=1e-4, atol=1e-5)
    # ledger: each train message carries the trainable parameters only (SCAFFOLD: and their c / Delta c)
    trainable = 4 * (C * H + C)
    per_message = trainable * (2 if algorithm == "scaffold" else 1)
    assert _train_bytes(run / "run.db") == {"down": {per_message}, "up": {per_message}}
    everything = 4 * (H * D + H + C * H + C)
    assert summary["num_parameters"] * 4 == everything and summary["exchanged_parameters"] * 4 == trainable
    # checkpoints: the exchanged part as params/, the frozen rest as frozen/; client state: exchanged names only
    ckpt = load_checkpoint(list_checkpoints(run)[0])
    assert ckpt.round == 2 and set(ckpt.params) == set(TRAINED) and set(ckpt.frozen) == set(FROZEN)
    for name in FROZEN:
        assert np.array_equal(ckpt.frozen[name].numpy(), init[name])
    if algorithm == "scaffold":
        assert set(ckpt.extra) == {f"scaffold_c.{n}" for n in TRAINED}
        assert {k for s in ckpt.client_states.values() for k in s} == {f"scaffold_ci.{n}" for n in TRAINED}


@pytest.mark.slow
def test_resume_with_a_frozen_layer_is_bit_identical(user_dir):
    """Drop the last checkpoint and resume from round 2 with fresh processes: the same model, bit
    for bit, whose frozen layer came from the seeded init and whose c, c_i from the checkpoint."""
    _write_data(user_dir)
    Path("run.toml").write_text(_config("scaffold", rounds=4))
    assert run_local("run.toml", ["run.checkpoint_every=2"], "run", quiet=True, show_table=False) == 0
    whole = load_file(str(user_dir / "run" / "model.safetensors"))
    list_checkpoints(user_dir / "run")[-1].unlink()
    assert resume_local(str(user_dir / "run"), quiet=True, show_table=False) == 0
    again = load_file(str(user_dir / "run" / "model.safetensors"))
    assert set(again) == set(whole) and all(torch.equal(again[k], whole[k]) for k in whole)


def test_exchange_all_is_todays_run(tmp_path, monkeypatch):
    """The defaults and an explicit exchange = "all" give the same bits and bytes, every parameter
    in every message; a frozen layer under "all" still travels but stays as built."""
    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path)
    runs = {}
    for name, model in (("default", ""), ("all", 'exchange = "all"'), ("frozen", 'freeze = ["layers.0.*"]')):
        summary, coord = run_inmemory(parse_config(_config(rounds=2, model=model)), tmp_path / name)
        assert summary["status"] == "completed", summary["error"]
        runs[name] = (summary, coord.state.params, _train_bytes(tmp_path / name / "run.db"))
    everything = 4 * (H * D + H + C * H + C)
    for name, (summary, params, nbytes) in runs.items():
        assert set(params) == set(FROZEN) | set(TRAINED) and nbytes == {"down": {everything}, "up": {everything}}
        assert summary["exchanged_parameters"] == summary["num_parameters"]
    assert all(torch.equal(runs["default"][1][k], runs["all"][1][k]) for k in runs["default"][1])
    assert runs["default"][0]["bytes"] == runs["all"][0]["bytes"]
    init = _initial(_config(rounds=2))
    for name in FROZEN:
        assert np.array_equal(runs["frozen"][1][name].numpy(), init[name])
        assert not np.array_equal(runs["default"][1][name].numpy(), init[name])


def test_hierarchical_edges_aggregate_the_same_part_as_the_star(tmp_path, monkeypatch):
    """Edges reduce only the exchanged tensors: SCAFFOLD through 2 edges equals the star run."""
    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path)
    params = {}
    for name, topology in (("star", ""), ("edges", '[topology]\nkind = "hierarchical"\nedges = 2\n')):
        summary, coord = run_inmemory(parse_config(topology + _config("scaffold", rounds=2)), tmp_path / name)
        assert summary["status"] == "completed", summary["error"]
        assert set(coord.state.params) == set(TRAINED)
        params[name] = coord.state.params
    for n in TRAINED:
        np.testing.assert_allclose(params["edges"][n].numpy(), params["star"][n].numpy(), rtol=1e-5, atol=1e-6)


def test_resume_refuses_frozen_parameters_that_changed():
    frozen = {"layers.0.weight": torch.ones(2, 2)}
    ckpt = Checkpoint(round=2, run_id="r", params={}, frozen={k: v.clone() for k, v in frozen.items()})
    check_frozen(ckpt, frozen)
    with pytest.raises(CheckpointError, match=r"frozen parameters \['layers.0.weight'\] differ"):
        check_frozen(ckpt, {"layers.0.weight": torch.full((2, 2), 2.0)})
    with pytest.raises(CheckpointError, match="model.freeze"):
        check_frozen(ckpt, {})


SELECT = """
def select(name, parameter):
    return name == "out.weight"    # adapter-style: one tensor by name
"""


def test_a_plugin_selects_by_name_and_is_subject_to_the_allow_list(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(plugins.PLUGIN_PATH_ENV, str(tmp_path))
    (tmp_path / "mysel.py").write_text(SELECT)
    _write_data(tmp_path)
    text = _config(rounds=2, model='exchange = "mysel:select"')
    summary, coord = run_inmemory(parse_config(text), tmp_path / "run")
    assert summary["status"] == "completed", summary["error"]
    assert set(coord.state.params) == {"out.weight"}
    assert _train_bytes(tmp_path / "run" / "run.db") == {"down": {4 * C * H}, "up": {4 * C * H}}
    model = load_file(str(tmp_path / "run" / "model.safetensors"))
    init = _initial(text)
    assert set(model) == set(FROZEN) | set(TRAINED)
    for name in (*FROZEN, "out.bias"):                                # not selected: frozen as built
        assert np.array_equal(model[name].numpy(), init[name]), name
    assert not np.array_equal(model["out.weight"].numpy(), init["out.weight"])
    # the launcher hands the selection to the children's allow-lists; a process without it refuses it
    assert "mysel" in plugins.config_plugins(parse_config(text))
    try:
        plugins.restrict([])
        with pytest.raises(ConfigError, match="PLUGIN_NOT_ALLOWED.*mysel"):
            parse_config(text)
    finally:
        plugins.unrestricted()


def test_a_pattern_that_matches_nothing_is_one_line_and_exit_2(tmp_path):
    _write_data(tmp_path)
    (tmp_path / "bad.toml").write_text(_config(model='freeze = ["layers.0.*", "conv9.*"]\nexchange = "trainable"'))
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "bad.toml", "--out", "r"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.freeze" in lines[0] and "'conv9.*'" in lines[0], done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("model,algorithm,expect", [
    ('freeze = ["*"]\nexchange = "trainable"', "fedavg", "nothing is left to exchange"),
    ('exchange = "trainable"', "fedlga", "exchanges the whole model"),
    ('exchange = "everything"', "fedavg", "model.exchange"),
    ('freeze = [""]', "fedavg", r"model.freeze\[0\]"),
])
def test_bad_selections_are_refused_before_any_process_starts(tmp_path, monkeypatch, capsys, model, algorithm, expect):
    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path)
    Path("bad.toml").write_text(_config(algorithm, model=model))
    assert run_local("bad.toml", [], "r", quiet=True, show_table=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedhop run:"), err
    assert re.search(expect, err[0]), err
    assert not Path("r").exists()


def test_the_kept_parameter_list_follows_every_change_to_the_model():
    """`named_parameters` (common/models/exchange.py) keeps a model's walk and checks it before
    each use: after a submodule or a parameter is replaced, added or removed, after
    `bind_params` (load_state_dict assign=True) and with tied weights, it is the list
    `model.named_parameters()` gives, the same objects in the same order."""
    from fedhop.common.algorithms.local import bind_params
    from fedhop.common.models.exchange import named_parameters

    def same(model):
        got, want = named_parameters(model), list(model.named_parameters())
        return [n for n, _ in got] == [n for n, _ in want] and all(a is b for (_, a), (_, b) in zip(got, want))

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    assert same(model) and same(model)
    model[0] = torch.nn.Linear(4, 3)                                         # a submodule replaced
    assert same(model)
    model[2].weight = torch.nn.Parameter(torch.zeros(2, 3))                 # a parameter replaced
    assert same(model)
    model[1].register_parameter("gain", torch.nn.Parameter(torch.ones(1)))  # one added
    assert same(model)
    del model[2].bias                                                       # one removed
    assert same(model) and "2.bias" not in dict(named_parameters(model))
    model.append(torch.nn.Linear(2, 2))                                     # a module added
    assert same(model)
    bind_params(model, {n: torch.full_like(p, 3.0) for n, p in model.named_parameters()})
    assert same(model) and all(bool((p == 3.0).all()) for _, p in named_parameters(model))
    tied = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    tied[1].weight = tied[0].weight                                         # tied: listed once
    assert same(tied) and len(named_parameters(tied)) == 3
