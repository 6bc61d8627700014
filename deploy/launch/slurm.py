"""`fedhop slurm CONFIG.toml`: one run as one Slurm batch job (docs/deployment.md, "Slurm").

The job's steps are the processes of the config's process plan (common/topologies/plan.py), the same plan
`fedhop run`, `fedhop launch` and compose follow: the server, then each edge and client process,
each an `srun --nodes=1 --ntasks=1 --overlap` step placed on one node of the allocation (the
server on the first, the others round-robin over all of them).  Separate steps rather than a
heterogeneous job: every Slurm site allows steps, while heterogeneous jobs need site support, and
steps let each process have its own command line, log (RUN/logs/NODE.log) and exit status.

The batch script runs `python -m fedhop.deploy.launch.slurm _supervise RUN` on the first node, which
starts the steps and decides the job's exit status, the run's:

- the server's exit status (0: the run completed), or
- an edge's or client's non-zero status when it fails before every client registered (the run
  could not start: every step is stopped at once rather than waiting out the server's
  registration timeout); later failures are the server's to handle (dropouts, faults).

Security, decided before anything is written or submitted (`plan_run`), mutual TLS unless the
user opts out by name:

- no security keys (the default): per-job credentials.  `fedhop slurm` makes a new CA and, for
  every process of the plan, a certificate (CN = node id) and a per-node credential NODE.cred
  (common/security/auth.py, the machinery of `fedhop certs`); each process gets its own folder
  RUN/creds/NODE (0700, files 0600) holding only ca.pem, NODE.pem, NODE.key and NODE.cred, and
  its step is given only that folder.  The CA and issuer keys are never written: nothing can be
  issued for the job afterwards, by anyone.  A plain `fedhop slurm my.toml` runs on any cluster.
- `security.certs_dir`: the same folders, copied from a `fedhop certs` folder (every file read
  before anything is written: a missing or unreadable one is one line, exit 2); never ca.key,
  issuer.key or another node's files.  Mutual TLS, whatever `security.mtls` says: every node holds
  a certificate.
- `security.insecure = true` (the named opt-out): plaintext gRPC and one shared run token in
  RUN/.token (0600), which each step reads into its process's environment; said in one line at
  submission.

Nothing secret is on a command line or in the batch script; RUN/config.toml is 0600; the run
directory must be on a filesystem every node sees (the default runs/NAME-seedS-TIMESTAMP under the
submitting folder).

Before submitting, the job is fitted to its partition (`check_fit`): a job that asks more CPUs than
the partition's nodes have (one task per process, `--cpus-per-task` each) would stay pending for
ever (reason PartitionConfig), so it is refused with one line naming the CPUs it needs and
`--overcommit` (sbatch's --overcommit: the processes share the CPUs of the allocation).
`--wait` prints the job's state and Slurm's pending reason each time they change, and on failure
the failing step's error line from the run folder (`failure_reason`).  `--print` writes nothing.

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
import re
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
from typing import TYPE_CHECKING, Callable

from fedhop.common.util.cliparser import ArgumentParser
from fedhop.deploy.launch.runfolder import record_server_lost

if TYPE_CHECKING:
    from fedhop.common.config.schema import Config

SLURM_DIR = "slurm"        # RUN/slurm: the batch script, the task list, the job's output and exit record
TOKEN_FILE = ".token"
GRACE_S = 30.0             # after the server ends: how long the others have to exit on their own


class SlurmError(Exception):
    """A bad flag, config or environment: one line, exit 2."""


# sbatch's --time formats: "M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S"
TIME_LIMIT = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}")


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

    def refusal(self) -> str | None:
        """Why these options cannot be a job's (the first flag out of range, or the time limit), or None."""
        for flag, value, least in (("--nodes", self.nodes, 1), ("--cpus-per-task", self.cpus_per_task, 1),
                                   ("--gpus-per-node", self.gpus_per_node, 0)):
            if value < least:
                return f"{flag} {value}: must be >= {least}"
        return self.time_refusal()

    def time_refusal(self) -> str | None:
        """Why `time` is not a time limit Slurm accepts (None when it is, or is unset): minutes,
        MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED / INFINITE (sbatch(1), --time)."""
        if not self.time or TIME_LIMIT.fullmatch(self.time) or self.time.upper() in ("UNLIMITED", "INFINITE"):
            return None
        return (f"--time {self.time!r} is not a Slurm time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                f"D-HH:MM:SS or UNLIMITED)")

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
    node's `gpus_per_node` GPUs (common/transport/placement.py; NCCL: one GPU per process of the node)."""
    from fedhop.common.transport.factory import own_device_per_process
    from fedhop.common.transport.placement import DeviceError, client_devices, nccl_devices, resolve
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


def _read_all(paths: list[Path]) -> dict[Path, bytes]:
    """The bytes of every file, or SlurmError naming the first that cannot be read."""
    out = {}
    for path in paths:
        try:
            out[path] = path.read_bytes()
        except OSError as exc:
            raise SlurmError(f"security.certs_dir: cannot read {path} ({exc.strerror or exc})") from None
    return out


def node_files(certs_dir: Path, node_ids: list[str]) -> dict[str, dict[str, bytes]]:
    """node id -> {file name: bytes} of what each node's folder gets from a `fedhop certs` folder:
    ca.pem, NODE.pem, NODE.key and NODE.cred (its per-node credential); never ca.key, issuer.key,
    cluster.secret (the shared secret, with which any node could mint another's tokens) or another
    node's files, as `fedhop compose` (compose.py `node_folders`).  Everything is read here, before
    anything is written or submitted, so a missing or unreadable file is one line (SlurmError)."""
    from fedhop.common.security.auth import CA_CERT
    from fedhop.common.security.nodecred import CRED_SUFFIX
    if not certs_dir.is_dir():
        raise SlurmError(f"security.certs_dir: {certs_dir} is not a folder (make one with "
                         f"`fedhop certs {certs_dir} --config CONFIG`, or leave security.certs_dir unset and "
                         f"fedhop slurm makes per-job credentials)")
    missing = [str(certs_dir / n) for node in node_ids
               for n in (CA_CERT, f"{node}.pem", f"{node}.key", f"{node}{CRED_SUFFIX}") if not (certs_dir / n).is_file()]
    if missing:
        raise SlurmError(f"security.certs_dir: missing {', '.join(sorted(set(missing))[:4])} "
                         f"(make them with `fedhop certs {certs_dir} --config CONFIG`; each node needs its own "
                         f"NODE{CRED_SUFFIX}, the shared cluster.secret is never given to a node)")
    out: dict[str, dict[str, bytes]] = {}
    for node in node_ids:
        names = [CA_CERT, f"{node}.pem", f"{node}.key", f"{node}{CRED_SUFFIX}"]
        data = _read_all([certs_dir / n for n in names])
        out[node] = {n: data[certs_dir / n] for n in names}
    return out


def job_node_files(node_ids: list[str], days: int = 365) -> dict[str, dict[str, bytes]]:
    """Per-job credentials, made with the machinery of `fedhop certs` (common/security/auth.py): a
    new CA and a certificate per planned node (CN = node id), and a new issuer signing each node's
    per-node credential.  The CA key and the issuer key stay in this process's memory and are never
    written: the job's nodes are all known now, so nothing is issued later, and no file in the run
    folder can mint a certificate or credential for a node."""
    from fedhop.common.security.auth import CA_CERT, make_ca, make_node_cert
    from fedhop.common.security.nodecred import CRED_SUFFIX, TokenAuthority
    ca_key, ca_cert = make_ca(days, name="fedhop slurm job CA")
    authority = TokenAuthority()
    out: dict[str, dict[str, bytes]] = {}
    for node in node_ids:
        key, cert = make_node_cert(ca_key, ca_cert, node, (), days)
        out[node] = {CA_CERT: ca_cert, f"{node}.pem": cert, f"{node}.key": key,
                     f"{node}{CRED_SUFFIX}": authority.issue(node).encode() + b"\n"}
    return out


def write_node_files(files: dict[str, dict[str, bytes]], run_dir: Path) -> None:
    """RUN/creds/NODE (0700) for every node, its files mode 0600 (node_files, job_node_files)."""
    creds = run_dir / "creds"
    creds.mkdir(mode=0o700, exist_ok=True)
    creds.chmod(0o700)
    for node, named in files.items():
        d = creds / node
        d.mkdir(mode=0o700, exist_ok=True)
        d.chmod(0o700)
        for name, data in named.items():
            _write_private(d / name, data)


SECURITY_LINES = {
    "job": ["# security: mutual TLS with per-job credentials that `fedhop slurm` made for this job: RUN/creds/NODE",
            "# (0700) holds ca.pem, NODE.pem, NODE.key and NODE.cred of that node only, each step gets its own",
            "# folder; the job's CA and issuer keys are not kept."],
    "certs": ["# security: mutual TLS with the certificates of security.certs_dir: RUN/creds/NODE (0700) holds",
              "# ca.pem, NODE.pem, NODE.key and NODE.cred of that node only, each step gets its own folder."],
    "token": ["# security: plaintext gRPC and one shared run token in RUN/.token (security.insecure = true):",
              "# every step can speak for any node; for a trusted network only."],
}
INSECURE_NOTE = ("security.insecure = true: plaintext gRPC with one shared run token (any step can speak for any "
                 "node), for a quick try on a trusted network; leave it unset for mutual TLS with per-job "
                 "credentials")


def batch_script(run_dir: Path, opts: SlurmOptions, ntasks: int, job_name: str, workdir: Path,
                 security: str = "token") -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --output={run_dir}/{SLURM_DIR}/job.out",
             f"#SBATCH --chdir={workdir}"]
    lines += [f"#SBATCH {d}" for d in opts.directives(ntasks)]
    lines += [f"# fedhop: the steps of {run_dir}/{SLURM_DIR}/tasks.json (server, edges, client processes), one",
              "# `srun --nodes=1 --ntasks=1 --overlap` each; this job's exit status is the run's."]
    lines += [ln.replace("RUN/", f"{run_dir}/") for ln in SECURITY_LINES[security]]
    lines += [f"exec {shlex.quote(opts.python)} -m fedhop.deploy.launch.slurm _supervise {shlex.quote(str(run_dir))}", ""]
    return "\n".join(lines)


@dataclass
class PreparedRun:
    """Everything a run folder will hold, decided and checked before anything is written: `--print`
    shows `script` and writes nothing; `write()` makes the folder; `submit` sends the script."""

    run_dir: Path
    cfg: Config
    node_ids: list[str]
    tasks: list[dict]
    script: str
    security: str                                   # "job" (per-job mTLS), "certs" (certs_dir, mTLS), "token"
    certs: dict[str, dict[str, bytes]] | None       # node files read from security.certs_dir ("certs")
    opts: SlurmOptions

    def check_out(self, force: bool = False) -> None:
        """Refuse a run folder that is not empty: one holding an earlier `fedhop slurm` run
        (its RUN/slurm/tasks.json) unless `force` (then write() replaces it), any other never,
        `force` or not: --force replaces a run, not a folder of the user's."""
        run_dir = self.run_dir
        if run_dir.exists() and not run_dir.is_dir():
            raise SlurmError(f"--out {run_dir} is a file, not a run directory")
        if not run_dir.exists() or not any(run_dir.iterdir()):
            return
        if not holds_run(run_dir):
            raise SlurmError(f"--out {run_dir} is not empty and holds no fedhop slurm run (no "
                             f"{SLURM_DIR}/tasks.json); name a new or empty folder")
        if not force:
            raise SlurmError(f"--out {run_dir} holds an earlier run (pass --force to replace it)")

    def write(self, force: bool = False) -> None:
        """Make the run folder: config.toml (0600), the credentials (RUN/creds/NODE, or RUN/.token in
        shared-token mode), the task list and the batch script."""
        from fedhop.common.config import config_to_toml
        run_dir = self.run_dir
        self.check_out(force)
        clear(run_dir)   # an earlier run (check_out), replaced
        for sub in ("logs", "ledger", SLURM_DIR):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        if self.security == "token":
            _write_private(run_dir / TOKEN_FILE, secrets.token_hex(16) + "\n")
        else:
            write_node_files(self.certs if self.certs is not None else job_node_files(self.node_ids), run_dir)
        _write_private(run_dir / "config.toml", config_to_toml(self.cfg))
        (run_dir / SLURM_DIR / "tasks.json").write_text(json.dumps(self.tasks, indent=1))
        (run_dir / SLURM_DIR / "job.sbatch").write_text(self.script)


def clear(run_dir: Path) -> None:
    """Remove what `run_dir` holds, keeping the folder itself (it may be the working directory)."""
    if not run_dir.is_dir():
        return
    for entry in run_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` is a `fedhop slurm` run folder (its task list is there)."""
    return (run_dir / SLURM_DIR / "tasks.json").is_file()


def plan_run(config: str, overrides: list[str], out: str | None, opts: SlurmOptions) -> PreparedRun:
    """Load and check the config, decide the run folder, the security mode and the tasks, and render
    the batch script; nothing is written.  The security mode (module docstring):
    security.certs_dir set: its certificates, every file read now; else security.insecure = true:
    plaintext with a shared token (the named opt-out); else per-job credentials, made on write().
    Every mode but the opt-out runs mutual TLS."""
    from fedhop.common.config import ConfigError, load_config
    from fedhop.common.security.addresses import plaintext_refusal
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.deploy.launch.engine import process_launch_problem
    try:
        cfg = load_config(config, overrides)
        plan = plan_processes(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        raise SlurmError(str(exc)) from None
    engine_problem = process_launch_problem(cfg, "fedhop slurm")
    if engine_problem:
        raise SlurmError(engine_problem)
    refusal = opts.refusal()
    if refusal:
        raise SlurmError(refusal)
    run_dir = Path(out or f"runs/{cfg.run.name}-seed{cfg.run.seed}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}").resolve()
    _check_path(run_dir, "the run directory")
    sec = cfg.security
    certs = None
    if sec.certs_dir:
        security = "certs"
        certs = node_files(Path(sec.certs_dir).resolve(), plan.node_ids)
    elif sec.insecure:
        security = "token"
    else:
        security = "job"
    creds = security != "token"
    # the steps listen on their node's host name, never loopback: the same rule every process applies
    refusal = plaintext_refusal(["{host}:0"], sec.insecure, tls=creds, who="launch")
    if refusal:
        raise SlurmError(refusal)
    if creds:
        sec.mtls = True                                  # every node holds a certificate: mutual TLS
        sec.certs_dir = str(run_dir / "creds" / "server")   # the server's config names its own folder
    tasks = task_list(cfg, run_dir, opts.nodes, creds)
    bind_devices(tasks, slurm_devices(cfg, tasks, opts.gpus_per_node), opts.gpus_per_node)
    name = "fedhop-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in cfg.run.name)
    script = batch_script(run_dir, opts, len(tasks), name, Path.cwd(), security)
    return PreparedRun(run_dir, cfg, plan.node_ids, tasks, script, security, certs, opts)


def prepare_run(config: str, overrides: list[str], out: str | None, opts: SlurmOptions,
                force: bool = False) -> Path:
    """Make the run directory (plan_run, then write); its absolute path."""
    prepared = plan_run(config, overrides, out, opts)
    prepared.write(force)
    return prepared.run_dir


# ----------------------------------------------------------------------------- fitting the partition
QUERY_TIMEOUT_S = 20.0     # a controller that does not answer: refused well within 30 s


def _slurm_query(argv: list[str]) -> str:
    """stdout of a Slurm query command, or SlurmError with its last error line."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} is not on PATH (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shlex.join(argv)}` did not answer within {QUERY_TIMEOUT_S:.0f} s "
                         f"(is slurmctld up?)") from None
    if res.returncode != 0:
        err = res.stderr.strip().splitlines()
        raise SlurmError(f"`{shlex.join(argv)}` failed: {err[-1] if err else f'status {res.returncode}'}")
    return res.stdout


@dataclass
class Partition:
    """What a partition can ever give one job: its nodes' CPUs (configured, whatever their state)."""

    name: str
    node_cpus: list[int]           # per node, largest first, capped by MaxCPUsPerNode
    max_nodes: int | None          # MaxNodes, None when unlimited

    def fit_refusal(self, ntasks: int, opts: SlurmOptions) -> str | None:
        """Why a job of `ntasks` tasks of `opts.cpus_per_task` CPUs on `opts.nodes` nodes can never
        start here (None when it can).  With --overcommit Slurm allocates `cpus_per_task` CPUs per
        node, whatever the number of tasks, so it is the node count and per-node CPUs that count."""
        nodes = opts.nodes
        have = len(self.node_cpus) if self.max_nodes is None else min(len(self.node_cpus), self.max_nodes)
        if nodes > have:
            return f"--nodes {nodes} asks more nodes than partition '{self.name}' can give one job ({have})"
        chosen = self.node_cpus[:nodes]
        cpus = sum(chosen)
        if opts.overcommit:
            if opts.cpus_per_task > min(chosen):
                return (f"--cpus-per-task {opts.cpus_per_task} asks more CPUs than a node of partition "
                        f"'{self.name}' has ({min(chosen)})")
            return None
        need = ntasks * opts.cpus_per_task
        if need <= cpus:
            return None
        per = f" x {opts.cpus_per_task} CPUs (--cpus-per-task)" if opts.cpus_per_task > 1 else ""
        return (f"the job needs {need} CPUs ({ntasks} processes{per}, one Slurm task each) but partition "
                f"'{self.name}' can give one job at most {cpus} ({nodes} node{'s' if nodes > 1 else ''} of "
                f"{'+'.join(map(str, chosen))} CPUs): pass --overcommit to run the processes on fewer CPUs, "
                f"or ask fewer processes (--set clients.processes=N) or more --nodes")


def query_partition(name: str) -> Partition:
    """The partition `name` (the cluster's default when empty) from `scontrol show partition` and
    its nodes' CPUs from `sinfo`."""
    rows = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            for line in _slurm_query(["scontrol", "show", "partition", "-o", *([name] if name else [])]).splitlines()
            if line.strip()]
    if name:
        row = next((r for r in rows if r.get("PartitionName") == name), None)
        if row is None:
            raise SlurmError(f"--partition {name}: Slurm knows no such partition")
    else:
        row = next((r for r in rows if r.get("Default") == "YES"), None)
        if row is None:
            raise SlurmError(f"this cluster has no default partition: name one with --partition "
                             f"({', '.join(r.get('PartitionName', '?') for r in rows)})")
    part = row["PartitionName"]
    cpus: dict[str, int] = {}
    for line in _slurm_query(["sinfo", "-h", "-N", "-p", part, "-o", "%N %c"]).splitlines():
        node, _, count = line.strip().partition(" ")
        if node and count.strip().isdigit():
            cpus[node] = int(count)
    if not cpus:
        raise SlurmError(f"partition '{part}' has no nodes")
    cap = row.get("MaxCPUsPerNode", "UNLIMITED")
    per_node = sorted((min(c, int(cap)) if cap.isdigit() else c for c in cpus.values()), reverse=True)
    max_nodes = row.get("MaxNodes", "UNLIMITED")
    return Partition(part, per_node, int(max_nodes) if max_nodes.isdigit() else None)


def check_fit(prepared: PreparedRun) -> None:
    """Refuse (SlurmError) a job that its partition can never start, before it is submitted: Slurm
    would keep it pending (reason PartitionConfig) for ever."""
    opts = prepared.opts
    partition = next((e.split("=", 1)[1] for e in opts.extra if e.startswith("--partition=")), opts.partition)
    overcommit = opts.overcommit or any(e in ("--overcommit", "-O") for e in opts.extra)
    fit = SlurmOptions(**{**opts.__dict__, "partition": partition, "overcommit": overcommit})
    refusal = query_partition(partition).fit_refusal(len(prepared.tasks), fit)
    if refusal:
        raise SlurmError(refusal)


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`: the job id (also written beside the script, as job.id)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SlurmError("sbatch is not on PATH (is this a Slurm login node?)")
    try:
        res = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True,
                             timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"sbatch did not answer within {QUERY_TIMEOUT_S:.0f} s (is slurmctld up?)") from None
    job = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not job:
        err = res.stderr.strip().splitlines()
        raise SlurmError(f"sbatch refused the job: {err[-1] if err else 'no job id'}")
    (script.parent / "job.id").write_text(job + "\n")
    return job


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}
# pending reasons that no amount of waiting clears: the job as asked does not fit its partition or account
NEVER_STARTS = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
                "AccountNotAllowed", "QOSMaxCpuPerJobLimit", "QOSMaxNodePerJobLimit", "InvalidAccount", "InvalidQOS",
                "PartitionDown", "PartitionInactive"}


@dataclass
class JobInfo:
    """A job's state, Slurm's reason for it (pending reason; "" when none) and its exit status as a
    shell reports it (the exit code, or 128 + N for a job ended by signal N; 0 while it runs)."""

    state: str
    reason: str
    status: int

    def describe(self) -> str:
        return f"{self.state} ({self.reason})" if self.reason and self.state not in TERMINAL else self.state


def _ask(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    """A Slurm command's result, or None when it did not answer within QUERY_TIMEOUT_S (a
    controller that hangs is then a poll that learnt nothing, never a wait without end)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def job_info(job: str) -> JobInfo | None:
    """A job's JobInfo from `scontrol show job`, or from `sacct` once the controller has forgotten
    it; None when neither knows it.  For an array, its first task's state until all have ended."""
    res = _ask(["scontrol", "show", "job", "-o", job])
    if res is not None and res.returncode == 0 and res.stdout.strip():
        rows = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in res.stdout.splitlines()]
        states = [r.get("JobState", "") for r in rows]
        reason = rows[0].get("Reason", "None")
        reason = "" if reason in ("None", "(null)") else reason
        if not all(s in TERMINAL for s in states):
            return JobInfo(states[0], reason, 0)
        row = next((r for r in rows if r.get("ExitCode", "0:0") != "0:0"), rows[0])
        pairs = [row.get("ExitCode", "0:0"), states[0]]
    else:
        reason = ""
        res = _ask(["sacct", "-j", job, "-X", "-n", "-P", "-o", "ExitCode,State"])
        lines = [ln for ln in res.stdout.splitlines() if ln.strip()] if res is not None and res.returncode == 0 else []
        if not lines:
            return None
        pairs = lines[0].split("|")[:2]
    code, _, sig = pairs[0].partition(":")
    status = 128 + int(sig) if sig.isdigit() and int(sig) else int(code or 0)
    return JobInfo(pairs[1].split()[0], reason, status)


def job_state(job: str) -> tuple[str, int] | None:
    """(state, exit status) of a job (job_info)."""
    info = job_info(job)
    return None if info is None else (info.state, info.status)


def wait_job(job: str, poll: float = 1.0, report: Callable[[str], None] | None = None) -> int:
    """Wait for a job (all tasks of an array) to end; its exit status (1 for a job that ended
    otherwise than COMPLETED with exit code 0, e.g. cancelled while pending).  `report` is given a line
    each time the job's state or pending reason changes ("job 12: PENDING (Resources)"), and once
    more, with what to do, when Slurm says the job can never start as asked.  Ctrl-C cancels it."""
    unknown = 0
    last = ""
    try:
        while True:
            info = job_info(job)
            if info is None:
                unknown += 1
                if unknown > 30:
                    raise SlurmError(f"job {job}: neither scontrol nor sacct knows it (or answers) after "
                                     f"{unknown} polls")
            else:
                unknown = 0
                line = f"job {job}: {info.describe()}"
                if report is not None and line != last:
                    report(line)
                    if info.state == "PENDING" and info.reason in NEVER_STARTS:
                        report(f"job {job}: Slurm will not start it as asked ({info.reason}); cancel it with "
                               f"`scancel {job}` and fit the request to the partition (--overcommit, --nodes, "
                               f"--partition, --time)")
                last = line
                if info.state in TERMINAL:   # ended otherwise than COMPLETED with exit code 0 (cancelled
                    return info.status or (0 if info.state == "COMPLETED" else 1)   # before it ran): 1
            time.sleep(poll)
    except KeyboardInterrupt:
        _ask(["scancel", job])
        print(f"fedhop slurm: interrupted; cancelled job {job}", file=sys.stderr)
        return 130


def _error_line(log: Path) -> str:
    """The last line of a process's log that reads as an error (a logged ERROR, a refusal, an
    exception's last line, argparse's "error:"), else its last line; "" without a log."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    lines = [ln for ln in lines if not ln.startswith("srun:")]
    marks = (" ERROR ", " CRITICAL ", "error:", "Error:", "refusing", "Exception:")
    found = [ln for ln in lines if any(m in ln for m in marks)]
    line = (found or lines or [""])[-1]
    return line if len(line) <= 400 else line[:397] + "..."


def failure_reason(run_dir: Path) -> str:
    """Why a run failed, from its folder: the error line of the step whose status became the job's
    (the server's, or the edge's or client's that failed before every client registered), else the
    server's, else the job's output."""
    try:
        exits = json.loads((run_dir / SLURM_DIR / "exit.json").read_text())
    except (OSError, ValueError):
        exits = {}
    steps = exits.get("steps", {})
    order = [n for n, c in steps.items() if c == exits.get("status")] + ["server"]
    for node in order:
        line = _error_line(run_dir / "logs" / f"{node}.log")
        if line:
            return f"{node}: {line}"
    return _error_line(run_dir / SLURM_DIR / "job.out")


# ----------------------------------------------------------------------------- inside the job
def hostnames() -> list[str]:
    """The allocation's node names, in Slurm's order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return [socket.gethostname()]
    res = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True,
                         timeout=QUERY_TIMEOUT_S)
    return res.stdout.split()


def registration_done(run_dir: Path) -> bool:
    from fedhop.deploy.launch.launcher import registration_complete
    return registration_complete(run_dir / "run.db")


def step_argv(task: dict, host: str, run_dir: Path, python: str) -> list[str]:
    """The `srun` of one task: one task on its node, sharing the allocation (`--overlap`), its
    own log, and its GPUs (`--gres`, set by bind_devices when the job has GPUs)."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", f"--job-name={task['node_id']}",
            f"--output={run_dir}/logs/{task['node_id']}.log", "--kill-on-bad-exit=1",
            *([f"--gres={task['gres']}"] if task.get("gres") else []),
            python, "-m", "fedhop.deploy.launch.slurm", "_task", str(run_dir), task["node_id"]]


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
    """One step: in shared-token mode the token from RUN/.token into the environment, "{host}"
    replaced by this node's name, then exec `python -m fedhop.ROLE ...` (its credentials are the
    folder RUN/creds/NODE its argv names)."""
    from fedhop.deploy.launch.malloc import tuned_env
    tasks = {t["node_id"]: t for t in json.loads((run_dir / SLURM_DIR / "tasks.json").read_text())}
    task = tasks[node_id]
    host = os.environ.get("FEDHOP_SLURM_HOST") or socket.gethostname()
    argv = [a.replace("{host}", host) for a in task["argv"]]
    env = dict(tuned_env(), PYTHONUNBUFFERED="1")
    env.pop("FEDHOP_TOKEN", None)
    if (run_dir / TOKEN_FILE).is_file():     # shared-token mode (security.insecure = true) only
        env["FEDHOP_TOKEN"] = (run_dir / TOKEN_FILE).read_text().strip()
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", f"fedhop.{argv[0]}", *argv[1:]], env)
    return 127   # not reached


# ----------------------------------------------------------------------------- sweeps as a job array
class SlurmArrayRunner:
    """A sweep runner (deploy/tools/sweep.py `Runner`'s `run_all`/`stop`) that submits the pending runs
    as one job array: array task i runs `fedhop run` of run i on one node (its processes on that
    node, as locally), at most `parallel` at a time.  Finished runs are skipped as locally, so a
    sweep resumes the same way."""

    def __init__(self, local, opts: SlurmOptions) -> None:
        self.local = local        # the sweep's own Runner: command(), request(), finished-run checks
        self.opts = opts
        self.job: str | None = None
        self.interrupted = False
        self.starting = False   # while the array is submitted and its job id kept (see Runner.starting)

    def run_all(self, tasks: list, on_done: Callable) -> None:
        from fedhop.deploy.tools.sweep import finished, launcher_log, request_file
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
        lines += [f"exec {shlex.quote(opts.python)} -m fedhop.deploy.launch.slurm _array {shlex.quote(str(listing))}", ""]
        script = jobs / f"array-{stamp}.sbatch"
        script.write_text("\n".join(lines))
        try:
            self.starting = True
            try:
                self.job = submit(script)
            finally:
                self.starting = False
            if self.interrupted:   # a Ctrl-C during the submission: `stop` cancels the job just submitted
                raise KeyboardInterrupt
            if wait_job(self.job, poll=2.0) == 130:
                raise KeyboardInterrupt   # Ctrl-C: the job is cancelled; the sweep says how to resume
        except SlurmError as exc:
            raise SystemExit(f"fedhop sweep --slurm: {exc}") from None
        for t in pending:
            on_done(t, 0 if finished(t.run_dir) else 1)

    def stop(self, grace: float = 20.0) -> None:
        if self.job:
            _ask(["scancel", "--signal=INT", "--full", self.job])
            _ask(["scancel", self.job])


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
    ap.add_argument("--time", default="", help="time limit in sbatch's formats (minutes, MM:SS, HH:MM:SS, D-HH, "
                                               "D-HH:MM, D-HH:MM:SS, UNLIMITED), e.g. 1:00:00 (default: the "
                                               "partition's DefaultTime; none is set for it, as one above the "
                                               "partition's MaxTime would leave the job pending)")
    ap.add_argument("--account", default="", help="Slurm account to charge")
    ap.add_argument("--cpus-per-task", type=int, default=1, metavar="N", help="CPUs per process (default 1)")
    ap.add_argument("--overcommit", action="store_true",
                    help="allow more processes than CPUs (sbatch --overcommit): the processes share the "
                         "allocation's CPUs; without it a job that needs more CPUs than its partition's nodes "
                         "have is refused before submission")
    ap.add_argument("--sbatch-arg", dest="extra", action="append", default=[], metavar="OPTION",
                    help="one more sbatch option, verbatim, e.g. --sbatch-arg=--qos=short (repeatable)")


def options_from(args: argparse.Namespace) -> SlurmOptions:
    return SlurmOptions(partition=args.partition, nodes=getattr(args, "nodes", 1), gpus_per_node=args.gpus_per_node,
                        time=args.time, account=args.account, cpus_per_task=args.cpus_per_task,
                        overcommit=args.overcommit, extra=list(args.extra))


def build_parser() -> argparse.ArgumentParser:
    """`fedhop slurm`'s command line."""
    ap = ArgumentParser(prog="fedhop slurm", description="submit one run as a Slurm batch job whose steps "
                                 "are the server, edge and client processes (docs/deployment.md, \"Slurm\")")
    ap.add_argument("config", help="experiment TOML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key (repeatable)")
    ap.add_argument("--out", help="run directory on a filesystem every node sees (default runs/NAME-seedS-TIMESTAMP)")
    ap.add_argument("--force", action="store_true",
                    help="with --out: replace the earlier fedhop slurm run there (a folder that holds anything "
                         "else is never replaced)")
    add_slurm_args(ap, nodes=True)
    ap.add_argument("--print", dest="print_only", action="store_true",
                    help="print the batch script (and describe the credentials); write and submit nothing")
    ap.add_argument("--wait", action="store_true",
                    help="follow the job (its state and Slurm's pending reason as they change) and exit with the "
                         "run's status")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_supervise":
        return supervise(Path(argv[1]))
    if argv and argv[0] == "_task":
        return run_task(Path(argv[1]), argv[2])
    if argv and argv[0] == "_array":
        return run_array_task(Path(argv[1]))
    args = build_parser().parse_args(argv)
    opts = options_from(args)
    try:
        prepared = plan_run(args.config, args.overrides, args.out, opts)
        if args.print_only:
            print(prepared.script, end="")
            print(f"# nothing written: without --print, fedhop slurm writes {prepared.run_dir} "
                  f"({'credentials in creds/NODE' if prepared.security != 'token' else 'a run token in .token'}) "
                  f"and submits this script", file=sys.stderr)
            return 0
        prepared.check_out(args.force)
        if shutil.which("sbatch") is None:
            raise SlurmError("sbatch is not on PATH (is this a Slurm login node?)")
        check_fit(prepared)
        if prepared.security == "token":
            print(f"fedhop slurm: {INSECURE_NOTE}", file=sys.stderr)
        prepared.write(args.force)
        try:
            job = submit(prepared.run_dir / SLURM_DIR / "job.sbatch")
        except SlurmError:   # nothing runs: what was written (credentials included) goes, a retry may use the folder
            clear(prepared.run_dir)
            raise
    except SlurmError as exc:
        print(f"fedhop slurm: {exc}", file=sys.stderr)
        return 2
    run_dir = prepared.run_dir
    how = {"job": "mutual TLS, per-job credentials in creds/", "certs": "mutual TLS, security.certs_dir",
           "token": "plaintext, shared run token"}[prepared.security]
    print(f"fedhop slurm: job {job}, run directory {run_dir} ({how})", flush=True)
    if not args.wait:
        print(f"  follow with `squeue -j {job}`; the job's exit status is the run's (sacct -j {job})")
        return 0
    return follow(job, run_dir)


def follow(job: str, run_dir: Path, poll: float = 1.0) -> int:
    """`--wait`: a line per change of the job's state or pending reason, then its end: the run's
    status and, on failure, why (failure_reason) rather than the number alone."""
    def report(line: str) -> None:
        print(f"fedhop slurm: {line}", flush=True)

    try:
        code = wait_job(job, poll, report)
    except SlurmError as exc:
        print(f"fedhop slurm: {exc}", file=sys.stderr)
        return 1
    if code == 0:
        print(f"fedhop slurm: job {job} ended with status 0 (the run completed; logs in {run_dir}/logs)")
        return 0
    # a server step killed with its job (a node lost, scancel, a limit past its grace) recorded no end
    record_server_lost(run_dir, "stopped" if code == 130 else "failed",
                       f"slurm job {job} ended with status {code} before the server recorded the run's end")
    if code != 130:
        why = failure_reason(run_dir)
        print(f"fedhop slurm: job {job} ended with status {code}{': ' + why if why else ''} "
              f"(logs in {run_dir}/logs)", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
