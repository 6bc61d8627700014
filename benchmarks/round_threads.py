"""Where a round's CPU goes, thread by thread, in a run of real processes (issue 49: W1's round in
processes is bound by the CPU of its three processes on two cores).

Starts `fedhop run CONFIG` (the processes engine unless the config says otherwise) in a folder of
its own, waits until `--warmup` rounds are in run.db, then reads the CPU time (user + system) of
every thread of the run's process tree from /proc twice, `--seconds` apart, and divides each
thread's difference by the rounds finished in between.  Printed: milliseconds of CPU a round for
each thread (named by its process's title and the thread's own name), each process's sum, and
the sum over all, beside the wall time a round; a thread that used less than 0.01 ms a round is
left out of the list but counted in the sums.  The run is then stopped (SIGINT to its process
group, as Ctrl-C) and its exit waited for.  Linux only (/proc).

    python benchmarks/round_threads.py CONFIG [--seconds 10] [--warmup 5] [--json FILE] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def rounds_done(db: Path) -> int:
    """Rows in run.db's rounds table (0 before the table exists)."""
    if not db.exists():
        return 0
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return int(conn.execute("SELECT count(*) FROM rounds").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def thread_times(root: int) -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process title, thread, CPU seconds) for the tree under `root`.  A thread is
    "main", a native thread's own name (grpcio's "event_engine"), or "python" for the threads
    Python starts (they carry the process's name, which says nothing more)."""
    out = {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            title = " ".join(proc.cmdline())[:40]
        except psutil.Error:
            continue
        task = Path(f"/proc/{proc.pid}/task")
        try:
            own = (task.parent / "comm").read_text().strip()
        except OSError:
            continue
        for entry in task.glob("*") if task.exists() else []:
            try:
                stat = (entry / "stat").read_text()
            except OSError:   # the thread ended meanwhile
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            name = "main" if int(entry.name) == proc.pid else "python" if name == own else name
            fields = stat[stat.rindex(")") + 2:].split()
            out[(proc.pid, int(entry.name))] = (title, name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def measure(config: Path, seconds: float, warmup: int, sets: list[str], folder: Path) -> dict:
    out_dir = folder / "run"
    argv = [sys.executable, "-m", "fedhop.deploy.cli", "run", str(config), "--out", str(out_dir), "--quiet"]
    for s in sets:
        argv += ["--set", s]
    log = (folder / "run.log").open("w")
    run = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    db = out_dir / "run.db"
    try:
        deadline = time.monotonic() + 300
        while rounds_done(db) < warmup:
            if run.poll() is not None:
                log.flush()
                lines = [line for line in (folder / "run.log").read_text(errors="replace").splitlines() if line.strip()]
                raise RuntimeError(f"the run ended (exit {run.returncode}) before {warmup} rounds"
                                   + (f": {lines[-1].strip()}" if lines else ""))
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {warmup} rounds within 300 s")
            time.sleep(0.05)
        first, r0, t0 = thread_times(run.pid), rounds_done(db), time.perf_counter()
        time.sleep(seconds)
        last, r1, t1 = thread_times(run.pid), rounds_done(db), time.perf_counter()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        log.close()
    rounds = r1 - r0
    if rounds < 1:
        raise RuntimeError(f"no round finished in {seconds:g} s; give --seconds more or a config with more rounds")
    threads = []
    for key, (title, name, cpu) in last.items():
        used = cpu - first.get(key, (title, name, 0.0))[2]
        threads.append({"pid": key[0], "tid": key[1], "process": title, "thread": name, "ms_per_round": used / rounds * 1e3})
    per_process: dict[str, float] = {}
    for t in threads:
        per_process[t["process"]] = per_process.get(t["process"], 0.0) + t["ms_per_round"]
    return {"rounds": rounds, "wall_ms_per_round": (t1 - t0) / rounds * 1e3, "threads": threads,
            "processes": per_process, "total_ms_per_round": sum(per_process.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a run's TOML config (enough rounds to last warmup + seconds)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the CPU is counted")
    ap.add_argument("--warmup", type=int, default=5, help="rounds in run.db before the count starts")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to fedhop run")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    if not Path("/proc/self/task").exists():
        ap.error("this benchmark reads /proc (Linux only)")
    if args.seconds <= 0 or args.warmup < 1:
        ap.error("--seconds must be > 0 and --warmup >= 1")
    config = Path(args.config).resolve()
    if not config.is_file():
        ap.error(f"config: no file {args.config}")
    with tempfile.TemporaryDirectory(prefix="round-threads-") as folder:
        try:
            figures = measure(config, args.seconds, args.warmup, args.set, Path(folder))
        except RuntimeError as exc:
            print(f"round_threads: {exc}", file=sys.stderr)
            return 1
    print(f"round_threads: {figures['rounds']} rounds, {figures['wall_ms_per_round']:.2f} ms wall a round; "
          f"ms of CPU a round")
    for t in sorted(figures["threads"], key=lambda t: (t["process"], -t["ms_per_round"])):
        if t["ms_per_round"] >= 0.01:
            print(f"  {t['process']:<40} {t['thread']:<14} {t['ms_per_round']:7.2f}")
    for process, ms in figures["processes"].items():
        print(f"{process:<42} {'(process)':<14} {ms:7.2f}")
    print(f"{'all processes':<42} {'':<14} {figures['total_ms_per_round']:7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
