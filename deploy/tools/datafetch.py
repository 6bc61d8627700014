"""`fedhop data fetch NAME`: download a known data set's files, verify them, unpack them.

fedhop never downloads at run time; this command is the one place it does, and only when asked.
It needs network access to the source (or to `--mirror URL`, a server holding the same file names).

    fedhop data fetch --list                        # the catalogue: names, files, checksums
    fedhop data fetch cifar10 [--dir data]          # data/cifar-10-batches-bin/*.bin
    fedhop data fetch mnist --mirror http://host/mnist/   # the same files from another server
    fedhop data fetch NAME --catalog my.toml        # another catalogue (same layout as CATALOG below)

Each file is written to `NAME.part` beside its final place; an interrupted download is resumed from
there with an HTTP Range request (a server that ignores it sends the whole file again, and the
part is restarted).  The complete part is hashed: on a match it is renamed into place
(`os.replace`: the final name never holds a partial file); on a mismatch it is deleted and the
command stops with one line and exit status 1.  Archives are unpacked into a temporary folder beside
the target, with every member checked first (regular files and folders only, no absolute name, no
"..", no link of any kind), then moved into place.

IDX files (MNIST, Fashion-MNIST) are kept as downloaded (.gz) and also decompressed beside them,
where torchvision's readers look for them (`data.dataset = "torchvision"`); fedhop's own reader takes
either.

Checksums are the ones the sources publish.  All of today's sources publish MD5 only (the CIFAR
page, Fashion-MNIST's README, torchvision's MNIST mirror list), so MD5 is what is compared for
them; an entry may give `sha256` instead, and then that is compared.  MD5 detects corruption, not
tampering.  LEAF (FEMNIST, Shakespeare, Sent140) is not in the catalogue: LEAF builds its JSON files
on your machine from sources that publish no archive checksum (docs/datasets.md says how).
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import tempfile
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from fedhop.common.util.cliparser import ArgumentParser

BLOCK = 1 << 20
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RemoteFile:
    """One file of a data set: where it comes from and what it must hash to."""

    name: str
    url: str
    md5: str = ""
    sha256: str = ""
    unpack: bool = False          # a .tar.gz to unpack into the data folder
    gunzip: bool = False          # a .gz to keep and also decompress beside it (torchvision reads plain IDX)

    @property
    def checksum(self) -> tuple[str, str]:
        return ("sha256", self.sha256.lower()) if self.sha256 else ("md5", self.md5.lower())


@dataclass(frozen=True)
class Entry:
    """A data set of the catalogue: its files, and the folder (under --dir) they go to."""

    name: str
    folder: str                   # where plain files go, relative to --dir ("" = --dir itself)
    creates: str                  # what unpacking makes (skip when present), or the folder
    files: tuple[RemoteFile, ...]
    note: str = ""


def _idx(base: str, sums: dict[str, str]) -> tuple[RemoteFile, ...]:
    return tuple(RemoteFile(n, base + n, md5=s, gunzip=True) for n, s in sums.items())


CATALOG: dict[str, Entry] = {e.name: e for e in (
    Entry("mnist", "MNIST/raw", "MNIST/raw", _idx("https://ossci-datasets.s3.amazonaws.com/mnist/", {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"}),
        "torchvision's MNIST mirror; MD5 as listed by torchvision (the original site lists none)"),
    Entry("fashion_mnist", "FashionMNIST/raw", "FashionMNIST/raw",
          _idx("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/", {
              "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
              "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
              "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
              "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}),
          "MD5 as published in Fashion-MNIST's README"),
    Entry("cifar10", "", "cifar-10-batches-bin", (RemoteFile(
        "cifar-10-binary.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
        md5="c32a1d4ab5d03f1284b67883e8d87530", unpack=True),), "binary version; MD5 as published on the CIFAR page"),
    Entry("cifar100", "", "cifar-100-binary", (RemoteFile(
        "cifar-100-binary.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
        md5="03b5dce01913d631647c71ecec9e9cb8", unpack=True),), "binary version; MD5 as published on the CIFAR page"),
)}


class FetchError(Exception):
    """A download, a checksum or an archive failed: one line for the user, exit status 1."""


def load_catalog(path: Path) -> dict[str, Entry]:
    """A catalogue from TOML: `[NAME] folder = ..., creates = ..., note = ...` and `[[NAME.files]]`
    tables with name, url, md5 or sha256, unpack.  ValueError names what is wrong."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--catalog {path}: {exc}") from None
    out = {}
    for name, table in doc.items():
        if not isinstance(table, dict) or not isinstance(table.get("files"), list) or not table["files"]:
            raise ValueError(f"--catalog {path}: [{name}] needs a list of [[{name}.files]]")
        files = []
        for f in table["files"]:
            unknown = set(f) - {"name", "url", "md5", "sha256", "unpack", "gunzip"}
            if unknown or "name" not in f or "url" not in f or not (f.get("md5") or f.get("sha256")):
                raise ValueError(f"--catalog {path}: each [[{name}.files]] needs name, url and md5 or sha256"
                                 + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else ""))
            files.append(RemoteFile(str(f["name"]), str(f["url"]), str(f.get("md5", "")), str(f.get("sha256", "")),
                                    bool(f.get("unpack", False)), bool(f.get("gunzip", False))))
        folder = str(table.get("folder", ""))
        out[name] = Entry(name, folder, str(table.get("creates", folder)), tuple(files), str(table.get("note", "")))
    return out


def file_digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: Path, expected: tuple[str, str], say=print) -> None:
    """`url` to `dest` through `dest.part` (resumed when present), verified, renamed into place."""
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            resumed = have > 0 and resp.status == 206
            say(f"  {url} -> {dest}" + (f" (resuming at {have} bytes)" if resumed else ""))
            length = resp.headers.get("Content-Length")
            with open(part, "ab" if resumed else "wb") as fh:
                shutil.copyfileobj(resp, fh, BLOCK)
            # a connection closed early can end the body without an error: compare with the announced size
            if length is not None and part.stat().st_size < (have if resumed else 0) + int(length):
                raise FetchError(f"cannot download {url}: the connection closed after {part.stat().st_size} of "
                                 f"{(have if resumed else 0) + int(length)} bytes; {part.name} is kept to resume "
                                 f"(run the command again)")
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:   # the part is already whole: verify it below
            pass
        else:
            raise FetchError(f"cannot download {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:   # IncompleteRead: cut mid-file
        reason = getattr(exc, "reason", exc)
        kept = f"; {part.name} is kept to resume" if part.exists() and part.stat().st_size else ""
        raise FetchError(f"cannot download {url}: {reason} (fedhop data fetch needs network access to the source, "
                         f"or --mirror URL{kept})") from None
    algorithm, want = expected
    got = file_digest(part, algorithm)
    if got != want:
        part.unlink()
        raise FetchError(f"{dest.name}: {algorithm} {got} does not match the catalogue's {want}; nothing kept "
                         f"(a changed or corrupted source; try again or another --mirror)")
    os.replace(part, dest)


def _check_member(m: tarfile.TarInfo, archive: Path) -> None:
    p = PurePosixPath(m.name)
    if p.is_absolute() or ".." in p.parts or not (m.isfile() or m.isdir()):
        what = "a link" if (m.issym() or m.islnk()) else "an absolute path" if p.is_absolute() else \
            "a '..' path" if ".." in p.parts else "a special file"
        raise FetchError(f"{archive.name}: member {m.name!r} is {what}; refusing to unpack the archive")


def unpack(archive: Path, into: Path) -> list[str]:
    """Unpack a .tar(.gz) into `into` after checking every member; returns the top-level names."""
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=into))
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for m in members:
                _check_member(m, archive)
            tar.extractall(tmp, members=members, filter="data")
        tops = sorted(p.name for p in tmp.iterdir())
        for top in tops:
            if (into / top).exists():
                raise FetchError(f"{archive.name}: {into / top} already exists; move it away to unpack again")
        for top in tops:
            os.replace(tmp / top, into / top)
        return tops
    except (tarfile.TarError, OSError) as exc:
        raise FetchError(f"{archive.name}: cannot unpack: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gunzip(path: Path) -> None:
    """`path` (.gz) decompressed beside it, through a .part file renamed into place."""
    plain = path.with_suffix("")
    part = plain.with_name(plain.name + ".part")
    try:
        with gzip.open(path, "rb") as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, BLOCK)
    except (OSError, EOFError) as exc:
        part.unlink(missing_ok=True)
        raise FetchError(f"{path.name}: cannot decompress: {exc}") from None
    os.replace(part, plain)


def fetch(entry: Entry, base: Path, mirror: str = "", say=print) -> None:
    """Every file of `entry` under `base` (see the module docstring); FetchError on any failure."""
    if entry.creates and (base / entry.creates).exists() and all(
            (base / entry.folder / f.name).exists() for f in entry.files if not f.unpack):
        say(f"{entry.name}: {base / entry.creates} is already there; nothing fetched")
        return
    say(f"{entry.name}: fetching {len(entry.files)} file(s) (needs network access)")
    made: list[Path] = []   # the folders this call made: removed again, when left empty, by a failure
    try:
        _fetch_files(entry, base, mirror, say, made)
    except FetchError:
        for folder in reversed(made):
            with contextlib.suppress(OSError):   # not empty: a part file kept to resume, or another file
                folder.rmdir()
        raise
    say(f"{entry.name}: done, under {base}")


def _fetch_files(entry: Entry, base: Path, mirror: str, say, made: list[Path]) -> None:
    for f in entry.files:
        folder = base / (entry.folder if not f.unpack else "")
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        made.extend(p for p in reversed(missing) if p not in made)
        dest = folder / f.name
        if dest.exists() and file_digest(dest, f.checksum[0]) == f.checksum[1]:
            say(f"  {dest} is already there (checksum matches)")
        else:
            url = mirror.rstrip("/") + "/" + f.name if mirror else f.url
            download(url, dest, f.checksum, say)
        if f.gunzip and dest.suffix == ".gz" and not dest.with_suffix("").exists():
            gunzip(dest)
        if f.unpack:
            tops = unpack(dest, base)
            say(f"  unpacked {dest.name}: {', '.join(tops)}")


def print_catalog(catalog: dict[str, Entry]) -> None:
    for entry in catalog.values():
        print(f"{entry.name}: -> {entry.creates or '.'}" + (f"  ({entry.note})" if entry.note else ""))
        for f in entry.files:
            algorithm, digest = f.checksum
            print(f"    {f.name}  {algorithm} {digest}  {f.url}" + ("  [unpacked]" if f.unpack else ""))


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop data fetch",
                                 description="download a known data set's files (needs network access), verify "
                                             "their published checksums and unpack them")
    ap.add_argument("name", nargs="?", help="a data set of the catalogue (--list shows them)")
    ap.add_argument("--dir", default="data", help="where to put the files (default: data, as data.data_dir)")
    ap.add_argument("--mirror", default="", metavar="URL",
                    help="fetch each file as URL/<file name> instead of from its source")
    ap.add_argument("--catalog", metavar="FILE.toml", help="use this catalogue instead of the built-in one")
    ap.add_argument("--list", action="store_true", help="print the catalogue and exit")
    a = ap.parse_args(argv)
    try:
        catalog = load_catalog(Path(a.catalog)) if a.catalog else CATALOG
    except ValueError as exc:
        print(f"fedhop data fetch: {exc}", file=sys.stderr)
        return 2
    if a.list:
        print_catalog(catalog)
        return 0
    if not a.name:
        ap.error("a data set NAME is required (or --list)")
    if a.name not in catalog:
        print(f"fedhop data fetch: unknown data set {a.name!r} (known: {', '.join(catalog)})", file=sys.stderr)
        return 2
    if a.mirror and not a.mirror.startswith(("http://", "https://", "file:")):
        print(f"fedhop data fetch: --mirror {a.mirror!r} must be an http://, https:// or file: URL", file=sys.stderr)
        return 2
    try:
        fetch(catalog[a.name], Path(a.dir), a.mirror)
    except FetchError as exc:
        print(f"fedhop data fetch: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
