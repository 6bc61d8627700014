"""A task placed on a device (common/transport/placement.py resolves which): its models and its clients'
data live there, its CPU task underneath keeps the bookkeeping (client sizes, evaluation of the
tasks whose closed forms use numpy).  The round engine and the roles place their task once."""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from fedhop.common.tasks.base import ClientData, StackedLoss, Task, client_rows

#: hosted clients whose data a process keeps on its device (the most recently trained ones)
DEVICE_CLIENTS = 4096


class PlacedTask(Task):
    """A task whose models and client data live on `device` (the wrapped task's stay on the CPU).

    Client data is copied to the device once per hosted client and kept (the `DEVICE_CLIENTS`
    most recently trained clients).  Evaluation runs on
    the device for the tasks whose evaluation moves its batches to the model's device
    (`Task.device_evaluation`); the others evaluate a CPU copy of the model (their closed forms
    use numpy and are small)."""

    def __init__(self, inner: Task, device: torch.device) -> None:
        self.inner = inner
        self.device = device
        self.kind = inner.kind
        self._clients: OrderedDict[int, ClientData] = OrderedDict()   # the most recently trained clients

    def __getattr__(self, name: str) -> Any:   # the task's own extras (optimum, n_classes, ...)
        return getattr(self.__dict__["inner"], name)

    @property
    def num_clients(self) -> int:
        return self.inner.num_clients

    def num_samples(self, client_id: int) -> int:
        return self.inner.num_samples(client_id)

    def num_rows(self, client_id: int) -> int:
        return client_rows(self.inner, client_id)

    def build_model(self) -> torch.nn.Module:
        return self.inner.build_model().to(self.device)

    def client_data(self, client_id: int) -> ClientData:
        data = self._clients.get(client_id)
        if data is None:
            cpu = self.inner.client_data(client_id)
            data = ClientData(tensors=tuple(t.to(self.device) for t in cpu.tensors), num_samples=cpu.num_samples)
            self._clients[client_id] = data
            if len(self._clients) > DEVICE_CLIENTS:   # cross-device scale: a process may host 100,000
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client_id)
        return data

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        return self.inner.loss(model, batch, generator)

    def vectorizable(self) -> bool:
        return self.inner.vectorizable()

    def sample_loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.inner.sample_loss(model, batch)

    def padded_loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
                    mask: torch.Tensor) -> torch.Tensor:
        return self.inner.padded_loss(model, batch, mask)

    def stacked_sample_loss(self, model: torch.nn.Module) -> StackedLoss | None:
        return self.inner.stacked_sample_loss(model)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        if self.inner.device_evaluation:
            return self.inner.evaluate(model)
        return self.inner.evaluate(copy.deepcopy(model).cpu())

    def train_loss(self, model: torch.nn.Module) -> float:
        if self.inner.device_evaluation:
            return self.inner.train_loss(model)
        return self.inner.train_loss(copy.deepcopy(model).cpu())


def place_task(task: Task, device: torch.device | None) -> Task:
    """`task` on `device`; on the CPU (or None) the task itself, unchanged."""
    if device is None or device.type == "cpu":
        return task
    return PlacedTask(task, device)


def host_task(task: Task) -> Task:
    """The CPU task under a placed one (the task itself otherwise): for bookkeeping that reads
    client sizes and must not copy client data to a device."""
    return task.inner if isinstance(task, PlacedTask) else task
