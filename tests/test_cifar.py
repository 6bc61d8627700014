"""CIFAR-10/100 binary batches (common/data/cifar.py), their tasks, and Fashion-MNIST from IDX files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.data import cifar
from fedhop.common.data.datasets import write_idx
from fedhop.common.tasks import build_task
from tests.helpers import data_set_config


def _stage_cifar10(base: Path, per_batch: int = 30, n_test: int = 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    folder = base / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    labels, images = [], []
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        n = n_test if name == "test_batch.bin" else per_batch
        y = rng.integers(0, 10, n)
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        cifar.write_cifar(folder / name, y, x)
        if name != "test_batch.bin":
            labels.append(y)
            images.append(x)
    return np.concatenate(labels), np.concatenate(images)


def _cfg(dataset: str, partition: str, count: int = 6, extra: str = "") -> str:
    return data_set_config(dataset, partition, count, extra=extra, kind="cifar_cnn", seed=2)


def test_records_are_one_label_byte_and_3072_pixels(tmp_path: Path) -> None:
    labels, images = _stage_cifar10(tmp_path)
    raw = (tmp_path / "cifar-10-batches-bin" / "data_batch_2.bin").read_bytes()
    assert len(raw) == 30 * 3073 and raw[3073] == labels[31]
    train, test = cifar.open_cifar(tmp_path, "cifar10")
    assert len(train) == 150 and len(test) == 20
    assert np.array_equal(train.labels, labels)
    rows = np.array([149, 0, 77, 31])
    assert np.array_equal(train.images(rows), images[rows])


def test_cifar100_uses_the_fine_label(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    rng = np.random.default_rng(3)
    fine, coarse = rng.integers(0, 100, 12), rng.integers(0, 20, 12)
    x = rng.integers(0, 256, (12, 3, 32, 32), dtype=np.uint8)
    cifar.write_cifar(folder / "train.bin", fine, x, coarse=coarse)
    cifar.write_cifar(folder / "test.bin", fine[:4], x[:4], coarse=coarse[:4])
    assert (folder / "train.bin").read_bytes()[3074:3076] == bytes([coarse[1], fine[1]])
    train, _ = cifar.open_cifar(tmp_path, "cifar100")
    assert np.array_equal(train.labels, fine) and np.array_equal(train.images(np.arange(12)), x)


def test_truncated_batch_and_missing_file_are_named(tmp_path: Path) -> None:
    _stage_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-bin"
    (folder / "data_batch_3.bin").write_bytes(b"\0" * 3000)
    with pytest.raises(ValueError, match=r"data_batch_3\.bin: 3000 bytes"):
        cifar.open_cifar(tmp_path, "cifar10")
    (folder / "test_batch.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing .*test_batch\.bin"):
        cifar.open_cifar(tmp_path, "cifar10")


def test_dirichlet_task_histograms_and_standardised_pixels(tmp_path: Path, monkeypatch) -> None:
    labels, images = _stage_cifar10(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    task = build_task(parse_config(_cfg("cifar10", "dirichlet", extra="alpha = 0.3")))
    assert task.loaded_clients() == []
    hist = task.label_histograms()
    expected = np.stack([np.bincount(labels[p.numpy()], minlength=10) for p in task.parts])
    assert np.array_equal(hist, expected) and hist.sum() == 150
    x, y = task.client_data(2).tensors
    assert task.loaded_clients() == [2]
    idx = task.parts[2].numpy()
    pix = images.astype(np.float64) / 255.0
    mean, std = pix.mean(axis=(0, 2, 3)), pix.std(axis=(0, 2, 3))
    want = (pix[idx] - mean[None, :, None, None]) / std[None, :, None, None]
    assert np.allclose(x.numpy(), want, atol=1e-5) and np.array_equal(y.numpy(), labels[idx])
    assert set(task.evaluate(task.build_model())) == {"test_accuracy", "test_loss"}


def test_natural_partition_on_cifar_is_refused(tmp_path: Path, monkeypatch) -> None:
    _stage_cifar10(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="'cifar10' has no natural clients"):
        build_task(parse_config(_cfg("cifar10", "natural")))


def test_fashion_mnist_from_idx_files(tmp_path: Path, monkeypatch) -> None:
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, 40).astype(np.uint8)
    write_idx(raw / "train-images-idx3-ubyte.gz", x)
    write_idx(raw / "train-labels-idx1-ubyte.gz", y)
    write_idx(raw / "t10k-images-idx3-ubyte", x[:10])
    write_idx(raw / "t10k-labels-idx1-ubyte", y[:10])
    monkeypatch.chdir(tmp_path)
    task = build_task(parse_config(_cfg("fashion_mnist", "iid", count=4)))
    assert np.allclose(task.x.numpy().reshape(40, 28, 28), x / 255.0)
    assert np.array_equal(task.y.numpy(), y) and len(task.y_test) == 10


def test_run_with_a_missing_download_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    from fedhop.deploy.launch.launcher import run_local
    (tmp_path / "c.toml").write_text(_cfg("cifar10", "dirichlet"))
    monkeypatch.chdir(tmp_path)
    assert run_local("c.toml", [], "out", quiet=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data/cifar-10-batches-bin/data_batch_1.bin" in err[0]
    assert not (tmp_path / "out").exists()        # refused before any run folder or process
