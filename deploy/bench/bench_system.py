"""System benchmarks: compute overhead, scale to many logical clients, cost growth.

    fedhop bench compute   # a FedAvg run on the digits CNN vs a single-process loop of the same SGD steps
    fedhop bench scale     # 100,000 cross-device clients in 4 processes: registration, round time, memory
                           # (--also inprocess,loop: the same config in the in-process engine and the
                           # round engine's loop; --flwr-python PY: Flower's simulation engine beside each run)
    fedhop bench growth    # bytes and time per round against model size and client count, with fitted slopes

Each prints its figures; `--tiny` runs a seconds-long version (the tests use it).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import numpy as np
import psutil
import torch
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.records.runstore import RunStore, round_seconds
from fedhop.common.tasks import dataset_params
from fedhop.deploy.bench.bench_peers import run_fedhop, run_loop
from fedhop.deploy.bench.engine_loop import model_sha256
from fedhop.deploy.launch.launcher import LocalRun, run_local


def _run(config_text: str, out: Path) -> tuple[dict, list[dict]]:
    cfg_file = out.with_suffix(".toml")
    cfg_file.write_text(config_text)
    code = run_local(str(cfg_file), [], str(out), quiet=True, show_table=False)
    if code != 0:
        raise RuntimeError(f"benchmark run failed (exit {code}); see {out}/logs")
    summary = json.loads((out / "summary.json").read_text())
    return summary, RunStore(out / "run.db", create=False).rounds()


# ----------------------------------------------------------------------------- compute overhead
COMPUTE_CONFIG = """
[run]
name = "bench-compute"
rounds = {rounds}
eval_every = 0
torch_threads = 1
[algorithm]
name = "fedavg"
lr = 0.05
local_epochs = {epochs}
batch_size = 16
[data]
dataset = "digits"
partition = "iid"
[model]
kind = "cnn"
[clients]
count = 10
per_round = 10
processes = 2
"""


def single_process_loop(config_text: str) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """The same SGD steps on the same data in one process, no framework: the round engine
    (common/engine/rounds.py) playing server and clients.  Returns (seconds, seconds per round, final model)."""
    cfg = parse_config(config_text)
    torch.set_num_threads(2)  # one process may use both cores
    engine = RoundEngine(cfg)
    started = time.perf_counter()
    per_round = []
    for r in range(1, cfg.run.rounds + 1):
        round_started = time.perf_counter()
        engine.train_round(r)
        per_round.append(time.perf_counter() - round_started)
    return time.perf_counter() - started, per_round, engine.state.params


def fresh_process_seconds(config_text: str, tmp: Path) -> tuple[float, float]:
    """Both sides as a user runs them, each timed from process start to exit: a fresh Python
    process running `single_process_loop` (its imports, data loading and model included) and
    `fedhop run` (every process's start-up, registration and shutdown included)."""
    cfg = tmp / "fresh.toml"
    cfg.write_text(config_text)
    root = str(Path(__file__).resolve().parents[2])
    loop_code = ("from fedhop.deploy.bench.bench_system import single_process_loop; "
                 f"single_process_loop(open({str(cfg)!r}).read())")
    out = []
    for argv in ([sys.executable, "-c", loop_code],
                 [sys.executable, "-m", "fedhop.deploy.cli.cli", "run", str(cfg), "--out", str(tmp / "fresh-run"), "--quiet"]):
        started = time.perf_counter()
        subprocess.run(argv, check=True, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(time.perf_counter() - started)
    return out[0], out[1]


def bench_compute(args: argparse.Namespace) -> dict:
    """Target 3 of issue 11: fedhop's FedAvg rounds against one process doing the same SGD steps
    (10 clients of the digits CNN, 135 samples each, `epochs` local epochs of batch 16: about
    17 steps per epoch).  Round 1 of both pays one-off costs (lazy imports, first torch calls,
    connections), so the steady ratio compares rounds 2.. and the whole-run ratio is printed too."""
    rounds = 3 if args.tiny else args.rounds
    epochs = 1 if args.tiny else 2
    text = COMPUTE_CONFIG.format(rounds=rounds, epochs=epochs)
    loop, loop_rounds, loop_model = single_process_loop(text)
    with tempfile.TemporaryDirectory() as tmp:
        summary, rows = _run(text, Path(tmp) / "run")
        model = load_file(str(Path(tmp) / "run" / "model.safetensors"))
        fresh_loop, fresh_fedhop = fresh_process_seconds(text, Path(tmp))
    framework_rounds = sum(r["wall_seconds"] for r in rows)
    steady_fedhop = sum(r["wall_seconds"] for r in rows[1:])
    steady_loop = sum(loop_rounds[1:])
    out = {"rounds": rounds, "local_epochs": epochs, "loop_seconds": loop, "fedhop_round_seconds": framework_rounds,
           "fedhop_wall_seconds": summary["wall_seconds"], "ratio_rounds": framework_rounds / loop,
           "steady_loop_seconds": steady_loop, "steady_fedhop_seconds": steady_fedhop,
           "ratio_steady": steady_fedhop / steady_loop,
           "ratio_wall": summary["wall_seconds"] / loop, "num_parameters": summary["num_parameters"],
           "fresh_loop_seconds": fresh_loop, "fresh_fedhop_seconds": fresh_fedhop,
           "ratio_fresh": fresh_fedhop / fresh_loop,
           # the same steps: equal up to float rounding (the loop's 2 threads sum in another order)
           "model_max_abs_diff": max(float((model[k] - v).abs().max()) for k, v in loop_model.items())}
    print(f"digits CNN ({out['num_parameters']} parameters), 10 clients/round, {epochs} local epochs, {rounds} rounds:")
    print(f"  single-process loop (2 threads)           {loop:8.2f} s   rounds 2..: {steady_loop:.2f} s")
    print(f"  fedhop rounds (2 client processes)        {framework_rounds:8.2f} s   rounds 2..: {steady_fedhop:.2f} s")
    print(f"  ratio, rounds 2.. (steady state)          {out['ratio_steady']:8.2f}")
    print(f"  ratio, all rounds                         {out['ratio_rounds']:8.2f}")
    print(f"  ratio, whole run incl. process start-up   {out['ratio_wall']:8.2f}   (against the loop's rounds)")
    print(f"  both as fresh processes, start to exit    {fresh_loop:8.2f} s loop, {fresh_fedhop:.2f} s fedhop: "
          f"ratio {out['ratio_fresh']:.2f}")
    print(f"  final models of the loop and fedhop differ by at most {out['model_max_abs_diff']:.2g}")
    return out


# ----------------------------------------------------------------------------- scale
SCALE_CONFIG = """
[run]
name = "bench-scale"
rounds = {rounds}
eval_every = 0
round_timeout = 600.0
call_timeout = 300.0
torch_threads = 1
[algorithm]
name = "fedavg"
lr = 0.05
local_steps = 1
batch_size = 16
vectorized = {vectorized}
[data]
dataset = "crossdevice"
base = "synthetic"
[model]
kind = "logreg"
[clients]
count = {count}
per_round = {per_round}
processes = {processes}
[transport]
batch = {batch}
"""


def _memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, USS) in MB. RSS counts pages shared with other processes: a forked child shares
    the launcher's torch (deploy/launch/forkstart.py). USS counts only the process's own pages, what
    its exit would free."""
    try:
        info = psutil.Process(pid).memory_full_info()
        return info.rss / 1e6, info.uss / 1e6
    except psutil.Error:
        return float("nan"), float("nan")


def _registration_seconds(store: RunStore) -> float:
    """From the server's start of the run to its `registration_complete` event."""
    run = store.run() or {}
    done = [e["time"] for e in store.events("registration_complete")]
    return float(done[0] - run["started"]) if done and run.get("started") else float("nan")


def _scale_text(count: int, processes: int, per_round: int, rounds: int, batch: bool, vectorized: bool = False) -> str:
    return SCALE_CONFIG.format(rounds=rounds, count=count, per_round=per_round, processes=processes,
                               batch=str(batch).lower(), vectorized=str(vectorized).lower())


def scale_run(count: int, processes: int, per_round: int, rounds: int, batch: bool = True,
              vectorized: bool = False) -> dict:
    """One cross-device run (common/tasks/crossdevice.py, a 610-parameter softmax model; with
    `batch`, transport.batch): the registration time, the round times and every process's peak
    RSS and USS."""
    text = _scale_text(count, processes, per_round, rounds, batch, vectorized)
    with tempfile.TemporaryDirectory() as tmp:
        run = LocalRun(parse_config(text), Path(tmp))
        server = run.start([])
        peak: dict[str, float] = {}
        peak_uss: dict[str, float] = {}
        while server.proc.poll() is None:
            for child in run.children:
                rss, uss = _memory_mb(child.proc.pid)
                peak[child.name] = max(peak.get(child.name, 0.0), rss)
                peak_uss[child.name] = max(peak_uss.get(child.name, 0.0), uss)
            time.sleep(0.2)
        run.stop_all()
        if server.proc.returncode != 0:
            raise RuntimeError(f"scale run failed; see {tmp}/logs")
        store = RunStore(Path(tmp) / "run.db", create=False)
        walls = round_seconds(store.rounds())   # from one round's row to the next's
        registration = _registration_seconds(store)
        store.close()
        sha = model_sha256(Path(tmp) / "model.safetensors")
    client_rss = [v for k, v in peak.items() if k.startswith("client")]
    client_uss = [v for k, v in peak_uss.items() if k.startswith("client")]
    return {"clients": count, "processes": processes, "per_round": per_round, "rounds": rounds, "batch": batch,
            "registration_seconds": registration, **_steady_figures(walls),
            "server_rss_mb": peak.get("server"), "server_uss_mb": peak_uss.get("server"),
            "client_process_rss_mb": statistics.mean(client_rss), "client_process_uss_mb": statistics.mean(client_uss),
            "client_process_rss_mb_max": max(client_rss),
            "total_rss_mb": sum(peak.values()), "total_uss_mb": sum(peak_uss.values()),
            "rss_per_logical_client_kb": 1000 * sum(client_rss) / count,
            "uss_per_logical_client_kb": 1000 * sum(client_uss) / count, "model_sha256": sha}


def _steady_figures(per_round: list[float]) -> dict[str, float]:
    """Median, min and max over the rounds after the first, which also warms the processes' caches."""
    steady = per_round[1:] or per_round
    return {"round_seconds_median": statistics.median(steady), "round_seconds_min": min(steady),
            "round_seconds_max": max(steady)}


def scale_other(system: str, count: int, processes: int, per_round: int, rounds: int, batch: bool,
                timeout: float, vectorized: bool = False) -> dict:
    """The scale run's config in the in-process engine (`fedhop run --engine inprocess` with
    run.workers = 0, as `fedhop bench peers` runs it) or in the round engine's loop (one process,
    no message: deploy/bench/engine_loop.py), each a fresh process watched with its children:
    round times, CPU s a round (None where too few readings), the process tree's peak RSS, the
    final model's hash."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "scale.toml"
        config.write_text(_scale_text(count, processes, per_round, rounds, batch, vectorized))
        if system == "inprocess":
            row = run_fedhop(config, "inprocess", Path(tmp) / "run", timeout)
        else:
            row = run_loop(config, Path(tmp) / "loop.log", timeout)
    return {"system": system, "clients": count, "per_round": per_round, "rounds": rounds,
            **_steady_figures(row["per_round_s"]), "cpu_s_per_round": row["cpu_s_per_round"],
            "peak_rss_mb": row["peak_rss_mb"], "model_sha256": row["model_sha256"]}


def _flower_compare() -> ModuleType:
    """benchmarks/flower_compare.py, which is not in the installed package: loaded from the
    checkout, as `fedhop bench flower` loads it."""
    name = "fedhop_bench_flower_compare"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "flower_compare.py"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise FileNotFoundError(f"no {path}: the Flower side needs fedhop's checkout")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _bad_flag(message: str) -> NoReturn:
    print(f"fedhop bench scale: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def flower_scale_row(flwr_python: str, count: int, per_round: int, rounds: int, timeout: float,
                     max_rss_mb: float) -> dict:
    """Flower's simulation engine on the scale run's task (benchmarks/flower_compare.py,
    run_flower_scale): the learning rate, local steps, batch size, seed and data parameters are
    read from the same config fedhop runs."""
    cfg = parse_config(_scale_text(count, 1, per_round, rounds, True))
    steps = cfg.algorithm.local_steps
    assert isinstance(steps, int)   # the scale config gives one count for every client
    return _flower_compare().run_flower_scale(
        flwr_python, count, per_round, rounds, lr=cfg.algorithm.lr, batch_size=cfg.algorithm.batch_size,
        local_steps=steps, seed=cfg.run.seed,
        data_params=dataclasses.asdict(dataset_params(cfg)), timeout=timeout, max_rss_mb=max_rss_mb,
        log=lambda line: None)


def _flower_line(row: dict, fedhop: dict) -> str:
    """Flower's figures beside fedhop's row (or how far it got and why it stopped)."""
    head = f"  Flower {row.get('versions', '').split(' ')[0]} simulation, {row['clients']} SuperNodes, " \
           f"{row['per_round']} sampled: "
    start = row.get("start_to_first_round_s")
    memory = (f"Flower's {row['processes_seen']} processes {row['total_rss_mb']:.0f} MB RSS / "
              f"{row['total_uss_mb']:.0f} MB USS")
    rounds = ""
    if "median_s" in row:   # a stopped run's completed rounds too (all of them when it has only round 1)
        replies = row["train_replies"]
        rounds = (f"round median {row['median_s']:.3f} s (min {row['min_s']:.3f}, max {row['max_s']:.3f}); "
                  f"{min(replies)}-{max(replies)} clients trained a round; ")
    if "ratio_to_fedhop" in row:
        memory += f"; Flower / fedhop round time {row['ratio_to_fedhop']:.1f}x"
    if not row["ok"]:
        head += (f"did not finish: {row['reason']}; {row['rounds_completed']} of {row['rounds']} rounds done"
                 + (f" (round 1 included: {row['per_round_s'][0]:.1f} s)" if row["rounds_completed"] == 1 else "")
                 + "; ")
    return head + (f"start to round 1 {start:.1f} s; " if start else "") + rounds + memory


#: the systems `--also` runs beside the processes engine on the scale config (`scale_other`)
SCALE_ALSO = ("inprocess", "loop")


def _other_line(other: dict, processes_row: dict) -> str:
    """An in-process or loop run's figures beside the processes engine's round."""
    name = ("  in-process engine (run.workers = 0)" if other["system"] == "inprocess" else
            "  the round engine's loop (one process, no message sent or recorded)")
    cpu = other["cpu_s_per_round"]
    return (f"{name}: round median {other['round_seconds_median']:.3f} s (min {other['round_seconds_min']:.3f}, "
            f"max {other['round_seconds_max']:.3f}); "
            + (f"{cpu:.3f} CPU s a round; " if cpu is not None else "")
            + f"{other['peak_rss_mb']:.0f} MB RSS at its peak (its process tree); processes engine / this "
            f"{processes_row['round_seconds_median'] / other['round_seconds_median']:.2f}")


def bench_scale(args: argparse.Namespace) -> dict:
    """Cross-device scale: `--clients` logical clients in `--processes` client processes,
    one run per `--sampled` count; with `--flwr-python`, a Flower simulation beside each run."""
    count = 2000 if args.tiny else args.clients
    processes = 2 if args.tiny else args.processes
    try:
        samples = [10, 50] if args.tiny else [int(s) for s in str(args.sampled).split(",")]
    except ValueError:
        _bad_flag(f"--sampled {args.sampled!r}: give client counts, comma-separated (e.g. 100,1000)")
    rounds = 3 if args.tiny else args.rounds
    if count < 1 or processes < 1 or rounds < 2:
        _bad_flag("--clients and --processes must be >= 1 and --rounds >= 2 (round 1 is left out of the medians)")
    if any(not 1 <= s <= count for s in samples):
        _bad_flag(f"--sampled {args.sampled}: each must be between 1 and --clients ({count})")
    if args.flwr_timeout <= 0 or args.flwr_max_gb <= 0:
        _bad_flag("--flwr-timeout and --flwr-max-gb must be > 0")
    flwr_python = None
    if args.flwr_python:
        flwr_python = _flower_compare().find_flwr_python(args.flwr_python)
        if flwr_python is None:
            _bad_flag(f"--flwr-python {args.flwr_python}: not a python that imports flwr")
    else:
        print("Flower side skipped: no --flwr-python (the python of a venv with flwr[simulation])")
    systems = [s for s in str(args.also).split(",") if s]
    unknown = sorted(set(systems) - set(SCALE_ALSO))
    if unknown:
        _bad_flag(f"--also {args.also}: unknown {', '.join(unknown)}; choose from {', '.join(SCALE_ALSO)}")
    if args.scale_timeout <= 0:
        _bad_flag("--scale-timeout must be > 0")
    results, flower = [], []
    batch = not args.no_batch
    for per_round in samples:
        vectorized = getattr(args, "vectorized", False)
        row = scale_run(count, processes, per_round, rounds, batch, vectorized)
        results.append(row)
        print(f"{count} clients in {processes} processes, {per_round} sampled{' (batched calls)' if batch else ''}"
              f"{' (vectorized)' if vectorized else ''}: "
              f"registration "
              f"{row['registration_seconds']:.2f} s; round median {row['round_seconds_median']:.3f} s "
              f"(min {row['round_seconds_min']:.3f}, max {row['round_seconds_max']:.3f}, {rounds - 1} rounds after "
              f"the first); server {row['server_rss_mb']:.0f} MB RSS / {row['server_uss_mb']:.0f} MB USS; client "
              f"process {row['client_process_rss_mb']:.0f} MB RSS / {row['client_process_uss_mb']:.0f} MB USS; all "
              f"processes {row['total_rss_mb']:.0f} MB RSS / {row['total_uss_mb']:.0f} MB USS; per logical client "
              f"{row['rss_per_logical_client_kb']:.2f} kB RSS / {row['uss_per_logical_client_kb']:.2f} kB USS "
              f"(client processes' memory / clients)", flush=True)
        others = [scale_other(system, count, processes, per_round, rounds, batch, args.scale_timeout,
                              vectorized) for system in systems]
        row["others"] = others
        for other in others:
            print(_other_line(other, row), flush=True)
        if others:
            same = len({row["model_sha256"], *(o["model_sha256"] for o in others)}) == 1
            row["same_model"] = same
            print("  final model: the same bits in every fedhop system" if same else
                  "  final model: DIFFERS between fedhop systems (a defect: the engines and the loop compute the "
                  "same rounds)", flush=True)
        if flwr_python:
            fl = flower_scale_row(flwr_python, count, per_round, rounds, args.flwr_timeout, args.flwr_max_gb * 1e3)
            if "median_s" in fl:
                fl["ratio_to_fedhop"] = fl["median_s"] / row["round_seconds_median"]
            flower.append(fl)
            print(_flower_line(fl, row), flush=True)
    return {"rows": results, "flower": flower}


# ----------------------------------------------------------------------------- growth
GROWTH_CONFIG = """
[run]
name = "bench-growth"
rounds = {rounds}
eval_every = 0
[algorithm]
name = "fedavg"
lr = 0.1
local_steps = 1
batch_size = 0
[data]
dataset = "quadratic"
dim = {dim}
[model]
init = "zeros"
[clients]
count = {clients}
per_round = {clients}
processes = 2
"""


def _fit(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """Least-squares line y = a x + b and its R^2."""
    a, b = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    pred = a * np.asarray(x) + b
    ss_res = float(np.sum((np.asarray(y) - pred) ** 2))
    ss_tot = float(np.sum((np.asarray(y) - np.mean(y)) ** 2)) or 1.0
    return float(a), float(b), 1.0 - ss_res / ss_tot


def bench_growth(args: argparse.Namespace) -> dict:
    dims = [1_000, 100_000, 1_000_000] if args.tiny else [10_000, 250_000, 1_000_000, 2_500_000, 5_000_000]
    client_counts = [2, 4] if args.tiny else [2, 5, 10, 20]
    rounds = 2 if args.tiny else 4
    out: dict[str, Any] = {"by_dim": [], "by_clients": []}
    with tempfile.TemporaryDirectory() as tmp:
        for d in dims:
            summary, rows = _run(GROWTH_CONFIG.format(rounds=rounds, dim=d, clients=5), Path(tmp) / f"d{d}")
            per_round = summary["bytes"]["by_link"]["client-server"]["tensor_bytes"] / rounds
            t = statistics.median(r["wall_seconds"] for r in rows[1:] or rows)
            out["by_dim"].append({"dim": d, "tensor_bytes_per_round": per_round, "round_seconds": t})
        for n in client_counts:
            summary, rows = _run(GROWTH_CONFIG.format(rounds=rounds, dim=100_000, clients=n), Path(tmp) / f"n{n}")
            per_round = summary["bytes"]["by_link"]["client-server"]["tensor_bytes"] / rounds
            t = statistics.median(r["wall_seconds"] for r in rows[1:] or rows)
            out["by_clients"].append({"clients": n, "tensor_bytes_per_round": per_round, "round_seconds": t})
    a, b, r2 = _fit([r["dim"] for r in out["by_dim"]], [r["tensor_bytes_per_round"] for r in out["by_dim"]])
    ta, tb, tr2 = _fit([r["dim"] for r in out["by_dim"]], [r["round_seconds"] for r in out["by_dim"]])
    ca, cb, cr2 = _fit([r["clients"] for r in out["by_clients"]], [r["tensor_bytes_per_round"] for r in out["by_clients"]])
    cta, ctb, ctr2 = _fit([r["clients"] for r in out["by_clients"]], [r["round_seconds"] for r in out["by_clients"]])
    out["fits"] = {"bytes_per_param": a, "bytes_per_param_r2": r2, "seconds_per_mparam": ta * 1e6,
                   "seconds_per_param_r2": tr2, "bytes_per_client": ca, "bytes_per_client_r2": cr2,
                   "seconds_per_client": cta, "seconds_per_client_r2": ctr2}
    print("per round, 5 clients, FedAvg, against model size d:")
    for r in out["by_dim"]:
        print(f"  d={r['dim']:>9}: {r['tensor_bytes_per_round']:>14.0f} tensor bytes, {r['round_seconds']:.3f} s")
    print(f"  fit: {a:.3f} bytes per parameter (expected 2*5*4 = 40; R^2 {r2:.4f}); "
          f"{ta * 1e6:.4f} s per million parameters (R^2 {tr2:.3f})")
    print("per round, d=100,000, against sampled clients S:")
    for r in out["by_clients"]:
        print(f"  S={r['clients']:>3}: {r['tensor_bytes_per_round']:>12.0f} tensor bytes, {r['round_seconds']:.3f} s")
    print(f"  fit: {ca:.0f} bytes per client (expected 2*4*d = 800000; R^2 {cr2:.4f}); "
          f"{cta * 1000:.2f} ms per client (R^2 {ctr2:.3f})")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--clients", type=int, default=100_000, help="scale: logical clients")
    ap.add_argument("--processes", type=int, default=4, help="scale: client processes")
    ap.add_argument("--sampled", default="100,1000", help="scale: clients sampled per round, one run each "
                                                         "(comma-separated)")
    ap.add_argument("--no-batch", action="store_true",
                    help="scale: one gRPC call per sampled client (default: transport.batch, one per process)")
    ap.add_argument("--vectorized", action="store_true",
                    help="scale: [algorithm] vectorized = true, the clients of one call trained together "
                         "(docs/vectorized.md)")
    ap.add_argument("--also", default="",
                    help="scale: also run the same config in these, comma-separated: inprocess (fedhop run --engine "
                         "inprocess, run.workers = 0), loop (the round engine's loop in one process, no message: "
                         "the floor for fedhop's training code); each checked to end on the same model")
    ap.add_argument("--scale-timeout", type=float, default=3600.0,
                    help="scale: seconds an --also run may take before it is stopped")
    ap.add_argument("--flwr-python", default=None,
                    help="scale: the python of a venv with flwr[simulation]; runs Flower's simulation engine beside "
                         "each run (default: no Flower side)")
    ap.add_argument("--flwr-timeout", type=float, default=900.0,
                    help="scale: seconds one Flower run may take before it is stopped")
    ap.add_argument("--flwr-max-gb", type=float, default=10.0,
                    help="scale: GB of RSS over Flower's processes at which its run is stopped")
    ap.add_argument("--kind-clients", default="4,8",
                    help="transport --kind torch: client counts (one process each), comma-separated")


# ----------------------------------------------------------------------------- gRPC vs torch.distributed
KIND_CONFIG = """
[run]
name = "bench-kind"
rounds = {rounds}
eval_every = 0
round_timeout = 600.0
call_timeout = 600.0
[algorithm]
name = "fedavg"
lr = 0.01
local_steps = 1
batch_size = 16
[data]
dataset = "digits"
[model]
kind = "mlp"
hidden = [{hidden}]
[clients]
count = {clients}
per_round = {clients}
processes = {clients}
[transport]
kind = "{kind}"
max_message_bytes = 134217728
{transport_extra}
"""


def mlp_hidden_for(size_bytes: int, features: int = 64, classes: int = 10) -> int:
    """Hidden width h of a one-layer MLP on digits with about `size_bytes` of float32 parameters:
    (features + 1) h + (h + 1) classes parameters.  A model of any size on a small data set keeps
    each process's memory to the model and its buffers (the quadratic task of that size would
    hold every client's d-dimensional centre and curvature in every process)."""
    return max(1, round((size_bytes / 4 - classes) / (features + 1 + classes)))


def bench_kinds(args: argparse.Namespace) -> dict:
    """Round time and throughput of FedAvg rounds over gRPC and over torch.distributed (gloo)."""
    sizes = [1] if args.tiny else [int(s) for s in args.sizes.split(",")]
    client_counts = [2] if args.tiny else [int(n) for n in args.kind_clients.split(",")]
    rounds = 2 if args.tiny else 4
    rows = []
    print(f"{'model':>7} {'clients':>8} {'kind':>6} {'round s':>9} {'MB/s':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            hidden = mlp_hidden_for(size * 1_000_000)
            for n in client_counts:
                for kind in ("grpc", "torch"):
                    summary, rounds_rows = _run(KIND_CONFIG.format(rounds=rounds, hidden=hidden, clients=n, kind=kind,
                                                                      transport_extra="timeout = 900.0" if kind == "torch" else ""),
                                                Path(tmp) / f"{kind}-{size}-{n}")
                    t = statistics.median(r["wall_seconds"] for r in rounds_rows[1:] or rounds_rows)
                    per_round = summary["bytes"]["by_link"]["client-server"]["tensor_bytes"] / rounds
                    row = {"size_mb": size, "clients": n, "kind": kind, "round_seconds": t,
                           "tensor_mb_per_s": per_round / t / 1e6}
                    rows.append(row)
                    print(f"{size:>5}MB {n:>8} {kind:>6} {t:>9.3f} {row['tensor_mb_per_s']:>9.0f}")
    return {"rows": rows}
