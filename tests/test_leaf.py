"""LEAF JSON reader (common/data/leaf.py) and the femnist / shakespeare tasks (common/tasks/leaf.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.data import leaf
from fedhop.common.models.text import LEAF_LETTERS
from fedhop.common.tasks import build_task
from fedhop.common.util.rng import numpy_stream
from tests.helpers import data_set_config


def _femnist_users(rng: np.random.Generator, names: list[str]) -> dict[str, tuple[list, list]]:
    out = {}
    for u in names:
        n = int(rng.integers(3, 9))
        out[u] = (np.round(rng.random((n, 784)), 3).tolist(), rng.integers(0, 62, n).tolist())
    return out


def _stage_femnist(base: Path, files: int = 3, per_file: int = 3, seed: int = 0) -> dict[str, tuple[list, list]]:
    """LEAF layout base/train/*.json and base/test/*.json; returns every train user's (x, y)."""
    rng = np.random.default_rng(seed)
    everything: dict[str, tuple[list, list]] = {}
    for split in ("train", "test"):
        (base / split).mkdir(parents=True)
        for f in range(files):
            names = [f"w{f}_{i}" for i in range(per_file)]
            users = _femnist_users(rng, names)
            leaf.write_leaf(base / split / f"all_data_{f}.json", users)
            if split == "train":
                everything.update(users)
    return everything


def _cfg(dataset: str, partition: str, count: int, extra: str = "", kind: str = "mlp") -> str:
    return data_set_config(dataset, partition, count, extra=extra, kind=kind, seed=4)


def test_index_reads_users_and_sizes_in_file_order(tmp_path: Path) -> None:
    users = _stage_femnist(tmp_path / "femnist")
    index = leaf.LeafIndex(tmp_path / "femnist" / "train")
    assert [u.name for u in index.users] == list(users)
    assert [u.num_samples for u in index.users] == [len(y) for _, y in users.values()]


def test_a_user_is_decoded_alone(tmp_path: Path) -> None:
    """Another user's data is never parsed: a corrupt value elsewhere in the file does not matter."""
    doc = ('{"users": ["a", "b", "c"], "num_samples": [2, 1, 1], "hierarchies": [], "user_data": {'
           '"a": {"x": [[1, 2], [3, 4]], "y": [0, 1]}, '
           '"b": {"x": [[not json at all]], "y": [1]}, '
           '"c": {"y": [5], "x": [[7.5, -1e-3]]}}}')
    (tmp_path / "t.json").write_text(doc)
    f = leaf.LeafFile(tmp_path / "t.json")
    assert f.users == ["a", "b", "c"] and f.num_samples == [2, 1, 1]
    assert f.user("a") == ([[1, 2], [3, 4]], [0, 1])
    assert f.user("c") == ([[7.5, -1e-3]], [5])
    with pytest.raises(ValueError):
        f.user("b")


def test_user_data_before_users_and_strings_with_brackets(tmp_path: Path) -> None:
    x = ['a]}"[{\\ x' + " " * 70, "]" * 80]
    doc = {"user_data": {"s": {"x": x, "y": ["}", "\""]}, "t": {"x": [], "y": []}}, "num_samples": [2, 0],
           "users": ["s", "t"]}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    f = leaf.LeafFile(tmp_path / "s.json")
    assert f.users == ["s", "t"]
    assert f.user("s") == (x, ["}", "\""])
    assert f.user("t") == ([], [])
    from fedhop.common.tasks.leaf import KINDS
    xs, ys = KINDS["shakespeare"].decode(*f.user("t"), "t")     # a user with no samples: empty, right shape
    assert xs.shape == (0, 80) and ys.shape == (0,)
    with pytest.raises(ValueError, match=r"user 's': character '\{' is not in the 80-character vocabulary"):
        KINDS["shakespeare"].decode(*f.user("s"), "s")             # LEAF's alphabet has '}' but no '{'


def test_count_mismatch_names_the_file_and_user(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.json").write_text(json.dumps(
        {"users": ["u"], "num_samples": [3], "user_data": {"u": {"x": [[0] * 784], "y": [1]}}}))
    index = leaf.LeafIndex(tmp_path / "train")
    with pytest.raises(ValueError, match=r"a\.json: user 'u' has 1 samples but num_samples says 3"):
        index.load("u")


def test_natural_partition_is_lazy_and_matches_the_files(tmp_path: Path, monkeypatch) -> None:
    users = _stage_femnist(tmp_path / "data" / "femnist")
    monkeypatch.chdir(tmp_path)
    task = build_task(parse_config(_cfg("femnist", "natural", len(users), kind="leaf_cnn")))
    assert task.num_clients == len(users) and task.loaded_clients() == []
    assert [task.num_samples(k) for k in range(task.num_clients)] == [len(y) for _, y in users.values()]
    assert task.loaded_clients() == []                    # sizes come from the index alone
    k = 4
    name = list(users)[k]
    data = task.client_data(k)
    assert task.loaded_clients() == [k]
    assert np.allclose(data.tensors[0].numpy().reshape(-1, 784), np.array(users[name][0], dtype=np.float32))
    assert data.tensors[1].tolist() == users[name][1]
    assert tuple(data.tensors[0].shape[1:]) == (1, 28, 28)
    hist = task.label_histograms()
    expected = np.stack([np.bincount(y, minlength=62) for _, y in users.values()])
    assert np.array_equal(hist, expected)
    metrics = task.evaluate(task.build_model())
    test_total = sum(len(json.loads(p.read_text())["users"]) for p in (tmp_path / "data/femnist/test").glob("*.json"))
    assert test_total == len(users) and 0.0 <= metrics["test_accuracy"] <= 1.0


def test_fraction_and_fewer_clients_are_seeded_samples(tmp_path: Path, monkeypatch) -> None:
    users = list(_stage_femnist(tmp_path / "data" / "femnist"))
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(_cfg("femnist", "natural", 3, extra="fraction = 0.5"))
    task = build_task(cfg)
    kept = np.sort(numpy_stream(4, "data/leaf/users").choice(len(users), 4, replace=False))   # round(0.5 * 9) = 4
    chosen = np.sort(numpy_stream(4, "data/leaf/clients").choice(4, 3, replace=False))
    assert [task.user(k) for k in range(3)] == [users[kept[i]] for i in chosen]
    assert [build_task(cfg).user(k) for k in range(3)] == [task.user(k) for k in range(3)]
    with pytest.raises(ValueError, match="has 9 users"):
        build_task(parse_config(_cfg("femnist", "natural", 10)))


def test_dirichlet_over_pooled_writers(tmp_path: Path, monkeypatch) -> None:
    users = _stage_femnist(tmp_path / "data" / "femnist")
    monkeypatch.chdir(tmp_path)
    task = build_task(parse_config(_cfg("femnist", "iid", 4)))
    total = sum(len(y) for _, y in users.values())
    assert sum(task.num_samples(k) for k in range(4)) == total
    pooled = np.concatenate([y for _, y in users.values()])
    assert np.array_equal(np.sort(task.y.numpy()), np.sort(pooled))


def test_shakespeare_encoding(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(1)
    text = "".join(rng.choice(list(LEAF_LETTERS), 200))
    xs = [text[i:i + 80] for i in range(10)]
    ys = [text[i + 80] for i in range(10)]
    for split in ("train", "test"):
        (tmp_path / "data/shakespeare" / split).mkdir(parents=True)
        leaf.write_leaf(tmp_path / "data/shakespeare" / split / "a.json", {"ROLE": (xs, ys)})
    monkeypatch.chdir(tmp_path)
    task = build_task(parse_config(_cfg("shakespeare", "natural", 1, kind="char_lstm")))
    x, y = task.client_data(0).tensors
    assert x.shape == (10, 80)
    assert x[3].long().tolist() == [LEAF_LETTERS.find(c) for c in xs[3]]
    assert y.tolist() == [LEAF_LETTERS.find(c) for c in ys]
    assert task.build_model()(x).shape == (10, 80)


def test_missing_folder_is_one_line_naming_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"data/femnist/train") as err:
        build_task(parse_config(_cfg("femnist", "natural", 3)))
    assert "\n" not in str(err.value)


def test_user_split_tests_on_every_test_writer(tmp_path: Path, monkeypatch) -> None:
    """LEAF's `-t user`: the test files hold other writers; the test set is all of theirs."""
    rng = np.random.default_rng(5)
    base = tmp_path / "data" / "femnist"
    (base / "train").mkdir(parents=True)
    (base / "test").mkdir()
    leaf.write_leaf(base / "train" / "a.json", _femnist_users(rng, ["w0", "w1"]))
    test_users = _femnist_users(rng, ["t0", "t1", "t2"])
    leaf.write_leaf(base / "test" / "a.json", test_users)
    monkeypatch.chdir(tmp_path)
    task = build_task(parse_config(_cfg("femnist", "natural", 2)))
    x, y = task.data.test_arrays()
    assert y.tolist() == [c for _, ys in test_users.values() for c in ys] and len(x) == len(y)
