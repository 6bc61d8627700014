"""LEAF's FEMNIST and Shakespeare as tasks: one client per writer / speaking role, loaded lazily.

`[data] dataset = "femnist"` or `"shakespeare"`, files in LEAF's JSON layout (common/data/leaf.py) under
`data.path` (default: `data.data_dir/<dataset>`), in `train/` and `test/` (or LEAF's own
`data/train`, `data/test`).  `data.fraction` < 1 keeps a seeded sample of the users (stream
"data/leaf/users"), as LEAF's `--sf` does.

With `partition = "natural"` (the benchmark's own split) client k is the k-th selected user in file
order; with fewer clients (`clients.count`) than users, a seeded sample of clients.count users
(stream "data/leaf/clients") is kept.  A process builds only the index (users and sizes) when it
starts: a client's data is read from its file the first time one of its calls needs it and kept,
so a client process holds
the users it hosts and no others (its clients are a contiguous block of ids, hence a contiguous run
of files).  The test set (the selected users' test samples, pooled) is read on the first
evaluation, which only the server runs.  Other partitions (iid, dirichlet, ...) pool every selected
user's training samples in every process and split them as for any data set.

FEMNIST: 28x28 images with values in [0, 1] (used as stored), 62 classes.  Shakespeare: 80-character
windows encoded with LEAF's 80-character alphabet (common/models/text.py LEAF_LETTERS), the label is the
next character.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fedhop.common.data import leaf
from fedhop.common.models.text import LEAF_LETTERS
from fedhop.common.tasks.base import ClientData
from fedhop.common.tasks.classification import ClassificationTask
from fedhop.common.util.rng import numpy_stream

LOSS_CLIENTS = 100   # clients in the final training-loss estimate of a natural partition


@dataclass
class LeafParams:
    """[data] keys of dataset = "femnist" / "shakespeare" (LEAF JSON files).

    `path`: the folder holding train/ and test/ (relative: under data.data_dir, then the cwd);
        "" = data.data_dir/<dataset>
    `fraction`: the share of users kept (a seeded sample; 1 = every user)
    """

    path: str = field(default="", metadata={"path": True})
    fraction: float = field(default=1.0, metadata={"min_exclusive": 0.0, "max": 1.0})


@dataclass(frozen=True)
class LeafKind:
    """What differs between the LEAF data sets: the input shape, the classes and the decoding."""

    input_shape: tuple[int, ...]
    n_classes: int
    decode: Callable[[list, list, str], tuple[np.ndarray, np.ndarray]]


def _femnist(x: list, y: list, user: str) -> tuple[np.ndarray, np.ndarray]:
    return leaf.as_images(x, user, (1, 28, 28)), leaf.labels(y, user)


def _shakespeare(x: list, y: list, user: str) -> tuple[np.ndarray, np.ndarray]:
    xs = leaf.encode_chars(x, LEAF_LETTERS, user).astype(np.float32).reshape(len(x), -1 if len(x) else 80)
    if xs.shape[1] != 80:
        raise leaf.LeafError(f"user {user!r}: Shakespeare inputs must be 80 characters, got {xs.shape[1]}")
    return xs, leaf.encode_chars(y, LEAF_LETTERS, user).reshape(-1)


KINDS = {"femnist": LeafKind((1, 28, 28), 62, _femnist), "shakespeare": LeafKind((80,), 80, _shakespeare)}


class LeafData:
    """The selected users of one LEAF data set: the train index, the test index, the decoder."""

    def __init__(self, name: str, base: Path, fraction: float, seed: int, kind: LeafKind | None = None) -> None:
        self.name, self.kind = name, kind if kind is not None else KINDS[name]
        train = leaf.find_split(base, "train")
        if train is None:
            from fedhop.common.data.datafiles import leaf_recipe
            raise FileNotFoundError(f"{name}: no LEAF train folder {base / 'train'} (nor {base / 'data' / 'train'}); "
                                    f"{leaf_recipe(name, base)}")
        self.train = leaf.LeafIndex(train)
        test = leaf.find_split(base, "test")
        self.test = leaf.LeafIndex(test) if test is not None else None
        users = self.train.users
        if fraction < 1.0:
            keep = max(1, int(round(fraction * len(users))))
            pick = np.sort(numpy_stream(seed, "data/leaf/users").choice(len(users), keep, replace=False))
            users = [users[i] for i in pick]
        self.users = users

    def load(self, index: leaf.LeafIndex, user: str) -> tuple[np.ndarray, np.ndarray]:
        """One user's (inputs, labels), or a LeafError naming the file and the user."""
        try:
            x, y = self.kind.decode(*index.load(user), user)
        except leaf.LeafError as exc:
            text = str(exc)
            where = str(index.path_of(user))
            raise leaf.LeafError(text if text.startswith(where) else f"{where}: {text}") from None
        except (TypeError, ValueError, OverflowError) as exc:   # values of another kind than the format's
            raise leaf.LeafError(f"{index.path_of(user)}: user {user!r}: unreadable data ({str(exc)[:120]})") from None
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= self.kind.n_classes):
            raise leaf.LeafError(f"{index.path_of(user)}: {self.name} user {user!r} has labels outside "
                                 f"0..{self.kind.n_classes - 1}")
        return x, y

    def test_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The selected users' test samples, pooled (LEAF's `-t sample` split); every test user's when
        none of the selected users is there (`-t user`: test users are other writers).  None without
        a test folder."""
        if self.test is None:
            return None
        names = [u.name for u in self.users if u.name in self.test.position] or [u.name for u in self.test.users]
        pairs = [self.load(self.test, name) for name in names]
        if not pairs:
            return None
        return np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs])


class LeafTask(ClassificationTask):
    """Natural partition: client k is user k; data read on first use (module docstring)."""

    def __init__(self, data: LeafData, spec: Any, seed: int) -> None:
        self.data, self.seed = data, seed
        self._loaded: dict[int, ClientData] = {}
        self._test: tuple[torch.Tensor, torch.Tensor] | None = None
        k = data.kind
        super().__init__(np.zeros((0, *k.input_shape), np.float32), np.zeros(0, np.int64), [], spec,
                         name=data.name, n_classes=k.n_classes)

    @property
    def num_clients(self) -> int:
        return len(self.data.users)

    def num_samples(self, client_id: int) -> int:
        return self.data.users[self._check(client_id)].num_samples

    def num_rows(self, client_id: int) -> int:
        """The index's count: a user's data is refused when it holds another (common/data/leaf.py)."""
        return self.num_samples(client_id)

    def user(self, client_id: int) -> str:
        return self.data.users[self._check(client_id)].name

    def _read(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.load(self.data.train, self.user(client_id))
        return torch.from_numpy(x), torch.from_numpy(y)

    def client_data(self, client_id: int) -> ClientData:
        data = self._loaded.get(self._check(client_id))
        if data is None:
            x, y = self._read(client_id)
            data = ClientData(tensors=(x, y), num_samples=int(y.shape[0]))
            self._loaded[client_id] = data
        return data

    def loaded_clients(self) -> list[int]:
        """The clients whose data this process has read (tests check lazy loading with it)."""
        return sorted(self._loaded)

    def client_labels(self, client_id: int) -> np.ndarray:
        data = self._loaded.get(client_id)
        return (data.tensors[1] if data is not None else self._read(client_id)[1]).numpy()

    def label_histograms(self) -> np.ndarray:
        return np.stack([np.bincount(self.client_labels(c), minlength=self.n_classes)
                         for c in range(self.num_clients)]) if self.num_clients else np.zeros((0, self.n_classes))

    def _sample(self) -> np.ndarray:
        n = self.num_clients
        if n <= LOSS_CLIENTS:
            return np.arange(n)
        return np.sort(numpy_stream(self.seed, "data/leaf/loss_sample").choice(n, LOSS_CLIENTS, replace=False))

    def train_loss(self, model: torch.nn.Module) -> float:
        """Sample-weighted training loss over every client, or over a seeded sample of LOSS_CLIENTS
        clients (stream "data/leaf/loss_sample") when there are more: the server would otherwise
        read the whole data set.  Clients read here are not kept."""
        total, weight = 0.0, 0
        for cid in self._sample():
            x, y = self._read(int(cid)) if int(cid) not in self._loaded else self._loaded[int(cid)].tensors
            if len(y):
                total += float(self._per_sample(model, x, y).sum())
                weight += int(len(y))
        return total / max(weight, 1)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        if self._test is None:
            arrays = self.data.test_arrays()
            if arrays is None:   # no test folder: the training data of the loss sample
                pairs = [self._read(int(c)) for c in self._sample()]
                x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
                return self.metrics(model, x, y, prefix="train")
            self._test = (torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1]))
        return self.metrics(model, *self._test, prefix="test")

    def _check(self, client_id: int) -> int:
        if not 0 <= client_id < len(self.data.users):
            raise IndexError(f"{self.name}: client id {client_id} out of range 0..{len(self.data.users) - 1}")
        return client_id


def base_folder(cfg: Any, p: LeafParams, default: str) -> Path:
    """`data.path` (relative: under data.data_dir, then the cwd), or data.data_dir/<default>."""
    if not p.path:
        return Path(cfg.data.data_dir) / default
    given = Path(p.path)
    if given.is_absolute():
        return given
    under = Path(cfg.data.data_dir) / given
    return under if under.exists() or not given.exists() else given


def build(cfg: Any, p: LeafParams, kind: LeafKind | None = None) -> ClassificationTask:
    """The task of a LEAF data set; `kind` for one not in KINDS (sent140: its input size is a key)."""
    from fedhop.common.tasks import make_partition, model_spec
    name = cfg.data.dataset
    data = LeafData(name, base_folder(cfg, p, name), p.fraction, int(cfg.run.seed), kind)
    kind = data.kind
    spec = model_spec(cfg, kind.input_shape, kind.n_classes)
    k = int(cfg.clients.count)
    if cfg.data.partition == "natural":
        if k > len(data.users):
            raise ValueError(f"{name}: partition = 'natural' gives one client per user: the data has {len(data.users)} "
                             f"users (data.fraction {p.fraction}) but clients.count = {k}; lower clients.count")
        if k < len(data.users):   # a seeded sample of clients.count users, kept in file order
            pick = np.sort(numpy_stream(int(cfg.run.seed), "data/leaf/clients").choice(len(data.users), k, replace=False))
            data.users = [data.users[i] for i in pick]
        return LeafTask(data, spec, int(cfg.run.seed))
    pairs = [data.load(data.train, u.name) for u in data.users]
    x_tr = np.concatenate([x for x, _ in pairs])
    y_tr = np.concatenate([y for _, y in pairs])
    test = data.test_arrays()
    parts = make_partition(cfg, y_tr)
    x_te, y_te = test if test is not None else (None, None)
    return ClassificationTask(x_tr, y_tr, parts, spec, x_te, y_te, name=name, n_classes=kind.n_classes)


REGISTER = {"femnist": (build, LeafParams), "shakespeare": (build, LeafParams)}   # data.dataset -> (builder, keys), one per KINDS
