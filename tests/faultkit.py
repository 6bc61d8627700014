"""Helpers for the process-level fault tests and tests/fault_table.py: a quadratic problem
whose rounds take about a second (so a kill lands in the middle of one), process liveness
checks, waiting for rounds, and the run.db checks every fault scenario shares."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import numpy as np

from fedhop.common.records.runstore import RunStore
from fedhop.common.records.walfold import connect_ro
from fedhop.deploy.launch.launcher import Child, read_progress
from fedhop.server.resilience import ledger_consistency
from tests.helpers import quadratic_config

RNG = np.random.default_rng(17)
CENTERS = RNG.normal(0, 2, size=(8, 4))
CURV = RNG.uniform(0.5, 2.0, size=(8, 4))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]
STEPS, LR = 1000, 0.01          # about 0.3 s of local work per client (a step of autograd is about 0.3 ms)

# fast liveness: heartbeats every 0.25 s, dead after 1.5 s of silence, children give up after 3 s;
# call and round deadlines generous (a dead node fails fast through liveness, not through them), so a
# loaded machine's slow rounds are not lost results
FAST_LIVENESS = ["security.heartbeat_interval=0.25", "security.heartbeat_timeout=1.5", "security.parent_timeout=3.0",
                 "security.insecure=true", "run.min_results=1", "run.call_timeout=120.0", "run.round_timeout=180.0",
                 "run.eval_every=0"]


def slow_quadratic(rounds: int, *, processes: int = 4, topology: str = "", algorithm: str = "fedavg",
                   extra_algorithm: str = "", name: str = "faults") -> str:
    return quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=STEPS, lr=LR, processes=processes,
                            topology=topology, algorithm=algorithm, extra_algorithm=extra_algorithm, name=name)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        # the state follows the command name in parentheses, which may hold spaces ("fedhop client c")
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_round(run_dir: Path, round: int, timeout: float = 120.0) -> float:
    """Block until run.db records `round`; returns the time it appeared (time.monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read_progress(run_dir / "run.db", round - 1):
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"round {round} never finished in {run_dir}")


def wait_for_dispatch(run_dir: Path, round: int, timeout: float = 120.0) -> float:
    """Block until a child has received its work of `round` (a receiver record of that round in
    a child's ledger file, written and flushed as the message arrives): the round is under way.
    Returns the time (time.monotonic)."""
    deadline = time.monotonic() + timeout
    offsets: dict[Path, int] = {}
    while time.monotonic() < deadline:
        for path in sorted((run_dir / "ledger").glob("*.jsonl")):
            if path.name == "server.jsonl":
                continue
            with open(path, "rb") as fh:
                fh.seek(offsets.get(path, 0))
                data = fh.read()
            complete = data[:data.rfind(b"\n") + 1]
            offsets[path] = offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("round") == round and rec.get("role") == "receiver" and rec.get("link") != "control":
                    return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"no child of {run_dir} received work of round {round}")


def kill_after_round(run, round: int, victims, timeout: float = 90.0) -> tuple[int, float]:
    """Start `run` (a LocalRun), wait until run.db records `round`, SIGKILL the children whose
    names `victims(name)` selects, and wait for the server to exit; returns its exit status and
    the seconds it took after the kill.  Every process is stopped on the way out."""
    server = run.start([])
    try:
        wait_for_round(run.run_dir, round, timeout)
        for child in run.children:
            if victims(child.name):
                os.kill(child.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        server.proc.wait(timeout=timeout)
        return server.proc.returncode, time.monotonic() - killed
    finally:
        run.stop_all()


def wait_dead(pids: list[int], timeout: float) -> float:
    """Seconds until every pid is gone; AssertionError if some outlive `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not any(alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"processes left behind: {[p for p in pids if alive(p)]}")


def failed_by_round(store: RunStore) -> dict[int, set[int]]:
    """{round: logical clients whose result was not used} from the events of the final attempt."""
    out: dict[int, set[int]] = {}
    for e in store.events():
        if e["kind"] in ("client_failed", "rejected_payload") and e["node"].startswith("client-"):
            out.setdefault(int(e["round"]), set()).add(int(e["node"].split("-")[1]))
    return out


def reference_model(rounds: int, left_out: dict[int, set[int]]) -> np.ndarray:
    from tests.cluster import fedavg_reference
    return fedavg_reference(CENTERS, CURV, SIZES, rounds, STEPS, LR, left_out)


def check_run_db(run_dir: Path, rounds: int) -> dict:
    """What every fault scenario must leave: summary completed, each round stored exactly once,
    the summary's failure count equal to the failures stored per round and to the failure events,
    and a consistent ledger.  Returns the summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == rounds, summary.get("error")
    store = RunStore(run_dir / "run.db")
    got = [r["round"] for r in store.rounds()]
    assert got == list(range(1, rounds + 1)), got                      # nothing lost, nothing twice
    per_round = sum(int(r["failures"] or 0) for r in store.rounds())
    events = sum(len(v) for v in failed_by_round(store).values())
    assert summary["failures"] == per_round == events, (summary["failures"], per_round, events)
    consistency = ledger_consistency(store)
    assert consistency["ok"], consistency
    # every used result appears once: one accepted train reply per participant and round
    ok_replies = store._query("SELECT round, COUNT(*) FROM messages WHERE role = 'receiver' AND method = 'train.reply' "
                              "AND status = 'ok' AND error NOT LIKE 'aborted:%' GROUP BY round")
    participants = {r["round"]: r["participants"] for r in store.rounds()}
    if summary["topology"] == "star":
        assert dict(ok_replies) == {r: int(p) for r, p in participants.items()}, (ok_replies, participants)
    return summary


def registrations(db: Path, node: str) -> int:
    """How many times `node` has registered with the server so far (run.db's `registered` events;
    0 while run.db cannot be read)."""
    try:
        con = connect_ro(db, timeout=1.0)
        try:
            return int(con.execute("SELECT COUNT(*) FROM events WHERE kind = 'registered' AND node = ?",
                                   (node,)).fetchone()[0])
        finally:
            con.close()
    except (FileNotFoundError, sqlite3.Error):
        return 0


def soak(tmp_path: Path, rounds: int = 30, kills: int = 6, seed: int = 0, processes: int = 4) -> dict:
    """Run `rounds` rounds with `kills` client processes killed (-9) at seeded random moments and
    each restarted (same node id, same clients) a seeded random moment later.  The kills fall in
    the first half of the run, each once a seeded round has finished (then a seeded fraction of a
    second later), so the rounds left outlast every restart whatever the machine's speed.
    Returns what was done: kills, restarts, times, how many restarts came before the server had
    noticed, and how many restarted processes the run ended before they could register again
    (`too_late`: on a loaded machine a process can take seconds to start).  Such a process has
    no parent to end it and would retry until its registration deadline; `fedhop run` stops
    them, and so does this function, once the server has exited.  Every other child must leave
    by itself."""
    from fedhop.common.config import load_config
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.common.util.nodeids import id_spec
    from fedhop.common.util.rng import numpy_stream
    from fedhop.deploy.launch.launcher import LocalRun

    cfg_file = tmp_path / "soak.toml"
    cfg_file.write_text(slow_quadratic(rounds, processes=processes, name="soak"))
    run = LocalRun(load_config(cfg_file, FAST_LIVENESS), tmp_path / "run")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    server = run.start([])
    address = (run.run_dir / "server.address").read_text().strip()
    hosted = {p.node_id: p.clients for p in plan_processes(run.cfg).clients}
    rng = numpy_stream(seed, "soak")
    done = {"kills": 0, "restarts": 0, "restarted_before_detection": 0, "too_late": 0, "events": []}
    db = run.run_dir / "run.db"
    restarted: list[tuple[str, Child, int]] = []   # (node, child, its registrations before the restart)
    kill_rounds = sorted(int(r) for r in rng.choice(np.arange(1, rounds // 2 + 1), size=kills, replace=False))
    try:
        current = {c.name: c for c in run.children if c.name.startswith("client-proc")}
        for kill_round in kill_rounds:
            wait_for_round(run.run_dir, kill_round)
            time.sleep(float(rng.uniform(0.0, 0.5)))
            if server.proc.poll() is not None:
                break
            name = sorted(current)[int(rng.integers(len(current)))]
            os.kill(current[name].proc.pid, signal.SIGKILL)
            current[name].proc.wait()
            done["kills"] += 1
            down = float(rng.uniform(0.2, 2.5))
            time.sleep(down)
            if server.proc.poll() is not None or read_progress(run.run_dir / "run.db", rounds - 2):
                # the run is ending: a process started now may find no server to register with
                # and would wait out its registration deadline (fedhop run stops such processes)
                break
            before = registrations(db, name)
            current[name] = run.spawn(name, ["client", "--parent", address, "--clients", id_spec(hosted[name]),
                                             "--node-id", name, "--listen", f"{run.cfg.transport.host}:0",
                                             "--ledger-dir", str(run.run_dir / "ledger")] + run.security_args())
            restarted.append((name, current[name], before))
            done["restarts"] += 1
            done["restarted_before_detection"] += down < 1.5     # security.heartbeat_timeout in FAST_LIVENESS
            done["events"].append((name, round(down, 2)))
        assert server.proc.wait(timeout=300) == 0, tail_log(run)
        for name, child, before in restarted:   # the run ended before it registered again (docstring)
            if registrations(db, name) == before and child.proc.poll() is None:
                child.proc.terminate()
                done["too_late"] += 1
        wait_dead([c.proc.pid for c in run.children], timeout=30)
    finally:
        run.stop_all()
    return done


def tail_log(run) -> str:
    from fedhop.deploy.launch.launcher import tail
    return tail(run.children[0].log, 30)
