"""The LEAF claims check (docs/claims.md, "On a LEAF natural partition"): the generated FEMNIST-format
files are non-IID across writers as the writer says, and the claim's sweep runs in tiny mode."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.data import fakedata
from fedhop.deploy.tools.sweep_spec import load_spec

SPEC = Path(__file__).resolve().parent.parent / "examples" / "claims" / "leaf" / "fedli_femnist.toml"


def _users(folder: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in sorted(folder.glob("*.json")):
        doc = json.loads(f.read_text())
        assert doc["num_samples"] == [len(doc["user_data"][u]["y"]) for u in doc["users"]]
        out.update(doc["user_data"])
    return out


def test_femnist_niid_writers_differ_in_labels_and_style(tmp_path: Path) -> None:
    fakedata.femnist_niid(tmp_path, writers=12, mean=40, classes=10, alpha=0.3, per_file=5)
    train = _users(tmp_path / "train")
    assert len(train) == 12 and set(train) == set(_users(tmp_path / "test"))
    hists = np.array([np.bincount(u["y"], minlength=62) for u in train.values()], dtype=float)
    assert hists[:, 10:].sum() == 0                                 # classes 0..9 of FEMNIST's 62
    shares = hists / hists.sum(1, keepdims=True)
    pooled = hists.sum(0) / hists.sum()
    tv = 0.5 * np.abs(shares - pooled).sum(1)                       # label skew per writer
    assert tv.mean() > 0.3, tv
    means = np.array([np.asarray(u["x"]).mean(0) for u in train.values()])   # a writer's style
    x = np.asarray(next(iter(train.values()))["x"])
    assert x.shape[1] == 784 and x.min() >= 0.0 and x.max() <= 1.0
    assert np.std(means, axis=0).mean() > 0.1                       # writers' mean images differ


@pytest.mark.slow   # three runs of 30 writers as processes: 30 s at load 12, 126 s at load 40 (FEDHOP_SLOW=1)
def test_the_leaf_claim_runs_in_tiny_mode(tmp_path: Path) -> None:
    fakedata.femnist_niid(tmp_path / "data" / "femnist_niid", writers=30, mean=12, per_file=10)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fedhop.deploy.cli.cli", "sweep", str(SPEC), "--out", str(out), "--set", "run.rounds=2",
           "--set", "run.eval_every=1", "--seeds", "0", "--max-settings", "1", "--quiet"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["settings"]) == set(load_spec(SPEC).sweep.algorithms)
    for settings in results["settings"].values():
        (run,) = settings[0]["runs"]
        summary = json.loads((Path(run["run_dir"]) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["num_clients"] == 30
        assert isinstance(summary["final"]["test_accuracy"], float)
