"""Synthetic statistical-recovery tasks of Bao et al. (ICML 2022), digest research/seed-001.md 4.1-4.2:
federated sparse linear regression ("lasso") and low-rank matrix estimation ("lowrank").

Both are least squares over linear measurements, f(w; x, y) = 1/2 (y - <x, w>)^2, with a known
true parameter w*, so `evaluate` reports statistical-recovery metrics.  The model is one tensor
"w" (shape (p,) for lasso, (rows, cols) for lowrank).

lasso (Example 3.1):   w* = (signal 1_s, 0_{p-s});  client k draws delta_k ~ N(0, shift^2 I_p) once,
                       x = delta_k + z with z ~ N(0, Sigma), Sigma_ij = ar^|i-j| (AR(1));
                       y = <x, w*> + eps, eps ~ N(0, noise^2).
                       Paper: p = 1024, s = 512, 64 clients x 128 samples, shift 1, ar 0.5, noise 1.
lowrank (Example 3.2): W* = signal diag(1_r, 0) (rows x cols); client k draws Z_k with iid
                       N(0, shift^2) entries once; X = Z_k + A, A iid N(0, 1); y = <X, W*> + eps.
                       Paper: 32 x 32, r = 16, 64 clients x 128 samples (a per-client Z_k as the
                       paper describes, not the reference code's shared one, digest 2.7 item 11).

Random streams: "data/<name>/client/<k>" (client k's shift, design and noise), "model/init" (the
initial point w0 = init_scale * N(0, I) under [model] init = "default", as the authors' code's
randn(p); zeros under init = "zeros").  Every parameter comes from the [data] section.

Metrics of `evaluate` (all on the pooled training data; there is no test set):
    distance_to_opt   ||w - w*||_2 (Frobenius for lowrank)
    train_mse         (1/N) ||Y - X w||^2 (the papers' "training loss", digest 4.1);  train_loss = train_mse / 2
    objective         train_loss + reg * R(w), with the run's [algorithm] regularizer and reg (when set)
    lasso:   l1_error ||w - w*||_1; support_f1: F1 of {j : |w_j| > support_threshold} (0.01 as in the
             authors' code) against supp(w*); support_f1_exact: the same with {j : w_j != 0};
             exact_zeros: #{j : w_j == 0}; exact_zeros_off_support: #{j not in supp(w*) : w_j == 0}; nnz
    lowrank: op_error ||W - W*||_op; rank: #{singular values > tol}, tol = rank_tol or, when 0,
             MATLAB's default max(rows, cols) * eps(model dtype) * sigma_max; nuclear_norm
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, cast

import numpy as np
import torch

from fedhop.common.tasks.base import ClientData, StackedLoss, Task
from fedhop.common.tasks.quadratic import VectorModel
from fedhop.common.util.rng import numpy_stream

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class LassoParams:
    """[data] keys of dataset = "lasso" (defaults: the paper's setting, digest 4.1).

    `dim`: p, the number of features
    `signal`: the value of w*'s nonzero entries
    `ar`: the AR(1) correlation of the features: Sigma_ij = ar^|i-j|
    `noise`: std of the label noise eps
    `support_threshold`: support_f1 counts |w_j| above this as nonzero
    `init_scale`: w0 = init_scale * N(0, I) under model.init = "default"
    `dtype`: dtype of the data and the model
    """

    dim: int = field(default=1024, metadata={"min": 1})
    sparsity: int = field(default=512, metadata={"min": 0})     # s: w* = (signal 1_s, 0_{p-s})
    signal: float = 1.0
    w_true: list = field(default_factory=list)                  # explicit w* (overrides dim, sparsity, signal)
    samples: int = field(default=128, metadata={"min": 1})      # per client
    sizes: list = field(default_factory=list)                   # explicit samples per client
    shift: float = field(default=1.0, metadata={"min": 0.0})    # heterogeneity: delta_k ~ N(0, shift^2 I)
    ar: float = field(default=0.5, metadata={"min": 0.0, "max": 0.999})
    noise: float = field(default=1.0, metadata={"min": 0.0})
    support_threshold: float = field(default=0.01, metadata={"min": 0.0})
    init_scale: float = field(default=1.0, metadata={"min": 0.0})
    dtype: str = field(default="float32", metadata={"choices": tuple(_DTYPES)})


@dataclass
class LowRankParams:
    """[data] keys of dataset = "lowrank" (defaults: the paper's setting, digest 4.2).

    `rows`: rows of W
    `cols`: columns of W
    `signal`: the value of W*'s nonzero diagonal entries
    `samples`: samples per client
    `sizes`: explicit samples per client (overrides samples)
    `noise`: std of the label noise eps
    `init_scale`: W0 = init_scale * N(0, I) under model.init = "default"
    `dtype`: dtype of the data and the model
    """

    rows: int = field(default=32, metadata={"min": 1})
    cols: int = field(default=32, metadata={"min": 1})
    rank: int = field(default=16, metadata={"min": 0})          # W* = signal diag(1_rank, 0)
    signal: float = 1.0
    w_true: list = field(default_factory=list)                  # explicit W* (list of rows)
    samples: int = field(default=128, metadata={"min": 1})
    sizes: list = field(default_factory=list)
    shift: float = field(default=1.0, metadata={"min": 0.0})    # Z_k entries ~ N(0, shift^2)
    noise: float = field(default=1.0, metadata={"min": 0.0})
    rank_tol: float = field(default=0.0, metadata={"min": 0.0})  # 0: MATLAB's rank() default
    init_scale: float = field(default=1.0, metadata={"min": 0.0})
    dtype: str = field(default="float32", metadata={"choices": tuple(_DTYPES)})


# ---------------------------------------------------------------------------- generators
def client_sizes(sizes: list, samples: int, n_clients: int) -> list[int]:
    if not sizes:
        return [int(samples)] * n_clients
    ok = len(sizes) == n_clients and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
    if not ok:
        raise ValueError(f"data.sizes: expected {n_clients} integers >= 1 (one per client, clients.count = "
                         f"{n_clients}), got {sizes!r}")
    return [int(s) for s in sizes]


def lasso_truth(p: LassoParams) -> np.ndarray:
    if p.w_true:
        w = np.asarray(p.w_true, dtype=np.float64)
        if w.ndim != 1 or not np.isfinite(w).all():
            raise ValueError(f"data.w_true: expected a flat list of finite numbers, got shape {w.shape}")
        return w
    if p.sparsity > p.dim:
        raise ValueError(f"data.sparsity = {p.sparsity} exceeds data.dim = {p.dim}")
    w = np.zeros(p.dim)
    w[:p.sparsity] = p.signal
    return w


def ar1_rows(noise: np.ndarray, ar: float) -> np.ndarray:
    """Rows with covariance Sigma_ij = ar^|i-j| from iid N(0, 1) `noise`:
    z_0 = n_0, z_j = ar z_{j-1} + sqrt(1 - ar^2) n_j (a stationary AR(1) along each row)."""
    if ar == 0:
        return noise
    s = math.sqrt(1.0 - ar * ar)
    cols = np.ascontiguousarray(noise.T)          # one contiguous row per coordinate
    out = np.empty_like(cols)
    out[0] = cols[0]
    for j in range(1, cols.shape[0]):
        np.multiply(out[j - 1], ar, out=out[j])
        out[j] += s * cols[j]
    return out.T


def generate_lasso(p: LassoParams, n_clients: int, seed: int):
    """(X (N, p), y (N,), per-client sizes, w*) in float64, deterministic in (p, n_clients, seed)."""
    w_star = lasso_truth(p)
    d = w_star.size
    xs, ys = [], []
    sizes = client_sizes(p.sizes, p.samples, n_clients)
    for k, n_k in enumerate(sizes):
        rng = numpy_stream(seed, "data/lasso/client", k)
        delta = rng.normal(0.0, 1.0, d) * p.shift
        x = delta + ar1_rows(rng.standard_normal((n_k, d)), p.ar)
        y = x @ w_star + p.noise * rng.standard_normal(n_k)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys), sizes, w_star


def lowrank_truth(p: LowRankParams) -> np.ndarray:
    if p.w_true:
        w = np.asarray(p.w_true, dtype=np.float64)
        if w.ndim != 2 or not np.isfinite(w).all():
            raise ValueError(f"data.w_true: expected a list of equal-length rows (a matrix), got shape {w.shape}")
        return w
    if p.rank > min(p.rows, p.cols):
        raise ValueError(f"data.rank = {p.rank} exceeds min(data.rows, data.cols) = {min(p.rows, p.cols)}")
    w = np.zeros((p.rows, p.cols))
    w[np.arange(p.rank), np.arange(p.rank)] = p.signal
    return w


def generate_lowrank(p: LowRankParams, n_clients: int, seed: int):
    """(X (N, rows, cols), y (N,), sizes, W*) in float64."""
    w_star = lowrank_truth(p)
    shape = w_star.shape
    xs, ys = [], []
    sizes = client_sizes(p.sizes, p.samples, n_clients)
    for k, n_k in enumerate(sizes):
        rng = numpy_stream(seed, "data/lowrank/client", k)
        z_k = rng.normal(0.0, 1.0, shape) * p.shift
        x = z_k + rng.standard_normal((n_k, *shape))
        y = np.einsum("nij,ij->n", x, w_star) + p.noise * rng.standard_normal(n_k)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys), sizes, w_star


# ---------------------------------------------------------------------------- the task
def f1_score(pred: np.ndarray, true: np.ndarray) -> float:
    tp = int(np.sum(pred & true))
    denom = int(np.sum(pred)) + int(np.sum(true))
    return 1.0 if denom == 0 else 2.0 * tp / denom


class LinearMeasurementTask(Task):
    """Least squares on linear measurements y = <x, w*> + eps with a known w*."""

    kind = "regression"

    def __init__(self, name: str, x: np.ndarray, y: np.ndarray, sizes: list[int], w_star: np.ndarray,
                 w0: np.ndarray, dtype: str = "float32", regularizer: str = "none", reg: float = 0.0,
                 support_threshold: float = 0.01, rank_tol: float = 0.0) -> None:
        if x.shape[1:] != w_star.shape:
            raise ValueError(f"{name}: measurements have shape {x.shape[1:]} but w* has {w_star.shape}")
        self.name = name
        self.dtype = _DTYPES[dtype]
        self.x = torch.tensor(x, dtype=self.dtype)
        self.y = torch.tensor(y, dtype=self.dtype)
        self._x_flat = self.x.reshape(self.x.shape[0], -1)
        self.w_star = torch.tensor(w_star, dtype=torch.float64)
        self.w0 = torch.tensor(w0, dtype=self.dtype)
        self.sizes = list(sizes)
        offsets = np.cumsum([0] + self.sizes)
        self._slices = [(int(offsets[i]), int(offsets[i + 1])) for i in range(len(self.sizes))]
        self._clients: dict[int, ClientData] = {}
        self.regularizer, self.reg = regularizer, float(reg)
        self.support_threshold = float(support_threshold)
        self.rank_tol = float(rank_tol)

    # ------------------------------------------------------------------ Task interface
    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    def build_model(self) -> torch.nn.Module:
        return VectorModel(self.w0)

    def client_data(self, client_id: int) -> ClientData:
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"{self.name}: client id {client_id} out of range 0..{self.num_clients - 1}")
        data = self._clients.get(client_id)
        if data is None:
            lo, hi = self._slices[client_id]
            data = ClientData(tensors=(self.x[lo:hi], self.y[lo:hi]), num_samples=hi - lo)
            self._clients[client_id] = data
        return data

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        x, y = batch[0], batch[1]
        pred = x.reshape(x.shape[0], -1) @ cast(VectorModel, model).w.reshape(-1)
        return 0.5 * (pred - y).pow(2).mean()

    def vectorizable(self) -> bool:
        return type(self).loss is LinearMeasurementTask.loss

    def sample_loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch[0], batch[1]
        return 0.5 * (x.reshape(x.shape[0], -1) @ cast(VectorModel, model).w.reshape(-1) - y).pow(2)

    def stacked_sample_loss(self, model: torch.nn.Module) -> StackedLoss | None:
        """`sample_loss` of m models w at once: x (m, B, ...), y (m, B), w (m, ...) -> (m, B)."""
        if type(self).sample_loss is not LinearMeasurementTask.sample_loss:
            return None

        def losses(params: Mapping[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            x, y = batch[0], batch[1]
            w = params["w"]
            pred = torch.matmul(x.reshape(*x.shape[:2], -1), w.reshape(w.shape[0], -1, 1)).squeeze(2)
            return 0.5 * (pred - y).pow(2)
        return losses

    def train_loss(self, model: torch.nn.Module) -> float:
        return 0.5 * self.train_mse(cast(VectorModel, model).w.detach())

    def train_mse(self, w: torch.Tensor) -> float:
        with torch.no_grad():
            resid = self._x_flat @ w.reshape(-1).to(self.dtype) - self.y
            return float(resid.double().pow(2).mean())

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        w_model = cast(VectorModel, model).w.detach()
        w = w_model.double()
        diff = w - self.w_star
        mse = self.train_mse(w_model)
        out = {"distance_to_opt": float(diff.norm()), "train_mse": mse, "train_loss": 0.5 * mse}
        if w.ndim == 1:
            out.update(self._sparsity_metrics(w, diff))
            reg_value = float(w.abs().sum())
        else:
            s = torch.linalg.svdvals(w)
            tol = self.rank_tol or max(w.shape) * torch.finfo(w_model.dtype).eps * float(s.max())
            out.update({"op_error": float(torch.linalg.matrix_norm(diff, ord=2)), "rank": float((s > tol).sum()),
                        "nuclear_norm": float(s.sum())})
            reg_value = float(s.sum())
        if self.regularizer == ("l1" if w.ndim == 1 else "nuclear") and self.reg > 0:
            out["objective"] = 0.5 * mse + self.reg * reg_value
        return out

    def _sparsity_metrics(self, w: torch.Tensor, diff: torch.Tensor) -> dict[str, float]:
        true = (self.w_star != 0).numpy()
        w_np = w.numpy()
        zeros = w_np == 0
        return {"l1_error": float(diff.abs().sum()),
                "support_f1": f1_score(np.abs(w_np) > self.support_threshold, true),
                "support_f1_exact": f1_score(~zeros, true),
                "exact_zeros": float(zeros.sum()),
                "exact_zeros_off_support": float((zeros & ~true).sum()),
                "nnz": float((~zeros).sum())}

    # ------------------------------------------------------------------ references
    def design(self) -> tuple[np.ndarray, np.ndarray]:
        """(X (N, p) flattened, y) in float64: for centralized reference solvers in tests."""
        return self._x_flat.double().numpy(), self.y.double().numpy()


# ---------------------------------------------------------------------------- builders
def _initial_point(cfg: Any, shape: tuple[int, ...], scale: float) -> np.ndarray:
    if cfg.model.init == "zeros":
        return np.zeros(shape)
    return numpy_stream(cfg.run.seed, "model/init").standard_normal(shape) * scale


def _reg(cfg: Any) -> tuple[str, float]:
    return getattr(cfg.algorithm, "regularizer", "none"), float(getattr(cfg.algorithm, "reg", 0.0))


def build_lasso(cfg: Any, p: LassoParams) -> Task:
    x, y, sizes, w_star = generate_lasso(p, int(cfg.clients.count), int(cfg.run.seed))
    regularizer, reg = _reg(cfg)
    return LinearMeasurementTask("lasso", x, y, sizes, w_star, _initial_point(cfg, w_star.shape, p.init_scale),
                                 p.dtype, regularizer, reg, support_threshold=p.support_threshold)


def build_lowrank(cfg: Any, p: LowRankParams) -> Task:
    x, y, sizes, w_star = generate_lowrank(p, int(cfg.clients.count), int(cfg.run.seed))
    regularizer, reg = _reg(cfg)
    return LinearMeasurementTask("lowrank", x, y, sizes, w_star, _initial_point(cfg, w_star.shape, p.init_scale),
                                 p.dtype, regularizer, reg, rank_tol=p.rank_tol)


REGISTER = {"lasso": (build_lasso, LassoParams), "lowrank": (build_lowrank, LowRankParams)}   # data.dataset -> (builder, keys)
