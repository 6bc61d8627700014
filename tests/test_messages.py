"""Issue 25, item 5: messages that say what happened.  The server's --insecure flag and the plaintext
refusal naming the flags of the process that refuses; the README's one-role-at-a-time recipe run as
written, each role its own process, from a folder outside the repository; a diverging run's failure
naming NaN/Inf, the round and the clients."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from fedhop.common.security.addresses import is_loopback, plaintext_refusal

PY = sys.executable


def digits_config(*, clients: int, rounds: int, lr: float) -> str:
    """examples/fedavg_digits.toml's task, made smaller: every client sampled in every round."""
    return f"""
[run]
name = "msg"
seed = 0
rounds = {rounds}
eval_every = 1

[algorithm]
name = "fedavg"
lr = {lr}
local_epochs = 2
batch_size = 16

[data]
dataset = "digits"
partition = "dirichlet"
alpha = 0.5

[model]
kind = "mlp"
hidden = [64]

[clients]
count = {clients}
per_round = {clients}
processes = 1

[transport]
kind = "grpc"
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDHOP_INSECURE", "FEDHOP_CERTS_DIR", "FEDHOP_MTLS")}
    env["FEDHOP_TOKEN"] = "messages-test-secret"
    return env


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """The file's text once its writer has put it there (the server's --port-file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode} before serving: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {path.name} within {timeout}s")


def _server_and_client(cwd: Path, server_args: list[str], client_args: list[str]) -> tuple[int, str, int, str]:
    """Start the server, then (once it serves) one client process: both exit statuses and stderrs."""
    log = cwd / "server.log"   # a file, not a pipe: a chatty server never blocks on a full pipe
    with log.open("w") as sink:
        server = subprocess.Popen([PY, "-m", "fedhop.server", *server_args, "--port-file", "port.txt"], cwd=cwd,
                                  env=_env(), stdout=subprocess.DEVNULL, stderr=sink)
    try:
        port = _wait_for(cwd / "port.txt", server, log).rsplit(":", 1)[1]
        client = subprocess.run([PY, "-m", "fedhop.client", "--parent", f"127.0.0.1:{port}", *client_args],
                                cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return server.returncode, log.read_text(), client.returncode, client.stderr


# ----------------------------------------------------------------------------- plaintext off loopback
def test_all_interfaces_is_off_loopback_and_each_refusal_names_its_own_flags():
    assert not is_loopback("0.0.0.0:7000") and not is_loopback("[::]:7000") and is_loopback("127.0.0.1:7000")
    server = plaintext_refusal(["0.0.0.0:7000"], False, False, who="server")
    client = plaintext_refusal(["10.1.2.3:7000"], False, False)
    launch = plaintext_refusal(["10.1.2.3:7000"], False, False, who="launch")
    assert "--insecure" in server and "security.insecure = true" in server and "0.0.0.0:7000" in server
    assert "--insecure" in client and "--certs-dir" in client and "security." not in client   # flags only
    assert "--set security.insecure=true" in launch and "--insecure " not in launch
    assert plaintext_refusal(["0.0.0.0:7000"], True, False, who="server") is None
    assert plaintext_refusal(["127.0.0.1:7000"], False, False) is None


def test_server_off_loopback_refuses_without_insecure_in_one_line(tmp_path):
    (tmp_path / "exp.toml").write_text(digits_config(clients=2, rounds=1, lr=0.1))
    out = subprocess.run([PY, "-m", "fedhop.server", "--config", "exp.toml", "--run-dir", "runs/exp",
                          "--listen", "0.0.0.0:0"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "0.0.0.0:0" in lines[0] and "--insecure" in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "runs" / "exp" / "summary.json").exists()


def test_one_role_at_a_time_recipe_runs_as_written(tmp_path):
    """README "One role at a time": the server on all interfaces with --insecure, a client process
    with --insecure (127.0.0.1 standing for both hosts), relative paths from the user's folder,
    then `fedhop merge-ledgers`."""
    rounds, clients = 3, 6
    (tmp_path / "exp.toml").write_text(digits_config(clients=clients, rounds=rounds, lr=0.1))
    s_rc, s_err, c_rc, c_err = _server_and_client(
        tmp_path, ["--config", "exp.toml", "--run-dir", "runs/exp", "--listen", "0.0.0.0:0", "--insecure"],
        ["--clients", f"0-{clients - 1}", "--listen", "127.0.0.1:0", "--ledger-dir", "runs/exp/ledger", "--insecure"])
    assert (s_rc, c_rc) == (0, 0), (s_err[-2000:], c_err[-2000:])
    run = tmp_path / "runs" / "exp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == rounds
    assert "insecure = true" in (run / "config.toml").read_text()   # --insecure is the key it stands for
    merged = subprocess.run([PY, "-m", "fedhop.deploy.cli.cli", "merge-ledgers", "runs/exp"], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr[-2000:]
    with sqlite3.connect(run / "run.db") as db:
        rows = db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0]
        sent = db.execute("SELECT COUNT(*) FROM messages WHERE role = 'sender'").fetchone()[0]
        unpaired = db.execute("SELECT COUNT(*) FROM messages a LEFT JOIN messages b ON a.msg_id = b.msg_id AND "
                              "b.role = 'receiver' WHERE a.role = 'sender' AND b.msg_id IS NULL").fetchone()[0]
    assert rows == rounds
    assert sent >= 2 * rounds * clients and unpaired == 0   # the client process's records merged beside the server's


# ----------------------------------------------------------------------------- divergence
def test_a_diverging_run_fails_naming_nan_inf_the_round_and_the_clients(tmp_path):
    clients = 6
    (tmp_path / "exp.toml").write_text(digits_config(clients=clients, rounds=12, lr=30.0))
    s_rc, s_err, c_rc, c_err = _server_and_client(
        tmp_path, ["--config", "exp.toml", "--run-dir", "runs/div"],
        ["--clients", f"0-{clients - 1}", "--ledger-dir", "runs/div/ledger"])
    assert s_rc == 1, s_err[-2000:]
    summary = json.loads((tmp_path / "runs" / "div" / "summary.json").read_text())
    error = summary["error"]
    failed_round = summary["rounds_completed"] + 1
    assert summary["status"] == "failed" and f"round {failed_round}:" in error, error
    assert "NaN/Inf" in error and "diverged" in error, error
    with sqlite3.connect(tmp_path / "runs" / "div" / "run.db") as db:
        refused = sorted(int(node.split("-")[1]) for node, in db.execute(
            "SELECT node FROM events WHERE kind = 'rejected_payload' AND round = ? AND detail LIKE 'NON_FINITE%'",
            (failed_round,)))
        details = [d for d, in db.execute("SELECT detail FROM events WHERE kind = 'rejected_payload'")]
    assert refused and str(refused[:10]).rstrip("]") in error, (refused, error)
    assert f"{len(refused)} of {clients} sampled clients" in error
    assert all(not d.startswith("NON_FINITE: NON_FINITE") for d in details), details[:3]   # the code once


# ----------------------------------------------------------------------------- the cross-device example
def test_crossdevice_digits_example_learns(tmp_path):
    """README "Cross-device scale": the digits example learns (a shortened run: 2,000 of its clients,
    5 rounds, in memory) well above the share of the test split's most common class."""
    import numpy as np

    from fedhop.common.config import load_config
    from fedhop.deploy.launch.inmemory import run_inmemory
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "crossdevice_digits.toml",
                      ["clients.count=2000", "run.rounds=5", "run.eval_every=5", "clients.processes=1"])
    summary, coord = run_inmemory(cfg, tmp_path / "run")
    majority = np.bincount(np.asarray(coord.task.y_test)).max() / len(coord.task.y_test)
    assert summary["status"] == "completed"
    assert summary["final"]["test_accuracy"] > 3 * majority, (summary["final"], majority)
