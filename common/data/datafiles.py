"""Are a config's data files there?  Checked by `fedhop run` before it starts any process, so a
missing download is one line naming the file and exit status 2 rather than a child's failure.
Only presence is checked here (cheap: no file is read); the readers check the contents."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fedhop.common.data import cifar, leaf
from fedhop.common.data.datasets import MNIST_FILES, _find_idx

LEAF_FLAGS = {"femnist": "-k 0", "shakespeare": "-k 0", "sent140": "-k 3"}   # LEAF's READMEs' examples


def leaf_recipe(name: str, folder: Path) -> str:
    """How to make a LEAF data set's JSON files (no archive to download: LEAF's scripts build them
    from the original sources), as one line for an error message."""
    return (f"make them with LEAF's scripts: git clone https://github.com/TalwalkarLab/leaf && cd leaf/data/{name} "
            f"&& ./preprocess.sh -s niid --sf 1.0 {LEAF_FLAGS.get(name, '-k 0')} -t sample, then copy its data/train "
            f"and data/test into {folder}")


def check_data_files(cfg: Any) -> None:
    """FileNotFoundError naming the first missing file of `cfg`'s data set, with the command or recipe
    that makes it (built-in file-backed sets only: mnist, fashion_mnist, cifar10, cifar100, femnist,
    shakespeare, sent140, torchvision, and the user's npz: ValueError without data.path)."""
    name, base = cfg.data.dataset, Path(cfg.data.data_dir)
    if name in cifar.LAYOUTS:
        cifar.find_folder(base, cifar.LAYOUTS[name])
    elif name in ("mnist", "fashion_mnist"):
        sub = "MNIST" if name == "mnist" else "FashionMNIST"
        for stem in ("train_images", "train_labels"):
            if not any(_find_idx(folder, MNIST_FILES[stem]) for folder in (base, base / sub / "raw")):
                raise FileNotFoundError(f"{name}: missing {base / MNIST_FILES[stem]} (or in {base / sub / 'raw'}, "
                                        f"plain or .gz); fetch it with `fedhop data fetch {name} --dir {base}`")
    elif name == "npz":
        from fedhop.common.tasks import dataset_params, npz_file
        npz_file(cfg, dataset_params(cfg))
    elif name == "torchvision":
        from fedhop.common.tasks import dataset_params
        params = dataset_params(cfg)
        if not params.download and params.name != "SVHN" and not (base / params.name / "raw").is_dir():
            raise FileNotFoundError(f"torchvision {params.name}: missing {base / params.name / 'raw'}; fetch it with "
                                    f"`fedhop data fetch` (--list shows the sets) or set data.download = true")
    elif name in ("femnist", "shakespeare", "sent140"):
        from fedhop.common.tasks import dataset_params
        from fedhop.common.tasks.leaf import LeafParams, base_folder
        params = dataset_params(cfg)
        folder = base_folder(cfg, params if isinstance(params, LeafParams) else LeafParams(), name)
        train = leaf.find_split(folder, "train")
        if train is None or not any(train.glob("*.json")):
            raise FileNotFoundError(f"{name}: missing LEAF JSON files in {folder / 'train'} (nor "
                                    f"{folder / 'data' / 'train'}); {leaf_recipe(name, folder)}")
