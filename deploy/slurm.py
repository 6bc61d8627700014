"""`fedhop slurm CONFIG.toml`: one run as one Slurm batch job (docs/deployment.md, "Slurm").

The job's steps are the processes of the config's process plan (common/topologies/plan.py), the same plan
`fedhop run`, `fedhop launch` and compose follow: the server, then each edge and client process,
each an `srun --nodes=1 --ntasks=1 --overlap` step placed on one node of the allocation (the
server on the first, the others round-robin over all of them).  Separate steps rather than a
heterogeneous job: every Slurm site allows steps, while heterogeneous jobs need site support, and
steps let each process have its own command line, log (RUN/logs/NODE.log) and exit status.

The batch script runs `python -m fedhop.deploy.slurm _supervise RUN` on the first node, which
starts the steps and decides the job's exit status, the run's:

- the server's exit status (0: the run completed), or
- an edge's or client's non-zero status when it fails before every client registered (the run
  could not start: every step is stopped at once rather than waiting out the server's
  registration timeout); later failures are the server's to handle (dropouts, faults).

Nothing secret is on a command line: RUN/.token (the run's shared token) and RUN/config.toml are
files of mode 0600 in the run directory, which must be on a filesystem every node sees (the
default runs/NAME-TIMESTAMP under the submitting folder); each step's `_task` reads the token and
puts it into its process's environment.  With `security.certs_dir` set, each process gets its own
folder RUN/creds/NODE (0700) holding only ca.pem, NODE.pem, NODE.key and its own credential
NODE.cred: no task is handed the CA key, the issuer key or another node's files.

GPUs go through Slurm's own options: `--gpus-per-node N` asks `#SBATCH --gpus-per-node=N` (Slurm's
gres "gpu", N on every node of the allocation).  Which process computes where is the config's
device keys (`run.device`, `edges.device`, `clients.device`, `clients.gpus`,
`clients.processes_per_gpu`) applied per node with N as the node's GPU count: the client processes
placed on one node go round-robin over its GPUs, as `fedhop run` does on one machine
(`slurm_devices`).  Each process is given its device (`--device cuda:K`, K an index into the
step's CUDA_VISIBLE_DEVICES); a step that computes on a GPU is started with `--gres=gpu:N`
(the node's GPUs, shared with the other steps through `--overlap`, so several processes can use
one GPU), a CPU step with `--gres=none` (it holds no GPU).  A device key asking for CUDA without
`--gpus-per-node` is refused before anything is written (exit 2).

`fedhop sweep SPEC --slurm` submits a sweep's runs as one job array (`SlurmArrayRunner`): array
task i runs `fedhop run` of run i on one node, at most `sweep.parallel` at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SLURM_DIR = "slurm"        # RUN/slurm: the batch script, the task list, the job's output and exit record
TOKEN_FILE = ".token"
GRACE_S = 30.0             # after the server ends: how long the others have to exit on their own


class SlurmError(Exception):
    """A bad flag, config or environment: one line, exit 2."""


@dataclass
class SlurmOptions:
    """What the batch job asks of Slurm."""

    partition: str = ""
    nodes: int = 1
    gpus_per_node: int = 0
    time: str = ""
    account: str = ""
    cpus_per_task: int = 1
    overcommit: bool = False
    extra: list[str] = field(default_factory=list)   # more `sbatch` options, verbatim
    python: str = sys.executable                     # the interpreter every node runs (same path everywhere)

    def directives(self, ntasks: int) -> list[str]:
        out = [f"--nodes={self.nodes}", f"--ntasks={ntasks}", f"--cpus-per-task={self.cpus_per_task}"]
        out += [f"--partition={self.partition}"] if self.partition else []
        out += [f"--time={self.time}"] if self.time else []
        out += [f"--account={self.account}"] if self.account else []
        out += [f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node else []
        out += ["--overcommit"] if self.overcommit else []
        return out + list(self.extra)


def _write_private(path: Path, text: str | bytes) -> None:
    """Write a file of mode 0600 (created so, never readable by others in between)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(text.encode() if isinstance(text, str) else text)


def _check_path(path: Path, what: str) -> None:
    if any(ch.isspace() for ch in str(path)):
        raise SlurmError(f"{what} {str(path)!r} contains white space, which #SBATCH lines cannot carry")


# ----------------------------------------------------------------------------- preparing a run
def task_list(cfg, run_dir: Path, nodes: int, creds: bool) -> list[dict]:
    """One entry per process of the plan: node id, kind, the index of the allocation's node it runs
    on, and its `python -m fedhop.ARGV` with "{host}" where the node's host name goes."""
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.common.util.nodeids import id_spec
    run = str(run_dir)
    sec = cfg.security
    mm = str(cfg.transport.max_message_bytes)
    window = ["--window-bytes", str(cfg.transport.window_bytes)]
    tasks = []
    for i, proc in enumerate(plan_processes(cfg).processes):
        security = [] if proc.kind == "server" else (
            (["--certs-dir", f"{run}/creds/{proc.node_id}"] if creds else [])
            + (["--mtls"] if sec.mtls else []) + (["--insecure"] if sec.insecure else []))
        addr = f"{run}/{proc.node_id}.address"
        if proc.kind == "server":
            argv = ["server", "--config", f"{run}/config.toml", "--run-dir", run, "--listen", "{host}:0",
                    "--port-file", addr]
        elif proc.kind == "edge":
            argv = ["edge", "--parent-file", f"{run}/{proc.parent}.address", "--node-id", proc.node_id,
                    "--listen", "{host}:0", "--port-file", addr, "--ledger-dir", f"{run}/ledger",
                    "--max-message-bytes", mm] + window + security
        else:
            argv = ["client", "--parent-file", f"{run}/{proc.parent}.address", "--clients", id_spec(proc.clients),
                    "--node-id", proc.node_id, "--listen", "{host}:0", "--ledger-dir", f"{run}/ledger",
                    "--max-message-bytes", mm, "--threads", str(cfg.run.torch_threads)] + window + security
        tasks.append({"node_id": proc.node_id, "kind": proc.kind, "node": 0 if i == 0 else i % nodes, "argv": argv})
    return tasks


def slurm_devices(cfg, tasks: list[dict], gpus_per_node: int) -> dict[str, str]:
    """node id -> device ("cpu" or "cuda:K") of every task: the server on run.device, edges on
    edges.device, and on each node of the allocation its client processes round-robin over that
    node's `gpus_per_node` GPUs (common/transport/torch_device.py; NCCL: one GPU per process of the node)."""
    from fedhop.common.transport.factory import own_device_per_process
    from fedhop.common.transport.torch_device import DeviceError, client_devices, nccl_devices, resolve
    out: dict[str, str] = {}
    per_node: dict[int, list[str]] = {}
    nccl = own_device_per_process(cfg.transport.kind, cfg.transport.options)
    try:
        if nccl:
            for t in tasks:
                per_node.setdefault(t["node"], []).append(t["node_id"])
            for ids in per_node.values():
                out.update(nccl_devices(ids, gpus_per_node))
            return out
        for t in tasks:
            if t["kind"] == "server":
                out[t["node_id"]] = resolve(cfg.run.device, "run.device", gpus_per_node)
            elif t["kind"] == "edge":
                out[t["node_id"]] = resolve(cfg.edges.device, "edges.device", gpus_per_node)
            else:
                per_node.setdefault(t["node"], []).append(t["node_id"])
        for ids in per_node.values():
            out.update(zip(ids, client_devices(cfg.clients.device, cfg.clients.gpus, cfg.clients.processes_per_gpu,
                                               len(ids), gpus_per_node)))
    except DeviceError as exc:
        raise SlurmError(f"{exc} [under Slurm a node's CUDA devices are the --gpus-per-node {gpus_per_node} "
                         f"it is given]") from None
    return out


def bind_devices(tasks: list[dict], devices: dict[str, str], gpus_per_node: int) -> None:
    """Each task's `--device` and the gres its srun step asks for (module docstring)."""
    if not gpus_per_node:
        return
    for t in tasks:
        device = devices[t["node_id"]]
        t["argv"] += ["--device", device]
        t["gres"] = f"gpu:{gpus_per_node}" if device.startswith("cuda") else "none"


def node_credentials(certs_dir: Path, node_ids: list[str], run_dir: Path) -> None:
    """RUN/creds/NODE for every node: ca.pem, NODE.pem, NODE.key and NODE.cred (its per-node
    credential; cluster.secret instead for a folder made before `fedhop certs` wrote them), mode
    0600 in a 0700 folder; never ca.key, issuer.key or another node's files."""
    from fedhop.common.security.auth import CA_CERT, SECRET_FILE
    from fedhop.common.security.nodecred import CRED_SUFFIX
    missing = [str(certs_dir / n) for node in node_ids for n in (CA_CERT, f"{node}.pem", f"{node}.key")
               if not (certs_dir / n).is_file()]
    if missing:
        raise SlurmError(f"security.certs_dir: missing {', '.join(sorted(set(missing))[:4])} "
                         f"(make them with `fedhop certs {certs_dir} --config CONFIG`)")
    for node in node_ids:
        d = run_dir / "creds" / node
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        token = [f"{node}{CRED_SUFFIX}"] if (certs_dir / f"{node}{CRED_SUFFIX}").is_file() else \
            [SECRET_FILE] if (certs_dir / SECRET_FILE).is_file() else []
        names = [CA_CERT, f"{node}.pem", f"{node}.key"] + token
        for name in names:
            _write_private(d / name, (certs_dir / name).read_bytes())
    (run_dir / "creds").chmod(0o700)


def batch_script(run_dir: Path, opts: SlurmOptions, ntasks: int, job_name: str, workdir: Path) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --output={run_dir}/{SLURM_DIR}/job.out",
             f"#SBATCH --chdir={workdir}"]
    lines += [f"#SBATCH {d}" for d in opts.directives(ntasks)]
    lines += [f"# fedhop: the steps of {run_dir}/{SLURM_DIR}/tasks.json (server, edges, client processes), one",
              "# `srun --nodes=1 --ntasks=1 --overlap` each; this job's exit status is the run's.",
              f"exec {shlex.quote(opts.python)} -m fedhop.deploy.slurm _supervise {shlex.quote(str(run_dir))}", ""]
    return "\n".join(lines)


def prepare_run(config: str, overrides: list[str], out: str | None, opts: SlurmOptions,
                force: bool = False) -> Path:
    """Make the run directory: config.toml and .token (0600), per-node credentials, the task list,
    the batch script.  Returns its absolute path."""
    from fedhop.common.config import ConfigError, config_to_toml, load_config
    from fedhop.common.topologies.plan import plan_processes
    try:
        cfg = load_config(config, overrides)
        plan = plan_processes(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        raise SlurmError(str(exc)) from None
    if opts.nodes < 1 or opts.cpus_per_task < 1 or opts.gpus_per_node < 0:
        raise SlurmError("--nodes and --cpus-per-task must be >= 1, --gpus-per-node >= 0")
    run_dir = Path(out or f"runs/{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}").resolve()
    _check_path(run_dir, "the run directory")
    creds = bool(cfg.security.certs_dir)
    devices = slurm_devices(cfg, task_list(cfg, run_dir, opts.nodes, creds), opts.gpus_per_node)   # before writing
    if run_dir.exists() and any(run_dir.iterdir()):
        if not force:
            raise SlurmError(f"--out {run_dir} holds an earlier run (pass --force to replace it)")
        shutil.rmtree(run_dir)
    for sub in ("logs", "ledger", SLURM_DIR):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    if creds:
        node_credentials(Path(cfg.security.certs_dir).resolve(), plan.node_ids, run_dir)
        cfg.security.certs_dir = str(run_dir / "creds" / "server")   # the server's config names its own folder
    _write_private(run_dir / "config.toml", config_to_toml(cfg))
    _write_private(run_dir / TOKEN_FILE, secrets.token_hex(16) + "\n")
    tasks = task_list(cfg, run_dir, opts.nodes, creds)
    bind_devices(tasks, devices, opts.gpus_per_node)
    (run_dir / SLURM_DIR / "tasks.json").write_text(json.dumps(tasks, indent=1))
    name = "fedhop-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in cfg.run.name)
    (run_dir / SLURM_DIR / "job.sbatch").write_text(batch_script(run_dir, opts, len(tasks), name, Path.cwd()))
    return run_dir


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`: the job id (also written beside the script, as job.id)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SlurmError("sbatch is not on PATH (is this a Slurm login node?)")
    res = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    job = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not job:
        err = res.stderr.strip().splitlines()
        raise SlurmError(f"sbatch refused the job: {err[-1] if err else 'no job id'}")
    (script.parent / "job.id").write_text(job + "\n")
    return job


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def job_state(job: str) -> tuple[str, int] | None:
    """(state, exit status) of a job from `scontrol show job`, or from `sacct` once the controller
    has forgotten it; None when neither knows it.  The status is as a shell reports it: the exit
    code, or 128 + N for a job ended by signal N."""
    res = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    if res.returncode == 0 and res.stdout.strip():
        rows = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in res.stdout.splitlines()]
        states = [r.get("JobState", "") for r in rows]
        if not all(s in TERMINAL for s in states):
            return states[0], 0
        row = next((r for r in rows if r.get("ExitCode", "0:0") != "0:0"), rows[0])
        pairs = [row.get("ExitCode", "0:0"), states[0]]
    else:
        res = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "ExitCode,State"], capture_output=True,
                             text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.strip()] if res.returncode == 0 else []
        if not lines:
            return None
        pairs = lines[0].split("|")[:2]
    code, _, sig = pairs[0].partition(":")
    status = 128 + int(sig) if sig.isdigit() and int(sig) else int(code or 0)
    return pairs[1].split()[0], status


def wait_job(job: str, poll: float = 1.0) -> int:
    """Wait for a job (all tasks of an array) to end; its exit status.  Ctrl-C cancels it."""
    unknown = 0
    try:
        while True:
            state = job_state(job)
            if state is None:
                unknown += 1
                if unknown > 30:
                    raise SlurmError(f"job {job}: neither scontrol nor sacct knows it")
            elif state[0] in TERMINAL:
                return state[1]
            time.sleep(poll)
    except KeyboardInterrupt:
        subprocess.run(["scancel", job], capture_output=True)
        print(f"fedhop slurm: interrupted; cancelled job {job}", file=sys.stderr)
        return 130


# ----------------------------------------------------------------------------- inside the job
def hostnames() -> list[str]:
    """The allocation's node names, in Slurm's order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return [socket.gethostname()]
    res = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return res.stdout.split()


def registration_done(run_dir: Path) -> bool:
    from fedhop.deploy.launcher import registration_complete
    return registration_complete(run_dir / "run.db")


def step_argv(task: dict, host: str, run_dir: Path, python: str) -> list[str]:
    """The `srun` of one task: one task on its node, sharing the allocation (`--overlap`), its
    own log, and its GPUs (`--gres`, set by bind_devices when the job has GPUs)."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", f"--job-name={task['node_id']}",
            f"--output={run_dir}/logs/{task['node_id']}.log", "--kill-on-bad-exit=1",
            *([f"--gres={task['gres']}"] if task.get("gres") else []),
            python, "-m", "fedhop.deploy.slurm", "_task", str(run_dir), task["node_id"]]


def supervise(run_dir: Path) -> int:
    """Start every task as an srun step and return the run's status (module docstring)."""
    tasks = json.loads((run_dir / SLURM_DIR / "tasks.json").read_text())
    hosts = hostnames()
    python = sys.executable
    steps: dict[str, subprocess.Popen] = {}
    record = run_dir / SLURM_DIR / "steps.log"

    def note(text: str) -> None:
        with open(record, "a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for t in tasks:
        host = hosts[t["node"] % len(hosts)]
        argv = step_argv(t, host, run_dir, python)
        note("start " + shlex.join(argv))
        steps[t["node_id"]] = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    server = steps[tasks[0]["node_id"]]
    codes: dict[str, int] = {}
    status: int | None = None
    grace_until = None
    while len(codes) < len(steps):
        for name, proc in steps.items():
            if name in codes or proc.poll() is None:
                continue
            codes[name] = proc.returncode
            note(f"exit {name} {proc.returncode}")
            if proc is server and status is None:   # 0: it shut its children down, they end on their own
                status = proc.returncode
                grace_until = time.monotonic() + (GRACE_S if status == 0 else 0.0)
            elif proc.returncode != 0 and status is None and not registration_done(run_dir):
                status = proc.returncode
                note(f"{name} failed before every client registered: stopping the run")
                _terminate(steps, codes)
        if stop["signal"] and status is None:
            status = 128 + stop["signal"]
            note(f"signal {stop['signal']}: stopping the run")
            _terminate(steps, codes)
        if grace_until is not None and time.monotonic() > grace_until:
            note("the server ended; stopping the steps still running")
            _terminate(steps, codes)
            grace_until = None
        time.sleep(0.2)
    status = 1 if status is None else status
    (run_dir / SLURM_DIR / "exit.json").write_text(json.dumps({"status": status, "steps": codes}, indent=1))
    return status if 0 <= status < 256 else 1


def _terminate(steps: dict[str, subprocess.Popen], codes: dict[str, int]) -> None:
    """SIGTERM every step still running (srun passes it to its task)."""
    for name, proc in steps.items():
        if name not in codes and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def run_task(run_dir: Path, node_id: str) -> int:
    """One step: the token from RUN/.token into the environment, "{host}" replaced by this node's
    name, then exec `python -m fedhop.ROLE ...`."""
    from fedhop.deploy.malloc import tuned_env
    tasks = {t["node_id"]: t for t in json.loads((run_dir / SLURM_DIR / "tasks.json").read_text())}
    task = tasks[node_id]
    host = os.environ.get("FEDHOP_SLURM_HOST") or socket.gethostname()
    argv = [a.replace("{host}", host) for a in task["argv"]]
    env = dict(tuned_env(), FEDHOP_TOKEN=(run_dir / TOKEN_FILE).read_text().strip(), PYTHONUNBUFFERED="1")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", f"fedhop.{argv[0]}", *argv[1:]], env)
    return 127   # not reached


# ----------------------------------------------------------------------------- sweeps as a job array
class SlurmArrayRunner:
    """A sweep runner (deploy/sweep.py `Runner`'s `run_all`/`stop`) that submits the pending runs
    as one job array: array task i runs `fedhop run` of run i on one node (its processes on that
    node, as locally), at most `parallel` at a time.  Finished runs are skipped as locally, so a
    sweep resumes the same way."""

    def __init__(self, local, opts: SlurmOptions) -> None:
        self.local = local        # the sweep's own Runner: command(), request(), finished-run checks
        self.opts = opts
        self.job: str | None = None
        self.interrupted = False

    def run_all(self, tasks: list, on_done: Callable) -> None:
        from fedhop.deploy.sweep import finished, launcher_log, request_file
        pending = [t for t in tasks if not (finished(t.run_dir) and self.local.same_request(t))]
        if not pending:
            return
        commands = []
        for t in pending:
            if t.run_dir.exists():
                shutil.rmtree(t.run_dir)
            t.run_dir.parent.mkdir(parents=True, exist_ok=True)
            request_file(t.run_dir).write_text(json.dumps(self.local.request(t), indent=2))
            commands.append({"argv": self.local.command(t), "log": str(launcher_log(t.run_dir).resolve())})
        sweep_dir = pending[0].run_dir.parents[3]   # SWEEP/runs/ALGORITHM/SETTING/seedS
        jobs = sweep_dir / SLURM_DIR
        jobs.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}"
        listing = jobs / f"array-{stamp}.json"
        listing.write_text(json.dumps(commands, indent=1))
        _check_path(listing, "the sweep directory")
        opts = SlurmOptions(**{**self.opts.__dict__, "nodes": 1})
        lines = ["#!/bin/bash", "#SBATCH --job-name=fedhop-sweep", f"#SBATCH --output={jobs}/array-{stamp}-%a.out",
                 f"#SBATCH --chdir={Path.cwd()}", f"#SBATCH --array=0-{len(commands) - 1}%{self.local.parallel}"]
        lines += [f"#SBATCH {d}" for d in opts.directives(1)]
        lines += [f"exec {shlex.quote(opts.python)} -m fedhop.deploy.slurm _array {shlex.quote(str(listing))}", ""]
        script = jobs / f"array-{stamp}.sbatch"
        script.write_text("\n".join(lines))
        try:
            self.job = submit(script)
            if wait_job(self.job, poll=2.0) == 130:
                raise KeyboardInterrupt   # Ctrl-C: the job is cancelled; the sweep says how to resume
        except SlurmError as exc:
            raise SystemExit(f"fedhop sweep --slurm: {exc}") from None
        for t in pending:
            on_done(t, 0 if finished(t.run_dir) else 1)

    def stop(self, grace: float = 20.0) -> None:
        if self.job:
            subprocess.run(["scancel", "--signal=INT", "--full", self.job], capture_output=True)
            subprocess.run(["scancel", self.job], capture_output=True)


def run_array_task(listing: Path) -> int:
    """Array task SLURM_ARRAY_TASK_ID: exec its `fedhop run`, output to the sweep's log beside the run."""
    entry = json.loads(listing.read_text())[int(os.environ["SLURM_ARRAY_TASK_ID"])]
    fd = os.open(entry["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.execv(entry["argv"][0], entry["argv"])
    return 127   # not reached


def add_slurm_args(ap: argparse.ArgumentParser, nodes: bool = False) -> None:
    """The sbatch options `fedhop slurm` (with `nodes`) and `fedhop sweep --slurm` share."""
    ap.add_argument("--partition", default="", help="Slurm partition (default: the cluster's default)")
    if nodes:   # a sweep's array task is one `fedhop run` on one node
        ap.add_argument("--nodes", type=int, default=1, help="nodes of the allocation (default 1)")
    ap.add_argument("--gpus-per-node", type=int, default=0, metavar="N", help="GPUs per node (--gpus-per-node)")
    ap.add_argument("--time", default="", help="time limit, e.g. 1:00:00")
    ap.add_argument("--account", default="", help="Slurm account to charge")
    ap.add_argument("--cpus-per-task", type=int, default=1, metavar="N", help="CPUs per process (default 1)")
    ap.add_argument("--overcommit", action="store_true",
                    help="allow more processes than CPUs (sbatch --overcommit): small runs on few cores")
    ap.add_argument("--sbatch-arg", dest="extra", action="append", default=[], metavar="OPTION",
                    help="one more sbatch option, verbatim, e.g. --sbatch-arg=--qos=short (repeatable)")


def options_from(args: argparse.Namespace) -> SlurmOptions:
    return SlurmOptions(partition=args.partition, nodes=getattr(args, "nodes", 1), gpus_per_node=args.gpus_per_node,
                        time=args.time, account=args.account, cpus_per_task=args.cpus_per_task,
                        overcommit=args.overcommit, extra=list(args.extra))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_supervise":
        return supervise(Path(argv[1]))
    if argv and argv[0] == "_task":
        return run_task(Path(argv[1]), argv[2])
    if argv and argv[0] == "_array":
        return run_array_task(Path(argv[1]))
    ap = argparse.ArgumentParser(prog="fedhop slurm", description="submit one run as a Slurm batch job whose steps "
                                 "are the server, edge and client processes (docs/deployment.md, \"Slurm\")")
    ap.add_argument("config", help="experiment TOML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key (repeatable)")
    ap.add_argument("--out", help="run directory on a filesystem every node sees (default runs/NAME-TIMESTAMP)")
    ap.add_argument("--force", action="store_true", help="with --out: replace the earlier run there")
    add_slurm_args(ap, nodes=True)
    ap.add_argument("--print", dest="print_only", action="store_true",
                    help="write the run directory and print the batch script; submit nothing")
    ap.add_argument("--wait", action="store_true", help="wait for the job and exit with the run's status")
    args = ap.parse_args(argv)
    try:
        run_dir = prepare_run(args.config, args.overrides, args.out, options_from(args), args.force)
        script = run_dir / SLURM_DIR / "job.sbatch"
        if args.print_only:
            print(script.read_text(), end="")
            print(f"# written to {script}; submit with: sbatch {script}", file=sys.stderr)
            return 0
        job = submit(script)
    except SlurmError as exc:
        print(f"fedhop slurm: {exc}", file=sys.stderr)
        return 2
    print(f"fedhop slurm: job {job}, run directory {run_dir}")
    if not args.wait:
        print(f"  follow with `squeue -j {job}`; the job's exit status is the run's (sacct -j {job})")
        return 0
    try:
        code = wait_job(job)
    except SlurmError as exc:
        print(f"fedhop slurm: {exc}", file=sys.stderr)
        return 1
    print(f"fedhop slurm: job {job} ended with status {code} (logs in {run_dir}/logs)")
    return code


if __name__ == "__main__":
    sys.exit(main())
