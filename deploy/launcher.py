"""`fedhop run`: start every process of a run on this machine, show progress, clean up.

The server and each client process are separate OS processes on free loopback ports.  Their
output goes to `RUN_DIR/logs/<node>.log`.  Children die with the launcher (PR_SET_PDEATHSIG
on Linux) and are terminated on success, failure or Ctrl-C, so nothing is left behind.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedhop.common.config import Config, config_to_toml, load_config
from fedhop.common.topology import cluster_assignment
from fedhop.deploy.forkstart import ForkedProcess, die_with_parent, fork_allowed, fork_module
from fedhop.deploy.malloc import tuned_env

REPO_ROOT = Path(__file__).resolve().parents[1]


def client_blocks(count: int, processes: int) -> list[list[int]]:
    """Logical clients 0..count-1 split into `processes` contiguous, near-equal blocks."""
    processes = max(1, min(processes, count))
    base, extra = divmod(count, processes)
    out, start = [], 0
    for p in range(processes):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def id_spec(ids: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5' for the client command line."""
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(f"{ids[i]}-{ids[j]}" if j > i else str(ids[i]))
        i = j + 1
    return ",".join(parts)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | ForkedProcess
    log: Path


@dataclass
class LocalRun:
    """The processes of one run on this machine."""

    cfg: Config
    run_dir: Path
    children: list[Child] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    def spawn(self, name: str, argv: list[str]) -> Child:
        log = self.run_dir / "logs" / f"{name}.log"
        env = dict(tuned_env(), FEDHOP_TOKEN=self.token, PYTHONUNBUFFERED="1")
        module = f"fedhop.{argv[0]}"
        if fork_allowed():   # start-up without re-importing torch (deploy/forkstart.py)
            proc = fork_module(module, argv[1:], env, log, REPO_ROOT)
        else:
            with open(log, "ab") as fh:
                proc = subprocess.Popen([sys.executable, "-m", module, *argv[1:]], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                        cwd=REPO_ROOT, preexec_fn=die_with_parent if sys.platform == "linux" else None)
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def security_args(self) -> list[str]:
        """The client and edge flags that match the config's [security] section."""
        sec = self.cfg.security
        out = ["--certs-dir", str(Path(sec.certs_dir).resolve())] if sec.certs_dir else []
        return out + (["--mtls"] if sec.mtls else []) + (["--insecure"] if sec.insecure else [])

    def start(self, overrides: list[str], resume: bool = False) -> Child:
        """Start the server (continuing from its checkpoint with `resume`), the edges and the
        client processes all at once, so their start-up (imports, above all torch's) overlaps:
        each child reads its parent's address from the file the parent writes once it serves
        (`--parent-file`).  Returns once the server serves."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "ledger").mkdir(parents=True, exist_ok=True)
        cfg_path = self.run_dir / "config.toml"
        cfg_path.write_text(config_to_toml(self.cfg))
        port_file = self.run_dir / "server.address"
        port_file.unlink(missing_ok=True)
        host = self.cfg.transport.host
        server = self.spawn("server", ["server", "--config", str(cfg_path), "--run-dir", str(self.run_dir),
                                       "--listen", f"{host}:0", "--port-file", str(port_file)]
                            + (["--resume"] if resume else []))
        for p, (parent_file, ids) in enumerate(self.client_layout(port_file)):
            self.spawn(f"client-proc{p}", ["client", "--parent-file", str(parent_file), "--clients", id_spec(ids),
                                           "--node-id", f"client-proc{p}", "--listen", f"{host}:0",
                                           "--ledger-dir", str(self.run_dir / "ledger"),
                                           "--max-message-bytes", str(self.cfg.transport.max_message_bytes),
                                           "--threads", str(self.cfg.run.torch_threads)] + self.security_args())
        self._wait_for_address(server, port_file)
        return server

    def client_layout(self, server_file: Path) -> list[tuple[Path, list[int]]]:
        """(parent's address file, client ids) per client process.  Star: blocks of all clients
        under the server.  Hierarchical and sequential: start the edges, then split each edge's
        cluster over its share of `clients.processes` (at least one process per edge)."""
        cfg = self.cfg
        if cfg.topology.kind not in ("hierarchical", "sequential"):   # sequential: Fed-CHS edges (edge/sequential.py)
            return [(server_file, ids) for ids in client_blocks(cfg.clients.count, cfg.clients.processes)]
        clusters = cluster_assignment(cfg)
        per_edge = max(1, cfg.clients.processes // len(clusters))
        layout = []
        for e, cluster in enumerate(clusters):
            port_file = self.run_dir / f"edge-{e}.address"
            port_file.unlink(missing_ok=True)
            self.spawn(f"edge-{e}", ["edge", "--parent-file", str(server_file), "--node-id", f"edge-{e}",
                                     "--listen", f"{cfg.transport.host}:0", "--port-file", str(port_file),
                                     "--ledger-dir", str(self.run_dir / "ledger"),
                                     "--max-message-bytes", str(cfg.transport.max_message_bytes)]
                       + self.security_args())
            for block in client_blocks(len(cluster), per_edge):
                layout.append((port_file, [cluster[i] for i in block]))
        return layout

    @staticmethod
    def _wait_for_address(server: Child, port_file: Path, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port_file.exists():
                return port_file.read_text().strip()
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with status {server.proc.returncode} before serving; "
                                   f"last log lines:\n{tail(server.log)}")
            time.sleep(0.05)
        raise RuntimeError(f"{server.name} did not start serving within {timeout:.0f}s; see {server.log}")

    def stop_all(self, grace: float = 5.0) -> None:
        """Terminate every child still running; kill those that do not exit within `grace`."""
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
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
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


def read_progress(db: Path, after: int) -> list[dict]:
    """Rounds recorded in run.db after round `after`, each with the framed bytes sent up to and
    including it (read-only; the server may be writing)."""
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = con.execute("SELECT round, participants, sampled, failures, metrics_json FROM rounds "
                               "WHERE round > ? ORDER BY round", (after,)).fetchall()
            per_round = dict(con.execute("SELECT round, SUM(framed_bytes) FROM messages WHERE role = 'sender' "
                                         "GROUP BY round").fetchall())
        finally:
            con.close()
    except sqlite3.Error:
        return []
    out = []
    for r in rows:
        cumulative = sum(b for rnd, b in per_round.items() if rnd <= r[0])
        out.append({"round": r[0], "participants": r[1], "sampled": r[2], "failures": r[3],
                    "metrics": json.loads(r[4] or "{}"), "bytes": cumulative})
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


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

    def update(self, row: dict) -> None:
        m = row["metrics"]
        acc = m.get("test_accuracy", m.get("objective"))
        label = "acc" if "test_accuracy" in m else "obj"
        fields = {"ok": f"{row['participants']}/{row['sampled']}", "bytes": human_bytes(row["bytes"])}
        if row["failures"]:
            fields["fail"] = row["failures"]
        if acc is not None:
            fields[label] = f"{acc:.4f}"
        if self.bar is not None:
            self.bar.update(row["round"] - self.bar.n)
            self.bar.set_postfix(fields)
        elif row["round"] % self.every == 0 or row["round"] == self.total:
            print(f"round {row['round']}/{self.total} " + " ".join(f"{k}={v}" for k, v in fields.items()),
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def final_table(run_dir: Path) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [f"run {summary['run_id']}: {summary['status']}"
             + (f" ({summary['error']})" if summary.get("error") else ""),
             f"  algorithm {summary['algorithm']}, topology {summary['topology']}, transport {summary['transport']}",
             f"  rounds {summary['rounds_completed']}/{summary['rounds_planned']}, wall {summary['wall_seconds']:.1f}s, "
             f"parameters {summary['num_parameters']}, failures {summary['failures']}, "
             f"clients dropped {summary.get('clients_dropped', 0)}"]
    final = summary.get("final", {})
    if final:
        lines.append("  final: " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))
    try:
        from fedhop.common.runstore import RunStore
        by_dir = RunStore(run_dir / "run.db", create=False).bytes_by_link_direction()
    except Exception:  # the table is a courtesy; summary.json has the numbers
        by_dir = {}
    lines.append(f"  {'link':<14}{'direction':<10}{'messages':>10}{'tensor bytes':>16}{'framed bytes':>16}")
    for link, direction, row in ((l, d, r) for l, per in sorted(by_dir.items()) for d, r in sorted(per.items())):
        lines.append(f"  {link:<14}{direction:<10}{row['messages']:>10}{human_bytes(row['tensor_bytes']):>16}"
                     f"{human_bytes(row['framed_bytes']):>16}")
    total = summary["bytes"].get("total") or {}
    if total:
        lines.append(f"  {'total':<24}{total.get('messages', 0):>10}{human_bytes(total.get('tensor_bytes', 0)):>16}"
                     f"{human_bytes(total.get('framed_bytes', 0)):>16}")
    agreement = summary.get("ledger_agreement", {})
    lines.append(f"  ledger: sender and receiver records agree: {agreement.get('ok')} "
                 f"(matched {agreement.get('matched')}, sender only {agreement.get('sender_only')}, "
                 f"receiver only {agreement.get('receiver_only')}, mismatched {agreement.get('mismatched')})")
    lines.append(f"  run directory: {run_dir}")
    return "\n".join(lines)


def default_run_dir(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def loopback_plaintext_note(cfg: Config) -> str | None:
    """`fedhop run` on loopback without TLS sets security.insecure = true, and says so."""
    from fedhop.common.addresses import is_loopback
    sec = cfg.security
    if sec.certs_dir or sec.insecure or not is_loopback(cfg.transport.host):
        return None
    sec.insecure = True
    return ("fedhop run: plaintext gRPC on loopback (security.insecure = true); set security.certs_dir to a "
            "`fedhop certs` directory for TLS")


def resume_local(run_dir: str, quiet: bool = False, show_table: bool = True) -> int:
    """`fedhop run --resume RUN_DIR`: restart the server from its newest checkpoint and fresh
    client processes; the same exit codes as `run_local`."""
    from fedhop.common.checkpoint import CheckpointError, latest_checkpoint
    d = Path(run_dir)
    if not (d / "config.toml").exists():
        print(f"fedhop run --resume: {d} holds no config.toml; is it a run directory?", file=sys.stderr)
        return 2
    try:
        ckpt = latest_checkpoint(d)
    except CheckpointError as exc:
        print(f"fedhop run --resume: {exc}", file=sys.stderr)
        return 2
    if not quiet:
        print(f"fedhop run: resuming {d} after round {ckpt.round}", file=sys.stderr)
    return run_local(str(d / "config.toml"), [], str(d), quiet=quiet, show_table=show_table, resume=True,
                     start_round=ckpt.round)


def run_local(config_path: str, overrides: list[str], out: str | None, quiet: bool = False,
              show_table: bool = True, resume: bool = False, start_round: int = 0) -> int:
    """`fedhop run`: returns the exit status (0 completed, 1 failed, 2 bad config, 130 interrupted)."""
    from fedhop.common.config import ConfigError
    try:
        cfg = load_config(config_path, overrides)
    except (ConfigError, OSError) as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(out) if out else default_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.transport.kind == "inmemory":
        print("fedhop run: transport.kind = 'inmemory' is for unit tests (deploy/inmemory.py); "
              "process runs use grpc or torch", file=sys.stderr)
        return 2
    note = loopback_plaintext_note(cfg)
    if note and not quiet:
        print(note, file=sys.stderr)
    run = LocalRun(cfg, run_dir)
    progress = None
    try:
        server = run.start(overrides=[], resume=resume)
        progress = Progress(cfg.run.rounds, start=start_round) if not quiet else None
        last = start_round if resume else -1
        registered = False
        while server.proc.poll() is None:
            if not registered:   # a child that dies before registration completes dooms the run: say so now
                registered = registration_complete(run_dir / "run.db")
                if not registered:
                    check_children_started(run)
            for row in read_progress(run_dir / "run.db", last):
                last = row["round"]
                if progress:
                    progress.update(row)
            for c in run.children[1:]:
                c.proc.poll()   # reap a child that exited; a dead client is the server's to notice and record
            try:
                server.proc.wait(0.2)   # returns as soon as the server exits
            except subprocess.TimeoutExpired:
                pass
        for row in read_progress(run_dir / "run.db", last):
            if progress:
                progress.update(row)
        status = server.proc.returncode
    except KeyboardInterrupt:
        print("\nfedhop run: interrupted; stopping every process", file=sys.stderr)
        run.stop_all()
        return 130
    except RuntimeError as exc:
        print(f"fedhop run: {exc}", file=sys.stderr)
        run.stop_all()
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
        if (run_dir / "checkpoints").is_dir():
            print(f"fedhop run: continue it with `fedhop run --resume {run_dir}`", file=sys.stderr)
    return 0 if status == 0 else 1
