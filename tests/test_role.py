"""deploy/role.py as separate processes on loopback: the server's role records its process's exit
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
from pathlib import Path

import numpy as np

from fedhop.common.transport.torchdist import free_port
from tests.helpers import quadratic_config

RNG = np.random.default_rng(11)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None or path.exists(), f"{proc.args} exited {proc.returncode} before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def test_server_role_ends_first_and_a_late_sigterm_keeps_its_status(tmp_path):
    text = quadratic_config(RNG.normal(0, 2, (4, 3)), RNG.uniform(0.5, 2, (4, 3)), [3, 5, 4, 6], rounds=2,
                            processes=1, local_steps=2, name="role")
    (tmp_path / "exp.toml").write_text(text)
    env = {**os.environ, "FEDHOP_CONFIG": str(tmp_path / "exp.toml"), "FEDHOP_RUNS": str(tmp_path / "runs"),
           "FEDHOP_RUN_NAME": "r", "FEDHOP_CLIENT_PROCESSES": "1", "FEDHOP_INSECURE": "1"}
    port, cport = free_port("127.0.0.1"), free_port("127.0.0.1")
    role = [sys.executable, "-m", "fedhop.deploy.role"]
    server = subprocess.Popen(role + ["server", "--listen", f"127.0.0.1:{port}"], env={**env, "FEDHOP_HOLD": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = subprocess.Popen(role + ["client", "--server", f"127.0.0.1:{port}", "--port", str(cport)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
