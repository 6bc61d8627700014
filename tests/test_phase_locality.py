"""benchmarks/phase_locality.py (issue 49): the three orders of a round's per-client steps give the
same replies bit for bit, and the round engine aggregates them into the same model as the loop
that trains in place (`RoundEngine.train_round`)."""
from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import torch

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine, local_update
from fedhop.deploy.bench.bench_peers import workloads

ROOT = Path(__file__).resolve().parents[1]
BENCH = runpy.run_path(str(ROOT / "benchmarks" / "phase_locality.py"), run_name="phase_locality")


def test_every_order_gives_the_same_replies_and_the_loops_model():
    w = workloads(False)["W1"]
    text = w.config(3, 0)
    digests = {order: BENCH["play"](order, text, 3)[2] for order in BENCH["ORDERS"]}
    assert len(set(digests.values())) == 1, digests
    # the replies the orders hash are the round engine's: one more run, its model checked against the loop
    loop = RoundEngine(parse_config(text))
    for rnd in range(1, 4):
        loop.train_round(rnd)
    replay = RoundEngine(parse_config(text))
    for rnd in range(1, 4):
        sampled = replay.sample(rnd)
        _, own = replay.messages(rnd, sampled)
        model = replay.task.build_model()
        replies = {cid: BENCH["_wire"](local_update(replay.cfg, replay.task, replay.algorithm, model, cid, rnd,
                                                    BENCH["_wire"](own[cid], rnd, "server", f"client-{cid}", "train"),
                                                    {}), rnd, f"client-{cid}", "server", "train.reply")
                   for cid in sampled}
        replay.finish_round(rnd, {cid: replay.accept(rnd, f"client {cid}", replies[cid]) for cid in sampled}, sampled)
    for name, w_loop in loop.state.params.items():
        assert torch.equal(w_loop, replay.state.params[name]), name


def test_the_benchmark_prints_each_order_from_a_folder_of_its_own(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "phase_locality.py"), "--rounds", "3",
                          "--repeats", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for order in BENCH["ORDERS"]:
        assert f"  {order} " in res.stdout
    assert "replies: the same bits in every order" in res.stdout
