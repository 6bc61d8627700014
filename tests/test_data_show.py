"""`fedhop data show CONFIG.toml` (deploy/tools/datashow.py): its statistics against numpy computed from the
files and the partition directly, its PNG, and its one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedhop.common.config import parse_config
from fedhop.common.data import fakedata
from fedhop.common.tasks import build_task
from fedhop.deploy.cli.cli import main as cli_main
from fedhop.deploy.tools.datashow import partition_stats

FEMNIST = """
[run]
name = "show"
seed = 1
[data]
dataset = "femnist"
partition = "natural"
data_dir = "data"
[model]
kind = "mlp"
[clients]
count = 9
"""


def _show(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "data", "show", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _numpy_stats(hist: np.ndarray) -> dict:
    sizes = hist.sum(axis=1)
    p = hist / sizes[:, None]
    q = hist.sum(axis=0) / hist.sum()
    return {"sizes": sizes, "mean": sizes.mean(), "std": sizes.std(), "median": np.median(sizes),
            "tv": 0.5 * np.abs(p - q).sum(axis=1), "classes": (hist > 0).sum(axis=1)}


def test_leaf_natural_statistics_equal_numpy_from_the_files(tmp_path: Path) -> None:
    fakedata.femnist(tmp_path / "data" / "femnist", writers=9, mean=25, std=8, per_file=4, seed=3)
    (tmp_path / "show.toml").write_text(FEMNIST)
    proc = _show(tmp_path, "show.toml", "--json", "stats.json", "--png", "part.png", "--top", "2")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((tmp_path / "stats.json").read_text())
    # independent: every writer's labels straight from the JSON files, in file order
    hist = []
    for path in sorted((tmp_path / "data/femnist/train").glob("*.json")):
        doc = json.loads(path.read_text())
        hist += [np.bincount(doc["user_data"][u]["y"], minlength=62) for u in doc["users"]]
    hist = np.array(hist)
    ref = _numpy_stats(hist)
    assert np.array_equal(np.array(stats["histograms"]), hist)
    assert stats["sizes"] == ref["sizes"].tolist()
    assert np.isclose(stats["size_mean"], ref["mean"]) and np.isclose(stats["size_std"], ref["std"])
    assert np.isclose(stats["size_median"], ref["median"])
    assert np.allclose(stats["label_tv"], ref["tv"])
    assert stats["classes_per_client_min"] == ref["classes"].min()
    assert stats["largest"] == np.argsort(-ref["sizes"], kind="stable")[:2].tolist()
    assert f"client {stats['largest'][0]:>6}" in proc.stdout
    assert (tmp_path / "part.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dirichlet_statistics_equal_numpy_from_the_partition() -> None:
    cfg = parse_config("[data]\ndataset = \"digits\"\npartition = \"dirichlet\"\nalpha = 0.2\n[clients]\ncount = 15\n")
    task = build_task(cfg)
    labels = task.y.numpy()
    hist = np.stack([np.bincount(labels[p.numpy()], minlength=10) for p in task.parts])
    stats = partition_stats(np.array([task.num_samples(c) for c in range(15)]), task.label_histograms(), top=3)
    ref = _numpy_stats(hist)
    assert stats["sizes"] == ref["sizes"].tolist() and np.allclose(stats["label_tv"], ref["tv"])
    assert np.isclose(stats["size_std"], ref["std"])
    assert stats["smallest"][0] == int(np.argmin(ref["sizes"]))


def test_missing_data_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "show.toml").write_text(FEMNIST)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["data", "show", "show.toml", "--no-png"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "data/femnist/train" in lines[0]


def test_outputs_that_would_replace_a_file_or_cannot_be_written_are_refused_before_any_work(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """The config being read (even with --force), an existing --json or PNG without --force, a missing
    folder, a PNG named otherwise: one line, exit 2, and every file as it was."""
    monkeypatch.chdir(tmp_path)
    config = '[data]\ndataset = "digits"\n[clients]\ncount = 4\n'
    Path("c.toml").write_text(config)
    Path("stats.json").write_text("mine")
    Path("partition.png").write_text("mine too")
    cases = [
        (["--json", "c.toml", "--force", "--no-png"], "--json c.toml: the config being read; name another file"),
        (["--json", "stats.json", "--no-png"], "--json stats.json: a file is there; name another, or replace it "
                                               "with --force"),
        ([], "--png partition.png: a file is there; name another, or replace it with --force"),
        (["--png", "m.safetensors"], "--png m.safetensors: name a .png file"),
        (["--png", "no/such/p.png"], f"--png no/such/p.png: no folder {tmp_path / 'no' / 'such'}"),
    ]
    for flags, message in cases:
        assert cli_main(["data", "show", "c.toml", *flags]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"fedhop data show: {message}\n", captured.err
        assert captured.out == ""                    # refused before the data was built
    assert Path("c.toml").read_text() == config and Path("stats.json").read_text() == "mine"
    assert Path("partition.png").read_text() == "mine too" and sorted(p.name for p in tmp_path.iterdir()) == [
        "c.toml", "partition.png", "stats.json"]
    assert cli_main(["data", "show", "c.toml", "--json", "stats.json", "--force", "--no-png"]) == 0
    assert json.loads(Path("stats.json").read_text())["clients"] == 4
