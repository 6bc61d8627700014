"""Separable quadratic clients (DESIGN.md section 7), for checks against closed forms.

    f_i(w) = 1/2 sum_j C_ij (w_j - A_ij)^2                 (client i, curvatures C, centers A)
    F(w)   = sum_i p_i f_i(w),  p_i = n_i / sum_k n_k       (n_i = sizes[i])
    w*_j   = sum_i p_i C_ij A_ij / sum_i p_i C_ij           (the unique minimiser of F)

The model is one tensor named "w".  Optional gradient noise: the loss adds noise * <xi, w>
with xi ~ N(0, I) from the client's generator, so the stochastic gradient
C_i (w - A_i) + noise * xi is unbiased with per-coordinate standard deviation `noise`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence, cast

import numpy as np
import torch

from fedhop.common.tasks.base import ClientData, StackedLoss, Task

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class QuadraticParams:
    """[data] keys of dataset = "quadratic".

    Give `centers` (one row per client) and optionally `curvatures` (default all ones),
    or leave `centers` empty and set `dim` to draw them: A_ij ~ N(0, spread^2) and
    C_ij ~ U[curvature_low, curvature_high] from the "data/quadratic" stream.

    `centers`: A, the centers: one row per client (empty: drawn, see `dim`)
    `curvatures`: C, the curvatures: one row per client (empty: all ones, or drawn with `dim`)
    `noise`: std of additive gradient noise
    `dim`: with `centers` empty: draw the centers and curvatures in this dimension
    `spread`: drawn centers: A_ij ~ N(0, spread^2)
    `curvature_low`: drawn curvatures: C_ij ~ U[curvature_low, curvature_high]
    `curvature_high`: drawn curvatures: the upper end
    `dtype`: dtype of the data and the model
    """

    centers: list = field(default_factory=list)
    curvatures: list = field(default_factory=list)
    sizes: list = field(default_factory=list)     # samples per client (weights); default 1 each
    noise: float = field(default=0.0, metadata={"min": 0.0})
    w0: list = field(default_factory=list)        # initial w; default zeros
    dim: int = field(default=0, metadata={"min": 0})
    spread: float = field(default=1.0, metadata={"min": 0.0})
    curvature_low: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    curvature_high: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    dtype: str = field(default="float32", metadata={"choices": tuple(_DTYPES)})


class VectorModel(torch.nn.Module):
    """A model that is one parameter vector `w` (no forward pass; tasks read `w` directly)."""

    def __init__(self, w0: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w0.clone())

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        return self.w


def _matrix(name: str, value: Sequence | np.ndarray, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"data.{name}: expected a list of equal-length numeric lists ({exc})") from exc
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"data.{name}: expected a non-empty list of equal-length numeric lists "
                         f"(one row per client), got shape {arr.shape}")
    if (rows is not None and arr.shape[0] != rows) or (cols is not None and arr.shape[1] != cols):
        raise ValueError(f"data.{name}: expected shape ({rows}, {cols}) like data.centers, got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"data.{name}: holds NaN or Inf")
    return arr


class QuadraticTask(Task):
    kind = "quadratic"

    def __init__(self, centers: Sequence | np.ndarray, curvatures: Sequence | np.ndarray | None = None,
                 sizes: Sequence | None = None, noise: float = 0.0, w0: Sequence | None = None,
                 dtype: str = "float32") -> None:
        a = _matrix("centers", centers)
        n, d = a.shape
        c = np.ones_like(a) if curvatures is None or len(curvatures) == 0 else _matrix("curvatures", curvatures, n, d)
        if (c < 0).any():
            raise ValueError("data.curvatures: entries must be >= 0 (each f_i must be convex)")
        s = np.ones(n) if sizes is None or len(sizes) == 0 else np.asarray(sizes, dtype=np.float64)
        if s.shape != (n,) or not (s > 0).all() or not np.all(s == np.round(s)):
            raise ValueError(f"data.sizes: expected {n} positive integers (one per client, like data.centers), "
                             f"got {list(np.asarray(sizes).ravel())}")
        if not noise >= 0:
            raise ValueError(f"data.noise must be >= 0, got {noise}")
        if dtype not in _DTYPES:
            raise ValueError(f"data.dtype = {dtype!r} is not allowed (allowed: {', '.join(_DTYPES)})")
        p = s / s.sum()
        denom = p @ c
        if (denom <= 0).any():
            j = int(np.flatnonzero(denom <= 0)[0])
            raise ValueError(f"data.curvatures: coordinate {j} has zero curvature on every client, "
                             f"so the optimum is not unique")
        w_init = np.zeros(d) if w0 is None or len(w0) == 0 else np.asarray(w0, dtype=np.float64)
        if w_init.shape != (d,):
            raise ValueError(f"data.w0: expected {d} numbers (the dimension of data.centers), got shape {w_init.shape}")
        self.dtype = _DTYPES[dtype]
        self.centers = torch.tensor(a, dtype=self.dtype)
        self.curvatures = torch.tensor(c, dtype=self.dtype)
        self.sizes = [int(v) for v in s]
        self.weights = torch.tensor(p, dtype=torch.float64)
        self.noise = float(noise)
        self.w0 = torch.tensor(w_init, dtype=self.dtype)
        # closed-form optimum and optimal value, in float64
        self._a64, self._c64 = torch.from_numpy(a), torch.from_numpy(c)   # float64 views, no copies
        self._w_star = torch.tensor((p @ (c * a)) / denom)
        self._f_star = self._objective64(self._w_star)

    # ------------------------------------------------------------------ Task interface
    @property
    def num_clients(self) -> int:
        return int(self.centers.shape[0])

    @property
    def dim(self) -> int:
        return int(self.centers.shape[1])

    def build_model(self) -> torch.nn.Module:
        return VectorModel(self.w0)

    def num_samples(self, client_id: int) -> int:
        """`client_data(client_id).num_samples` without slicing the client's tensors."""
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"quadratic: client id {client_id} out of range 0..{self.num_clients - 1}")
        return self.sizes[client_id]

    def client_data(self, client_id: int) -> ClientData:
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"quadratic: client id {client_id} out of range 0..{self.num_clients - 1}")
        return ClientData(tensors=(self.centers[client_id][None], self.curvatures[client_id][None]),
                          num_samples=self.sizes[client_id])

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        a, c = batch[0], batch[1]
        w = cast(VectorModel, model).w
        value = (0.5 * (c * (w[None, :] - a).pow(2)).sum(1)).mean()
        if self.noise > 0 and generator is not None:
            xi = torch.randn(w.shape, generator=generator, dtype=w.dtype).to(w.device)   # the CPU stream on any device
            value = value + self.noise * torch.dot(xi, w)
        return value

    def vectorizable(self) -> bool:
        return self.noise == 0 and type(self).loss is QuadraticTask.loss   # noise draws from the generator

    def sample_loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        a, c = batch[0], batch[1]
        return 0.5 * (c * (cast(VectorModel, model).w[None, :] - a).pow(2)).sum(1)

    def stacked_sample_loss(self, model: torch.nn.Module) -> StackedLoss | None:
        """`sample_loss` of m vectors w at once: a, c (m, B, d), w (m, d) -> (m, B)."""
        if type(self).sample_loss is not QuadraticTask.sample_loss:
            return None

        def losses(params: Mapping[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            a, c = batch[0], batch[1]
            return 0.5 * (c * (params["w"][:, None, :] - a).pow(2)).sum(2)
        return losses

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        w = cast(VectorModel, model).w.detach().double()
        f = self._objective64(w)
        return {"objective": f, "train_loss": f, "suboptimality": f - self._f_star,
                "distance_to_opt": float((w - self._w_star).norm())}

    def train_loss(self, model: torch.nn.Module) -> float:
        return self._objective64(cast(VectorModel, model).w.detach().double())

    # ------------------------------------------------------------------ closed forms
    def optimum(self) -> torch.Tensor:
        """w* (float64)."""
        return self._w_star.clone()

    def optimal_value(self) -> float:
        return self._f_star

    def objective(self, w: torch.Tensor) -> float:
        return self._objective64(w.detach().double())

    def client_gradient(self, client_id: int, w: torch.Tensor) -> torch.Tensor:
        """grad f_i(w) = C_i (w - A_i), in float64."""
        return self._c64[client_id] * (w.detach().double() - self._a64[client_id])

    def _objective64(self, w: torch.Tensor) -> float:
        f_i = 0.5 * (self._c64 * (w[None, :] - self._a64).pow(2)).sum(1)
        return float(self.weights @ f_i)


def generate_problem(params: QuadraticParams, n_clients: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random centers and curvatures for `n_clients` clients of dimension `params.dim`."""
    if params.dim < 1:
        raise ValueError("quadratic: give data.centers (one row per client) or data.dim >= 1 to draw them")
    if params.curvature_high < params.curvature_low:
        raise ValueError(f"data.curvature_high ({params.curvature_high}) must be >= data.curvature_low "
                         f"({params.curvature_low})")
    centers = rng.normal(0.0, params.spread, size=(n_clients, params.dim))
    curv = rng.uniform(params.curvature_low, params.curvature_high, size=(n_clients, params.dim))
    return centers, curv
