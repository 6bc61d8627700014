"""Loaders: IDX round trip and corruption, MNIST from IDX files, npz user data, splits."""
from __future__ import annotations

import gzip
import io
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.data import datasets as D
from fedhop.common.util.rng import numpy_stream


def test_bundled_loaders_shapes_and_dtypes() -> None:
    x, y = D.load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32 and y.dtype == np.int64
    assert set(np.unique(y)) == set(range(10)) and x.max() == 16.0
    xb, yb = D.load_breast_cancer()
    assert xb.shape == (569, 30) and xb.dtype == np.float32 and set(np.unique(yb)) == {0, 1}
    with pytest.raises(ValueError):  # the cached copy is read-only
        x[0, 0] = 1.0


def test_bundled_csv_reader_equals_sklearn_loaders() -> None:
    """digits and breast cancer are read from scikit-learn's data files without importing it
    (the import cost each client process a second): the same arrays as its loaders."""
    from sklearn.datasets import load_breast_cancer, load_digits
    for ours, theirs, name in ((D.load_digits, load_digits, "digits.csv.gz"),
                               (D.load_breast_cancer, load_breast_cancer, "breast_cancer.csv")):
        assert D._sklearn_data_file(name) is not None, name
        x, y = ours()
        ref = theirs()
        assert np.array_equal(x, ref.data.astype(np.float32)) and x.dtype == np.float32
        assert np.array_equal(y, ref.target) and y.dtype == np.int64


def test_bundled_csv_header_must_match_the_rows(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("3,2,a,b\n1.0,2.0,0\n3.0,4.0,1\n")
    with pytest.raises(ValueError, match="header says 3 rows of 2 features"):
        D._read_labelled_csv(path, header=True)
    x, y = D._read_labelled_csv(_write(tmp_path / "ok.csv.gz"), header=False)
    assert x.tolist() == [[1.0, 2.0], [3.0, 4.0]] and y.tolist() == [0, 1]


def _write(path: Path) -> Path:
    with gzip.open(path, "wt") as f:
        f.write("1,2,0\n3,4,1\n")
    return path


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("array", [
    np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28),
    np.array([3, 1, 4, 1, 5], dtype=np.uint8),
    np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    np.array([[-70000, 5], [1, 2]], dtype=np.int32),
])
def test_idx_round_trip(tmp_path: Path, array: np.ndarray, suffix: str) -> None:
    path = tmp_path / f"a.idx{suffix}"
    D.write_idx(path, array)
    back = D.read_idx(path)
    assert back.dtype == array.dtype and np.array_equal(back, array)


def test_idx_header_is_mnist_layout(tmp_path: Path) -> None:
    D.write_idx(tmp_path / "img", np.zeros((3, 28, 28), np.uint8))
    D.write_idx(tmp_path / "lab", np.zeros(3, np.uint8))
    img, lab = (tmp_path / "img").read_bytes(), (tmp_path / "lab").read_bytes()
    assert struct.unpack(">IIII", img[:16]) == (2051, 3, 28, 28) and len(img) == 16 + 3 * 784
    assert struct.unpack(">II", lab[:8]) == (2049, 3) and len(lab) == 8 + 3


def test_corrupt_idx_rejected_with_clear_errors(tmp_path: Path) -> None:
    good = tmp_path / "good"
    D.write_idx(good, np.ones((4, 28, 28), np.uint8))
    raw = good.read_bytes()
    cases = {
        "bad magic": (b"\x12\x34" + raw[2:], "bad IDX magic"),
        "unknown type": (raw[:2] + b"\x07" + raw[3:], "bad IDX magic"),
        "truncated data": (raw[:-10], "truncated"),
        "trailing bytes": (raw + b"\x00", "trailing"),
        "truncated header": (raw[:9], "truncated header"),
        "empty": (b"", "too short"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name.replace(" ", "_")
        path.write_bytes(content)
        with pytest.raises(D.IdxError, match=message):
            D.read_idx(path)
    gz = tmp_path / "cut.gz"
    gz.write_bytes(gzip.compress(raw)[:-20])
    with pytest.raises(D.IdxError):
        D.read_idx(gz)


def test_read_idx_reads_no_more_than_its_header_declares(tmp_path: Path, monkeypatch) -> None:
    """A gzip bomb (3 labels declared, 50 MB inflated): refused as trailing bytes after reading at most
    one byte past the declared 3, not after inflating all of it."""
    monkeypatch.chdir(tmp_path)
    Path("bomb.gz").write_bytes(gzip.compress(struct.pack(">II", 2049, 3) + bytes(50_000_000)))
    sizes: list[int] = []
    real_open = gzip.open

    def spy_open(path, mode="rb"):
        fh = real_open(path, mode)
        read = fh.read

        def counted(size=-1):
            data = read(size)
            sizes.append(len(data))
            return data
        fh.read = counted
        return fh
    monkeypatch.setattr(D.gzip, "open", spy_open)
    with pytest.raises(D.IdxError, match=r"bomb\.gz: data has trailing bytes"):
        D.read_idx("bomb.gz")
    assert sum(sizes) <= 8 + 3 + 1


def test_read_idx_refuses_dimensions_too_large_to_hold(tmp_path: Path, monkeypatch) -> None:
    """65536^4 elements overflow a numpy int64 product to 0; the size is computed exactly and refused."""
    monkeypatch.chdir(tmp_path)
    Path("huge").write_bytes(struct.pack(">IIIII", 0x0804, 65536, 65536, 65536, 65536))
    with pytest.raises(D.IdxError, match=r"huge: dimensions \(65536, 65536, 65536, 65536\) of uint8 declare "
                                         r"18446744073709551616 bytes; at most"):
        D.read_idx("huge")


@pytest.mark.parametrize("labels, message", [
    (np.array([2.7, 1.0, 0.0], np.float32), "labels have IDX type float32 (floating point)"),
    (np.array([np.nan, 1.0, 0.0]), "labels have IDX type float64 (floating point)"),
    (np.array([-1, 1, 0], np.int8), "labels must be 0..9, found -1"),
])
def test_load_mnist_refuses_labels_that_are_not_digits(tmp_path: Path, labels, message) -> None:
    """Float labels are refused, never truncated (2.7 is not class 2), and negative ones are named."""
    D.write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((3, 28, 28), np.uint8))
    D.write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    with pytest.raises(D.IdxError, match=r"train-labels-idx1-ubyte: ") as err:
        D.load_mnist(tmp_path)
    assert message in str(err.value)


def test_write_idx_rejects_unsupported_dtype(tmp_path: Path) -> None:
    with pytest.raises(D.IdxError, match="no IDX type code"):
        D.write_idx(tmp_path / "x", np.zeros(3, dtype=np.complex64))


def _stage_mnist(folder: Path, gz: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)   # 600 synthetic 28x28 images of every class
    images = rng.integers(0, 256, size=(600, 28, 28), dtype=np.uint8)
    labels = (np.arange(600) % 10).astype(np.uint8)[rng.permutation(600)]
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    D.write_idx(folder / f"train-images-idx3-ubyte{ext}", images[:500])
    D.write_idx(folder / f"train-labels-idx1-ubyte{ext}", labels[:500])
    D.write_idx(folder / f"t10k-images-idx3-ubyte{ext}", images[500:])
    D.write_idx(folder / f"t10k-labels-idx1-ubyte{ext}", labels[500:])
    return images, labels


@pytest.mark.parametrize("layout,gz", [("flat", False), ("torchvision", True)])
def test_load_mnist_from_idx_files(tmp_path: Path, layout: str, gz: bool) -> None:
    folder = tmp_path if layout == "flat" else tmp_path / "MNIST" / "raw"
    images, labels = _stage_mnist(folder, gz)
    data = D.load_mnist(tmp_path)
    assert data.source.startswith("idx:")
    assert data.x.shape == (500, 1, 28, 28) and data.x.dtype == np.float32
    assert data.x_test.shape == (100, 1, 28, 28) and data.y_test.dtype == np.int64
    np.testing.assert_allclose(data.x[:, 0], images[:500] / 255.0, rtol=0, atol=1e-7)
    assert np.array_equal(data.y, labels[:500]) and np.array_equal(data.y_test, labels[500:])
    assert 0.0 <= data.x.min() and data.x.max() <= 1.0


def test_load_mnist_rejects_mismatched_label_count(tmp_path: Path) -> None:
    D.write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((5, 28, 28), np.uint8))
    D.write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(4, np.uint8))
    with pytest.raises(D.IdxError, match="expected 5 labels"):
        D.load_mnist(tmp_path)


def test_load_mnist_without_files_says_how_to_get_them(tmp_path: Path) -> None:
    """No silent 5,000-image subset in MNIST's place (issue 18): a clear error naming the IDX
    files and both ways to get them."""
    with pytest.raises(D.MnistMissing) as info:
        D.load_mnist(tmp_path / "empty")
    text = str(info.value)
    assert "no IDX files" in text and "train-images-idx3-ubyte" in text and "MNIST mirror" in text
    assert "torchvision.datasets.MNIST" in text


def test_stratified_split_keeps_class_proportions() -> None:
    x, y = D.load_digits()
    x_tr, y_tr, x_te, y_te = D.train_test_split(x, y, 0.25, numpy_stream(0, "data/split"))
    assert len(y_tr) + len(y_te) == len(y)
    for c in range(10):
        n_c = int(np.sum(y == c))
        assert int(np.sum(y_te == c)) == round(0.25 * n_c)
    tr, te = D.train_test_indices(y, 0.25, numpy_stream(0, "data/split"))
    assert np.intersect1d(tr, te).size == 0 and np.array_equal(x[te], x_te)
    tr2, te2 = D.train_test_indices(y, 0.25, numpy_stream(0, "data/split"))
    assert np.array_equal(te, te2)
    with pytest.raises(ValueError, match="test_fraction"):
        D.train_test_indices(y, 1.0, numpy_stream(0, "data/split"))


def test_load_npz_round_trip_and_rejections(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {"x_0": rng.normal(size=(5, 3)), "y_0": np.arange(5), "x_1": rng.normal(size=(2, 3)),
              "y_1": np.array([1, 0]), "w_true": np.ones(3)}
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    data = D.load_npz(path)
    assert len(data.xs) == 2 and np.array_equal(data.xs[1], arrays["x_1"]) and data.x_test is None
    assert np.array_equal(data.w_true, np.ones(3))

    np.savez(tmp_path / "gap.npz", x_0=np.zeros((2, 1)), y_0=np.zeros(2), x_2=np.zeros((2, 1)), y_2=np.zeros(2))
    with pytest.raises(ValueError, match="x_0..x_1"):
        D.load_npz(tmp_path / "gap.npz")
    np.savez(tmp_path / "rows.npz", x_0=np.zeros((3, 1)), y_0=np.zeros(2))
    with pytest.raises(ValueError, match="same number of rows"):
        D.load_npz(tmp_path / "rows.npz")
    np.savez(tmp_path / "extra.npz", x_0=np.zeros((2, 1)), y_0=np.zeros(2), z=np.zeros(1))
    with pytest.raises(ValueError, match="unexpected key 'z'"):
        D.load_npz(tmp_path / "extra.npz")
    np.savez(tmp_path / "obj.npz", x_0=np.array([{"a": 1}, None], dtype=object), y_0=np.zeros(2))
    with pytest.raises(ValueError, match="pickle"):
        D.load_npz(tmp_path / "obj.npz")
    with pytest.raises(FileNotFoundError):
        D.load_npz(tmp_path / "missing.npz")


def _write_bad_npz(kind: str) -> str:
    """A hostile file named bad.npz in the working folder; returns what the error must say."""
    ok = {"x_0": np.zeros((2, 1)), "y_0": np.zeros(2)}
    if kind == "truncated":
        np.savez("whole.npz", **ok)
        Path("bad.npz").write_bytes(Path("whole.npz").read_bytes()[:100])
        return "not an .npz archive"
    if kind == "text":
        Path("bad.npz").write_text("hello world\n")
        return "not an .npz archive"
    if kind == "npy":
        np.save("plain.npy", np.zeros(3))
        Path("plain.npy").rename("bad.npz")
        return "is a single .npy array, not an .npz archive"
    if kind == "huge_shape":
        header = "{'descr': '<f8', 'fortran_order': False, 'shape': (10000000000000, 3), }"
        header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
        member = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
        with zipfile.ZipFile("bad.npz", "w") as z:
            z.writestr("x_0.npy", member)
            buf = io.BytesIO()
            np.save(buf, ok["y_0"])
            z.writestr("y_0.npy", buf.getvalue())
        return "x_0 declares an array too large to load"
    assert kind == "empty"
    np.savez("bad.npz", x_0=np.zeros((0, 1)), y_0=np.zeros(0), x_1=np.zeros((0, 1)), y_1=np.zeros(0))
    return "every client has 0 rows"


@pytest.mark.parametrize("kind", ["truncated", "text", "npy", "huge_shape", "empty"])
def test_load_npz_refuses_a_file_that_is_not_usable_npz_data_naming_it(tmp_path: Path, monkeypatch, kind) -> None:
    """A truncated or foreign file, a member declaring 240 TB, no rows at all: a ValueError naming the file
    and what is wrong (never a zipfile, numpy or builtin error of its own)."""
    monkeypatch.chdir(tmp_path)
    message = _write_bad_npz(kind)
    with pytest.raises(ValueError) as err:
        D.load_npz("bad.npz")
    assert type(err.value) is ValueError and "\n" not in str(err.value)
    assert str(err.value).startswith(f"{tmp_path.resolve() / 'bad.npz'}: ") and message in str(err.value)
