"""data.dataset = "torchvision": through torchvision's own classes where it is installed (the real test
skips otherwise), and against a stand-in module with torchvision's documented constructor and
attributes (MNIST(root, train=, download=) with .data (N, 28, 28) uint8 and .targets), which always runs."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.data.datasets import write_idx
from fedhop.common.tasks import build_task


def _cfg(data_dir: Path, name: str = "MNIST", extra: str = "") -> object:
    return parse_config(f'[data]\ndataset = "torchvision"\nname = "{name}"\npartition = "iid"\n'
                        f'data_dir = "{data_dir}"\n{extra}\n[model]\nkind = "logreg"\n[clients]\ncount = 4\n')


@pytest.fixture
def fake_torchvision(monkeypatch):
    """A `torchvision.datasets` whose MNIST serves fixed arrays and records its calls."""
    rng = np.random.default_rng(5)
    arrays = {True: (rng.integers(0, 256, (40, 28, 28), dtype=np.uint8), rng.integers(0, 10, 40)),
              False: (rng.integers(0, 256, (12, 28, 28), dtype=np.uint8), rng.integers(0, 10, 12))}
    calls: list[tuple] = []

    class MNIST:
        def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
            calls.append((root, train, download))
            if not (Path(root) / "MNIST" / "raw").is_dir() and not download:
                raise RuntimeError("Dataset not found. You can use download=True to download it")
            x, y = arrays[train]
            self.data, self.targets = torch.from_numpy(x), torch.from_numpy(y)

    datasets = types.ModuleType("torchvision.datasets")
    datasets.MNIST = MNIST
    package = types.ModuleType("torchvision")
    package.datasets = datasets
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", datasets)
    return arrays, calls


def test_arrays_partition_and_flags_through_the_torchvision_api(tmp_path: Path, fake_torchvision) -> None:
    arrays, calls = fake_torchvision
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    task = build_task(_cfg(tmp_path))
    assert calls == [(str(tmp_path), True, False), (str(tmp_path), False, False)]   # never downloads unasked
    x, y = arrays[True]
    assert np.allclose(task.x.numpy(), x[:, None].astype(np.float32) / 255.0)
    assert np.array_equal(task.y.numpy(), y)
    assert len(task.y_test) == 12 and task.num_clients == 4
    assert sorted(np.concatenate([p.numpy() for p in task.parts]).tolist()) == list(range(40))


def test_missing_files_name_the_folder_and_download_is_passed_on(tmp_path: Path, fake_torchvision) -> None:
    _, calls = fake_torchvision
    with pytest.raises(FileNotFoundError, match=r"torchvision MNIST: no usable files under .*fedhop data fetch"):
        build_task(_cfg(tmp_path))
    build_task(_cfg(tmp_path, extra="download = true"))
    assert calls[-1][2] is True


def test_cifar_through_torchvision_is_refused_for_its_pickles(tmp_path: Path, fake_torchvision) -> None:
    with pytest.raises(ValueError, match=r"never unpickles; use data.dataset = 'cifar10'"):
        build_task(_cfg(tmp_path, "CIFAR10"))


def test_without_torchvision_the_error_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)     # import fails as if not installed
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    with pytest.raises(ValueError, match=r"fedhop\[torchvision\]"):
        build_task(_cfg(tmp_path))


def test_real_torchvision_reads_the_same_idx_files_as_fedhop(tmp_path: Path) -> None:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:   # absent, or a build that does not match the installed torch
        pytest.skip(f"torchvision not usable here: {exc}")
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8), rng.integers(0, 10, 30).astype(np.uint8)
    write_idx(raw / "train-images-idx3-ubyte", x)
    write_idx(raw / "train-labels-idx1-ubyte", y)
    write_idx(raw / "t10k-images-idx3-ubyte", x[:9])
    write_idx(raw / "t10k-labels-idx1-ubyte", y[:9])
    via_tv = build_task(_cfg(tmp_path))
    own = build_task(parse_config(f'[data]\ndataset = "mnist"\npartition = "iid"\ndata_dir = "{tmp_path}"\n'
                                  f'[model]\nkind = "logreg"\n[clients]\ncount = 4\n'))
    assert np.allclose(via_tv.x.numpy().reshape(30, -1), own.x.numpy().reshape(30, -1))
    assert np.array_equal(via_tv.y.numpy(), own.y.numpy()) and len(via_tv.y_test) == 9


def test_fedhop_run_without_the_files_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    from fedhop.deploy.launch.launcher import run_local
    (tmp_path / "c.toml").write_text('[data]\ndataset = "torchvision"\nname = "FashionMNIST"\npartition = "iid"\n'
                                     '[model]\nkind = "logreg"\n[clients]\ncount = 2\n')
    monkeypatch.chdir(tmp_path)
    assert run_local("c.toml", [], "out", quiet=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data/FashionMNIST/raw" in err[0] and "fedhop data fetch" in err[0]
    assert not (tmp_path / "out").exists()
