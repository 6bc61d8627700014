"""Every claim of docs/claims.md in a tiny mode: its `fedhop sweep` spec runs with 2 rounds, one seed
and the first setting of each algorithm, completes, and every run records the claim's metric."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.deploy.tools.sweep_spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = sorted((REPO / "examples" / "claims").glob("*.toml"))
SPECS = [p for p in SPECS if "[sweep]" in p.read_text()]   # lasso_small.toml is a base config


def test_every_spec_is_in_the_claims_page():
    page = (REPO / "docs" / "claims.md").read_text()
    named = set(re.findall(r"examples/claims/(\w+)\.toml", page))
    assert {p.stem for p in SPECS} <= named


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_claim_command_runs_in_tiny_mode(tmp_path, spec):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fedhop.deploy.cli.cli", "sweep", str(spec), "--out", str(out), "--set", "run.rounds=2",
           "--set", "run.eval_every=1", "--seeds", "0", "--max-settings", "1", "--quiet"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    parsed = load_spec(spec)
    metric = parsed.criterion.metric
    results = json.loads((out / "results.json").read_text())
    assert set(results["settings"]) == set(parsed.sweep.algorithms)
    for algorithm, settings in results["settings"].items():
        assert len(settings) == 1
        (run,) = settings[0]["runs"]
        summary = json.loads((Path(run["run_dir"]) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["rounds_completed"] == 2, summary.get("error")
        assert isinstance(summary["final"].get(metric), float), (algorithm, sorted(summary["final"]))
    assert (out / "results.md").read_text().count("## ") == len(parsed.sweep.algorithms)
