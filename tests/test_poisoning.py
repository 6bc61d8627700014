"""One poisoning client neutralised by robust aggregation (issue 17, item 5), with real
processes: a server, an honest client process (clients 0-8) and a poisoner (client 9) whose
FedAvg updates are sign-flipped and boosted 20x (tests/poisoning.py).  The plain weighted mean
is ruined; the coordinate-wise median, trimmed mean and Krum end close to the clean run, in the
star topology and in the hierarchical one (2 edges of 5 clients: the trimmed mean at trim 0.1
trims one per side there, common/engine/robust.py)."""
from __future__ import annotations

import pytest

from tests.poisoning import poisoned_run

CFG = """
[run]
name = "poison"
rounds = 12
seed = 3
eval_every = 0
call_timeout = 120.0
round_timeout = 180.0
[data]
dataset = "digits"
partition = "iid"
[model]
kind = "mlp"
hidden = [32]
[algorithm]
name = "fedavg"
lr = 0.1
local_epochs = 1
batch_size = 16
[clients]
count = 10
"""
SCALE = -20.0


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    base = tmp_path_factory.mktemp("clean")
    cfg = base / "exp.toml"
    cfg.write_text(CFG)
    return poisoned_run(cfg, base / "run", "0-9", None, 1.0)["final"]["test_accuracy"]


def _poisoned(tmp_path, rule: str, topology: list[str] = ()) -> dict:
    cfg = tmp_path / "exp.toml"
    cfg.write_text(CFG)
    return poisoned_run(cfg, tmp_path / "run", "0-8", "9", SCALE, [f"security.aggregation={rule}", *topology])


def test_plain_mean_is_ruined_by_one_poisoner(tmp_path, clean):
    summary = _poisoned(tmp_path, "mean")
    assert clean > 0.85
    assert summary["status"] != "completed" or summary["final"]["test_accuracy"] < 0.5, summary["final"]


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum"])
def test_robust_rules_neutralise_one_poisoner(tmp_path, clean, rule):
    summary = _poisoned(tmp_path, rule)
    assert summary["status"] == "completed", summary["error"]
    assert summary["final"]["test_accuracy"] >= clean - 0.05, (summary["final"], clean)


def test_robust_rules_neutralise_one_poisoner_in_the_hierarchical_topology(tmp_path, monkeypatch):
    """Edges and server both apply the rule (build_algorithm); in memory, client 9 poisoned."""
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.algorithms.fedavg import FedAvg
    from fedhop.common.config import parse_config
    from fedhop.deploy.launch.inmemory import run_inmemory
    honest = FedAvg.client_update

    def poisoned(self, ctx, message):
        reply = honest(self, ctx, message)
        if ctx.client_id != 9:
            return reply
        return Payload(tensors={k: v * SCALE for k, v in reply.tensors.items()}, scalars=reply.scalars)

    monkeypatch.setattr(FedAvg, "client_update", poisoned)
    hier = '\n[topology]\nkind = "hierarchical"\nedges = 2\n'
    acc = {}
    for rule in ("mean", "median", "trimmed_mean", "krum"):
        cfg = parse_config(CFG + hier, [f"security.aggregation={rule}"])
        summary, _ = run_inmemory(cfg, tmp_path / rule)
        acc[rule] = summary["final"]["test_accuracy"]
    monkeypatch.setattr(FedAvg, "client_update", honest)
    summary, _ = run_inmemory(parse_config(CFG + hier), tmp_path / "clean")
    clean = summary["final"]["test_accuracy"]
    assert acc["mean"] < 0.5, (acc, clean)
    assert all(acc[rule] >= clean - 0.08 for rule in ("median", "trimmed_mean", "krum")), (acc, clean)
