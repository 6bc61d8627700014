"""LEAF JSON files (Caldas et al. 2018: FEMNIST, Shakespeare, Sent140, ...), read one user at a time.

A LEAF split is a folder of JSON files, each an object

    {"users": [u, ...], "num_samples": [n_u, ...], "user_data": {u: {"x": [...], "y": [...]}, ...}}

(some files add "hierarchies").  A process needs the list of users and their sizes (the index) and
the data of the users it hosts, nothing more.  `LeafIndex` reads only "users" and "num_samples"
from each file (in LEAF's files they come before "user_data", so only the head of the file is
touched: the file is memory-mapped); `LeafFile.user` finds one user's value with a scan over
brackets and strings (no number is parsed) and decodes that slice alone with `json.loads`.  So a
process's memory holds its own users' arrays plus, briefly, one file's mapped pages.
"""
from __future__ import annotations

import json
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: a JSON string literal, or one bracket: all the structure needed to skip a value unparsed
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_SPACE = re.compile(rb"\s*")
_SCALAR_END = re.compile(rb"[,}\]\s]")


class LeafError(ValueError):
    """A LEAF file is missing or not in LEAF's layout."""


def _skip_space(buf: Any, pos: int) -> int:
    m = _SPACE.match(buf, pos)
    assert m is not None   # \s* matches everywhere
    return m.end()


def _value_end(buf: Any, pos: int, path: Path) -> int:
    """The end (exclusive) of the JSON value that starts at `pos`."""
    first = buf[pos:pos + 1]
    if first in (b"{", b"["):
        depth = 0
        for m in _TOKEN.finditer(buf, pos):
            t = m.group()
            if t in (b"{", b"["):
                depth += 1
            elif t in (b"}", b"]"):
                depth -= 1
                if depth == 0:
                    return m.end()
        raise LeafError(f"{path}: unterminated JSON value at byte {pos}")
    if first == b'"':
        string = _TOKEN.match(buf, pos)
        if string is None:
            raise LeafError(f"{path}: unterminated string at byte {pos}")
        return string.end()
    end = _SCALAR_END.search(buf, pos)
    return end.start() if end else len(buf)


def _members(buf: Any, pos: int, path: Path):
    """(key, value_start, value_end) of each member of the object starting at `pos`, in file order."""
    pos = _skip_space(buf, pos)
    if buf[pos:pos + 1] != b"{":
        raise LeafError(f"{path}: expected a JSON object at byte {pos}")
    pos = _skip_space(buf, pos + 1)
    if buf[pos:pos + 1] == b"}":
        return
    while True:
        m = _TOKEN.match(buf, pos)
        if m is None or not m.group().startswith(b'"'):
            raise LeafError(f"{path}: expected a key at byte {pos}")
        key = json.loads(m.group())
        pos = _skip_space(buf, m.end())
        if buf[pos:pos + 1] != b":":
            raise LeafError(f"{path}: expected ':' after key {key!r} at byte {pos}")
        start = _skip_space(buf, pos + 1)
        end = _value_end(buf, start, path)
        yield key, start, end
        pos = _skip_space(buf, end)
        sep = buf[pos:pos + 1]
        if sep == b"}":
            return
        if sep != b",":
            raise LeafError(f"{path}: expected ',' or '}}' at byte {pos}")
        pos = _skip_space(buf, pos + 1)


class LeafFile:
    """One LEAF JSON file: its users and sizes at once, any user's data on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users: list[str] = []
        self.num_samples: list[int] = []
        self._spans: dict[str, tuple[int, int]] | None = None
        try:
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                got: dict[str, Any] = {}
                for key, start, end in _members(buf, 0, path):
                    if key in ("users", "num_samples"):
                        got[key] = json.loads(buf[start:end])
                        if len(got) == 2:
                            break
        except (OSError, ValueError, RecursionError) as exc:   # RecursionError: JSON nested too deeply
            if isinstance(exc, LeafError):
                raise
            raise LeafError(f"{path}: cannot read LEAF JSON: {str(exc)[:200]}") from exc
        if len(got) != 2:
            raise LeafError(f"{path}: a LEAF file needs keys 'users' and 'num_samples' (found {sorted(got)})")
        users, sizes = got["users"], got["num_samples"]
        if not isinstance(users, list) or not isinstance(sizes, list) or len(users) != len(sizes):
            raise LeafError(f"{path}: 'users' and 'num_samples' must be lists of the same length")
        for k, (u, n) in enumerate(zip(users, sizes)):
            if not isinstance(u, str):
                raise LeafError(f"{path}: users[{k}] is a JSON {type(u).__name__}, not a user name (a string)")
            if type(n) is not int or n < 0:
                raise LeafError(f"{path}: num_samples[{k}] (user {u!r}) is {json.dumps(n)[:40]}, not a count "
                                f"(an integer >= 0)")
        self.users = users
        self.num_samples = sizes

    def _index_user_data(self, buf: Any) -> dict[str, tuple[int, int]]:
        for key, start, _end in _members(buf, 0, self.path):
            if key == "user_data":
                return {u: (s, e) for u, s, e in _members(buf, start, self.path)}
        raise LeafError(f"{self.path}: no 'user_data' object")

    def user(self, user: str) -> tuple[list, list]:
        """(x, y) of `user` as decoded JSON lists (the caller converts them)."""
        with open(self.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if self._spans is None:
                self._spans = self._index_user_data(buf)
            if user not in self._spans:
                raise LeafError(f"{self.path}: user {user!r} is listed in 'users' but has no entry in 'user_data'")
            start, end = self._spans[user]
            try:
                value = json.loads(buf[start:end])
            except (ValueError, RecursionError) as exc:   # RecursionError: JSON nested too deeply
                raise LeafError(f"{self.path}: user_data[{user!r}] is not readable JSON: {str(exc)[:200]}") from None
        if not isinstance(value, dict) or "x" not in value or "y" not in value:
            raise LeafError(f"{self.path}: user_data[{user!r}] needs keys 'x' and 'y'")
        x, y = value["x"], value["y"]
        if not isinstance(x, list) or not isinstance(y, list):
            raise LeafError(f"{self.path}: user {user!r}: 'x' and 'y' must be JSON arrays")
        if len(x) != len(y):
            raise LeafError(f"{self.path}: user {user!r} has {len(x)} inputs but {len(y)} labels")
        return x, y


@dataclass(frozen=True)
class LeafUser:
    name: str
    num_samples: int
    file: int          # index into LeafIndex.files


class LeafIndex:
    """Every user of a LEAF split folder (its *.json files in name order, users in file order)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        paths = sorted(p for p in folder.glob("*.json") if p.is_file())
        if not paths:
            raise LeafError(f"{folder}: no LEAF JSON files (*.json)")
        self.files = [LeafFile(p) for p in paths]
        self.users: list[LeafUser] = []
        seen: dict[str, Path] = {}
        for i, f in enumerate(self.files):
            for name, n in zip(f.users, f.num_samples):
                if name in seen:
                    raise LeafError(f"{f.path}: user {name!r} also appears in {seen[name]}")
                seen[name] = f.path
                self.users.append(LeafUser(name, n, i))
        self.position = {u.name: k for k, u in enumerate(self.users)}

    def path_of(self, user: str) -> Path:
        """The file that holds `user`."""
        return self.files[self.users[self.position[user]].file].path

    def load(self, user: str) -> tuple[list, list]:
        """(x, y) of one user; checks the count against 'num_samples'."""
        u = self.users[self.position[user]]
        x, y = self.files[u.file].user(user)
        if len(y) != u.num_samples:
            raise LeafError(f"{self.files[u.file].path}: user {user!r} has {len(y)} samples but num_samples says "
                            f"{u.num_samples}")
        return x, y


def write_leaf(path: str | Path, users: dict[str, tuple[list, list]]) -> None:
    """Write `{user: (x, y)}` as one LEAF JSON file (LEAF's key order; used by tests and examples)."""
    names = list(users)
    doc = {"users": names, "num_samples": [len(users[u][1]) for u in names],
           "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in names}}
    Path(path).write_text(json.dumps(doc))


def find_split(base: Path, split: str) -> Path | None:
    """LEAF's split folder under `base`: base/split or base/data/split (LEAF's own layout)."""
    for folder in (base / split, base / "data" / split):
        if folder.is_dir():
            return folder
    return None


def labels(y: list, user: str) -> np.ndarray:
    """Class labels as int64: every entry a JSON integer (not a float such as 1.5, a bool, a string
    or a nested list, which a cast would truncate or flatten)."""
    if not all(type(v) is int for v in y):
        bad = next(v for v in y if type(v) is not int)
        raise LeafError(f"user {user!r}: labels must be integers, found {json.dumps(bad)[:40]}")
    try:
        return np.asarray(y, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise LeafError(f"user {user!r}: a label beyond the int64 range") from None


def as_images(x: list, user: str, shape: tuple[int, ...]) -> np.ndarray:
    """FEMNIST's flattened pixel lists as float32 images of `shape`."""
    if len(x) == 0:
        return np.zeros((0, *shape), dtype=np.float32)
    try:
        arr = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as exc:   # a string, null, an object or ragged rows
        raise LeafError(f"user {user!r}: inputs are not rows of numbers ({str(exc)[:120]})") from None
    size = int(np.prod(shape))
    if arr.ndim != 2 or arr.shape[1] != size:
        raise LeafError(f"user {user!r}: expected inputs of {size} values each, got array shape {arr.shape}")
    return arr.reshape(len(arr), *shape)


def encode_chars(strings: list, letters: str, user: str) -> np.ndarray:
    """Strings as int64 rows of indices into `letters` (LEAF's Shakespeare encoding)."""
    table = {c: i for i, c in enumerate(letters)}
    if len(strings) == 0:
        return np.zeros((0, 0), dtype=np.int64)
    try:
        return np.array([[table[c] for c in s] for s in strings], dtype=np.int64).reshape(len(strings), -1)
    except KeyError as exc:
        raise LeafError(f"user {user!r}: character {exc.args[0]!r} is not in the {len(letters)}-character "
                        f"vocabulary") from None
    except ValueError:
        raise LeafError(f"user {user!r}: inputs must all have the same length") from None
