"""Measured checks of the federated minimax algorithms (research/seed-003.md, sections 5.1, 5.2, 4.2).

    .venv/bin/python -m benchmarks.minimax_checks                 # every table (~8 min on 1 CPU core)
    .venv/bin/python -m benchmarks.minimax_checks --part two      # 5.1 two-client closed form only
    .venv/bin/python -m benchmarks.minimax_checks --part vector   # 5.1 vector version, partial participation
    .venv/bin/python -m benchmarks.minimax_checks --part fair     # fair classification on digits

Every run is a config (TOML text below) run by `common.algorithms.minimax_driver.simulate`, the
round loop of a real run without the transport (tests/test_minimax.py checks it gives the
in-memory run's model bit for bit), so thousands of rounds take seconds.  Tables print as
Markdown; docs/minimax.md holds the measured ones.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.local import set_params
from fedhop.common.algorithms.minimax_driver import simulate
from fedhop.common.config import parse_config, resolve_clients_per_round
from fedhop.common.tasks import build_task


def run_config(text: str, on_round=None):
    cfg = parse_config(text)
    task = build_task(cfg)
    state = simulate(build_algorithm(cfg), task, cfg.run.rounds, per_round=resolve_clients_per_round(cfg),
                     seed=cfg.run.seed, local_steps=cfg.algorithm.local_steps,
                     local_epochs=cfg.algorithm.local_epochs, on_round=on_round)
    return cfg, task, state


def distance(state, z) -> float:
    x, y = state.params["x"].double().numpy(), state.params["y"].double().numpy()
    return float(np.sqrt(np.sum((x - z[0]) ** 2) + np.sum((y - z[1]) ** 2)))


def fmt_point(state) -> str:
    return f"({float(state.params['x'][0]):.3f}, {float(state.params['y'][0]):.3f})"


# ============================================================================ 5.1, two clients
TWO_CLIENT = """
[run]
seed = 0
rounds = {rounds}
[algorithm]
name = "{algorithm}"
lr = {lr}
server_lr = 1.0
local_steps = [2, 5]
batch_size = 0
[data]
dataset = "minimax_quadratic"
a = [1.0, 1.0]
c = [1.0, 1.0]
u = [[-2.0], [2.0]]
v = [[1.0], [3.0]]
b = 0.5
sizes = [1, 1]
dtype = "float64"
[clients]
count = 2
per_round = 2
"""


def two_client_table(etas=(0.1, 0.01, 0.001)) -> str:
    rows = ["| eta_c | rounds | Local SGDA limit | dist to z* | dist to z~* | Fed-Norm-SGDA limit | dist to z* |",
            "|---|---|---|---|---|---|---|"]
    for eta in etas:
        rounds = max(200, math.ceil(4 / eta))
        _, task, local = run_config(TWO_CLIENT.format(rounds=rounds, algorithm="local_sgda", lr=eta))
        _, _, norm = run_config(TWO_CLIENT.format(rounds=rounds, algorithm="fed_norm_sgda", lr=eta))
        p = np.asarray(task.weights)
        z_star, z_tilde = task.saddle(), task.saddle(p * [2, 5] / np.dot(p, [2, 5]))
        rows.append(f"| {eta} | {rounds} | {fmt_point(local)} | {distance(local, z_star):.4f} | "
                    f"{distance(local, z_tilde):.4f} | {fmt_point(norm)} | {distance(norm, z_star):.4f} |")
    header = (f"True saddle z* = ({z_star[0][0]:.4f}, {z_star[1][0]:.4f}); step-weighted surrogate "
              f"z~* = ({z_tilde[0][0]:.4f}, {z_tilde[1][0]:.4f}); ||z~* - z*|| = "
              f"{math.dist(np.concatenate(z_star), np.concatenate(z_tilde)):.4f}\n\n")
    return header + "\n".join(rows)


# ============================================================================ 5.1, vector version
VECTOR = """
[run]
seed = {seed}
rounds = {rounds}
[algorithm]
name = "{algorithm}"
lr = 0.02
server_lr = {ratio}
local_steps = {local_steps}
batch_size = 0
{extra}
[data]
dataset = "minimax_quadratic"
dim = 5
spread = 3.0
curvature_low = 0.5
curvature_high = 2.0
b = 0.5
noise = 0.5
dtype = "float64"
[clients]
count = 10
per_round = {per_round}
"""


def late_error(text: str) -> tuple[float, float]:
    """Mean distance to the true saddle over the second half of the rounds, and ||z~* - z*||."""
    cfg = parse_config(text)
    errors: list[float] = []
    task_box = {}

    def hook(r, state, _sampled):
        if r > cfg.run.rounds // 2:
            errors.append(distance(state, task_box["z"]))

    task = build_task(cfg)
    task_box["z"] = task.saddle()
    steps = cfg.algorithm.local_steps
    simulate(build_algorithm(cfg), task, cfg.run.rounds, per_round=resolve_clients_per_round(cfg),
             seed=cfg.run.seed, local_steps=steps, on_round=hook)
    taus = np.asarray(steps if isinstance(steps, list) else [1] * task.num_clients, dtype=float)
    p = np.asarray(task.weights)
    gap = math.dist(np.concatenate(task.saddle()), np.concatenate(task.saddle(p * taus / np.dot(p, taus))))
    return float(np.mean(errors)), gap


def vector_table(per_rounds=(10, 5, 2), schedule=((1.0, 300), (0.25, 1200), (0.0625, 4800))) -> str:
    taus = list(range(1, 11))
    rows = ["| server lr gamma_s (rounds) | " + " | ".join(f"P={p} Local / Fed-Norm" for p in per_rounds) + " |",
            "|---|" + "---|" * len(per_rounds)]
    gap = float("nan")
    for ratio, rounds in schedule:
        cells = []
        for per_round in per_rounds:
            errs = []
            for algorithm in ("local_sgda", "fed_norm_sgda"):
                err, gap = late_error(VECTOR.format(seed=0, rounds=rounds, algorithm=algorithm, ratio=ratio,
                                                    local_steps=taus, extra="", per_round=per_round))
                errs.append(err)
            cells.append(f"{errs[0]:.2f} / **{errs[1]:.2f}**")
        rows.append(f"| {ratio:g} eta_c ({rounds}) | " + " | ".join(cells) + " |")
    drawn = []
    for algorithm in ("local_sgda", "fed_norm_sgda"):
        err, _ = late_error(VECTOR.format(seed=0, rounds=600, algorithm=algorithm, ratio=1.0, local_steps=0,
                                          extra='local_draw = "round"\ndraw_low = 2\ndraw_high = 10',
                                          per_round=10))
        drawn.append(err)
    return (f"Fixed tau_i = 1..10: ||z~* - z*|| = {gap:.2f}.\n\n" + "\n".join(rows) +
            f"\n\ntau_i ~ U{{2..10}} redrawn every round, P = 10, gamma_s = eta_c, 600 rounds: "
            f"Local SGDA {drawn[0]:.2f}, Fed-Norm-SGDA {drawn[1]:.2f}.")


# ============================================================================ fair classification
FAIR = """
[run]
seed = {seed}
rounds = {rounds}
[algorithm]
name = "{algorithm}"
lr = 0.05
lr_y = 0.05
server_lr = 1.0
batch_size = 32
local_steps = 0
local_draw = "client"
draw_unit = "epochs"
draw_low = 2
draw_high = 5
draw_seed = {seed}
{extra}
[data]
dataset = "fair_digits"
partition = "dirichlet"
alpha = 0.1
lam = 0.1
[model]
kind = "mlp"
hidden = [32]
[clients]
count = 15
per_round = {per_round}
"""

FAIR_METHODS = (("Local SGDA", "local_sgda", ""),
                ("Momentum Local SGDA", "local_sgda", 'solver = "momentum"\nmomentum = 0.9'),
                ("Local SGDA+", "local_sgda_plus", "snapshot_period = 5"),
                ("Fed-Norm-SGDA", "fed_norm_sgda", ""),
                ("Fed-Norm-SGDA+", "fed_norm_sgda_plus", "snapshot_period = 5"))


def fair_table(seeds=(0, 1, 2), per_rounds=(15, 5), rounds=100, early=20) -> str:
    rows = ["| method | P | worst-class acc @ round " + str(early) + " | worst-class acc @ round " + str(rounds)
            + " | test acc @ round " + str(rounds) + " |", "|---|---|---|---|---|"]
    for per_round in per_rounds:
        for label, algorithm, extra in FAIR_METHODS:
            at_early, final, acc = [], [], []
            for seed in seeds:
                text = FAIR.format(seed=seed, rounds=rounds, algorithm=algorithm, extra=extra, per_round=per_round)
                box = {}

                def hook(r, state, _sampled, box=box):
                    if r == early:
                        box["early"] = evaluate(box["task"], state)["worst_class_accuracy"]

                cfg = parse_config(text)
                box["task"] = task = build_task(cfg)
                state = simulate(build_algorithm(cfg), task, rounds, per_round=per_round, seed=seed,
                                 local_steps=0, on_round=hook)
                metrics = evaluate(task, state)
                at_early.append(box["early"])
                final.append(metrics["worst_class_accuracy"])
                acc.append(metrics["test_accuracy"])
            rows.append(f"| {label} | {per_round} | {mean_std(at_early)} | {mean_std(final)} | {mean_std(acc)} |")
    return (f"15 clients, Dirichlet alpha = 0.1, batch 32, tau_i ~ U{{2..5}} epochs fixed per client, "
            f"seeds {list(seeds)} (mean +- std):\n\n" + "\n".join(rows))


def evaluate(task, state) -> dict[str, float]:
    model = task.build_model()
    set_params(model, state.params)
    with torch.no_grad():
        return task.evaluate(model)


def mean_std(values) -> str:
    return f"{np.mean(values):.3f} +- {np.std(values):.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "two", "vector", "fair"), default="all")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    parts = {"two": ("Section 5.1: two clients, tau = (2, 5), full participation", two_client_table),
             "vector": ("Section 5.1: vector version, mean distance to z* over the second half of the rounds",
                        vector_table),
             "fair": ("Fair classification on digits (Fig. 5 setting, scaled down)", fair_table)}
    for key, (title, fn) in parts.items():
        if args.part in ("all", key):
            started = time.perf_counter()
            table = fn()
            print(f"### {title}\n\n{table}\n\n({time.perf_counter() - started:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
