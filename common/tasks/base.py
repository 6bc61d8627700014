"""The task interface: what a federated problem gives the algorithms.

A task owns the per-client data (already partitioned), the model factory, the loss a local
solver minimises and the evaluation the server runs.  Every process builds the same task from
the same resolved config, so data never travels on the wire.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping

import torch


@dataclass
class ClientData:
    """One logical client's local data.

    `tensors` are aligned along dim 0 (e.g. `(x, y)`); `num_samples` is the client's weight
    in the objective (for synthetic tasks it may come from the config's `sizes` rather than
    from `len(x)`).
    """

    tensors: tuple[torch.Tensor, ...]
    num_samples: int

    @property
    def rows(self) -> int:
        return int(self.tensors[0].shape[0]) if self.tensors else 0


StackedLoss = Callable[[Mapping[str, torch.Tensor], tuple[torch.Tensor, ...]], torch.Tensor]
"""(the clients' parameters by name, stacked; their batches, stacked) -> per-sample losses (m, B)."""


class Task(ABC):
    """A federated problem. Concrete tasks live in `common.tasks`."""

    #: "classification" | "regression" | "quadratic" | "minimax"
    kind: str = "classification"
    #: whether `evaluate` and `train_loss` take a model on any device (moving their batches to
    #: it); a task without runs them on a CPU copy of a device model (common/transport/placement.py)
    device_evaluation: bool = False

    @property
    @abstractmethod
    def num_clients(self) -> int: ...

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """A fresh model with the run's seeded initialisation (same on every process)."""

    @abstractmethod
    def client_data(self, client_id: int) -> ClientData: ...

    def num_samples(self, client_id: int) -> int:
        """Client `client_id`'s weight in the objective.  Tasks that make clients on demand
        (common/tasks/crossdevice.py) answer without building the client's data."""
        return self.client_data(client_id).num_samples

    def num_rows(self, client_id: int) -> int:
        """The rows of client `client_id`'s training data (`ClientData.rows`), which decide its
        steps in an epoch.  The server asks it of every client that replies in a round (its
        virtual clock's planned steps, common/engine/vclock.py), so tasks whose clients' data is
        read or made on demand answer it without building the data: a server then never reads
        or holds its clients' data.  A subclass that makes its clients' data otherwise than the
        class that counts their rows is asked through its data (`client_rows`)."""
        return self.client_data(client_id).rows

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        """Mean loss of `model` on `batch` (a tuple sliced from `ClientData.tensors`).

        Tasks with gradient noise draw it from `generator` (the client's stream).
        """

    def vectorizable(self) -> bool:
        """Whether `padded_loss` is `loss` on the real rows and a pure function of the model's
        parameters and the batch that torch.func can vmap ([algorithm] vectorized,
        common/algorithms/vectorized.py): no draw from the generator, no Python branch on a
        tensor's values, nothing written in place."""
        return False

    def sample_loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The loss of each row of `batch` (a vectorizable task's `loss` is their mean, unless
        it brings a `padded_loss` of its own)."""
        raise NotImplementedError(f"{type(self).__name__} gives no per-sample loss")

    def padded_loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
                    mask: torch.Tensor) -> torch.Tensor:
        """`loss` of the rows of `batch` whose `mask` is 1, the others padding (zero rows that
        make every client's batch one width, common/algorithms/vectorized.py): the per-sample
        losses of the real rows summed and divided by their count.  A task that brings its own
        returns None from `stacked_sample_loss`, whose stacks compute this default."""
        return (self.sample_loss(model, batch) * mask).sum() / mask.sum()

    def stacked_sample_loss(self, model: torch.nn.Module) -> "StackedLoss | None":
        """`sample_loss` of m clients at once with `model`'s architecture, computed directly on
        stacked parameters (common/algorithms/vectorized.py): (params, each stacked along a first
        dimension of m; the batch, each tensor (m, B, ...)) -> the losses (m, B), row i the same
        as `sample_loss` of client i's parameters on its own batch.  None: the solver runs
        `sample_loss` through torch.func.vmap instead."""
        return None

    @abstractmethod
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out metrics and task metrics (test_accuracy, test_loss, objective,
        distance_to_opt, support_f1, rank, ...)."""

    def train_loss(self, model: torch.nn.Module) -> float:
        """Sample-weighted mean training loss over every client's data."""
        total, weight = 0.0, 0
        with torch.no_grad():
            for cid in range(self.num_clients):
                data = self.client_data(cid)
                if data.rows == 0:
                    continue
                total += float(self.loss(model, data.tensors)) * data.num_samples
                weight += data.num_samples
        return total / max(weight, 1)


def client_rows(task: Task, client_id: int) -> int:
    """`task.num_rows(client_id)`, where the class that says how many rows a client has is the
    one that makes its data or a subclass of it; else (a subclass that makes the data its own way
    and does not count it) the rows of `task.client_data(client_id)`."""
    mro = type(task).__mro__
    makes = next(cls for cls in mro if "client_data" in vars(cls))
    counts = next(cls for cls in mro if "num_rows" in vars(cls))
    if counts is not makes and issubclass(makes, counts):
        return task.client_data(client_id).rows
    return task.num_rows(client_id)
