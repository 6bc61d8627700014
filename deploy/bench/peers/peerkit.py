"""What every peer script of `fedhop bench peers` shares: the workload it is handed, the model,
the loss, the local SGD loop, the sampling rule, the evaluation and the one JSON line it prints.

A peer script runs under another framework's interpreter (a Flower or pfl venv), so this file
imports only the standard library, numpy and torch, never fedhop.  The benchmark
(deploy/bench/bench_peers.py) writes the workload as two files in one folder, given to the script
as its only argument:

  spec.json  {"workload", "kind": "classification" | "quadratic", "clients", "per_round", "rounds",
              "lr", "batch_size" (0: the client's whole data), "epochs", "local_steps", "hidden",
              "seed", "weighting": "samples" | "uniform", "match": bool}
  data.npz   classification: x (N, F) float32, y (N,) int64, offsets (clients + 1,) int64 (client i
             holds rows offsets[i]:offsets[i+1]), x_test, y_test; quadratic: centers, curvatures
             (clients, d) float32.  With "match": init_<name> (fedhop's initial parameters, by
             fedhop's parameter names) and sampled (rounds, per_round) int64 (fedhop's draws).

The data are fedhop's own (its split, standardisation and partition, or its quadratic's centers
and curvatures), so the split is the same by construction; loaded with allow_pickle=False.

The script prints one JSON line last on stdout: {"system", "version", "per_round_s": [...],
"round_end_s": [...], "accuracy": float | null, "objective": float | null, "rounds": int};
`round_end_s` holds time.perf_counter() at the end of each round (the benchmark reads the CPU
the run used between them).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Spec(dict):
    """spec.json with the arrays of data.npz (`arrays`) and the folder they came from."""

    arrays: dict[str, np.ndarray]


def load(folder: str) -> Spec:
    where = Path(folder)
    spec = Spec(json.loads((where / "spec.json").read_text()))
    with np.load(where / "data.npz", allow_pickle=False) as npz:
        spec.arrays = {k: npz[k] for k in npz.files}
    return spec


class MLP(nn.Module):
    """fedhop's model.kind = "mlp" (common/models/dense.py): Linear + ReLU per hidden width, then
    the output layer; parameter names layers.<i>.{weight,bias} and out.{weight,bias}, as fedhop's."""

    def __init__(self, features: int, hidden: list[int], classes: int) -> None:
        super().__init__()
        widths = [features, *hidden]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)
        for layer in self.layers:
            h = F.relu(layer(h))
        return self.out(h)


class Vector(nn.Module):
    """fedhop's quadratic model: one parameter `w`, zeros at the start."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        return self.w


def build_model(spec: Spec) -> nn.Module:
    """The workload's model: PyTorch's default initialisation under torch.manual_seed(seed) (what
    a user of the peer framework writes), or with "match" fedhop's initial parameters."""
    a = spec.arrays
    if spec["kind"] == "quadratic":
        model: nn.Module = Vector(int(a["centers"].shape[1]))
    else:
        torch.manual_seed(int(spec["seed"]))
        model = MLP(int(a["x"].shape[1]), list(spec["hidden"]), int(max(a["y"].max(), a["y_test"].max())) + 1)
    if spec.get("match"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.from_numpy(a[f"init_{name}"]))
    return model


def client_arrays(spec: Spec, cid: int) -> tuple[np.ndarray, np.ndarray]:
    """Client `cid`'s data: (x, y) rows, or the quadratic's (center, curvature) as one row each."""
    a = spec.arrays
    if spec["kind"] == "quadratic":
        return a["centers"][cid:cid + 1], a["curvatures"][cid:cid + 1]
    lo, hi = int(a["offsets"][cid]), int(a["offsets"][cid + 1])
    return a["x"][lo:hi], a["y"][lo:hi]


def loss(kind: str, model: nn.Module, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch, or the quadratic 1/2 sum_j c_j (w_j - a_j)^2 (mean over rows)."""
    if kind == "quadratic":
        w = model.get_parameter("w")
        return (0.5 * (second * (w[None, :] - first).pow(2)).sum(1)).mean()
    return F.cross_entropy(model(first), second)


def batches(rows: int, batch_size: int, epochs: int, generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """Index batches of `epochs` passes, the last batch of a pass smaller; shuffled per pass with a
    generator (fedhop's rule), in stored order without one (pfl's Dataset.iter)."""
    bs = rows if batch_size <= 0 else min(batch_size, rows)
    for _ in range(epochs):
        order = torch.randperm(rows, generator=generator) if generator is not None else torch.arange(rows)
        for start in range(0, rows, bs):
            yield order[start:start + bs]


def local_sgd(spec: Spec, model: nn.Module, x: np.ndarray, y: np.ndarray, generator: torch.Generator | None) -> float:
    """Plain SGD at spec["lr"] over the client's data in place; the mean loss of its steps."""
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
    params = [p for p in model.parameters()]
    total, steps = 0.0, 0
    for idx in batches(len(xt), int(spec["batch_size"]), int(spec["epochs"]), generator):
        for p in params:
            p.grad = None
        value = loss(spec["kind"], model, xt[idx], yt[idx])
        value.backward()
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-float(spec["lr"]))
        total += float(value.detach())
        steps += 1
    return total / max(steps, 1)


def sampled(spec: Spec, rnd: int) -> list[int]:
    """Round `rnd`'s clients (1-based): uniformly without replacement, `per_round` of `clients`,
    each round its own draw (fedhop's rule; numpy seeded by (seed, rnd)), or fedhop's own draws
    with "match"."""
    if spec.get("match"):
        return [int(c) for c in spec.arrays["sampled"][rnd - 1]]
    rng = np.random.default_rng([int(spec["seed"]), rnd])
    return sorted(int(c) for c in rng.choice(int(spec["clients"]), size=int(spec["per_round"]), replace=False))


def weight(spec: Spec, rows: int) -> float:
    """A client's weight in the mean: its samples (fedhop's default weighting) or 1."""
    return float(rows) if spec["weighting"] == "samples" else 1.0


def evaluate(spec: Spec, model: nn.Module) -> dict[str, float | None]:
    """Test accuracy (classification) or the quadratic objective sum_i p_i f_i(w) with p_i uniform
    (every client holds one sample), computed the same way for every system."""
    a = spec.arrays
    with torch.no_grad():
        if spec["kind"] == "quadratic":
            c, ctr = torch.from_numpy(a["curvatures"]).double(), torch.from_numpy(a["centers"]).double()
            w = model.get_parameter("w").detach().double()
            return {"accuracy": None, "objective": float((0.5 * (c * (w[None, :] - ctr).pow(2)).sum(1)).mean())}
        logits = model(torch.from_numpy(a["x_test"]))
        acc = float((logits.argmax(1) == torch.from_numpy(a["y_test"])).double().mean())
        return {"accuracy": acc, "objective": None}


def emit(system: str, version: str, per_round: list[float], spec: Spec, model: nn.Module,
         round_ends: list[float], **extra: Any) -> None:
    """Print the result line (the last line of stdout); `round_ends`: time.perf_counter() at the
    end of each round."""
    row = {"system": system, "version": version, "rounds": len(per_round), "per_round_s": per_round,
           "round_end_s": round_ends, **evaluate(spec, model), **extra}
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()
