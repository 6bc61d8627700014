"""Compare the five composite methods (FedMiD, FedDA, Fast-FedDA, C-FedDA, MC-FedDA) on the
paper's synthetic tasks (seed-001 digest 4.1, 4.2) and on digits (sparse multinomial logistic
regression), and print the figures of docs/composite.md.

    .venv/bin/python benchmarks/composite_compare.py lasso   --seeds 0 1 --out runs/composite
    .venv/bin/python benchmarks/composite_compare.py lowrank --seeds 0 1 --out runs/composite
    .venv/bin/python benchmarks/composite_compare.py digits  --seeds 0   --out runs/composite

Each (method, seed) is one full framework run (`deploy.launch.inmemory.run_inmemory`: the server,
client hosts, codec and ledger of a real run over the in-memory transport) of
examples/<task>_compare.toml with the method's [algorithm] keys from `METHOD_KEYS`.  The
script writes every run directory, `<task>-figures.md` / `.json` (rounds to l2 <= 1, final
errors, F1, exact zeros, rank, bytes per round and in total, uplink and downlink) and one
`fedhop report` per metric (plots against rounds and against bytes).  `--direct` uses
`run_direct` instead: the round engine (common/engine/rounds.py) in a tight loop without transport
(no ledger, so no bytes), which the paper-setting test uses.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from fedhop.common.algorithms.base import ServerState
from fedhop.common.config import Config, config_from_dict
from fedhop.common.engine.rounds import RoundEngine

ROOT = Path(__file__).resolve().parents[1]

METHODS = ("fedmid", "fedda", "fast_fedda", "c_fedda", "mc_fedda")
#: [algorithm] keys shared by all methods of a comparison (taken from the example file)
SHARED_KEYS = ("regularizer", "reg", "local_steps", "local_epochs", "batch_size", "weighting", "weight_decay")

# Per-method hyper-parameters (digest 4.1, 4.2, 4.3 and 8; gamma in the authors' code convention).
METHOD_KEYS: dict[str, dict[str, dict[str, Any]]] = {
    "lasso": {
        "fedmid": {"lr": 1e-3, "server_lr": 1.0},
        "fedda": {"lr": 1e-3, "server_lr": 1.0},
        "fast_fedda": {"mu": 0.1, "gamma": 550.0},
        "c_fedda": {"mu": 0.1, "gamma": 600.0},
        "mc_fedda": {"mu": 0.1, "gamma": 600.0, "stage_rounds": [250, 250, 1500],
                     "stage_reg": [0.125, 0.0625, 0.03125]},
    },
    "lowrank": {
        "fedmid": {"lr": 1e-3, "server_lr": 1.0},
        "fedda": {"lr": 1e-3, "server_lr": 1.0},
        "fast_fedda": {"mu": 0.1, "gamma": 550.0},
        "c_fedda": {"mu": 0.1, "gamma": 600.0},
        "mc_fedda": {"mu": 0.1, "gamma": 600.0, "stage_rounds": [250, 250, 1000], "stage_reg": [0.3, 0.15, 0.1]},
    },
    "digits": {
        "fedmid": {"lr": 0.01, "server_lr": 1.0},
        "fedda": {"lr": 0.01, "server_lr": 1.0},
        "fast_fedda": {"mu": 1e-3, "gamma": 25.0},
        "c_fedda": {"mu": 1e-3, "gamma": 25.0},
        "mc_fedda": {"mu": 1e-3, "gamma": 25.0, "stage_rounds": [40, 40, 40, 40, 40],
                     "stage_reg": [4e-4, 2e-4, 1e-4, 1e-4, 1e-4]},
    },
}
EXAMPLES = {"lasso": ROOT / "examples" / "lasso_compare.toml", "lowrank": ROOT / "examples" / "lowrank_compare.toml"}

#: the digits comparison has no example file of its own: this is its base config
DIGITS_BASE: dict[str, Any] = {
    "run": {"name": "digits-l1", "seed": 0, "rounds": 200, "eval_every": 10},
    "algorithm": {"name": "fast_fedda", "regularizer": "l1", "reg": 1e-4, "local_steps": 10, "batch_size": 25,
                  "mu": 1e-3, "gamma": 25.0},
    "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
    "model": {"kind": "logreg", "init": "zeros"},
    "clients": {"count": 50, "per_round": 10, "processes": 1},
    "transport": {"kind": "inmemory"},
}


# ---------------------------------------------------------------------------- configs
def base_config(task: str) -> dict[str, Any]:
    if task == "digits":
        return copy.deepcopy(DIGITS_BASE)
    if task not in EXAMPLES:
        raise SystemExit(f"unknown task {task!r} (allowed: lasso, lowrank, digits)")
    return tomllib.loads(EXAMPLES[task].read_text())


def method_config(task: str, method: str, seed: int, rounds: int | None = None,
                  base: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Config:
    """The comparison's config for one method and seed: the example's shared keys plus the method's own."""
    data = copy.deepcopy(base if base is not None else base_config(task))
    shared = {k: v for k, v in data.get("algorithm", {}).items() if k in SHARED_KEYS}
    data["algorithm"] = {"name": method, **shared, **METHOD_KEYS[task][method], **(extra or {})}
    data.setdefault("run", {})
    data["run"]["seed"] = seed
    data["run"]["name"] = f"{task}-{method}-s{seed}"
    if rounds is not None:
        data["run"]["rounds"] = rounds
    data.setdefault("transport", {})["kind"] = "inmemory"
    return config_from_dict(data)


# ---------------------------------------------------------------------------- drivers
def run_direct(cfg: Config, on_round: Callable[[int, dict[str, float]], None] | None = None,
               on_state: Callable[[int, Any, ServerState], None] | None = None
               ) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """The coordinator's rounds without transport or ledger: the round engine (common/engine/rounds.py)
    in this process.  Returns the per-round evaluations (eval_every as configured; the last round
    always) and the final model.  `on_state(round, algorithm, state)` sees the server state after
    every server step."""
    torch.set_num_threads(cfg.run.torch_threads)
    engine = RoundEngine(cfg)
    history = []
    for r in range(1, cfg.run.rounds + 1):
        engine.train_round(r)
        if on_state is not None:
            on_state(r, engine.algorithm, engine.state)
        if engine.evaluation_due(r):
            metrics = {"round": r, **engine.evaluate()}
            history.append(metrics)
            if on_round is not None:
                on_round(r, metrics)
    return history, {k: v.clone() for k, v in engine.state.params.items()}


def run_framework(cfg: Config, run_dir: Path) -> tuple[dict, list[dict[str, float]], dict[str, Any]]:
    """One full in-process run; returns (summary, per-round metrics, bytes by link and direction)."""
    from fedhop.common.records.runstore import RunStore
    from fedhop.deploy.launch.inmemory import run_inmemory

    summary, coord = run_inmemory(cfg, run_dir)
    history = [{"round": h.round, **h.metrics} for h in coord.history]
    with RunStore(Path(run_dir) / "run.db", create=False) as store:
        directions = store.bytes_by_link_direction()
    return summary, history, directions


# ---------------------------------------------------------------------------- figures
def first_round(history: list[dict[str, float]], key: str, target: float, below: bool = True) -> int | None:
    for h in history:
        v = h.get(key)
        if v is not None and (v <= target if below else v >= target):
            return int(h["round"])
    return None


def figures_row(task: str, method: str, seed: int, history: list[dict[str, float]], summary: dict | None,
                directions: dict | None, wall: float, model: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    final = history[-1] if history else {}
    row: dict[str, Any] = {"task": task, "method": method, "seed": seed, "rounds": final.get("round"),
                           "wall_s": round(wall, 1)}
    if task in ("lasso", "lowrank"):
        row["rounds_to_l2_le_1"] = first_round(history, "distance_to_opt", 1.0)
        row["rounds_to_l2_le_0.5"] = first_round(history, "distance_to_opt", 0.5)
        row["final_l2"] = final.get("distance_to_opt")
    if task == "lasso":
        row.update({k: final.get(k) for k in ("support_f1", "support_f1_exact", "exact_zeros_off_support", "nnz")})
        row["rounds_to_f1_ge_0.99"] = first_round(history, "support_f1", 0.99, below=False)
    if task == "lowrank":
        row.update({k: final.get(k) for k in ("rank", "op_error")})
    if task == "digits":
        row.update({k: final.get(k) for k in ("test_accuracy", "test_loss")})
        if model is not None:
            weights = [t for n, t in model.items() if not n.endswith("bias")]
            row["weight_exact_zeros"] = int(sum(int((t == 0).sum()) for t in weights))
            row["weights"] = int(sum(t.numel() for t in weights))
    if summary is not None:
        rounds = max(int(summary["rounds_completed"]), 1)
        cs = (directions or {}).get("client-server", {})
        up = cs.get("up", {}).get("tensor_bytes", 0)
        down = cs.get("down", {}).get("tensor_bytes", 0)
        row.update({"uplink_bytes_per_round": up // rounds, "downlink_bytes_per_round": down // rounds,
                    "total_tensor_bytes": summary["bytes"]["total"]["tensor_bytes"],
                    "total_payload_bytes": summary["bytes"]["total"]["payload_bytes"],
                    "ledger_agrees": summary.get("ledger_agreement", {}).get("ok")})
    return row


def markdown_table(rows: list[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def report_plots(task: str, run_dirs: list[Path], out: Path) -> None:
    from fedhop.deploy.tools.report import build_report

    metrics = {"lasso": ("distance_to_opt", "support_f1", "exact_zeros_off_support"),
               "lowrank": ("distance_to_opt", "rank"), "digits": ("test_accuracy",)}[task]
    for metric in metrics:
        build_report(run_dirs, out / f"{task}-report-{metric}", metric=metric)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=("lasso", "lowrank", "digits"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rounds", type=int, default=None, help="override run.rounds")
    parser.add_argument("--out", default="runs/composite")
    parser.add_argument("--direct", action="store_true", help="tight loop without transport (no bytes)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, run_dirs = [], []
    for seed in args.seeds:
        for method in args.methods:
            cfg = method_config(args.task, method, seed, args.rounds)
            started = time.perf_counter()
            if args.direct:
                history, model = run_direct(cfg)
                summary = directions = None
            else:
                run_dir = out / cfg.run.name
                summary, history, directions = run_framework(cfg, run_dir)
                model = load_file(str(run_dir / "model.safetensors"))
                run_dirs.append(run_dir)
            row = figures_row(args.task, method, seed, history, summary, directions, time.perf_counter() - started,
                              model)
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / f"{args.task}-figures.json").write_text(json.dumps(rows, indent=2))
    table = markdown_table(rows)
    (out / f"{args.task}-figures.md").write_text(table + "\n")
    print(table)
    if run_dirs:
        report_plots(args.task, run_dirs, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
