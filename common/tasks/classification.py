"""Supervised tasks over in-memory arrays: classification (cross-entropy) and regression.

A task holds the pooled training arrays, one index array per client (from a partitioner or
from the user's own per-client files) and an optional held-out test set.  Client tensors are
sliced on first use and kept, so a process hosting many logical clients pays for each client
once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedhop.common.models import build_model
from fedhop.common.models.dense import stacked_forward
from fedhop.common.tasks.base import ClientData, StackedLoss, Task

EVAL_BATCH = 4096  # rows per forward pass in evaluation (bounds memory on MNIST-sized tests)


@dataclass(frozen=True)
class ModelSpec:
    """Everything `common.models.build_model` needs; the same spec gives the same model."""

    kind: str
    input_shape: tuple[int, ...]
    n_outputs: int
    hidden: tuple[int, ...] = (64,)
    init: str = "default"
    seed: int = 0
    bias: bool = True
    factory: str = ""                           # a user's model factory (common/util/plugins.py); "" = kind
    factory_args: tuple[tuple[str, Any], ...] = ()


def _as_tensor(a: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.to(dtype)
    return torch.tensor(np.asarray(a), dtype=dtype)  # copies: cached numpy arrays are read-only


def _check_char_indices(name: str, vocab: int, *xs: torch.Tensor | None) -> None:
    """model.kind = "char_lstm" embeds each input as a character index: every input must be a
    whole number in 0..vocab-1 (vocab: the task's number of classes), or the embedding would
    index out of its table in the middle of training."""
    for x in xs:
        if x is None or not x.numel():
            continue
        if not bool(torch.equal(x, x.floor())) or float(x.min()) < 0 or float(x.max()) >= vocab:
            raise ValueError(f"model.kind = 'char_lstm': the {name or 'data set'}'s inputs are not character "
                             f"indices in 0..{vocab - 1} (found values in {float(x.min()):g}..{float(x.max()):g}); "
                             f"char_lstm is for character sequences (LEAF's Shakespeare)")


class ArrayTask(Task):
    """Common machinery of the supervised tasks; subclasses define the per-sample loss."""

    y_dtype: torch.dtype = torch.int64

    def __init__(self, x_train: np.ndarray | torch.Tensor, y_train: np.ndarray | torch.Tensor,
                 parts: Sequence[np.ndarray], model_spec: ModelSpec,
                 x_test: np.ndarray | torch.Tensor | None = None,
                 y_test: np.ndarray | torch.Tensor | None = None, name: str = "") -> None:
        self.name = name
        self.model_spec = model_spec
        self.x = _as_tensor(x_train, torch.float32)
        self.y = _as_tensor(y_train, self.y_dtype)
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"{name}: x has {self.x.shape[0]} rows but y has {self.y.shape[0]}")
        self.parts = [torch.as_tensor(np.asarray(p, dtype=np.int64)) for p in parts]
        n = int(self.x.shape[0])
        for i, p in enumerate(self.parts):
            if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n):
                raise ValueError(f"{name}: client {i}'s indices fall outside 0..{n - 1}")
        if (x_test is None) != (y_test is None):
            raise ValueError(f"{name}: give both x_test and y_test, or neither")
        self.x_test = None if x_test is None else _as_tensor(x_test, torch.float32)
        self.y_test = None if y_test is None else _as_tensor(y_test, self.y_dtype)
        if model_spec.kind == "char_lstm":
            _check_char_indices(name, model_spec.n_outputs, self.x, self.x_test)
        self._clients: dict[int, ClientData] = {}

    # ------------------------------------------------------------------ Task interface
    @property
    def num_clients(self) -> int:
        return len(self.parts)

    def build_model(self) -> torch.nn.Module:
        s = self.model_spec
        return build_model(s.kind, s.input_shape, s.n_outputs, s.hidden, s.init, s.seed,
                           bias=s.bias, task=self.kind, factory=s.factory, factory_args=dict(s.factory_args))

    def num_rows(self, client_id: int) -> int:
        """A client's rows are its partition's indices, counted without copying its data."""
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"{self.name}: client id {client_id} out of range 0..{self.num_clients - 1}")
        return int(self.parts[client_id].numel())

    def client_data(self, client_id: int) -> ClientData:
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"{self.name}: client id {client_id} out of range 0..{self.num_clients - 1}")
        data = self._clients.get(client_id)
        if data is None:
            idx = self.parts[client_id]
            data = ClientData(tensors=(self.x[idx], self.y[idx]), num_samples=int(idx.numel()))
            self._clients[client_id] = data
        return data

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        x, y = batch[0], batch[1]
        return self.sample_losses(model(x), y).mean()

    def vectorizable(self) -> bool:
        return type(self).loss is ArrayTask.loss   # the mean of sample_losses: a pure function

    def sample_loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.sample_losses(model(batch[0]), batch[1])

    def stacked_sample_loss(self, model: torch.nn.Module) -> StackedLoss | None:
        """`sample_losses` of the stacked outputs of a model that computes them directly
        (`stacked_forward`: the dense models, common/models/dense.py), the m batches as one."""
        forward = stacked_forward(model)
        if forward is None or type(self).sample_loss is not ArrayTask.sample_loss:
            return None

        def losses(params: Mapping[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
            out, y = forward(params, batch[0]), batch[1]
            m, rows = y.shape[0], y.shape[1]
            return self.sample_losses(out.reshape(m * rows, *out.shape[2:]),
                                      y.reshape(m * rows, *y.shape[2:])).view(m, rows)
        return losses

    def train_loss(self, model: torch.nn.Module) -> float:
        """sum_i n_i * mean-loss_i / sum_i n_i, computed in large pooled batches."""
        idx = torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.int64)
        if idx.numel() == 0:
            return float("nan")
        losses = self._per_sample(model, self.x[idx], self.y[idx])
        return float(losses.mean())

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        if self.x_test is None or self.x_test.shape[0] == 0:
            idx = torch.cat(self.parts)
            return self.metrics(model, self.x[idx], self.y[idx], prefix="train")
        assert self.y_test is not None   # __init__ sets x_test and y_test both or neither
        return self.metrics(model, self.x_test, self.y_test, prefix="test")

    # ------------------------------------------------------------------ per task kind
    def sample_losses(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                prefix: str) -> dict[str, float]:
        raise NotImplementedError

    def _forward(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's outputs on `x`, in batches moved to the model's device; on the CPU."""
        first = next(model.parameters(), None)
        device = first.device if first is not None else x.device
        with torch.no_grad():
            return torch.cat([model(x[i:i + EVAL_BATCH].to(device)).cpu() for i in range(0, x.shape[0], EVAL_BATCH)])

    def _per_sample(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.sample_losses(self._forward(model, x), y)


class ClassificationTask(ArrayTask):
    """Mean cross-entropy over integer labels; metrics: accuracy and loss."""

    kind = "classification"
    y_dtype = torch.int64
    device_evaluation = True    # metrics and train_loss go through _forward
    source: str                 # where the data came from ("idx:<folder>"); set by idx_task only

    def __init__(self, *args, n_classes: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        labels = [self.y] + ([self.y_test] if self.y_test is not None else [])
        top = max((int(t.max()) for t in labels if t.numel()), default=0)
        self.n_classes = int(n_classes) if n_classes is not None else top + 1
        low = min((int(t.min()) for t in labels if t.numel()), default=0)
        if low < 0 or top >= self.n_classes:
            raise ValueError(f"{self.name}: labels must lie in 0..{self.n_classes - 1}, found {low}..{top}")
        if self.model_spec.n_outputs != self.n_classes:
            raise ValueError(f"{self.name}: model has {self.model_spec.n_outputs} outputs for "
                             f"{self.n_classes} classes")

    def sample_losses(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, reduction="none")

    def metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                prefix: str) -> dict[str, float]:
        logits = self._forward(model, x)
        return {f"{prefix}_accuracy": float((logits.argmax(1) == y).double().mean()),
                f"{prefix}_loss": float(F.cross_entropy(logits, y))}

    def label_histograms(self) -> np.ndarray:
        """(clients, classes) label counts of the training partition."""
        return np.stack([np.bincount(self.y[p].numpy(), minlength=self.n_classes) for p in self.parts])


class RegressionTask(ArrayTask):
    """Least squares, loss = mean over rows of 1/2 ||f(x) - y||^2; optional known w_true
    gives `distance_to_opt` = ||(W, b) - w_true|| (w_true may omit the bias)."""

    kind = "regression"
    y_dtype = torch.float32

    def __init__(self, *args, w_true: np.ndarray | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.w_true = None if w_true is None else torch.tensor(np.array(w_true, dtype=np.float64)).flatten()

    def sample_losses(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        diff = out - y.reshape(out.shape)
        return 0.5 * diff.reshape(diff.shape[0], -1).pow(2).sum(1)

    def metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                prefix: str) -> dict[str, float]:
        out = {f"{prefix}_loss": float(self._per_sample(model, x, y).mean())}
        if self.w_true is not None:
            out["distance_to_opt"] = self.distance_to_opt(model)
        return out

    def distance_to_opt(self, model: torch.nn.Module) -> float:
        assert self.w_true is not None
        params = [p.detach().double().flatten() for p in model.parameters()]
        if not params:
            raise ValueError(f"{self.name}: the model has no parameters")
        weight_only = params[0]
        full = torch.cat(params)
        for cand in (full, weight_only):
            if cand.numel() == self.w_true.numel():
                return float((cand - self.w_true).norm())
        raise ValueError(f"{self.name}: w_true has {self.w_true.numel()} entries; the model has "
                         f"{weight_only.numel()} weights and {full.numel()} parameters in all")
