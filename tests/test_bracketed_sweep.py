"""Bracketed sweeps (issue 28 item 1): a best setting on the edge of its grid is marked in the table
and results.json, and `--extend N` / `sweep.extend` widens the grid geometrically past it until the
best is interior or N widenings have run.  The fast tests run the sweep with a stand-in child process
per run (it writes the summary.json of a known objective); the slow one runs real `fedhop run`s."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhop.deploy.tools import sweep as sweep_mod
from fedhop.deploy.tools.bracket import Edge, edges, step_beyond, widen
from fedhop.deploy.tools.sweep import main
from fedhop.deploy.tools.sweep_spec import Dist, SweepSpecError, load_spec

REPO = Path(__file__).resolve().parents[1]
LR_STAR, EPOCHS_STAR = 0.7, 3

# a stand-in for `fedhop run`: writes a completed summary.json whose final objective is a known
# function of algorithm.lr and algorithm.local_epochs (minimum at LR_STAR, EPOCHS_STAR)
FAKE_RUN = f"""
import json, math, sys, pathlib
out, sets = pathlib.Path(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[2:])
lr, epochs = float(sets["algorithm.lr"]), int(sets.get("algorithm.local_epochs", "{EPOCHS_STAR}"))
obj = math.log(lr / {LR_STAR}) ** 2 + 0.1 * (epochs - {EPOCHS_STAR}) ** 2
out.mkdir(parents=True, exist_ok=True)
(out / "summary.json").write_text(json.dumps({{"status": "completed", "final": {{"objective": obj}}}}))
"""


def objective(lr: float, epochs: int = EPOCHS_STAR) -> float:
    return math.log(lr / LR_STAR) ** 2 + 0.1 * (epochs - EPOCHS_STAR) ** 2


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)

    def command(self, task):
        return [sys.executable, str(script), str(task.run_dir.resolve()), *task.overrides]

    monkeypatch.setattr(sweep_mod.Runner, "command", command)
    monkeypatch.setattr(sweep_mod, "build_report", lambda *a, **k: type("R", (), {"out_dir": tmp_path})())
    return script


def write_spec(tmp: Path, grid: str, extra: str = "") -> Path:
    spec = tmp / "sweep.toml"
    spec.write_text(f"""
[sweep]
config = "{REPO / 'examples' / 'fedavg_digits.toml'}"
algorithms = ["fedavg"]
seeds = [0]
parallel = 2
{extra}
[grid]
{grid}
[criterion]
kind = "final"
metric = "objective"
""")
    return spec


def tried(out: Path) -> list[dict]:
    return [json.loads(p.read_text())["values"] for p in sorted((out / "runs" / "fedavg").glob("*/setting.json"))]


# ----------------------------------------------------------------------------------- pure rules
def test_edges_of_a_grid():
    grid = [{"k.lr": lr, "k.e": e, "k.opt": "sgd"} for lr in (0.1, 0.3, 1.0) for e in (1, 2)]
    found = edges({"k.lr": 1.0, "k.e": 1, "k.opt": "sgd"}, grid)
    assert [(e.key, e.side) for e in found] == [("k.e", "low"), ("k.lr", "high")]   # strings: never an edge
    assert edges({"k.lr": 0.3, "k.e": 1, "k.opt": "sgd"}, [g for g in grid if g["k.e"] == 1]) == []   # one value
    assert [e.side for e in edges({"k.lr": 0.1}, [{"k.lr": 0.1}, {"k.lr": 0.3}])] == ["low"]


def test_edges_of_a_range_use_its_outer_tenth_in_log_space():
    space = {"k.lr": Dist(low=0.01, high=1.0, log=True)}
    tried_ = [{"k.lr": v} for v in (0.012, 0.1, 0.5)]
    assert [e.side for e in edges({"k.lr": 0.012}, tried_, space)] == ["low"]     # log position 0.04
    assert edges({"k.lr": 0.5}, tried_, space) == []                                # log position 0.85
    assert [e.side for e in edges({"k.lr": 0.9}, tried_ + [{"k.lr": 0.9}], space)] == ["high"]


def test_step_beyond_follows_the_grids_own_ratio():
    assert step_beyond(Edge("k.lr", 1.0, "high", (0.03, 0.1, 0.3, 1.0))) == pytest.approx(1.0 / 0.3)
    assert step_beyond(Edge("k.lr", 0.03, "low", (0.03, 0.1, 0.3, 1.0))) == pytest.approx(0.009)
    assert step_beyond(Edge("k.lr", 0.03, "low", (0.03, 0.1)), factor=10.0) == pytest.approx(0.003)
    assert step_beyond(Edge("k.e", 5, "high", (1, 2, 5))) == 12 and step_beyond(Edge("k.e", 1, "low", (1, 2))) == 0
    assert step_beyond(Edge("k.b", 0.0, "low", (0.0, 0.5))) == -0.5               # through 0: arithmetic
    assert step_beyond(Edge("k.lr", 0.01, "low", (0.01, 0.5), log=True)) == pytest.approx(0.01 / 3)
    new, notes = widen({"k.e": 1, "k.lr": 1.0}, [Edge("k.e", 1, "low", (1, 2)), Edge("k.lr", 1.0, "high", (0.5, 1.0))],
                       [{"k.e": 1, "k.lr": 1.0}], valid=lambda s: "must be >= 1" if s["k.e"] < 1 else None)
    assert new == [{"k.e": 1, "k.lr": 2.0}] and notes == ["k.e=0: must be >= 1"]


def test_extend_factor_is_validated(tmp_path):
    with pytest.raises(SweepSpecError, match="sweep.extend_factor"):
        load_spec(write_spec(tmp_path, '"algorithm.lr" = [0.1, 0.2]', "extend_factor = 0.5"))
    assert main([str(write_spec(tmp_path, '"algorithm.lr" = [0.1, 0.2]')), "--extend", "-1"]) == 2


# ----------------------------------------------------------------------------------- sweeps
def test_edge_best_is_marked_then_widened_until_interior(tmp_path, fake_runs, capsys):
    spec = write_spec(tmp_path, '"algorithm.lr" = [0.1, 0.2]\n"algorithm.local_epochs" = [1, 2]')
    out = tmp_path / "out"
    # no widening: the best (0.2, 2) is on the edge of both keys, and says so
    assert main([str(spec), "--out", str(out), "--extend", "0", "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    best = res["best"]["fedavg"]
    assert best["point"] == {"algorithm.local_epochs": 2, "algorithm.lr": 0.2}
    assert not best["interior"] and not res["bracketed"]["all_interior"]
    assert {(e["key"], e["side"]) for e in best["edges"]} == {("algorithm.lr", "high"),
                                                              ("algorithm.local_epochs", "high")}
    table = (out / "results.md").read_text()
    assert "ON THE EDGE: local_epochs, lr" in table and "**best on the edge**" in table
    # widened (same folder: the four grid runs are reused): each step moves one key past the edge by
    # the grid's ratio (lr x2, epochs x2) from the current best, until both are bracketed
    assert main([str(spec), "--out", str(out), "--extend", "6", "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    points = tried(out)
    assert len(points) == len({json.dumps(p, sort_keys=True) for p in points})       # nothing run twice
    lrs = {p["algorithm.lr"] for p in points}
    assert all(math.isclose(math.log2(lr / 0.1), round(math.log2(lr / 0.1))) for lr in lrs)   # 0.1 * 2^k
    by_hand = min(points, key=lambda p: objective(p["algorithm.lr"], p["algorithm.local_epochs"]))
    best = res["best"]["fedavg"]
    assert best["point"] == by_hand and best["mean"] == pytest.approx(objective(by_hand["algorithm.lr"],
                                                                                 by_hand["algorithm.local_epochs"]))
    # epochs widen 2 -> 4 (a tie with 2 at lr 0.2): 2 is then bracketed; lr 0.2 -> 0.4 -> 0.8 -> 1.6
    assert by_hand == {"algorithm.lr": pytest.approx(0.8), "algorithm.local_epochs": 2}
    assert sorted(lrs) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6])
    for key in by_hand:       # bracketed: a value tried on each side of the best
        values = {p[key] for p in points}
        assert min(values) < by_hand[key] < max(values)
    assert best["interior"] and res["bracketed"]["all_interior"] and best["edges"] == []
    assert 0 < res["bracketed"]["widenings"]["fedavg"] <= 6
    assert "bracketed after" in (out / "results.md").read_text()


def test_the_limit_stops_widening_and_the_edge_stays_marked(tmp_path, fake_runs):
    spec = write_spec(tmp_path, '"algorithm.lr" = [0.01, 0.02]', "extend = 2")        # the spec key
    out = tmp_path / "out"
    assert main([str(spec), "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert sorted(p["algorithm.lr"] for p in tried(out)) == pytest.approx([0.01, 0.02, 0.04, 0.08])
    best = res["best"]["fedavg"]
    assert best["point"] == {"algorithm.lr": pytest.approx(0.08)} and best["widened"] == 2
    assert [(e["key"], e["side"]) for e in best["edges"]] == [("algorithm.lr", "high")]
    assert res["bracketed"]["widenings"] == {"fedavg": 2} and not res["bracketed"]["all_interior"]


@pytest.mark.slow
def test_real_runs_widen_a_quadratic_lr_grid(tmp_path):
    """Real `fedhop run`s (server and client processes over gRPC) on a deterministic quadratic: FedAvg's
    final objective against lr is unimodal; numpy predicts the best of the widened grid."""
    from tests.helpers import numpy_fedavg_round, quadratic_config

    rng = np.random.default_rng(0)
    centers, curv = rng.normal(size=(3, 4)), rng.uniform(0.5, 1.5, size=(3, 4))
    base = tmp_path / "quad.toml"
    base.write_text(quadratic_config(centers, curv, [1, 1, 1], rounds=3, local_steps=5, lr=0.1, processes=1))
    spec = tmp_path / "sweep.toml"
    spec.write_text('[sweep]\nconfig = "quad.toml"\nseeds = [0]\nparallel = 2\nextend = 4\n'
                    '[grid]\n"algorithm.lr" = [0.05, 0.1]\n[criterion]\nkind = "final"\nmetric = "objective"\n')
    out = tmp_path / "out"
    assert main([str(spec), "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())

    def f(lr):
        w = np.zeros(4)
        for _ in range(3):
            w = numpy_fedavg_round(w, centers, curv, [1, 1, 1], [0, 1, 2], 5, lr, 1.0)
        return float(np.mean([0.5 * (c * (w - a) ** 2).sum() for a, c in zip(centers, curv)]))

    lrs = sorted(s["point"]["algorithm.lr"] for s in res["settings"]["base"])
    assert lrs[:2] == [0.05, 0.1] and all(b == pytest.approx(2 * a) for a, b in zip(lrs, lrs[1:]))
    want = min(lrs, key=f)
    assert res["best"]["base"]["point"]["algorithm.lr"] == pytest.approx(want)
    assert res["best"]["base"]["mean"] == pytest.approx(f(want), rel=1e-5)
    assert res["best"]["base"]["interior"] and lrs[0] < want < lrs[-1]
