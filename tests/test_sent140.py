"""Sent140 (LEAF JSON): the reader against the JSON itself, the hashed features against an independent
computation, bad labels, and FedAvg on generated tweets with a learnable signal beating chance."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import load_config, parse_config
from fedhop.common.data import fakedata
from fedhop.common.data.leaf import LeafError, write_leaf
from fedhop.common.tasks import build_task
from fedhop.common.tasks.sent140 import hash_features
from fedhop.deploy.launch.inmemory import run_inmemory

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _config(data_dir: Path, clients: int, extra: str = "") -> object:
    return parse_config(f'[data]\ndataset = "sent140"\npartition = "natural"\ndata_dir = "{data_dir}"\n{extra}\n'
                        f'[model]\nkind = "logreg"\n[clients]\ncount = {clients}\n')


def _json_users(folder: Path) -> dict[str, dict]:
    users: dict[str, dict] = {}
    for f in sorted(folder.glob("*.json")):
        users.update(json.loads(f.read_text())["user_data"])
    return users


def test_reader_matches_the_json(tmp_path: Path) -> None:
    fakedata.sent140(tmp_path / "sent140", users=9, mean=12, per_file=4)
    raw = _json_users(tmp_path / "sent140" / "train")
    task = build_task(_config(tmp_path, 9, "features = 64"))
    assert task.num_clients == len(raw) == 9
    assert [task.user(c) for c in range(9)] == list(raw)          # file order, one client per user
    for c, (name, value) in enumerate(raw.items()):
        x, y = task.client_data(c).tensors
        assert task.num_samples(c) == len(value["y"]) == len(y)
        assert y.tolist() == [int(v) for v in value["y"]]
        assert x.shape == (len(value["y"]), 64)
        texts = [row[4] for row in value["x"]]
        assert all(row[3] == name for row in value["x"])
        np.testing.assert_array_equal(x.numpy(), hash_features(texts, 64))


def test_hashed_features_against_an_independent_count() -> None:
    texts = ["I love it, LOVE it!", "", "can't stop: 42 times"]
    x = hash_features(texts, 32)
    for row, text in zip(x, texts):
        words = {w.strip(",!:").lower() for w in text.split()} - {""}
        buckets = {zlib.crc32(w.encode()) % 32 for w in words}
        assert set(np.flatnonzero(row)) == buckets
        assert math.isclose(float(np.linalg.norm(row)), 1.0 if buckets else 0.0, rel_tol=1e-6)


def test_a_label_outside_0_1_is_named(tmp_path: Path) -> None:
    (tmp_path / "sent140" / "train").mkdir(parents=True)
    write_leaf(tmp_path / "sent140" / "train" / "a.json", {"u1": ([["1", "d", "NO_QUERY", "u1", "good"]], [4])})
    task = build_task(_config(tmp_path, 1))
    with pytest.raises(LeafError, match=r"label 4 is not 0 or 1"):
        task.client_data(0)


def test_fedavg_learns_the_generated_sentiment(tmp_path: Path, monkeypatch) -> None:
    """The example's config, 20 generated users, 10 rounds in memory: test accuracy well above the
    majority-label share of the test tweets (what a constant guess gets)."""
    fakedata.sent140(tmp_path / "data" / "sent140", users=20, mean=60, per_file=8)
    test_y = [int(v) for u in _json_users(tmp_path / "data" / "sent140" / "test").values() for v in u["y"]]
    chance = max(np.mean(test_y), 1 - np.mean(test_y))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(EXAMPLES / "sent140_fedavg.toml",
                      ["run.rounds=10", "run.eval_every=10", "clients.count=20", "clients.per_round=10",
                       "clients.processes=1", "algorithm.lr=2.0", "algorithm.local_epochs=5",
                       'transport.kind="inmemory"'])
    summary, _ = run_inmemory(cfg, tmp_path / "run")
    assert summary["status"] == "completed" and summary["num_clients"] == 20
    assert summary["num_parameters"] == 1024 * 2 + 2
    assert summary["final"]["test_accuracy"] >= chance + 0.15, (summary["final"], chance)
