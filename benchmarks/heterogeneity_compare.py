"""FedLGA's Table V protocol scaled to a CPU: rounds and simulated time to a target accuracy.

    .venv/bin/python benchmarks/heterogeneity_compare.py --seeds 0 1 2 --out runs/hetero
    .venv/bin/python benchmarks/heterogeneity_compare.py --rho 0.0 --seeds 0 --out runs/hetero-rho0

Every (method, seed) is one full framework run (`deploy.launch.inmemory.run_inmemory`: the server,
client hosts, codec, ledger and virtual clock of a real run over the in-memory transport) of
examples/stragglers_digits.toml: digits in 2-classes-per-client shards, N = 50, K = 10, E = 5
epochs of batch 10, rho = 0.5 (exactly 5 stragglers per round, each missing 1..4 epochs), two
device speed classes and two uplink bandwidths.  Every method sees the same samples, the same
stragglers and the same devices (named seeded streams), so only the algorithm differs.

For each run: rounds to the target test accuracy, simulated seconds to it (running sum of the
rounds' `sim_seconds`), bytes to it, best and final accuracy.  Writes every run directory,
`figures.md` / `figures.json` in --out, and a `fedhop report` of the first seed's runs
(accuracy against rounds, bytes and simulated time) in --out/report.  Methods whose algorithm
is not registered (yet) are skipped with a note.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fedhop.common.algorithms import registry
from fedhop.common.config import load_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = ROOT / "examples" / "stragglers_digits.toml"

#: label -> (algorithm name, its own [algorithm] keys).  Paper: FedProx mu = 1; FedDyn alpha is
#: not given (digest section 4: 0.01); FedLGA lambda = 1 and the "delta" gradient source are the
#: paper's reading; the two extra FedLGA rows are NOT in the paper (a smaller lambda, a clip).
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg": ("fedavg", {}),
    "FedProx (mu=1)": ("fedprox", {"mu": 1.0}),
    "FedNova": ("fednova", {}),
    "SCAFFOLD": ("scaffold", {}),
    "FedDyn (alpha=0.01)": ("feddyn", {"alpha": 0.01}),
    "FedLGA (paper: delta, lambda=1)": ("fedlga", {}),
    "FedLGA (lambda=0.25)": ("fedlga", {"lga_lambda": 0.25}),
    "FedLGA (diag)": ("fedlga", {"lga_grad_source": "diag"}),
}


def _set(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}" if isinstance(value, str) else f"{key}={value}"


def run_one(label: str, algo: str, keys: dict[str, Any], seed: int, args: argparse.Namespace, out: Path) -> dict:
    slug = label.split(" ")[0].lower() + ("" if not keys else "-" + "-".join(f"{k}{v}" for k, v in keys.items()))
    overrides = [f"algorithm.name={algo}", f"run.seed={seed}", f"run.rounds={args.rounds}",
                 "transport.kind=inmemory", f"clients.straggler_fraction={args.rho}",
                 f"run.name={slug}-s{seed}"] + [_set(f"algorithm.{k}", v) for k, v in keys.items()]
    cfg = load_config(args.config, overrides + list(args.set))
    run_dir = out / f"{slug}-seed{seed}"
    started = time.perf_counter()
    summary, _ = run_inmemory(cfg, run_dir)
    wall = time.perf_counter() - started
    store = RunStore(run_dir / "run.db")
    rows = store.rounds()
    cum_bytes = store.cumulative_bytes_by_round()
    clock, hit, acc = 0.0, None, []
    for row in rows:
        clock += row.get("sim_seconds") or 0.0
        a = row["metrics"].get("test_accuracy")
        if a is None:
            continue
        acc.append(a)
        if hit is None and a >= args.target:
            hit = {"round": row["round"], "sim_seconds": clock,
                   "framed_bytes": cum_bytes.get(row["round"], {}).get("framed_bytes")}
    sims = [r["sim_seconds"] for r in rows if r.get("sim_seconds") is not None]
    return {"label": label, "algorithm": algo, "keys": keys, "seed": seed, "run_dir": str(run_dir),
            "status": summary["status"], "error": summary.get("error", ""), "rounds": len(rows),
            "rounds_to_target": hit["round"] if hit else None,
            "sim_seconds_to_target": hit["sim_seconds"] if hit else None,
            "framed_bytes_to_target": hit["framed_bytes"] if hit else None,
            "best_accuracy": max(acc) if acc else None, "final_accuracy": acc[-1] if acc else None,
            "mean_sim_round_seconds": statistics.fmean(sims) if sims else None,
            "bytes_per_round": (summary["bytes"]["total"] or {}).get("framed_bytes", 0) / max(len(rows), 1),
            "wall_seconds": wall}


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def summarize(results: list[dict], args: argparse.Namespace, notes: list[str]) -> str:
    lines = [f"Target test accuracy {args.target:g}; rho = {args.rho}; {args.rounds} rounds; seeds {args.seeds}.",
             "Medians over the seeds that reached the target (reached = how many did).", "",
             "| method | reached | rounds to target | sim s to target | MB to target | best acc | final acc "
             "| sim s / round | MB / round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in dict.fromkeys(r["label"] for r in results):
        rs = [r for r in results if r["label"] == label]
        reached = [r for r in rs if r["rounds_to_target"] is not None]
        mb = _median([r["framed_bytes_to_target"] for r in reached])
        lines.append(
            f"| {label} | {len(reached)}/{len(rs)} | {_fmt(_median([r['rounds_to_target'] for r in reached]), 'g')} "
            f"| {_fmt(_median([r['sim_seconds_to_target'] for r in reached]), '.1f')} "
            f"| {_fmt(mb / 1e6 if mb is not None else None, '.1f')} "
            f"| {_fmt(_median([r['best_accuracy'] for r in rs]))} | {_fmt(_median([r['final_accuracy'] for r in rs]))} "
            f"| {_fmt(_median([r['mean_sim_round_seconds'] for r in rs]), '.3f')} "
            f"| {_fmt(_median([r['bytes_per_round'] for r in rs]) / 1e6, '.2f')} |")
    lines.append("")
    lines.append("Per seed (rounds to target / sim s to target):")
    for r in results:
        lines.append(f"- {r['label']} seed {r['seed']}: {r['status']} {r['error'][:80]} "
                     f"{_fmt(r['rounds_to_target'], 'g')} / {_fmt(r['sim_seconds_to_target'], '.1f')}, "
                     f"best {_fmt(r['best_accuracy'])}, wall {r['wall_seconds']:.1f}s")
    lines += [f"- note: {n}" for n in notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(EXAMPLE))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--rho", type=float, default=0.5)
    ap.add_argument("--target", type=float, default=0.90)
    ap.add_argument("--methods", nargs="*", default=None, help="labels' first word, e.g. FedAvg FedLGA")
    ap.add_argument("--set", action="append", default=[], help="extra SECTION.KEY=VALUE overrides")
    ap.add_argument("--out", default="runs/heterogeneity")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    known = registry()
    results, notes = [], []
    for label, (algo, keys) in METHODS.items():
        if args.methods and label.split(" ")[0] not in args.methods:
            continue
        if algo not in known:
            notes.append(f"{label}: algorithm '{algo}' is not registered; skipped")
            continue
        for seed in args.seeds:
            r = run_one(label, algo, keys, seed, args, out)
            print(f"{label:34s} seed {seed}: {r['status']:9s} rounds->target {r['rounds_to_target']} "
                  f"sim->target {_fmt(r['sim_seconds_to_target'], '.1f')} best {_fmt(r['best_accuracy'])} "
                  f"({r['wall_seconds']:.1f}s)", flush=True)
            results.append(r)
    text = summarize(results, args, notes)
    (out / "figures.md").write_text(text + "\n")
    (out / "figures.json").write_text(json.dumps({"args": vars(args), "results": results, "notes": notes}, indent=2))
    print(text)
    first = [r["run_dir"] for r in results if r["seed"] == args.seeds[0]]
    if first:
        from fedhop.deploy.tools.report import build_report
        build_report(first, out / "report", target=args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
