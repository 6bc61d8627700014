"""Framework overhead against Flower, measured side by side (issue 11, target 2).

    .venv/bin/python benchmarks/flower_compare.py --rounds 20 --flwr-python /work/flwr-venv/bin/python --json out.json
    fedhop bench flower --rounds 20 --flwr-python /work/flwr-venv/bin/python            (the same thing)

One invocation runs the same FedAvg round -- 10 clients, one float32 vector of `--params`
(default 1,000) parameters, compute near zero (one gradient step on a per-client quadratic
1/2 ||w - a_i||^2) -- in

  (a) fedhop: a server process and `--fedhop-processes` client processes (default 10, one per
      client like Flower's SuperNodes) over gRPC on loopback (deploy.launch.launcher.run_local); the
      per-round wall time is `rounds.wall_seconds` of run.db;
  (b) Flower's deployment runtime: one `flower-superlink` and 10 `flower-supernode` processes
      on loopback, the app submitted with `flwr run APP deploy` (Flower's default subprocess
      isolation: the SuperNode starts a `flwr-clientapp` process for every message);
  (c) Flower's simulation engine: `flwr run APP local` (the `:local:` SuperLink that `flwr run`
      starts, Ray backend, 10 simulated SuperNodes, default client resources).

Each Flower mode runs twice: with the FedAvg default `fraction_evaluate = 1.0` (a federated
evaluate on every node after every train phase) and with `fraction_evaluate = 0.0`, the
like-for-like round: train + aggregate + a server-side (centralised) evaluation, which is what
fedhop's round does with `eval_every = 1`.  Flower's app is written into a temporary directory
from the sources in this file; its ServerApp writes time stamps (configure_train, top and end of
aggregate_train, end of aggregate_evaluate, end of the centralised evaluate_fn) to a JSONL file.

What one "round" is:
  fedhop  sampling, broadcast (encode once), 10 gRPC calls in parallel (send, the client's
          step, reply), reply validation, aggregation, server update, server-side evaluation
          of the objective; not included: writing the round's row and ledger to run.db.
  Flower  from the top of `configure_train` to the end of the centralised `evaluate_fn`:
          train messages to 10 nodes and replies, `aggregate_train`, the federated evaluate
          phase (messages and replies; skipped when fraction_evaluate = 0), `aggregate_evaluate`,
          the centralised evaluation; not included: Flower's log lines between rounds.
Figures are the median over rounds 2..R (round 1 warms up: Ray start-up, first process spawns).

Flower is a benchmark extra, never a fedhop dependency: it lives in its own venv, given by
`--flwr-python` or FEDHOP_FLWR_PYTHON; its console scripts are taken from that python's bin/.
Every Flower process this script starts carries a unique FEDHOP_FLOWER_BENCH token in its
environment; at the end the script stops every live process holding that token (by PID),
including the detached `:local:` SuperLink and Ray's processes.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

TOKEN_VAR = "FEDHOP_FLOWER_BENCH"
CLIENTS = 10

# ----------------------------------------------------------------------------- fedhop half
FEDHOP_CONFIG = """
[run]
name = "bench-flower-compare"
rounds = {rounds}
eval_every = 1
[algorithm]
name = "fedavg"
lr = 0.1
local_steps = 1
batch_size = 0
[data]
dataset = "quadratic"
dim = {params}
[model]
init = "zeros"
[clients]
count = {clients}
per_round = {clients}
processes = {processes}
[transport]
batch = {batch}
"""


def _summary(values: list[float]) -> dict[str, float]:
    """Median, min and max over rounds 2..R (all rounds when there is only one)."""
    steady = values[1:] if len(values) > 1 else values
    return {"median_s": statistics.median(steady), "min_s": min(steady), "max_s": max(steady)}


def run_fedhop(rounds: int, params: int, processes: int, batch: bool = True) -> dict[str, Any]:
    """FedAvg over gRPC with real processes (with `batch`, transport.batch: one call per client
    process and round, each client's request still its own message); per-round wall times from run.db."""
    from fedhop.common.records.runstore import RunStore
    from fedhop.deploy.launch.launcher import run_local

    with tempfile.TemporaryDirectory(prefix="fedhop-flwr-cmp-") as tmp:
        cfg = Path(tmp) / "round.toml"
        cfg.write_text(FEDHOP_CONFIG.format(rounds=rounds, params=params, clients=CLIENTS, processes=processes,
                                            batch=str(batch).lower()))
        t = time.perf_counter()
        code = run_local(str(cfg), [], str(Path(tmp) / "run"), quiet=True, show_table=False)
        wall = time.perf_counter() - t
        if code != 0:
            raise RuntimeError(f"the fedhop run failed (exit {code})")
        rows = RunStore(Path(tmp) / "run" / "run.db", create=False).rounds()
    per_round = [float(r["wall_seconds"]) for r in rows]
    breakdown = {k: statistics.median(float(r["metrics"].get(k, 0.0)) for r in rows[1:] or rows)
                 for k in ("time_compute", "time_communication", "time_aggregation", "time_evaluation")}
    if len(per_round) != rounds or not all(r["participants"] == CLIENTS for r in rows):
        raise RuntimeError(f"fedhop run recorded {len(per_round)} rounds ({rounds} expected) "
                           f"or rounds with fewer than {CLIENTS} participants")
    mode = f"gRPC, {processes} client processes" + (", batched calls" if batch else "")
    return {"system": "fedhop", "mode": mode, "eval": "server-side",
            "rounds": rounds, "per_round_s": per_round, **_summary(per_round), "run_wall_s": wall,
            "breakdown_median_s": breakdown}


# ----------------------------------------------------------------------------- the Flower app
APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedhopbench"
version = "1.0.0"
description = "fedhop's side-by-side benchmarks against Flower (benchmarks/flower_compare.py)"
license = "Apache-2.0"
dependencies = ["flwr[simulation]>=1.41.0", "numpy>=2.0"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedhop"

[tool.flwr.app.components]
serverapp = "fedhopbench.server_app:app"
clientapp = "fedhopbench.client_app:app"

[tool.flwr.app.config]
{config}
"""
ROUND_APP_CONFIG = """\
num-server-rounds = 3
num-params = 1000
num-clients = 10
fraction-evaluate = 1.0
lr = 0.1
timing-file = "timing.jsonl"
"""

APP_TASK = '''\
"""The per-client quadratic f_i(w) = 1/2 ||w - a_i||^2 (fedhop's quadratic task, curvature 1)."""
import numpy as np


def center(partition_id: int, dim: int) -> np.ndarray:
    return np.random.default_rng(1000 + partition_id).standard_normal(dim).astype(np.float32)


def objective(w: np.ndarray, num_clients: int) -> float:
    return float(np.mean([0.5 * np.sum((w - center(i, w.size)) ** 2) for i in range(num_clients)]))
'''

APP_CLIENT = '''\
"""One local gradient step w - lr (w - a_i): every client's update differs (Flower dedups
identical arrays by content hash, so identical updates would be unfairly cheap)."""
import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedhopbench.task import center

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    (w,) = msg.content["arrays"].to_numpy_ndarrays()
    a = center(int(context.node_config["partition-id"]), w.size)
    lr = float(context.run_config["lr"])
    new = (w - np.float32(lr) * (w - a)).astype(np.float32)
    loss = float(0.5 * np.sum((w - a) ** 2))
    return Message(content=RecordDict({"arrays": ArrayRecord([new]),
                                       "metrics": MetricRecord({"train_loss": loss, "num-examples": 1})}),
                   reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    (w,) = msg.content["arrays"].to_numpy_ndarrays()
    a = center(int(context.node_config["partition-id"]), w.size)
    loss = float(0.5 * np.sum((w - a) ** 2))
    return Message(content=RecordDict({"metrics": MetricRecord({"eval_loss": loss, "num-examples": 1})}),
                   reply_to=msg)
'''

APP_TIMING = '''\
"""FedAvg with time stamps written to a JSONL file (one line per event)."""
import json
import time

from flwr.serverapp.strategy import FedAvg


class TimedFedAvg(FedAvg):
    def __init__(self, timing_file, **kw):
        super().__init__(**kw)
        self.timing_file = timing_file

    def stamp(self, event, rnd, **extra):
        with open(self.timing_file, "a") as fh:
            fh.write(json.dumps({"event": event, "round": rnd, "t": time.time(), **extra}) + "\\n")

    def configure_train(self, server_round, arrays, config, grid):
        self.stamp("round_start", server_round)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.stamp("train_done", server_round, replies=sum(1 for m in replies if not m.has_error()))
        out = super().aggregate_train(server_round, replies)
        self.stamp("aggregated", server_round)
        return out

    def aggregate_evaluate(self, server_round, replies):
        out = super().aggregate_evaluate(server_round, replies)
        self.stamp("evaluate_done", server_round)
        return out
'''

APP_SERVER = '''\
"""FedAvg on the quadratic, a centralised evaluation of the objective every round."""
import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedhopbench.task import objective
from fedhopbench.timing import TimedFedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["num-clients"])
    strategy = TimedFedAvg(str(cfg["timing-file"]), fraction_train=1.0,
                           fraction_evaluate=float(cfg["fraction-evaluate"]),
                           min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n)

    def central_evaluate(rnd, arrays):  # server-side evaluation, as fedhop's round has
        (w,) = arrays.to_numpy_ndarrays()
        value = objective(w, n)
        if rnd > 0:
            strategy.stamp("round_end", rnd)
        return MetricRecord({"objective": value})

    strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(int(cfg["num-params"]), np.float32)]),
                   num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=central_evaluate)
'''


def write_app(where: Path, modules: dict[str, str] | None = None, config: str = ROUND_APP_CONFIG) -> Path:
    """The Flower app package `fedhopbench` under where/app: `modules` (file stem -> source;
    default the 10-client round's task, client_app and server_app) beside the timed strategy,
    whose ServerApp and ClientApp are server_app:app and client_app:app."""
    app = where / "app"
    pkg = app / "fedhopbench"
    pkg.mkdir(parents=True)
    (app / "pyproject.toml").write_text(APP_PYPROJECT.format(config=config))
    (pkg / "__init__.py").write_text("")
    (pkg / "timing.py").write_text(APP_TIMING)
    for stem, source in (modules or {"task": APP_TASK, "client_app": APP_CLIENT, "server_app": APP_SERVER}).items():
        (pkg / f"{stem}.py").write_text(source)
    return app


def read_stamps(path: Path) -> tuple[dict[tuple[str, int], float], dict[int, int]]:
    """The ServerApp's time stamps by (event, round), and the successful train replies by round
    (both empty when there is no file; a line cut by a killed run is left out)."""
    stamps: dict[tuple[str, int], float] = {}
    replies: dict[int, int] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        stamps[(row["event"], int(row["round"]))] = float(row["t"])
        if "replies" in row:
            replies[int(row["round"])] = int(row["replies"])
    return stamps, replies


def parse_timing(path: Path, rounds: int) -> dict[str, Any]:
    """Per-round seconds (round_start -> round_end), the phase split and the train replies per
    round from the stamps."""
    stamps, replies = read_stamps(path)
    missing = [r for r in range(1, rounds + 1) if ("round_end", r) not in stamps]
    if missing:
        raise RuntimeError(f"Flower run stopped early: no round_end stamp for rounds {missing[:5]} in {path}")
    per_round = [stamps[("round_end", r)] - stamps[("round_start", r)] for r in range(1, rounds + 1)]
    train = [stamps[("train_done", r)] - stamps[("round_start", r)] for r in range(1, rounds + 1)]
    evaluate = [stamps[("evaluate_done", r)] - stamps[("aggregated", r)] for r in range(1, rounds + 1)]
    return {"per_round_s": per_round, **_summary(per_round),
            "train_phase_median_s": _summary(train)["median_s"],
            "evaluate_phase_median_s": _summary(evaluate)["median_s"],
            "train_replies": [replies.get(r) for r in range(1, rounds + 1)]}


# ----------------------------------------------------------------------------- Flower processes
class FlowerBench:
    """Flower's processes for one benchmark: started with a token, all stopped in `close`."""

    def __init__(self, flwr_python: str, work: Path, log=print) -> None:
        self.python = flwr_python
        self.bin = Path(flwr_python).parent          # the venv's bin/ (not resolved: keep the venv)
        for exe in ("flwr", "flower-superlink", "flower-supernode"):
            if not (self.bin / exe).exists():
                raise FileNotFoundError(f"--flwr-python {flwr_python}: no {exe} beside it in {self.bin}")
        self.work = work
        self.token = secrets.token_hex(8)
        self.log = log
        self.home = work / "flwrhome"
        self.home.mkdir(parents=True)
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, FLWR_HOME=str(self.home), FLWR_DISABLE_UPDATE_CHECK="1",
                        PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
        self.env[TOKEN_VAR] = self.token
        for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):   # nothing of fedhop's venv leaks in
            self.env.pop(var, None)
        self.superlink_port = 0

    def version(self) -> str:
        code = "import flwr, ray; print(flwr.__version__, ray.__version__)"
        out = subprocess.run([self.python, "-c", code], env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"the Flower python cannot import flwr/ray: {out.stderr.strip()[-500:]}")
        return out.stdout.strip()

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        fh = open(self.work / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=self.env, cwd=self.work,
                                start_new_session=True)
        fh.close()
        self.procs.append(proc)
        return proc

    def write_connections(self, supernodes: int = CLIENTS, actor_cpus: int | None = None) -> None:
        """$FLWR_HOME/config.toml: `deploy` (our SuperLink) and `local` (flwr run's managed one,
        `supernodes` simulated nodes; `actor_cpus`: CPUs per ClientApp actor, Flower's default 2)."""
        resources = "" if actor_cpus is None else f"options.backend.client-resources.num-cpus = {actor_cpus}\n"
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n'
            f'[superlink.local]\naddress = ":local:"\noptions.num-supernodes = {supernodes}\n{resources}\n'
            f'[superlink.deploy]\naddress = "127.0.0.1:{self.superlink_port}"\ninsecure = true\n')

    def start_deployment(self) -> None:
        """One SuperLink and 10 SuperNodes on loopback (each SuperNode needs its own port)."""
        self.superlink_port = _free_port()
        self.write_connections()
        # the app's dependencies are already in this venv: skip the per-run `uv sync` from a registry
        self.spawn("superlink", [str(self.bin / "flower-superlink"), "--insecure", "--port", str(self.superlink_port),
                                 "--disable-runtime-dependency-installation"])
        _wait_http(f"http://127.0.0.1:{self.superlink_port}/health", 120, self.procs[-1], self.work / "superlink.log")
        for i in range(CLIENTS):
            self.spawn(f"supernode-{i}", [str(self.bin / "flower-supernode"), "--insecure",
                                          "--superlink", f"127.0.0.1:{self.superlink_port}",
                                          "--port", str(_free_port()),
                                          "--node-config", f"partition-id={i} num-partitions={CLIENTS}"])

    def flwr_run(self, app: Path, connection: str, tag: str, rounds: int, params: int,
                 fraction_evaluate: float, timeout: float) -> dict[str, Any]:
        timing = self.work / f"timing-{tag}.jsonl"
        run_config = (f'num-server-rounds={rounds} num-params={params} num-clients={CLIENTS} '
                      f'fraction-evaluate={fraction_evaluate} timing-file="{timing}"')
        wall = self.run_app(app, connection, tag, run_config, timeout)
        if not timing.exists():
            raise RuntimeError(f"flwr run ({tag}) wrote no time stamps; see {self.work}/flwr-run-{tag}.log")
        return {"rounds": rounds, "fraction_evaluate": fraction_evaluate, **parse_timing(timing, rounds),
                "run_wall_s": wall}

    def run_app(self, app: Path, connection: str, tag: str, run_config: str, timeout: float,
                watch: Callable[[], str | None] | None = None) -> float:
        """`flwr run APP CONNECTION --run-config RUN_CONFIG` to its end; its wall seconds.  Raises
        RuntimeError when it fails, runs past `timeout` seconds, or `watch()` (called about twice
        a second) returns a reason to stop; the run's processes are left to `close`."""
        log = self.work / f"flwr-run-{tag}.log"
        self.log(f"  flwr run {connection} ({tag}) ...")
        t = time.perf_counter()
        with open(log, "wb") as fh:
            proc = subprocess.Popen([str(self.bin / "flwr"), "run", str(app), connection, "--run-config", run_config,
                                     "--stream"], stdout=fh, stderr=subprocess.STDOUT, env=self.env, cwd=self.work,
                                    start_new_session=True)
            self.procs.append(proc)
            while True:
                try:
                    code = proc.wait(0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                reason = watch() if watch is not None else None
                if reason is None and time.perf_counter() - t > timeout:
                    reason = f"took over {timeout:.0f}s"
                if reason:
                    raise RuntimeError(f"flwr run ({tag}) {reason}; see {log}")
        if code != 0:
            raise RuntimeError(f"flwr run ({tag}) failed (exit {code}):\n" + log.read_text(errors="replace")[-2000:])
        return time.perf_counter() - t

    def close(self, grace: float = 10.0) -> list[int]:
        """Stop every live process carrying this benchmark's token (SIGTERM, then SIGKILL)."""
        pids = _pids_with_token(self.token)
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _pids_with_token(self.token):
            time.sleep(0.2)
        for pid in _pids_with_token(self.token):
            _signal(pid, signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s; see {log}")


def _pids_with_token(token: str) -> list[int]:
    """PIDs of this user's processes whose environment holds FEDHOP_FLOWER_BENCH=token."""
    needle = f"{TOKEN_VAR}={token}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def find_flwr_python(given: str | None) -> str | None:
    """--flwr-python, else FEDHOP_FLWR_PYTHON; None when neither names a python that imports flwr."""
    path = given or os.environ.get("FEDHOP_FLWR_PYTHON")
    if not path or not Path(path).exists():
        return None
    try:
        ok = subprocess.run([path, "-c", "import flwr"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if ok else None


def run_flower(flwr_python: str, rounds: int, params: int, modes: list[str], evals: list[float],
               log=print, keep: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Flower's rows (one per mode and fraction_evaluate) and run info; `keep`: a directory
    to leave the app, FLWR_HOME and every log in (else a temporary one is removed)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flwr-cmp-") as tmp:
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=False)
        bench = FlowerBench(flwr_python, Path(keep or tmp), log)
        info = {"versions": bench.version()}
        try:
            app = write_app(bench.work)
            bench.write_connections()
            if "deployment" in modes:
                bench.start_deployment()
                for fe in evals:
                    r = bench.flwr_run(app, "deploy", f"deploy-fe{fe}", rounds, params, fe, timeout=120 + 120 * rounds)
                    rows.append({"system": "Flower", "mode": "deployment (HTTP, 10 SuperNodes)", **r})
            if "simulation" in modes:
                for fe in evals:
                    r = bench.flwr_run(app, "local", f"sim-fe{fe}", rounds, params, fe, timeout=300 + 30 * rounds)
                    rows.append({"system": "Flower", "mode": "simulation (Ray, 10 simulated nodes)", **r})
        finally:
            info["stopped_pids"] = len(bench.close())
            left = _pids_with_token(bench.token)
            if left:
                log(f"warning: Flower processes still alive: {left}")
            info["left_alive"] = left
    return rows, info


# ----------------------------------------------------------------------------- cross-device scale
# `fedhop bench scale --flwr-python PY` (deploy/bench/bench_system.py) runs, beside each fedhop run, this
# app in Flower's simulation engine: as many simulated SuperNodes as fedhop's logical clients,
# FedAvg sampling the same number per round, the same 610-parameter softmax model and local work.
SCALE_APP_CONFIG = """\
num-server-rounds = 3
num-clients = 100
sampled = 10
lr = 0.05
batch-size = 16
local-steps = 1
seed = 0
timing-file = "timing.jsonl"
"""

SCALE_TASK_TAIL = '''

P = SimpleNamespace(**{params!r})
SEED = {seed}
COUNT = {count}


@functools.lru_cache(maxsize=1)
def devices():
    return SyntheticDevices(P, SEED), client_sizes(P, COUNT, SEED)


def client_data(k):
    """Client k's samples, made on demand (fedhop keeps a 64-client cache; sampled clients rarely repeat)."""
    gen, sizes = devices()
    return gen.device(k, int(sizes[k]))
'''

SCALE_CLIENT = '''\
"""`local-steps` SGD steps of multinomial logistic regression on minibatches of `batch-size`
(the client's whole data when it holds fewer), in numpy: the local work of fedhop's scale run."""
import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedhopbench.task import SEED, client_data

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    w, b = msg.content["arrays"].to_numpy_ndarrays()
    k = int(context.node_config["partition-id"])
    x, y = client_data(k)
    cfg = context.run_config
    bs = min(int(cfg["batch-size"]), len(y))
    lr = np.float32(cfg["lr"])
    rng = np.random.default_rng([SEED, k, int(msg.content["config"].get("server-round", 0))])
    loss = float("nan")
    for _ in range(int(cfg["local-steps"])):
        at = rng.permutation(len(y))[:bs]
        xb, yb, rows = x[at], y[at], np.arange(bs)
        z = xb @ w.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-np.log(p[rows, yb]).mean())
        p[rows, yb] -= 1.0
        p /= bs
        w, b = w - lr * (p.T @ xb), b - lr * p.sum(axis=0)
    return Message(content=RecordDict({"arrays": ArrayRecord([w.astype(np.float32), b.astype(np.float32)]),
                                       "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)})}),
                   reply_to=msg)
'''

SCALE_SERVER = '''\
"""FedAvg sampling `sampled` of `num-clients` nodes a round, no evaluation (fedhop's scale run
has eval_every = 0): a round is configure_train .. aggregate_train and the (empty) evaluate phase."""
import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedhopbench.task import P
from fedhopbench.timing import TimedFedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n, s = int(cfg["num-clients"]), int(cfg["sampled"])
    # fraction s/n gives int(n * s/n) <= s nodes; min_train_nodes makes it exactly s
    strategy = TimedFedAvg(str(cfg["timing-file"]), fraction_train=s / n, min_train_nodes=s,
                           fraction_evaluate=0.0, min_available_nodes=n)

    def round_end(rnd, arrays):
        if rnd > 0:
            strategy.stamp("round_end", rnd)
        return None

    initial = ArrayRecord([np.zeros((P.classes, P.dim), np.float32), np.zeros(P.classes, np.float32)])
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(cfg["num-server-rounds"]),
                   evaluate_fn=round_end)
'''


def scale_app_modules(data_params: dict[str, Any], seed: int, count: int) -> dict[str, str]:
    """The scale app's modules.  Its task module is fedhop's own generator -- the source of
    common/util/rng.py's stream and common/tasks/crossdevice.py's client sizes and Synthetic(alpha,
    beta) devices, copied in -- so each Flower client holds, bit for bit, the samples of the
    fedhop client with the same id."""
    import inspect

    from fedhop.common.tasks import crossdevice
    from fedhop.common.util import rng

    head = ('"""Cross-device clients made as fedhop makes them (source copied from fedhop)."""\n'
            "from __future__ import annotations\n\nimport functools\nimport zlib\nfrom types import SimpleNamespace\n\n"
            "import numpy as np\n\n\n")
    body = "\n\n".join(inspect.getsource(f) for f in (rng._seed_sequence, rng.numpy_stream, crossdevice.client_sizes,
                                                     crossdevice.SyntheticDevices))
    task = head + body + SCALE_TASK_TAIL.format(params=data_params, seed=seed, count=count)
    return {"task": task, "client_app": SCALE_CLIENT, "server_app": SCALE_SERVER}


class ProcessMemory:
    """Peak RSS and USS (MB) of every process carrying a benchmark's token, each process's peak
    kept apart; the run's figure is their sum, as `bench scale` sums fedhop's processes."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.rss: dict[int, float] = {}
        self.uss: dict[int, float] = {}

    def sample(self) -> float:
        """Read every live process once; the total RSS now (MB)."""
        import psutil

        now = 0.0
        for pid in _pids_with_token(self.token):
            try:
                info = psutil.Process(pid).memory_full_info()
            except psutil.Error:
                continue
            now += info.rss / 1e6
            self.rss[pid] = max(self.rss.get(pid, 0.0), info.rss / 1e6)
            self.uss[pid] = max(self.uss.get(pid, 0.0), info.uss / 1e6)
        return now

    def figures(self) -> dict[str, Any]:
        return {"total_rss_mb": sum(self.rss.values()), "total_uss_mb": sum(self.uss.values()),
                "processes_seen": len(self.rss)}


def run_flower_scale(flwr_python: str, count: int, sampled: int, rounds: int, *, lr: float, batch_size: int,
                     local_steps: int, seed: int, data_params: dict[str, Any], timeout: float, max_rss_mb: float,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """One Flower simulation of the cross-device round: `count` simulated SuperNodes (one ClientApp
    actor per CPU), `sampled` trained a round, `rounds` rounds.  Never raises for Flower's sake: a
    run that fails, passes `timeout` seconds or `max_rss_mb` of RSS over its processes (then
    stopped) comes back with ok False, the reason and what it reached (rounds completed, memory)."""
    out: dict[str, Any] = {"system": "Flower", "clients": count, "per_round": sampled, "rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="flwr-scale-") as tmp:
        bench = FlowerBench(flwr_python, Path(tmp), log)
        memory = ProcessMemory(bench.token)
        timing = bench.work / "timing-scale.jsonl"

        def watch() -> str | None:
            rss = memory.sample()
            if rss > max_rss_mb:
                return f"was stopped at {rss / 1e3:.1f} GB RSS (limit {max_rss_mb / 1e3:.1f} GB)"
            return None

        launched = time.time()
        try:
            out["versions"] = bench.version()
            app = write_app(bench.work, scale_app_modules(data_params, seed, count), SCALE_APP_CONFIG)
            bench.write_connections(supernodes=count, actor_cpus=1)
            run_config = (f"num-server-rounds={rounds} num-clients={count} sampled={sampled} lr={lr} "
                          f"batch-size={batch_size} local-steps={local_steps} seed={seed} "
                          f'timing-file="{timing}"')
            launched = time.time()
            out["run_wall_s"] = bench.run_app(app, "local", "scale", run_config, timeout, watch)
            out.update(parse_timing(timing, rounds), ok=True)
        except (RuntimeError, OSError) as exc:
            out.update(ok=False, reason=str(exc).strip().splitlines()[0].split("; see ")[0], detail=str(exc)[-1500:])
        finally:
            stamps, replies = read_stamps(timing)
            done = [r for r in range(1, rounds + 1) if ("round_end", r) in stamps]
            out["rounds_completed"] = len(done)
            if not out.get("ok") and done:   # what a stopped run reached: its completed rounds
                out["per_round_s"] = [stamps[("round_end", r)] - stamps[("round_start", r)] for r in done]
                out["train_replies"] = [replies.get(r) for r in done]
                out.update(_summary(out["per_round_s"]))
            first = stamps.get(("round_start", 1))
            out["start_to_first_round_s"] = first - launched if first else None   # Ray, nodes, ServerApp start
            bench.close()
            out["left_alive"] = _pids_with_token(bench.token)
        out.update(memory.figures())
    return out


# ----------------------------------------------------------------------------- report
def table(fedhop: dict[str, Any], flower: list[dict[str, Any]]) -> str:
    base = fedhop["median_s"]
    lines = ["| system | mode | round includes | rounds | round median (s) | min | max | train phase | "
             "federated-eval phase | Flower / fedhop |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| fedhop | {fedhop['mode']} | train + aggregate + server eval | {fedhop['rounds']} | "
             f"{base:.4f} | {fedhop['min_s']:.4f} | {fedhop['max_s']:.4f} | | | 1 |"]
    for r in flower:
        includes = ("train + aggregate + federated eval + server eval" if r["fraction_evaluate"]
                    else "train + aggregate + server eval")
        lines.append(f"| Flower | {r['mode']} | {includes} (fraction_evaluate={r['fraction_evaluate']:g}) | "
                     f"{r['rounds']} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['max_s']:.4f} | "
                     f"{r['train_phase_median_s']:.4f} | {r['evaluate_phase_median_s']:.4f} | "
                     f"{r['median_s'] / base:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedhop bench flower", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--params", type=int, default=1000, help="model size (one float32 vector)")
    ap.add_argument("--fedhop-processes", type=int, default=CLIENTS, help="fedhop client processes")
    ap.add_argument("--no-batch", action="store_true", help="fedhop with transport.batch = false (one call per "
                                                            "client, not one per client process and round)")
    ap.add_argument("--flwr-python", default=None, help="python of a venv with flwr[simulation] "
                                                        "(default: $FEDHOP_FLWR_PYTHON)")
    ap.add_argument("--modes", default="deployment,simulation", help="Flower modes, comma-separated")
    ap.add_argument("--evaluate", default="1,0", help="Flower fraction_evaluate values, comma-separated")
    ap.add_argument("--no-flower", action="store_true", help="fedhop half only")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", help="a new directory to keep Flower's app, FLWR_HOME and logs in")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 1 is a warm-up and left out of the medians)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(modes) - {"deployment", "simulation"}
    if bad:
        ap.error(f"--modes: unknown {sorted(bad)}; allowed: deployment, simulation")
    evals = [float(x) for x in args.evaluate.split(",")]
    from fedhop.common.util.cliparser import figures_file_problem, folder_problem
    problem = (figures_file_problem(args.json)
               or (folder_problem(args.keep, "--keep") if args.keep else None)
               or (f"--keep {args.keep}: there already; name a new folder" if args.keep and Path(args.keep).exists()
                   else None))
    if problem:
        ap.error(problem)

    print(f"fedhop: FedAvg, {CLIENTS} clients, {args.params} parameters, {args.rounds} rounds ...", flush=True)
    fedhop = run_fedhop(args.rounds, args.params, args.fedhop_processes, not args.no_batch)
    figures: dict[str, Any] = {"clients": CLIENTS, "params": args.params, "rounds": args.rounds,
                               "fedhop": fedhop, "flower": [], "python": sys.version.split()[0]}
    flwr_python = None if args.no_flower else find_flwr_python(args.flwr_python)
    if not args.no_flower and flwr_python is None:
        figures["flower_skipped"] = ("no Flower python: pass --flwr-python or set FEDHOP_FLWR_PYTHON to the python "
                                     "of a venv with flwr[simulation] installed")
        print(figures["flower_skipped"], file=sys.stderr)
    if flwr_python:
        print(f"Flower ({flwr_python}): {', '.join(modes)}, fraction_evaluate {args.evaluate} ...", flush=True)
        figures["flower"], info = run_flower(flwr_python, args.rounds, args.params, modes, evals,
                                                   keep=args.keep)
        figures["flower_info"] = info
        for r in figures["flower"]:
            r["ratio_to_fedhop"] = r["median_s"] / fedhop["median_s"]
    print()
    print(table(fedhop, figures["flower"]))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
