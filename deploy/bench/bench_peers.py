"""`fedhop bench peers`: issue 49's workloads in fedhop's two engines, the round engine's loop and
other frameworks, interleaved, with the ratios.

    fedhop bench peers [--workloads W1,W2,W3] [--rounds N] [--repeats 3] [--seeds 0] [--match]
                       [--quick] [--vectorized] [--json FILE]

The workloads (issue 49):

  W1  10 clients, all sampled, a 1,000-parameter quadratic 1/2 sum_j c_ij (w_j - a_ij)^2
      (dataset "quadratic", centers and curvatures drawn from the seed), 1 local step, lr 0.1,
      the model from zeros;
  W2  scikit-learn's digits, standardised, 25% held out, an iid split over 1,000 clients, 100
      sampled a round, MLP 64-32-10, 1 epoch, batch 10, lr 0.05, weighted by samples, 30 rounds;
  W3  the same with 10,000 clients and 1,000 sampled: digits' 1,347 training samples cannot go
      to 10,000 clients without repeats, so W3 is dataset "crossdevice" on digits: each client
      draws log-normal many samples of a Dirichlet(0.5) label mix from the same training split
      (common/tasks/crossdevice.py), 10 rounds.

Systems: fedhop with run.engine = "processes" (a server and 2 client processes over gRPC) and
"inprocess" (the server in the one process, its client processes in one worker process per core,
run.workers = 0), each run as `fedhop run` in a subprocess; "fedhop loop", the round engine's
loop in one fresh process (deploy/bench/engine_loop.py: the same clients trained by the same code
into the same model bit for bit, with no message encoded, sent or recorded), the floor for an
engine with fedhop's training code, printed beside the engines as engine s/round / loop s/round
with a check that every fedhop system ended with the same model; Flower's
simulation engine when FEDHOP_FLWR_PYTHON names a Flower venv's python, pfl when FEDHOP_PFL_PYTHON
names a pfl venv's python.  A peer runs deploy/bench/peers/<peer>_peer.py under its own python
on the same data, exported from fedhop's task (deploy/bench/peers/peerkit.py has the contract and
each script's docstring what it does the same and where its framework differs); it prints one
JSON line.

Per run: s/round, the median of rounds 2..n (fedhop: the time between run.db's rows of
successive rounds, `finished`; a peer: its own stamps between central iterations); CPU
s/round, the CPU seconds (user + system) of every process of the run over the same rounds 2..n
divided by n - 1, from psutil's readings of the process tree every 50 ms, interpolated to the
end of round 1 and of round n (fedhop: run.db's `finished`; a peer: the `round_end_s` stamps
its script prints, time.perf_counter, one monotonic clock for every process here), and
"cores", CPU s/round over s/round: how many cores the system kept busy; peak memory, the
largest sum of RSS over the process tree in those readings; final test accuracy (W1: the
objective).  A workload's systems run `--repeats` times each, the
order rotated every repeat; the figures printed are the medians over the repeats.  Ratios are
"peer s/round / fedhop s/round" (how many times faster fedhop is) from those printed figures;
with several repeats each ratio is also given within each repeat ("by repeat LOW-HIGH"), and a
line that the medians meet but not every repeat alone, or the other way, says how many repeats
meet it: on a busy machine its state, not the systems, decides such a line.
`--seeds 0,1,2,3,4` repeats everything per seed and prints the accuracy of every seed.
`--match`: the peers start from fedhop's initial parameters and train fedhop's sampled clients
(Flower's own draws still: its node ids are not fedhop's clients).
`--vectorized`: fedhop's systems with `[algorithm] vectorized = true` (the clients of one call
trained together, docs/vectorized.md); they must still end on one model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.common.records.runstore import RunStore, round_seconds
from fedhop.common.tasks import build_task
from fedhop.common.util.cliparser import ArgumentParser, figures_file_problem
from fedhop.deploy.bench.engine_loop import model_sha256

PEERS_DIR = Path(__file__).resolve().parent / "peers"
#: peer -> (environment variable naming its python, script, name printed)
PEERS = {"flower": ("FEDHOP_FLWR_PYTHON", "flwr_peer.py", "Flower sim"),
         "pfl": ("FEDHOP_PFL_PYTHON", "pfl_peer.py", "pfl")}
ENGINES = ("processes", "inprocess")
#: the round engine's loop in one process (deploy/bench/engine_loop.py): fedhop's training code with no
#: message encoded, sent or recorded, the floor for an engine; its final model must be the engines'
LOOP = "fedhop loop"
#: the in-process engine with one worker process per core (run.workers = 0; issue 49: "both cores used")
ENGINE_FLAGS = {"inprocess": ["--set", "run.workers=0"]}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    clients: int
    per_round: int
    rounds: int
    data: str            # the [data] and [model] tables
    lr: float
    batch_size: int
    epochs: int
    local_steps: int
    kind: str            # "classification" | "quadratic"
    hidden: tuple[int, ...] = ()

    def config(self, rounds: int, seed: int, vectorized: bool = False) -> str:
        algo = (f"local_steps = {self.local_steps}\n" if self.local_steps else f"local_epochs = {self.epochs}\n")
        if vectorized:   # --vectorized: fedhop's clients of one call trained together (docs/vectorized.md)
            algo += "vectorized = true\n"
        return (f'[run]\nname = "bench-peers-{self.name.lower()}"\nseed = {seed}\nrounds = {rounds}\n'
                f'eval_every = {rounds}\n\n'
                f'[algorithm]\nname = "fedavg"\nlr = {self.lr}\nbatch_size = {self.batch_size}\n{algo}\n'
                f'{self.data}\n'
                f'[clients]\ncount = {self.clients}\nper_round = {self.per_round}\nprocesses = 2\n')


_MLP = '[model]\nkind = "mlp"\nhidden = [64, 32]\n'
_DIGITS = '[data]\ndataset = "digits"\npartition = "iid"\ntest_fraction = 0.25\n\n' + _MLP
_CROSSDEVICE = ('[data]\ndataset = "crossdevice"\nbase = "digits"\nlabel_alpha = 0.5\nsizes = "lognormal"\n'
                'size_mean = 3.0\nsize_sigma = 1.0\n\n' + _MLP)
_QUADRATIC = '[data]\ndataset = "quadratic"\ndim = {dim}\n\n[model]\ninit = "zeros"\n'


def workloads(quick: bool) -> dict[str, Workload]:
    """Issue 49's workloads, or with `quick` the same shapes at tiny sizes (seconds each)."""
    if quick:
        return {"W1": Workload("W1", "quadratic, 4 clients, all sampled, 50 parameters, 1 step", 4, 4, 4,
                               _QUADRATIC.format(dim=50), 0.1, 0, 1, 1, "quadratic"),
                "W2": Workload("W2", "digits iid, 40 clients, 8 a round, MLP 64-32-10, 1 epoch, batch 10", 40, 8, 4,
                               _DIGITS, 0.05, 10, 1, 0, "classification", (64, 32)),
                "W3": Workload("W3", "crossdevice digits, 60 clients, 12 a round, the same model", 60, 12, 3,
                               _CROSSDEVICE, 0.05, 10, 1, 0, "classification", (64, 32))}
    return {"W1": Workload("W1", "quadratic, 10 clients, all sampled, 1,000 parameters, 1 local step", 10, 10, 30,
                           _QUADRATIC.format(dim=1000), 0.1, 0, 1, 1, "quadratic"),
            "W2": Workload("W2", "digits iid, 1,000 clients, 100 a round, MLP 64-32-10, 1 epoch, batch 10, lr 0.05",
                           1000, 100, 30, _DIGITS, 0.05, 10, 1, 0, "classification", (64, 32)),
            "W3": Workload("W3", "crossdevice digits, 10,000 clients, 1,000 a round, the same model and training",
                           10000, 1000, 10, _CROSSDEVICE, 0.05, 10, 1, 0, "classification", (64, 32))}


# ----------------------------------------------------------------------------- measuring
class TreeWatch:
    """Samples a process and its descendants every `every` s: the largest sum of their RSS
    (`peak`) and the CPU seconds (user + system) the tree has used so far, with the time of each
    sample (`cpu`: rows of (time.time(), time.perf_counter(), CPU seconds)).  A process counts
    its last reading, so one that has exited still counts what it used up to its last sample (at
    most `every` s of its CPU is missed)."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.root, self.every, self.peak = psutil.Process(pid), every, 0
        self.cpu: list[tuple[float, float, float]] = []
        self._used: dict[tuple[int, float], float] = {}   # (pid, start time) -> its CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        """One reading of the tree: its RSS (returned) and its CPU seconds (appended to `cpu`;
        once the tree has ended, what its processes used up to their last readings)."""
        total = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                with p.oneshot():
                    total += p.memory_info().rss
                    times = p.cpu_times()
                    self._used[(p.pid, p.create_time())] = times.user + times.system
            except psutil.Error:
                pass
        self.cpu.append((time.time(), time.perf_counter(), sum(self._used.values())))
        return total

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.every)

    def stop(self) -> "TreeWatch":
        """Stop watching, with one last reading: a run's last round may end after the reading
        before its exit (a peer that exits right after its last round)."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return self


#: the clocks of `TreeWatch.cpu`'s rows: fedhop stamps its rounds with time.time() (run.db's
#: `finished`), a peer script with time.perf_counter() (the same monotonic clock in every
#: process of this machine)
WALL, MONOTONIC = 0, 1


def cpu_at(samples: list[tuple[float, float, float]], t: float, clock: int) -> float | None:
    """The tree's CPU seconds at time `t` on `clock`, interpolated linearly between the two
    samples around it; None when `t` is outside the sampled span."""
    for before, after in zip(samples, samples[1:]):
        if before[clock] <= t <= after[clock]:
            span = after[clock] - before[clock]
            share = (t - before[clock]) / span if span > 0 else 1.0
            return before[2] + share * (after[2] - before[2])
    return None


#: readings of the process tree a run's rounds 2..n must span for their CPU to be a per-round figure
MIN_READINGS = 5


def cpu_per_round(samples: list[tuple[float, float, float]], ends: list[float], clock: int) -> float | None:
    """CPU seconds of every process of a run per round over rounds 2..n (the span s/round is
    taken over): the CPU between the end of round 1 and the end of round n, divided by n - 1.
    `ends`: when each round ended, on `clock`.  None without two rounds inside the sampled span,
    or when the span holds fewer than MIN_READINGS readings (the interpolation would then give
    the tree's rate around the rounds rather than the rounds' own CPU)."""
    if len(ends) < 2 or sum(ends[0] <= row[clock] <= ends[-1] for row in samples) < MIN_READINGS:
        return None
    first, last = cpu_at(samples, ends[0], clock), cpu_at(samples, ends[-1], clock)
    if first is None or last is None:
        return None
    return (last - first) / (len(ends) - 1)


def run_watched(argv: list[str], env: dict[str, str] | None, log: Path, timeout: float) -> tuple[int, TreeWatch, str]:
    """Run `argv` to its end: (exit code, the watch of its process tree, its stdout)."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env)
        watch = TreeWatch(proc.pid)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, _ = proc.communicate()
        except BaseException:   # Ctrl-C: no run's processes (Ray's workers among them) outlive the benchmark
            kill_tree(proc.pid)
            raise
        return proc.returncode, watch.stop(), out.decode(errors="replace")


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every descendant it has now, by PID."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def steady(per_round: list[float]) -> float:
    """The median of rounds 2..n (all rounds when there is one)."""
    return statistics.median(per_round[1:] if len(per_round) > 1 else per_round)


def run_fedhop(config: Path, engine: str, out: Path, timeout: float) -> dict[str, Any]:
    argv = [sys.executable, "-m", "fedhop.deploy.cli", "run", str(config), "--out", str(out), "--engine", engine,
            "--quiet", *ENGINE_FLAGS.get(engine, [])]
    code, watch, _ = run_watched(argv, None, out.with_suffix(".log"), timeout)
    if code != 0:
        raise RuntimeError(f"fedhop run --engine {engine} failed (exit {code}); see {out.with_suffix('.log')}")
    store = RunStore(out / "run.db", create=False)
    rows = store.rounds()
    store.close()
    metrics = rows[-1]["metrics"]
    ends = [float(r["finished"]) for r in rows if r.get("finished") is not None]
    sha = model_sha256(out / "model.safetensors")
    return {"per_round_s": round_seconds(rows), "peak_rss_mb": watch.peak / 1e6,
            "cpu_s_per_round": cpu_per_round(watch.cpu, ends, WALL) if len(ends) == len(rows) else None,
            "accuracy": metrics.get("test_accuracy"), "objective": metrics.get("objective"), "model_sha256": sha}


def run_loop(config: Path, log: Path, timeout: float) -> dict[str, Any]:
    """The round engine's loop on `config` in a fresh process of this python (deploy/bench/engine_loop.py)."""
    code, watch, out = run_watched([sys.executable, "-m", "fedhop.deploy.bench.engine_loop", str(config)], None,
                                   log, timeout)
    if code != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{LOOP} failed (exit {code}); the end of {log}:\n{tail}")
    row = parse_peer_output(out, LOOP)
    ends = [float(v) for v in row["round_end_s"]]
    return {"per_round_s": [float(v) for v in row["per_round_s"]], "peak_rss_mb": watch.peak / 1e6,
            "cpu_s_per_round": cpu_per_round(watch.cpu, ends, MONOTONIC), "accuracy": row.get("accuracy"),
            "objective": row.get("objective"), "model_sha256": row.get("model_sha256")}


def parse_peer_output(stdout: str, name: str) -> dict[str, Any]:
    """The peer script's result: its last stdout line, a JSON object with per_round_s (a non-empty
    list of seconds), optionally round_end_s (a time per round) and accuracy or objective;
    ValueError naming what is wrong otherwise."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{name}: the peer script printed nothing on stdout")
    try:
        row = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: the peer script's last line is not JSON ({exc}): {lines[-1][:200]!r}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{name}: the peer script's last line is not a JSON object")
    rounds = row.get("per_round_s")
    if not isinstance(rounds, list) or not rounds or not all(isinstance(v, (int, float)) and v >= 0 for v in rounds):
        raise ValueError(f"{name}: per_round_s must be a non-empty list of seconds, got {rounds!r}")
    ends = row.get("round_end_s")
    if ends is not None and (not isinstance(ends, list) or len(ends) != len(rounds)
                             or not all(isinstance(v, (int, float)) for v in ends)):
        raise ValueError(f"{name}: round_end_s must be a list of {len(rounds)} times (one a round), got {ends!r:.200}")
    for key in ("accuracy", "objective"):
        if row.get(key) is not None and not isinstance(row[key], (int, float)):
            raise ValueError(f"{name}: {key} must be a number or null, got {row[key]!r}")
    return row


def run_peer(peer: str, python: str, folder: Path, log: Path, timeout: float) -> dict[str, Any]:
    _, script, name = PEERS[peer]
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLWR_DISABLE_UPDATE_CHECK="1")
    for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):   # nothing of fedhop's venv leaks in
        env.pop(var, None)
    code, watch, out = run_watched([python, str(PEERS_DIR / script), str(folder)], env, log, timeout)
    if code != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{name} failed (exit {code}); the end of {log}:\n{tail}")
    row = parse_peer_output(out, name)
    if len(row["per_round_s"]) != json.loads((folder / "spec.json").read_text())["rounds"]:
        raise RuntimeError(f"{name}: {len(row['per_round_s'])} rounds timed, expected the spec's")
    ends = row.get("round_end_s")
    return {"per_round_s": [float(v) for v in row["per_round_s"]], "peak_rss_mb": watch.peak / 1e6,
            "cpu_s_per_round": cpu_per_round(watch.cpu, [float(v) for v in ends], MONOTONIC) if ends else None,
            "accuracy": row.get("accuracy"), "objective": row.get("objective"), "version": row.get("version")}


# ----------------------------------------------------------------------------- the shared workload
def export(w: Workload, config_text: str, rounds: int, seed: int, folder: Path, match: bool) -> None:
    """spec.json and data.npz for the peers (peerkit.py): fedhop's own data, and with `match`
    its initial parameters and sampled clients."""
    cfg = parse_config(config_text)
    task = build_task(cfg)
    arrays: dict[str, np.ndarray] = {}
    if w.kind == "quadratic":
        rows = [task.client_data(c).tensors for c in range(w.clients)]
        arrays["centers"] = np.concatenate([r[0].numpy() for r in rows]).astype(np.float32)
        arrays["curvatures"] = np.concatenate([r[1].numpy() for r in rows]).astype(np.float32)
    else:
        data = [task.client_data(c).tensors for c in range(w.clients)]
        arrays["x"] = np.concatenate([d[0].numpy().reshape(len(d[0]), -1) for d in data]).astype(np.float32)
        arrays["y"] = np.concatenate([d[1].numpy() for d in data]).astype(np.int64)
        arrays["offsets"] = np.cumsum([0] + [len(d[1]) for d in data]).astype(np.int64)
        x_test, y_test = task.x_test, task.y_test   # type: ignore[attr-defined]
        arrays["x_test"] = x_test.numpy().reshape(len(x_test), -1).astype(np.float32)
        arrays["y_test"] = y_test.numpy().astype(np.int64)
    if match:
        engine = RoundEngine(cfg, task)
        for name, p in engine.model.named_parameters():
            arrays[f"init_{name}"] = p.detach().numpy().copy()
        arrays["sampled"] = np.array([engine.sample(r) for r in range(1, rounds + 1)], dtype=np.int64)
    spec = {"workload": w.name, "kind": w.kind, "clients": w.clients, "per_round": w.per_round, "rounds": rounds,
            "lr": w.lr, "batch_size": w.batch_size, "epochs": w.epochs, "local_steps": w.local_steps,
            "hidden": list(w.hidden), "seed": seed, "weighting": cfg.algorithm.weighting, "match": match}
    with open(folder / "data.npz", "wb") as fh:
        np.savez(fh, allow_pickle=False, **arrays)
    (folder / "spec.json").write_text(json.dumps(spec))


# ----------------------------------------------------------------------------- one workload
def systems(env: dict[str, str]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(the systems to run, peer -> its python, peer -> why it is not run)."""
    run, pythons, skipped = [*(f"fedhop {e}" for e in ENGINES), LOOP], {}, {}
    for peer, (var, _, name) in PEERS.items():
        python = env.get(var, "")
        if not python:
            skipped[name] = f"not run (set {var})"
        elif not Path(python).is_file():
            skipped[name] = f"not run ({var}={python}: no such file)"
        else:
            run.append(peer)
            pythons[peer] = python
    return run, pythons, skipped


def label(system: str) -> str:
    return PEERS[system][2] if system in PEERS else system


def measure(w: Workload, rounds: int, seed: int, repeats: int, match: bool, work: Path,
            order: list[str], pythons: dict[str, str], say: Callable[[str], None],
            vectorized: bool = False) -> dict[str, list[dict]]:
    """Every system on `w`, `repeats` times, the order rotated each repeat: system -> its runs."""
    folder = work / f"{w.name}-seed{seed}"
    folder.mkdir()
    config = folder / "run.toml"
    text = w.config(rounds, seed, vectorized)
    config.write_text(text)
    if any(s in PEERS for s in order):
        export(w, text, rounds, seed, folder, match)
    timeout = 600.0 + 30.0 * rounds * max(1, w.per_round // 100)
    runs: dict[str, list[dict]] = {s: [] for s in order}
    for rep in range(repeats):
        turn = order[rep % len(order):] + order[:rep % len(order)]
        for system in turn:
            tag = f"{system.replace(' ', '-')}-{rep}"
            if system in PEERS:
                row = run_peer(system, pythons[system], folder, folder / f"{tag}.log", timeout)
            elif system == LOOP:
                row = run_loop(config, folder / f"{tag}.log", timeout)
            else:
                row = run_fedhop(config, system.split()[1], folder / tag, timeout)
            row["s_per_round"] = steady(row["per_round_s"])
            runs[system].append(row)
            cpu = row.get("cpu_s_per_round")
            say(f"  {w.name} seed {seed} repeat {rep + 1}/{repeats}: {label(system)} "
                f"{row['s_per_round']:.4f} s/round, {'-' if cpu is None else f'{cpu:.4f}'} CPU s/round, "
                f"{row['peak_rss_mb']:.0f} MB")
    return runs


def summarise(runs: list[dict]) -> dict[str, Any]:
    """The printed figures of one system: medians over its repeats (s/round rounded as printed)."""
    accs = [r["accuracy"] for r in runs if r.get("accuracy") is not None]
    objs = [r["objective"] for r in runs if r.get("objective") is not None]
    cpus = [r["cpu_s_per_round"] for r in runs if r.get("cpu_s_per_round") is not None]
    return {"s_per_round": float(f"{statistics.median(r['s_per_round'] for r in runs):.4f}"),
            "cpu_s_per_round": float(f"{statistics.median(cpus):.4f}") if cpus else None,
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
            "accuracy": statistics.median(accs) if accs else None,
            "objective": statistics.median(objs) if objs else None, "runs": len(runs),
            "by_repeat": [float(f"{r['s_per_round']:.4f}") for r in runs],
            "models": sorted({r["model_sha256"] for r in runs if r.get("model_sha256")})}


#: issue 49's acceptance lines: (workload, fedhop engine, peer, least ratio peer s/round / fedhop s/round)
ACCEPTANCE = [("W1", "fedhop processes", "flower", 10.0), ("W2", "fedhop processes", "pfl", 1.0),
              ("W2", "fedhop processes", "flower", 10.0), ("W3", "fedhop processes", "pfl", 1.0),
              ("W3", "fedhop processes", "flower", 10.0), ("W1", "fedhop inprocess", "pfl", 2.0),
              ("W2", "fedhop inprocess", "pfl", 2.0)]


def ratios(name: str, table: dict[str, dict]) -> list[dict[str, Any]]:
    """peer s/round / fedhop s/round for each fedhop engine and peer run, with the acceptance
    line that applies (None where the issue sets none).  `by_repeat`: the same ratio within each
    repeat (both systems' runs of that repeat, which ran in the same turn of the systems), so that a reader
    sees how far the machine's state moved it; `repeats_agree`: whether every repeat alone meets
    the line as the medians do (None without a line or with one repeat)."""
    out = []
    for engine in (*(f"fedhop {e}" for e in ENGINES), LOOP):
        for peer in PEERS:
            if engine in table and peer in table and table[engine]["s_per_round"] > 0:
                need = next((x for (wn, e, p, x) in ACCEPTANCE if (wn, e, p) == (name, engine, peer)), None)
                ratio = table[peer]["s_per_round"] / table[engine]["s_per_round"]
                by_repeat = [theirs / ours for theirs, ours in zip(table[peer].get("by_repeat", []),
                                                                   table[engine].get("by_repeat", [])) if ours > 0]
                agree = (None if need is None or len(by_repeat) < 2 else
                         all((r >= need) == (ratio >= need) for r in by_repeat))
                out.append({"engine": engine, "peer": peer, "ratio": ratio, "needs": need,
                            "meets": None if need is None else ratio >= need, "by_repeat": by_repeat,
                            "repeats_agree": agree})
    return out


def ratio_line(r: dict[str, Any]) -> str:
    """One printed ratio (`ratios`' row): the medians' ratio, each repeat's where there are
    several, and the acceptance line it is held to."""
    spread = ""
    if len(r["by_repeat"]) > 1:
        spread = f" (by repeat {min(r['by_repeat']):.3f}-{max(r['by_repeat']):.3f})"
    need = ""
    if r["needs"] is not None:
        need = f"  (issue 49: >= {r['needs']:g}: {'met' if r['meets'] else 'NOT met'}"
        if r["repeats_agree"] is False:
            meeting = sum(x >= r["needs"] for x in r["by_repeat"])
            need += f"; {meeting} of {len(r['by_repeat'])} repeats alone meet it: the machine's state decides it"
        need += ")"
    return f"  ratio {label(r['peer'])} / {r['engine']}: {r['ratio']:.3f}{spread}{need}"


def against_loop(table: dict[str, dict]) -> dict[str, Any]:
    """Each fedhop engine's s/round over the loop's (what moving and recording the messages costs),
    and whether every fedhop system and repeat ended with the same model (`identical`; None
    where a system gave no model hash)."""
    loop = table.get(LOOP)
    over = {e: table[e]["s_per_round"] / loop["s_per_round"] for e in (f"fedhop {n}" for n in ENGINES)
            if loop is not None and e in table and loop["s_per_round"] > 0}
    models = [fig.get("models") or [] for s, fig in table.items() if s not in PEERS]
    identical = None if not all(models) else len({m for ms in models for m in ms}) == 1
    return {"engine_over_loop": over, "identical": identical}


def print_table(w: Workload, rounds: int, seed: int, repeats: int, table: dict[str, dict],
                skipped: dict[str, str], say: Callable[[str], None]) -> list[dict]:
    say(f"\n{w.name}: {w.title}; {rounds} rounds, seed {seed}, {repeats} repeat(s)")
    say(f"  {'system':<18} {'s/round':>9} {'CPU s/round':>12} {'cores':>6} {'peak MB':>9} "
        f"{'accuracy' if w.kind != 'quadratic' else 'objective':>10}")
    for system, fig in table.items():
        metric = fig["accuracy"] if w.kind != "quadratic" else fig["objective"]
        shown = "-" if metric is None else (f"{metric:.4f}" if w.kind != "quadratic" else f"{metric:.6g}")
        cpu = fig.get("cpu_s_per_round")
        cores = f"{cpu / fig['s_per_round']:.2f}" if cpu is not None and fig["s_per_round"] > 0 else "-"
        say(f"  {label(system):<18} {fig['s_per_round']:>9.4f} {'-' if cpu is None else f'{cpu:.4f}':>12} "
            f"{cores:>6} {fig['peak_rss_mb']:>9.0f} {shown:>10}")
    for name, why in skipped.items():
        say(f"  {name:<18} {why}")
    if any(fig.get("cpu_s_per_round") is None for fig in table.values()):
        say(f"  (CPU s/round -: rounds 2..n spanned fewer than {MIN_READINGS} readings of the process tree, "
            f"50 ms apart; more --rounds give it)")
    rows = ratios(w.name, table)
    for r in rows:
        say(ratio_line(r))
    loop = against_loop(table)
    if loop["engine_over_loop"]:
        say("  fedhop engine / fedhop loop: " + ", ".join(f"{e.split()[1]} {x:.2f}" for e, x in
                                                        loop["engine_over_loop"].items())
            + " (the loop trains the same clients and sends and records no message)")
    if loop["identical"] is not None:
        say("  final model: " + ("the same bits in every fedhop system and repeat" if loop["identical"] else
                                 "DIFFERS between fedhop systems or repeats (a defect: the engines are bit-identical)"))
    return rows


def bench_peers(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    table_of = workloads(args.quick)
    names = workload_names(args.workloads)
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    order, pythons, skipped = systems(dict(os.environ))
    load = os.getloadavg()
    say(f"fedhop bench peers, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {os.cpu_count()} CPUs; systems: "
        f"{', '.join(label(s) for s in order)}"
        + ("; fedhop with [algorithm] vectorized = true" if getattr(args, "vectorized", False) else ""))
    out: dict[str, Any] = {"started": time.time(), "load_average_start": load, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="fedhop-bench-peers-") as tmp:
        for name in names:
            w = table_of[name]
            rounds = args.rounds or w.rounds
            per_seed: dict[int, dict[str, Any]] = {}
            for seed in seeds:
                runs = measure(w, rounds, seed, args.repeats, args.match, Path(tmp), order, pythons, say,
                               getattr(args, "vectorized", False))
                table = {s: summarise(r) for s, r in runs.items()}
                rows = print_table(w, rounds, seed, args.repeats, table, skipped, say)
                per_seed[seed] = {"systems": table, "ratios": rows, "loop": against_loop(table),
                                  "versions": {s: r[0].get("version") for s, r in runs.items() if s in PEERS}}
            if len(seeds) > 1 and w.kind != "quadratic":
                say(f"\n{name} final test accuracy by seed:")
                for system in order:
                    accs = [per_seed[s]["systems"][system]["accuracy"] for s in seeds]
                    say(f"  {label(system):<18} " + " ".join(f"{a:.4f}" for a in accs) +
                        f"   mean {statistics.mean(accs):.4f}, min {min(accs):.4f}, max {max(accs):.4f}")
            out["workloads"][name] = {"title": w.title, "rounds": rounds, "seeds": per_seed}
    out["load_average_end"] = os.getloadavg()
    say(f"load average at the end: {' '.join(f'{v:.1f}' for v in out['load_average_end'])}")
    return out


def workload_names(given: str) -> list[str]:
    """--workloads as names; ValueError naming the unknown ones."""
    names = [n.strip().upper() for n in given.split(",") if n.strip()]
    unknown = [n for n in names if n not in workloads(False)]
    if unknown or not names:
        raise ValueError(f"--workloads {given!r}: unknown {', '.join(unknown) or '(none given)'} "
                         f"(allowed: {', '.join(workloads(False))})")
    return names


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="fedhop bench peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="W1,W2,W3", help="comma-separated: W1, W2, W3")
    ap.add_argument("--rounds", type=int, default=0, help="rounds of every workload (default: W1 30, W2 30, W3 10)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each system per workload, interleaved")
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (accuracy by seed with more than one)")
    ap.add_argument("--match", action="store_true",
                    help="peers start from fedhop's initial parameters and train fedhop's sampled clients")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, seconds a run (for the tests)")
    ap.add_argument("--vectorized", action="store_true",
                    help="fedhop's systems with [algorithm] vectorized = true: the clients of one call trained "
                         "together (docs/vectorized.md); the peers as always")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.rounds < 0:
        ap.error("--repeats must be >= 1 and --rounds >= 0")
    if args.rounds == 1:
        ap.error("--rounds must be >= 2 (s/round is the median of rounds 2..n)")
    try:
        workload_names(args.workloads)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        if not [int(s) for s in str(args.seeds).split(",") if s.strip()]:
            raise ValueError
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    try:
        figures = bench_peers(args)
    except RuntimeError as exc:   # a system's run failed: its name, exit code and log's end
        print(f"fedhop bench peers: {exc}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    return 0
