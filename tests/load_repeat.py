"""The fault and launch tests under load (issue 17, item 7), one command:

    .venv/bin/python -m tests.load_repeat [--runs 5] [--spinners 2] [--files PATH ...] [--log DIR]

starts `--spinners` busy-loop processes (`python -c 'while True: pass'`, one per core on the
2-core reference machine), runs pytest on the fault-injection and launch test files `--runs`
times one after another, stops the spinners by their PIDs (also when interrupted), and prints
for each run the passed / failed / error / skipped counts, the names of the tests that failed
and the wall time.  Exit status 0 when every run passed every test.  docs/faults.md ("Tests
under load") records the counts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# every test file that injects a fault into real processes (kill -9, SIGSTOP, restart) or launches
# roles; the mixed files contribute their kill tests only
FILES = [
    "tests/test_faults.py",
    "tests/test_launch.py",
    "tests/test_liveness_pause.py",
    "tests/test_processes.py::test_killed_client_process_run_completes",
    "tests/test_fedchs.py::test_killed_hierarchical_edge_loses_its_clients_and_rounds_complete",
    "tests/test_role_signals.py",
    "tests/test_stop_phases.py",
    "tests/test_stop_points.py",
    "tests/test_address_proof.py",
]

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def counts(tail: str) -> dict[str, int]:
    """pytest's last summary line ("3 failed, 20 passed, 1 skipped in 81.2s") as numbers."""
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    lines = [ln for ln in tail.splitlines() if re.search(r"\bin [\d.]+s\b", ln)]
    for n, what in _COUNT.findall(lines[-1] if lines else ""):
        key = "error" if what.startswith("error") else what
        if key in out:
            out[key] += int(n)
    return out


def spin(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def stop(spinners: list[subprocess.Popen]) -> None:
    for p in spinners:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.load_repeat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--spinners", type=int, default=2, help="busy-loop processes kept running (default: 2)")
    ap.add_argument("--files", nargs="*", default=FILES, help="pytest node ids (default: the fault and launch tests)")
    ap.add_argument("--log", default="", help="keep each run's pytest output here")
    ap.add_argument("--json", default="", help="also write the per-run rows here")
    args = ap.parse_args(argv)
    log_dir = Path(args.log) if args.log else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    spinners = spin(args.spinners)
    print(f"{args.spinners} spinners: pids {[p.pid for p in spinners]}; files: {' '.join(args.files)}", flush=True)
    rows = []
    try:
        for i in range(1, args.runs + 1):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args.files],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wall = time.monotonic() - t0
            if log_dir:
                (log_dir / f"run{i}.log").write_text(proc.stdout)
            row = counts(proc.stdout[-4000:])
            row.update(run=i, exit=proc.returncode, wall_s=round(wall, 1), load1=round(os.getloadavg()[0], 1),
                       failed_tests=re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M))
            rows.append(row)
            print(f"run {i}: {row['passed']} passed, {row['failed']} failed, {row['error']} errors, "
                  f"{row['skipped']} skipped in {wall:.0f} s (load {row['load1']})"
                  + (f"; failed: {', '.join(row['failed_tests'])}" if row["failed_tests"] else ""), flush=True)
    finally:
        stop(spinners)
    total = sum(r["passed"] for r in rows), sum(r["failed"] + r["error"] for r in rows)
    print(f"total: {total[0]} passed, {total[1]} failed or errors over {len(rows)} runs", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if rows and all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
