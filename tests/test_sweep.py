"""`fedhop sweep`: a real sweep (fedhop run processes) interrupted with SIGINT and resumed, its table
against a by-hand computation from the run directories; spec errors; criteria on hand-made runs."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedhop.deploy.launch.engine import usable_cores
from fedhop.deploy.tools import sweep as sweep_module
from fedhop.deploy.tools.sweep import (
    Criterion,
    Runner,
    RunTask,
    Setting,
    grid_settings,
    interrupt_on_sigint,
    main,
    score_run,
)
from fedhop.deploy.tools.sweep_spec import SweepSpecError, load_spec

REPO = Path(__file__).resolve().parents[1]
LRS = [0.02, 0.1, 0.5]
SEEDS = [0, 1]
RUNS = 2 * len(LRS) * len(SEEDS)     # two algorithms


SMALL = ["run.rounds=2", "clients.count=3", "clients.per_round=3", "clients.processes=1", "algorithm.local_epochs=1",
         "model.hidden=[16]"]


def write_spec(tmp: Path, extra: str = "", parallel: int = 2, algorithms: tuple[str, ...] = ("fedavg", "fedexp"),
               sets: list[str] = SMALL, lrs: list[float] = LRS, seeds: list[int] = SEEDS) -> Path:
    spec = tmp / "sweep.toml"
    spec.write_text(f"""
[sweep]
config = "{REPO / 'examples' / 'fedavg_digits.toml'}"
algorithms = {json.dumps(list(algorithms))}
seeds = {seeds}
parallel = {parallel}
set = {json.dumps(sets)}
[grid]
"algorithm.lr" = {lrs}
[criterion]
kind = "final"
metric = "test_accuracy"
{extra}
""")
    return spec


def summaries(out: Path) -> list[Path]:
    return sorted((out / "runs").glob("*/*/seed*/summary.json"))


def processes_under(path: Path) -> list[psutil.Process]:
    """Live processes whose command line names the sweep directory (fedhop run, server, clients)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(path) in a for a in p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def by_hand(out: Path) -> dict[str, tuple[float, float]]:
    """Best lr per algorithm from the summary.json files alone: (lr, mean final accuracy over seeds)."""
    best = {}
    for alg in ("fedavg", "fedexp"):
        means = {}
        for lr in LRS:
            accs = [json.loads((out / "runs" / alg / f"lr={lr}" / f"seed{s}" / "summary.json").read_text())
                    ["final"]["test_accuracy"] for s in SEEDS]
            means[lr] = statistics.fmean(accs)
        lr = max(means, key=means.get)
        best[alg] = (lr, means[lr])
    return best


def test_a_ctrl_c_while_a_run_starts_stops_that_run_too(tmp_path, monkeypatch):
    """SIGINT right after a run's process started, before the sweep recorded it: the sweep still
    knows that process, and `stop` ends it (an unrecorded one would outlive the sweep)."""
    base = tmp_path / "base.toml"
    base.write_text("")
    task = RunTask("fedavg", Setting.of({}), 0, tmp_path / "runs" / "fedavg" / "s" / "seed0", [])
    runner = Runner(base, parallel=1)
    monkeypatch.setattr(runner, "command", lambda task: [sys.executable, "-c", "import signal; signal.pause()"])
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_sigint(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGINT)   # its handler runs at this function's next bytecode
        return proc

    monkeypatch.setattr(sweep_module.subprocess, "Popen", popen_then_sigint)
    before = signal.getsignal(signal.SIGINT)
    interrupt_on_sigint(runner)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run_all([task], on_done=lambda task, code: None)
    finally:
        signal.signal(signal.SIGINT, before)
    assert [proc.pid for proc, _ in runner.running.values()] == [started[0].pid]
    runner.stop(grace=30)
    assert started[0].poll() is not None


def test_sweep_interrupted_resumes_and_picks_the_by_hand_best(tmp_path):
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fedhop.deploy.cli.cli", "sweep", str(spec), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while len(summaries(out)) < 3:   # wait on files: three runs finished
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "no three finished runs within 300 s"
        time.sleep(0.1)
    before = {p: p.read_text() for p in summaries(out)}
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 130, text
    assert "interrupted" in text
    assert processes_under(out) == [], "the sweep left processes running"
    assert len(before) < RUNS

    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    after = summaries(out)
    assert len(after) == RUNS
    for path, text in before.items():   # finished before the interrupt: not run again
        assert path.read_text() == text
    results = json.loads((out / "results.json").read_text())
    for alg, (lr, mean) in by_hand(out).items():
        best = results["best"][alg]
        assert best["overrides"] == [f"algorithm.lr={lr}"]
        assert best["mean"] == pytest.approx(mean, abs=1e-12)
        assert len(best["runs"]) == len(SEEDS)
    table = (out / "results.md").read_text()
    assert "## fedavg" in table and "## fedexp" in table
    assert (out / "best" / "metric_vs_round.png").exists()
    report = json.loads((out / "best" / "report.json").read_text())
    assert len(report["runs"]) == 2 * len(SEEDS)   # the best setting of each algorithm, every seed


@pytest.mark.parametrize("extra,needle", [
    ('[space]\n"algorithm.lr" = { low = 0.5, high = 0.1 }', "space.\"algorithm.lr\""),
    ("[bogus]\nx = 1", "'bogus'"),
    ('[grid2]', "'grid2'"),
])
def test_bad_spec_is_one_line_naming_the_key(tmp_path, capsys, extra, needle):
    spec = write_spec(tmp_path, extra)
    assert main([str(spec), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("extra,flags,needle", [
    # a grid point that does not fit the base config (3 clients): refused before any run, naming the point
    ('"clients.per_round" = [2, 9]', [], "with clients.per_round=9, algorithm.lr=0.02): config key 'clients.per_round'"),
    ("", ["--seeds", "0,-1"], "--seeds: got [0, -1], expected distinct seeds from 0"),
    ("", ["--seeds", "1,1"], "--seeds: got [1, 1]"),
    ("", ["--seeds", f"{1 << 63}"], "--seeds"),
    ("", ["--slurm", "--time", "forever"], "--time 'forever' is not a Slurm time limit"),   # sbatch was called
    ("", ["--slurm", "--cpus-per-task", "0"], "--cpus-per-task 0: must be >= 1"),
    ("", ["--out", "afile"], "--out afile: a file, not a folder"),
    ("", ["--out", "afile/sub"], "afile is a file, so no folder can be made under it"),
], ids=["grid point", "negative seed", "duplicate seeds", "seed past 2^63-1", "slurm time", "slurm cpus", "out a file",
        "out under a file"])
def test_a_bad_setting_seed_or_folder_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, monkeypatch,
                                                                                   extra, flags, needle):
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path)
    if extra:   # one more key of the [grid] table
        spec.write_text(spec.read_text().replace("[grid]\n", f"[grid]\n{extra}\n"))
    (tmp_path / "afile").write_text("mine\n")
    out = [] if "--out" in flags else ["--out", "o"]
    assert main([str(spec), *out, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "sweep.toml"]   # no sweep folder, no run
    assert (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.parametrize("text,needle", [
    ('[sweep]\nconfig = "CFG"\nmethod = "anneal"', "sweep.method"),
    ('[sweep]\nconfig = "CFG"\nparallel = 0', "sweep.parallel"),
    ('[sweep]\nconfig = "CFG"\n[criterion]\nkind = "rounds_to_target"', "criterion.target"),
    ('[sweep]\nconfig = "CFG"\n[criterion]\nlink = "client-moon"', "criterion.link"),
    ('[sweep]\nconfig = "CFG"\nset = ["algorithm.lrr=0.1"]', "algorithm.lrr"),
    ('[sweep]\nconfig = "CFG"\n[grid]\n"algorithm.lr" = 0.1', "grid.\"algorithm.lr\""),
    ('[sweep]\nconfig = "CFG"\nmethod = "tpe"', "space"),
])
def test_spec_errors(tmp_path, text, needle):
    path = tmp_path / "s.toml"
    path.write_text(text.replace("CFG", str(REPO / "examples" / "fedavg_digits.toml")))
    with pytest.raises(SweepSpecError, match=None) as exc:
        load_spec(path)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_grid_is_the_cartesian_product():
    settings = grid_settings({"algorithm.lr": [0.1, 0.2], "algorithm.local_epochs": [1, 2, 3]})
    assert len(settings) == 6 and len(set(settings)) == 6
    assert settings[0].overrides() == ["algorithm.local_epochs=1", "algorithm.lr=0.1"]


def test_bytes_and_rounds_to_target_criteria(tmp_path):
    """Hand-made run directories (the same writer as test_report): rounds and bytes to target
    on the busiest link, a named link and all links."""
    from tests.test_report import exchange, write_run

    recs = [r for k in range(1, 5) for r in exchange(f"a{k}", k, "client-1", "server", "client-server", tensor=1000)]
    recs += [r for k in range(1, 5) for r in exchange(f"b{k}", k, "edge-0", "server", "edge-server", tensor=300)]
    run = tmp_path / "r"
    write_run(run, name="r", algorithm="fedavg", topology="star", records=recs,
              metrics=[{"test_accuracy": a} for a in (0.3, 0.5, 0.8, 0.9)])
    at = lambda kind, link="busiest": score_run(Criterion(kind, "test_accuracy", 0.75, link, "tensor"), run, 0).value
    assert at("rounds_to_target") == 3
    assert at("bytes_to_target") == 3 * 2 * 1000            # client-server is the busiest: 3 rounds, 2 messages
    assert at("bytes_to_target", "edge-server") == 3 * 2 * 300
    assert at("bytes_to_target", "total") == 3 * 2 * 1300
    assert at("final") == 0.9
    never = Criterion("rounds_to_target", "test_accuracy", 0.95, "busiest", "tensor")
    assert score_run(never, run, 0).value is None


def fake_runs(monkeypatch, calls: list):
    """Runner.run_all writes each task's summary.json itself: accuracy peaks at lr = 0.1."""
    import math as _m

    from fedhop.deploy.tools.sweep import Runner, finished

    def run_all(self, tasks, on_done):
        for t in tasks:
            if finished(t.run_dir):
                continue
            calls.append(t.run_dir)
            lr = dict(t.setting.values)["algorithm.lr"]
            acc = 0.9 - 0.1 * (_m.log10(lr) + 1) ** 2 + 0.001 * t.seed
            t.run_dir.mkdir(parents=True, exist_ok=True)
            (t.run_dir / "summary.json").write_text(json.dumps(
                {"status": "completed", "final": {"test_accuracy": acc}, "rounds_completed": 2}))
    monkeypatch.setattr(Runner, "run_all", run_all)


@pytest.mark.parametrize("method", ["random", "tpe"])
def test_optuna_search_replays_on_resume(tmp_path, monkeypatch, method):
    from fedhop.deploy.tools.sweep import Sweep

    spec_path = tmp_path / "s.toml"
    spec_path.write_text(f"""
[sweep]
config = "{REPO / 'examples' / 'fedavg_digits.toml'}"
seeds = [0, 1]
method = "{method}"
trials = 6
parallel = 2
[space]
"algorithm.lr" = {{ low = 0.001, high = 10.0, log = true }}
""")
    calls: list = []
    fake_runs(monkeypatch, calls)
    first = Sweep(load_spec(spec_path), tmp_path / "o", quiet=True)
    first.run()
    assert len(calls) == 12                                      # 6 trials x 2 seeds
    settings = [r.overrides for r in first.results["base"]]
    assert len({tuple(s) for s in settings}) == 6
    again = Sweep(load_spec(spec_path), tmp_path / "o", quiet=True)
    again.run()
    assert len(calls) == 12                                      # the same settings: every run found finished
    assert [r.overrides for r in again.results["base"]] == settings
    best = again.best()["base"]
    by_hand = max(again.results["base"], key=lambda r: statistics.fmean(x.value for x in r.runs))
    assert best.overrides == by_hand.overrides and best.spread == pytest.approx(0.001 / 2 ** 0.5)


def test_a_sweep_without_algorithms_heads_its_table_with_the_base_configs_algorithm(tmp_path):
    """No `algorithms` in the spec: the runs are filed under runs/base, and the table is headed by the
    algorithm the base config (with the spec's `set`) runs, not '## base'."""
    from fedhop.deploy.tools.sweep import Sweep
    spec_path = write_spec(tmp_path).read_text().replace('algorithms = ["fedavg", "fedexp"]\n', "")
    spec_path = spec_path.replace('set = ["run.rounds=2"', 'set = ["algorithm.name=fedprox", "run.rounds=2"')
    (tmp_path / "sweep.toml").write_text(spec_path)
    sweep = Sweep(load_spec(tmp_path / "sweep.toml"), tmp_path / "out", quiet=True)
    assert sweep._heading("base") == "fedprox (the base config's algorithm)"
    assert sweep._heading("fedexp") == "fedexp"
    sweep.results["base"] = []
    assert "## fedprox (the base config's algorithm)" in sweep.tables() and "## base" not in sweep.tables()


def test_the_heading_reads_a_setting_that_ran_when_the_fixed_overrides_alone_do_not_validate(tmp_path):
    """The spec's `set` may leave the base config invalid until the grid's values complete it
    (privacy.mode without its clipping norm, here a negative one the grid replaces): the heading
    loads the base config with a setting that ran, not with `set` alone."""
    from fedhop.common.config import ConfigError, load_config
    from fedhop.deploy.tools.sweep import SettingResult, Sweep
    text = write_spec(tmp_path).read_text().replace('algorithms = ["fedavg", "fedexp"]\n', "")
    text = text.replace('set = ["run.rounds=2"', 'set = ["algorithm.name=fedprox", "algorithm.mu=-1.0", "run.rounds=2"')
    (tmp_path / "sweep.toml").write_text(text.replace("[grid]\n", '[grid]\n"algorithm.mu" = [0.1, 0.2]\n'))
    spec = load_spec(tmp_path / "sweep.toml")
    with pytest.raises(ConfigError, match="algorithm.mu"):
        load_config(spec.base_config, spec.sweep.set)
    sweep = Sweep(spec, tmp_path / "out", quiet=True)
    sweep.results["base"] = [SettingResult("base", "mu=0.1", ["algorithm.mu=0.1"])]
    assert sweep._heading("base") == "fedprox (the base config's algorithm)"


def test_runs_of_a_parallel_sweep_share_the_cores_among_their_workers(tmp_path, monkeypatch):
    """`parallel` in-process runs at once: each child is told its share of the machine's cores
    (FEDHOP_RUN_CORES), so run.workers = "auto" forks that many workers per run, not one per core
    each (deploy/launch/workers.py `worker_count`).  A user's own FEDHOP_RUN_CORES is kept."""
    cores = usable_cores()
    monkeypatch.delenv("FEDHOP_RUN_CORES", raising=False)
    assert "FEDHOP_RUN_CORES" not in Runner(tmp_path / "base.toml", parallel=1).child_env()
    assert Runner(tmp_path / "base.toml", parallel=2).child_env()["FEDHOP_RUN_CORES"] == str(max(1, cores // 2))
    assert Runner(tmp_path / "base.toml", parallel=cores + 1).child_env()["FEDHOP_RUN_CORES"] == "1"
    monkeypatch.setenv("FEDHOP_RUN_CORES", "7")
    assert Runner(tmp_path / "base.toml", parallel=2).child_env()["FEDHOP_RUN_CORES"] == "7"
    monkeypatch.delenv("FEDHOP_RUN_CORES")

    spec = write_spec(tmp_path, algorithms=("fedavg",), seeds=[0], lrs=[0.05, 0.1],
                      sets=["run.engine=inprocess", "run.rounds=2", "clients.count=4", "clients.per_round=4",
                            "clients.processes=2", "model.hidden=[16]"])
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "sweep", str(spec), "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    share = max(1, cores // 2)
    expected = min(share, 2) if share > 1 else 0   # two client processes a run
    logs = sorted((out / "runs" / "fedavg").glob("*/seed0/logs/inprocess.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert sum(f"trains in fedhop worker {i} (forked" in text for i in range(2)) == expected, text[-2000:]
