"""Cross-device federated data: any number of small clients, each made on demand from the seed.

`[data] dataset = "crossdevice"`.  A process builds nothing per client when it starts: the only
array over all clients is their sizes (8 bytes a client); a client's samples are generated when
one of its calls needs them, from its own stream ("data/crossdevice/client", id), and a few
recent clients are kept (`cache_clients`).  So a result depends only on the seed and the client
id, never on which process hosts the client, and a process hosting 25,000 clients holds the data
of the handful it is training.

Client sizes (`sizes`), drawn for every client at once from the stream "data/crossdevice/sizes":

- `"lognormal"`: floor(LogNormal(size_mean, size_sigma)) + size_min (FedProx's device sizes);
- `"pareto"`: floor(size_min * (1 + Lomax(pareto_shape))), a power-law tail of index
  `pareto_shape` (the smaller, the heavier);

each capped at `size_max` (0: no cap).

What a client holds (`base`):

- `"synthetic"`: FedProx's Synthetic(alpha, beta) (Li et al. 2020, Section 5.1), generated as
  common/tasks/logreg.py does for one device:
      u_k ~ N(0, alpha),  W_k ~ N(u_k, 1) in R^{C x d},  b_k ~ N(u_k, 1) in R^C   (model skew)
      B_k ~ N(0, beta),   v_k ~ N(B_k, 1) in R^d                                 (feature skew)
      x ~ N(v_k, diag(j^-1.2)),  y = argmax(W_k x + b_k)
  The test set is every sample of `test_clients` held-out devices (ids count .. count +
  test_clients - 1 of the same generator): new devices, as cross-device evaluation asks.
- `"digits"` or `"breast_cancer"` (scikit-learn's bundled sets): a partition of the bundled
  training split over any number of clients.  Client k draws its label mix
  p_k ~ Dirichlet(label_alpha * 1_C) and then its n_k samples: a label from p_k, a sample of
  that label uniformly from the training split.  Samples are drawn with replacement, so more
  clients than samples is allowed (each client holds its own copies; the test split is held out
  from every client).

The final `train_loss` of a run is estimated on a seeded sample of 1,000 clients
(`CrossDeviceTask.train_loss`); the rounds report their sampled clients' loss as always.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedhop.common.data import datasets
from fedhop.common.tasks.base import ClientData
from fedhop.common.tasks.classification import ClassificationTask
from fedhop.common.util.rng import numpy_stream

LOSS_CLIENTS = 1000   # clients in the final training-loss estimate (CrossDeviceTask.train_loss)
BUNDLED = {"digits": (datasets.load_digits, (8, 8)), "breast_cancer": (datasets.load_breast_cancer, None)}


@dataclass
class CrossDeviceParams:
    """[data] keys of dataset = "crossdevice".

    `base`: what a client holds: "synthetic" (FedProx's Synthetic(alpha, beta), made per device) or
        a partition of a bundled set ("digits", "breast_cancer")
    `sizes`: the law of the clients' sample counts: "lognormal" or "pareto"
    `size_min`: the fewest samples a client holds
    """

    base: str = field(default="synthetic", metadata={"choices": ("synthetic", "digits", "breast_cancer")})
    alpha: float = field(default=1.0, metadata={"min": 0.0})      # synthetic: model skew
    beta: float = field(default=1.0, metadata={"min": 0.0})       # synthetic: feature skew
    dim: int = field(default=60, metadata={"min": 1})             # synthetic: features
    classes: int = field(default=10, metadata={"min": 2})         # synthetic: classes
    sizes: str = field(default="lognormal", metadata={"choices": ("lognormal", "pareto")})
    size_mean: float = 3.0                                        # lognormal: mu
    size_sigma: float = field(default=1.0, metadata={"min": 0.0})  # lognormal: sigma
    pareto_shape: float = field(default=1.5, metadata={"min_exclusive": 0.0})   # pareto: tail index
    size_min: int = field(default=2, metadata={"min": 1})
    size_max: int = field(default=1000, metadata={"min": 0})      # cap on a client's samples; 0: none
    label_alpha: float = field(default=0.5, metadata={"min_exclusive": 0.0})    # bundled: label skew
    test_clients: int = field(default=200, metadata={"min": 1})   # synthetic: held-out devices
    cache_clients: int = field(default=64, metadata={"min": 0})   # clients' data kept per process


def client_sizes(p: CrossDeviceParams, n_clients: int, seed: int) -> np.ndarray:
    """Every client's sample count (module docstring), int64."""
    rng = numpy_stream(seed, "data/crossdevice/sizes")
    if p.sizes == "lognormal":
        sizes = np.floor(rng.lognormal(p.size_mean, p.size_sigma, n_clients)).astype(np.int64) + p.size_min
    else:
        sizes = np.floor(p.size_min * (1.0 + rng.pareto(p.pareto_shape, n_clients))).astype(np.int64)
    if p.size_max:
        if p.size_max < p.size_min:
            raise ValueError(f"data.size_max ({p.size_max}) must be 0 or >= data.size_min ({p.size_min})")
        sizes = np.minimum(sizes, p.size_max)
    return sizes


class SyntheticDevices:
    """FedProx's Synthetic(alpha, beta), one device at a time."""

    def __init__(self, p: CrossDeviceParams, seed: int) -> None:
        self.p, self.seed = p, seed
        self.sigma_sd = np.arange(1, p.dim + 1, dtype=np.float64) ** (-1.2 / 2)   # sqrt of diag(j^-1.2)

    def device(self, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        p, rng = self.p, numpy_stream(self.seed, "data/crossdevice/client", k)
        u = rng.normal(0.0, p.alpha)
        w = rng.normal(u, 1.0, (p.classes, p.dim))
        b = rng.normal(u, 1.0, p.classes)
        v = rng.normal(rng.normal(0.0, p.beta), 1.0, p.dim)
        x = (v + rng.standard_normal((n, p.dim)) * self.sigma_sd).astype(np.float32)
        y = np.argmax(x.astype(np.float64) @ w.T + b, axis=1).astype(np.int64)
        return x, y


class BundledDevices:
    """A bundled data set's training split spread over the clients (module docstring)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, n_classes: int, label_alpha: float, seed: int) -> None:
        self.x, self.y, self.seed = x, y, seed
        self.n_classes, self.label_alpha = n_classes, label_alpha
        self.by_label = [np.flatnonzero(y == c) for c in range(n_classes)]
        self.present = np.array([len(ix) > 0 for ix in self.by_label])

    def device(self, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        rng = numpy_stream(self.seed, "data/crossdevice/client", k)
        mix = rng.dirichlet(np.full(self.n_classes, self.label_alpha)) * self.present
        mix /= mix.sum()
        labels = rng.choice(self.n_classes, size=n, p=mix)
        picks = rng.random(n)
        idx = np.empty(n, dtype=np.int64)
        for c in np.unique(labels):
            at = labels == c
            idx[at] = self.by_label[c][(picks[at] * len(self.by_label[c])).astype(np.int64)]
        return self.x[idx], self.y[idx]


class CrossDeviceTask(ClassificationTask):
    """Classification over clients made on demand; the held-out test set is built at start."""

    def __init__(self, p: CrossDeviceParams, n_clients: int, seed: int, spec, devices, x_test, y_test,
                 n_classes: int) -> None:
        self.params, self.devices, self.seed = p, devices, seed
        self.sizes = client_sizes(p, n_clients, seed)
        self._cache: OrderedDict[int, ClientData] = OrderedDict()
        empty_x = np.zeros((0, *x_test.shape[1:]), dtype=np.float32)
        super().__init__(empty_x, np.zeros(0, dtype=np.int64), [], spec, x_test, y_test, name="crossdevice",
                         n_classes=n_classes)

    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    def num_samples(self, client_id: int) -> int:
        self._check_id(client_id)
        return int(self.sizes[client_id])

    def num_rows(self, client_id: int) -> int:
        return self.num_samples(client_id)   # a client is made with exactly its size's rows

    def client_data(self, client_id: int) -> ClientData:
        self._check_id(client_id)
        data = self._cache.get(client_id)
        if data is None:
            x, y = self.devices.device(client_id, int(self.sizes[client_id]))
            shape = self.model_spec.input_shape
            data = ClientData(tensors=(torch.from_numpy(x.reshape(len(x), *shape)), torch.from_numpy(y)),
                              num_samples=len(y))
            if self.params.cache_clients:
                self._cache[client_id] = data
                while len(self._cache) > self.params.cache_clients:
                    self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(client_id)
        return data

    def train_loss(self, model: torch.nn.Module) -> float:
        """The sample-weighted training loss over a seeded sample of LOSS_CLIENTS clients (stream
        "data/crossdevice/loss_sample"; every client when there are fewer): over every client it
        would generate every client's data.  Made and dropped here, not cached."""
        rng = numpy_stream(self.seed, "data/crossdevice/loss_sample")
        n = self.num_clients
        chosen = np.arange(n) if n <= LOSS_CLIENTS else np.sort(rng.choice(n, LOSS_CLIENTS, replace=False))
        total, weight = 0.0, 0
        shape = self.model_spec.input_shape
        with torch.no_grad():
            for cid in chosen:
                x, y = self.devices.device(int(cid), int(self.sizes[cid]))
                losses = self._per_sample(model, torch.from_numpy(x.reshape(len(x), *shape)), torch.from_numpy(y))
                total += float(losses.sum())
                weight += len(y)
        return total / max(weight, 1)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        assert self.x_test is not None and self.y_test is not None   # __init__ always passes a test set
        return self.metrics(model, self.x_test, self.y_test, prefix="test")

    def _check_id(self, client_id: int) -> None:
        if not 0 <= client_id < len(self.sizes):
            raise IndexError(f"crossdevice: client id {client_id} out of range 0..{len(self.sizes) - 1}")


def build(cfg: Any, p: CrossDeviceParams) -> CrossDeviceTask:
    """The task for `[data] dataset = "crossdevice"` (registered in common/tasks/__init__.py)."""
    from fedhop.common.tasks import _split, model_spec, standardize  # the shared steps of the bundled sets
    n, seed = int(cfg.clients.count), int(cfg.run.seed)
    if p.base == "synthetic":
        if cfg.model.kind == "cnn":
            raise ValueError("model.kind = 'cnn' needs image data; crossdevice base 'synthetic' allows linear, "
                             "logreg, mlp")
        devices: SyntheticDevices | BundledDevices = SyntheticDevices(p, seed)
        test = [devices.device(n + j, int(s)) for j, s in
                enumerate(client_sizes(p, n + p.test_clients, seed)[n:])]
        x_te = np.concatenate([x for x, _ in test])
        y_te = np.concatenate([y for _, y in test])
        return CrossDeviceTask(p, n, seed, model_spec(cfg, (p.dim,), p.classes), devices, x_te, y_te, p.classes)
    load, image_hw = BUNDLED[p.base]
    x, y = load()
    x_tr, y_tr, x_te, y_te = _split(cfg, x, y)
    if cfg.data.standardize:
        x_tr, x_te = standardize(x_tr, x_te)
    shape: tuple[int, ...] = (x_tr.shape[1],)
    if cfg.model.kind == "cnn":
        if image_hw is None:
            raise ValueError(f"model.kind = 'cnn' needs image data; crossdevice base '{p.base}' is tabular")
        shape = (1, *image_hw)
        x_te = x_te.reshape(-1, *shape)
    n_classes = int(y.max()) + 1
    devices = BundledDevices(np.asarray(x_tr, dtype=np.float32), np.asarray(y_tr, dtype=np.int64), n_classes,
                             p.label_alpha, seed)
    return CrossDeviceTask(p, n, seed, model_spec(cfg, shape, n_classes), devices, x_te, y_te, n_classes)


REGISTER = {"crossdevice": (build, CrossDeviceParams)}   # data.dataset -> (builder, its [data] keys)
