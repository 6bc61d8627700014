"""The fault-suite table of docs/faults.md: inject each fault into a real run and measure.

    .venv/bin/python -m tests.fault_table [--out DIR] [--rounds 6] [--only NAME,...] [--json FILE]

Scenarios (all on the quadratic problem of tests/faultkit.py, rounds of about a second, fast
liveness settings: heartbeat every 0.25 s, dead after 1.5 s, children give up after 3 s):

- none              no fault (baseline)
- kill-client       kill -9 of one of 4 client processes in the middle of round 3 (star)
- kill-edge         kill -9 of one of 2 edges in the middle of round 3 (hierarchical, 4 client processes)
- kill-server       kill -9 of the server in the middle of round 4, checkpoint_every = 2, then `fedhop run --resume`
- corrupt-proxy     a byte-flipping proxy (p = 0.3 per 4 KiB DATA frame) in front of one client process
- drop-proxy        a connection-dropping proxy (p = 0.1 per DATA frame) in front of one client process
- hostile-nan       a client that sends NaN in every result
- soak              12 rounds, 3 client processes killed and restarted at seeded random times

Columns: faults injected; rounds completed / planned; results lost, expected versus observed
(observed = results the server did not use, from run.db; expected = what the fault must cost:
for a killed client process its 2 clients from the round it died in to the end, for a killed edge
its 4 clients likewise, 0 for a killed server (the aborted rounds are re-run), one result per
corrupted message, 1-2 per dropped connection (the calls sharing it), every round for the hostile
client); time to detect a dead node (heartbeat silence when the parent marked it dead, or for the
server: kill to the last client process giving up); time to resume (resume command to the first
re-run round stored); ledger consistent (server/resilience.py `ledger_consistency`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedhop.common.config import load_config, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.launcher import LocalRun, read_progress, resume_local, run_local
from fedhop.server.resilience import ledger_consistency
from tests.faultkit import (
    FAST_LIVENESS,
    failed_by_round,
    slow_quadratic,
    soak,
    wait_dead,
    wait_for_dispatch,
    wait_for_round,
)

ROOT = Path(__file__).resolve().parents[1]


def _row(name: str, run_dir: Path, faults: str, expected: str, detect: str = "-", resume: str = "-") -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    store = RunStore(run_dir / "run.db")
    lost = sum(len(v) for v in failed_by_round(store).values())
    live = summary.get("liveness") or {}
    if detect == "-" and live.get("detection_seconds_max") is not None:
        detect = f"{live['detection_seconds_max']:.2f} s"
    return {"scenario": name, "faults": faults, "rounds": f"{summary['rounds_completed']}/{summary['rounds_planned']}",
            "status": summary["status"], "lost_expected": expected, "lost_observed": str(lost),
            "detect": detect, "resume": resume, "ledger_ok": ledger_consistency(store)["ok"]}


def _start(base: Path, name: str, text: str, overrides: list[str] = ()) -> tuple[LocalRun, object]:
    (base / f"{name}.toml").write_text(text)
    run = LocalRun(load_config(base / f"{name}.toml", FAST_LIVENESS + list(overrides)), base / name)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    return run, run.start([])


def _kill_child(base: Path, name: str, rounds: int, text: str, victim: str, per_victim: int) -> dict:
    run, server = _start(base, name, text)
    try:
        wait_for_round(run.run_dir, 2)
        wait_for_dispatch(run.run_dir, 3)   # round 3 is under way: a child has its work
        child = next(c for c in run.children if c.name == victim)
        in_round = len(read_progress(run.run_dir / "run.db", 0)) + 1
        os.kill(child.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=300)
        wait_dead([c.proc.pid for c in run.children], timeout=20)
    finally:
        run.stop_all()
    expected = per_victim * (rounds - in_round + 1)
    return _row(name, run.run_dir, f"kill -9 {victim} in round {in_round}", str(expected))


def scenario_none(base: Path, rounds: int) -> dict:
    cfg = base / "none.toml"
    cfg.write_text(slow_quadratic(rounds))
    run_local(str(cfg), FAST_LIVENESS, str(base / "none"), quiet=True, show_table=False)
    return _row("none", base / "none", "0", "0")


def scenario_kill_client(base: Path, rounds: int) -> dict:
    return _kill_child(base, "kill-client", rounds, slow_quadratic(rounds), "client-proc1", 2)


def scenario_kill_edge(base: Path, rounds: int) -> dict:
    text = slow_quadratic(rounds, topology='kind = "hierarchical"\nedges = 2')
    return _kill_child(base, "kill-edge", rounds, text, "edge-1", 4)


def scenario_kill_server(base: Path, rounds: int) -> dict:
    run, server = _start(base, "kill-server", slow_quadratic(rounds, processes=2), ["run.checkpoint_every=2"])
    try:
        wait_for_round(run.run_dir, 3)
        wait_for_dispatch(run.run_dir, 4)   # round 4 is under way
        in_round = len(read_progress(run.run_dir / "run.db", 0)) + 1
        os.kill(server.proc.pid, signal.SIGKILL)
        clients = [c.proc.pid for c in run.children if c is not server]
        gone = wait_dead(clients, timeout=30)
    finally:
        run.stop_all()
    from fedhop.common.records.checkpoint import latest_checkpoint
    ckpt_round = latest_checkpoint(run.run_dir).round
    started = time.monotonic()
    first = {}

    def watch():   # the resumed server first deletes the aborted rounds, then re-runs them
        cleared = False
        while "t" not in first and time.monotonic() - started < 300:
            rows = read_progress(run.run_dir / "run.db", ckpt_round)
            if not rows:
                cleared = True
            elif cleared:
                first["t"] = time.monotonic() - started
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = resume_local(str(run.run_dir), quiet=True, show_table=False)
    watcher.join(5)
    assert code == 0, f"resume failed with status {code}"
    return _row("kill-server", run.run_dir, f"kill -9 server in round {in_round}; resume from round {ckpt_round}", "0",
                detect=f"{gone:.2f} s (clients give up)", resume=f"{first.get('t', float('nan')):.2f} s")


def _proxy(base: Path, name: str, mode: str, p: float, seed: int, rounds: int) -> dict:
    from tests.cluster import Cluster
    from tests.helpers import quadratic_config
    from tests.netfault import FaultProxy
    from tests.test_proxy import CENTERS, CURV, LR, SIZES, STEPS
    cfg = parse_config(quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=STEPS, lr=LR, name=name),
                       ["run.min_results=1", "run.call_timeout=10.0", "run.round_timeout=20.0", "run.eval_every=0"])
    cluster = Cluster(cfg, base / name)
    proxies = []

    def behind(address: str) -> str:
        proxies.append(FaultProxy(address, mode=mode, p=p, seed=seed))
        return proxies[-1].address

    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2, 3], advertise=behind)
        cluster.run()
    finally:
        cluster.close()
        for px in proxies:
            px.close()
    hits = len(proxies[0].events)
    expected = str(hits) if mode == "corrupt" else f"{hits}-{2 * hits}"
    what = "corrupted DATA frames" if mode == "corrupt" else "dropped connections"
    return _row(name, base / name, f"{hits} {what}", expected)


def scenario_corrupt_proxy(base: Path, rounds: int) -> dict:
    return _proxy(base, "corrupt-proxy", "corrupt", 0.3, 4, max(rounds, 8))


def scenario_drop_proxy(base: Path, rounds: int) -> dict:
    return _proxy(base, "drop-proxy", "drop", 0.1, 7, max(rounds, 8))


def scenario_hostile_nan(base: Path, rounds: int) -> dict:
    from tests.cluster import Cluster
    from tests.test_hostile import HostileClient, _cfg
    cfg = _cfg()
    cluster = Cluster(cfg, base / "hostile-nan")
    hostile = HostileClient(cfg, "nan")
    try:
        cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2])
        hostile.register(cluster.address)
        cluster.run()
    finally:
        cluster.close()
        hostile.close()
    return _row("hostile-nan", base / "hostile-nan", f"NaN result x {cfg.run.rounds}", str(cfg.run.rounds))


def scenario_soak(base: Path, rounds: int) -> dict:
    (base / "soak").mkdir(exist_ok=True)
    done = soak(base / "soak", rounds=12, kills=3, seed=3)
    return _row("soak", base / "soak" / "run", f"{done['kills']} kills + restarts", "n/a (timing)")


SCENARIOS = {"none": scenario_none, "kill-client": scenario_kill_client, "kill-edge": scenario_kill_edge,
             "kill-server": scenario_kill_server, "corrupt-proxy": scenario_corrupt_proxy,
             "drop-proxy": scenario_drop_proxy, "hostile-nan": scenario_hostile_nan, "soak": scenario_soak}


def markdown(rows: list[dict]) -> str:
    head = ["scenario", "faults injected", "rounds", "results lost (expected)", "results lost (observed)",
            "time to detect", "time to resume", "ledger consistent"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['faults']} | {r['rounds']} | {r['lost_expected']} | {r['lost_observed']} "
                     f"| {r['detect']} | {r['resume']} | {'yes' if r['ledger_ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--json", default="", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedhop-faults-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        t = time.monotonic()
        rows.append(SCENARIOS[name](base, args.rounds))
        print(f"{name}: done in {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["status"] == "completed" and r["ledger_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
