"""Server step sizes and the FedOpt family (issue 4): every method on the same splits and seeds.

    .venv/bin/python benchmarks/serverstep_compare.py --seeds 0 1 2 --out runs/serverstep
    .venv/bin/python benchmarks/serverstep_compare.py --tasks synth --rounds 100 --seeds 0 1 2 3 4

Digest shared/research/seed-000.md section 5, "Cheapest checks": 100 clients, 10 per round,
Dirichlet(0.1) label split, 1 local epoch of batch 32, on two offline proxies:

- `synth`: softmax regression (model.kind = "logreg") on a 10-class Gaussian mixture in d = 20
  (class means ~ N(0, sep^2 I), sep = 0.5, x = mean_y + N(0, I)); 10,000 training samples split over the
  clients by common.partition.dirichlet, 2,000 iid test samples.  The data is drawn from the
  named stream "data/serverstep/<seed>" and written as an npz per seed (dataset = "npz"), so
  the split is part of the run's inputs and identical for every method;
- `digits`: scikit-learn's digits with the small CNN (model.kind = "cnn"), the base config
  examples/compare_serverstep.toml (Dirichlet(0.1) split by the run's "partition" stream).

Every (task, method, seed) is one full framework run (`deploy.launch.inmemory.run_inmemory`: the real
server, client hosts, codec and ledger over the in-memory transport); every method sees the same
samples and the same sampled clients (named seeded streams), only the algorithm differs.
Prints and writes (--out/figures.md, figures.json) a Markdown table per task: test accuracy at
fixed rounds (mean +- std over seeds), the final client-reported train loss, and bytes per
round (uplink and downlink framed bytes, and the uplink tensor bytes per client reply).  Writes
every run directory and a `fedhop report` of the first seed's runs per task (--out/report-<task>).
Methods whose algorithm is not registered are skipped with a note.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedhop.common.algorithms import registry
from fedhop.common.config import load_config
from fedhop.common.data.partition import dirichlet
from fedhop.common.records.runstore import RunStore
from fedhop.common.util.rng import numpy_stream
from fedhop.deploy.launch.inmemory import run_inmemory

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = ROOT / "examples" / "compare_serverstep.toml"

#: label -> (algorithm name, its [algorithm] keys).  Client lr is the base config's for all;
#: server lr 1 (the paper's Appendix C) except the adaptive FedOpt methods, which use 0.1
#: (digest section 5's proxy run; with tau = 1e-3 a server lr of 1 moves every coordinate by ~1).
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg": ("fedavg", {}),
    "FedLi-LS (unit)": ("fedli_ls", {}),
    "FedLi-LS (max)": ("fedli_ls", {"server_step": "max"}),
    "FedLi-LU (paper)": ("fedli_lu", {}),
    "FedLi-LU (code)": ("fedli_lu", {"preset": "code"}),
    "FedExP": ("fedexp", {}),
    "FedAdam": ("fedadam", {"server_lr": 0.1}),
    "FedYogi": ("fedyogi", {"server_lr": 0.1}),
    "FedAdagrad": ("fedadagrad", {"server_lr": 0.1}),
    "FedAvgM": ("fedavgm", {}),
    "FedProx": ("fedprox", {"mu": 0.01}),
    "SCAFFOLD": ("scaffold", {}),
    "FedNova": ("fednova", {}),
}

TASKS: dict[str, list[str]] = {
    "synth": ["model.kind=logreg", 'data.dataset="npz"', "data.standardize=false"],
    "digits": ["model.kind=cnn"],
}


def make_synth(seed: int, path: Path, clients: int, alpha: float, n_train: int = 10_000, n_test: int = 2_000,
               dim: int = 20, classes: int = 10, sep: float = 0.5) -> Path:
    """The Gaussian-mixture softmax-regression data set with a Dirichlet(alpha) label split, as an npz."""
    rng = numpy_stream(seed, "data/serverstep", seed)
    means = rng.normal(0.0, sep, (classes, dim))
    y = rng.integers(0, classes, n_train + n_test)
    x = (means[y] + rng.standard_normal((len(y), dim))).astype(np.float32)
    parts = dirichlet(y[:n_train], clients, alpha, numpy_stream(seed, "data/serverstep/partition"),
                      min_size=2, max_tries=10_000)
    arrays = {"x_test": x[n_train:], "y_test": y[n_train:]}
    for i, idx in enumerate(parts):
        arrays[f"x_{i}"], arrays[f"y_{i}"] = x[idx], y[idx]
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


def _set(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}" if isinstance(value, str) else f"{key}={value}"


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in label.lower()).strip("-").replace("--", "-")


def run_one(task: str, label: str, algo: str, keys: dict[str, Any], seed: int, args: argparse.Namespace,
            out: Path) -> dict:
    overrides = [f"algorithm.name={algo}", f"run.seed={seed}", f"run.rounds={args.rounds}",
                 f"run.eval_every={args.eval_every}", "transport.kind=inmemory",
                 f"run.name={task}-{_slug(label)}-s{seed}"] + TASKS[task]
    if task == "synth":
        data = make_synth(seed, out / "data" / f"softmax_seed{seed}.npz", 100, args.alpha)
        overrides.append(_set("data.path", str(data.resolve())))
    else:
        overrides.append(f"data.alpha={args.alpha}")
    overrides += [_set(f"algorithm.{k}", v) for k, v in keys.items()] + list(args.set)
    cfg = load_config(args.config, overrides)
    run_dir = out / task / f"{_slug(label)}-seed{seed}"
    started = time.perf_counter()
    summary, coord = run_inmemory(cfg, run_dir)
    wall = time.perf_counter() - started
    store = RunStore(run_dir / "run.db")
    rows = store.rounds()
    acc = {row["round"]: row["metrics"]["test_accuracy"] for row in rows if "test_accuracy" in row["metrics"]}
    loss = [row["metrics"].get("client_train_loss") for row in rows]
    by_dir = store.bytes_by_link_direction().get("client-server", {})
    up, down = by_dir.get("up", {}), by_dir.get("down", {})
    n = max(len(rows), 1)
    replies = [m["tensor_bytes"] for m in store.messages()
               if m["role"] == "sender" and m["method"] == "train.reply" and m["link"] == "client-server"]
    return {"task": task, "label": label, "algorithm": algo, "keys": keys, "seed": seed, "run_dir": str(run_dir),
            "status": summary["status"], "error": summary.get("error", ""), "rounds": len(rows),
            "accuracy": acc, "final_client_loss": loss[-1] if loss else None,
            "up_bytes_per_round": up.get("framed_bytes", 0) / n, "down_bytes_per_round": down.get("framed_bytes", 0) / n,
            "up_tensor_bytes_per_reply": statistics.fmean(replies) if replies else 0.0,
            "server_scalars": {k: v for k, v in coord.state.scalars.items() if isinstance(v, (int, float))},
            "wall_seconds": wall}


def _ms(values: list[float | None], spec: str = ".3f") -> str:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return "-"
    if len(vals) == 1:
        return format(vals[0], spec)
    return f"{format(statistics.fmean(vals), spec)} ± {format(statistics.stdev(vals), spec)}"


def summarize(task: str, results: list[dict], args: argparse.Namespace) -> str:
    checkpoints = sorted({max(args.eval_every, args.rounds // 2), args.rounds})
    head = " | ".join(f"acc @ {r}" for r in checkpoints)
    lines = [f"### {task}: {args.rounds} rounds, seeds {args.seeds}, Dirichlet({args.alpha}), 100 clients, 10 per round",
             "", f"| method | {head} | client loss (last round) | up KB/round | down KB/round | up tensor B/reply |",
             "|---|" + "---|" * (len(checkpoints) + 4)]
    for label in dict.fromkeys(r["label"] for r in results if r["task"] == task):
        rs = [r for r in results if r["task"] == task and r["label"] == label]
        failed = [r for r in rs if r["status"] != "completed"]
        accs = " | ".join(_ms([r["accuracy"].get(c) for r in rs]) for c in checkpoints)
        flag = f" ({len(failed)} failed)" if failed else ""
        lines.append(f"| {label}{flag} | {accs} | {_ms([r['final_client_loss'] for r in rs])} "
                     f"| {statistics.fmean(r['up_bytes_per_round'] for r in rs) / 1e3:.2f} "
                     f"| {statistics.fmean(r['down_bytes_per_round'] for r in rs) / 1e3:.2f} "
                     f"| {statistics.fmean(r['up_tensor_bytes_per_reply'] for r in rs):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(EXAMPLE))
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--methods", nargs="*", default=None, help="labels' first word, e.g. FedAvg FedLi-LS")
    ap.add_argument("--set", action="append", default=[], help="extra SECTION.KEY=VALUE overrides (all runs)")
    ap.add_argument("--out", default="runs/serverstep")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    known = registry()
    results, notes, tables = [], [], []
    for task in args.tasks:
        for label, (algo, keys) in METHODS.items():
            if args.methods and label.split(" ")[0] not in args.methods:
                continue
            if algo not in known:
                notes.append(f"{label}: algorithm '{algo}' is not registered; skipped")
                continue
            for seed in args.seeds:
                r = run_one(task, label, algo, keys, seed, args, out)
                final = r["accuracy"].get(args.rounds)
                print(f"{task:6s} {label:18s} seed {seed}: {r['status']:9s} acc {final if final is None else round(final, 3)} "
                      f"({r['wall_seconds']:.1f}s)", flush=True)
                results.append(r)
        tables.append(summarize(task, results, args))
    notes = sorted(set(notes))
    text = "\n\n".join(tables) + "".join(f"\n- note: {n}" for n in notes)
    (out / "figures.md").write_text(text + "\n")
    (out / "figures.json").write_text(json.dumps({"args": vars(args), "results": results, "notes": notes},
                                                 indent=2, default=str))
    print(text)
    from fedhop.deploy.tools.report import build_report
    for task in args.tasks:
        first = [r["run_dir"] for r in results if r["task"] == task and r["seed"] == args.seeds[0]]
        if first:
            build_report(first, out / f"report-{task}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
