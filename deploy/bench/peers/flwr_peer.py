"""`fedhop bench peers`'s workload in Flower's simulation engine, run by the Flower venv's python:

    $FEDHOP_FLWR_PYTHON flwr_peer.py FOLDER      (FOLDER: spec.json and data.npz, peerkit.py says what)

Flower's Message API (a ServerApp running the FedAvg strategy, a ClientApp with a train
function) played by `flwr.simulation.run_simulation`: one simulated SuperNode per client, the
Ray backend with one CPU per ClientApp actor (two actors on two cores).  What fedhop's run does,
made explicit where Flower leaves it to the user:

- data split: fedhop's, read from data.npz: the SuperNode with partition-id i holds exactly
  fedhop's client i's rows;
- model: fedhop's MLP layout (peerkit.MLP), PyTorch's default initialisation under
  torch.manual_seed(seed) (fedhop draws its own under its "model/init" stream: the same
  distribution, other numbers), or fedhop's initial parameters with "match";
- local training: peerkit.local_sgd: `epochs` passes of plain SGD at `lr`, batches of `batch`
  (0: the whole client), shuffled each pass by a torch generator seeded by (seed, round, client),
  the last batch of a pass smaller (fedhop's rule);
- W1: one full-batch step on the quadratic, the model one vector `w` from zeros;
- sampling: Flower's FedAvg draws round(clients * fraction_train) = per_round nodes uniformly
  without replacement, its own draw each round (`random.sample`, seeded here by random.seed(seed));
  with "match" Flower still draws its own (its node ids are not fedhop's client ids);
- weighting: FedAvg's mean weighted by the replies' "num-examples": the client's samples (or 1
  for uniform weighting); the new model is that mean (server_lr = 1);
- no federated evaluation (fraction_evaluate = 0); the test accuracy after the last round by
  peerkit.evaluate, outside the timing;
- timing: from the top of configure_train to the end of aggregate_train, each round.
"""
from __future__ import annotations

import os
import random
import sys
import time
from importlib.metadata import version
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)
# Ray's worker processes import peerkit too: they inherit the driver's environment
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)

import peerkit  # noqa: E402
import torch  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

_SPECS: dict[str, peerkit.Spec] = {}


def spec_of(folder: str) -> peerkit.Spec:
    """The workload, loaded once per process (each Ray actor loads its own)."""
    if folder not in _SPECS:
        _SPECS[folder] = peerkit.load(folder)
    return _SPECS[folder]


class TimedFedAvg(FedAvg):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.starts: list[float] = []
        self.ends: list[float] = []

    def configure_train(self, server_round, arrays, config, grid):
        self.starts.append(time.perf_counter())
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        out = super().aggregate_train(server_round, replies)
        self.ends.append(time.perf_counter())
        return out


def make_apps(folder: str, result: dict) -> tuple[ServerApp, ClientApp]:
    client = ClientApp()
    server = ServerApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        spec = spec_of(folder)
        torch.set_num_threads(1)
        cid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        model = peerkit.build_model(spec)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = peerkit.client_arrays(spec, cid)
        generator = torch.Generator().manual_seed(int(spec["seed"]) * 1_000_003 + rnd * 100_003 + cid)
        value = peerkit.local_sgd(spec, model, x, y, generator)
        metrics = MetricRecord({"train_loss": value, "num-examples": peerkit.weight(spec, len(x))})
        return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}),
                       reply_to=msg)

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        spec = spec_of(folder)
        random.seed(int(spec["seed"]))
        n, k = int(spec["clients"]), int(spec["per_round"])
        strategy = TimedFedAvg(fraction_train=k / n, fraction_evaluate=0.0, min_train_nodes=k,
                               min_available_nodes=n)
        model = peerkit.build_model(spec)
        out = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                             num_rounds=int(spec["rounds"]))
        model.load_state_dict(out.arrays.to_torch_state_dict())
        result["model"] = model
        result["per_round"] = [e - s for s, e in zip(strategy.starts, strategy.ends)]
        result["round_ends"] = list(strategy.ends)

    return server, client


def main(folder: str) -> None:
    spec = spec_of(folder)
    result: dict = {}
    server, client = make_apps(folder, result)
    run_simulation(server_app=server, client_app=client, num_supernodes=int(spec["clients"]),
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    if "model" not in result:
        raise SystemExit("flwr_peer: the simulation ended without a model (see the log above)")
    peerkit.emit("flower", version("flwr"), result["per_round"], spec, result["model"],
                 round_ends=result["round_ends"])


if __name__ == "__main__":
    main(sys.argv[1])
