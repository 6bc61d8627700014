"""`fedhop bench large`: one FedAvg round with a large synthetic model over real processes.

    fedhop bench large [--sizes 10,100] [--clients 2,4] [--processes N] [--repeats 3]
                       [--json FILE] [--max-memory-gb GB] [--no-transfer]

For each model size (MB of float32 parameters) and client count, one round of FedAvg (one
local gradient step per client) runs as `fedhop run` runs it: a server process and one client
process per client (or `--processes` client processes, the clients spread over them, so that
many clients of a large model fit a small machine: the server's side of the round is the
same), gRPC on loopback.  The bench samples every process's
/proc/PID/stat and /proc/PID/status while the run goes and reports, for the round's window
(from the start of the server's first `train` call, as its ledger records date it, for the
round's wall time):

- the round's wall time (run.db `rounds.wall_seconds`);
- the peak resident memory (VmHWM) of the server and of one client process at the round's end;
- CPU seconds per GB moved on each end: the server's CPU over the bytes it sent and received
  (2 x clients x model), a client process's over its clients' 2 x model each;
- the bytes the ledger counted on the client-server link, against the formula
  (tensor bytes = clients x model each way).

Beside it, in the same run and for each size, one model moved between two processes by
fedhop's endpoint (encode, stream, decode, ledger: `FedhopTransfer`) and by bare grpcio moving the
same bytes in the same call shape (`BareTransfer`): its chunks cut before the call ("bare",
`bench transport`'s baseline) and cut from the array during the call ("cut": grpcio takes only
`bytes`, so any sender of a fresh tensor makes that copy), with each end's CPU per GB.  The
three take turns call by call (deploy/bench/bench.py `paired`), so a change in the machine's load
during the run falls on all of them alike.

A cell whose estimated memory does not fit in this machine's available memory (or
`--max-memory-gb`) is skipped, saying why; a cell whose run fails is reported and the next one
runs.  The estimate is generous: a client process holds the received model, its local copy, a
gradient and its update (CLIENT_MODELS x model, with room to spare), and one more model for each
further client it hosts (an update waits until the server reads it); the server its model, the
accumulator and what it receives (SERVER_MODELS x model, with room to spare: the round is
streamed, so this does not grow with the clients); and each Python process with torch about
BASE_MB.

The model is a plug-in task of this module (`synthetic`: a vector w with client i's loss
1/2 ||w||^2 - t_i sum(w), t_i = i + 1), so one step from w = 0 with step size lr gives
w = lr t_i, and FedAvg's aggregate is lr x mean(t_i) in every coordinate (checked).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from fedhop.common.tasks.base import ClientData, Task
from fedhop.common.topologies.plan import plan_processes
from fedhop.common.util.cliparser import ArgumentParser, figures_file_problem, folder_problem

MB = 1_000_000
GB = 1_000_000_000
BASE_MB = 400          # a Python process with torch and grpcio, before any model
CLIENT_MODELS = 6      # model-sized buffers a client process of one client may hold at once (module docstring)
SERVER_MODELS = 5      # and the server, however many clients
LR = 0.5


# ----------------------------------------------------------------------------- the synthetic task
@dataclass
class SyntheticParams:
    """[data] keys of the bench's synthetic task.

    `mb`: model size in MB (float32 parameters, one tensor `w`)
    """

    mb: float = field(default=1.0, metadata={"min_exclusive": 0.0})


class _Vector(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        return self.w


class _Objective(torch.autograd.Function):
    """f(w) = 1/2 ||w||^2 - t sum(w), whose gradient w - t is made in one tensor.  Autograd's own
    backward of `dot` and `sum` makes three model-sized temporaries; a real model's cost there is
    its activations, which this task has none of, so a client's peak shows what the framework
    holds.  The gradient is w - t correctly rounded (autograd's own adds 1/2 w, 1/2 w and -t in
    its own order, which may differ in the last bit; from w = 0, the bench's one step, the two
    are equal)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, t)
        return 0.5 * torch.dot(w, w) - t * w.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        w, t = ctx.saved_tensors
        g = torch.sub(w, t)
        return (g if bool(grad == 1) else g.mul_(grad)), None


class SyntheticTask(Task):
    """f_i(w) = 1/2 ||w||^2 - t_i sum(w), t_i = i + 1: gradient w - t_i, no model-sized data."""

    kind = "quadratic"

    def __init__(self, num_clients: int, mb: float) -> None:
        self._n = int(num_clients)
        self.params = max(1, int(mb * MB) // 4)

    @property
    def num_clients(self) -> int:
        return self._n

    def build_model(self) -> torch.nn.Module:
        return _Vector(self.params)

    def client_data(self, client_id: int) -> ClientData:
        return ClientData(tensors=(torch.tensor([[float(client_id + 1)]]),), num_samples=1)

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             generator: torch.Generator | None = None) -> torch.Tensor:
        w, t = model.get_parameter("w"), batch[0].reshape(-1)[0]
        return _Objective.apply(w, t)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return {"objective": self.train_loss(model)}

    def train_loss(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            w = model.get_parameter("w").detach()
            mean_t = (self._n + 1) / 2
            return float(0.5 * torch.dot(w, w) - mean_t * w.sum())


def synthetic(request) -> Task:
    """The data-set plug-in (`data.dataset = "fedhop.deploy.bench.bench_large:synthetic"`)."""
    return SyntheticTask(request.num_clients, request.params.mb)


setattr(synthetic, "Params", SyntheticParams)   # the plug-in's [data] keys (common/util/plugins.py)

ROUND_CONFIG = """
[run]
name = "bench-large"
rounds = 1
eval_every = 0
round_timeout = {timeout}
call_timeout = {timeout}
torch_threads = 1
[algorithm]
name = "fedavg"
lr = {lr}
local_steps = 1
batch_size = 0
[data]
dataset = "fedhop.deploy.bench.bench_large:synthetic"
mb = {mb}
[model]
[clients]
count = {clients}
per_round = {clients}
processes = {processes}
"""


# ----------------------------------------------------------------------------- sampling /proc
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_sample(pid: int) -> tuple[float, int, int] | None:
    """(CPU seconds, VmHWM bytes, VmRSS bytes) of `pid` now, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/status", "rb") as fh:
            status = fh.read().decode()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    cpu = (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime (fields 14 and 15 of stat)
    kib = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
           if line.startswith(("VmHWM:", "VmRSS:"))}
    if "VmHWM" not in kib:   # a zombie: no memory left to read
        return None
    return cpu, kib["VmHWM"] * 1024, kib["VmRSS"] * 1024


class Sampler(threading.Thread):
    """Samples the run's processes every `period` seconds: {name: [(time.time(), cpu, hwm, rss)]}."""

    def __init__(self, local_run, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.local_run, self.period = local_run, period
        self.samples: dict[str, list[tuple[float, float, int, int]]] = {}
        self.done = threading.Event()

    def run_once(self) -> None:
        for child in list(self.local_run.children):
            s = _proc_sample(child.proc.pid)
            if s is not None:
                self.samples.setdefault(child.name, []).append((time.time(), *s))

    def run(self) -> None:   # noqa: D401 - threading's entry point
        while not self.done.is_set():
            self.run_once()
            self.done.wait(self.period)

    def window(self, name: str, start: float, end: float) -> dict:
        """CPU seconds of `name` between the last sample at or before `start` and the first at or
        after `end` (its last sample if it ended sooner), and its VmHWM at that end sample."""
        rows = self.samples.get(name, [])
        if not rows:
            return {"cpu_s": float("nan"), "peak_rss_bytes": 0}
        before = [r for r in rows if r[0] <= start] or rows[:1]
        after = [r for r in rows if r[0] >= end] or rows[-1:]
        a, b = before[-1], after[0]
        return {"cpu_s": b[1] - a[1], "peak_rss_bytes": b[2], "rss_at_start_bytes": a[3]}


# ----------------------------------------------------------------------------- one round
def estimate_bytes(size_mb: float, clients: int, processes: int | None = None) -> int:
    """Generous memory estimate of one cell (module docstring); `processes` client processes
    (default: one per client)."""
    model = size_mb * MB
    processes = min(processes or clients, clients)
    server = BASE_MB * MB + SERVER_MODELS * model
    return int(server + processes * (BASE_MB * MB + CLIENT_MODELS * model) + (clients - processes) * model)


PATIENCE = 900.0   # seconds a cell's processes may take to start and register (a loaded 2-core machine)


def _patient_run(cfg, run_dir: Path):
    """`fedhop run`'s launcher, waiting up to PATIENCE for the server to serve and for every
    client process to register: nine processes importing torch at once on two busy cores can
    take longer than the launcher's own two minutes."""
    from fedhop.deploy.launch.launcher import LocalRun

    class PatientRun(LocalRun):
        def spawn(self, name: str, argv: list[str]):
            if name == "server":
                argv = [*argv, "--register-timeout", str(PATIENCE)]
            return super().spawn(name, argv)

        @staticmethod
        def _wait_for_address(server, port_file: Path, timeout: float = PATIENCE) -> str:
            return LocalRun._wait_for_address(server, port_file, PATIENCE)

    return PatientRun(cfg, run_dir)


def _round_window(store, wall_seconds: float) -> tuple[float, float]:
    """(start, end) of the round in time.time(): the server's first `train` call began when its
    sender record was written (after the reply) less the call's send and reply seconds; the
    round lasted `wall_seconds` (run.db) from about then."""
    msgs = [m for m in store.messages() if m["recorder"] == "server" and m["method"] in ("train", "train.reply")]
    replies = {m["msg_id"]: m for m in msgs if m["role"] == "receiver"}
    starts = [m["wall_time"] - m["seconds"] - replies.get(m["msg_id"] + ".reply", {}).get("seconds", 0.0)
              for m in msgs if m["role"] == "sender"]
    if not starts:
        raise RuntimeError("the round's run.db holds no train call of the server")
    start = min(starts)
    return start, start + wall_seconds


def round_cell(size_mb: float, clients: int, workdir: Path, processes: int | None = None) -> dict:
    """One FedAvg round of a `size_mb` model with `clients` clients on `processes` client
    processes (default: one per client; module docstring)."""
    from safetensors.torch import load_file

    from fedhop.common.config import parse_config
    from fedhop.common.records.runstore import RunStore

    timeout = max(120.0, 4 * clients * size_mb / 10)   # seconds; generous at 10 MB/s per byte moved
    processes = min(processes or clients, clients)
    cfg = parse_config(ROUND_CONFIG.format(mb=size_mb, clients=clients, processes=processes, lr=LR, timeout=timeout))
    run_dir = workdir / f"round-{size_mb:g}mb-{clients}c-{processes}p"
    run = _patient_run(cfg, run_dir.resolve())
    sampler = Sampler(run)
    sampler.start()
    try:
        server = run.start([])
        server.proc.wait()
    finally:
        sampler.done.set()
        sampler.join()
        run.stop_all()
    if server.proc.returncode != 0:
        raise RuntimeError(f"the {size_mb:g} MB x {clients} clients round failed; see {run_dir}/logs")
    store = RunStore(run_dir / "run.db", create=False)
    (row,) = store.rounds()
    # the round's window: it ended when the server noted its `round` event, wall_seconds before
    start, end = _round_window(store, float(row["wall_seconds"]))
    model_bytes = SyntheticTask(clients, size_mb).params * 4
    links = store.bytes_by_link_direction().get("client-server", {})
    down, up = links.get("down", {}), links.get("up", {})
    srv = sampler.window("server", start, end)
    first = next(c.name for c in run.children if c.name.startswith("client"))
    cli = sampler.window(first, start, end)
    hosted = len(next(p.clients for p in plan_processes(cfg).processes if p.node_id == first))
    final = load_file(str(run_dir / "model.safetensors"))["w"]
    expect = LR * (clients + 1) / 2   # FedAvg of lr * t_i, t_i = 1..clients, equal weights
    moved_server = down.get("tensor_bytes", 0) + up.get("tensor_bytes", 0)
    moved_client = 2 * model_bytes * hosted   # the sampled client process's logical clients
    return {"size_mb": size_mb, "clients": clients, "processes": processes, "model_bytes": model_bytes,
            "round_seconds": float(row["wall_seconds"]),
            "server_peak_rss_bytes": srv["peak_rss_bytes"], "client_peak_rss_bytes": cli["peak_rss_bytes"],
            "server_rss_at_start_bytes": srv.get("rss_at_start_bytes", 0),
            "client_rss_at_start_bytes": cli.get("rss_at_start_bytes", 0),
            "server_cpu_s": srv["cpu_s"], "client_cpu_s": cli["cpu_s"],
            "server_cpu_s_per_gb": srv["cpu_s"] / (moved_server / GB) if moved_server else float("nan"),
            "client_cpu_s_per_gb": cli["cpu_s"] / (moved_client / GB),
            "down": down, "up": up,
            "model_exact": bool(torch.all(final == torch.tensor(expect, dtype=final.dtype)))}


# ----------------------------------------------------------------------------- transfer
def transfer_row(size_mb: float, repeats: int, chunk: int) -> dict:
    """fedhop's endpoint and bare grpcio moving one model, taking turns in one run (`paired`):
    medians and CPU per GB."""
    from fedhop.deploy.bench.bench import BareTransfer, FedhopTransfer, paired

    nbytes = int(size_mb * MB) // 4 * 4
    fedhop = FedhopTransfer(nbytes, chunk)
    rows = paired([fedhop, BareTransfer(nbytes, chunk), BareTransfer(nbytes, chunk, cut_in_call=True)], repeats)
    framed = fedhop.framed_bytes()
    (fed_times, fed_cpu), (bare_times, bare_cpu), (cut_times, cut_cpu) = (
        (rows[name]["times"], rows[name]) for name in ("fedhop", "bare", "cut"))
    g, b, c = statistics.median(fed_times), statistics.median(bare_times), statistics.median(cut_times)
    per_gb = GB / nbytes
    return {"size_mb": size_mb, "bytes": nbytes, "framed_bytes": framed,
            "grpc_mb_s": nbytes / g / MB, "bare_mb_s": nbytes / b / MB, "grpc_over_bare": b / g,
            "bare_cut_mb_s": nbytes / c / MB, "grpc_over_bare_cut": c / g,
            "bare_cut_sender_cpu_s_per_gb": cut_cpu["sender_cpu_s"] * per_gb,
            "bare_cut_receiver_cpu_s_per_gb": cut_cpu["receiver_cpu_s"] * per_gb,
            "sender_cpu_ratio_cut": _ratio(fed_cpu["sender_cpu_s"], cut_cpu["sender_cpu_s"]),
            "grpc_sender_cpu_s_per_gb": fed_cpu["sender_cpu_s"] * per_gb,
            "bare_sender_cpu_s_per_gb": bare_cpu["sender_cpu_s"] * per_gb,
            "grpc_receiver_cpu_s_per_gb": fed_cpu["receiver_cpu_s"] * per_gb,
            "bare_receiver_cpu_s_per_gb": bare_cpu["receiver_cpu_s"] * per_gb,
            "sender_cpu_ratio": _ratio(fed_cpu["sender_cpu_s"], bare_cpu["sender_cpu_s"]),
            "receiver_cpu_ratio": _ratio(fed_cpu["receiver_cpu_s"], bare_cpu["receiver_cpu_s"])}


def _ratio(a: float, b: float) -> float:
    """a / b; NaN where b is 0 (a tiny transfer's CPU below the clock tick, 10 ms)."""
    return a / b if b > 0 else float("nan")


# ----------------------------------------------------------------------------- command line
def _numbers(text: str, flag: str, kind=float) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        print(f"fedhop bench large: {flag} {text!r}: expected positive {kind.__name__}s, comma-separated",
              file=sys.stderr)
        raise SystemExit(2)
    return values


def _mb(n: float) -> str:
    return f"{n / MB:,.0f}"


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="fedhop bench large", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,100", help="model sizes in MB, comma-separated (e.g. 100,500,1000)")
    ap.add_argument("--clients", default="2,4", help="clients per round, comma-separated (e.g. 2,4,8)")
    ap.add_argument("--processes", type=int, default=None,
                    help="client processes per round, the clients spread over them (default: one per client)")
    ap.add_argument("--repeats", type=int, default=3, help="timed transfers per size (after one warm-up)")
    ap.add_argument("--chunk", type=int, default=4 << 20, help="frame size of the transfers")
    ap.add_argument("--max-memory-gb", type=float, default=None,
                    help="memory a cell may need (default: what this machine has available now)")
    ap.add_argument("--no-transfer", action="store_true", help="only the rounds")
    ap.add_argument("--no-rounds", action="store_true", help="only the transfers")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", help="keep the rounds' run directories (config, run.db, logs) in this folder")
    args = ap.parse_args(argv)
    sizes = _numbers(args.sizes, "--sizes")
    counts = _numbers(args.clients, "--clients", int)
    if args.repeats < 1:
        print("fedhop bench large: --repeats must be >= 1", file=sys.stderr)
        return 2
    problem = figures_file_problem(args.json) or (folder_problem(args.keep, "--keep") if args.keep else None)
    if problem:
        print(f"fedhop bench large: {problem}", file=sys.stderr)
        return 2
    if args.processes is not None and args.processes < 1:
        print("fedhop bench large: --processes must be >= 1", file=sys.stderr)
        return 2
    if args.chunk < 1:
        print(f"fedhop bench large: --chunk {args.chunk}: at least 1 byte", file=sys.stderr)
        return 2
    if args.max_memory_gb is not None and not args.max_memory_gb > 0:   # not NaN either
        print(f"fedhop bench large: --max-memory-gb {args.max_memory_gb}: must be above 0", file=sys.stderr)
        return 2
    out: dict = {"recv_buffers": os.environ.get("FEDHOP_RECV_BUFFERS", "2"),
                 "file_buffers": os.environ.get("FEDHOP_FILE_BUFFERS", "1"), "sizes_mb": sizes, "clients": counts, "rounds": [], "skipped": [], "failed": [],
                 "transfers": []}
    budget = (args.max_memory_gb * GB if args.max_memory_gb is not None
              else psutil.virtual_memory().available)
    if not args.no_rounds:
        print(f"{'model':>8} {'clients':>7} {'procs':>5} {'round s':>8} {'server peak RSS MB':>19} {'client peak RSS MB':>19} "
              f"{'server CPU s/GB':>16} {'client CPU s/GB':>16} {'tensor MB down/up':>18}", flush=True)
        with tempfile.TemporaryDirectory(prefix="fedhop-bench-large-") as tmp:
            if args.keep:
                tmp = args.keep
                Path(tmp).mkdir(parents=True, exist_ok=True)
            for size in sizes:
                for n in counts:
                    need = estimate_bytes(size, n, args.processes)
                    if need > budget:
                        why = (f"needs about {need / GB:.1f} GB (estimate), {budget / GB:.1f} GB available")
                        out["skipped"].append({"size_mb": size, "clients": n, "reason": why})
                        print(f"{size:>6g}MB {n:>7} skipped: {why}", flush=True)
                        continue
                    try:
                        row = round_cell(size, n, Path(tmp), args.processes)
                    except RuntimeError as exc:   # a run that failed (or did not start): the next cell still runs
                        out["failed"].append({"size_mb": size, "clients": n, "error": str(exc)})
                        print(f"{size:>6g}MB {n:>7} failed: {exc}", flush=True)
                        continue
                    out["rounds"].append(row)
                    print(f"{size:>6g}MB {n:>7} {row['processes']:>5} {row['round_seconds']:>8.2f} {_mb(row['server_peak_rss_bytes']):>19} "
                          f"{_mb(row['client_peak_rss_bytes']):>19} {row['server_cpu_s_per_gb']:>16.2f} "
                          f"{row['client_cpu_s_per_gb']:>16.2f} "
                          f"{_mb(row['down'].get('tensor_bytes', 0)) + '/' + _mb(row['up'].get('tensor_bytes', 0)):>18}",
                          flush=True)
    if not args.no_transfer:
        print(f"\none model between two processes, median of {args.repeats} taking turns: fedhop gRPC against bare grpcio with "
              f"its chunks cut before the call (bare) and cut from the array during it (cut); CPU s/GB fedhop / bare / cut")
        print(f"{'model':>8} {'gRPC MB/s':>10} {'bare MB/s':>10} {'gRPC/bare':>10} {'cut MB/s':>9} {'gRPC/cut':>9} "
              f"{'sender CPU s/GB':>22} {'receiver CPU s/GB':>22}", flush=True)
        for size in sizes:
            need = 4 * size * MB + 2 * BASE_MB * MB   # sender: model and frames; receiver: buffer and grpcio's bytes
            if need > budget:
                why = f"needs about {need / GB:.1f} GB, {budget / GB:.1f} GB available"
                out["skipped"].append({"size_mb": size, "transfer": True, "reason": why})
                print(f"{size:>6g}MB skipped: {why}", flush=True)
                continue
            row = transfer_row(size, args.repeats, args.chunk)
            out["transfers"].append(row)
            print(f"{size:>6g}MB {row['grpc_mb_s']:>10.0f} {row['bare_mb_s']:>10.0f} {row['grpc_over_bare']:>10.2f} "
                  f"{row['bare_cut_mb_s']:>9.0f} {row['grpc_over_bare_cut']:>9.2f} "
                  f"{row['grpc_sender_cpu_s_per_gb']:>6.2f} / {row['bare_sender_cpu_s_per_gb']:.2f} / "
                  f"{row['bare_cut_sender_cpu_s_per_gb']:<5.2f} "
                  f"{row['grpc_receiver_cpu_s_per_gb']:>6.2f} / {row['bare_receiver_cpu_s_per_gb']:.2f} / "
                  f"{row['bare_cut_receiver_cpu_s_per_gb']:<5.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
