"""`fedhop run`: start every process of a run on this machine, show progress, clean up.

The server and each client process are separate OS processes on free loopback ports.  Their
output goes to `RUN_DIR/logs/<node>.log`.  Children die with the launcher (PR_SET_PDEATHSIG
on Linux) and are terminated on success, failure or Ctrl-C, so nothing is left behind.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from fedhop.common.config import Config, config_to_toml, load_config
from fedhop.common.records.walfold import connect_ro, fold_wal
from fedhop.common.security.nodecred import CRED_ENV, TokenAuthority
from fedhop.common.topologies.plan import plan_processes
from fedhop.common.transport.factory import TRANSPORTS, transport
from fedhop.common.transport.placement import DeviceError, describe, plan_devices, resolve_config
from fedhop.common.util.memo import forget_process_memos
from fedhop.common.util.nodeids import id_spec
from fedhop.common.util.plugins import ALLOW_ENV, PLUGIN_PATH_ENV, allow_list_from, config_plugins
from fedhop.common.util.procexit import (
    LAUNCHER_ENV,
    Stopped,
    ignore_stops,
    raise_if_stopped,
    signals_restored,
    stop_on_sigterm,
    stop_reason,
    stops_deferred,
)
from fedhop.common.util.rolelog import RoleRefused, refusal_of
from fedhop.deploy.launch.forkstart import ForkedProcess, fork_allowed, fork_module
from fedhop.deploy.launch.malloc import tuned_env
from fedhop.deploy.launch.runfolder import (
    RunDirError,
    claim,
    false_start,
    give_back,
    held_count,
    hold,
    in_use,
    new_folder,
    out_run_dir,
    record_server_lost,
    release_since,
    run_stamp,
)
from fedhop.deploy.tools.report import human_bytes


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | ForkedProcess
    log: Path


@dataclass
class LocalRun:
    """The processes of one run on this machine."""

    cfg: Config
    run_dir: Path              # absolute: the children may read it from another working directory
    children: list[Child] = field(default_factory=list)
    workdir: Path = field(default_factory=Path.cwd)   # the children's working directory: the user's folder
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    authority: TokenAuthority = field(default_factory=TokenAuthority)   # issues each child's credential
    credentials: dict[str, str] = field(default_factory=dict)          # node id -> its credential
    devices: dict[str, str] = field(default_factory=dict)   # node id -> its --device (common/transport/placement.py)

    def spawn(self, name: str, argv: list[str]) -> Child:
        log = self.run_dir / "logs" / f"{name}.log"
        env = dict(tuned_env(), FEDHOP_TOKEN=self.token, PYTHONUNBUFFERED="1")
        # the children may load the plug-ins this run's own config names, and no other (common/util/plugins.py)
        env[ALLOW_ENV] = ",".join(allow_list_from([*config_plugins(self.cfg)], env.get(ALLOW_ENV, "")))
        env[CRED_ENV] = self.credential(name)   # this child's own per-node credential (common/security/auth.py)
        module = f"fedhop.{argv[0]}"
        # A stop between the start and the list would leave a child that stop_all never stops (it
        # would outlive this launcher until its SIGTERM at our exit): raised once the child is listed.
        with stops_deferred():
            # start-up without re-importing torch (deploy/launch/forkstart.py); CUDA cannot be used in a forked child
            proc: subprocess.Popen | ForkedProcess
            if fork_allowed() and not any(d.startswith("cuda") for d in self.devices.values()):
                proc = fork_module(module, argv[1:], env, log, self.workdir)
            else:
                with open(log, "ab") as fh:
                    # the child dies with this launcher (common/util/procexit.py die_with_launcher)
                    proc = subprocess.Popen([sys.executable, "-m", module, *argv[1:]], stdout=fh,
                                            stderr=subprocess.STDOUT, env={**env, LAUNCHER_ENV: str(os.getpid())},
                                            cwd=self.workdir)
            child = Child(name, proc, log)
            self.children.append(child)
        raise_if_stopped()
        return child

    def device_args(self, node_id: str) -> list[str]:
        """`--device` of one process (the run's device plan), or none: the config's key decides."""
        return ["--device", self.devices[node_id]] if node_id in self.devices else []

    def credential(self, name: str) -> str:
        """The per-node credential of child `name`, issued once: `start` issues every planned
        child's before the first fork (key generation between forks hung forked children), and a
        restarted child gets its node's again."""
        if name not in self.credentials:
            self.credentials[name] = self.authority.issue(name)
        return self.credentials[name]

    def security_args(self) -> list[str]:
        """The client and edge flags that match the config's [security] section."""
        sec = self.cfg.security
        out = ["--certs-dir", str(Path(sec.certs_dir).resolve())] if sec.certs_dir else []
        return out + (["--mtls"] if sec.mtls else []) + (["--insecure"] if sec.insecure else [])

    def start(self, overrides: list[str], resume: bool = False) -> Child:
        """Start the server (continuing from its checkpoint with `resume`), then the edges and the
        client processes of the config's process plan (common/topologies/plan.py) all at once, so their
        start-up (imports, above all torch's) overlaps: each child reads its parent's address
        from the file the parent writes once it serves (`--parent-file`).  Returns once the
        server serves."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "ledger").mkdir(parents=True, exist_ok=True)
        cfg_path = self.run_dir / "config.toml"
        cfg_path.write_text(config_to_toml(self.cfg))
        port_file = self.run_dir / "server.address"
        port_file.unlink(missing_ok=True)
        for node in ["server", *(p.node_id for p in plan_processes(self.cfg).processes[1:])]:
            self.credential(node)
        host = self.cfg.transport.host
        server = self.spawn("server", ["server", "--config", str(cfg_path), "--run-dir", str(self.run_dir),
                                       "--listen", f"{host}:0", "--port-file", str(port_file)]
                            + (["--resume"] if resume else []) + self.device_args("server"))
        if self.devices:
            (self.run_dir / "devices.json").write_text(json.dumps(self.devices, indent=1) + "\n")
        address_file = {"server": port_file}
        for proc in plan_processes(self.cfg).processes[1:]:   # the processes this config starts (common/topologies/plan.py)
            assert proc.parent is not None   # only the server (processes[0]) has no parent
            parent_file = address_file[proc.parent]
            if proc.kind == "edge":
                address_file[proc.node_id] = self.run_dir / f"{proc.node_id}.address"
                address_file[proc.node_id].unlink(missing_ok=True)
                self.spawn(proc.node_id, ["edge", "--parent-file", str(parent_file), "--node-id", proc.node_id,
                                          "--listen", f"{host}:0", "--port-file", str(address_file[proc.node_id]),
                                          "--ledger-dir", str(self.run_dir / "ledger"),
                                          "--max-message-bytes", str(self.cfg.transport.max_message_bytes),
                                          "--window-bytes", str(self.cfg.transport.window_bytes)]
                           + self.security_args() + self.device_args(proc.node_id))
            else:
                self.spawn(proc.node_id, ["client", "--parent-file", str(parent_file), "--clients", id_spec(proc.clients),
                                          "--node-id", proc.node_id, "--listen", f"{host}:0",
                                          "--ledger-dir", str(self.run_dir / "ledger"),
                                          "--max-message-bytes", str(self.cfg.transport.max_message_bytes),
                                          "--window-bytes", str(self.cfg.transport.window_bytes),
                                          "--threads", str(self.cfg.run.torch_threads)] + self.security_args()
                           + self.device_args(proc.node_id))
        forget_process_memos()   # the children have what the config check built (common/util/memo.py)
        self._wait_for_address(server, port_file)
        return server

    @staticmethod
    def _wait_for_address(server: Child, port_file: Path, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port_file.exists():
                return port_file.read_text().strip()
            if server.proc.poll() is not None:
                refusal = refusal_of(server.proc.returncode, server.log, "server")
                if refusal:
                    raise RoleRefused(refusal)
                raise RuntimeError(f"{server.name} exited with status {server.proc.returncode} before serving; "
                                   f"last log lines:\n{tail(server.log)}")
            time.sleep(0.05)
        raise RuntimeError(f"{server.name} did not start serving within {timeout:.0f}s; see {server.log}")

    def stop_all(self, grace: float = 5.0, server_grace: float = 0.0, server_signal: int = signal.SIGINT) -> None:
        """Terminate every child still running; kill those that do not exit within `grace`.
        With `server_grace`, the server is asked first (`server_signal`: the signal that stopped the
        launcher) and given that long to record the run as stopped and shut its children down itself."""
        if server_grace and self.children and self.children[0].proc.poll() is None:
            server = self.children[0].proc
            server.send_signal(server_signal)
            try:
                server.wait(server_grace)
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.terminate()
        deadline = time.monotonic() + grace
        for c in self.children:
            left = max(0.0, deadline - time.monotonic())
            try:
                c.proc.wait(left)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def kill_all(self) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.kill()
        for c in self.children:
            c.proc.wait()


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def registration_complete(db: Path) -> bool:
    """Whether the server has recorded that every logical client registered (read-only)."""
    if not db.exists():
        return False
    try:
        con = connect_ro(db, timeout=1.0)
        try:
            return con.execute("SELECT 1 FROM events WHERE kind = 'registration_complete' LIMIT 1").fetchone() \
                is not None
        finally:
            con.close()
    except sqlite3.Error:
        return False


def check_children_started(run: "LocalRun") -> None:
    """Raise when an edge or client process has exited with an error before registration
    completed: the server would otherwise wait out its registration timeout (120 s)."""
    for c in run.children[1:]:
        code = c.proc.poll()
        if code not in (None, 0):
            raise RuntimeError(f"{c.name} exited with status {code} before every process had registered; "
                               f"last log lines of {c.log}:\n{tail(c.log)}")


def read_progress(db: Path, after: int, final: bool = False) -> list[dict]:
    """Rounds recorded in run.db after round `after`, each with `bytes`: the framed bytes of every
    link up to that round in the live view every process reports with its heartbeats
    (common/transport/livebytes.py); with `final` (the run has ended), the live view's total now, which
    equals the final table.  A run.db without a live view: the records merged so far."""
    if not db.exists():
        return []
    try:
        con = connect_ro(db, timeout=1.0)
        try:
            live = con.execute("SELECT name FROM sqlite_master WHERE name = 'live_bytes'").fetchone()
            rows = con.execute("SELECT round, participants, sampled, failures, metrics_json, "
                               f"{'live_framed_bytes' if live else 'NULL'} FROM rounds "
                               "WHERE round > ? ORDER BY round", (after,)).fetchall()
            total = con.execute("SELECT SUM(framed_bytes) FROM live_bytes" if live else
                                "SELECT SUM(framed_bytes) FROM messages WHERE role = 'sender'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return []
    return [{"round": r[0], "participants": _count(r[1]), "sampled": _count(r[2]), "failures": _count(r[3]),
             "metrics": json.loads(r[4] or "{}"), "bytes": int(total or 0) if final or r[5] is None else r[5],
             "pending": bool(live) and r[5] is None and not final}   # its live figure is not written yet
            for r in rows]


class RoundFollower:
    """Shows the rounds run.db records as they come (`read_progress`), on a `Progress` (or on
    nothing, quiet); both engines' launch loops poll it while the run goes on."""

    def __init__(self, db: Path, progress: "Progress | None", last: int) -> None:
        self.db = db
        self.progress = progress
        self.last = last       # the last round shown
        self.floor = last      # the round the run started after (0 resuming, -1 fresh)

    def poll(self) -> None:
        """Show every round recorded since the last look, up to one whose live byte figure the
        server has not written yet (it follows the round's row): that one waits for the next look."""
        for row in read_progress(self.db, self.last):
            if row["pending"]:
                break
            self.last = row["round"]
            if self.progress:
                self.progress.update(row)

    def finish(self) -> None:
        """After the run: the rounds recorded after the last look, then the last round again with
        the final byte total (every process's last figures are in), as the final table shows it."""
        self.poll()
        for row in read_progress(self.db, max(self.last - 1, self.floor), final=True):
            if self.progress:
                self.progress.update(row, final=True)


def _count(value) -> int:
    """A rounds count column: an INTEGER (schema 2) or JSON text of a count or a list (schema 1)."""
    if isinstance(value, str):
        value = json.loads(value)
    if isinstance(value, list):
        return len(value)
    return int(value or 0)


class Progress:
    """A tqdm bar on a terminal; one short line per `every` rounds otherwise."""

    def __init__(self, total: int, start: int = 0) -> None:
        self.tty = sys.stderr.isatty()
        self.total = total
        self.every = max(1, total // 10)
        self.bar = None
        if self.tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="round", dynamic_ncols=True)

    def update(self, row: dict, final: bool = False) -> None:
        """Show one round; the last round's line waits for `final` (the server has exited and
        every process's last byte totals are in), so it shows the final table's bytes."""
        m = row["metrics"]
        acc = m.get("test_accuracy", m.get("objective"))
        label = "acc" if "test_accuracy" in m else "obj"
        fields = {"ok": f"{row['participants']}/{row['sampled']}", "bytes": human_bytes(row["bytes"])}
        if row["failures"] > 0:
            fields["fail"] = row["failures"]
        if acc is not None:
            fields[label] = f"{acc:.4f}"
        if m.get("epsilon") is not None:   # [privacy]: epsilon at privacy.delta so far
            fields["eps"] = f"{m['epsilon']:.3g}"
        if self.bar is not None:
            self.bar.update(row["round"] - self.bar.n)
            self.bar.set_postfix(fields)
        elif (final and row["round"] == self.total) or \
                (not final and row["round"] % self.every == 0 and row["round"] != self.total):
            print(f"round {row['round']}/{self.total} " + " ".join(f"{k}={v}" for k, v in fields.items()),
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def final_table(run_dir: Path) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [f"run {run_dir.name}: {summary['status']}"      # the run is named by its folder (run id in run.db)
             + (f" ({summary['error']})" if summary.get("error") else ""),
             f"  algorithm {summary['algorithm']}, topology {summary['topology']}, transport {summary['transport']}"
             + (f", engine {summary['engine']}" if summary.get("engine") else ""),
             f"  rounds {summary['rounds_completed']}/{summary['rounds_planned']}, wall {summary['wall_seconds']:.1f}s, "
             f"parameters {'-' if summary['num_parameters'] is None else summary['num_parameters']}, failures {summary['failures']}, "
             f"clients dropped {summary.get('clients_dropped', 0)}"]
    final = summary.get("final", {})
    if final:
        lines.append("  final: " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))
    if summary.get("final_error"):
        lines.append(f"  final: none, the final evaluation failed: {summary['final_error']}")
    try:
        from fedhop.common.records.runstore import RunStore
        store = RunStore(run_dir / "run.db", create=False)
        try:
            by_dir = store.bytes_by_link_direction()
        finally:
            store.close()   # the last connection: no -wal/-shm files left beside run.db
    except Exception:  # the table is a courtesy; summary.json has the numbers
        by_dir = {}
    lines.append(f"  {'link':<14}{'direction':<10}{'messages':>10}{'tensor bytes':>16}{'framed bytes':>16}")
    for link, direction, row in ((ln, d, r) for ln, per in sorted(by_dir.items()) for d, r in sorted(per.items())):
        lines.append(f"  {link:<14}{direction:<10}{row['messages']:>10}{human_bytes(row['tensor_bytes']):>16}"
                     f"{human_bytes(row['framed_bytes']):>16}")
    total = summary["bytes"].get("total") or {}
    if total:
        lines.append(f"  {'total':<24}{total.get('messages', 0):>10}{human_bytes(total.get('tensor_bytes', 0)):>16}"
                     f"{human_bytes(total.get('framed_bytes', 0)):>16}")
    agreement = summary.get("ledger_agreement", {})
    if summary.get("status") == "stopped" and not agreement.get("ok") and not agreement.get("mismatched"):
        lines.append(f"  ledger: {agreement.get('matched')} messages recorded by both ends; "
                     f"{agreement.get('sender_only')} sender-only and {agreement.get('receiver_only')} receiver-only "
                     f"records were in flight when the run stopped (expected after a stop)")
    else:
        lines.append(f"  ledger: sender and receiver records agree: {agreement.get('ok')} "
                     f"(matched {agreement.get('matched')}, sender only {agreement.get('sender_only')}, "
                     f"receiver only {agreement.get('receiver_only')}, mismatched {agreement.get('mismatched')})")
    lines.append(f"  run directory: {run_dir}")
    return "\n".join(lines)


def start_dashboard(run_dir: Path, port: int):
    """The live run page, served after the children are forked (they must not inherit its thread)."""
    from fedhop.deploy.tools.dashboard import serve
    try:
        page, url = serve(run_dir, port)
    except OSError as exc:
        raise RuntimeError(f"--dashboard: cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
    print(f"fedhop run: dashboard at {url}", file=sys.stderr, flush=True)
    return page


def keep_serving(page) -> None:
    """After the run: the page stays up (showing the finished run) until Ctrl-C."""
    print("fedhop run: the run has ended; the dashboard stays up until Ctrl-C", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        page.shutdown()


def merge_interrupted(run_dir: Path) -> None:
    """After an interrupt: the children's ledgers into run.db, so the report shows what really
    crossed the wire (deploy/tools/ledgers.py; `fedhop merge-ledgers` does the same later)."""
    from fedhop.deploy.tools.ledgers import merge_run, stopped_agreement
    if not (run_dir / "run.db").is_file():
        return
    try:
        added, agreement = merge_run(run_dir)
    except Exception as exc:   # noqa: BLE001 - the run is over either way; say how to retry
        print(f"fedhop run: could not merge the ledgers ({exc}); run `fedhop merge-ledgers {run_dir}`",
              file=sys.stderr)
        return
    print(f"fedhop run: merged the ledgers of every process ({added} records); {stopped_agreement(agreement)}",
          file=sys.stderr)


#: bytes of memory one logical client costs the processes of a run on one machine, rounded up: its
#: client process's share (1.4 kB) and the server's (0.5 kB) with 1,000,000 clients
#: (docs/performance.md, "One million registered clients")
BYTES_PER_CLIENT = 2048


def clients_beyond_memory(count: int) -> str | None:
    """Why `clients.count` clients cannot be run on this machine (their bookkeeping alone would need
    more than its available memory), or None.  A data set with fewer samples than clients refuses
    the count later, once it is loaded; this check keeps a count in the billions from exhausting
    the machine's memory before that."""
    from fedhop.common.topologies.plan import memory_shortfall
    short = memory_shortfall(count, BYTES_PER_CLIENT)
    if short is None:
        return None
    need, available = short
    return (f"clients.count = {count:,} needs about {need / 2**30:,.1f} GiB of memory for the clients' bookkeeping "
            f"alone ({BYTES_PER_CLIENT} bytes each in the run's processes), more than the {available / 2**30:.1f} GiB "
            f"this machine has available")


STOP_GRACE = 60.0   # seconds the server has, after Ctrl-C, to record the stopped run and shut its children down


def default_run_dir(cfg: Config, parent: Path | None = None) -> Path:
    """A new folder `runs/NAME-seedS-YYYYmmdd-HHMMSS` in the working directory, held and claimed for
    this run (deploy/launch/runfolder.py `new_folder`: `-2`, `-3`, ... for runs started in the same second),
    so runs of one config with other seeds are told apart by their folders too."""
    stamp = run_stamp(cfg.run.name, cfg.run.seed)
    return new_folder((parent or Path.cwd() / "runs").resolve(), stamp, lambda folder: hold(folder) and claim(folder))


def absolute_paths(cfg: Config, base: Path) -> None:
    """Resolve the config's file-system paths against `base` (the folder the user ran fedhop in),
    so the run folder's config.toml means the same from any working directory (children, resume)."""
    def absolute(value: str) -> str:
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (base / path).resolve())

    cfg.data.data_dir = absolute(cfg.data.data_dir)
    if cfg.security.certs_dir:
        cfg.security.certs_dir = absolute(cfg.security.certs_dir)
    data_file = cfg.data.options.get("path")
    # a relative data.path is looked up in data.data_dir, then the working directory (common/tasks)
    if isinstance(data_file, str) and data_file and not (Path(cfg.data.data_dir) / data_file).exists() \
            and (base / data_file).exists():
        cfg.data.options["path"] = absolute(data_file)


USER_PLUGIN_PATH = os.environ.get(PLUGIN_PATH_ENV, "")   # as the user started fedhop (the API may run many configs)
PLUGIN_PATH_FILE = "plugin_path"   # the run's plug-in search path, for --resume from any folder


def plugin_search_path(config_path: str | Path) -> list[Path]:
    """Where a plug-in package that is not installed is looked for: the config's folder, then the
    working directory (common/util/plugins.py)."""
    folders = [Path(config_path).expanduser().resolve().parent, Path.cwd().resolve()]
    return list(dict.fromkeys(folders))


def export_plugin_path(config_path: str | Path) -> None:
    """Put the plug-in search path in the environment this process and its children read it from,
    after any folders the user set there."""
    have = [p for p in USER_PLUGIN_PATH.split(os.pathsep) if p]
    os.environ[PLUGIN_PATH_ENV] = os.pathsep.join(dict.fromkeys([*have, *map(str, plugin_search_path(config_path))]))


def loopback_plaintext_note(cfg: Config) -> str | None:
    """`fedhop run` on loopback without TLS sets security.insecure = true, and says so."""
    from fedhop.common.security.addresses import is_loopback
    sec = cfg.security
    if sec.certs_dir or sec.insecure or not is_loopback(cfg.transport.host):
        return None
    sec.insecure = True
    return ("fedhop run: plaintext gRPC on loopback (security.insecure = true); set security.certs_dir to a "
            "`fedhop certs` directory for TLS")


def finished_rounds(run_dir: Path) -> int | None:
    """The rounds a completed run's summary.json records, or None (no summary, not completed,
    unreadable).  Resuming from a checkpoint older than that re-runs the rounds after it."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("status") != "completed":
            return None
        return int(summary.get("rounds_completed"))
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def resume_local(run_dir: str, quiet: bool = False, show_table: bool = True, dashboard: int | None = None) -> int:
    """`fedhop run --resume RUN_DIR`: restart the server from its newest checkpoint and fresh
    client processes; the same exit codes as `run_local`."""
    from fedhop.common.records.checkpoint import CheckpointError, latest_checkpoint
    d = Path(run_dir).expanduser().resolve()
    if not (d / "config.toml").exists():
        why = ("no such folder" if not d.exists() else "a file, not a run folder" if not d.is_dir()
               else "holds no config.toml; is it a run directory?")
        print(f"fedhop run --resume: {run_dir}: {why}", file=sys.stderr)
        return 2
    done = finished_rounds(d)
    if in_use(d):
        print(f"fedhop run --resume: a run is still using {d}", file=sys.stderr)
        return 2
    if false_start(d):
        print(f"fedhop run --resume: the run in {d} ended before its first round, so there is nothing to resume; "
              f"start it again with `fedhop run CONFIG --out {run_dir}` (that folder is reused)", file=sys.stderr)
        return 2
    db = d / "run.db"
    from fedhop.common.records.runstore import foreign_schema_problem
    db_problem = ("run.db is not a file" if db.exists() and not db.is_file()
                  else foreign_schema_problem(db) if db.exists() else None)
    if db_problem:
        print(f"fedhop run --resume: {d}: {db_problem.replace('not a SQLite', 'run.db is not a SQLite', 1)}",
              file=sys.stderr)
        return 2
    try:
        ckpt = latest_checkpoint(d)
    except CheckpointError as exc:
        if done is not None:
            print(f"fedhop run --resume: the run in {d} is already completed (summary.json, {done} rounds); nothing "
                  f"to resume", file=sys.stderr)
        else:
            print(f"fedhop run --resume: {exc}", file=sys.stderr)
        return 2
    if done is not None and ckpt.round >= done:
        print(f"fedhop run --resume: the run in {d} is already completed (summary.json, {done} rounds); nothing to "
              f"resume", file=sys.stderr)
        return 2
    if not quiet:
        print(f"fedhop run: resuming {d} after round {ckpt.round}", file=sys.stderr)
    saved = (d / PLUGIN_PATH_FILE).read_text().strip() if (d / PLUGIN_PATH_FILE).is_file() else ""
    os.environ[PLUGIN_PATH_ENV] = saved or str(d)
    return run_local(str(d / "config.toml"), [], str(d), quiet=quiet, show_table=show_table, resume=True,
                     start_round=ckpt.round, dashboard=dashboard)


@contextlib.contextmanager
def folders_released() -> Iterator[None]:
    """The run folder a run holds (deploy/launch/runfolder.py) is let go when `run_local` returns."""
    count = held_count()
    try:
        yield
    finally:
        release_since(count)


def run_local(config_path: str, overrides: list[str], out: str | None, quiet: bool = False,
              show_table: bool = True, resume: bool = False, start_round: int = 0,
              dashboard: int | None = None, force: bool = False,
              on_run_dir: Callable[[Path], None] | None = None) -> int:
    """`fedhop run`, leaving this process's SIGINT and SIGTERM handlers as it found them.
    `on_run_dir` is told the run folder once it is chosen (the Python API, deploy/api.py)."""
    with signals_restored(), folders_released():
        stop_on_sigterm()   # SIGTERM (a scheduler, `timeout`, `kill`) stops the run as Ctrl-C does
        try:
            return _run_local(config_path, overrides, out, quiet, show_table, resume, start_round, dashboard, force,
                              on_run_dir)
        except (KeyboardInterrupt, Stopped) as exc:   # before any process started (or during a second Ctrl-C's kill)
            reason, code = stop_reason(exc)
            print(f"\nfedhop run: {reason}", file=sys.stderr)
            return code
        finally:   # a Python API caller's process keeps nothing the run built from its config
            forget_process_memos()


def _run_local(config_path: str, overrides: list[str], out: str | None, quiet: bool, show_table: bool,
               resume: bool, start_round: int, dashboard: int | None, force: bool,
               on_run_dir: Callable[[Path], None] | None) -> int:
    """`fedhop run`: returns the exit status (0 completed, 1 failed, 2 bad config or run folder,
    130 after Ctrl-C, 143 after SIGTERM: the run is then recorded as "stopped"; a stop that
    reaches the server after its last round's row leaves a completed run, 0).  Paths (the
    config, `out`, and the config's data_dir, data.path and certs_dir) are relative to the
    working directory; the run folder records them absolute.
    With `dashboard` (a port), the live run page is served from this process (deploy/tools/dashboard.py)
    once the children are started, and stays up after the run until Ctrl-C."""
    from fedhop.common.config import ConfigError
    if not resume:
        export_plugin_path(config_path)
    try:
        cfg = load_config(config_path, overrides)
    except (ConfigError, OSError) as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        return 2
    given_certs = cfg.security.certs_dir
    if not resume:   # a run folder's config.toml is resumed as written (its checkpoints carry its digest)
        absolute_paths(cfg, Path.cwd())
    try:   # a missing download: one line naming the file, before any process starts (common/data/datafiles.py)
        from fedhop.common.data.datafiles import check_data_files
        check_data_files(cfg)
    except (FileNotFoundError, ValueError) as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        return 2
    try:   # model.freeze / model.exchange name real parameters and leave some to exchange (common/models/exchange.py)
        from fedhop.common.models.exchange import check_model_selection
        check_model_selection(cfg)
        from fedhop.common.algorithms.vectorized import check_vectorized
        check_vectorized(cfg)   # [algorithm] vectorized: a task and a model that can train clients together
    except (FileNotFoundError, ValueError) as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        return 2
    if cfg.security.certs_dir and not Path(cfg.security.certs_dir).is_dir():
        print(f"fedhop run: security.certs_dir = '{given_certs}' is not a directory ({cfg.security.certs_dir}); "
              f"make one with `fedhop certs {given_certs} --nodes ...`", file=sys.stderr)
        return 2
    inprocess = cfg.run.engine == "inprocess"
    if not inprocess and transport(cfg.transport.kind).one_process:
        others = ", ".join(k for k, t in TRANSPORTS.items() if not t.one_process)
        print(f"fedhop run: transport.kind = '{cfg.transport.kind}' connects endpoints inside one process; process "
              f"runs use {others}, or set run.engine = \"inprocess\" (--engine inprocess)", file=sys.stderr)
        return 2
    too_many = clients_beyond_memory(cfg.clients.count)
    if too_many:   # before the process plan, which lists every client: a count in the billions would exhaust memory
        print(f"fedhop run: {too_many}", file=sys.stderr)
        return 2
    asked = any(d != "cpu" for d in (cfg.run.device, cfg.edges.device, cfg.clients.device))
    try:   # which process computes on which device: checked before anything starts (common/transport/placement.py)
        if not resume:
            resolve_config(cfg)
        devices = plan_devices(cfg, plan_processes(cfg))
    except DeviceError as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        return 2
    made = False   # whether this run made its folder (so a refusal removes it)
    try:
        if resume:
            assert out is not None   # resume_local passes the run folder
            run_dir = Path(out).resolve()
            if not hold(run_dir):
                raise RunDirError(f"--resume {out}: a run is still using {run_dir}")
        else:
            made = not out or not Path(out).expanduser().resolve().exists()
            run_dir = out_run_dir(out, force) if out else default_run_dir(cfg)
    except (RunDirError, OSError) as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        return 2
    if not resume:
        (run_dir / PLUGIN_PATH_FILE).write_text(os.environ.get(PLUGIN_PATH_ENV, "") + "\n")
    if on_run_dir is not None:
        on_run_dir(run_dir)
    if inprocess:
        code = run_inprocess(cfg, run_dir, quiet, show_table, resume, start_round, dashboard, devices)
        if code == 2 and not resume:   # refused while building the run: nothing ran
            give_back(run_dir, made)
        return code
    note = loopback_plaintext_note(cfg)
    if note and not quiet:
        print(note, file=sys.stderr)
    run = LocalRun(cfg, run_dir, devices=devices)
    if not quiet and (asked or any(d != "cpu" for d in devices.values())):
        print(f"fedhop run: devices: {describe(devices)}", file=sys.stderr)
    progress = page = None
    try:
        server = run.start(overrides=[], resume=resume)
        page = start_dashboard(run_dir, dashboard) if dashboard is not None else None
        progress = Progress(cfg.run.rounds, start=start_round) if not quiet else None
        rounds = RoundFollower(run_dir / "run.db", progress, start_round if resume else -1)
        registered = False
        while server.proc.poll() is None:
            raise_if_stopped()   # a Ctrl-C whose KeyboardInterrupt was lost in a library call
            if not registered:   # a child that dies before registration completes dooms the run: say so now
                registered = registration_complete(run_dir / "run.db")
                if not registered:
                    check_children_started(run)
            rounds.poll()
            for c in run.children[1:]:
                c.proc.poll()   # reap a child that exited; a dead client is the server's to notice and record
            try:
                server.proc.wait(0.2)   # returns as soon as the server exits
            except subprocess.TimeoutExpired:
                pass
        rounds.finish()   # once the children's last heartbeats are in, the last round's bytes are the final table's
        status = server.proc.returncode
    except (KeyboardInterrupt, Stopped) as exc:
        ignore_stops()
        reason, code = stop_reason(exc)
        again = "Ctrl-C again" if code == 128 + signal.SIGINT else "Ctrl-C"
        try:   # a second Ctrl-C lands in here, whenever it comes: every process is killed now
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.default_int_handler)
            print(f"\nfedhop run: {reason}; the server records the run as stopped ({again}: kill every "
                  "process now)", file=sys.stderr, flush=True)
            run.stop_all(server_grace=STOP_GRACE, server_signal=code - 128)
        except KeyboardInterrupt:
            ignore_stops()   # a third changes nothing: the kill below is never cut
            run.kill_all()
            record_server_lost(run_dir, "stopped", f"{reason}, then Ctrl-C again: every process was killed "
                                                   "before the server recorded the stop")
            print("fedhop run: Ctrl-C again: every process was killed; run.db records the run as stopped",
                  file=sys.stderr, flush=True)
        finally:
            ignore_stops()   # the processes are gone or stopping: the records below are written whole
        if progress:
            progress.close()
            progress = None
        # a read-only connection the signal cut off before its `finally` is closed here, so that the
        # merge's is the last one and SQLite folds the WAL into run.db
        gc.collect()
        merge_interrupted(run_dir)
        if show_table and (run_dir / "summary.json").exists():
            print(final_table(run_dir))
        fold_wal(run_dir / "run.db")
        # the server's verdict: a stop after the last round's row leaves a completed run (server/coordinator.py)
        return 0 if recorded_status(run_dir) == "completed" else code
    except RoleRefused as exc:   # the server's config, data set or credentials: one line, nothing ran
        print(f"fedhop run: {exc}", file=sys.stderr)
        run.stop_all()
        if not resume:
            give_back(run_dir, made)
        return 2
    except RuntimeError as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        run.stop_all()
        fold_wal(run_dir / "run.db")
        return 1
    finally:
        if progress:
            progress.close()
    run.stop_all()
    if (run_dir / "summary.json").exists():
        if show_table:
            print(final_table(run_dir))
    else:
        print(f"fedhop run: the server exited with status {status} and wrote no summary; last log lines:\n"
              f"{tail(run.children[0].log)}", file=sys.stderr)
        record_server_lost(run_dir, "failed", f"the server process exited with status {status} "
                                              "without recording the run's end")
        merge_interrupted(run_dir)   # what the other processes recorded, for a report of the run so far
        if (run_dir / "checkpoints").is_dir():
            print(f"fedhop run: continue it with `fedhop run --resume {run_dir}`", file=sys.stderr)
    fold_wal(run_dir / "run.db")   # one our progress reads held open as the server closed run.db (runstore.py)
    if page is not None:
        keep_serving(page)
    # the server's status: 0 completed, 128 + N stopped by signal N (one this launcher did not
    # take itself: it ignores SIGINT as a background job), else 1
    return status if status in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM) else 1


def recorded_status(run_dir: Path) -> str:
    """summary.json's status ('' without a readable one)."""
    try:
        return str(json.loads((run_dir / "summary.json").read_text()).get("status", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def run_inprocess(cfg: Config, run_dir: Path, quiet: bool, show_table: bool, resume: bool, start_round: int,
                  dashboard: int | None, devices: dict[str, str]) -> int:
    """`fedhop run` with run.engine = "inprocess" (deploy/launch/inprocess.py): every role in this process,
    the rounds in the main thread so that a stop signal ends them as it ends a server process's
    (Coordinator.run: recorded "stopped", children shut down, records written), and the progress
    lines from a thread that polls run.db as the process engine's loop does.  The same exit
    statuses as `_run_local`."""
    from fedhop.common.records.checkpoint import CheckpointError
    from fedhop.common.util.procexit import stop_on_sigterm
    from fedhop.deploy.launch.inprocess import LOG_NAME, RunLog, build, heap_frozen
    from fedhop.server.setup_stop import stopped_in_setup
    stop_on_sigterm(deferred=True)   # set-up is never cut: a stop noted now ends the run at its first wait
    started = time.monotonic()       # (but the task's and model's build is: Coordinator, `stops_raised`)
    progress = Progress(cfg.run.rounds, start=start_round) if not quiet else None
    rounds = RoundFollower(run_dir / "run.db", progress, start_round if resume else -1)
    done = threading.Event()
    follower = threading.Thread(target=_follow, args=(rounds, done), name="fedhop progress", daemon=True)
    page = None
    try:
        with RunLog(run_dir / "logs" / LOG_NAME, cfg.run.log_level):
            try:
                engine = build(cfg, run_dir, devices, resume_run=resume)
            except (KeyboardInterrupt, Stopped) as exc:   # the build of the task and model cut (server/setup_stop.py)
                code, said = stopped_in_setup(cfg, run_dir, exc, resume, time.monotonic() - started)
                print(f"\nfedhop run: {said}", file=sys.stderr, flush=True)
                return code
            except (RuntimeError, ValueError, FileNotFoundError, CheckpointError) as exc:
                # ValueError, FileNotFoundError: the config's data set, model or files refused, and
                # CheckpointError: a run folder that cannot be resumed (exit 2, as the server
                # process's refusal); RuntimeError: a run that failed
                print(f"fedhop run: {exc}", file=sys.stderr)
                return 1 if isinstance(exc, RuntimeError) and not isinstance(exc, CheckpointError) else 2
            try:
                page = start_dashboard(run_dir, dashboard) if dashboard is not None else None
            except RuntimeError as exc:
                engine.close()
                print(f"fedhop run: {exc}", file=sys.stderr)
                return 1
            follower.start()
            with heap_frozen():
                summary = engine.run()
        stop_on_sigterm()   # the run is over: a stop signal is raised again (it ends `keep_serving`)
    finally:
        done.set()
        if follower.is_alive():
            follower.join()
        if progress:
            progress.close()
    if summary["status"] == "stopped":
        print(f"\nfedhop run: {summary['error']}; the run is recorded as stopped", file=sys.stderr, flush=True)
    if show_table:
        print(final_table(run_dir))
    fold_wal(run_dir / "run.db")   # one the progress thread held open as the engine closed run.db (runstore.py)
    if page is not None and summary["status"] != "stopped":   # a stopped run ends at once, as a process run does
        keep_serving(page)
    elif page is not None:
        page.shutdown()
    return _inprocess_status(summary, engine.coordinator.stop_status)


def _follow(rounds: RoundFollower, done: threading.Event, every: float = 0.2) -> None:
    """The in-process engine's progress thread: poll run.db until the run has ended, then show
    the last rounds with the final figures."""
    while not done.wait(every):
        rounds.poll()
    rounds.finish()


def _inprocess_status(summary: dict, stop_status: int) -> int:
    """The exit status of an in-process run, as a server process's: 0 completed, 128 + N when
    signal N stopped it, 1 failed."""
    if summary["status"] == "completed":
        return 0
    if summary["status"] == "stopped":
        return stop_status
    return 1
