"""`python -m fedhop.deploy.launch.role server|edge|client|health ...`: what each docker compose service runs.

It turns the environment of a container (the experiment, the shared run volume, the token) into
the command line of `python -m fedhop.server|edge|client` and runs it, so the process a compose
service runs is the same one `fedhop run` and `fedhop launch` start.

Ending in order: `docker compose up --abort-on-container-exit --exit-code-from server` stops every
container as soon as the first one exits, so the server's container must be the first.  The role
waits for its process, passing SIGTERM and SIGINT on while it runs.  The server's role then writes
the process's exit status to `RUN/server.exit` and exits with it, ignoring a SIGTERM that arrives
after the process ended.  An edge or client whose process ended with status 0 (the server shut it
down) stays until `RUN/server.exit` exists (at most `FEDHOP_LINGER` seconds, default 120) or a
SIGTERM comes, then exits with the run's status (the one in `RUN/server.exit`; 0 when it never
appeared); one that failed exits at once with its own status.

Environment (docker-compose.yml sets it):

- `FEDHOP_CONFIG`: the experiment file (baked into the image under /app/examples, or mounted).
- `FEDHOP_SET`: config overrides, `section.key=value` separated by spaces (shell quoting).
- `FEDHOP_RUNS`: the run volume (default /runs).  The server makes `RUNS/<run name>` and writes its
  name to `RUNS/current`; the others wait for that file and write their ledgers there.
- `FEDHOP_RUN_NAME`: the run directory's name (default `<run.name>-<UTC time>`).
- `FEDHOP_CERTS_DIR`, `FEDHOP_MTLS=1`, `FEDHOP_INSECURE=1`: the processes' security (common/security/
  auth.py add_security_args).  With `FEDHOP_MTLS=1` and a certificate folder holding only this
  node's files (deploy/k8s/base: the pod's own Secret) each node's certificate is its identity and
  no run token exists.  A role whose process could not start with them (plaintext off loopback
  without `FEDHOP_INSECURE=1`, `FEDHOP_MTLS=1` without a folder, a folder without this node's
  files) ends with one line and status 2 before it announces or joins a run.
- `FEDHOP_TOKEN`: the shared registration token of the shared-token quick try (no per-node
  credentials): when empty the server draws one and leaves it in `RUN/.token` (mode 0600) on the
  volume, which only this project's containers mount.  Every holder can mint any node's token;
  each process says so in one line at start.
- `FEDHOP_REGISTER_TIMEOUT`: seconds the server waits for every client to register (default 300:
  containers start after the server is healthy, and each imports torch first, which on a loaded
  machine took more than the server's own default of 120 s).
- `FEDHOP_CLIENT_PROCESSES`: how many client replicas share the logical clients, or `auto`
  (the default): the replicas announce themselves in `RUN/replicas/`, and once no new one has
  appeared for `FEDHOP_SETTLE` seconds (default 3) the first to notice fixes the count in
  `RUN/replicas.count`.  So `docker compose up --scale client=8` needs nothing else.  The server's
  role waits for that count before it starts the server process with `clients.processes` set to
  it, so the run's config.toml records the processes that ran.
- `FEDHOP_REPLICA`: this replica's identity in `RUN/replicas/` and `RUN/slots/` (default
  `<hostname>-<address>`, unique per container).

Errors in what the environment gives (the config file, its keys, these variables) end the role
with one line on stderr and exit status 2, as `fedhop run` does.

Kubernetes (deploy/k8s) sets `FEDHOP_SLOT`, the client Job's completion index, which is then the
client's slot (with `FEDHOP_CLIENT_PROCESSES` the number of indexes, nothing is claimed).  There
every role is a Job's pod, so each role ending with the run's status is what ends the Jobs.
`FEDHOP_HOLD=1` keeps a role's process running once its part of the run is over (until SIGTERM
or SIGINT), for a controller that would restart an exited container into a second run.

A client replica claims a slot (`RUN/slots/<k>`, created with O_EXCL, holding the replica's
identity so a restarted container gets its slot back), hosts the k-th block of logical clients
of the same layout `fedhop run` uses, registers with the server or with `edge-<e>` (found by
service name), and advertises the address of its interface on the route to the server.  It
starts its process once that parent accepts connections (the clients start with the server's
container, not after its health check: the server's role may be waiting for their count).
"""
from __future__ import annotations

import argparse
import json
import logging
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
from pathlib import Path

from fedhop.common.util.cliparser import ArgumentParser, port_number
from fedhop.common.util.procexit import exit_now

log = logging.getLogger("fedhop.role")


SERVER_EXIT = "server.exit"


class UsageError(Exception):
    """A bad config or environment variable: one line and exit status 2 (main)."""


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, "") or default


def overrides() -> list[str]:
    try:
        return shlex.split(env("FEDHOP_SET"))
    except ValueError as exc:
        raise UsageError(f"FEDHOP_SET={env('FEDHOP_SET')!r}: {exc}") from None


def seconds(name: str, default: str) -> float:
    """A duration in seconds from the environment variable `name`."""
    text = env(name, default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{name}={text!r}: a number of seconds > 0")
    return value


def load_cfg(extra: list[str] | None = None):
    from fedhop.common.config import load_config
    return load_config(env("FEDHOP_CONFIG", "/app/examples/fedavg_digits.toml"), overrides() + (extra or []))


def runs_root() -> Path:
    return Path(env("FEDHOP_RUNS", "/runs"))


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None, socket.AF_INET)
        return True
    except OSError:
        return False


def wait_for_run(server: str, timeout: float = 300.0, gone_after: float = 20.0) -> Path:
    """The current run directory, once the server (HOST:PORT) has announced it.

    Gives up when the server's name has not resolved for `gone_after` seconds: a container that
    compose started while it was already aborting the run (the server's container stopped, so its
    name is gone from the network's DNS) leaves at once instead of after `timeout`."""
    current = runs_root() / "current"
    host, _ = split_address(server)
    deadline = time.monotonic() + timeout
    last_resolved = time.monotonic()
    while time.monotonic() < deadline:
        if resolves(host):
            last_resolved = time.monotonic()
        elif time.monotonic() - last_resolved > gone_after:
            raise SystemExit(f"deploy.launch.role: the server {host} does not resolve (for {gone_after:.0f} s) and "
                             f"announced no run in {current}: leaving")
        try:
            name = current.read_text().strip()
        except OSError:
            name = ""
        # a finished run (its server.exit written) is an earlier run's announcement, left on the
        # volume: the clients start with the server's container and may read it before it is replaced
        if name and (runs_root() / name).is_dir() and not (runs_root() / name / SERVER_EXIT).exists():
            return runs_root() / name
        time.sleep(0.2)
    raise SystemExit(f"deploy.launch.role: no run announced in {current} after {timeout:.0f}s (is the server up?)")


def per_node_mode() -> bool:
    """Mutual TLS with each node's own certificate (FEDHOP_MTLS=1 and FEDHOP_CERTS_DIR, what
    deploy/k8s/base sets): the certificate is the identity, so no run token is drawn or shared."""
    return env("FEDHOP_MTLS") == "1" and bool(env("FEDHOP_CERTS_DIR"))


def security_problem(addresses: list[str], node_id: str | None = None) -> str | None:
    """Why this role's process could not start with the security the environment gives (None
    when it can), decided before the role announces or joins a run: plaintext off loopback
    without FEDHOP_INSECURE=1, FEDHOP_MTLS=1 without FEDHOP_CERTS_DIR, and a certificate folder
    without this node's files (a missing or wrong Secret)."""
    from fedhop.common.security.addresses import plaintext_refusal
    from fedhop.common.security.auth import CA_CERT
    certs = env("FEDHOP_CERTS_DIR")
    if env("FEDHOP_MTLS") == "1" and not certs:
        return "FEDHOP_MTLS=1 needs FEDHOP_CERTS_DIR (the folder holding ca.pem and this node's NODE.pem / NODE.key)"
    refusal = plaintext_refusal(addresses, env("FEDHOP_INSECURE") in ("1", "true"), tls=bool(certs))
    if refusal:
        return (f"{refusal} (in a container: FEDHOP_CERTS_DIR=DIR and FEDHOP_MTLS=1 for mutual TLS, "
                f"or FEDHOP_INSECURE=1 for plaintext)")
    if certs and node_id is not None:
        missing = [n for n in (CA_CERT, f"{node_id}.pem", f"{node_id}.key") if not (Path(certs) / n).is_file()]
        if missing:
            return (f"FEDHOP_CERTS_DIR={certs} has no {', '.join(missing)} for node {node_id} (mount its Secret "
                    f"fedhop-node-{node_id}: deploy/k8s/node-secrets.sh)")
    return None


def check_security(addresses: list[str], node_id: str | None = None) -> None:
    problem = security_problem(addresses, node_id)
    if problem:
        raise UsageError(f"refusing to start: {problem}")


def token_for(run_dir: Path, timeout: float = 60.0) -> str:
    if env("FEDHOP_TOKEN"):
        return env("FEDHOP_TOKEN")
    if per_node_mode():
        return ""
    path = run_dir / ".token"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return text
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"deploy.launch.role: FEDHOP_TOKEN is empty and {path} did not appear")


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"address {address!r} must be HOST:PORT")
    return host, int(port)


def local_ip_towards(address: str, timeout: float = 120.0) -> str:
    """This machine's address on the route to `address` (a UDP connect sends nothing)."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"deploy.launch.role: cannot find a route to {address}: {exc}") from None
            time.sleep(0.5)


def _run(role: str, args: list[str], token: str) -> int:
    """Run `python -m fedhop.<role> ARGS` and return its exit status, passing SIGTERM and SIGINT on.

    The process's output goes to this role's stdout (what `docker compose logs` shows) and to
    RUN/logs/NODE.log in the run folder (the run named by --run-dir, or the folder above
    --ledger-dir; NODE from --node-id, else `server`), as `fedhop run` keeps it: a host folder in
    compose, so the log of a container that was killed or removed stays with the run.  Each chunk
    is written to the file as it arrives, so a SIGKILL loses nothing already read."""
    import threading

    from fedhop.deploy.launch.malloc import tuned_env
    child_env = tuned_env()
    child_env["FEDHOP_TOKEN"] = token
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    argv = [sys.executable, "-m", f"fedhop.{role}", *args]
    after = dict(zip(args, args[1:]))        # each flag's value
    run_dir = Path(after["--run-dir"]) if "--run-dir" in after else (
        Path(after["--ledger-dir"]).parent if "--ledger-dir" in after else None)
    log_fd = -1
    if run_dir is not None:
        log_path = run_dir / "logs" / f"{after.get('--node-id', 'server')}.log"
        try:
            log_path.parent.mkdir(exist_ok=True)
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            log.warning("no log file in the run folder (%s): the output goes to stdout only", exc)
    command = " ".join(shlex.quote(a) for a in argv)
    log.info("run %s", command)
    sys.stdout.flush()
    if log_fd >= 0:
        os.write(log_fd, f"{time.strftime('%Y-%m-%d %H:%M:%S')} role-{role} run {command}\n".encode())
    proc = subprocess.Popen(argv, env=child_env, stdout=subprocess.PIPE if log_fd >= 0 else None,
                            stderr=subprocess.STDOUT if log_fd >= 0 else None)

    def copy_output() -> None:
        assert proc.stdout is not None
        out = sys.stdout.fileno()
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            os.write(log_fd, chunk)
            try:
                os.write(out, chunk)
            except OSError:
                pass                          # stdout gone: the file still gets everything

    copier = threading.Thread(target=copy_output, name="log-copy", daemon=True) if log_fd >= 0 else None
    if copier is not None:
        copier.start()

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)   # the status is decided: a late stop request cannot change it
    if copier is not None:
        copier.join(timeout=5.0)             # the rest of the output (a child it left may hold the pipe)
    return 128 - code if code < 0 else code  # killed by signal N: 128+N, as a shell reports it


def linger_until_server_exits(run_dir: Path, timeout: float) -> int:
    """Wait (bounded) for the server's role to record its exit status, or for a SIGTERM; the
    run's status: the recorded one, or 0 when none was recorded (this process's part went well)."""
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    deadline = time.monotonic() + timeout
    marker = run_dir / SERVER_EXIT
    while not stop["now"] and time.monotonic() < deadline and not marker.exists():
        time.sleep(0.2)
    try:
        text = marker.read_text().strip()
    except OSError:
        log.warning("leaving before the server's role ended (%s)", "SIGTERM" if stop["now"] else f"{timeout:.0f} s")
        return 0
    log.info("the server's role ended with status %s; leaving", text)
    return int(text) if text.lstrip("-").isdigit() else 0


def _run_member(role: str, args: list[str], token: str, run_dir: Path) -> int:
    """An edge's or client's role: its own status when its process failed, else the run's (the
    server's role's), so that a Kubernetes Job of clients fails when the run failed."""
    code = _run(role, args, token)
    if code == 0:
        code = linger_until_server_exits(run_dir, float(env("FEDHOP_LINGER", "120")))
    return hold(code)


def hold(code: int) -> int:
    """With FEDHOP_HOLD=1, stay until SIGTERM or SIGINT before leaving with `code` (see module doc)."""
    if env("FEDHOP_HOLD") == "1":
        log.info("part of the run over (status %d); holding until stopped (FEDHOP_HOLD=1)", code)
        stop = {signal.SIGTERM, signal.SIGINT}
        for sig in stop:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        signal.sigwait(stop)
    return code


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def fixed_processes() -> int | None:
    """FEDHOP_CLIENT_PROCESSES as a number, or None for `auto`."""
    n = env("FEDHOP_CLIENT_PROCESSES", "auto")
    if n == "auto":
        return None
    if not (n.isdigit() and int(n) > 0):
        raise UsageError(f"FEDHOP_CLIENT_PROCESSES={n!r}: a positive number or 'auto'")
    return int(n)


def processes_override() -> list[str]:
    n = fixed_processes()
    return [f"clients.processes={n}"] if n is not None else []


def wait_for_replica_count(run_dir: Path, timeout: float) -> int:
    """The count the client replicas fixed in RUN/replicas.count (FEDHOP_CLIENT_PROCESSES=auto)."""
    count_file = run_dir / "replicas.count"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(count_file.read_text())
        except (OSError, ValueError):
            time.sleep(0.2)
    raise SystemExit(f"deploy.launch.role: no client replica announced itself in {run_dir / 'replicas'} within "
                     f"{timeout:.0f} s (FEDHOP_REGISTER_TIMEOUT)")


# ----------------------------------------------------------------------------- roles
def cmd_server(a: argparse.Namespace) -> int:
    cfg = load_cfg(processes_override())   # fail here, with the key named, before announcing a run
    check_security([a.listen], "server")
    register_timeout = seconds("FEDHOP_REGISTER_TIMEOUT", "300")
    root = runs_root()
    root.mkdir(parents=True, exist_ok=True)
    (root / "current").unlink(missing_ok=True)
    from fedhop.deploy.launch.runfolder import run_stamp
    name = env("FEDHOP_RUN_NAME", run_stamp(cfg.run.name, cfg.run.seed, utc=True))
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise UsageError(f"FEDHOP_RUN_NAME={name!r}: use letters, digits, '.', '_' and '-'")
    run_dir = root / name
    (run_dir / "ledger").mkdir(parents=True, exist_ok=True)
    for stale in ("slots", "replicas"):   # a reused FEDHOP_RUN_NAME starts with no claims
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    for stale in ("replicas.count", SERVER_EXIT):
        (run_dir / stale).unlink(missing_ok=True)
    token = env("FEDHOP_TOKEN")
    if not token and not per_node_mode():   # the shared token of a quick try (announced by every process)
        token = secrets.token_hex(16)
        _write_atomic(run_dir / ".token", token + "\n", 0o600)
    _write_atomic(root / "current", name + "\n")
    log.info("run directory %s", run_dir)
    processes = processes_override()
    if not processes:   # auto: the replicas' count, so that config.toml records the processes that ran
        n = wait_for_replica_count(run_dir, register_timeout)
        processes = [f"clients.processes={n}"]
        load_cfg(processes)
        log.info("%d client replicas: clients.processes = %d", n, n)
    args = ["--config", env("FEDHOP_CONFIG", "/app/examples/fedavg_digits.toml"), "--run-dir", str(run_dir),
            "--listen", a.listen, "--register-timeout", f"{register_timeout:g}"]
    for o in overrides() + processes + security_overrides():
        args += ["--set", o]
    code = _run("server", args, token)
    if code != 0:   # killed (the kernel's OOM killer, SIGKILL) or crashed before it recorded the run's end
        lost_run(run_dir, code)
    _write_atomic(run_dir / SERVER_EXIT, f"{code}\n")
    return hold(code)


def lost_run(run_dir: Path, code: int) -> None:
    """run.db's run, when the server process exited with status `code` without recording its end,
    becomes `failed` (`stopped` after a SIGTERM or SIGINT this role passed on) with a `server_lost`
    event, as `fedhop run` records it (deploy/launch/runfolder.py `record_server_lost`); a run the
    server recorded is left as it is."""
    from fedhop.deploy.launch.runfolder import record_server_lost
    stopped = code in (128 + signal.SIGTERM, 128 + signal.SIGINT)
    record_server_lost(run_dir, "stopped" if stopped else "failed",
                       f"the server process exited with status {code} without recording the run's end")
    if (run_dir / "run.db").is_file() and not (run_dir / "summary.json").is_file():
        log.warning("the server process exited with status %d without recording the run's end: run.db records "
                    "the run as %s (server_lost); `fedhop merge-ledgers %s` adds the other processes' ledgers "
                    "once they have ended", code, "stopped" if stopped else "failed", run_dir)


def security_overrides() -> list[str]:
    """The server's [security] keys from FEDHOP_INSECURE / FEDHOP_CERTS_DIR / FEDHOP_MTLS, the
    variables the edge and client processes read (common/security/auth.py add_security_args)."""
    out = []
    if env("FEDHOP_INSECURE") in ("1", "true"):
        out.append("security.insecure=true")
    if env("FEDHOP_CERTS_DIR"):
        out.append(f"security.certs_dir={json.dumps(env('FEDHOP_CERTS_DIR'))}")
    if env("FEDHOP_MTLS") == "1":
        out.append("security.mtls=true")
    return out


def cmd_edge(a: argparse.Namespace) -> int:
    cfg = load_cfg()
    check_security([a.parent, a.listen], a.node_id)
    run_dir = wait_for_run(a.parent)
    token = token_for(run_dir)
    return _run_member("edge", ["--parent", a.parent, "--node-id", a.node_id, "--listen", a.listen,
                                "--ledger-dir", str(run_dir / "ledger"),
                                "--max-message-bytes", str(cfg.transport.max_message_bytes),
                                "--window-bytes", str(cfg.transport.window_bytes)], token, run_dir)


def _identity(ip: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", env("FEDHOP_REPLICA", f"{socket.gethostname()}-{ip}"))


def wait_for_parent(address: str, timeout: float) -> None:
    """Until something accepts TCP connections at `address` (the server or an edge starting up)."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"deploy.launch.role: {address} accepted no connection within {timeout:.0f} s: {exc}") from None
            time.sleep(0.5)


def replica_count(run_dir: Path, me: str, settle: float, timeout: float = 300.0) -> int:
    """FEDHOP_CLIENT_PROCESSES, or the number of replicas that announced themselves (see module doc)."""
    fixed = fixed_processes()
    if fixed is not None:
        return fixed
    here = run_dir / "replicas"
    here.mkdir(exist_ok=True)
    (here / me).touch()
    count_file = run_dir / "replicas.count"
    tmp = run_dir / f".replicas.count.{me}"
    seen, since = -1, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(count_file.read_text())
        except (OSError, ValueError):
            pass
        n = len(list(here.iterdir()))
        if n != seen:
            seen, since = n, time.monotonic()
        elif time.monotonic() - since >= settle:
            try:
                tmp.write_text(str(n))
                os.link(tmp, count_file)   # atomic, and fails if another replica fixed the count first
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
            continue
        time.sleep(0.2)
    raise SystemExit("deploy.launch.role: the client replicas did not settle on a count")


def claim_slot(slots: Path, me: str, n: int) -> int | None:
    """Slot k in 0..n-1 for this replica: its own from before a restart, else the first free one."""
    slots.mkdir(exist_ok=True)
    for k in range(n):
        try:
            if (slots / str(k)).read_text().strip() == me:
                return k
        except OSError:
            pass
    for k in range(n):
        try:
            fd = os.open(slots / str(k), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(me + "\n")
        return k
    return None


def cmd_client(a: argparse.Namespace) -> int:
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.common.util.nodeids import id_spec
    check_security([a.server])
    run_dir = wait_for_run(a.server)
    token = token_for(run_dir)
    ip = local_ip_towards(a.server)
    me = _identity(ip)
    n = replica_count(run_dir, me, seconds("FEDHOP_SETTLE", "3"))
    cfg = load_cfg([f"clients.processes={n}"])
    layout = plan_processes(cfg).clients   # slot k hosts client-proc<k> of the process plan (common/topologies/plan.py)
    fixed_slot = env("FEDHOP_SLOT")
    if fixed_slot and not (fixed_slot.isdigit() and int(fixed_slot) < len(layout)):
        raise UsageError(f"FEDHOP_SLOT={fixed_slot!r}: must be 0..{len(layout) - 1} "
                         f"(the layout has {len(layout)} client processes)")
    slot = int(fixed_slot) if fixed_slot else claim_slot(run_dir / "slots", me, len(layout))
    if slot is None:
        log.warning("all %d client slots of this run are taken (clients.processes = %d, layout %d processes); "
                    "this replica hosts nothing and waits for the run to end", len(layout), n, len(layout))
        return hold(linger_until_server_exits(run_dir, float("inf")))
    planned = layout[slot]
    parent = a.server if planned.edge is None else a.edge.format(edge=planned.edge)
    check_security([parent, f"{ip}:{a.port}"], planned.node_id)
    ids = id_spec(planned.clients)
    log.info("replica %s: slot %d of %d, clients %s, parent %s", me, slot, len(layout), ids, parent)
    wait_for_parent(parent, seconds("FEDHOP_REGISTER_TIMEOUT", "300"))
    return _run_member("client", ["--parent", parent, "--clients", ids, "--node-id", planned.node_id,
                                  "--listen", f"{ip}:{a.port}", "--ledger-dir", str(run_dir / "ledger"),
                                  "--max-message-bytes", str(cfg.transport.max_message_bytes),
                                  "--window-bytes", str(cfg.transport.window_bytes),
                                  "--threads", str(cfg.run.torch_threads)], token, run_dir)


def cmd_health(a: argparse.Namespace) -> int:
    """Exit 0 when something accepts TCP connections at the address (the healthcheck)."""
    host, port = split_address(a.address)
    try:
        with socket.create_connection((host, port), timeout=a.timeout):
            pass
    except OSError as exc:
        print(f"unhealthy: {a.address}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m fedhop.deploy.launch.role", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--listen", default="0.0.0.0:7000")
    e = sub.add_parser("edge")
    e.add_argument("--node-id", required=True, help="edge-<n>")
    e.add_argument("--parent", default="server:7000")
    e.add_argument("--listen", required=True, help="HOST:PORT others reach it on, e.g. its service name edge-0:7100")
    c = sub.add_parser("client")
    c.add_argument("--server", default="server:7000")
    c.add_argument("--edge", default="edge-{edge}:7100", help="address of edge e: a template with {edge}")
    c.add_argument("--port", type=port_number, default=7200)
    h = sub.add_parser("health")
    h.add_argument("address")
    h.add_argument("--timeout", type=float, default=2.0)
    a = ap.parse_args(argv)
    if a.role != "health":
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s role-{a.role} %(levelname)s %(message)s")
    from fedhop.common.config import ConfigError
    try:
        return {"server": cmd_server, "edge": cmd_edge, "client": cmd_client, "health": cmd_health}[a.role](a)
    except (ConfigError, UsageError) as exc:
        print(f"fedhop.deploy.launch.role {a.role}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main())   # records are on disk; skip the slow interpreter teardown
