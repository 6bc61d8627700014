"""SIGTERM and SIGINT end every role cleanly (issue 26, item 2): each role started on its own
(`python -m fedhop.server|edge|client`, as compose, Kubernetes and Slurm start them), a real
signal sent to one of them, and what it leaves checked: its exit status (128 + the signal), its
log line, and for the server a run recorded as "stopped" with the round reached.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import max_round, quadratic_config, wait_until

PY = sys.executable
CENTERS = [[1.0, -2.0], [3.0, 0.5], [-1.0, 1.0], [0.0, 2.0]]
CURVATURES = [[1.0, 2.0], [0.5, 1.0], [2.0, 1.0], [1.0, 1.0]]
SIZES = [10, 20, 30, 40]


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "FEDHOP_TOKEN": "t" * 32}


def role(cwd: Path, name: str, args: list[str]) -> subprocess.Popen:
    log = open(cwd / f"{name}.log", "wb")
    try:
        return subprocess.Popen([PY, "-m", f"fedhop.{name.split('-')[0]}", *args], cwd=cwd, env=env(), stdout=log,
                                stderr=subprocess.STDOUT)
    finally:
        log.close()


def stop_and_wait(proc: subprocess.Popen, sig: int, timeout: float = 60) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout)


def start_star(tmp_path: Path, processes: int = 2) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
    (tmp_path / "exp.toml").write_text(quadratic_config(CENTERS, CURVATURES, SIZES, rounds=100_000,
                                                        processes=processes))
    server = role(tmp_path, "server", ["--config", "exp.toml", "--run-dir", "run", "--port-file", "server.address"])
    clients = [role(tmp_path, f"client-{i}", ["--parent-file", "server.address", "--node-id", f"client-proc{i}",
                                             "--clients", "0-1" if i == 0 else "2-3", "--ledger-dir", "run/ledger"])
               for i in range(processes)]
    return server, clients


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_signal_records_a_stopped_run_and_its_clients_exit(tmp_path, sig):
    server, clients = start_star(tmp_path)
    try:
        wait_until("round 3", lambda: max_round(tmp_path / "run" / "run.db") >= 3, [server, *clients])
        assert stop_and_wait(server, sig) == 128 + sig
        # the WAL is folded into run.db (checked before this test's read-only connection makes one again)
        assert not list((tmp_path / "run").glob("run.db-wal"))
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["status"] == "stopped" and summary["rounds_completed"] >= 3
        assert summary["error"] == f"stopped by {signal.Signals(sig).name}" + (" (Ctrl-C)" if sig == signal.SIGINT
                                                                              else "") + \
            f" after round {summary['rounds_completed']}"
        assert max_round(tmp_path / "run" / "run.db") == summary["rounds_completed"]
        assert [c.wait(60) for c in clients] == [0, 0]    # told to shut down by the server
    finally:
        for p in [server, *clients]:
            if p.poll() is None:
                p.kill()


def test_client_sigterm_exits_143_and_says_so(tmp_path):
    server, clients = start_star(tmp_path)
    try:
        wait_until("round 2", lambda: max_round(tmp_path / "run" / "run.db") >= 2, [server, *clients])
        assert stop_and_wait(clients[1], signal.SIGTERM) == 143
        assert "stopped by SIGTERM: leaving" in (tmp_path / "client-1.log").read_text()
        assert stop_and_wait(server, signal.SIGTERM) == 143
        assert clients[0].wait(60) == 0
    finally:
        for p in [server, *clients]:
            if p.poll() is None:
                p.kill()


def test_edge_sigterm_shuts_its_client_processes_down_first(tmp_path):
    topo = 'kind = "hierarchical"\nedges = 1'
    (tmp_path / "exp.toml").write_text(quadratic_config(CENTERS, CURVATURES, SIZES, rounds=100_000, processes=1,
                                                        topology=topo))
    server = role(tmp_path, "server", ["--config", "exp.toml", "--run-dir", "run", "--port-file", "server.address"])
    edge = role(tmp_path, "edge-0", ["--parent-file", "server.address", "--node-id", "edge-0", "--port-file",
                                     "edge.address", "--ledger-dir", "run/ledger"])
    client = role(tmp_path, "client-0", ["--parent-file", "edge.address", "--node-id", "client-proc0",
                                        "--clients", "0-3", "--ledger-dir", "run/ledger"])
    procs = [server, edge, client]
    try:
        wait_until("round 2", lambda: max_round(tmp_path / "run" / "run.db") >= 2, procs)
        assert stop_and_wait(edge, signal.SIGTERM) == 143
        assert "stopped by SIGTERM: shutting down the cluster's client processes" in \
            (tmp_path / "edge-0.log").read_text()
        assert client.wait(60) == 0                         # shut down by its edge, not left waiting
        assert "shut down by parent" in (tmp_path / "client-0.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("which", ["client", "edge"])
def test_a_taken_listen_port_is_one_line_and_exit_2(tmp_path, which):
    """A client or edge whose --listen port is taken says so in one line and exits 2, as the server does."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        extra = ["--clients", "0-1"] if which == "client" else ["--node-id", "edge-0"]
        res = subprocess.run([PY, "-m", f"fedhop.{which}", "--parent", "127.0.0.1:9", "--listen",
                              f"127.0.0.1:{port}", *extra], cwd=tmp_path, env=env(), capture_output=True, text=True,
                             timeout=120)
    assert res.returncode == 2, res.stderr[-1500:]
    errors = [ln for ln in res.stderr.splitlines() if "ERROR" in ln]
    assert len(errors) == 1 and f"cannot serve on --listen 127.0.0.1:{port}" in errors[0], res.stderr[-1500:]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_whose_exception_was_lost_is_raised_at_the_next_check(sig):
    """A signal's exception raised inside Python code that C code called and then cleared the
    error of (here: an `except BaseException` standing in for it) is not lost for good: the
    stop was noted, and `raise_if_stopped` (the server between rounds, the launcher while it
    waits) raises it; once a stop is being handled (`ignore_stops`), nothing is pending."""
    from fedhop.common.util.procexit import Stopped, ignore_stops, raise_if_stopped, signals_restored, stop_on_sigterm

    with signals_restored():
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as a role starts (an earlier test may have left another)
        stop_on_sigterm()
        raise_if_stopped()   # nothing asked yet
        swallowed = []
        try:
            signal.raise_signal(sig)   # the handler runs before this call returns
        except BaseException as exc:   # noqa: BLE001 - the C code that clears the error
            swallowed.append(exc)
        assert swallowed and isinstance(swallowed[0], KeyboardInterrupt if sig == signal.SIGINT else Stopped)
        with pytest.raises(KeyboardInterrupt if sig == signal.SIGINT else Stopped):
            raise_if_stopped()
        ignore_stops()
        raise_if_stopped()   # handled: nothing pending
