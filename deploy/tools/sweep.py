"""`fedhop sweep SWEEP.toml`: tuned comparisons over seeds (docs/sweep.md).

For each algorithm the sweep tries settings (a grid of `[grid]` values, or `trials` settings drawn
by Optuna's random or TPE sampler from `[space]`), runs each setting once per seed as a normal
`fedhop run` in its own directory, `parallel` runs at a time, scores every run by the criterion,
and writes one table per algorithm: the settings ranked by the criterion's mean over seeds, with
its spread (sample standard deviation).  The best setting of every algorithm goes into one
`fedhop report` (plots side by side) under SWEEP_DIR/best.

Layout: SWEEP_DIR/runs/ALGORITHM/SETTING/seedS is a run directory; SETTING/setting.json holds the
overrides.  A run directory with a summary.json is finished (completed or failed) and is never
run again, so an interrupted sweep resumes where it stopped; one without (stopped mid-run) is
cleared and run again.  Ctrl-C (SIGINT) stops every running `fedhop run` the way its own Ctrl-C
does (each stops its server and clients) and the sweep exits 130.

A TPE search replays: trials are asked in batches and told in ask order, with the sampler seeded,
so a resumed TPE sweep asks the same settings again and finds their runs finished.

Bracketing (deploy/tools/bracket.py): a best setting whose value of a swept key is the smallest or
largest tried (the outer tenth of a random / TPE range) is marked "on the edge" in the table and
in results.json; with `sweep.extend = N` (`--extend N`) the sweep runs the best setting with that
key one geometric step further, re-ranks, and repeats, up to N times per algorithm, until every
best is interior.  The widening is a deterministic function of the finished runs, so a resumed
sweep makes the same steps and finds their runs finished.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from fedhop.common.util.cliparser import ArgumentParser, folder_problem
from fedhop.common.util.procexit import LAUNCHER_ENV
from fedhop.deploy.launch.engine import RUN_CORES_ENV, usable_cores
from fedhop.deploy.launch.slurm import SlurmArrayRunner, add_slurm_args, options_from
from fedhop.deploy.tools.bracket import Edge, edges, widen
from fedhop.deploy.tools.report import RunData, build_report, load_run, lower_is_better, meets
from fedhop.deploy.tools.sweep_spec import (
    CRITERIA,
    Dist,
    SweepSpec,
    SweepSpecError,
    check_base_config,
    check_seeds,
    load_spec,
    setting_error,
    toml_value,
)

CLASSIFICATION = ("digits", "breast_cancer", "mnist", "npz", "robust_digits", "fair_digits")


# -- settings -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One point of the search: dotted key -> value."""

    values: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, values: dict[str, Any]) -> "Setting":
        return cls(tuple(sorted(values.items())))

    def overrides(self) -> list[str]:
        return [f"{k}={toml_value(v)}" for k, v in self.values]

    def label(self) -> str:
        return ", ".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in self.values) or "(base)"

    def slug(self) -> str:
        """A directory name: readable when short, else a hash of the overrides."""
        text = ",".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in self.values) or "base"
        text = re.sub(r"[^A-Za-z0-9_.=,+-]", "_", text)
        if len(text) <= 60 and len({k.split('.')[-1] for k, _ in self.values}) == len(self.values):
            return text
        return "s-" + hashlib.sha1(json.dumps(self.values, default=str).encode()).hexdigest()[:12]


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def grid_settings(grid: dict[str, list]) -> list[Setting]:
    keys = sorted(grid)
    return [Setting.of(dict(zip(keys, combo))) for combo in itertools.product(*(grid[k] for k in keys))]


def optuna_distribution(d: Dist):
    import optuna

    if d.choices is not None:
        return optuna.distributions.CategoricalDistribution(d.choices)
    assert d.low is not None and d.high is not None   # sweep_spec: a range without choices has both ends
    if all(isinstance(x, int) and not isinstance(x, bool) for x in (d.low, d.high)) and \
            (d.step is None or isinstance(d.step, int)):
        return optuna.distributions.IntDistribution(int(d.low), int(d.high), log=d.log, step=d.step or 1)
    return optuna.distributions.FloatDistribution(float(d.low), float(d.high), log=d.log,
                                                  step=None if d.step is None else float(d.step))


# -- running --------------------------------------------------------------------------------
@dataclass
class RunTask:
    algorithm: str
    setting: Setting
    seed: int
    run_dir: Path
    overrides: list[str]


def finished(run_dir: Path) -> bool:
    """A run directory whose server wrote summary.json with status completed or failed; a run
    stopped mid-way (Ctrl-C, SIGTERM: status "stopped") is run again."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") in ("completed", "failed")
    except (OSError, ValueError, AttributeError):
        return False


def last_line(log: Path) -> str:
    """The last non-empty line of a log, for a one-line report."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"(no log at {log})"
    return lines[-1] if lines else f"(empty log {log})"


def request_file(run_dir: Path) -> Path:
    """The request that made `run_dir` (base config digest and overrides): SETTING/seedS.request.json."""
    return run_dir.with_name(run_dir.name + ".request.json")


def launcher_log(run_dir: Path) -> Path:
    """The output of the `fedhop run` that made `run_dir`: SETTING/seedS.log."""
    return run_dir.with_name(run_dir.name + ".log")


class Runner:
    """Runs `fedhop run` child processes, at most `parallel` at a time."""

    def __init__(self, base_config: Path, parallel: int, quiet: bool = True) -> None:
        self.base_config = base_config
        self.parallel = parallel
        self.quiet = quiet
        self.running: dict[int, tuple[subprocess.Popen, RunTask]] = {}
        # Set by the sweep's SIGINT handler: a KeyboardInterrupt raised where Python swallows it
        # (an at-fork handler while a child is being started) still stops the sweep at the next check.
        self.interrupted = False
        # True while a child is started and recorded: the handler then only sets `interrupted`, since
        # an exception between Popen's return and `running` would leave a run that `stop` never stops
        # (it would live on until its SIGTERM at this process's exit, common/util/procexit.py die_with).
        self.starting = False

    def command(self, task: RunTask) -> list[str]:
        argv = [sys.executable, "-m", "fedhop.deploy.cli.cli", "run", str(self.base_config), "--out",
                str(task.run_dir.resolve()),
                "--quiet"]
        for o in task.overrides:
            argv += ["--set", o]
        return argv

    def child_env(self) -> dict[str, str]:
        """A run's environment: this one's, its launcher named, and the cores it may use
        (FEDHOP_RUN_CORES: the machine's over `parallel`, unless the user set it), so that an
        in-process run with run.workers = "auto" forks no more workers than its share."""
        env = {**os.environ, LAUNCHER_ENV: str(os.getpid())}
        if self.parallel > 1:
            env.setdefault(RUN_CORES_ENV, str(max(1, usable_cores() // self.parallel)))
        return env

    def run_all(self, tasks: list[RunTask], on_done: Callable[[RunTask, int], None]) -> None:
        pending = [t for t in tasks if not (finished(t.run_dir) and self.same_request(t))]
        while pending or self.running:
            while pending and len(self.running) < self.parallel:
                self._check_interrupt()
                self._start(pending.pop(0))
            self._reap(on_done)

    def request(self, task: RunTask) -> dict:
        """What a run is asked to be: its base config's text and its overrides, in order."""
        return {"base_config": str(self.base_config), "base_config_sha256":
                hashlib.sha256(self.base_config.read_bytes()).hexdigest(), "overrides": list(task.overrides)}

    def same_request(self, task: RunTask) -> bool:
        """Whether a finished run was made by the request this sweep would make now; one made
        with other overrides (another --set, spec or base config) is run again, never reused."""
        try:
            recorded = json.loads(request_file(task.run_dir).read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded == self.request(task):
            return True
        if not self.quiet:
            print(f"sweep: {task.run_dir} was made with other settings; running it again", file=sys.stderr, flush=True)
        return False

    def _check_interrupt(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt

    def _start(self, task: RunTask) -> None:
        if task.run_dir.exists():   # stopped mid-run: its records are partial, run it again
            shutil.rmtree(task.run_dir)
        task.run_dir.parent.mkdir(parents=True, exist_ok=True)
        # beside the run folder, which `fedhop run --out` creates itself
        request_file(task.run_dir).write_text(json.dumps(self.request(task), indent=2))
        self.starting = True
        try:
            with open(launcher_log(task.run_dir), "wb") as log:
                # Own session: a terminal's Ctrl-C reaches the sweep only; the sweep stops its children (stop()).
                proc = subprocess.Popen(self.command(task), stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(),
                                        start_new_session=True, env=self.child_env())
            self.running[proc.pid] = (proc, task)
        finally:
            self.starting = False
        self._check_interrupt()
        if not self.quiet:
            print(f"sweep: started {task.run_dir}", file=sys.stderr, flush=True)

    def _reap(self, on_done: Callable[[RunTask, int], None]) -> None:
        """Return once at least one running child has exited (each reported to `on_done`)."""
        while self.running:
            self._check_interrupt()
            done = [(pid, proc, task) for pid, (proc, task) in self.running.items() if proc.poll() is not None]
            for pid, proc, task in done:
                del self.running[pid]
                on_done(task, proc.returncode)
            if done:
                return
            time.sleep(0.1)   # runs last seconds to minutes; a short poll keeps Ctrl-C prompt

    def stop(self, grace: float = 20.0) -> None:
        """Ctrl-C for every running run (each stops its own processes), then SIGKILL its group
        if it has not exited within `grace`."""
        for proc, _ in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace
        for proc, _ in self.running.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.running.clear()


# -- scoring --------------------------------------------------------------------------------
@dataclass
class RunScore:
    run_dir: str
    seed: int
    status: str
    value: float | None          # the criterion; None: failed, or the target never reached
    final: float | None
    clients_dropped: int


@dataclass
class SettingResult:
    algorithm: str
    setting: str
    overrides: list[str]
    runs: list[RunScore] = field(default_factory=list)
    point: dict[str, Any] = field(default_factory=dict)    # the swept keys' values
    widened: int = 0          # 0: a point of the grid / search; k: added by the k-th widening past an edge

    def values(self) -> list[float]:
        return [r.value for r in self.runs if r.value is not None]

    @property
    def mean(self) -> float | None:
        v = self.values()
        return statistics.fmean(v) if v else None

    @property
    def spread(self) -> float | None:
        v = self.values()
        return statistics.stdev(v) if len(v) > 1 else (0.0 if v else None)

    @property
    def final_mean(self) -> float | None:
        v = [r.final for r in self.runs if r.final is not None]
        return statistics.fmean(v) if v else None


class Criterion:
    """Scores a run: its final metric, its rounds to the target, or its bytes to the target on a
    link class (busiest: the link class with the most bytes up to that round)."""

    def __init__(self, kind: str, metric: str, target: float | None, link: str, bytes_kind: str) -> None:
        self.kind, self.metric, self.target, self.link = kind, metric, target, link
        self.byte_field = f"{bytes_kind}_bytes"

    @property
    def higher_is_better(self) -> bool:
        return self.kind == "final" and not lower_is_better(self.metric)

    def describe(self) -> str:
        if self.kind == "final":
            return f"final {self.metric} ({'higher' if self.higher_is_better else 'lower'} is better)"
        cmp = "<=" if lower_is_better(self.metric) else ">="
        what = "rounds" if self.kind == "rounds_to_target" else f"{self.byte_field} on the {self.link} link"
        return f"{what} until {self.metric} {cmp} {self.target:g} (lower is better)"

    def final(self, run: RunData) -> float | None:
        v = (run.summary.get("final") or {}).get(self.metric)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        curve = run.curve(self.metric)
        return curve[-1][1] if curve and math.isfinite(curve[-1][1]) else None

    def score(self, run: RunData) -> float | None:
        if run.summary.get("status") != "completed":
            return None
        if self.kind == "final":
            return self.final(run)
        target = self.target
        assert target is not None   # sweep_spec requires it for the *_to_target kinds
        hit = next((r for r, v in run.curve(self.metric) if meets(v, target, self.metric)), None)
        if hit is None:
            return None
        if self.kind == "rounds_to_target":
            return float(hit)
        return float(self.link_bytes_upto(run.run_dir, hit))

    def link_bytes_upto(self, run_dir: Path, round_: int) -> int:
        from fedhop.common.records.runstore import RunStore
        with RunStore(run_dir / "run.db", create=False, read_only=True) as store:
            per_link = store.bytes_by_link_upto(round_)
        if self.link == "total":
            return sum(v[self.byte_field] for v in per_link.values())
        if self.link == "busiest":
            return max((v[self.byte_field] for v in per_link.values()), default=0)
        return per_link.get(self.link, {}).get(self.byte_field, 0)

    def rank_key(self, res: SettingResult) -> tuple:
        """Most seeds with a value first, then the best mean."""
        mean = res.mean
        if mean is None:
            return (0, math.inf)
        return (-len(res.values()), -mean if self.higher_is_better else mean)


def score_run(crit: Criterion, run_dir: Path, seed: int) -> RunScore:
    notes: list[str] = []
    run = load_run(run_dir, notes)
    if run is None:
        return RunScore(str(run_dir), seed, "missing", None, None, 0)
    return RunScore(str(run_dir), seed, str(run.summary.get("status", "-")), crit.score(run), crit.final(run),
                    int(run.summary.get("clients_dropped", run.summary.get("failures", 0)) or 0))


# -- the sweep ------------------------------------------------------------------------------
class Sweep:
    def __init__(self, spec: SweepSpec, out: Path, quiet: bool = False) -> None:
        self.spec, self.out, self.quiet = spec, out, quiet
        c = spec.criterion
        self.criterion = Criterion(c.kind, c.metric or self._default_metric(), c.target, c.link, c.bytes)
        self.runner: Runner | SlurmArrayRunner = Runner(spec.base_config.resolve(), spec.sweep.parallel, quiet)
        self.results: dict[str, list[SettingResult]] = {}
        self.widenings: dict[str, int] = {}     # algorithm -> widenings run past an edge best
        self.notes: dict[str, list[str]] = {}   # algorithm -> edges that could not be widened, and why

    def _default_metric(self) -> str:
        """test_accuracy for the classification data sets, else objective (as `fedhop report` prefers)."""
        from fedhop.common.config import load_config
        cfg = load_config(self.spec.base_config, self.spec.sweep.set)
        return "test_accuracy" if cfg.data.dataset in CLASSIFICATION else "objective"

    def tasks_for(self, algorithm: str, setting: Setting) -> list[RunTask]:
        alg_dir = self.out / "runs" / (algorithm or "base")
        sdir = alg_dir / setting.slug()
        sdir.mkdir(parents=True, exist_ok=True)
        overrides = [*self.spec.fixed_overrides(algorithm), *setting.overrides()]
        (sdir / "setting.json").write_text(json.dumps({"algorithm": algorithm, "values": dict(setting.values),
                                                       "overrides": overrides}, indent=2, default=str))
        name = f"{algorithm or 'run'} {setting.label()}"
        return [RunTask(algorithm, setting, s, sdir / f"seed{s}",
                        [*overrides, f"run.seed={s}", f"run.name={toml_value(f'{name} seed{s}')}"])
                for s in self.spec.sweep.seeds]

    def collect(self, algorithm: str, setting: Setting, tasks: list[RunTask], widened: int = 0) -> SettingResult:
        res = SettingResult(algorithm or "base", setting.label(), setting.overrides(), point=dict(setting.values),
                            widened=widened)
        res.runs = [score_run(self.criterion, t.run_dir, t.seed) for t in tasks]
        self.results.setdefault(algorithm or "base", []).append(res)
        return res

    def _on_done(self, task: RunTask, code: int) -> None:
        if not self.quiet:
            state = "finished" if finished(task.run_dir) else \
                f"exited {code} without a summary: {last_line(launcher_log(task.run_dir))}"
            print(f"sweep: {task.run_dir} {state}", file=sys.stderr, flush=True)

    def run(self) -> None:
        for algorithm in self.spec.algorithms():
            if self.spec.sweep.method == "grid":
                self._grid(algorithm)
            else:
                self._optuna(algorithm)
            self._bracket(algorithm)

    # -- bracketing -------------------------------------------------------------------------
    def edges(self, algorithm: str) -> list[Edge]:
        """The swept keys on whose edge `algorithm`'s best setting lies (none: bracketed)."""
        ranked = self.ranked(algorithm)
        if not ranked or ranked[0].mean is None:
            return []
        space = self.spec.space_for(algorithm) if self.spec.sweep.method != "grid" else None
        return edges(ranked[0].point, [r.point for r in ranked], space)

    def _bracket(self, algorithm: str) -> None:
        """Widen past an edge best, up to sweep.extend times (module docstring)."""
        key = algorithm or "base"
        self.widenings[key], self.notes[key] = 0, []
        for step in range(1, self.spec.sweep.extend + 1):
            found = self.edges(key)
            if not found:
                return
            best = self.ranked(key)[0]
            valid = lambda values: setting_error(self.spec, algorithm, Setting.of(values).overrides())  # noqa: E731
            new, notes = widen(best.point, found, [r.point for r in self.results[key]],
                               self.spec.sweep.extend_factor, valid)
            self.notes[key] += notes
            if not new:
                return
            settings = [Setting.of(v) for v in new]
            tasks = {s: self.tasks_for(algorithm, s) for s in settings}
            if not self.quiet:
                print(f"sweep: {key}: best on the edge ({'; '.join(e.describe() for e in found)}); widening "
                      f"{step}/{self.spec.sweep.extend}: {', '.join(s.label() for s in settings)}",
                      file=sys.stderr, flush=True)
            self.runner.run_all([t for ts in tasks.values() for t in ts], self._on_done)
            for s in settings:
                self.collect(algorithm, s, tasks[s], widened=step)
            self.widenings[key] = step

    def _grid(self, algorithm: str) -> None:
        settings = grid_settings(self.spec.grid_for(algorithm))[:self.spec.max_settings]
        tasks = {s: self.tasks_for(algorithm, s) for s in settings}
        self.runner.run_all([t for ts in tasks.values() for t in ts], self._on_done)
        for s in settings:
            self.collect(algorithm, s, tasks[s])

    def _optuna(self, algorithm: str) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        seed = self.spec.sweep.sampler_seed
        sampler = optuna.samplers.TPESampler(seed=seed) if self.spec.sweep.method == "tpe" \
            else optuna.samplers.RandomSampler(seed=seed)
        study = optuna.create_study(sampler=sampler,
                                    direction="maximize" if self.criterion.higher_is_better else "minimize")
        dists = {k: optuna_distribution(d) for k, d in sorted(self.spec.space_for(algorithm).items())}
        batch = max(1, math.ceil(self.spec.sweep.parallel / len(self.spec.sweep.seeds)))
        done = 0
        while done < self.spec.sweep.trials:
            trials = [study.ask(dists) for _ in range(min(batch, self.spec.sweep.trials - done))]
            settings = [Setting.of(dict(t.params)) for t in trials]
            tasks = [self.tasks_for(algorithm, s) for s in settings]
            self.runner.run_all([t for ts in tasks for t in ts], self._on_done)
            for trial, s, ts in zip(trials, settings, tasks):   # told in ask order: a resumed sweep replays
                res = self.collect(algorithm, s, ts)
                if res.mean is None:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                else:
                    study.tell(trial, res.mean)
            done += len(trials)

    # -- output -----------------------------------------------------------------------------
    def ranked(self, algorithm: str) -> list[SettingResult]:
        return sorted(self.results.get(algorithm, []), key=self.criterion.rank_key)

    def best(self) -> dict[str, SettingResult]:
        return {a: self.ranked(a)[0] for a in self.results if self.ranked(a)}

    def _heading(self, algorithm: str) -> str:
        """A table's heading: the algorithm swept, or for a sweep without `algorithms` (its runs filed
        under "base") the base config's own algorithm, named as such."""
        if algorithm != "base":
            return algorithm
        from fedhop.common.config import load_config
        ran = self.results.get(algorithm) or []   # a setting that ran: the fixed overrides alone may not validate
        setting = ran[0].overrides if ran else []
        name = load_config(self.spec.base_config, [*self.spec.fixed_overrides(""), *setting]).algorithm.name
        return f"{name} (the base config's algorithm)"

    def tables(self) -> str:
        crit = self.criterion
        n = len(self.spec.sweep.seeds)
        out = [f"# fedhop sweep: {self.spec.path.name}", "",
               f"criterion: {crit.describe()}; mean and sample standard deviation over {n} seeds "
               f"({', '.join(map(str, self.spec.sweep.seeds))}); settings ranked by the seeds with a value, "
               f"then the mean; a best setting whose value of a swept key is the smallest or largest tried is "
               f"marked on the edge (widened past it up to {self.spec.sweep.extend} times: sweep.extend / --extend)",
               ""]
        for algorithm in self.results:
            found = self.edges(algorithm)
            out += [f"## {self._heading(algorithm)}", "", f"| rank | setting | criterion mean | spread (sd) | seeds with a value "
                    f"| final {crit.metric} mean | clients dropped |", "|---|---|---|---|---|---|---|"]
            for i, res in enumerate(self.ranked(algorithm), start=1):
                dropped = sum(r.clients_dropped for r in res.runs)
                mark = "" if i > 1 else (f" (best, ON THE EDGE: {', '.join(e.key.split('.')[-1] for e in found)})"
                                         if found else " (best)")
                label = res.setting + (f" (widened {res.widened})" if res.widened else "")
                out.append(f"| {i}{mark} | {label} | {_fmt(res.mean)} | "
                           f"{_fmt(res.spread)} | {len(res.values())}/{len(res.runs)} | {_fmt(res.final_mean)} | "
                           f"{dropped} |")
            out.append("")
            out.append(self._bracket_line(algorithm, found))
            out.append("")
        return "\n".join(out)

    def _bracket_line(self, algorithm: str, found: list[Edge]) -> str:
        done = self.widenings.get(algorithm, 0)
        widened = f" after {done} widening(s)" if done else ""
        notes = f" (not widened: {'; '.join(self.notes[algorithm])})" if self.notes.get(algorithm) else ""
        if not found:
            return f"bracketed{widened}: the best value of every swept key lies inside the values tried{notes}"
        return (f"**best on the edge**{widened}: {'; '.join(e.describe() for e in found)}; a value beyond it may be "
                f"better (widen with --extend N){notes}")

    def write(self) -> tuple[Path, Path | None]:
        table = self.tables()
        (self.out / "results.md").write_text(table + "\n")
        (self.out / "results.json").write_text(json.dumps(
            {"criterion": {"description": self.criterion.describe(), **asdict(self.spec.criterion),
                           "metric": self.criterion.metric},
             "best": {a: asdict(r) | {"mean": r.mean, "spread": r.spread, "edges": [e.as_dict() for e in self.edges(a)],
                                      "interior": not self.edges(a)} for a, r in self.best().items()},
             "bracketed": {"all_interior": all(not self.edges(a) for a in self.best()),
                           "extend": self.spec.sweep.extend, "extend_factor": self.spec.sweep.extend_factor,
                           "widenings": dict(self.widenings),
                           "not_widened": {a: n for a, n in self.notes.items() if n}},
             "settings": {a: [asdict(r) | {"mean": r.mean, "spread": r.spread} for r in self.ranked(a)]
                          for a in self.results}}, indent=2, default=str))
        best_dirs = [r.run_dir for res in self.best().values() for r in res.runs if finished(Path(r.run_dir))]
        if not best_dirs:
            return self.out / "results.md", None
        target = self.criterion.target if self.criterion.kind != "final" else None
        report = build_report(best_dirs, self.out / "best", target=target, metric=self.criterion.metric,
                              bytes_kind=self.criterion.byte_field)
        return self.out / "results.md", report.out_dir


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.4g}"


def default_out(spec: SweepSpec) -> Path:
    return Path("sweeps") / spec.path.stem


def seed_list(text: str) -> list[int]:
    """`--seeds 0,1,2` (argparse's type: a bad list is one usage line naming --seeds)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers, e.g. 0,1,2") from None


def interrupt_on_sigint(runner: Runner | SlurmArrayRunner) -> None:
    """Ctrl-C stops the sweep: KeyboardInterrupt at once, or, while the runner starts a child,
    once that child is recorded (`Runner.starting`).  An ignored SIGINT (a background job's) stays so."""
    def on_sigint(signum: int, frame: Any) -> None:
        runner.interrupted = True
        if not runner.starting:
            raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_sigint)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop sweep", description="tuned comparisons: settings x seeds, best per "
                                                                  "algorithm by a criterion")
    ap.add_argument("spec", metavar="SWEEP.toml")
    ap.add_argument("--out", help="sweep directory (default sweeps/SPEC_NAME); an existing one is resumed")
    ap.add_argument("--parallel", type=int, help="runs at a time (overrides sweep.parallel)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a fixed override of every run, after sweep.set (repeatable)")
    ap.add_argument("--seeds", type=seed_list, metavar="S,S,...", help="run these seeds instead of sweep.seeds")
    ap.add_argument("--criterion", choices=CRITERIA, help="overrides criterion.kind (finished runs are re-scored, "
                                                          "not re-run)")
    ap.add_argument("--metric", help="overrides criterion.metric")
    ap.add_argument("--target", type=float, help="overrides criterion.target")
    ap.add_argument("--max-settings", type=int, metavar="N",
                    help="the first N settings per algorithm only (grid order, or N trials): a quick check")
    ap.add_argument("--extend", type=int, metavar="N",
                    help="widen a grid past a best setting on its edge up to N times per algorithm (overrides "
                         "sweep.extend; 0: only mark it)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--slurm", action="store_true", help="submit the runs as a Slurm job array (deploy/launch/slurm.py)")
    add_slurm_args(ap)   # the sbatch options of `fedhop slurm` (--partition, --time, ...)
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except SweepSpecError as exc:
        print(f"fedhop sweep: {exc}", file=sys.stderr)
        return 2
    for flag, value in (("--parallel", args.parallel), ("--max-settings", args.max_settings)):
        if value is not None and value < 1:
            print(f"fedhop sweep: {flag} {value}: must be >= 1", file=sys.stderr)
            return 2
    if args.extend is not None:
        if args.extend < 0:
            print(f"fedhop sweep: --extend {args.extend}: must be >= 0", file=sys.stderr)
            return 2
        spec.sweep.extend = args.extend
    if args.parallel is not None:
        spec.sweep.parallel = args.parallel
    if args.seeds is not None:
        try:
            check_seeds(args.seeds, "--seeds")
        except SweepSpecError as exc:
            print(f"fedhop sweep: {exc}", file=sys.stderr)
            return 2
        spec.sweep.seeds = args.seeds
    if args.max_settings is not None:
        spec.sweep.trials = min(spec.sweep.trials, args.max_settings)
        spec.max_settings = args.max_settings
    spec.sweep.set = [*spec.sweep.set, *args.overrides]
    for key, value in (("kind", args.criterion), ("metric", args.metric), ("target", args.target)):
        if value is not None:
            setattr(spec.criterion, key, value)
    if spec.criterion.kind != "final" and spec.criterion.target is None:
        print(f"fedhop sweep: criterion {spec.criterion.kind} needs a target (criterion.target or --target)",
              file=sys.stderr)
        return 2
    try:
        check_base_config(spec)
    except SweepSpecError as exc:
        print(f"fedhop sweep: {exc}", file=sys.stderr)
        return 2
    slurm = options_from(args) if args.slurm else None
    refusal = slurm.refusal() if slurm is not None else None
    if refusal:   # before any folder or job: sbatch would refuse it only after the runs were laid out
        print(f"fedhop sweep: {refusal}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out(spec)
    problem = folder_problem(out, "--out")
    try:
        if problem is None:
            out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:   # no permission, no space
        problem = f"--out {out}: {exc.strerror}"
    if problem is not None:
        print(f"fedhop sweep: {problem}", file=sys.stderr)
        return 2
    (out / "spec.toml").write_text(Path(args.spec).read_text())
    sweep = Sweep(spec, out, quiet=args.quiet)
    if slurm is not None:
        sweep.runner = SlurmArrayRunner(sweep.runner, slurm)

    interrupt_on_sigint(sweep.runner)
    try:
        sweep.run()
    except KeyboardInterrupt:
        print("\nfedhop sweep: interrupted; stopping the running runs", file=sys.stderr)
        sweep.runner.stop()
        again = [a for a in (argv if argv is not None else sys.argv[1:])]
        if "--out" not in again:
            again += ["--out", str(out)]
        print(f"fedhop sweep: resume with `fedhop sweep {shlex.join(again)}`", file=sys.stderr)
        return 130
    table, best = sweep.write()
    print(table.read_text())
    print(f"wrote {table}" + (f" and the best settings' report in {best}" if best else ""))
    broken = [r.run_dir for results in sweep.results.values() for res in results for r in res.runs
              if not finished(Path(r.run_dir))]
    if broken:   # a run that diverged still has a summary (status failed); these never got that far
        print(f"fedhop sweep: {len(broken)} run(s) wrote no summary, e.g. {broken[0]}: "
              f"{last_line(launcher_log(Path(broken[0])))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
