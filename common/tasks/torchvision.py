"""torchvision's data sets as tasks, where torchvision is installed (`pip install 'fedhop[torchvision]'`).

    [data]
    dataset = "torchvision"
    name = "FashionMNIST"        # MNIST, FashionMNIST, KMNIST, SVHN
    download = false             # true: torchvision downloads into data.data_dir if the files are missing

The files are looked up where torchvision's own classes look (`data.data_dir/MNIST/raw`, ...;
`fedhop data fetch mnist|fashion_mnist --dir DATA_DIR` puts them there).  fedhop never downloads at
run time unless `download = true` says so.  Each set is read through its torchvision class
(`torchvision.datasets.NAME(root, train=..., download=...)`, SVHN: `split=...`) and its documented
`data` / `targets` (SVHN: `labels`) arrays, scaled to [0, 1], shape (N, C, H, W); the training split
is partitioned as any data set, the test split is the test set.

Only sets whose torchvision reader unpickles nothing are offered: torchvision's CIFAR-10/100 read the
pickled "python version" of CIFAR, so `dataset = "cifar10"` / `"cifar100"` (the binary version,
common/data/cifar.py) is the way to CIFAR.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedhop.common.tasks.classification import ClassificationTask

#: name -> (train kwargs, test kwargs, label attribute, classes)
SETS: dict[str, tuple[dict, dict, str, int]] = {
    "MNIST": ({"train": True}, {"train": False}, "targets", 10),
    "FashionMNIST": ({"train": True}, {"train": False}, "targets", 10),
    "KMNIST": ({"train": True}, {"train": False}, "targets", 10),
    "SVHN": ({"split": "train"}, {"split": "test"}, "labels", 10),
}
PICKLED = {"CIFAR10": "cifar10", "CIFAR100": "cifar100"}


@dataclass
class TorchvisionParams:
    """[data] keys of dataset = "torchvision".

    `name`: the torchvision data set class
    `download`: let torchvision download missing files into data.data_dir (needs network access)
    """

    name: str = field(default="MNIST", metadata={"choices": tuple(SETS) + tuple(PICKLED)})
    download: bool = False


def _datasets_module() -> Any:
    try:
        return importlib.import_module("torchvision.datasets")
    except ImportError as exc:
        raise ValueError(f"data.dataset = 'torchvision' needs torchvision (pip install 'fedhop[torchvision]', a "
                         f"build matching the installed torch): {exc}") from None


def as_arrays(ds: Any, labels_attr: str) -> tuple[np.ndarray, np.ndarray]:
    """A torchvision data set's documented `data` and label arrays as float32 (N, C, H, W) in [0, 1]
    and int64 labels.  MNIST-style sets hold (N, H, W) uint8 tensors, SVHN (N, 3, H, W) arrays."""
    data = ds.data.numpy() if hasattr(ds.data, "numpy") else np.asarray(ds.data)
    y = getattr(ds, labels_attr)
    y = y.numpy() if hasattr(y, "numpy") else np.asarray(y)
    if data.ndim == 3:
        data = data[:, None]
    elif data.ndim == 4 and data.shape[-1] in (1, 3) and data.shape[1] not in (1, 3):
        data = data.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(data, dtype=np.float32) / 255.0, y.astype(np.int64).reshape(-1)


def build(cfg: Any, p: TorchvisionParams) -> ClassificationTask:
    from fedhop.common.tasks import make_partition, model_spec
    if p.name in PICKLED:
        raise ValueError(f"data.name = {p.name!r}: torchvision reads CIFAR's pickled python version, which fedhop "
                         f"never unpickles; use data.dataset = {PICKLED[p.name]!r} (the binary version)")
    tvd = _datasets_module()
    cls = getattr(tvd, p.name)
    train_kw, test_kw, labels_attr, n_classes = SETS[p.name]
    root = str(Path(cfg.data.data_dir))
    try:
        train = cls(root, download=p.download, **train_kw)
        test = cls(root, download=p.download, **test_kw)
    except RuntimeError as exc:   # torchvision's "Dataset not found or corrupted" when the files are missing
        raise FileNotFoundError(f"torchvision {p.name}: no usable files under {root} ({exc}); fetch them with "
                                f"`fedhop data fetch` or set data.download = true") from None
    x_tr, y_tr = as_arrays(train, labels_attr)
    x_te, y_te = as_arrays(test, labels_attr)
    parts = make_partition(cfg, y_tr)
    spec = model_spec(cfg, x_tr.shape[1:], n_classes)
    return ClassificationTask(x_tr, y_tr, parts, spec, x_te, y_te, name=f"torchvision:{p.name}",
                              n_classes=n_classes)


REGISTER = {"torchvision": (build, TorchvisionParams)}   # data.dataset -> (builder, its [data] keys)
