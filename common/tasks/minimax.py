"""Minimax tasks: min over x, max over y of F(x, y) = sum_i p_i f_i(x, y)  (seed-003, section 1).

How a minimax task talks to the algorithms (common/algorithms/minimax.py):

- **Which parameters maximise.**  By name: a model parameter named `y`, or whose name starts
  with `y.`, belongs to the maximising part; every other trainable parameter is minimised.
  The rule needs no task object, so the server (which never builds one for its algorithm)
  and the edges split a model the same way the clients do.
- **The constraint on y.**  The task's `max_constraint` (a `common.projections.Constraint`).
  Clients project y after every local step and send `max_constraint.spec()` as a payload
  scalar; the server projects after its step with the same set.
- **The loss** `task.loss(model, batch, generator)` is f_i(x, y) on the batch itself: the
  algorithms descend on x and ascend on y along its gradient.

Data sets (`[data] dataset = ...`):

- `minimax_quadratic`: f_i(x, y) = a_i/2 ||x - u_i||^2 + b <x, y> - c_i/2 ||y - v_i||^2 (DESIGN.md
  section 7), a_i and c_i scalars or per-coordinate vectors.  The saddle point of any weighting
  is in closed form (`saddle_point`); `evaluate` reports the distance to the true saddle.
- `robust_digits`: min_x max_{||y|| <= r} mean_j CE(h_x(a_j + y), b_j), one universal input
  perturbation y (seed-003 Eq. 8) on sklearn's digits, pixels scaled to [0, 1].
- `fair_digits`: min_x max_{y in simplex} sum_c y_c F_c(x) - lam/2 ||y||^2, F_c the mean loss of
  class c in the batch (seed-003 Eq. 9); metric: the worst class's test accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhop.common.data import datasets
from fedhop.common.numerics.projections import NO_CONSTRAINT, Constraint
from fedhop.common.tasks import make_partition, model_spec, standardize
from fedhop.common.tasks.base import ClientData, Task
from fedhop.common.tasks.classification import ClassificationTask, ModelSpec
from fedhop.common.util.rng import numpy_stream

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


# ============================================================================ quadratic
@dataclass
class MinimaxQuadraticParams:
    """[data] keys of dataset = "minimax_quadratic".

    Give `u`, `v` (one row per client) and `a`, `c` (one entry per client: a number, or a list
    of per-coordinate curvatures), or leave `u` empty and set `dim` to draw them from the
    "data/minimax_quadratic" stream: u, v ~ N(0, spread^2), a, c ~ U[curvature_low, curvature_high]
    per coordinate.

    `a`: a_i, the x-curvature of f_i(x, y) = a_i/2 ||x - u_i||^2 + b <x, y> - c_i/2 ||y - v_i||^2:
        one entry per client, a number or per-coordinate list
    `c`: c_i, the y-curvature of f_i (like `a`)
    `u`: u_i, the x-center of f_i: one row per client (empty: drawn, see `dim`)
    `v`: v_i, the y-center of f_i: one row per client
    `b`: b, the coupling <x, y> of every f_i
    `dim`: with `u` empty: draw u, v, a, c in this dimension
    `spread`: drawn centers: u, v ~ N(0, spread^2)
    `curvature_low`: drawn curvatures: a, c ~ U[curvature_low, curvature_high]
    `curvature_high`: drawn curvatures: the upper end
    `dtype`: dtype of the data and the model
    """

    a: list = field(default_factory=list)
    c: list = field(default_factory=list)
    u: list = field(default_factory=list)
    v: list = field(default_factory=list)
    b: float = 0.5
    sizes: list = field(default_factory=list)      # samples per client (weights p_i); default 1 each
    noise: float = field(default=0.0, metadata={"min": 0.0})   # std of additive gradient noise
    x0: list = field(default_factory=list)         # initial x (default zeros)
    y0: list = field(default_factory=list)         # initial y (default zeros)
    dim: int = field(default=0, metadata={"min": 0})
    spread: float = field(default=1.0, metadata={"min": 0.0})
    curvature_low: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    curvature_high: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    dtype: str = field(default="float32", metadata={"choices": tuple(_DTYPES)})


class SaddleModel(nn.Module):
    """Two parameter vectors: `x` (minimised) and `y` (maximised); no forward pass."""

    def __init__(self, x0: torch.Tensor, y0: torch.Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(x0.clone())
        self.y = nn.Parameter(y0.clone())

    def forward(self, _inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def saddle_point(a: np.ndarray, c: np.ndarray, u: np.ndarray, v: np.ndarray, b: float,
                 weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Saddle point of sum_i w_i f_i (seed-003 section 5.1), per coordinate j:

        abar = sum w_i a_ij,  ubar = sum w_i a_ij u_ij / abar,  cbar, vbar likewise,
        abar (x - ubar) + b y = 0  and  b x - cbar (y - vbar) = 0
        =>  x = (abar ubar - b vbar) / (abar + b^2 / cbar),   y = vbar + (b / cbar) x.

    `a`, `c`, `u`, `v` are (n, d) arrays (scalar curvatures broadcast to (n, d)).
    """
    w = np.asarray(weights, dtype=np.float64)
    a, c, u, v = (np.asarray(t, dtype=np.float64) for t in (a, c, u, v))
    abar, cbar = w @ a, w @ c
    if (abar <= 0).any() or (cbar <= 0).any():
        raise ValueError("minimax_quadratic: the weighted curvatures sum(w_i a_i), sum(w_i c_i) must be > 0 "
                         "in every coordinate (otherwise the saddle point is not unique)")
    ubar, vbar = (w @ (a * u)) / abar, (w @ (c * v)) / cbar
    x = (abar * ubar - b * vbar) / (abar + b * b / cbar)
    y = vbar + (b / cbar) * x
    return x, y


def _per_client_curvature(name: str, value: Sequence | np.ndarray, n: int, d: int) -> np.ndarray:
    if len(value) == 0:
        return np.ones((n, d))
    if len(value) != n:
        raise ValueError(f"data.{name}: expected {n} entries (one per client, like data.u), got {len(value)}")
    rows = []
    for i, entry in enumerate(value):
        arr = np.asarray(entry, dtype=np.float64)
        if arr.ndim == 0:
            arr = np.full(d, float(arr))
        if arr.shape != (d,):
            raise ValueError(f"data.{name}[{i}]: expected a number or a list of {d} numbers, got {entry!r}")
        rows.append(arr)
    out = np.stack(rows)
    if not np.isfinite(out).all() or (out < 0).any():
        raise ValueError(f"data.{name}: entries must be finite and >= 0")
    return out


def _rows(name: str, value: Sequence | np.ndarray, n: int | None = None, d: int | None = None) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"data.{name}: expected a list of equal-length numeric lists ({exc})") from None
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"data.{name}: expected a non-empty list of equal-length numeric lists (one row per "
                         f"client), got shape {arr.shape}")
    if (n is not None and arr.shape[0] != n) or (d is not None and arr.shape[1] != d):
        raise ValueError(f"data.{name}: expected shape ({n}, {d}) like data.u, got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"data.{name}: holds NaN or Inf")
    return arr


class MinimaxQuadraticTask(Task):
    """f_i(x, y) = a_i/2 ||x - u_i||^2 + b <x, y> - c_i/2 ||y - v_i||^2 (a_i, c_i diagonal)."""

    kind = "minimax"
    max_constraint = NO_CONSTRAINT

    def __init__(self, a: Sequence | np.ndarray, c: Sequence | np.ndarray, u: Sequence | np.ndarray,
                 v: Sequence | np.ndarray, b: float = 0.5,
                 sizes: Sequence | None = None, noise: float = 0.0, x0: Sequence | None = None,
                 y0: Sequence | None = None, dtype: str = "float32") -> None:
        uu = _rows("u", u)
        n, d = uu.shape
        vv = _rows("v", v, n, d)
        aa = _per_client_curvature("a", a, n, d)
        cc = _per_client_curvature("c", c, n, d)
        s = np.ones(n) if sizes is None or len(sizes) == 0 else np.asarray(sizes, dtype=np.float64)
        if s.shape != (n,) or not (s > 0).all() or not np.all(s == np.round(s)):
            raise ValueError(f"data.sizes: expected {n} positive integers (one per client, like data.u), "
                             f"got {list(np.asarray(sizes).ravel())}")
        if not noise >= 0:
            raise ValueError(f"data.noise must be >= 0, got {noise}")
        if dtype not in _DTYPES:
            raise ValueError(f"data.dtype = {dtype!r} is not allowed (allowed: {', '.join(_DTYPES)})")
        self.dtype = _DTYPES[dtype]
        self.a, self.c, self.u, self.v = aa, cc, uu, vv          # float64 numpy, (n, d)
        self.b = float(b)
        self.sizes = [int(t) for t in s]
        self.weights = s / s.sum()                                # p_i
        self.noise = float(noise)
        self._x_star, self._y_star = saddle_point(aa, cc, uu, vv, self.b, self.weights)
        self.x0 = self._init("x0", x0, d)
        self.y0 = self._init("y0", y0, d)
        self._client_tensors = [tuple(torch.tensor(t[i][None], dtype=self.dtype) for t in (aa, cc, uu, vv))
                                for i in range(n)]

    @staticmethod
    def _init(name: str, value: Sequence | None, d: int) -> torch.Tensor:
        arr = np.zeros(d) if value is None or len(value) == 0 else np.asarray(value, dtype=np.float64)
        if arr.shape != (d,):
            raise ValueError(f"data.{name}: expected {d} numbers (the width of data.u), got shape {arr.shape}")
        return torch.tensor(arr)

    # ------------------------------------------------------------------ Task interface
    @property
    def num_clients(self) -> int:
        return int(self.u.shape[0])

    @property
    def dim(self) -> int:
        return int(self.u.shape[1])

    def build_model(self) -> nn.Module:
        return SaddleModel(self.x0.to(self.dtype), self.y0.to(self.dtype))

    def client_data(self, client_id: int) -> ClientData:
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"minimax_quadratic: client id {client_id} out of range 0..{self.num_clients - 1}")
        return ClientData(tensors=self._client_tensors[client_id], num_samples=self.sizes[client_id])

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        a, c, u, v = batch
        saddle = cast(SaddleModel, model)
        x, y = saddle.x, saddle.y
        value = (0.5 * (a * (x[None] - u).pow(2)).sum(1) + self.b * torch.dot(x, y)
                 - 0.5 * (c * (y[None] - v).pow(2)).sum(1)).mean()
        if self.noise > 0 and generator is not None:
            # unbiased noise on both gradients: grad_x += noise * xi_x, grad_y += noise * xi_y
            xi = torch.randn((2, x.numel()), generator=generator, dtype=x.dtype).to(x.device)   # the CPU stream on any device
            value = value + self.noise * (torch.dot(xi[0], x) + torch.dot(xi[1], y))
        return value

    def vectorizable(self) -> bool:
        return self.noise == 0 and type(self).loss is MinimaxQuadraticTask.loss   # noise draws from the generator

    def sample_loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Each row's a/2 ||x - u||^2 + b <x, y> - c/2 ||y - v||^2 (`loss` is their mean)."""
        a, c, u, v = batch
        saddle = cast(SaddleModel, model)
        x, y = saddle.x, saddle.y
        return 0.5 * (a * (x[None] - u).pow(2)).sum(1) + self.b * torch.dot(x, y) - 0.5 * (c * (y[None] - v).pow(2)).sum(1)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        saddle = cast(SaddleModel, model)
        x, y = (t.detach().double().numpy() for t in (saddle.x, saddle.y))
        dist = float(np.sqrt(np.sum((x - self._x_star) ** 2) + np.sum((y - self._y_star) ** 2)))
        value = self.objective(x, y)
        return {"distance_to_saddle": dist, "distance_to_opt": dist,
                "x_error": float(np.linalg.norm(x - self._x_star)),
                "y_error": float(np.linalg.norm(y - self._y_star)),
                "objective": value, "train_loss": value}

    def train_loss(self, model: nn.Module) -> float:
        saddle = cast(SaddleModel, model)
        return self.objective(saddle.x.detach().double().numpy(), saddle.y.detach().double().numpy())

    # ------------------------------------------------------------------ closed forms
    def saddle(self, weights: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The saddle point of sum_i w_i f_i (default w = p, the true problem)."""
        if weights is None:
            return self._x_star.copy(), self._y_star.copy()
        return saddle_point(self.a, self.c, self.u, self.v, self.b, weights)

    def objective(self, x: np.ndarray, y: np.ndarray) -> float:
        f = (0.5 * (self.a * (x[None] - self.u) ** 2).sum(1) + self.b * float(x @ y)
             - 0.5 * (self.c * (y[None] - self.v) ** 2).sum(1))
        return float(self.weights @ f)


def _build_minimax_quadratic(cfg: Any, p: MinimaxQuadraticParams) -> Task:
    a: list | np.ndarray
    c: list | np.ndarray
    u: list | np.ndarray
    v: list | np.ndarray
    a, c, u, v = p.a, p.c, p.u, p.v
    if len(u) == 0:
        if p.dim < 1:
            raise ValueError("minimax_quadratic: give data.u and data.v (one row per client) or data.dim >= 1 "
                             "to draw them")
        if p.curvature_high < p.curvature_low:
            raise ValueError(f"data.curvature_high ({p.curvature_high}) must be >= data.curvature_low "
                             f"({p.curvature_low})")
        n = int(cfg.clients.count)
        rng = numpy_stream(cfg.run.seed, "data/minimax_quadratic")
        u = rng.normal(0.0, p.spread, size=(n, p.dim))
        v = rng.normal(0.0, p.spread, size=(n, p.dim))
        a = rng.uniform(p.curvature_low, p.curvature_high, size=(n, p.dim))
        c = rng.uniform(p.curvature_low, p.curvature_high, size=(n, p.dim))
    elif len(v) == 0:
        raise ValueError("minimax_quadratic: data.u is given but data.v is not (one row per client each)")
    task = MinimaxQuadraticTask(a, c, u, v, p.b, p.sizes, p.noise, p.x0, p.y0, p.dtype)
    if task.num_clients != cfg.clients.count:
        raise ValueError(f"data.u has {task.num_clients} rows (clients) but clients.count = {cfg.clients.count}; "
                         f"they must match")
    return task


# ============================================================================ digits tasks
class PerturbedInput(nn.Module):
    """h_x(a + y): a classifier `net` (the x part) behind one additive input perturbation `y`."""

    def __init__(self, net: nn.Module, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.y = nn.Parameter(torch.zeros(input_shape))
        self.net = net

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs + self.y)


class ClassWeighted(nn.Module):
    """A classifier `net` (the x part) and class weights `y` on the simplex (start: uniform)."""

    def __init__(self, net: nn.Module, n_classes: int) -> None:
        super().__init__()
        self.y = nn.Parameter(torch.full((n_classes,), 1.0 / n_classes))
        self.net = net

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


def _eval_set(task: ClassificationTask) -> tuple[torch.Tensor, torch.Tensor]:
    """The test set when the task has one, else its training arrays."""
    if task.x_test is not None and task.y_test is not None:   # ClassificationTask holds both or neither
        return task.x_test, task.y_test
    return task.x, task.y


def _net(spec: ModelSpec) -> nn.Module:
    from fedhop.common.models import build_model
    return build_model(spec.kind, spec.input_shape, spec.n_outputs, spec.hidden, spec.init, spec.seed,
                       bias=spec.bias, task="classification", factory=spec.factory,
                       factory_args=dict(spec.factory_args))


@dataclass
class RobustDigitsParams:
    """[data] keys of dataset = "robust_digits" (pixels in [0, 1]; data.standardize is not used,
    since the ball's radius is in pixel units).

    `attack_lr`: evaluation: step size of the projected ascent
    """

    radius: float = field(default=1.0, metadata={"min_exclusive": 0.0})   # ||y||_2 <= radius
    attack_steps: int = field(default=10, metadata={"min": 0})   # evaluation: projected ascent steps
    attack_lr: float = field(default=0.5, metadata={"min_exclusive": 0.0})


class RobustDigitsTask(ClassificationTask):
    """Universal-perturbation robust training (seed-003 Eq. 8); f_i = mean CE(h_x(a + y), b)."""

    device_evaluation = False   # evaluate reads the CPU test set directly

    kind = "minimax"

    def __init__(self, *args: Any, radius: float = 1.0, attack_steps: int = 10, attack_lr: float = 0.5,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_constraint = Constraint("ball", float(radius))
        self.attack_steps = int(attack_steps)
        self.attack_lr = float(attack_lr)

    def build_model(self) -> nn.Module:
        return PerturbedInput(_net(self.model_spec), tuple(self.model_spec.input_shape))

    def universal_attack(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A universal perturbation in the ball that raises the test loss of `net`: projected
        gradient ascent from 0, `attack_steps` steps of size attack_lr * radius (normalised)."""
        delta = torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)
        for _ in range(self.attack_steps):
            delta.requires_grad_(True)
            with torch.enable_grad():
                loss = F.cross_entropy(net(x + delta), y)
                (grad,) = torch.autograd.grad(loss, delta)
            with torch.no_grad():
                step = grad / grad.norm().clamp_min(1e-12)
                delta = self.max_constraint.project(delta + self.attack_lr * self.max_constraint.size * step)
        return delta.detach()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x, y = _eval_set(self)
        perturbed = cast(PerturbedInput, model)
        with torch.no_grad():
            clean = perturbed.net(x)
            learned = model(x)
        out = {"test_accuracy": float((clean.argmax(1) == y).double().mean()),
               "test_loss": float(F.cross_entropy(clean, y)),
               "robust_test_accuracy": float((learned.argmax(1) == y).double().mean()),
               "robust_test_loss": float(F.cross_entropy(learned, y)),
               "perturbation_norm": float(perturbed.y.detach().norm())}
        if self.attack_steps:
            delta = self.universal_attack(perturbed.net, x, y)
            with torch.no_grad():
                attacked = perturbed.net(x + delta)
            out["attack_test_accuracy"] = float((attacked.argmax(1) == y).double().mean())
        return out


@dataclass
class FairDigitsParams:
    """[data] keys of dataset = "fair_digits"."""

    lam: float = field(default=0.1, metadata={"min": 0.0})   # lambda of -lambda/2 ||y||^2 (seed-003 Eq. 9)


class FairDigitsTask(ClassificationTask):
    """Fair classification (seed-003 Eq. 9): f_i = sum_c y_c F_{i,c}(x) - lam/2 ||y||^2 with
    F_{i,c} the mean cross-entropy of the batch's class-c samples (0 for a class the batch lacks)."""

    device_evaluation = False   # evaluate reads the CPU test set directly

    kind = "minimax"

    def __init__(self, *args: Any, lam: float = 0.1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lam = float(lam)
        self.max_constraint = Constraint("simplex", 1.0)

    def build_model(self) -> nn.Module:
        return ClassWeighted(_net(self.model_spec), self.n_classes)

    def class_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """F_c for c = 0..C-1: mean cross-entropy over the rows of class c (0 where none)."""
        per = F.cross_entropy(logits, labels, reduction="none")
        sums = torch.zeros(self.n_classes, dtype=per.dtype, device=per.device).index_add(0, labels, per)
        counts = torch.bincount(labels, minlength=self.n_classes).to(per.dtype)
        return sums / counts.clamp_min(1.0)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        inputs, labels = batch[0], batch[1]
        f_c = self.class_losses(model(inputs), labels)
        y = cast(ClassWeighted, model).y
        return torch.dot(y, f_c) - 0.5 * self.lam * y.pow(2).sum()

    def vectorizable(self) -> bool:
        return type(self).loss is FairDigitsTask.loss and type(self).padded_loss is FairDigitsTask.padded_loss

    def padded_loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        """`loss` of the real rows (`mask` 1): F_c from each class's real rows alone, through a
        one-hot matrix rather than `index_add`, so that torch.func can vmap it."""
        inputs, labels = batch[0], batch[1]
        per = F.cross_entropy(model(inputs), labels, reduction="none") * mask
        classes = torch.arange(self.n_classes, device=labels.device)
        member = (labels[:, None] == classes[None, :]).to(per.dtype) * mask[:, None]   # row r of class c, real
        f_c = (member * per[:, None]).sum(0) / member.sum(0).clamp_min(1.0)
        y = cast(ClassWeighted, model).y
        return torch.dot(y, f_c) - 0.5 * self.lam * y.pow(2).sum()

    def stacked_sample_loss(self, model: nn.Module) -> None:
        """None: the loss is not a mean of per-sample losses, so a stack runs `padded_loss` through vmap."""
        return None

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x, y = _eval_set(self)
        logits = self._forward(model, x)
        correct = (logits.argmax(1) == y).double()
        per_class_acc = [float(correct[y == k].mean()) for k in range(self.n_classes) if bool((y == k).any())]
        f_c = self.class_losses(logits, y)
        return {"test_accuracy": float(correct.mean()), "test_loss": float(F.cross_entropy(logits, y)),
                "worst_class_accuracy": min(per_class_acc), "worst_class_loss": float(f_c.max()),
                "class_weight_max": float(cast(ClassWeighted, model).y.detach().max())}


def _digits(cfg: Any, scale_unit: bool) -> tuple[np.ndarray, ...]:
    x, y = datasets.load_digits()
    x_tr, y_tr, x_te, y_te = datasets.train_test_split(x, y, cfg.data.test_fraction,
                                                       numpy_stream(cfg.run.seed, "data/split"))
    if scale_unit:
        x_tr, x_te = x_tr / np.float32(16.0), x_te / np.float32(16.0)
    elif cfg.data.standardize:
        x_tr, x_te = standardize(x_tr, x_te)
    if cfg.model.kind == "cnn":
        x_tr, x_te = (t.reshape(-1, 1, 8, 8) for t in (x_tr, x_te))
    return x_tr, y_tr, x_te, y_te


def _build_robust_digits(cfg: Any, p: RobustDigitsParams) -> Task:
    x_tr, y_tr, x_te, y_te = _digits(cfg, scale_unit=True)
    spec = model_spec(cfg, x_tr.shape[1:], 10)
    return RobustDigitsTask(x_tr, y_tr, make_partition(cfg, y_tr), spec, x_te, y_te, name="robust_digits",
                            n_classes=10, radius=p.radius, attack_steps=p.attack_steps, attack_lr=p.attack_lr)


def _build_fair_digits(cfg: Any, p: FairDigitsParams) -> Task:
    x_tr, y_tr, x_te, y_te = _digits(cfg, scale_unit=False)
    spec = model_spec(cfg, x_tr.shape[1:], 10)
    return FairDigitsTask(x_tr, y_tr, make_partition(cfg, y_tr), spec, x_te, y_te, name="fair_digits",
                          n_classes=10, lam=p.lam)


REGISTER = {"minimax_quadratic": (_build_minimax_quadratic, MinimaxQuadraticParams),   # data.dataset -> (builder, keys)
            "robust_digits": (_build_robust_digits, RobustDigitsParams),
            "fair_digits": (_build_fair_digits, FairDigitsParams)}
