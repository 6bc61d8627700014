"""CIFAR-10, CIFAR-100 and Fashion-MNIST as tasks.

`[data] dataset = "cifar10"` / `"cifar100"`: the binary files under `data.data_dir` (common/data/cifar.py).
Every process reads the labels (one byte per image) to draw the same partition; a client's pixels are
read from the files (its records only) the first time its data is needed, so a client process holds its
own clients' images only, and the test set is read on the first evaluation (the server's).
Pixels are scaled to [0, 1] and, with `data.standardize`, normalised per channel with the training
set's mean and standard deviation.  CIFAR has no natural clients: partition = "natural" is refused.

`[data] dataset = "fashion_mnist"`: IDX files as for MNIST (common/data/datasets.py), read whole.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedhop.common.data import cifar, datasets
from fedhop.common.tasks.base import ClientData
from fedhop.common.tasks.classification import ClassificationTask


class CifarTask(ClassificationTask):
    """A partition of CIFAR's training records; pixels read per client on first use."""

    def __init__(self, name: str, train: cifar.CifarRecords, test: cifar.CifarRecords, parts: list[np.ndarray],
                 spec: Any, standardize: bool) -> None:
        self.train_records, self.test_records = train, test
        self.mean: np.ndarray
        self.std: np.ndarray
        self.mean, self.std = train.channel_stats() if standardize else (np.zeros(3, np.float32),
                                                                          np.ones(3, np.float32))
        self._loaded: dict[int, ClientData] = {}
        self._test: tuple[torch.Tensor, torch.Tensor] | None = None
        n_classes = train.layout.n_classes
        super().__init__(np.zeros((0, 3, 32, 32), np.float32), np.zeros(0, np.int64), [], spec, name=name,
                         n_classes=n_classes)
        self.parts = [torch.as_tensor(np.asarray(p, dtype=np.int64)) for p in parts]
        self.labels = torch.from_numpy(train.labels)

    def _pixels(self, records: cifar.CifarRecords, rows: np.ndarray) -> torch.Tensor:
        x = records.images(rows).astype(np.float32)       # in place from here: one float32 copy at a time
        x /= 255.0
        x -= self.mean.reshape(1, 3, 1, 1)
        x /= self.std.reshape(1, 3, 1, 1)
        return torch.from_numpy(x)

    def num_samples(self, client_id: int) -> int:
        return int(self.parts[client_id].numel())

    def num_rows(self, client_id: int) -> int:
        return self.num_samples(client_id)

    def client_data(self, client_id: int) -> ClientData:
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"{self.name}: client id {client_id} out of range 0..{self.num_clients - 1}")
        data = self._loaded.get(client_id)
        if data is None:
            idx = self.parts[client_id]
            data = ClientData(tensors=(self._pixels(self.train_records, idx.numpy()), self.labels[idx]),
                              num_samples=int(idx.numel()))
            self._loaded[client_id] = data
        return data

    def loaded_clients(self) -> list[int]:
        return sorted(self._loaded)

    def label_histograms(self) -> np.ndarray:
        return np.stack([np.bincount(self.labels[p].numpy(), minlength=self.n_classes) for p in self.parts])

    def train_loss(self, model: torch.nn.Module) -> float:
        """Sample-weighted training loss over every client, one client's pixels at a time."""
        total, weight = 0.0, 0
        for p in self.parts:
            if p.numel():
                total += float(self._per_sample(model, self._pixels(self.train_records, p.numpy()),
                                                self.labels[p]).sum())
                weight += int(p.numel())
        return total / max(weight, 1)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        if self._test is None:
            rows = np.arange(len(self.test_records))
            self._test = (self._pixels(self.test_records, rows), torch.from_numpy(self.test_records.labels))
        return self.metrics(model, *self._test, prefix="test")


def _build_cifar(cfg: Any, _params: Any) -> ClassificationTask:
    from fedhop.common.tasks import make_partition, model_spec
    name = cfg.data.dataset
    train, test = cifar.open_cifar(cfg.data.data_dir, name)
    parts = make_partition(cfg, train.labels)
    spec = model_spec(cfg, (3, 32, 32), train.layout.n_classes)
    return CifarTask(name, train, test, parts, spec, bool(cfg.data.standardize))


def _build_fashion(cfg: Any, _params: Any) -> ClassificationTask:
    from fedhop.common.tasks import idx_task
    return idx_task(cfg, datasets.load_fashion_mnist(cfg.data.data_dir), "fashion_mnist")


REGISTER = {"cifar10": (_build_cifar, None), "cifar100": (_build_cifar, None),   # data.dataset -> (builder, keys)
            "fashion_mnist": (_build_fashion, None)}
