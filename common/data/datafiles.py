"""Are a config's data files there?  Checked by `fedhop run` before it starts any process, so a
missing download is one line naming the file and exit status 2 rather than a child's failure.
Only presence is checked here (cheap: no file is read); the readers check the contents."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fedhop.common.data import cifar, leaf
from fedhop.common.data.datasets import MNIST_FILES, _find_idx


def check_data_files(cfg: Any) -> None:
    """FileNotFoundError naming the first missing file of `cfg`'s data set (built-in file-backed
    sets only: mnist, fashion_mnist, cifar10, cifar100, femnist, shakespeare, sent140, torchvision)."""
    name, base = cfg.data.dataset, Path(cfg.data.data_dir)
    if name in cifar.LAYOUTS:
        cifar.find_folder(base, cifar.LAYOUTS[name])
    elif name in ("mnist", "fashion_mnist"):
        sub = "MNIST" if name == "mnist" else "FashionMNIST"
        for stem in ("train_images", "train_labels"):
            if not any(_find_idx(folder, MNIST_FILES[stem]) for folder in (base, base / sub / "raw")):
                raise FileNotFoundError(f"{name}: missing {base / MNIST_FILES[stem]} (or in {base / sub / 'raw'}, "
                                        f"plain or .gz; docs/datasets.md)")
    elif name == "torchvision":
        from fedhop.common.tasks import dataset_params
        params = dataset_params(cfg)
        if not params.download and params.name != "SVHN" and not (base / params.name / "raw").is_dir():
            raise FileNotFoundError(f"torchvision {params.name}: missing {base / params.name / 'raw'} (fedhop data "
                                    f"fetch, or data.download = true; docs/datasets.md)")
    elif name in ("femnist", "shakespeare", "sent140"):
        from fedhop.common.tasks import dataset_params
        from fedhop.common.tasks.leaf import LeafParams, base_folder
        params = dataset_params(cfg)
        folder = base_folder(cfg, params if isinstance(params, LeafParams) else LeafParams(), name)
        train = leaf.find_split(folder, "train")
        if train is None or not any(train.glob("*.json")):
            raise FileNotFoundError(f"{name}: missing LEAF JSON files in {folder / 'train'} (nor "
                                    f"{folder / 'data' / 'train'}; docs/datasets.md)")
