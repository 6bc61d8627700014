"""`fedhop data fetch` against a local HTTP server (a real socket, in a thread) serving files generated
here: download, resume from a .part with a Range request, checksum refusal with the real catalogue,
unsafe archives refused, and the fetched files read by fedhop's own readers."""
from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import subprocess
import sys
import tarfile
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.data import cifar, fakedata
from fedhop.common.data.datasets import write_idx
from fedhop.common.tasks import build_task
from fedhop.deploy.cli.cli import main as cli_main
from fedhop.deploy.tools.datafetch import CATALOG


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; honours `Range: bytes=N-` (206) and records each request's Range header."""

    ranges: list = []
    cut: set = set()     # file names whose next whole-file answer stops half-way (then the connection closes)

    def log_message(self, *args) -> None:   # keep the test output clean
        pass

    def do_GET(self) -> None:
        self.ranges.append(self.headers.get("Range"))
        path = Path(self.translate_path(self.path))
        spec = self.headers.get("Range")
        if not spec and path.name in self.cut:
            self.cut.discard(path.name)
            data = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.close_connection = True
            return
        if not spec or not path.is_file():
            return super().do_GET()
        data = path.read_bytes()
        start = int(spec.split("=")[1].rstrip("-"))
        if start >= len(data):
            self.send_error(416)
            return
        self.send_response(206)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        self.wfile.write(data[start:])


@pytest.fixture
def server(tmp_path: Path):
    served = tmp_path / "served"
    served.mkdir()
    handler = type("H", (_RangeHandler,), {"ranges": [], "cut": set()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{httpd.server_address[1]}/", handler.ranges, handler.cut
    httpd.shutdown()
    httpd.server_close()


def _fetch(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`fedhop data fetch ARGS` as a user runs it: its own process, in `cwd`."""
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "data", "fetch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def fetch_here(monkeypatch, capsys):
    """The same command in this process (the server still answers over a real socket): saves the
    start-up of a Python process per call."""
    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        code = cli_main(["data", "fetch", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return run


def _cifar_tarball(tmp_path: Path, served: Path) -> bytes:
    fakedata.cifar10(tmp_path / "made", per_batch=5, n_test=7)
    with tarfile.open(served / "cifar-10-binary.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "made" / "cifar-10-batches-bin", arcname="cifar-10-batches-bin")
    return (served / "cifar-10-binary.tar.gz").read_bytes()


def test_cifar10_fetched_verified_unpacked_and_readable(tmp_path: Path, server) -> None:
    served, url, _, _ = server
    blob = _cifar_tarball(tmp_path, served)
    (tmp_path / "cat.toml").write_text(
        f'[cifar10]\ncreates = "cifar-10-batches-bin"\n[[cifar10.files]]\nname = "cifar-10-binary.tar.gz"\n'
        f'url = "https://example.invalid/cifar-10-binary.tar.gz"\nsha256 = "{hashlib.sha256(blob).hexdigest()}"\n'
        f'unpack = true\n')
    done = _fetch(tmp_path, "cifar10", "--dir", "data", "--mirror", url, "--catalog", "cat.toml")
    assert done.returncode == 0, done.stderr
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        assert (tmp_path / "data" / "cifar-10-batches-bin" / name).read_bytes() == \
            (tmp_path / "made" / "cifar-10-batches-bin" / name).read_bytes()
    assert not list((tmp_path / "data").glob(".unpack-*")) and not list((tmp_path / "data").glob("*.part"))
    folder = cifar.find_folder(tmp_path / "data", cifar.LAYOUTS["cifar10"])
    records = cifar.CifarRecords([folder / f"data_batch_{i}.bin" for i in range(1, 6)], cifar.LAYOUTS["cifar10"])
    assert sum(records.counts) == 25
    again = _fetch(tmp_path, "cifar10", "--dir", "data", "--mirror", url, "--catalog", "cat.toml")
    assert again.returncode == 0 and "already there" in again.stdout


def test_the_real_catalogue_refuses_a_file_that_does_not_match(tmp_path: Path, server) -> None:
    served, url, _, _ = server
    blob = _cifar_tarball(tmp_path, served)
    assert hashlib.md5(blob).hexdigest() != CATALOG["cifar10"].files[0].md5
    done = _fetch(tmp_path, "cifar10", "--dir", "data", "--mirror", url)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not match" in lines[0] and CATALOG["cifar10"].files[0].md5 in lines[0]
    assert not (tmp_path / "data").exists()   # nothing half-written, nothing unpacked, no folder it made


def test_an_interrupted_download_resumes_with_a_range_request(tmp_path: Path, server, fetch_here) -> None:
    """Fashion-MNIST-named IDX files (sha256 catalogue, gunzip on): one has half its bytes in a .part already."""
    served, url, ranges, _ = server
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8), rng.integers(0, 10, 30).astype(np.uint8)
    names = {"train-images-idx3-ubyte.gz": x, "train-labels-idx1-ubyte.gz": y,
             "t10k-images-idx3-ubyte.gz": x[:8], "t10k-labels-idx1-ubyte.gz": y[:8]}
    rows = []
    for name, arr in names.items():
        write_idx(served / name, arr)
        digest = hashlib.sha256((served / name).read_bytes()).hexdigest()
        rows.append(f'[[fashion_mnist.files]]\nname = "{name}"\nurl = "https://example.invalid/{name}"\n'
                    f'sha256 = "{digest}"\ngunzip = true\n')
    (tmp_path / "cat.toml").write_text('[fashion_mnist]\nfolder = "FashionMNIST/raw"\n' + "".join(rows))
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    whole = (served / "train-images-idx3-ubyte.gz").read_bytes()
    (raw / "train-images-idx3-ubyte.gz.part").write_bytes(whole[:len(whole) // 2])
    done = fetch_here(tmp_path, "fashion_mnist", "--dir", "data", "--mirror", url, "--catalog", "cat.toml")
    assert done.returncode == 0, done.stderr
    assert f"bytes={len(whole) // 2}-" in ranges and "resuming" in done.stdout
    assert (raw / "train-images-idx3-ubyte.gz").read_bytes() == whole and not list(raw.glob("*.part"))
    for name in names:    # each also decompressed beside it (where torchvision's readers look)
        assert (raw / name.removesuffix(".gz")).read_bytes() == gzip.decompress((served / name).read_bytes())
    cfg = parse_config(f'[data]\ndataset = "fashion_mnist"\npartition = "iid"\ndata_dir = "{tmp_path / "data"}"\n'
                       f'[model]\nkind = "logreg"\n[clients]\ncount = 3\n')
    task = build_task(cfg)
    assert np.allclose(task.x.numpy().reshape(30, 28, 28), x / 255.0) and np.array_equal(task.y.numpy(), y)


@pytest.mark.parametrize("bad", ["../escape.bin", "/abs.bin", "link"])
def test_an_unsafe_archive_is_refused_and_nothing_is_written(tmp_path: Path, server, fetch_here, bad: str) -> None:
    served, url, _, _ = server
    with tarfile.open(served / "evil.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("ok/a.bin")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
        info = tarfile.TarInfo(bad)
        if bad == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        else:
            info.size = 1
        tar.addfile(info, None if bad == "link" else io.BytesIO(b"x"))
    digest = hashlib.sha256((served / "evil.tar.gz").read_bytes()).hexdigest()
    (tmp_path / "cat.toml").write_text(f'[evil]\ncreates = "ok"\n[[evil.files]]\nname = "evil.tar.gz"\n'
                                       f'url = "https://example.invalid/evil.tar.gz"\nsha256 = "{digest}"\n'
                                       f'unpack = true\n')
    done = fetch_here(tmp_path, "evil", "--dir", "data", "--mirror", url, "--catalog", "cat.toml")
    assert done.returncode == 1 and "refusing to unpack" in done.stderr, done.stderr
    assert not (tmp_path / "data" / "ok").exists() and not (tmp_path / "escape.bin").exists()
    assert not list((tmp_path / "data").glob(".unpack-*"))


def test_no_network_is_one_line_and_exit_1(tmp_path: Path, fetch_here) -> None:
    done = fetch_here(tmp_path, "mnist", "--dir", "data", "--mirror", "http://127.0.0.1:9/")
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "needs network access" in done.stderr
    assert not (tmp_path / "data").exists()   # the folders it made for the files are removed again
    (tmp_path / "mine").mkdir()   # a folder that was there before stays, with what it held
    (tmp_path / "mine" / "notes.txt").write_text("kept\n")
    done = fetch_here(tmp_path, "mnist", "--dir", "mine", "--mirror", "http://127.0.0.1:9/")
    assert done.returncode == 1
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_list_and_bad_names(tmp_path: Path, fetch_here) -> None:
    listed = fetch_here(tmp_path, "--list")
    assert listed.returncode == 0
    for entry in CATALOG.values():
        for f in entry.files:
            assert f.md5 in listed.stdout and f.url in listed.stdout
    bad = fetch_here(tmp_path, "imagenet")
    assert bad.returncode == 2 and "unknown data set 'imagenet'" in bad.stderr
    (tmp_path / "c.toml").write_text("[x]\nfolder = 1\n")
    assert fetch_here(tmp_path, "x", "--catalog", "c.toml").returncode == 2


def test_a_download_cut_half_way_keeps_its_part_and_the_next_fetch_resumes(tmp_path: Path, server, fetch_here) -> None:
    served, url, ranges, cut = server
    blob = np.random.default_rng(7).bytes(300_000)
    (served / "blob.bin").write_bytes(blob)
    (tmp_path / "cat.toml").write_text(f'[blob]\n[[blob.files]]\nname = "blob.bin"\nurl = "https://example.invalid/b"\n'
                                       f'sha256 = "{hashlib.sha256(blob).hexdigest()}"\n')
    cut.add("blob.bin")
    first = fetch_here(tmp_path, "blob", "--dir", "data", "--mirror", url, "--catalog", "cat.toml")
    assert first.returncode == 1 and len(first.stderr.strip().splitlines()) == 1, first.stderr
    assert "kept to resume" in first.stderr and not (tmp_path / "data" / "blob.bin").exists()
    part = (tmp_path / "data" / "blob.bin.part").read_bytes()
    assert 0 < len(part) < len(blob) and blob.startswith(part)
    second = fetch_here(tmp_path, "blob", "--dir", "data", "--mirror", url, "--catalog", "cat.toml")
    assert second.returncode == 0, second.stderr
    assert ranges[-1] == f"bytes={len(part)}-"
    assert (tmp_path / "data" / "blob.bin").read_bytes() == blob and not (tmp_path / "data" / "blob.bin.part").exists()
