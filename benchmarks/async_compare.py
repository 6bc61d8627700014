"""FedBuff and FedAsync against synchronous FedAvg on the virtual clock with stragglers, bracketed.

Issue 46's acceptance asks for a fair comparison: every method's main hyper-parameters tuned on a
grid whose best value is interior (a value tried on each side, docs/claims.md "Bracketed grids"),
several seeds, and the measure is SIMULATED seconds and bytes to a target, not wall time: on the
virtual clock (common/engine/vclock.py) the order of arrivals and every round's duration follow
from the seed and the device keys, so the figures do not depend on the load of the machine.

The task is the quadratic one (``data.dataset = "quadratic"``, dim 10, 20 clients) with a target
suboptimality: a digits grid of this size (about 150 runs) does not fit a shared 2-core machine in
the time this comparison had. Stragglers: every client's compute slowdown is drawn once from a
lognormal (median 1, sigma 1), so the deadline trades participants against round time continuously.

Methods (each gets the same budget of client dispatches, ``--budget``; the rounds follow):

- ``fedavg``: star, ``clients.per_round`` = 8, each round waits for its slowest client (reference).
- ``fedavg-deadline``: the same, results finishing after ``clients.deadline_seconds`` are cut.
- ``fedbuff``: ``topology.kind = "asynchronous"``, ``mode = "fedbuff"``, polynomial staleness a = 0.5.
- ``fedasync``: ``mode = "fedasync"``, polynomial staleness a = 0.5.

Tuning is coordinate-wise (a cross, not a full product): around a centre, every axis's two
neighbours are run with the other axes at the centre, over all seeds. The best setting (fewest
seeds missing the target, then the median simulated seconds, then the median bytes) becomes the new
centre; when the centre is best and sits on an axis's edge, that axis is widened geometrically
(x2 or /2, up to a hard limit such as alpha <= 1) and the search goes on, at most ``--widen`` times
per axis. Each run is ``fedhop run CONFIG --out DIR`` in a temporary folder, as a user runs it.

Bytes: the tensor bytes of the ``train`` requests the server sent and the ``train.reply`` replies it
received (the server's ledger records in run.db), in the rounds up to the one that reached the target.
A dispatch is recorded in the round in progress when it was sent, so an asynchronous run's bytes
include the replacements dispatched during the target's round.

    python benchmarks/async_compare.py                 # the full comparison (docs/async.md)
    python benchmarks/async_compare.py --tiny --keep D # 4 runs, one seed, no grid (tests)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

BASE = """\
[run]
name = "{name}"
seed = {seed}
rounds = {rounds}
eval_every = 1

[algorithm]
name = "fedavg"
lr = {lr}
local_steps = 5
batch_size = 0

[data]
dataset = "quadratic"
dim = 10

[clients]
count = {count}
per_round = 8
processes = 1
step_seconds = 0.01
slowdown = {{dist = "lognormal", median = 1.0, sigma = 1.0}}
{clients}

[topology]
{topology}
"""

COUNT = 20


@dataclass
class Axis:
    """One tuned hyper-parameter: its grid (sorted), the centre's start and its hard limits."""

    name: str
    values: list[float]
    start: float
    integer: bool = False
    low: float = 0.0            # exclusive lower limit of a widening
    high: float = math.inf      # inclusive upper limit of a widening

    def widen(self, at_low: bool) -> bool:
        """Add the next value past an edge (x2 or /2); False when the hard limit forbids it."""
        edge = self.values[0] if at_low else self.values[-1]
        new = edge / 2 if at_low else edge * 2
        if self.integer:
            new = int(round(new))
        if not at_low and new > self.high:
            if self.high <= edge:
                return False
            new = self.high
        if new <= self.low or new in self.values:
            return False
        self.values = sorted(self.values + [new])
        return True


@dataclass
class Method:
    name: str
    axes: list[Axis]
    render: Callable[[dict], tuple[str, str, int]]   # params -> ([clients] lines, [topology] lines, rounds)
    widened: dict[str, int] = field(default_factory=dict)


def methods(budget: int) -> list[Method]:
    """The four methods, their grids and how a setting becomes a config (budget: client dispatches)."""
    def lr_axis() -> Axis:
        return Axis("lr", [0.025, 0.05, 0.1], 0.05)

    def fedavg(p: dict) -> tuple[str, str, int]:
        return "", 'kind = "star"', max(1, budget // 8)

    def deadline(p: dict) -> tuple[str, str, int]:
        return f"deadline_seconds = {p['deadline']}", 'kind = "star"', max(1, budget // 8)

    def fedbuff(p: dict) -> tuple[str, str, int]:
        k = int(p["K"])
        topo = (f'kind = "asynchronous"\nmode = "fedbuff"\nconcurrency = {int(p["concurrency"])}\n'
                f'buffer_size = {k}\nserver_lr = {p["server_lr"]}\nstaleness = "polynomial"\nstaleness_a = 0.5')
        return "", topo, max(1, budget // k)

    def fedasync(p: dict) -> tuple[str, str, int]:
        topo = (f'kind = "asynchronous"\nmode = "fedasync"\nconcurrency = {int(p["concurrency"])}\n'
                f'mixing = {p["alpha"]}\nstaleness = "polynomial"\nstaleness_a = 0.5')
        return "", topo, budget

    return [
        Method("fedavg", [lr_axis()], fedavg),
        Method("fedavg-deadline", [lr_axis(), Axis("deadline", [0.05, 0.1, 0.2], 0.1)], deadline),
        Method("fedbuff", [lr_axis(), Axis("server_lr", [0.5, 1.0, 2.0], 1.0),
                           Axis("K", [2, 4, 8], 4, integer=True, high=COUNT),
                           Axis("concurrency", [4, 8, 16], 8, integer=True, high=COUNT)], fedbuff),
        Method("fedasync", [lr_axis(), Axis("alpha", [0.3, 0.6, 0.9], 0.6, high=1.0),
                            Axis("concurrency", [4, 8, 16], 8, integer=True, high=COUNT)], fedasync),
    ]


@dataclass
class Result:
    """One run's outcome: the round, simulated seconds and tensor bytes at the target (None: missed)."""

    run_dir: Path
    round: int | None
    sim: float | None
    bytes: int | None
    best_sub: float


def score(run_dir: Path, target: float) -> Result:
    """Read run.db: the first evaluated round whose suboptimality is <= target, its time and bytes."""
    con = sqlite3.connect(run_dir / "run.db")
    try:
        sim, hit, best = 0.0, None, math.inf
        for rnd, s, m in con.execute("SELECT round, sim_seconds, metrics_json FROM rounds ORDER BY round"):
            sim += s or 0.0
            sub = json.loads(m or "{}").get("suboptimality")
            if sub is None:
                continue
            best = min(best, sub)
            if hit is None and sub <= target:
                hit = (rnd, sim)
        if hit is None:
            return Result(run_dir, None, None, None, best)
        nbytes = con.execute(
            "SELECT COALESCE(SUM(tensor_bytes), 0) FROM messages WHERE round <= ? AND method IN ('train', 'train.reply') "
            "AND ((role = 'sender' AND src = 'server') OR (role = 'receiver' AND dst = 'server'))",
            (hit[0],)).fetchone()[0]
        return Result(run_dir, hit[0], hit[1], int(nbytes), best)
    finally:
        con.close()


class Runner:
    """Runs (and caches by config text) ``fedhop run`` in a work folder, ``jobs`` at a time."""

    def __init__(self, work: Path, fedhop: str, jobs: int):
        self.work, self.fedhop, self.jobs = work, fedhop, jobs
        self.count = 0

    def run_all(self, configs: list[str]) -> list[Path]:
        dirs: list[Path] = []
        todo: list[tuple[str, Path]] = []
        for text in configs:
            h = hashlib.sha256(text.encode()).hexdigest()[:16]
            d = self.work / h
            dirs.append(d)
            if not (d / "summary.json").exists() and d not in [t[1] for t in todo]:
                todo.append((text, d))

        def one(item: tuple[str, Path]) -> None:
            text, d = item
            cfg = self.work / f"{d.name}.toml"
            cfg.write_text(text)
            proc = subprocess.run([self.fedhop, "run", str(cfg), "--out", str(d), "--force", "--quiet"],
                                  cwd=self.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"async_compare: fedhop run {cfg} failed ({proc.returncode}): {proc.stderr[-2000:]}")

        with ThreadPoolExecutor(self.jobs) as pool:
            list(pool.map(one, todo))
        self.count += len(todo)
        return dirs


def config_text(m: Method, params: dict, seed: int) -> str:
    clients, topology, rounds = m.render(params)
    return BASE.format(name=m.name, seed=seed, rounds=rounds, lr=params["lr"], count=COUNT,
                       clients=clients, topology=topology)


def summarize(results: list[Result]) -> tuple[int, float, float]:
    """(seeds missing the target, median simulated seconds, median bytes); a miss counts as infinity."""
    missed = sum(r.sim is None for r in results)
    sims = [r.sim if r.sim is not None else math.inf for r in results]
    byts = [r.bytes if r.bytes is not None else math.inf for r in results]
    return missed, statistics.median(sims), statistics.median(byts)


def tune(m: Method, runner: Runner, seeds: list[int], target: float, max_widen: int,
         log: Callable[[str], None]) -> tuple[dict, dict[tuple, list[Result]]]:
    """Coordinate search around a centre until the centre is best and interior (or widening stops)."""
    centre = {a.name: a.start for a in m.axes}
    seen: dict[tuple, list[Result]] = {}
    key = lambda p: tuple(p[a.name] for a in m.axes)  # noqa: E731
    for _ in range(20):
        cands = [dict(centre)]
        for a in m.axes:
            i = a.values.index(centre[a.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(a.values):
                    cands.append({**centre, a.name: a.values[j]})
        fresh = [p for p in cands if key(p) not in seen]
        texts = [config_text(m, p, s) for p in fresh for s in seeds]
        dirs = runner.run_all(texts)
        for n, p in enumerate(fresh):
            seen[key(p)] = [score(d, target) for d in dirs[n * len(seeds):(n + 1) * len(seeds)]]
        best = min(cands, key=lambda p: summarize(seen[key(p)]))
        log(f"  {m.name}: centre {centre} -> best {best} {summarize(seen[key(best)])} ({runner.count} runs so far)")
        if key(best) != key(centre):
            centre = best
            continue
        grew = False
        for a in m.axes:
            i = a.values.index(centre[a.name])
            if i in (0, len(a.values) - 1) and len(a.values) > 1 and m.widened.get(a.name, 0) < max_widen:
                if a.widen(at_low=(i == 0)):
                    m.widened[a.name] = m.widened.get(a.name, 0) + 1
                    grew = True
        if not grew:
            break
    return centre, seen


def fmt_s(x: float) -> str:
    return "-" if x is None or math.isinf(x) else f"{x:.3f}"


def fmt_b(x: float) -> str:
    return "-" if x is None or math.isinf(x) else f"{int(x)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.05, help="target suboptimality (default 0.05)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budget", type=int, default=600, help="client dispatches per run (default 600)")
    ap.add_argument("--widen", type=int, default=2, help="widenings per axis past an edge (default 2)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    ap.add_argument("--tiny", action="store_true", help="one seed, budget 40, each method's centre only (tests)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run folders here (default: a temp folder, removed)")
    ap.add_argument("--fedhop", default=None, help="the fedhop command (default: the one beside this python)")
    args = ap.parse_args(argv)
    if args.target <= 0 or args.budget < 8 or args.jobs < 1 or args.widen < 0:
        print("async_compare: --target must be > 0, --budget >= 8, --jobs >= 1, --widen >= 0", file=sys.stderr)
        return 2
    fedhop = args.fedhop or str(Path(sys.executable).with_name("fedhop"))
    if not os.path.exists(fedhop):
        fedhop = shutil.which("fedhop") or "fedhop"
    seeds = args.seeds[:1] if args.tiny else args.seeds
    budget = min(args.budget, 40) if args.tiny else args.budget
    ms = methods(budget)
    if args.tiny:
        for m in ms:
            for a in m.axes:
                a.values = [a.start]
    work = args.keep or Path(tempfile.mkdtemp(prefix="async-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    runner = Runner(work.resolve(), fedhop, args.jobs)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        print(f"# task: quadratic dim 10, {COUNT} clients, slowdown lognormal(median 1, sigma 1), "
              f"step_seconds 0.01, 5 local steps; target suboptimality {args.target}; seeds {seeds}; "
              f"budget {budget} client dispatches per run")
        rows = []
        for m in ms:
            best, seen = tune(m, runner, seeds, args.target, 0 if args.tiny else args.widen, log)
            res = seen[tuple(best[a.name] for a in m.axes)]
            grid = "; ".join(f"{a.name} {a.values}" for a in m.axes)
            print(f"# grid {m.name}: {grid}")
            for a in m.axes:
                i = a.values.index(best[a.name])
                where = "interior" if 0 < i < len(a.values) - 1 else ("single" if len(a.values) == 1 else "EDGE")
                nb = []
                for j in (i - 1, i + 1):
                    if 0 <= j < len(a.values):
                        p = {**best, a.name: a.values[j]}
                        k = tuple(p[x.name] for x in m.axes)
                        if k in seen:
                            miss, s, b = summarize(seen[k])
                            nb.append(f"{a.values[j]}: {fmt_s(s)} s, {len(seeds) - miss}/{len(seeds)} reached")
                print(f"# best {m.name} {a.name} = {best[a.name]} ({where}); neighbours: {', '.join(nb) or 'none'}")
            for seed, r in zip(seeds, res):
                print(f"# run {m.name} seed {seed} dir {r.run_dir.name} round {r.round} sim {r.sim} bytes {r.bytes}")
            rows.append((m, best, res))
        print("| method | setting | reached | sim s median | sim s range | bytes median | bytes range | "
              "best subopt. median | runs |")
        print("|---|---|---|---|---|---|---|---|---|")
        for m, best, res in rows:
            _, s_med, b_med = summarize(res)
            sims = [r.sim for r in res if r.sim is not None]
            byts = [r.bytes for r in res if r.bytes is not None]
            setting = ", ".join(f"{k} {v}" for k, v in best.items())
            s_rng = f"{min(sims):.3f}-{max(sims):.3f}" if sims else "-"
            b_rng = f"{min(byts)}-{max(byts)}" if byts else "-"
            subs = statistics.median(r.best_sub for r in res)
            dirs = " ".join(r.run_dir.name for r in res)
            print(f"| {m.name} | {setting} | {len(sims)}/{len(res)} | {fmt_s(s_med)} | {s_rng} | {fmt_b(b_med)} | "
                  f"{b_rng} | {subs:.4f} | {dirs} |")
        print(f"# {runner.count} runs")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
