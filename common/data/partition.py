"""Partitioners: split sample indices among clients (DESIGN.md section 8: every draw is seeded).

Callers pass a numpy Generator from `common.rng.numpy_stream(seed, "partition")`, so the same
config gives the same partition in every process.  Every function returns one index array per
client, sorted ascending; the arrays are disjoint and together cover all samples.
"""
from __future__ import annotations

import numpy as np


def _check_clients(n_clients: int) -> None:
    if int(n_clients) < 1:
        raise ValueError(f"n_clients must be >= 1, got {n_clients}")


def iid(n_samples: int, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A uniformly random split into `n_clients` parts whose sizes differ by at most 1."""
    _check_clients(n_clients)
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    perm = rng.permutation(int(n_samples))
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, int(n_clients))]


def dirichlet(labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator,
              min_size: int = 2, max_tries: int = 1000, balance: bool = True) -> list[np.ndarray]:
    """Label-skewed split: for each class c, client shares p_c ~ Dir(alpha * 1_K).

    This is the per-class Dirichlet scheme of Hsu et al. (2019) as used in NIID-Bench (Li et
    al. 2022).  The whole draw is repeated until every client holds at least `min_size`
    samples.  With `balance` (NIID-Bench's rule), a client that already holds more than
    n / K samples gets no share of the remaining classes; this keeps client sizes comparable
    and makes small `alpha` with many clients feasible.  Small alpha -> few classes per client;
    alpha -> infinity -> iid.
    """
    _check_clients(n_clients)
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    n, k = int(labels.shape[0]), int(n_clients)
    if min_size * k > n:
        raise ValueError(f"dirichlet partition impossible: {k} clients x min_size {min_size} = "
                         f"{k * min_size} > {n} samples; lower clients.count or data.min_size")
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    cap = n / k
    for _ in range(max(1, int(max_tries))):
        # draw only the cut points first (cheap); shuffle samples once a draw is accepted
        counts = np.zeros((len(by_class), k), dtype=np.int64)
        sizes = np.zeros(k, dtype=np.int64)
        for c, idx_c in enumerate(by_class):
            p = rng.dirichlet(np.full(k, float(alpha)))
            if balance:
                p = p * (sizes < cap)
                total = p.sum()
                p = p / total if total > 0 else np.full(k, 1.0 / k)
            cuts = (np.cumsum(p)[:-1] * len(idx_c)).astype(np.int64)
            counts[c] = np.diff(np.concatenate(([0], cuts, [len(idx_c)])))
            sizes += counts[c]
        if sizes.min() >= min_size:
            parts: list[list[np.ndarray]] = [[] for _ in range(k)]
            for c, idx_c in enumerate(by_class):
                pieces = np.split(rng.permutation(idx_c), np.cumsum(counts[c])[:-1])
                for client, piece in enumerate(pieces):
                    parts[client].append(piece)
            return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
    raise ValueError(f"dirichlet partition: no draw in {max_tries} tries gave every one of {k} clients "
                     f">= {min_size} samples (alpha={alpha}, {n} samples); raise data.alpha, lower "
                     f"data.min_size or clients.count")


def shards(labels: np.ndarray, n_clients: int, classes_per_client: int,
           rng: np.random.Generator) -> list[np.ndarray]:
    """Pathological non-iid split (McMahan et al. 2017): each client gets `classes_per_client`
    single-class shards, hence at most that many distinct labels.

    There are n_clients * classes_per_client shards.  Unlike the sort-and-cut original, shards
    never straddle a class boundary: each class gets a number of shards proportional to its
    size (at least one, largest remainder), and its shuffled samples are split evenly among them.
    """
    _check_clients(n_clients)
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    k, per = int(n_clients), int(classes_per_client)
    if per < 1:
        raise ValueError(f"classes_per_client must be >= 1, got {classes_per_client}")
    classes, counts = np.unique(labels, return_counts=True)
    total_shards = k * per
    if total_shards < len(classes):
        raise ValueError(f"shards partition needs clients.count x data.shards_per_client "
                         f"({k} x {per} = {total_shards}) >= number of classes ({len(classes)})")
    if total_shards > len(labels):
        raise ValueError(f"shards partition: {total_shards} shards but only {len(labels)} samples")
    # shards per class: proportional to class size, each class >= 1, never more than its samples
    quota = counts / counts.sum() * (total_shards - len(classes))
    n_shards = 1 + np.floor(quota).astype(np.int64)
    remainder = quota - np.floor(quota)
    for c in np.argsort(-remainder, kind="stable"):
        if n_shards.sum() >= total_shards:
            break
        n_shards[c] += 1
    while n_shards.sum() < total_shards:  # only when floors + remainders fell short (rounding)
        n_shards[int(np.argmax(counts / n_shards))] += 1
    if np.any(n_shards > counts):
        bad = int(np.flatnonzero(n_shards > counts)[0])
        raise ValueError(f"shards partition: class {classes[bad]} has {counts[bad]} samples but needs "
                         f"{n_shards[bad]} shards; lower clients.count or data.shards_per_client")
    pieces: list[np.ndarray] = []
    for c, s in zip(classes, n_shards):
        idx_c = rng.permutation(np.flatnonzero(labels == c))
        pieces.extend(np.array_split(idx_c, int(s)))
    order = rng.permutation(total_shards)
    return [np.sort(np.concatenate([pieces[j] for j in order[i * per:(i + 1) * per]])).astype(np.int64)
            for i in range(k)]


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], n_classes: int) -> np.ndarray:
    """(n_clients, n_classes) matrix of per-client label counts."""
    labels = np.asarray(labels)
    if len(parts) == 0:
        return np.zeros((0, n_classes), dtype=np.int64)
    return np.stack([np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=n_classes)[:n_classes]
                     for p in parts]).astype(np.int64)


#: every partition by name (`[data] partition`); `natural` needs a data set with natural clients
PARTITIONS = ("iid", "dirichlet", "shards", "natural", "lognormal", "pareto")


def skewed_sizes(n_samples: int, n_clients: int, law: str, rng: np.random.Generator, *,
                 sigma: float = 1.0, shape: float = 1.5, min_size: int = 1) -> np.ndarray:
    """Client sizes that sum to `n_samples`, each >= `min_size`, proportional to a heavy-tailed draw.

    law = "lognormal": w_k ~ LogNormal(0, sigma) (FedProx's device sizes, Li et al. 2020);
    law = "pareto":    w_k ~ 1 + Lomax(shape), a power law of tail index `shape`.
    Every client first gets `min_size`; the other n - K * min_size samples are shared in
    proportion to w (floors, then the largest remainders), so sizes sum to n exactly.
    """
    _check_clients(n_clients)
    k, n = int(n_clients), int(n_samples)
    if min_size * k > n:
        raise ValueError(f"{law} partition impossible: {k} clients x min_size {min_size} = {k * min_size} > "
                         f"{n} samples; lower clients.count or data.min_size")
    if law == "lognormal":
        w = rng.lognormal(0.0, float(sigma), k)
    elif law == "pareto":
        if not shape > 0:
            raise ValueError(f"pareto shape must be > 0, got {shape}")
        w = 1.0 + rng.pareto(float(shape), k)
    else:
        raise ValueError(f"size law {law!r} is not allowed (allowed: lognormal, pareto)")
    spare = n - min_size * k
    quota = w / w.sum() * spare
    sizes = np.floor(quota).astype(np.int64)
    short = spare - int(sizes.sum())
    if short:
        sizes[np.argsort(-(quota - sizes), kind="stable")[:short]] += 1
    return sizes + int(min_size)


def size_skewed(n_samples: int, n_clients: int, law: str, rng: np.random.Generator, *,
                sigma: float = 1.0, shape: float = 1.5, min_size: int = 1) -> list[np.ndarray]:
    """Quantity skew: sizes from `skewed_sizes`, samples assigned uniformly at random (labels
    stay iid in expectation; only how much each client holds differs)."""
    sizes = skewed_sizes(n_samples, n_clients, law, rng, sigma=sigma, shape=shape, min_size=min_size)
    perm = rng.permutation(int(n_samples))
    return [np.sort(p).astype(np.int64) for p in np.split(perm, np.cumsum(sizes)[:-1])]


def natural(groups: np.ndarray) -> list[np.ndarray]:
    """One client per natural group (writer, speaker): client k holds the samples whose group id
    is the k-th smallest id.  Deterministic; needs no seed."""
    groups = np.asarray(groups)
    if groups.ndim != 1:
        raise ValueError(f"groups must be 1-D, got shape {groups.shape}")
    _, inverse = np.unique(groups, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse))[:-1]
    return [np.sort(p).astype(np.int64) for p in np.split(order, bounds)]
