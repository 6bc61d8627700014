"""LEAF JSON reader (common/data/leaf.py) and the femnist / shakespeare tasks (common/tasks/leaf.py)."""
from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
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


def _one_file(base: Path, doc: dict | bytes) -> Path:
    (base / "train").mkdir(parents=True)
    path = base / "train" / "a.json"
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return path


@pytest.mark.parametrize("users, sizes, said", [
    ([{"a": 1}, "u1"], [1, 1], r"users\[0\] is a JSON dict, not a user name"),
    (["u0", "u1"], [None, 1], r"num_samples\[0\] \(user 'u0'\) is null, not a count"),
    (["u0", "u1"], ["abc", 1], r"num_samples\[0\] \(user 'u0'\) is \"abc\", not a count"),
    (["u0", "u1"], [1, -3], r"num_samples\[1\] \(user 'u1'\) is -3, not a count"),
    (["u0", "u1"], [1, 2.5], r"num_samples\[1\] \(user 'u1'\) is 2.5, not a count"),
    (["u0", "u1"], [True, 1], r"num_samples\[0\] \(user 'u0'\) is true, not a count"),
])
def test_an_index_of_values_of_the_wrong_kind_is_a_leaf_error_naming_the_file(tmp_path: Path, users, sizes,
                                                                             said) -> None:
    path = _one_file(tmp_path, {"users": users, "num_samples": sizes, "user_data": {}})
    with pytest.raises(leaf.LeafError, match=rf"^{path}: {said}"):
        leaf.LeafIndex(tmp_path / "train")


def test_json_nested_too_deeply_is_a_leaf_error_not_a_recursion_error(tmp_path: Path) -> None:
    path = _one_file(tmp_path, b'{"users": ' + b"[" * 100_000 + b"]" * 100_000 + b', "num_samples": [1]}')
    with pytest.raises(leaf.LeafError, match=rf"^{path}: cannot read LEAF JSON: maximum recursion depth"):
        leaf.LeafIndex(tmp_path / "train")
    deep = b'{"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}}"
    (tmp_path / "train" / "a.json").write_bytes(deep)
    with pytest.raises(leaf.LeafError, match=r"user_data\['u'\] is not readable JSON"):
        leaf.LeafIndex(tmp_path / "train").load("u")


@pytest.mark.parametrize("x, y, said", [
    ([[0.5] * 784] * 3, [1.5, 2, 3], "labels must be integers, found 1.5"),    # a cast would make it 1
    ([[0.5] * 784] * 3, [[1], [2], [3]], r"labels must be integers, found \[1\]"),   # a reshape would flatten it
    ([[0.5] * 784] * 3, ["a", 2, 3], 'labels must be integers, found "a"'),
    ([[0.5] * 784] * 3, [None, 2, 3], "labels must be integers, found null"),
    ([[0.5] * 784] * 3, [70, 1, 2], "femnist user 'u0' has labels outside 0..61"),
    (5, [1, 2, 3], "'x' and 'y' must be JSON arrays"),
    ([[0.5] * 784, "row", [0.5] * 784], [1, 2, 3], "inputs are not rows of numbers"),
    ([[0.5] * 10] * 3, [1, 2, 3], "expected inputs of 784 values each"),
])
def test_a_users_values_of_the_wrong_kind_are_a_leaf_error_naming_file_and_user(tmp_path: Path, monkeypatch,
                                                                                x, y, said) -> None:
    good = {"x": [[0.25] * 784] * 2, "y": [4, 5]}
    path = _one_file(tmp_path / "data" / "femnist", {"users": ["u0", "u1"], "num_samples": [3, 2],
                                                     "user_data": {"u0": {"x": x, "y": y}, "u1": good}})
    monkeypatch.chdir(tmp_path)
    task = build_task(parse_config(_cfg("femnist", "natural", 2)))
    assert task.client_data(1).tensors[1].tolist() == [4, 5]   # the other user is read as ever
    with pytest.raises(leaf.LeafError, match=r"a\.json: ") as err:
        task.client_data(0)
    assert re.search(said, str(err.value)), str(err.value)
    assert str(err.value).startswith(str(path.relative_to(tmp_path))) and "'u0'" in str(err.value)


FEMNIST_RUN = """
[run]
name = "leaf-bad-user"
rounds = 2
engine = "{engine}"
[algorithm]
name = "fedavg"
lr = 0.1
local_epochs = 1
batch_size = 4
[data]
dataset = "femnist"
partition = "natural"
path = "lf"
[model]
kind = "mlp"
hidden = [8]
[clients]
count = 2
per_round = 2
processes = 1
"""


@pytest.mark.parametrize("engine", ["inprocess", "processes"])
def test_a_user_whose_labels_are_bad_fails_its_rounds_and_the_run_still_writes_its_model(tmp_path: Path,
                                                                                     engine: str) -> None:
    """The bad user fails each round it is sampled in; the final training loss reads every user
    again and fails on it too: the run's model, summary.json and run.db's status are written all
    the same, with `final_error` naming the file and the user (the run had ended with a traceback,
    no summary.json and run.db left at `running`)."""
    rng = np.random.default_rng(1)
    users = _femnist_users(rng, ["u0", "u1"])
    users["u0"] = (users["u0"][0], [99] * len(users["u0"][1]))   # labels beyond FEMNIST's 62 classes
    for split in ("train", "test"):
        (tmp_path / "lf" / split).mkdir(parents=True)
        leaf.write_leaf(tmp_path / "lf" / split / "a.json", users if split == "train" else {"u1": users["u1"]})
    (tmp_path / "exp.toml").write_text(FEMNIST_RUN.format(engine=engine))
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "out", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2 and summary["failures"] == 2
    assert summary["final"] == {} and "lf/train/a.json" in summary["final_error"]
    assert "'u0' has labels outside 0..61" in summary["final_error"]
    assert "final evaluation failed" in done.stdout
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 0
    with sqlite3.connect(tmp_path / "out" / "run.db") as conn:
        assert conn.execute("SELECT status FROM runs").fetchone() == ("completed",)
        kinds = [k for (k,) in conn.execute("SELECT kind FROM events")]
    assert kinds.count("final_evaluation_failed") == 1 and kinds.count("client_failed") == 2
