"""benchmarks/client_train_speed.py (issue 49, item 3): fedhop's client round and the bare
PyTorch loop it is timed against do the same math, bit for bit, so the ratio it prints compares
equal work; and its tiny mode runs and reports the steps both took."""
from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = runpy.run_path(str(ROOT / "benchmarks" / "client_train_speed.py"), run_name="client_train_speed")


@pytest.mark.parametrize("clients, sampled, batch, epochs", [(1000, 12, 10, 1), (6, 3, 10, 2), (6, 2, 0, 1)],
                         ids=["W2: one step a client", "many steps, two epochs", "full batch"])
def test_fedhop_and_the_bare_loop_end_on_the_same_parameters(clients, sampled, batch, epochs):
    host, bare, message, cids = BENCH["setup"](clients, sampled, batch, epochs)
    ours, theirs = BENCH["fedhop_pass"](host, message, cids), BENCH["bare_pass"](bare, message, cids)
    assert sorted(ours) == sorted(theirs) == cids
    assert BENCH["same_math"](ours, theirs) == []
    for cid in cids:   # the update is real (not zero) and is the bare loop's, tensor by tensor
        assert any(float(t.abs().max()) > 0 for t in theirs[cid].values())
        n = host.task.num_samples(cid)
        bs = n if batch <= 0 else min(batch, n)
        assert int(ours[cid].scalars["local_steps"]) == epochs * math.ceil(n / bs)
    # a different batch order (another round's stream) gives other parameters: the check can fail
    other = BENCH["fedhop_pass"](host, message, cids, round=2)
    if batch > 0 and any(host.task.num_samples(c) > batch for c in cids):
        assert BENCH["same_math"](other, theirs) != []


def test_w1_the_quadratic_client_round_is_the_bare_loop_and_the_closed_form():
    """W1's shape (--workload W1): one full-batch step from w = 0 on 1/2 sum_j C_ij (w_j - A_ij)^2
    moves w by lr C_i A_i (common/tasks/quadratic.py), in fedhop and in the bare loop alike."""
    w1 = BENCH["WORKLOADS"]["W1"]
    clients, lr = w1.clients, w1.lr
    host, bare, message, cids = BENCH["setup"](clients, w1.per_round, w1.batch_size, w1.epochs, lr, workload="W1")
    ours, theirs = BENCH["fedhop_pass"](host, message, cids), BENCH["bare_pass"](bare, message, cids)
    assert cids == list(range(clients)) and BENCH["same_math"](ours, theirs) == []
    for cid in cids:
        centers, curvatures = host.task.client_data(cid).tensors
        expected = (lr * curvatures[0].double() * centers[0].double()).float()
        assert torch.allclose(ours[cid].tensors["w"], expected, rtol=1e-6, atol=1e-7)
        assert int(ours[cid].scalars["local_steps"]) == 1


def test_the_tiny_run_prints_the_ratio_and_writes_its_figures(tmp_path, capsys):
    assert BENCH["main"](["--clients", "40", "--sampled", "4", "--pairs", "2", "--json", str(tmp_path / "o.json")]) == 0
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["workload"] == "W2" and out["sampled"] == 4 and out["pairs"] == 2
    assert out["fedhop_cpu_ms"] > 0 and out["bare_cpu_ms"] > 0
    assert out["ratio_min"] <= out["ratio"] <= out["ratio_max"]
    assert "ratio fedhop / bare" in capsys.readouterr().out
    assert BENCH["main"](["--workload", "W1", "--pairs", "2", "--json", str(tmp_path / "w1.json")]) == 0
    w1 = json.loads((tmp_path / "w1.json").read_text())
    assert (w1["workload"], w1["clients"], w1["sampled"], w1["batch"], w1["steps"]) == ("W1", 10, 10, 0, 10)


def test_bad_sizes_are_refused_with_exit_2():
    with pytest.raises(SystemExit) as exc:
        BENCH["main"](["--workload", "W1", "--sampled", "20"])
    assert exc.value.code == 2
