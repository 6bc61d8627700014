"""Partitions by name (common/data/partition.py, [data] partition): quantity skew, natural ids, and the
errors where a partition has no meaning."""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.data import partition as P
from fedhop.common.tasks import build_task
from fedhop.common.util.rng import numpy_stream


def _cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))
    assert all(np.all(np.diff(p) > 0) for p in parts if len(p) > 1)


@pytest.mark.parametrize("law", ["lognormal", "pareto"])
def test_size_skewed_sizes_follow_the_draw(law: str) -> None:
    n, k, min_size = 5000, 40, 3
    parts = P.size_skewed(n, k, law, np.random.default_rng(7), sigma=1.2, shape=1.1, min_size=min_size)
    _cover(parts, n)
    sizes = np.array([len(p) for p in parts])
    # the weights, drawn again from the same stream as the rule says (first draw of the generator)
    rng = np.random.default_rng(7)
    w = rng.lognormal(0.0, 1.2, k) if law == "lognormal" else 1.0 + rng.pareto(1.1, k)
    expected = min_size + w / w.sum() * (n - k * min_size)
    assert sizes.min() >= min_size
    assert np.all(np.abs(sizes - expected) < 1.0)
    assert sizes.max() > 3 * np.median(sizes)          # skewed, not near-equal as iid
    again = P.size_skewed(n, k, law, np.random.default_rng(7), sigma=1.2, shape=1.1, min_size=min_size)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_size_skewed_refuses_impossible_minimum() -> None:
    with pytest.raises(ValueError, match="impossible"):
        P.size_skewed(10, 6, "lognormal", np.random.default_rng(0), min_size=2)


def test_natural_groups_one_client_per_id() -> None:
    groups = np.array(["b", "a", "c", "a", "b", "b"])
    parts = P.natural(groups)
    assert [p.tolist() for p in parts] == [[1, 3], [0, 4, 5], [2]]


def _digits(partition: str, extra: str = "", count: int = 12) -> str:
    return f"""
[run]
seed = 3
[data]
dataset = "digits"
partition = "{partition}"
{extra}
[clients]
count = {count}
"""


def test_lognormal_partition_through_the_config_is_seeded() -> None:
    cfg = parse_config(_digits("lognormal", "skew_sigma = 1.5"))
    task = build_task(cfg)
    sizes = [len(p) for p in task.parts]
    n = sum(sizes)
    rng = numpy_stream(3, "partition")
    w = rng.lognormal(0.0, 1.5, 12)
    expected = cfg.data.min_size + w / w.sum() * (n - 12 * cfg.data.min_size)
    assert np.all(np.abs(np.array(sizes) - expected) < 1.0)
    assert [len(p) for p in build_task(parse_config(_digits("lognormal", "skew_sigma = 1.5"))).parts] == sizes


def test_natural_on_a_set_without_writers_is_refused() -> None:
    with pytest.raises(ValueError, match="no natural clients"):
        build_task(parse_config(_digits("natural")))


def test_unknown_partition_names_the_choices() -> None:
    from fedhop.common.config import ConfigError
    with pytest.raises(ConfigError, match="pareto"):
        parse_config(_digits("zipf"))


def test_no_data_set_key_is_shadowed_by_a_new_common_data_key():
    """A data set's own [data] key that a common [data] key also names never reaches the data set
    (the common key takes it).  The clashes below predate this test and are documented as known
    wrong; any other is a mistake (the partition's skew keys once took crossdevice's size_sigma)."""
    import dataclasses

    from fedhop.common.config.schema import DataConfig
    from fedhop.common.tasks import builtin_datasets, dataset_params_class
    common = {f.name for f in dataclasses.fields(DataConfig)}
    known = {("crossdevice", "alpha"), ("logreg", "alpha"), ("npz", "standardize")}
    clashes = set()
    for name in builtin_datasets():
        cls = dataset_params_class(name)
        if cls is not None:
            clashes |= {(name, f.name) for f in dataclasses.fields(cls) if f.name in common}
    assert clashes <= known, sorted(clashes - known)
