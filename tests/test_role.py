"""deploy/launch/role.py as separate processes on loopback: the server's role records its process's exit
status in RUN/server.exit and survives a SIGTERM after it; a client's role stays until that file
exists (so `--abort-on-container-exit` always sees the server's container end first); run.db is
checkpointed (no -wal file) when the server exits."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import psutil
import pytest

from fedhop.transports.torch.dist import free_port
from tests.helpers import max_round, quadratic_config, read_db, wait_until

RNG = np.random.default_rng(11)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None or path.exists(), f"{proc.args} exited {proc.returncode} before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def _server_and_client(tmp_path: Path, name: str, rounds: int, server_env: dict[str, str] | None = None
                       ) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The server's role and one client's role on loopback for a 4-client quadratic run of
    `rounds` rounds in RUNS/`name` (output piped, text)."""
    text = quadratic_config(RNG.normal(0, 2, (4, 3)), RNG.uniform(0.5, 2, (4, 3)), [3, 5, 4, 6], rounds=rounds,
                            processes=1, local_steps=2, name="role")
    (tmp_path / "exp.toml").write_text(text)
    env = _role_env(tmp_path, FEDHOP_CONFIG=str(tmp_path / "exp.toml"), FEDHOP_RUN_NAME=name,
                    FEDHOP_CLIENT_PROCESSES="1")
    port, cport = free_port("127.0.0.1"), free_port("127.0.0.1")
    role = [sys.executable, "-m", "fedhop.deploy.launch.role"]
    server = subprocess.Popen(role + ["server", "--listen", f"127.0.0.1:{port}"], env={**env, **(server_env or {})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = subprocess.Popen(role + ["client", "--server", f"127.0.0.1:{port}", "--port", str(cport)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return server, client


def test_server_role_ends_first_and_a_late_sigterm_keeps_its_status(tmp_path):
    server, client = _server_and_client(tmp_path, "r", rounds=2, server_env={"FEDHOP_HOLD": "1"})
    run = tmp_path / "runs" / "r"
    try:
        _wait_for(run / "server.exit", server)
        client_out, _ = client.communicate(timeout=60)
        assert client.returncode == 0, client_out[-3000:]
        # the client's process ended when the server shut it down; its role left only after the marker
        assert "the server's role ended with status 0; leaving" in client_out
        assert server.poll() is None                     # holding (FEDHOP_HOLD=1) after the run
        server.send_signal(signal.SIGTERM)               # what compose's abort sends during teardown
        server_out, _ = server.communicate(timeout=60)
    finally:
        for p in (server, client):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert server.returncode == 0, server_out[-3000:]
    assert (run / "server.exit").read_text() == "0\n"
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert (run / "run.db").stat().st_size > 4096 and not (run / "run.db-wal").exists()


def test_a_server_killed_under_its_role_leaves_run_db_failed_with_server_lost(tmp_path):
    """The server's process SIGKILLed mid-run (what the kernel's OOM killer does inside a container):
    its role records the run `failed` with a `server_lost` event naming the status, as `fedhop run`
    does, writes 137 to RUN/server.exit and exits with it; the rounds run so far are kept."""
    server, client = _server_and_client(tmp_path, "k", rounds=100_000)
    run = tmp_path / "runs" / "k"
    try:
        wait_until("round 2", lambda: (run / "run.db").is_file() and max_round(run / "run.db") >= 2, [server, client])
        (process,) = psutil.Process(server.pid).children()   # the `python -m fedhop.server` the role runs
        process.kill()
        out, _ = server.communicate(timeout=60)
    finally:
        for p in (server, client):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert server.returncode == 137, out[-3000:]
    assert (run / "server.exit").read_text() == "137\n"
    assert "exited with status 137 without recording the run's end" in out, out[-3000:]
    run_row = read_db(run / "run.db", "SELECT status FROM runs")
    events = read_db(run / "run.db", "SELECT detail FROM events WHERE kind = 'server_lost'")
    assert run_row == "failed" and "status 137" in events, (run_row, events)
    assert max_round(run / "run.db") >= 2


def _role_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDHOP_")}
    return {**env, "FEDHOP_RUNS": str(tmp_path / "runs"), "FEDHOP_INSECURE": "1", **extra}


@pytest.mark.parametrize("role, extra, named", [
    ("server", {"FEDHOP_SET": "run.rounds=abc"}, "run.rounds"),
    ("server", {"FEDHOP_SET": "run.nosuchkey=1"}, "nosuchkey"),
    ("server", {"FEDHOP_CONFIG": "missing.toml"}, "missing.toml"),
    ("server", {"FEDHOP_CLIENT_PROCESSES": "many"}, "FEDHOP_CLIENT_PROCESSES"),
    ("server", {"FEDHOP_RUN_NAME": "a/b"}, "FEDHOP_RUN_NAME"),
    ("server", {"FEDHOP_SET": "run.rounds='3"}, "FEDHOP_SET"),
    ("server", {"FEDHOP_REGISTER_TIMEOUT": "soon"}, "FEDHOP_REGISTER_TIMEOUT"),
    ("edge", {"FEDHOP_SET": "algorithm.lr=fast"}, "algorithm.lr"),
])
def test_a_bad_config_or_variable_is_one_line_and_exit_2(tmp_path, role, extra, named):
    """What a container prints when its environment is wrong: one line naming it, exit 2 (no traceback)."""
    text = quadratic_config(RNG.normal(0, 2, (2, 3)), RNG.uniform(0.5, 2, (2, 3)), [3, 5], rounds=1, processes=1)
    (tmp_path / "exp.toml").write_text(text)
    args = {"server": ["server", "--listen", "127.0.0.1:0"],
            "edge": ["edge", "--node-id", "edge-0", "--listen", "127.0.0.1:1"]}[role]
    env = _role_env(tmp_path, **{"FEDHOP_CONFIG": "exp.toml", **extra})
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.launch.role", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "runs" / "current").exists()      # nothing announced


def test_auto_client_processes_are_counted_before_the_server_starts_and_recorded(tmp_path):
    """FEDHOP_CLIENT_PROCESSES=auto with 3 client replicas and a config saying 1: the server's role
    waits for the replicas' count, so config.toml says what ran (3 processes, 3 client ledgers)."""
    replicas = 3
    text = quadratic_config(RNG.normal(0, 2, (6, 3)), RNG.uniform(0.5, 2, (6, 3)), [3, 5, 4, 6, 2, 3], rounds=2,
                            processes=1, local_steps=2, name="auto")
    (tmp_path / "exp.toml").write_text(text)
    env = _role_env(tmp_path, FEDHOP_CONFIG=str(tmp_path / "exp.toml"), FEDHOP_RUN_NAME="a",
                    FEDHOP_CLIENT_PROCESSES="auto", FEDHOP_SETTLE="1")
    port = free_port("127.0.0.1")
    role = [sys.executable, "-m", "fedhop.deploy.launch.role"]
    procs = [subprocess.Popen(role + ["server", "--listen", f"127.0.0.1:{port}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    # the clients start with the server, as compose starts them now (not after its health check)
    for k in range(replicas):
        procs.append(subprocess.Popen(role + ["client", "--server", f"127.0.0.1:{port}",
                                              "--port", str(free_port("127.0.0.1"))],
                                      env={**env, "FEDHOP_REPLICA": f"replica-{k}"},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * (replicas + 1), "\n".join(o[-2000:] for o in outs)
    run = tmp_path / "runs" / "a"
    recorded = tomllib.loads((run / "config.toml").read_text())
    assert recorded["clients"]["processes"] == replicas
    assert int((run / "replicas.count").read_text()) == replicas
    hosted = {f.stem for f in (run / "ledger").glob("client-proc*.jsonl")}
    assert hosted == {f"client-proc{k}" for k in range(replicas)}, sorted(hosted)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_a_client_whose_server_is_gone_leaves_instead_of_waiting_for_a_run(tmp_path):
    """Compose can start a client's container while it aborts the run (the server's container
    already stopped, its name gone from DNS): the role leaves within seconds, not after the 300 s
    it waits for a run to be announced."""
    env = _role_env(tmp_path, FEDHOP_CONFIG=str(tmp_path / "exp.toml"))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.launch.role", "client", "--server", "server.invalid:7000"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0 and "server.invalid does not resolve" in res.stderr, res.stderr
    assert elapsed < 120, elapsed


def test_the_server_roles_default_run_folder_names_the_seed(tmp_path):
    """Without FEDHOP_RUN_NAME the compose server role names its run folder as `fedhop run` does,
    NAME-seedS-YYYYmmdd-HHMMSS (deploy/launch/runfolder.py `run_stamp`), so runs of one config with other
    seeds are told apart in runs-compose/ too."""
    import re

    text = quadratic_config(RNG.normal(0, 2, (4, 3)), RNG.uniform(0.5, 2, (4, 3)), [3, 5, 4, 6], rounds=2,
                            processes=1, local_steps=2, name="named", seed=37)
    (tmp_path / "exp.toml").write_text(text)
    env = _role_env(tmp_path, FEDHOP_CONFIG=str(tmp_path / "exp.toml"), FEDHOP_CLIENT_PROCESSES="1")
    server = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.launch.role", "server", "--listen",
                               f"127.0.0.1:{free_port('127.0.0.1')}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = tmp_path / "runs"
    try:
        _wait_for(runs / "current", server)   # announced once the run folder exists
        folders = [p.name for p in runs.iterdir() if p.is_dir()]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
    assert len(folders) == 1 and re.fullmatch(r"named-seed37-\d{8}-\d{6}", folders[0]), folders
