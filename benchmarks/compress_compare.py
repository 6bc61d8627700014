"""Accuracy against upload bytes for FedAvg with the compressor family, bracketed (issue 47's claims entry).

The papers' headline: top-k sparsification with error feedback reaches the accuracy of dense
updates at a small fraction of the upload bytes (Stich et al. 2018, "Sparsified SGD with memory";
Lin et al. 2018, "Deep gradient compression"); signSGD with majority vote (Bernstein et al. 2018)
and PowerSGD (Vogels et al. 2019) come close at 1 bit a coordinate or a rank-r factor pair.  This
script measures that claim here: FedAvg on digits as examples/fedavg_digits.toml sets it up (50
clients, Dirichlet(0.5), 10 a round, MLP 64-64-10, 2 local epochs), and optionally on the LEAF-format
FEMNIST natural partition of examples/claims/leaf/femnist_natural.toml (generated files), with:

- ``dense``: no compression (the reference);
- ``topk``: top-k 1% (float32 values), without error feedback;
- ``topk+ef``: the same with EF-SGD (``error_feedback = "ef"``);
- ``topk+ef21``: the same with EF21 (``error_feedback = "ef21"``, Richtarik et al. 2021);
- ``sign+mv``: signSGD (``up = "sign"``) with ``security.aggregation = "majority_vote"``;
- ``powersgd-r1``, ``-r2``, ``-r4``: PowerSGD rank 1, 2, 4 (warm start);
- ``qsgd``: QSGD with 15 levels, one norm per tensor.

Tuning: each compressor's step over a grid a factor of 3 apart around the example's client lr
(0.033, 0.1, 0.3), every seed at every value; the best is the highest mean final test accuracy.  A
best on the edge of the grid is widened by one more factor of 3 past it (``--extend`` times), so
"interior" means a value was tried on each side (docs/claims.md, "Bracketed grids").  signSGD with
majority vote is the exception: the server moves every coordinate by exactly ``algorithm.server_lr``
a round (w <- w + eta sign(sum_i sign(Delta_i)), Bernstein et al. 2018, Alg. 3), so the client lr
only shapes the direction and the step size that matters is eta: its grid is eta in {0.001,
0.003, 0.01} with the example's client lr 0.1.

Every run is ``run_inmemory`` (deploy/launch/inmemory.py) in this process, one after another: the same
endpoints, ledger and run.db as a real run, without sockets.  Upload bytes are the ledger's: the
tensor bytes of every message that travels towards the server (``RunStore.bytes_per_round("up")``,
each message once), so the coded parts of a compressed reply, exactly as counted on the wire.

A run that diverges (the coordinator fails it when every sampled reply is non-finite) scores 0.
The table gives, per compressor, its best setting's final accuracy per seed, its upload bytes, its
bytes per upload against dense float32, and the cumulative upload bytes at the first round that
reached each target accuracy (mean over the seeds that reached it).

    python benchmarks/compress_compare.py --seeds 0,1,2 --extend 3 --json d.json   # digits (docs/claims.md)
    python benchmarks/compress_compare.py --skip-digits --leaf DIR --extend 2      # the LEAF-format task:
        # DIR/femnist_niid from python -m fedhop.common.data.fakedata femnist_niid DIR/femnist_niid --writers 30 --samples 60
    python benchmarks/compress_compare.py --from-json d.json --target 0.9,0.95     # re-score, no runs
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "examples" / "fedavg_digits.toml"
LEAF = ROOT / "examples" / "claims" / "leaf" / "femnist_natural.toml"

# name -> ([compression]/[security] TOML lines, the tuned key)
COMPRESSORS: dict[str, tuple[str, str]] = {
    "dense": ("", "algorithm.lr"),
    "topk": ('[compression]\nup = "topk"\nratio = 0.01', "algorithm.lr"),
    "topk+ef": ('[compression]\nup = "topk"\nratio = 0.01\nerror_feedback = "ef"', "algorithm.lr"),
    "topk+ef21": ('[compression]\nup = "topk"\nratio = 0.01\nerror_feedback = "ef21"', "algorithm.lr"),
    "sign+mv": ('[compression]\nup = "sign"\n[security]\naggregation = "majority_vote"', "algorithm.server_lr"),
    "powersgd-r1": ('[compression]\nup = "powersgd"\nrank = 1', "algorithm.lr"),
    "powersgd-r2": ('[compression]\nup = "powersgd"\nrank = 2', "algorithm.lr"),
    "powersgd-r4": ('[compression]\nup = "powersgd"\nrank = 4', "algorithm.lr"),
    "qsgd": ('[compression]\nup = "qsgd"\nlevels = 15', "algorithm.lr"),
}
GRIDS = {"algorithm.lr": [0.1 / 3, 0.1, 0.3], "algorithm.server_lr": [0.001, 0.003, 0.01]}


@dataclass
class Run:
    """One finished run: its final accuracy, its upload bytes and its curve (accuracy per round)."""

    compressor: str
    value: float
    seed: int
    final: float
    up_bytes: int                       # tensor bytes of every upload of the run
    up_messages: int                    # the clients' train replies among them
    curve: list[tuple[int, int, float]] = field(default_factory=list)   # (round, cumulative up bytes, accuracy)
    diverged: bool = False

    def bytes_to(self, target: float) -> int | None:
        """Cumulative upload bytes at the first evaluated round whose accuracy is >= target."""
        return next((b for _, b, acc in self.curve if acc >= target), None)


def base_text(task: str, rounds: int, data_dir: Path | None) -> tuple[str, list[str]]:
    """The task's config text for an in-memory run, and the overrides that shorten it."""
    if task == "digits":
        text = DIGITS.read_text()
        sets = [f"run.rounds={rounds}", "run.eval_every=1", "clients.processes=1"]
    else:
        assert data_dir is not None
        text = LEAF.read_text()
        sets = [f"run.rounds={rounds}", "run.eval_every=1", f'data.data_dir="{data_dir}"']
    return text, sets + ['transport.kind="inmemory"']


def run_one(task: str, compressor: str, value: float, seed: int, rounds: int, data_dir: Path | None = None,
            run_dir: Path | None = None) -> Run:
    """Run one setting to the end in this process and read its ledger (run.db); the run folder is
    a temporary one, removed after, unless `run_dir` is given (tests read its run.db)."""
    text, sets = base_text(task, rounds, data_dir)
    extra, key = COMPRESSORS[compressor]
    cfg = parse_config(text + "\n" + extra + "\n", sets + [f"run.seed={seed}", f"{key}={value}"])
    with tempfile.TemporaryDirectory() as tmp:
        d = run_dir if run_dir is not None else Path(tmp)
        summary, _ = run_inmemory(cfg, d)
        status = str(summary.get("status"))
        if status not in ("completed", "failed"):
            raise RuntimeError(f"{compressor} {key}={value} seed {seed}: run ended {status}")
        store = RunStore(Path(d) / "run.db")
        try:
            per_round = store.bytes_per_round("up")
            cumulative = store.cumulative_bytes_by_round("up")
            rows = store.rounds()
            uploads = sum(1 for m in store.messages() if m["role"] == "sender" and m["direction"] == "up"
                          and m["method"] == "train.reply")
        finally:
            store.close()
    curve = [(int(r["round"]), cumulative[int(r["round"])]["tensor_bytes"], float(r["metrics"]["test_accuracy"]))
             for r in rows if "test_accuracy" in r["metrics"]]
    # a run that diverged (every sampled client's reply non-finite: the coordinator fails the run)
    # scores 0, as does a non-finite accuracy: a step size that diverges loses the grid
    final = float((summary.get("final") or {}).get("test_accuracy", math.nan)) if status == "completed" else math.nan
    diverged = not math.isfinite(final)
    return Run(compressor, value, seed, 0.0 if diverged else final,
               sum(v["tensor_bytes"] for v in per_round.values()), uploads, curve, diverged)


@dataclass
class Result:
    """A compressor's grid: every run, the best value and whether it is interior."""

    compressor: str
    key: str
    runs: dict[float, list[Run]]
    best: float
    interior: bool

    def best_runs(self) -> list[Run]:
        return self.runs[self.best]


def mean_final(runs: list[Run]) -> float:
    return statistics.fmean(r.final for r in runs)


def tune(task: str, compressor: str, seeds: list[int], rounds: int, extend: int, data_dir: Path | None,
         log=print) -> Result:
    """Run the compressor's grid over every seed; widen past a best on the edge up to `extend` times."""
    key = COMPRESSORS[compressor][1]
    grid = list(GRIDS[key])
    runs: dict[float, list[Run]] = {}
    widened = 0
    while True:
        for value in grid:
            if value not in runs:
                t0 = time.time()
                runs[value] = [run_one(task, compressor, value, s, rounds, data_dir) for s in seeds]
                log(f"  {task} {compressor:12s} {key}={value:.4g}: final "
                    + ", ".join("diverged" if r.diverged else f"{r.final:.3f}" for r in runs[value])
                    + f"  ({time.time() - t0:.1f} s)")
        best = max(grid, key=lambda v: mean_final(runs[v]))
        if grid[0] < best < grid[-1] or widened >= extend:
            break
        grid = [best / 3] + grid if best == grid[0] else grid + [best * 3]
        widened += 1
    return Result(compressor, key, runs, best, grid[0] < best < grid[-1])


def fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def table(results: list[Result], targets: list[float], task: str, rounds: int) -> str:
    """The Markdown table of the best setting of every compressor (best: highest mean final accuracy);
    bytes to a target: the mean over the seeds that reached it, at the first round they did."""
    dense = next(r for r in results if r.compressor == "dense").best_runs()
    dense_per_upload = statistics.fmean(r.up_bytes / r.up_messages for r in dense)
    lines = [f"{task}, {rounds} rounds, seeds {[r.seed for r in dense]}",
             "",
             "| compressor | grid (best: interior or edge) | final accuracy, mean (per seed) | upload bytes, total (mean over seeds) "
             "| bytes per upload / dense | " + " | ".join(f"upload bytes to accuracy {t} (seeds reaching it)" for t in targets)
             + " |",
             "|---|---|---|---|---|" + "---|" * len(targets)]
    for res in results:
        runs = res.best_runs()
        grid = ", ".join(f"{v:.3g}" for v in sorted(res.runs))
        per_upload = statistics.fmean(r.up_bytes / r.up_messages for r in runs)
        cells = []
        for target in targets:
            reached = [b for b in (r.bytes_to(target) for r in runs) if b is not None]
            cells.append(f"{fmt_bytes(statistics.fmean(reached))} ({len(reached)}/{len(runs)})" if reached
                         else f"not reached (0/{len(runs)})")
        short = res.key.split(".")[1]
        lines.append(
            f"| {res.compressor} | {short} {{{grid}}}: best {res.best:.3g}, {'interior' if res.interior else 'edge'} "
            f"| {mean_final(runs):.3f} ({', '.join('diverged' if r.diverged else f'{r.final:.3f}' for r in runs)}) "
            f"| {fmt_bytes(statistics.fmean(r.up_bytes for r in runs))} "
            f"| {per_upload / dense_per_upload:.4f} ({per_upload:,.0f} B) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_from_json(rows: list[dict]) -> list[Result]:
    """The Results of one task as `--json` wrote them (re-scoring at other targets without re-running)."""
    out = []
    for row in rows:
        runs: dict[float, list[Run]] = {}
        for r in row["runs"]:
            r = dict(r, curve=[tuple(c) for c in r["curve"]])
            runs.setdefault(float(r["value"]), []).append(Run(**r))
        out.append(Result(row["compressor"], row["key"], runs, float(row["best"]), bool(row["interior"])))
    return out


def compare(task: str, compressors: list[str], seeds: list[int], rounds: int, extend: int,
            data_dir: Path | None = None, log=print) -> list[Result]:
    return [tune(task, c, seeds, rounds, extend, data_dir, log) for c in compressors]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30, help="rounds per run (the example's 30)")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    ap.add_argument("--extend", type=int, default=1, help="widenings past a best on the edge, per compressor")
    ap.add_argument("--target", default="0.85,0.93", help="comma-separated accuracy targets for bytes-to-target")
    ap.add_argument("--compressors", default=",".join(COMPRESSORS), help="comma-separated, from: " + ", ".join(COMPRESSORS))
    ap.add_argument("--leaf", type=Path, default=None,
                    help="also run the LEAF-format task; DIR holds femnist_niid/ (python -m fedhop.common.data.fakedata "
                         "femnist_niid DIR/femnist_niid --writers 30 --samples 60)")
    ap.add_argument("--leaf-rounds", type=int, default=30)
    ap.add_argument("--leaf-target", default="0.6,0.7", help="comma-separated accuracy targets on the LEAF task")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="print the tables of a --json file (at these --target / --leaf-target) without running")
    ap.add_argument("--skip-digits", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="write every run (final, bytes, curve) here")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    names = [c.strip() for c in args.compressors.split(",") if c.strip()]
    unknown = [c for c in names if c not in COMPRESSORS]
    if unknown or "dense" not in names:
        print(f"--compressors: {'unknown ' + ', '.join(unknown) if unknown else 'dense (the reference) is needed'}",
              file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    targets = {"digits": [float(t) for t in args.target.split(",")],
               "leaf-femnist": [float(t) for t in args.leaf_target.split(",")]}
    if args.from_json is not None:
        for task, rows in json.loads(args.from_json.read_text()).items():
            rounds = max(r for run in rows[0]["runs"] for r, _, _ in run["curve"])
            print(table(results_from_json(rows), targets[task], task, rounds))
            print()
        return 0
    tasks = [] if args.skip_digits else [("digits", args.rounds, None)]
    if args.leaf is not None:
        tasks.append(("leaf-femnist", args.leaf_rounds, args.leaf.resolve()))
    dump: dict = {}
    t0 = time.time()
    for task, rounds, data_dir in tasks:
        results = compare(task, names, seeds, rounds, args.extend, data_dir, log=lambda m: print(m, flush=True))
        print()
        print(table(results, targets[task], task, rounds))
        print(flush=True)
        dump[task] = [{"compressor": r.compressor, "key": r.key, "best": r.best, "interior": r.interior,
                       "runs": [vars(x) for v in sorted(r.runs) for x in r.runs[v]]} for r in results]
    print(f"total {time.time() - t0:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
