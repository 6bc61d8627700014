"""`[run] engine = "inprocess"` (`fedhop run --engine inprocess`, deploy/launch/inprocess.py): one key moves a
run between separate processes over gRPC and every role in the `fedhop run` process.

Every run here is the real command (`python -m fedhop.deploy.cli.cli run`) started from a folder
outside the checkout with relative paths, as a user runs it.  The two engines must give the
same model bit for bit and the same bytes for every message but the heartbeats (compared as
tests/test_engines.py compares them: each sender record's round, ends, method, tensor, payload
and framed bytes, less the registration address and the config text, which differ by nature).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.deploy.launch.engine import usable_cores
from tests.helpers import max_round, quadratic_config, read_db, read_lines, wait_until
from tests.test_engines import _sent

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(3)
CENTERS = RNG.normal(0, 2, size=(8, 6))
CURV = RNG.uniform(0.5, 2.0, size=(8, 6))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]
ENGINES = ("processes", "inprocess")


def _env() -> dict[str, str]:
    """The user's environment: no PYTHONPATH into the checkout (the installed package runs)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_PLUGIN_PATH")}


def fedhop(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=_env())


def _quadratic(folder: Path) -> str:
    """tests/test_processes.py's quadratic run (3 client processes, 3 of 8 clients a round)."""
    (folder / "quad.toml").write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=4, per_round=3, processes=3,
                                                       local_steps=3))
    return "quad.toml"


def _digits(folder: Path) -> str:
    shutil.copy(ROOT / "examples" / "fedavg_digits.toml", folder / "fedavg_digits.toml")
    return "fedavg_digits.toml"


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def _same_model(a: Path, b: Path) -> bool:
    ma, mb = _model(a), _model(b)
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.fixture()
def user_dir(tmp_path: Path) -> Path:
    """A folder of the user's, outside the checkout."""
    d = tmp_path / "me"
    d.mkdir()
    return d


def _hierarchical(folder: Path) -> str:
    shutil.copy(ROOT / "examples" / "hierfavg_digits.toml", folder / "hierfavg_digits.toml")
    return "hierfavg_digits.toml"


@pytest.mark.parametrize("make_config, extra", [
    (_quadratic, []), (_digits, ["--set", "run.rounds=2"]),
    # edges relay messages without the checksum both ways, as a process run's edges do
    (_hierarchical, ["--set", "run.rounds=2", "--set", "security.checksum=false"])],
    ids=["quadratic", "fedavg_digits", "hierfavg_digits, no checksum"])
def test_one_flag_moves_a_run_between_the_engines_with_the_same_model_and_bytes(user_dir, make_config, extra):
    config = make_config(user_dir)
    for engine in ENGINES:
        res = fedhop(["run", config, "--out", engine, "--engine", engine, *extra], user_dir)
        assert res.returncode == 0, res.stderr[-2000:]
        assert f"engine {engine}" in res.stdout   # the final table names the engine
        assert [ln for ln in res.stderr.splitlines() if ln.startswith("round ")], res.stderr   # progress lines
    summaries = {e: json.loads((user_dir / e / "summary.json").read_text()) for e in ENGINES}
    assert {e: s["status"] for e, s in summaries.items()} == {e: "completed" for e in ENGINES}
    assert {e: s["engine"] for e, s in summaries.items()} == {e: e for e in ENGINES}
    assert {s["transport"] for s in summaries.values()} == {"grpc"}   # the accounting both record
    assert "engine = \"inprocess\"" in (user_dir / "inprocess" / "config.toml").read_text()
    assert _same_model(user_dir / "processes", user_dir / "inprocess")
    processes, inprocess = _sent(user_dir / "processes"), _sent(user_dir / "inprocess")
    assert {k[3] for k in processes} >= {"register", "probe", "train", "train.reply", "shutdown"}
    assert inprocess == processes
    assert sorted((user_dir / "inprocess" / "ledger").glob("*.jsonl")) != []


def test_the_engine_key_alone_selects_the_in_process_engine(user_dir):
    """The config's key, without the flag; the flag overrides it back."""
    (user_dir / "quad.toml").write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=2, processes=2)
                                        .replace("[run]", "[run]\nengine = \"inprocess\""))
    res = fedhop(["run", "quad.toml", "--out", "key", "--quiet"], user_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((user_dir / "key" / "summary.json").read_text())["engine"] == "inprocess"
    assert not (user_dir / "key" / "logs" / "server.log").exists()   # no server process ran
    res = fedhop(["run", "quad.toml", "--out", "flag", "--quiet", "--engine", "processes"], user_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((user_dir / "flag" / "summary.json").read_text())["engine"] == "processes"
    assert (user_dir / "flag" / "logs" / "server.log").exists()


@pytest.mark.parametrize("args, key", [
    (["run", "quad.toml", "--out", "r", "--engine", "inprocess", "--set", "transport.kind=torch"], "'run.engine'"),
    (["run", "quad.toml", "--out", "r", "--set", "run.engine=threads"], "'run.engine'"),
    (["launch", "hosts.toml", "fedavg_digits.toml", "--dry-run", "--set", "run.engine=inprocess"], "'run.engine'"),
])
def test_an_unsupported_combination_exits_2_with_one_line_naming_the_key(user_dir, args, key):
    _quadratic(user_dir)
    _digits(user_dir)
    shutil.copy(ROOT / "examples" / "hosts.toml", user_dir / "hosts.toml")   # two machines, 50 clients
    res = fedhop(args, user_dir, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], res.stderr
    assert not (user_dir / "r" / "summary.json").exists()


def test_report_reads_an_in_process_run_folder(user_dir):
    _quadratic(user_dir)
    assert fedhop(["run", "quad.toml", "--out", "mem", "--engine", "inprocess", "--quiet"], user_dir).returncode == 0
    res = fedhop(["report", "mem", "--out", "rep"], user_dir)
    assert res.returncode == 0, res.stderr
    table = res.stdout.splitlines()
    row = next(line for line in table if line.startswith("quad"))
    objective = json.loads((user_dir / "mem" / "summary.json").read_text())["final"]["objective"]
    assert f"{objective:.2f}" in row and "agree" in row, res.stdout
    assert (user_dir / "rep" / "report.md").is_file()


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "SIGINT (Ctrl-C)"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stopped_in_process_run_is_recorded_as_stopped_and_resumes_bit_for_bit(user_dir, sig, code, said):
    rounds = 200   # far more than the stop leaves done
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, per_round=3, processes=3, local_steps=1)
    (user_dir / "quad.toml").write_text(text.replace("[run]", "[run]\ncheckpoint_every = 2"))
    proc = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "quad.toml", "--out", "r", "--engine",
                             "inprocess", "--quiet"], cwd=user_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run = user_dir / "r"
    wait_until("round 3 recorded", lambda: max_round(run / "run.db") >= 3, [proc])
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-1500:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["error"].startswith(f"stopped by {said} after round")
    assert 3 <= summary["rounds_completed"] < rounds and summary["engine"] == "inprocess"
    assert "run r: stopped" in out and "Traceback" not in err
    assert read_db(run / "run.db", "SELECT status FROM runs") == "stopped"
    res = fedhop(["run", "--resume", "r", "--quiet"], user_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["rounds_completed"] == rounds
    assert resumed["engine"] == "inprocess"
    res = fedhop(["run", "quad.toml", "--out", "whole", "--engine", "inprocess", "--quiet"], user_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _same_model(run, user_dir / "whole")


def test_the_live_page_serves_an_in_process_run_with_the_final_tables_bytes(user_dir):
    """`--dashboard`: the live byte view, fed from every role's counter at each round's end (no
    heartbeats carry it in one process), ends equal to the final table; Ctrl-C then ends the page.
    Gossip: the clients' messages to each other are counted by their senders, not the server."""
    shutil.copy(ROOT / "examples" / "gossip_digits.toml", user_dir / "gossip.toml")
    proc = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "gossip.toml", "--out", "r", "--engine",
                             "inprocess", "--quiet", "--dashboard", "0", "--set", "run.rounds=2"], cwd=user_dir,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = read_lines(proc, proc.stderr, "the dashboard stays up")   # type: ignore[arg-type]
        url = next(ln.split("dashboard at ")[1].strip() for ln in lines if "dashboard at " in ln)
        state = json.loads(urllib.request.urlopen(url + "api/state", timeout=30).read())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    summary = json.loads((user_dir / "r" / "summary.json").read_text())
    assert state["status"] == "completed" and len(state["rounds"]) == 2
    assert "client-client" in {row["link"] for row in state["links"]}
    live_total = sum(row["framed_bytes"] for row in state["links"])
    assert live_total == summary["bytes"]["total"]["framed_bytes"] > 0
    assert proc.returncode == 0


@pytest.mark.parametrize("started", ["forked, the run's data shared", "forked", "spawned"])
@pytest.mark.parametrize("make_config, extra", [(_quadratic, []), (_digits, ["--set", "run.rounds=2"])],
                         ids=["quadratic", "fedavg_digits"])
def test_worker_processes_train_the_clients_with_the_same_model_and_bytes(user_dir, make_config, extra, started):
    """run.workers = 2 (deploy/launch/workers.py): the client processes train in two worker OS
    processes (the quadratic's three client processes dealt two and one), and the run gives
    what a process run gives: the same model bit for bit and the same bytes for every message.
    `fedhop run` forks its workers, which use the task (the data) it built before the fork; with
    run.torch_threads = 2 it builds none before (workers.py `SharedTask`) and each worker builds
    its own; with FEDHOP_START=exec (deploy/launch/forkstart.py) they are fresh interpreters, as
    where the run's process may not fork (a user's script, a GPU)."""
    config = make_config(user_dir)
    threads = ["--set", "run.torch_threads=2"] if started == "forked" else []
    runs = {"processes": ["--engine", "processes", *threads],
            "workers": ["--engine", "inprocess", "--set", "run.workers=2", *threads]}
    for name, flags in runs.items():
        env = {**_env(), "FEDHOP_START": "exec"} if name == "workers" and started == "spawned" else _env()
        res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", config, "--out", name, *flags,
                              *extra], cwd=user_dir, capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
    assert _same_model(user_dir / "processes", user_dir / "workers")
    assert _sent(user_dir / "workers") == _sent(user_dir / "processes")
    log = (user_dir / "workers" / "logs" / "inprocess.log").read_text()
    assert (f"client-proc0 trains in fedhop worker 0 ({started})" in log
            and f"client-proc1 trains in fedhop worker 1 ({started})" in log), log[-2000:]
    summary = json.loads((user_dir / "workers" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["engine"] == "inprocess"


def test_by_default_fedhop_run_forks_a_worker_per_core_and_a_run_that_cannot_fork_keeps_its_clients(user_dir):
    """run.workers = "auto", the default: `fedhop run --engine inprocess` forks one worker per core
    it may use (at most one per client process: the quadratic has three); pinned to one core (its
    CPU affinity, as taskset or a Slurm allocation leaves it) it forks none; where the run's
    process may not fork (FEDHOP_START=exec, as for a script calling the Python API, or a GPU run)
    it starts no fresh interpreter and trains every client itself.  All give the same model."""
    config = _quadratic(user_dir)
    expected = min(usable_cores(), 3) if usable_cores() > 1 else 0
    one_core = min(os.sched_getaffinity(0))
    runs = {"auto": ({}, None), "auto-exec": ({"FEDHOP_START": "exec"}, None),
            "auto-one-core": ({}, lambda: os.sched_setaffinity(0, {one_core}))}
    for name, (extra_env, pin) in runs.items():
        res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", config, "--out", name,
                              "--engine", "inprocess"], cwd=user_dir, capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in {**_env(), **extra_env}.items() if k != "FEDHOP_RUN_CORES"},
                             preexec_fn=pin)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "workers = \"auto\"" in (user_dir / name / "config.toml").read_text()
    forked = (user_dir / "auto" / "logs" / "inprocess.log").read_text()
    assert sum(f"trains in fedhop worker {i} (forked" in forked for i in range(3)) == expected, forked[-2000:]
    assert f"trains in fedhop worker {expected}" not in forked
    for name in ("auto-exec", "auto-one-core"):
        kept = (user_dir / name / "logs" / "inprocess.log").read_text()
        assert "trains in fedhop worker" not in kept, kept[-2000:]
        assert _same_model(user_dir / "auto", user_dir / name)


def test_the_in_process_engine_gives_the_garbage_collector_back_as_it_found_it():
    """The rounds run with the set-up frozen and young collections rare, as in a role process
    (common/util/procexit.py `freeze_heap`); the process may be a user's, so both are undone."""
    import gc

    from fedhop.common.util.procexit import YOUNG_COLLECTION_EVERY
    from fedhop.deploy.launch.inprocess import heap_frozen

    before = gc.get_threshold()
    gc.set_threshold(123, *before[1:])
    try:
        with heap_frozen():
            assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, *before[1:]) and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (123, *before[1:]) and gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)


@pytest.mark.parametrize("lock", [True, False], ids=["served-in-turn", "control-without-the-lock"])
def test_client_processes_in_the_run_process_serve_one_call_at_a_time(user_dir, monkeypatch, lock):
    """The client processes served in the run's process take turns (transports/inmemory/endpoint.py
    `serve_lock`): the server's fabric sends each process's batch from its own thread, and no two
    of them are inside a client's handler at once; the control takes the lock away and sees them
    overlap, so the count can tell the two apart.  The first client's handler waits until a
    second thread is inside with it (at most 5 s, which only the locked run spends, once)."""
    import threading

    import fedhop
    from fedhop.client.host import ClientHost
    from fedhop.transports.inmemory.endpoint import InMemoryEndpoint

    inside, most, count = [0], [0], threading.Lock()
    overlapped, first = threading.Event(), threading.Event()
    handle = ClientHost.handle

    def counted(self, *args, **kwargs):
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] > 1:
                overlapped.set()
            waits = not first.is_set()
            first.set()
        try:
            if waits:
                overlapped.wait(5.0)   # the event: another thread inside; without it, the lock kept it out
            return handle(self, *args, **kwargs)
        finally:
            with count:
                inside[0] -= 1

    monkeypatch.setattr(ClientHost, "handle", counted)
    if not lock:
        monkeypatch.setattr(InMemoryEndpoint, "serving", lambda self: contextlib.nullcontext())
    monkeypatch.chdir(user_dir)
    config = _quadratic(user_dir)
    result = fedhop.run(config, set={"run.engine": "inprocess", "clients.per_round": 8}, out="run")
    assert result.status == "completed" and len(result.rounds) == 4
    assert (most[0] == 1) if lock else (most[0] > 1), most[0]
