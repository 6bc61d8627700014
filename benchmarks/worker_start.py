"""The in-process engine's workers: forked sharing the run's data, against fresh interpreters and
against a process run (issue 49, item 2; docs/performance.md, "The in-process engine's workers
forked, sharing the run's data, closed together").

A user's `npz` data set of `--clients` clients and about `--mb` MB of float32 features (made by
this script in a temporary folder, seeded) is trained for 4 rounds (logreg, 10 clients a round,
2 client processes) three ways, each the real `fedhop run` from that folder:

- forked: `--engine inprocess --set run.workers=0`: `fedhop run` builds the data once and forks
  its workers, which use it (deploy/launch/workers.py `SharedTask`);
- fresh: the same with FEDHOP_START=exec: each worker a fresh interpreter that builds its own;
- processes: `--engine processes`.

For each run: the wall seconds of the command, and the peak over the run (sampled every 50 ms)
of the sum of every process's PSS (/proc/PID/smaps_rollup: shared pages counted once, split
between the processes that map them) and of their RSS (shared pages counted in each).  The
three take turns, repeat k starting with system k mod 3.  Printed: the medians, forked / fresh
for both, and whether every run wrote the same model.safetensors (exit 1 if not).

    python benchmarks/worker_start.py [--mb 630] [--clients 100] [--repeats 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

SYSTEMS = {"forked": (["--engine", "inprocess", "--set", "run.workers=0"], {}),
           "fresh": (["--engine", "inprocess", "--set", "run.workers=0"], {"FEDHOP_START": "exec"}),
           "processes": (["--engine", "processes"], {})}
FEATURES = 784
CONFIG = """[run]
name = "worker-start"
seed = 0
rounds = 4
eval_every = 2
[algorithm]
name = "fedavg"
lr = 0.05
batch_size = 50
local_steps = 2
[data]
dataset = "npz"
path = "data.npz"
[model]
kind = "logreg"
[clients]
count = {clients}
per_round = {per_round}
processes = 2
"""


def make_data(folder: Path, mb: float, clients: int) -> None:
    """data.npz (x_i, y_i per client, x_test, y_test) and exp.toml in `folder`."""
    rows = max(1, int(mb * 1e6 / (4 * FEATURES * clients)))
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for i in range(clients):
        arrays[f"x_{i}"] = rng.standard_normal((rows, FEATURES), dtype=np.float32)
        arrays[f"y_{i}"] = rng.integers(0, 10, rows)
    arrays["x_test"] = rng.standard_normal((500, FEATURES), dtype=np.float32)
    arrays["y_test"] = rng.integers(0, 10, 500)
    np.savez(folder / "data.npz", **arrays)
    (folder / "exp.toml").write_text(CONFIG.format(clients=clients, per_round=min(10, clients)))


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_once(folder: Path, system: str, out: str) -> dict:
    """One `fedhop run` of `system`: wall seconds, peak PSS and RSS sums (bytes)."""
    flags, extra = SYSTEMS[system]
    argv = [sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", out, "--quiet", *flags]
    started = time.perf_counter()
    errors = open(folder / f"{out}.stderr", "wb")   # a file, not a pipe nobody reads while it runs
    proc = subprocess.Popen(argv, cwd=folder, env={**os.environ, **extra}, stdout=subprocess.DEVNULL,
                            stderr=errors)
    root = psutil.Process(proc.pid)
    peak_pss = peak_rss = 0
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        rss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        peak_pss, peak_rss = max(peak_pss, sum(_pss(p.pid) for p in procs)), max(peak_rss, rss)
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    code = proc.wait()
    errors.close()
    if code != 0:
        err = (folder / f"{out}.stderr").read_text(errors="replace")
        raise RuntimeError(f"{system}: fedhop run exited {code}: {err[-500:]}")
    return {"seconds": seconds, "pss": peak_pss, "rss": peak_rss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=630.0, help="MB of float32 training features")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    if args.mb <= 0 or args.clients < 2 or args.repeats < 1:
        ap.error("--mb must be > 0, --clients >= 2 and --repeats >= 1")
    names = list(SYSTEMS)
    rows: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="fedhop-worker-start-") as tmp:
        folder = Path(tmp)
        make_data(folder, args.mb, args.clients)
        models = set()
        for k in range(args.repeats):
            for j in range(len(names)):
                name = names[(k + j) % len(names)]
                out = f"{name}-{k}"
                rows[name].append(run_once(folder, name, out))
                models.add((folder / out / "model.safetensors").read_bytes())
                print(f"  repeat {k + 1}/{args.repeats} {name}: {rows[name][-1]['seconds']:.2f} s, "
                      f"peak PSS {rows[name][-1]['pss'] / 2**20:,.0f} MiB", flush=True)
    med = {name: {key: statistics.median(r[key] for r in rows[name]) for key in ("seconds", "pss", "rss")}
           for name in names}
    print(f"\n{args.clients} clients, {args.mb:g} MB of features, logreg, 4 rounds, 2 client processes; "
          f"median of {args.repeats}")
    print(f"  {'system':<10} {'wall s':>8} {'peak PSS MiB':>13} {'peak RSS sum MiB':>17}")
    for name in names:
        m = med[name]
        print(f"  {name:<10} {m['seconds']:>8.2f} {m['pss'] / 2**20:>13,.0f} {m['rss'] / 2**20:>17,.0f}")
    ratios = {"wall_forked_over_fresh": med["forked"]["seconds"] / med["fresh"]["seconds"],
              "pss_forked_over_fresh": med["forked"]["pss"] / med["fresh"]["pss"]}
    print(f"  forked / fresh: wall {ratios['wall_forked_over_fresh']:.2f}, peak PSS {ratios['pss_forked_over_fresh']:.2f}")
    same = len(models) == 1
    print(f"  the same model.safetensors in every run: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "median": med, "ratios": ratios, "same_model": same},
                                              indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
