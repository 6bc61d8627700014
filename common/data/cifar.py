"""CIFAR-10 / CIFAR-100 from their binary distribution files (Krizhevsky 2009), never the pickled ones.

CIFAR-10 (cifar-10-binary.tar.gz, folder cifar-10-batches-bin): data_batch_1.bin .. data_batch_5.bin
and test_batch.bin, each 10,000 records of 1 label byte + 3,072 pixel bytes (1,024 red, 1,024 green,
1,024 blue, row-major 32x32).  CIFAR-100 (cifar-100-binary.tar.gz, folder cifar-100-binary):
train.bin (50,000) and test.bin (10,000), records of 2 label bytes (coarse, fine) + 3,072 pixels;
the fine label (100 classes) is used.

`CifarRecords` reads the labels once (one byte per record, through a map dropped at once) and the
pixels of the rows a caller asks for only (positioned reads), so a process holds the pixels of its
own clients only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class CifarLayout:
    name: str
    folder: str                  # the archive's folder
    train: tuple[str, ...]
    test: str
    label_bytes: int             # bytes before the pixels
    label_at: int                # which of them is the label used
    n_classes: int

    @property
    def record(self) -> int:
        return self.label_bytes + PIXELS


LAYOUTS = {
    "cifar10": CifarLayout("CIFAR-10", "cifar-10-batches-bin", tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
                           "test_batch.bin", 1, 0, 10),
    "cifar100": CifarLayout("CIFAR-100", "cifar-100-binary", ("train.bin",), "test.bin", 2, 1, 100),
}


class CifarError(ValueError):
    """A CIFAR binary file is not the size or content its layout needs."""


def _fetch_name(layout: CifarLayout) -> str:
    """The data set's name in `fedhop data fetch` (and data.dataset): cifar10, cifar100."""
    return next((name for name, known in LAYOUTS.items() if known is layout), layout.name)


def find_folder(data_dir: str | Path, layout: CifarLayout) -> Path:
    """data_dir/<archive folder> or data_dir itself, whichever holds the first training file;
    FileNotFoundError naming the missing file otherwise."""
    base = Path(data_dir)
    for folder in (base / layout.folder, base):
        if (folder / layout.train[0]).is_file():
            missing = [f for f in (*layout.train, layout.test) if not (folder / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{layout.name}: missing {folder / missing[0]} (binary version); fetch it "
                                        f"with `fedhop data fetch {_fetch_name(layout)} --dir {base}`")
            return folder
    raise FileNotFoundError(f"{layout.name}: missing {base / layout.folder / layout.train[0]} (the binary version, "
                            f"{layout.folder}); fetch it with `fedhop data fetch {_fetch_name(layout)} --dir {base}`")


class CifarRecords:
    """The records of some CIFAR binary files, concatenated: labels in memory, pixels mapped."""

    def __init__(self, paths: list[Path], layout: CifarLayout) -> None:
        self.layout, self.paths = layout, list(paths)
        self.counts: list[int] = []
        labels = []
        for path in self.paths:
            size = path.stat().st_size
            if size == 0 or size % layout.record:
                raise CifarError(f"{path}: {size} bytes is not a whole number of {layout.record}-byte "
                                 f"{layout.name} records")
            # the labels touch every page: read through a map that is dropped at once, so the pages do
            # not stay in this process's resident set
            records = self._map(path)
            labels.append(np.array(records[:, layout.label_at], dtype=np.int64))
            self.counts.append(len(records))
            del records
        self.offsets = np.cumsum([0] + self.counts)
        self.labels = np.concatenate(labels)
        if self.labels.size and int(self.labels.max()) >= layout.n_classes:
            raise CifarError(f"{paths[0].parent}: label {int(self.labels.max())} found; {layout.name} has "
                             f"{layout.n_classes} classes (is this the other CIFAR?)")

    def _map(self, path: Path) -> np.memmap:
        size = path.stat().st_size
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(size // self.layout.record, self.layout.record))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def images(self, rows: np.ndarray) -> np.ndarray:
        """uint8 images (len(rows), 3, 32, 32) of the given global rows, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(self)):
            raise IndexError(f"{self.layout.name}: rows must lie in 0..{len(self) - 1}")
        out = np.empty((len(rows), PIXELS), dtype=np.uint8)
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        rec, skip = self.layout.record, self.layout.label_bytes
        for f in np.unique(which):
            at = np.flatnonzero(which == f)
            fd = os.open(self.paths[f], os.O_RDONLY)
            try:   # positioned reads, not a map: only these records' bytes enter the process
                for i, r in zip(at, rows[at] - self.offsets[f]):
                    out[i] = np.frombuffer(os.pread(fd, PIXELS, int(r) * rec + skip), dtype=np.uint8)
            finally:
                os.close(fd)
        return out.reshape(len(rows), 3, 32, 32)

    def channel_stats(self, chunk: int = 1000) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and standard deviation of the pixels / 255, read in chunks."""
        s = np.zeros(3)
        s2 = np.zeros(3)
        n = 0
        for path in self.paths:   # through maps dropped after use (see __init__)
            records = self._map(path)
            for start in range(0, len(records), chunk):
                x = records[start:start + chunk, self.layout.label_bytes:].reshape(-1, 3, 32 * 32) / 255.0
                s += x.sum(axis=(0, 2))
                s2 += (x * x).sum(axis=(0, 2))
                n += x.shape[0] * 32 * 32
            del records
        mean = s / max(n, 1)
        std = np.sqrt(np.maximum(s2 / max(n, 1) - mean * mean, 0.0))
        std[std == 0] = 1.0
        return mean.astype(np.float32), std.astype(np.float32)


def open_cifar(data_dir: str | Path, name: str) -> tuple[CifarRecords, CifarRecords]:
    """(train, test) records of `name` ("cifar10" or "cifar100") under `data_dir`."""
    layout = LAYOUTS[name]
    folder = find_folder(data_dir, layout)
    return (CifarRecords([folder / f for f in layout.train], layout),
            CifarRecords([folder / layout.test], layout))


def write_cifar(path: str | Path, labels: np.ndarray, images: np.ndarray, coarse: np.ndarray | None = None) -> None:
    """Write records in the binary layout: CIFAR-10's when `coarse` is None, else CIFAR-100's
    (coarse label, fine label = `labels`).  `images`: uint8 (N, 3, 32, 32).  For tests and examples."""
    imgs = np.asarray(images, dtype=np.uint8).reshape(len(labels), PIXELS)
    heads = [np.asarray(labels, dtype=np.uint8).reshape(-1, 1)]
    if coarse is not None:
        heads.insert(0, np.asarray(coarse, dtype=np.uint8).reshape(-1, 1))
    Path(path).write_bytes(np.concatenate([*heads, imgs], axis=1).tobytes())
