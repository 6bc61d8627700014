"""Generated files in the real formats of the federated benchmarks (LEAF JSON, CIFAR binary), for
tests, the examples' CI runs and memory measurements (deploy/bench/leaf_memory.py).  Random content, real layouts and sizes.

    python -m fedhop.common.data.fakedata femnist DIR [--writers N] [--samples MEAN] [--per-file N]
    python -m fedhop.common.data.fakedata shakespeare DIR [--roles N] [--samples MEAN]
    python -m fedhop.common.data.fakedata femnist_niid DIR [--writers N] [--samples MEAN]   # learnable, non-IID
    python -m fedhop.common.data.fakedata sent140 DIR [--writers N] [--samples MEAN]
    python -m fedhop.common.data.fakedata cifar10 DIR [--per-batch N]

FEMNIST sizes follow LEAF's published statistics (Caldas et al. 2018, Table 1: 226.83 samples per
writer on average, standard deviation 88.94); files hold `per_file` writers each (LEAF's files hold
about 100); 10% of each writer's samples go to test/.

`femnist` and `shakespeare` hold noise (for sizes and memory); `femnist_niid`, `sent140` and `cifar10`
hold a signal a model can learn, so a few rounds of training must beat chance on them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fedhop.common.data.cifar import write_cifar
from fedhop.common.models.text import LEAF_LETTERS
from fedhop.common.util.cliparser import ArgumentParser

FEMNIST_MEAN, FEMNIST_STD = 226.83, 88.94


def _sizes(rng: np.random.Generator, n: int, mean: float, std: float, low: int = 4) -> np.ndarray:
    return np.maximum(np.round(rng.normal(mean, std, n)), low).astype(np.int64)


def _write_split(folder: Path, name: str, users: list[str], sizes: list[int], rows) -> None:
    """One LEAF file, written piece by piece (a FEMNIST file is ~80 MB of text)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "w") as fh:
        fh.write('{"users": ' + json.dumps(users) + ', "num_samples": ' + json.dumps([int(s) for s in sizes])
                 + ', "user_data": {')
        for i, (u, n) in enumerate(zip(users, sizes)):
            xs, ys = rows(u, int(n))
            fh.write(("" if i == 0 else ", ") + json.dumps(u) + ': {"x": [' + ", ".join(xs) + '], "y": '
                     + json.dumps(ys) + "}")
        fh.write("}}")


def femnist(folder: str | Path, writers: int = 20, mean: float = FEMNIST_MEAN, std: float = FEMNIST_STD,
            per_file: int = 100, seed: int = 0) -> None:
    """LEAF FEMNIST layout: train/ and test/ files of 28x28 images (784 values, 2 decimals), 62 classes."""
    rng = np.random.default_rng(seed)
    pool = [", ".join(f"{v:.2f}" for v in rng.random(784)) for _ in range(64)]
    pool = ["[" + r + "]" for r in pool]
    sizes = _sizes(rng, writers, mean, std)
    n_test = np.maximum(sizes // 10, 1)
    names = [f"f{i:04d}_{i % 97:02d}" for i in range(writers)]

    def rows(_u: str, n: int):
        return [pool[j] for j in rng.integers(0, len(pool), n)], rng.integers(0, 62, n).tolist()

    base = Path(folder)
    for f, start in enumerate(range(0, writers, per_file)):
        block = slice(start, min(start + per_file, writers))
        _write_split(base / "train", f"all_data_{f}_niid_0_keep_0_train_9.json", names[block],
                     (sizes - n_test)[block].tolist(), rows)
        _write_split(base / "test", f"all_data_{f}_niid_0_keep_0_test_9.json", names[block],
                     n_test[block].tolist(), rows)


def shakespeare(folder: str | Path, roles: int = 10, mean: float = 60.0, per_file: int = 50, seed: int = 0) -> None:
    """LEAF Shakespeare layout: 80-character windows and the next character, per speaking role."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(LEAF_LETTERS))
    sizes = _sizes(rng, roles, mean, mean / 2, low=5)
    n_test = np.maximum(sizes // 10, 1)
    names = [f"THE_PLAY_ROLE{i}" for i in range(roles)]

    def rows(_u: str, n: int):
        text = "".join(rng.choice(letters, n + 80))
        return [json.dumps(text[i:i + 80]) for i in range(n)], [text[i + 80] for i in range(n)]

    base = Path(folder)
    for f, start in enumerate(range(0, roles, per_file)):
        block = slice(start, min(start + per_file, roles))
        _write_split(base / "train", f"all_data_{f}_train.json", names[block], (sizes - n_test)[block].tolist(), rows)
        _write_split(base / "test", f"all_data_{f}_test.json", names[block], n_test[block].tolist(), rows)


def femnist_niid(folder: str | Path, writers: int = 20, mean: float = 60.0, classes: int = 10, alpha: float = 0.3,
                 signal: float = 0.15, per_file: int = 100, seed: int = 0) -> None:
    """FEMNIST's layout with a learnable, writer-heterogeneous signal (what natural FEMNIST is like):
    class c is a fixed binary 28x28 pattern (classes c < `classes` of FEMNIST's 62 are used); each
    writer has its own style (a fixed additive offset, std 0.25, on every image it writes) and its own
    label mix q_w ~ Dir(alpha 1_classes); each image is 0.3 + signal * pattern + style + N(0, 0.35^2)
    noise, clipped to [0, 1] (`signal` sets how hard the task is).  Sizes ~ N(mean, mean * 88.94 /
    226.83) as LEAF's; 10% of each writer's samples (at least one) go to test/, from the same writer's
    distribution (LEAF's `-t sample`)."""
    rng = np.random.default_rng(seed)
    patterns = (rng.random((classes, 784)) < 0.3).astype(np.float64)
    styles = rng.normal(0.0, 0.25, (writers, 784))
    mixes = rng.dirichlet(np.full(classes, alpha), writers)
    sizes = _sizes(rng, writers, mean, mean * FEMNIST_STD / FEMNIST_MEAN, low=6)
    n_test = np.maximum(sizes // 10, 1)
    names = [f"f{i:04d}_{i % 97:02d}" for i in range(writers)]
    position = {u: i for i, u in enumerate(names)}

    def rows(u: str, n: int):
        w = position[u]
        labels = rng.choice(classes, n, p=mixes[w])
        images = np.clip(0.3 + signal * patterns[labels] + styles[w] + rng.normal(0.0, 0.35, (n, 784)), 0.0, 1.0)
        return ["[" + ", ".join(f"{v:.2f}" for v in img) + "]" for img in images], labels.tolist()

    base = Path(folder)
    for f, start in enumerate(range(0, writers, per_file)):
        block = slice(start, min(start + per_file, writers))
        _write_split(base / "train", f"all_data_{f}_niid_0_keep_0_train_9.json", names[block],
                     (sizes - n_test)[block].tolist(), rows)
        _write_split(base / "test", f"all_data_{f}_niid_0_keep_0_test_9.json", names[block],
                     n_test[block].tolist(), rows)


#: sentiment words of the generated Sent140 tweets (label 1 / label 0) and filler words
SENT140_POSITIVE = ("love", "great", "happy", "awesome", "thanks", "good", "fun", "nice", "best", "yay")
SENT140_NEGATIVE = ("hate", "sad", "bad", "awful", "sick", "tired", "miss", "sorry", "worst", "ugh")
SENT140_FILLER = ("the", "a", "i", "to", "my", "is", "it", "day", "today", "work", "going", "now", "just", "so",
                  "at", "with", "this", "you", "and", "lol", "u", "get", "back", "home", "night", "morning")


def sent140(folder: str | Path, users: int = 20, mean: float = 30.0, noise: float = 0.15, per_file: int = 100,
            seed: int = 0) -> None:
    """LEAF Sent140 layout: user_data[u] = {"x": [[tweet_id, date, query, user, text], ...], "y": [0|1, ...]}.
    Each user has its own share of positive tweets (~ Beta(0.5, 0.5): most users lean one way, as
    real users do); a tweet is 4-10 filler words with 1-3 sentiment words of its label mixed in, each
    of them from the other label's list with probability `noise`.  10% of each user's tweets (at
    least one) go to test/."""
    rng = np.random.default_rng(seed)
    shares = rng.beta(0.5, 0.5, users)
    sizes = _sizes(rng, users, mean, mean / 2, low=4)
    n_test = np.maximum(sizes // 10, 1)
    names = [f"user{i:05d}" for i in range(users)]
    position = {u: i for i, u in enumerate(names)}
    counter = iter(range(1_467_810_000, 2_000_000_000))

    def tweet(label: int) -> str:
        words = list(rng.choice(SENT140_FILLER, int(rng.integers(4, 11))))
        for _ in range(int(rng.integers(1, 4))):
            own = label if rng.random() >= noise else 1 - label
            words.insert(int(rng.integers(0, len(words) + 1)),
                         str(rng.choice(SENT140_POSITIVE if own == 1 else SENT140_NEGATIVE)))
        return " ".join(words)

    def rows(u: str, n: int):
        labels = (rng.random(n) < shares[position[u]]).astype(int).tolist()
        xs = [json.dumps([str(next(counter)), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", u, tweet(y)])
              for y in labels]
        return xs, labels

    base = Path(folder)
    for f, start in enumerate(range(0, users, per_file)):
        block = slice(start, min(start + per_file, users))
        _write_split(base / "train", f"all_data_{f}_niid_0_keep_0_train_9.json", names[block],
                     (sizes - n_test)[block].tolist(), rows)
        _write_split(base / "test", f"all_data_{f}_niid_0_keep_0_test_9.json", names[block],
                     n_test[block].tolist(), rows)


def cifar10(folder: str | Path, per_batch: int = 40, n_test: int = 50, seed: int = 0) -> None:
    """CIFAR-10's binary layout (cifar-10-batches-bin/data_batch_1..5.bin, test_batch.bin): class c's
    images are noise around a per-class mean colour, so a model can learn them."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(30, 225, (10, 3))
    out = Path(folder) / "cifar-10-batches-bin"
    out.mkdir(parents=True, exist_ok=True)

    def batch(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, 10, n)
        noise = rng.normal(0, 40, (n, 3, 32, 32))
        return labels, np.clip(colours[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)

    for i in range(1, 6):
        write_cifar(out / f"data_batch_{i}.bin", *batch(per_batch))
    write_cifar(out / "test_batch.bin", *batch(n_test))


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m fedhop.common.data.fakedata", description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("femnist", "femnist_niid", "sent140", "shakespeare", "cifar10"))
    ap.add_argument("folder")
    ap.add_argument("--writers", type=int, default=20, help="femnist writers / shakespeare roles / sent140 users")
    ap.add_argument("--samples", type=float, default=0.0, help="mean samples per writer (0: the kind's default)")
    ap.add_argument("--per-file", type=int, default=100, help="writers per LEAF file")
    ap.add_argument("--per-batch", type=int, default=40, help="cifar10: images per training batch file")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.kind == "femnist":
        femnist(a.folder, a.writers, a.samples or FEMNIST_MEAN, (a.samples or FEMNIST_MEAN) * FEMNIST_STD / FEMNIST_MEAN,
                a.per_file, a.seed)
    elif a.kind == "femnist_niid":
        femnist_niid(a.folder, a.writers, a.samples or 60.0, per_file=a.per_file, seed=a.seed)
    elif a.kind == "sent140":
        sent140(a.folder, a.writers, a.samples or 30.0, per_file=a.per_file, seed=a.seed)
    elif a.kind == "shakespeare":
        shakespeare(a.folder, a.writers, a.samples or 60.0, a.per_file, a.seed)
    else:
        cifar10(a.folder, a.per_batch, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
