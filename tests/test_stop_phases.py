"""A stop signal at any moment of a run (issue 44 item 3, red-team row B2.7): SIGTERM or SIGINT
sent to the server process (`python -m fedhop.server`, as compose, Slurm and Kubernetes start it)
or to `fedhop run` at each phase of a run, each phase found from run.db's rows or the processes'
log lines, never from a sleep.  Whatever the phase, the run ends recorded: summary.json and
run.db agree on "stopped" (before the last round's row) or "completed" (after it), run.db is
closed (no -wal file), the exit status is 128 + the signal for a stopped run and 0 for a
completed one, no log holds a traceback, and no process is left behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.helpers import max_round, quadratic_config, read_db, wait_until

PY = sys.executable
CENTERS = [[1.0, -2.0], [3.0, 0.5], [-1.0, 1.0], [0.0, 2.0]]
CURVATURES = [[1.0, 2.0], [0.5, 1.0], [2.0, 1.0], [1.0, 1.0]]
SIZES = [10, 20, 30, 40]
SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "FEDHOP_TOKEN": "t" * 32}


def config(rounds: int) -> str:
    """A 4-client quadratic run in 2 processes; a call to a process that does not answer fails
    after 3 s, and one process's clients are enough for a round."""
    text = quadratic_config(CENTERS, CURVATURES, SIZES, rounds=rounds, processes=2)
    return text.replace("call_timeout = 30.0", "call_timeout = 3.0\nmin_results = 1")


def role(cwd: Path, name: str, args: list[str]) -> subprocess.Popen:
    with open(cwd / f"{name}.log", "wb") as log:
        return subprocess.Popen([PY, "-m", f"fedhop.{name.split('-')[0]}", *args], cwd=cwd, env=env(), stdout=log,
                                stderr=subprocess.STDOUT)


def clients(cwd: Path) -> list[subprocess.Popen]:
    return [role(cwd, f"client-{i}", ["--parent-file", "server.address", "--node-id", f"client-proc{i}",
                                      "--clients", "0-1" if i == 0 else "2-3", "--ledger-dir", "run/ledger"])
            for i in range(2)]


def events(db: Path, kind: str) -> int:
    return int(read_db(db, "SELECT COUNT(*) FROM events WHERE kind = ?", (kind,), default=0))


def logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


def procs_in(folder: Path) -> list[int]:
    """Processes whose working directory is `folder` (every process these tests start runs there)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "cwd") == str(folder):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def assert_recorded(run: Path, status: str, sig: int, code: int, rounds: int | None = None) -> dict:
    """The run's records once its server exited with `code`: summary.json and run.db both say
    `status`, run.db's WAL is folded in, and the exit status is the status's."""
    assert not list(run.glob("run.db-wal")), "run.db left open (its WAL is still there)"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == status, summary
    assert read_db(run / "run.db", "SELECT status FROM runs") == status
    assert code == (0 if status == "completed" else 128 + sig)
    assert max_round(run / "run.db") == summary["rounds_completed"]
    if rounds is not None:
        assert summary["rounds_completed"] == rounds
    if status == "stopped":
        assert summary["error"].startswith(f"stopped by {signal.Signals(sig).name}")
    return summary


def assert_no_traceback(*texts_or_folders) -> None:
    for item in texts_or_folders:
        if isinstance(item, Path):
            for log in sorted(item.rglob("*.log")):
                assert "Traceback" not in log.read_text(errors="replace"), f"{log}:\n{log.read_text()[-3000:]}"
        else:
            assert "Traceback" not in item, item[-3000:]


def assert_none_left(folder: Path, timeout: float = 60) -> None:
    """Every process started in `folder` has ended (within `timeout`: a stopped process is reaped
    by its parent a moment after the parent's own exit)."""
    wait_until("end of the processes left behind", lambda: procs_in(folder) == [], timeout=timeout, every=0.1)


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP: state T in /proc/PID/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def kill_all(procs: list[subprocess.Popen]) -> None:
    """End what is left: a running process gets SIGTERM and 10 s to write what it was writing (a
    failed test's server logs its traceback then), a frozen one and one that does not leave SIGKILL."""
    for p in procs:
        if p.poll() is None and not stopped(p.pid):
            p.terminate()
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(0 if stopped(p.pid) else 10)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- the server process
@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("phase", ["set-up", "registration", "round"])
def test_server_stopped_before_its_last_round_records_a_stopped_run(tmp_path, phase, sig):
    """set-up: the server has read its config and builds its task (its log says which device it
    computes on), it serves nobody yet; registration: it serves (its address file is written)
    and no client process was started; round: clients train, round 2's row is written."""
    (tmp_path / "exp.toml").write_text(config(rounds=100_000))
    server = role(tmp_path, "server", ["--config", "exp.toml", "--run-dir", "run", "--port-file", "server.address"])
    procs = [server]
    try:
        if phase == "set-up":
            wait_until("the set-up log line", lambda: logged(tmp_path / "server.log", "computes on"), procs)
        else:
            wait_until("the server's address", lambda: (tmp_path / "server.address").exists(), procs)
        if phase == "round":
            procs += clients(tmp_path)
            wait_until("round 2", lambda: max_round(tmp_path / "run" / "run.db") >= 2, procs)
        server.send_signal(sig)
        code = server.wait(60)
        summary = assert_recorded(tmp_path / "run", "stopped", sig, code, rounds=None if phase == "round" else 0)
        assert (summary["rounds_completed"] >= 2) == (phase == "round")
        assert [p.wait(60) for p in procs[1:]] == [0] * (len(procs) - 1)   # told to shut down by the server
        assert_no_traceback(tmp_path)
        assert_none_left(tmp_path)
    finally:
        kill_all(procs)


HELD_FACTORY = """import pathlib, threading


def make_net(input_shape, n_outputs):
    pathlib.Path("building").touch()
    threading.Event().wait()   # a model factory that never returns (weights fetched from nowhere)
"""


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("who", ["server", "inprocess"])
def test_a_stop_cuts_the_model_factory_and_records_the_run_stopped(tmp_path, who, sig):
    """The set-up runs a model factory that never returns, in a server process or in `fedhop run
    --engine inprocess`: the signal cuts it (not a launcher's grace and then a kill; an
    in-process run would wait for ever), and the run is recorded stopped before its first round."""
    (tmp_path / "mymodels.py").write_text(HELD_FACTORY)
    (tmp_path / "exp.toml").write_text('[run]\nname = "held"\nrounds = 2\n\n[algorithm]\nname = "fedavg"\nlr = 0.1\n\n'
                                       '[data]\ndataset = "digits"\n\n[model]\nfactory = "mymodels:make_net"\n\n'
                                       '[clients]\ncount = 4\nper_round = 2\nprocesses = 1\n')
    if who == "server":
        proc = role(tmp_path, "server", ["--config", "exp.toml", "--run-dir", "run", "--port-file", "server.address"])
    else:
        with open(tmp_path / "run.out", "wb") as out:
            proc = subprocess.Popen([PY, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "run", "--quiet",
                                     "--engine", "inprocess"], cwd=tmp_path, env=env(), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until("the model factory's call", lambda: (tmp_path / "building").exists(), [proc])
        proc.send_signal(sig)
        code = proc.wait(30)   # at once: the factory would never return
        summary = assert_recorded(tmp_path / "run", "stopped", sig, code, rounds=0)
        assert "while the run's task and model were built" in summary["error"], summary
        assert summary["num_parameters"] is None and not (tmp_path / "run" / "model.safetensors").exists()
        assert not (tmp_path / "server.address").exists()   # it never served
        assert_no_traceback(tmp_path)
        if who == "inprocess":
            assert "Traceback" not in (tmp_path / "run.out").read_text()
    finally:
        kill_all([proc])


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("phase", ["after-last-round", "closing"])
def test_server_stopped_after_its_last_round_records_a_completed_run(tmp_path, phase, sig):
    """Client process 1 is frozen (SIGSTOP) once round 2 is recorded, before round 3 is: the
    server paces each round to 2 s of wall time (clients.sleep_scale: its rounds' messages take
    milliseconds, and without it round 3 could be over before the freeze).  Round 3, the last,
    counts the results that came (the frozen process's batched call, when the freeze caught it,
    fails at run.round_timeout, 6 s; the heartbeat timeout is longer than the run, so it is never
    marked dead), and the server's shut-down call to the frozen process then waits for its
    timeout.  after-last-round:
    the signal arrives once round 3's row is written (the server records the round, or shuts its
    children down); closing: a first signal there and a second once the failed shut-down is
    recorded (the records are being written)."""
    text = config(rounds=3).replace("[transport]", "[security]\nheartbeat_timeout = 600.0\n\n[transport]")
    text = text.replace("[clients]\n", "[clients]\nsleep_scale = 40.0\n").replace("round_timeout = 60.0",
                                                                                  "round_timeout = 6.0")
    (tmp_path / "exp.toml").write_text(text)
    server = role(tmp_path, "server", ["--config", "exp.toml", "--run-dir", "run", "--port-file", "server.address"])
    procs = [server]
    db = tmp_path / "run" / "run.db"
    try:
        wait_until("the server's address", lambda: (tmp_path / "server.address").exists(), procs)
        procs += clients(tmp_path)
        wait_until("round 2", lambda: max_round(db) >= 2, procs)
        procs[2].send_signal(signal.SIGSTOP)
        wait_until("round 3", lambda: max_round(db) >= 3, procs[:2])
        server.send_signal(sig)
        if phase == "closing":
            wait_until("the failed shut-down", lambda: events(db, "shutdown_failed") >= 1, [server])
            server.send_signal(sig)
        code = server.wait(60)
        assert_recorded(tmp_path / "run", "completed", sig, code, rounds=3)
        assert events(db, "stop_after_last_round") == 1   # the signal came while the children were shut down
        assert procs[1].wait(60) == 0
        kill_all(procs[2:])   # the frozen one: the test's own doing
        assert_no_traceback(tmp_path)
        assert_none_left(tmp_path)
    finally:
        kill_all(procs)


# ---------------------------------------------------------------- `fedhop run`
def fedhop_run(cwd: Path, rounds: int, ignore_sigint: bool = False, args: tuple[str, ...] = (),
               extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """`fedhop run exp.toml --out run [args]` in its own process group (a terminal's job), its
    output in run.out; with `ignore_sigint` started as a shell starts a background job (SIGINT ignored)."""
    (cwd / "exp.toml").write_text(config(rounds=rounds))
    argv = [PY, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "run", "--quiet", *args]
    if ignore_sigint:
        argv = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]
    with open(cwd / "run.out", "wb") as out:
        return subprocess.Popen(argv, cwd=cwd, env={**env(), **(extra_env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def group_of(launcher: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """The launched `fedhop run`; its whole process group is killed on the way out if it still runs
    (a failed test leaves nothing behind)."""
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def stop_group(launcher: subprocess.Popen, cwd: Path, sig: int, status: str, rounds: int | None = None) -> None:
    """`sig` to the process group of `fedhop run` (started in `cwd` by `fedhop_run`), as a
    terminal's Ctrl-C sends it: it exits with `status`'s code, the run is recorded `status`, no log
    holds a traceback and no process is left."""
    os.killpg(launcher.pid, sig)
    code = launcher.wait(120)
    output = (cwd / "run.out").read_text(errors="replace")
    assert code == (0 if status == "completed" else 128 + sig), output
    assert_recorded(cwd / "run", status, sig, code, rounds)
    assert_no_traceback(output, cwd / "run" / "logs")
    assert_none_left(cwd)


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("phase", ["start-up", "round"])
def test_fedhop_run_stopped_at_any_phase(tmp_path, phase, sig):
    """start-up: the signal goes to the whole process group (a terminal's Ctrl-C) while the
    child processes start (the server has read its config, no registration is complete);
    round: once round 2 is recorded."""
    with group_of(fedhop_run(tmp_path, rounds=100_000)) as launcher:
        run = tmp_path / "run"
        if phase == "start-up":
            wait_until("the server's set-up", lambda: logged(run / "logs" / "server.log", "computes on")
                       and (run / "logs" / "client-proc1.log").exists(), [launcher])
            assert events(run / "run.db", "registration_complete") == 0
        else:
            wait_until("round 2", lambda: max_round(run / "run.db") >= 2, [launcher])
        stop_group(launcher, tmp_path, sig, "stopped")


def test_fedhop_run_as_a_background_job_ignores_the_groups_sigint(tmp_path):
    """A shell starts a background job with SIGINT ignored; every process of the run inherits
    that (as an exec'd child would), so a Ctrl-C in the terminal (SIGINT to the group) leaves
    the run to complete, and `fedhop run` says so with exit 0."""
    with group_of(fedhop_run(tmp_path, rounds=4, ignore_sigint=True)) as launcher:
        run = tmp_path / "run"
        wait_until("round 1", lambda: max_round(run / "run.db") >= 1, [launcher])
        stop_group(launcher, tmp_path, signal.SIGINT, "completed", rounds=4)


# ---------------------------------------------------------------- the in-process engine's workers
WORKERS = ("--engine", "inprocess", "--set", "run.workers=2")


def workers_of(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The in-process engine's worker processes: the children of `fedhop run` titled "fedhop worker N"
    (common/util/proctitle.py), forked or spawned."""
    return [p for p in psutil.Process(launcher.pid).children()
            if " ".join(p.cmdline()).startswith("fedhop worker ")]


@pytest.mark.parametrize("sig", SIGNALS)
def test_fedhop_run_inprocess_with_workers_stopped_by_its_group(tmp_path, sig):
    """The in-process engine's worker processes are in the run's process group, so a terminal's
    Ctrl-C or a scheduler's SIGTERM to the group reaches them too: they leave the stop to the run's
    process, which records it as a process run does and then closes them.  (A worker that SIGTERM
    ended made the run's next write to its pipe fail; that BrokenPipeError ended `fedhop run` as a
    closed stdout would, exit 141, the run left "running" with its rounds in run.db's WAL.)"""
    with group_of(fedhop_run(tmp_path, rounds=100_000, args=WORKERS)) as launcher:
        wait_until("round 2", lambda: max_round(tmp_path / "run" / "run.db") >= 2, [launcher])
        assert len(workers_of(launcher)) == 2
        stop_group(launcher, tmp_path, sig, "stopped")


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("engine", [pytest.param((), id="processes"), pytest.param(WORKERS, id="inprocess")])
def test_a_vectorized_run_with_client_state_stopped_by_its_group(tmp_path, engine, sig):
    """SCAFFOLD under [algorithm] vectorized (each process's clients trained together, their
    control variates kept in the process that hosts them): a terminal's Ctrl-C or a scheduler's
    SIGTERM to the group once round 2 is recorded stops it as it stops a one-at-a-time run."""
    args = (*engine, "--set", "algorithm.name=scaffold", "--set", "algorithm.vectorized=true")
    with group_of(fedhop_run(tmp_path, rounds=100_000, args=args)) as launcher:
        wait_until("round 2", lambda: max_round(tmp_path / "run" / "run.db") >= 2, [launcher])
        stop_group(launcher, tmp_path, sig, "stopped")
    recorded = (tmp_path / "run" / "config.toml").read_text()
    assert "vectorized = true" in recorded and 'name = "scaffold"' in recorded


def test_a_killed_worker_leaves_the_inprocess_run_going_without_its_clients(tmp_path):
    """A worker killed apart from the run (SIGKILL, as the out-of-memory killer sends it): its
    client process's calls fail as a dead process's do (UNAVAILABLE), the server records the node
    dead once, and the rounds go on with the other process's clients (run.min_results = 1), as a
    process run goes on without a dead client process."""
    with group_of(fedhop_run(tmp_path, rounds=100_000, args=WORKERS)) as launcher:
        db = tmp_path / "run" / "run.db"
        wait_until("round 2", lambda: max_round(db) >= 2, [launcher])
        workers = workers_of(launcher)
        assert len(workers) == 2
        workers[0].kill()
        wait_until("the node's death recorded", lambda: events(db, "node_dead") == 1, [launcher])
        dead_round = int(read_db(db, "SELECT round FROM events WHERE kind = 'node_dead'"))
        wait_until("3 rounds after it", lambda: max_round(db) >= dead_round + 3, [launcher])
        assert workers[1].is_running()
        stop_group(launcher, tmp_path, signal.SIGTERM, "stopped")
    node = read_db(db, "SELECT node FROM events WHERE kind = 'node_dead'")
    assert node in ("client-proc0", "client-proc1")
    detail = read_db(db, "SELECT detail FROM events WHERE kind = 'node_dead'")
    assert "ended (exit code -9)" in detail, detail
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        after = con.execute("SELECT sampled, participants, failures FROM rounds WHERE round > ?", (dead_round,)).fetchall()
        failed = con.execute("SELECT DISTINCT node FROM events WHERE kind = 'client_failed' AND round > ?",
                             (dead_round,)).fetchall()
    finally:
        con.close()
    assert after and all(row == (4, 2, 2) for row in after), after   # every client sampled; the dead node's 2 fail
    homes = {"client-proc0": {"client-0", "client-1"}, "client-proc1": {"client-2", "client-3"}}
    assert {row[0] for row in failed} == homes[node], failed


@pytest.mark.parametrize("sig", SIGNALS)
def test_workers_started_as_fresh_interpreters_ignore_a_stop_while_they_import(tmp_path, sig):
    """Where `fedhop run` may not fork its workers (FEDHOP_START=exec here; a GPU run) each is a
    fresh interpreter, importing torch and fedhop for a second or more.  A Ctrl-C or SIGTERM to the
    group then (a worker's command line still `python -m fedhop.deploy.launch.workers`) stops the
    run as at any other time: exit 130 or 143, recorded "stopped", nothing left.  (The worker took
    the signal while it imported and died, and the run failed: exit 1, "fedhop worker 0 ended".)"""
    with group_of(fedhop_run(tmp_path, rounds=100_000, args=WORKERS, extra_env={"FEDHOP_START": "exec"})) as launcher:
        def importing() -> bool:
            with contextlib.suppress(psutil.Error):
                return any("fedhop.deploy.launch.workers" in " ".join(p.cmdline())
                           for p in psutil.Process(launcher.pid).children())
            return False
        wait_until("a worker importing", importing, [launcher], every=0.005)
        stop_group(launcher, tmp_path, sig, "stopped")


def test_workers_end_by_themselves_when_the_runs_process_is_killed(tmp_path):
    """The run's process SIGKILLed alone (the out-of-memory killer): its workers, forked from it,
    see their pipes close and end, leaving no process behind.  (A forked worker holds copies of
    the run's end of its own pipe and of the workers' before it; without closing them it never
    saw EOF and stayed forever.)"""
    with group_of(fedhop_run(tmp_path, rounds=100_000, args=WORKERS)) as launcher:
        wait_until("round 2", lambda: max_round(tmp_path / "run" / "run.db") >= 2, [launcher])
        workers = workers_of(launcher)
        assert len(workers) == 2
        assert "(forked" in (tmp_path / "run" / "logs" / "inprocess.log").read_text()
        launcher.kill()
        launcher.wait()
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, [(p.pid, p.status()) for p in alive]


def test_a_frozen_worker_does_not_hold_up_the_runs_stop(tmp_path):
    """A worker that stops answering (SIGSTOP: frozen, as a hung one would be) while the run's
    process waits on its pipe: a SIGTERM to the group still ends the run, recorded "stopped" with
    exit 143 and no process left.  The shut-down gives the worker its SHUTDOWN_TIMEOUT, and the
    close kills a worker it cannot tell to end (the close waited for the pipe, which the call
    stuck on the frozen worker held, and the run never exited)."""
    with group_of(fedhop_run(tmp_path, rounds=100_000, args=WORKERS)) as launcher:
        wait_until("round 2", lambda: max_round(tmp_path / "run" / "run.db") >= 2, [launcher])
        frozen = workers_of(launcher)[0]
        frozen.suspend()   # every round samples all 4 clients: the next call to it waits on its pipe
        try:
            stop_group(launcher, tmp_path, signal.SIGTERM, "stopped")
        finally:
            with contextlib.suppress(psutil.Error):
                frozen.resume()


def test_a_frozen_worker_is_found_dead_after_the_heartbeat_timeout_and_the_run_goes_on(tmp_path):
    """A worker stopped (SIGSTOP) during a run: a process run's monitor finds a frozen process
    silent after security.heartbeat_timeout; here the server's monitor finds its worker stopped
    that long, records the node dead, and kills the worker, which ends the call waiting on it, so
    the rounds go on with the other process's clients instead of each waiting for the round's
    deadline (run.round_timeout)."""
    args = (*WORKERS, "--set", "security.heartbeat_timeout=2.0", "--set", "run.round_timeout=600")
    with group_of(fedhop_run(tmp_path, rounds=100_000, args=args)) as launcher:
        db = tmp_path / "run" / "run.db"
        wait_until("round 2", lambda: max_round(db) >= 2, [launcher])
        frozen = workers_of(launcher)[0]
        frozen.suspend()
        try:
            wait_until("the node's death recorded", lambda: events(db, "node_dead") == 1, [launcher])
            dead_round = int(read_db(db, "SELECT round FROM events WHERE kind = 'node_dead'"))
            wait_until("3 rounds after it", lambda: max_round(db) >= dead_round + 3, [launcher])
            wait_until("the frozen worker's end", lambda: not frozen.is_running(), [launcher])
            stop_group(launcher, tmp_path, signal.SIGTERM, "stopped")
        finally:
            with contextlib.suppress(psutil.Error):
                frozen.resume()
    detail = read_db(db, "SELECT detail FROM events WHERE kind = 'node_dead'")
    assert "was stopped (frozen) for" in detail and "security.heartbeat_timeout = 2s" in detail, detail
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        waited = con.execute("SELECT MAX(wall_seconds) FROM rounds WHERE round > ?", (dead_round,)).fetchone()[0]
        after = con.execute("SELECT participants FROM rounds WHERE round > ?", (dead_round,)).fetchall()
    finally:
        con.close()
    assert after and all(row == (2,) for row in after), after
    assert waited < 60, waited   # no round after it waited on the frozen worker (round_timeout is 600 s)


# ---------------------------------------------------------------- finalize's ledger check
def _record(msg_id: str, src: str, dst: str, recorder: str, role: str, t: float):
    """A round-1 `train` ledger record of one end (`role`, kept by `recorder`) of message `msg_id`."""
    from fedhop.common.wire.ledger import LedgerRecord

    return LedgerRecord(run_id="r", round=1, step=0, src=src, dst=dst, link="client-server",
                        direction="up" if src.startswith("client") else "down", method="train", tensor_bytes=8,
                        payload_bytes=8, framed_bytes=20, seconds=0.0, recorder=recorder, role=role,
                        msg_id=msg_id, status="ok", wall_time=t)


def test_ledger_check_explains_a_logical_clients_lone_record_by_its_process(tmp_path):
    """A lone receiver record of a message from a logical client ('client-15', recorded by its
    process 'client-proc1', never a recorder itself) whose process recorded nothing after it
    (it was stopped between sending and recording): explained, where the check raised
    KeyError: 'client-15' and finalize crashed."""
    from fedhop.common.records.runstore import RunStore
    from fedhop.server.resilience import ledger_consistency

    store = RunStore(tmp_path / "run.db")
    store.start_run("r")
    store.insert_records([_record("a", "server", "client-15", "server", "sender", 1.0),
                          _record("a", "server", "client-15", "client-proc1", "receiver", 1.1),
                          _record("b", "client-15", "server", "server", "receiver", 2.0)])   # its sender side lost
    report = ledger_consistency(store)
    assert report["unexplained"] == 0 and report["lost_explained"] == 1, report
    store.close()


def _statements(store, action) -> tuple[object, int]:
    """`action()`'s result and the SQL statements it ran on `store`'s connection."""
    seen: list[str] = []
    store._conn.set_trace_callback(seen.append)
    try:
        return action(), len(seen)
    finally:
        store._conn.set_trace_callback(None)


@pytest.mark.parametrize("lone_clients", [40, 1200])
def test_ledger_check_looks_up_every_logical_senders_process_in_a_few_scans(tmp_path, lone_clients):
    """Lone receiver records from many logical clients (a stopped run at scale): each is judged by
    its own hosting process's last record (explained where that process recorded nothing after
    it, unexplained where it did), and the hosts are looked up together, so the check's SQL
    statements do not grow with the clients (one scan per client took minutes at 1,000,000)."""
    from fedhop.common.records import runstore
    from fedhop.common.records.runstore import RunStore
    from fedhop.server.resilience import ledger_consistency

    store = RunStore(tmp_path / "run.db")
    store.start_run("r")
    records = []
    for k in range(lone_clients):   # client-k lives in client-proc(k % 2)
        records += [_record(f"q{k}", "server", f"client-{k}", "server", "sender", 1.0),
                    _record(f"q{k}", "server", f"client-{k}", f"client-proc{k % 2}", "receiver", 1.1),
                    _record(f"a{k}", f"client-{k}", "server", "server", "receiver", 2.0)]   # its sender side lost
    records.append(_record("late", "client-1", "server", "client-proc1", "sender", 3.0))   # proc1 went on
    records.append(_record("late", "client-1", "server", "server", "receiver", 3.1))
    store.insert_records(records)
    report, statements = _statements(store, lambda: ledger_consistency(store))
    odd = lone_clients // 2
    assert report["lost_explained"] == lone_clients - odd, report        # client-proc0 stopped before recording
    assert report["unexplained"] == odd, report                          # client-proc1 recorded after them
    assert {u["src"] for u in report["unexplained_first"]} <= {f"client-{k}" for k in range(1, lone_clients, 2)}
    scans = -(-lone_clients // runstore._IN_CHUNK)
    assert statements <= 12 + scans, statements
    store.close()


# ---------------------------------------------------------------- the handlers themselves
@pytest.mark.parametrize("sig", SIGNALS)
def test_stops_deferred_are_noted_and_raised_where_armed_and_a_second_one_never_cuts(sig):
    """In a deferred part a signal is noted only (set-up, closing the records); the run's rounds
    (`stops_at_waits`) raise it on entry; once a stop was raised, a second signal is noted, not raised into
    the code that records the first."""
    from fedhop.common.util.procexit import (
        Stopped,
        ignore_stops,
        signals_restored,
        stop_noted,
        stop_on_sigterm,
        stops_at_waits,
        stops_deferred,
    )

    expected = KeyboardInterrupt if sig == signal.SIGINT else Stopped
    with signals_restored():
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as a role starts
        stop_on_sigterm(deferred=True)
        signal.raise_signal(sig)   # during set-up: noted
        assert stop_noted() == sig
        with pytest.raises(expected):
            with stops_at_waits():
                pytest.fail("a noted stop is raised on entering the part that raises stops at its waits")
        signal.raise_signal(sig)   # the second, while the first is being recorded: noted only
        with stops_deferred():
            signal.raise_signal(sig)
        ignore_stops()
        assert stop_noted() is None


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_stop_while_the_launcher_starts_a_child_is_raised_once_that_child_is_listed(tmp_path, monkeypatch, sig):
    """`fedhop run` stops the children it lists; a stop arriving between a child's start and its
    listing is raised after the listing, so that the stop reaches that child too."""
    from fedhop.common.config import load_config
    from fedhop.common.util.procexit import Stopped, signals_restored, stop_on_sigterm
    from fedhop.deploy.launch import launcher

    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(config(rounds=1))
    run = launcher.LocalRun(load_config(str(cfg_path), []), tmp_path / "run")
    (run.run_dir / "logs").mkdir(parents=True)
    monkeypatch.setattr(launcher, "fork_allowed", lambda: False)
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_stop(argv, **kwargs):
        proc = real_popen([PY, "-c", "import signal; signal.pause()"], **kwargs)
        started.append(proc)
        signal.raise_signal(sig)   # its handler runs at this function's next bytecode
        return proc

    monkeypatch.setattr(launcher.subprocess, "Popen", popen_then_stop)
    expected = KeyboardInterrupt if sig == signal.SIGINT else Stopped
    with signals_restored():
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as `fedhop run` starts
        stop_on_sigterm()
        with pytest.raises(expected):
            run.spawn("server", ["server"])
    assert [c.proc.pid for c in run.children] == [started[0].pid]
    run.stop_all(grace=30)
    assert started[0].poll() is not None


def test_a_wait_on_calls_returns_what_finished_and_raises_a_stop_within_its_slice():
    """`wait_stoppable` in the rounds (`stops_at_waits`): every call finished, or at the deadline
    the ones that did not; a stop noted while it waits is raised at its next slice."""
    import threading
    import time
    from concurrent.futures import Future

    from fedhop.common.util.procexit import (
        WAIT_SLICE,
        Stopped,
        ignore_stops,
        signals_restored,
        stop_on_sigterm,
        stops_at_waits,
        wait_stoppable,
    )

    class Watched(Future):
        """A future that says when a waiter has attached itself."""
        def __init__(self) -> None:
            super().__init__()
            self.watched = threading.Event()

        def add_done_callback(self, fn) -> None:
            super().add_done_callback(fn)
            self.watched.set()

    with signals_restored():
        stop_on_sigterm(deferred=True)
        with stops_at_waits():
            calls = [Watched() for _ in range(50)]
            finisher = threading.Thread(target=lambda: [(c.watched.wait(30), c.set_result(i))
                                                        for i, c in enumerate(calls)])
            finisher.start()
            done, pending = wait_stoppable(calls + calls[:3], None)   # a call given twice counts once
            finisher.join()
            assert done == set(calls) and pending == set()
            never, finished = Watched(), Watched()
            finished.set_exception(RuntimeError("failed"))
            started = time.monotonic()
            done, pending = wait_stoppable([never, finished], 2.5 * WAIT_SLICE)
            assert (done, pending) == ({finished}, {never})
            assert time.monotonic() - started >= 2.5 * WAIT_SLICE
            assert wait_stoppable([], None) == (set(), set())
            blocked = Watched()   # the signal comes once the wait is attached to it
            stopper = threading.Thread(target=lambda: (blocked.watched.wait(30), os.kill(os.getpid(), signal.SIGTERM)))
            stopper.start()
            started = time.monotonic()
            with pytest.raises(Stopped):
                wait_stoppable([blocked], None)
            stopper.join()
            assert time.monotonic() - started < 30
        ignore_stops()
