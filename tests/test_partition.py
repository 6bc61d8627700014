"""Partitioners: coverage, disjointness, determinism, skew and label limits."""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.common.data import partition as P
from fedhop.common.data.datasets import load_digits
from fedhop.common.util.rng import numpy_stream

LABELS = load_digits()[1]
N_CLASSES = 10


def _split(kind: str, seed: int, n_clients: int = 10, labels: np.ndarray = LABELS) -> list[np.ndarray]:
    rng = numpy_stream(seed, "partition")
    if kind == "iid":
        return P.iid(len(labels), n_clients, rng)
    if kind == "dirichlet":
        return P.dirichlet(labels, n_clients, 0.3, rng)
    return P.shards(labels, n_clients, 2, rng)


def _mean_tv_to_global(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance of client label distributions to the global one."""
    hist = P.label_histograms(labels, parts, N_CLASSES).astype(float)
    q = hist / hist.sum(1, keepdims=True)
    g = np.bincount(labels, minlength=N_CLASSES) / len(labels)
    return float(0.5 * np.abs(q - g).sum(1).mean())


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards"])
@pytest.mark.parametrize("n_clients", [1, 7, 50])
def test_parts_cover_all_samples_disjointly_and_sorted(kind: str, n_clients: int) -> None:
    if kind == "shards" and n_clients * 2 < N_CLASSES:  # cannot cover 10 classes with 2 labels each
        with pytest.raises(ValueError, match="number of classes"):
            _split(kind, 0, n_clients)
        return
    parts = _split(kind, 0, n_clients)
    assert len(parts) == n_clients
    assert sum(len(p) for p in parts) == len(LABELS)
    joined = np.concatenate(parts)
    assert np.array_equal(np.sort(joined), np.arange(len(LABELS)))  # disjoint + complete
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards"])
def test_same_seed_same_partition_other_seed_differs(kind: str) -> None:
    a, b, c = _split(kind, 3), _split(kind, 3), _split(kind, 4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_sizes_differ_by_at_most_one() -> None:
    parts = P.iid(103, 10, numpy_stream(0, "partition"))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 103


def test_dirichlet_small_alpha_is_much_more_skewed_than_large_alpha() -> None:
    skewed = np.mean([_mean_tv_to_global(LABELS, P.dirichlet(LABELS, 10, 0.05, numpy_stream(s, "partition")))
                      for s in range(3)])
    near_iid = np.mean([_mean_tv_to_global(LABELS, P.dirichlet(LABELS, 10, 100.0, numpy_stream(s, "partition")))
                        for s in range(3)])
    assert skewed > 0.6
    assert near_iid < 0.1
    iid_tv = _mean_tv_to_global(LABELS, P.iid(len(LABELS), 10, numpy_stream(0, "partition")))
    assert near_iid < 3 * iid_tv + 0.05


def test_dirichlet_respects_min_size_and_rejects_impossible() -> None:
    parts = P.dirichlet(LABELS, 100, 0.1, numpy_stream(0, "partition"), min_size=3, max_tries=10_000)
    assert min(len(p) for p in parts) >= 3
    with pytest.raises(ValueError, match="impossible"):
        P.dirichlet(LABELS[:20], 10, 0.5, numpy_stream(0, "partition"), min_size=3)
    with pytest.raises(ValueError, match="tries"):
        P.dirichlet(LABELS, 200, 0.01, numpy_stream(0, "partition"), min_size=5, max_tries=3)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_give_at_most_k_labels(k: int) -> None:
    parts = P.shards(LABELS, 20, k, numpy_stream(1, "partition"))
    hist = P.label_histograms(LABELS, parts, N_CLASSES)
    labels_per_client = (hist > 0).sum(1)
    assert labels_per_client.max() <= k
    assert labels_per_client.min() >= 1
    if k == 1:  # 20 single-class clients over 10 classes: every class is used
        assert np.all(hist.sum(0) == np.bincount(LABELS))


def test_shards_rejects_too_few_shards_for_classes() -> None:
    with pytest.raises(ValueError, match="number of classes"):
        P.shards(LABELS, 3, 2, numpy_stream(0, "partition"))


def test_label_histograms_match_direct_count() -> None:
    parts = _split("dirichlet", 5)
    hist = P.label_histograms(LABELS, parts, N_CLASSES)
    assert hist.shape == (10, N_CLASSES)
    assert np.array_equal(hist.sum(1), [len(p) for p in parts])
    for i, p in enumerate(parts):
        for c in range(N_CLASSES):
            assert hist[i, c] == int(np.sum(LABELS[p] == c))
