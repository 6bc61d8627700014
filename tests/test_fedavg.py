"""FedAvg through the in-memory transport against an independent numpy FedAvg."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import numpy_fedavg_round, quadratic_config

RNG = np.random.default_rng(42)
CENTERS = RNG.normal(0, 2, size=(6, 5))
CURV = RNG.uniform(0.5, 2.0, size=(6, 5))
SIZES = [10, 30, 20, 5, 40, 15]


@pytest.mark.parametrize("per_round,server_lr", [(6, 1.0), (3, 0.7)])
def test_fedavg_matches_numpy(tmp_path, per_round, server_lr):
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=5, local_steps=4, lr=0.2,
                                        server_lr=server_lr, per_round=per_round))
    summary, coord = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["rounds_completed"] == 5
    w = np.zeros(5)
    for result in coord.history:
        assert len(result.participants) == per_round
        w = numpy_fedavg_round(w, CENTERS, CURV, SIZES, result.participants, 4, 0.2, server_lr)
    got = coord.state.params["w"].double().numpy()
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    # and it moved: far from the zero start, so the comparison is not vacuous
    assert np.linalg.norm(w) > 0.5


def test_partial_participation_samples_differ_and_reproduce(tmp_path):
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=6, per_round=2))
    _, a = run_inmemory(cfg, tmp_path / "a")
    _, b = run_inmemory(cfg, tmp_path / "b")
    sets_a = [tuple(r.participants) for r in a.history]
    assert sets_a == [tuple(r.participants) for r in b.history]
    assert len(set(sets_a)) > 1
    assert torch.equal(a.state.params["w"], b.state.params["w"])


def test_ledger_tensor_bytes_per_round_and_agreement(tmp_path):
    d = CENTERS.shape[1]
    per_round = 4
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=3, per_round=per_round))
    summary, _ = run_inmemory(cfg, tmp_path)
    store = RunStore(tmp_path / "run.db")
    per = store.bytes_per_round()
    for r in (1, 2, 3):
        assert per[r]["tensor_bytes"] == 2 * per_round * 4 * d
    agreement = store.check_agreement()
    assert agreement.ok and agreement.matched > 0 and not agreement.sender_only and not agreement.receiver_only
    assert summary["bytes"]["by_link"]["client-server"]["tensor_bytes"] == 3 * 2 * per_round * 4 * d


def test_nan_reply_is_rejected_and_recorded(tmp_path, monkeypatch):
    from fedhop.common.algorithms.fedavg import FedAvg
    original = FedAvg.client_update

    def poisoned(self, ctx, message):
        reply = original(self, ctx, message)
        if ctx.client_id == 1:
            reply.tensors["w"] = reply.tensors["w"] * float("nan")
        return reply

    monkeypatch.setattr(FedAvg, "client_update", poisoned)
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=2))
    summary, coord = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed"
    assert all(1 not in r.participants for r in coord.history)
    events = RunStore(tmp_path / "run.db").events("rejected_payload")
    assert len(events) == 2 and "NaN" in events[0]["detail"]
    assert torch.isfinite(coord.state.params["w"]).all()
