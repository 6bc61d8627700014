"""`fedhop bench peers`'s workload in pfl-research (Apple's simulator), run by the pfl venv's python:

    $FEDHOP_PFL_PYTHON pfl_peer.py FOLDER      (FOLDER: spec.json and data.npz, peerkit.py says what)

Written as pfl's own PyTorch benchmarks write a FedAvg simulation (SimulatedBackend over a
FederatedDataset, PyTorchModel with a local SGD optimizer and a central SGD at lr 1.0,
FederatedAveraging), with what fedhop's run does made explicit where pfl's defaults differ:

- data split: fedhop's, read from data.npz: client i is pfl user i holding exactly fedhop's rows;
- model: fedhop's MLP layout (peerkit.MLP), PyTorch's default initialisation under
  torch.manual_seed(seed) (fedhop draws its own under its "model/init" stream: the same
  distribution, other numbers), or fedhop's initial parameters with "match";
- local training: `local_num_epochs` epochs of SGD at `lr`, `local_batch_size` = batch (None: the
  whole client), the last batch of an epoch smaller; pfl iterates a user's rows in stored order,
  where fedhop shuffles each epoch (no difference when a client's data fits one batch, as in W2);
- W1: one full-batch step on the quadratic, the model one vector `w` from zeros;
- sampling: each round `per_round` users uniformly without replacement, its own draw each round
  (peerkit.sampled; pfl's 'random' user sampler draws with replacement, so it is not used);
- weighting: by the user's samples (WeightByDatapoints; pfl's default is one per user), the
  central step w + 1.0 * weighted mean of the users' model differences, as fedhop's FedAvg with
  server_lr = 1;
- evaluation: the test accuracy after the last round, by peerkit.evaluate (outside the timing);
- timing: a callback stamps the end of every central iteration; round 1 runs from the top of
  `algorithm.run`.
"""
from __future__ import annotations

import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peerkit  # noqa: E402  (beside this script)
from pfl.aggregate.simulate import SimulatedBackend  # noqa: E402
from pfl.aggregate.weighting import WeightByDatapoints, WeightByUser  # noqa: E402
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams  # noqa: E402
from pfl.callback.base import TrainingProcessCallback  # noqa: E402
from pfl.data.dataset import Dataset  # noqa: E402
from pfl.data.federated_dataset import FederatedDataset  # noqa: E402
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams  # noqa: E402
from pfl.metrics import Metrics, Weighted  # noqa: E402
from pfl.model.pytorch import PyTorchModel  # noqa: E402


class Stamps(TrainingProcessCallback):
    """The wall clock at the end of every central iteration."""

    def __init__(self) -> None:
        self.times: list[float] = [time.perf_counter()]

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        self.times.append(time.perf_counter())
        return False, Metrics()


def with_pfl_methods(module: torch.nn.Module, kind: str) -> torch.nn.Module:
    """The `loss(*batch)` and `metrics(*batch)` methods pfl's PyTorchModel calls on a module."""
    def loss(first, second, eval=False):   # noqa: A002 (pfl's keyword)
        return peerkit.loss(kind, module, first, second)

    def metrics(first, second, eval=True):   # noqa: A002
        with torch.no_grad():
            value = float(peerkit.loss(kind, module, first, second)) * len(first)
        return {"loss": Weighted(value, len(first))}

    module.loss = loss          # type: ignore[assignment]
    module.metrics = metrics    # type: ignore[assignment]
    return module


def main(folder: str) -> None:
    spec = peerkit.load(folder)
    torch.set_num_threads(1)   # one process, as fedhop's clients: no intra-op threads
    rounds, per_round = int(spec["rounds"]), int(spec["per_round"])
    order = iter([c for r in range(1, rounds + 1) for c in peerkit.sampled(spec, r)])
    users = [peerkit.client_arrays(spec, c) for c in range(int(spec["clients"]))]

    def make_dataset(uid: int) -> Dataset:
        x, y = users[uid]
        return Dataset(raw_data=[torch.from_numpy(x), torch.from_numpy(y)], user_id=str(uid))

    data = FederatedDataset(make_dataset, user_sampler=lambda: next(order))
    module = with_pfl_methods(peerkit.build_model(spec), spec["kind"])
    params = [p for p in module.parameters() if p.requires_grad]
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(params, 1.0))
    weighting = WeightByDatapoints() if spec["weighting"] == "samples" else WeightByUser()
    backend = SimulatedBackend(training_data=data, val_data=None, postprocessors=[weighting])
    batch = int(spec["batch_size"])
    train = NNTrainHyperParams(local_learning_rate=float(spec["lr"]), local_num_epochs=int(spec["epochs"]),
                               local_batch_size=batch if batch > 0 else None)
    stamps = Stamps()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                                           train_cohort_size=per_round, val_cohort_size=0),
        backend=backend, model=model, model_train_params=train,
        model_eval_params=NNEvalHyperParams(local_batch_size=None), callbacks=[stamps])
    seconds = [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    peerkit.emit("pfl", version("pfl"), seconds, spec, module, round_ends=stamps.times[1:])


if __name__ == "__main__":
    main(sys.argv[1])
