"""The privacy studies' scripts, run as users run them.

benchmarks/dp_epsilon_study.py (docs/privacy.md, "Accuracy against epsilon") in its smallest
configuration, from a folder outside the checkout: both tasks (digits, LEAF-format FEMNIST), one
seed, z in {0, 0.7} and the plain baseline, 2 rounds.  The epsilon it prints is dp-accounting's, called here directly with
the same sampling rate, noise multiplier, rounds and delta; the accuracy it prints is the one each
run's summary.json holds; the plot is a PNG.  benchmarks/secagg_bytes.py's plot option is checked
beside it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "benchmarks" / "dp_epsilon_study.py"
PNG = b"\x89PNG\r\n\x1a\n"


def _rdp_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return accountant.get_epsilon(delta)


def _rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| task")]
    return {(r[0], r[1]): r for r in rows}


@pytest.mark.timeout(240)
def test_smallest_study_prints_the_accountants_epsilon_and_writes_the_plot(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(STUDY), "--out", "study", "--tasks", "digits", "femnist",
                           "--z", "0", "0.7", "--seeds", "0", "--rounds", "2", "--parallel", "2",
                           "--plot", "fig/eps.png"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert list(rows) == [(t, z) for t in ("digits", "femnist") for z in ("plain", "0", "0.7")]
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    points = {(p["task"], "plain" if p["plain"] else f"{p['z']:g}"): p for p in study["points"]}
    # q = clients.per_round / clients.count of each base config: 10 of 50 (digits), 10 of 30 writers
    for task, q in (("digits", 10 / 50), ("femnist", 10 / 30)):
        expected = _rdp_epsilon(q, 0.7, 2, 1e-5)
        p = points[(task, "0.7")]
        assert p["sampling_rate"] == pytest.approx(q) and p["rounds_accounted"] == 2
        assert p["epsilon"] == pytest.approx(expected, rel=1e-9)
        assert rows[(task, "0.7")][2] == f"{expected:.3f}"
        assert rows[(task, "0")][2].startswith("inf") and points[(task, "0")]["epsilon"] is None
        assert rows[(task, "plain")][2].startswith("none") and points[(task, "plain")]["epsilon"] is None
        # the accuracy is the run's own record, read here from its summary.json
        runs = tmp_path / "study" / task
        for z, run in (("0", runs / "dp" / "runs" / "base" / "noise_multiplier=0" / "seed0"),
                       ("0.7", runs / "dp" / "runs" / "base" / "noise_multiplier=0.7" / "seed0"),
                       ("plain", runs / "plain" / "runs" / "base" / "mode=none" / "seed0")):
            summary = json.loads((run / "summary.json").read_text())
            if z == "plain":
                assert "privacy" not in summary           # no [privacy]: no mechanism, no section
            else:
                assert summary["privacy"]["noise_multiplier"] == float(z)
            acc = summary["final"]["test_accuracy"]
            assert points[(task, z)]["accuracy"] == {"0": acc}
            assert rows[(task, z)][3] == rows[(task, z)][4] == rows[(task, z)][5] == f"{acc:.4f}"
    # the LEAF task read the generated LEAF JSON files
    assert (tmp_path / "study" / "femnist" / "data" / "femnist_niid" / "train").is_dir()
    figure = tmp_path / "fig" / "eps.png"
    assert figure.read_bytes()[:8] == PNG and figure.stat().st_size > 10_000


def test_secagg_bytes_plot(tmp_path: Path) -> None:
    """The plot option draws the rows it measured; an integer degree at or above n - 1 is skipped."""
    script = ROOT / "benchmarks" / "secagg_bytes.py"
    done = subprocess.run([sys.executable, str(script), "--n", "6", "12", "--d", "20", "--bits", "20",
                           "--degrees", "complete", "4", "8", "--plot", "bytes.png"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("6", "complete"), ("6", "4"), ("12", "complete"), ("12", "4"),
                                            ("12", "8")]
    for r in rows:
        degree = int(r[0]) - 1 if r[1] == "complete" else int(r[1])
        assert r[8] == r[9] and int(r[7].replace(",", "")) == 100 + 376 * degree + 20 * 3
    assert (tmp_path / "bytes.png").read_bytes()[:8] == PNG
    bad = subprocess.run([sys.executable, str(script), "--degrees", "sparse"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--degrees sparse" in bad.stderr
