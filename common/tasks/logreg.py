"""Synthetic(alpha, beta) federated softmax regression (Li et al. 2020, FedProx, Section 5.1).

For client k (as in the FedProx data generator):

    u_k ~ N(0, alpha),  W_k ~ N(u_k, 1) in R^{C x d},  b_k ~ N(u_k, 1) in R^C   (model skew)
    B_k ~ N(0, beta),   v_k ~ N(B_k, 1) in R^d                                 (feature skew)
    x ~ N(v_k, Sigma),  Sigma = diag(j^-1.2), j = 1..d
    y = argmax softmax(W_k x + b_k)

alpha controls how much local models differ, beta how much local features differ; `iid = true`
gives the paper's Synthetic-IID (one W, b ~ N(0, 1) and v = 0 for every client).  As in the
FedProx code, the second argument of N(., .) is used as the standard deviation.  Client sizes
are floor(LogNormal(samples_mean, samples_sigma)) + samples_min unless `sizes` lists them.
Each client keeps (1 - test_fraction) of its samples; the held-out rest, pooled over clients,
is the test set.  Every draw comes from "data/logreg/..." streams of the run seed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedhop.common.tasks.classification import ClassificationTask, ModelSpec
from fedhop.common.util.rng import numpy_stream, stream_seed


@dataclass
class LogRegParams:
    """[data] keys of dataset = "logreg".

    `alpha`: Synthetic(alpha, beta): how much the clients' local models differ
    `beta`: Synthetic(alpha, beta): how much the clients' features differ
    `dim`: features
    `classes`: classes
    `samples_sigma`: sigma of the log-normal client sizes
    `samples_min`: added to every log-normal client size (the fewest samples a client holds)
    `iid`: the paper's Synthetic-IID: one W, b ~ N(0, 1) and no feature shift for every client
    """

    alpha: float = field(default=1.0, metadata={"min": 0.0})
    beta: float = field(default=1.0, metadata={"min": 0.0})
    dim: int = field(default=60, metadata={"min": 1})
    classes: int = field(default=10, metadata={"min": 2})
    samples_mean: float = 4.0          # mu of the log-normal client sizes
    samples_sigma: float = field(default=2.0, metadata={"min": 0.0})
    samples_min: int = field(default=50, metadata={"min": 2})
    samples_max: int = field(default=0, metadata={"min": 0})   # cap on a client's size; 0 = none
    sizes: list = field(default_factory=list)  # explicit samples per client (overrides the log-normal)
    iid: bool = False


@dataclass
class SyntheticData:
    x_train: np.ndarray
    y_train: np.ndarray
    parts: list[np.ndarray]
    x_test: np.ndarray
    y_test: np.ndarray


def client_sizes(params: LogRegParams, n_clients: int, seed: int) -> np.ndarray:
    if params.sizes:
        sizes = np.asarray(params.sizes)
        if sizes.shape != (n_clients,) or not np.all(sizes == np.round(sizes)) or (sizes < 2).any():
            raise ValueError(f"data.sizes: expected {n_clients} integers >= 2 (one per client, "
                             f"clients.count = {n_clients}), got {list(params.sizes)}")
        return sizes.astype(np.int64)
    rng = numpy_stream(seed, "data/logreg/sizes")
    sizes = rng.lognormal(params.samples_mean, params.samples_sigma, n_clients).astype(np.int64) + params.samples_min
    if params.samples_max:
        if params.samples_max < params.samples_min:
            raise ValueError(f"data.samples_max ({params.samples_max}) must be 0 or >= data.samples_min "
                             f"({params.samples_min})")
        sizes = np.minimum(sizes, params.samples_max)
    return sizes


def generate(params: LogRegParams, n_clients: int, test_fraction: float, seed: int) -> SyntheticData:
    """Draw every client's data; deterministic in (params, n_clients, test_fraction, seed)."""
    d, n_cls = int(params.dim), int(params.classes)
    sizes = client_sizes(params, n_clients, seed)
    sigma_sd = np.arange(1, d + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt of diag(j^-1.2)
    if params.iid:
        g = numpy_stream(seed, "data/logreg/global")
        w_glob = g.normal(0.0, 1.0, (n_cls, d))
        b_glob = g.normal(0.0, 1.0, n_cls)
    xs_tr, ys_tr, xs_te, ys_te, parts = [], [], [], [], []
    offset = 0
    for k in range(n_clients):
        rng = numpy_stream(seed, f"data/logreg/client/{k}")
        if params.iid:
            w_k, b_k, v_k = w_glob, b_glob, np.zeros(d)
        else:
            u_k = rng.normal(0.0, params.alpha)
            w_k = rng.normal(u_k, 1.0, (n_cls, d))
            b_k = rng.normal(u_k, 1.0, n_cls)
            big_b = rng.normal(0.0, params.beta)
            v_k = rng.normal(big_b, 1.0, d)
        n_k = int(sizes[k])
        x = (v_k + rng.standard_normal((n_k, d)) * sigma_sd).astype(np.float32)
        y = np.argmax(x.astype(np.float64) @ w_k.T + b_k, axis=1).astype(np.int64)
        n_test = min(max(int(round(test_fraction * n_k)), 1), n_k - 1)
        perm = rng.permutation(n_k)
        tr, te = np.sort(perm[n_test:]), np.sort(perm[:n_test])
        xs_tr.append(x[tr])
        ys_tr.append(y[tr])
        xs_te.append(x[te])
        ys_te.append(y[te])
        parts.append(np.arange(offset, offset + len(tr), dtype=np.int64))
        offset += len(tr)
    return SyntheticData(np.concatenate(xs_tr), np.concatenate(ys_tr), parts,
                         np.concatenate(xs_te), np.concatenate(ys_te))


class LogRegTask(ClassificationTask):
    """Synthetic(alpha, beta) with a logreg (or MLP) model; clients are the generating devices."""

    def __init__(self, params: LogRegParams, n_clients: int, test_fraction: float, seed: int,
                 model_kind: str = "logreg", hidden: tuple[int, ...] = (64,), init: str = "default") -> None:
        if model_kind == "cnn":
            raise ValueError("model.kind = 'cnn' needs image data; dataset 'logreg' allows linear, logreg, mlp")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"data.test_fraction must be in (0, 1), got {test_fraction}")
        self.params = params
        data = generate(params, n_clients, test_fraction, seed)
        spec = ModelSpec(model_kind, (int(params.dim),), int(params.classes), tuple(hidden), init,
                         stream_seed(seed, "model/init"))
        super().__init__(data.x_train, data.y_train, data.parts, spec, data.x_test, data.y_test,
                         name="logreg", n_classes=int(params.classes))
