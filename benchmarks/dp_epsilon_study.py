"""Accuracy against epsilon under DP-FedAvg (central mode, fixed clipping), on digits and on a
LEAF-format FEMNIST natural partition, over several seeds (docs/privacy.md, "Accuracy against epsilon").

    python benchmarks/dp_epsilon_study.py --out DIR [--tasks digits femnist] [--z 0 0.5 0.8 1.2 2.0]
        [--seeds 0 1 2] [--rounds 30] [--parallel 1] [--no-plain] [--plot docs/img/dp_accuracy_vs_epsilon.png]

For each task the script writes a `fedhop sweep` spec (docs/sweep.md), DIR/TASK/dp.toml, whose grid
is `privacy.noise_multiplier` over the given z values and whose seeds are the given seeds, and
(unless --no-plain) DIR/TASK/plain.toml, the same task without [privacy] (no clipping, no noise,
the same uniform weighting), and runs them with the `fedhop sweep` command in DIR/TASK into
DIR/TASK/dp and DIR/TASK/plain (real processes, one `fedhop run` per setting and seed; every sweep
at the same time, each `--parallel` runs at once; a sweep already there is resumed: finished runs
are not run again).  The LEAF task's files are made first, in the real LEAF JSON layout, by
fedhop's generator (`python -m fedhop.common.data.fakedata femnist_niid data/femnist_niid
--writers 30 --samples 60`, as docs/claims.md's LEAF check).

It then reads every run's records (`fedhop.load`: the epsilon fedhop recorded after the last round,
from dp-accounting's RDP accountant at delta = 1e-5, the sampling rate and the final test
accuracy), prints one Markdown row per task and z (epsilon, mean accuracy with its min-max over
seeds) and the plain baseline, writes the rows to DIR/study.json, and draws accuracy against
epsilon with min-max error bars for both tasks.  z = 0 clips without noise: its epsilon is
infinite, so it is drawn as a horizontal band (mean, min-max); the plain baseline as a dotted line."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import fedhop

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DELTA = 1e-5


@dataclass(frozen=True)
class Task:
    """A base config and the fixed overrides that make it a DP-FedAvg run; `data` makes its files."""

    label: str
    config: Path
    overrides: tuple[str, ...]
    data: tuple[str, ...] = ()          # arguments of `python -m fedhop.common.data.fakedata`


# the plain baseline of every task: no clipping, no noise, the same uniform weighting
PLAIN = ('privacy.mode="none"', 'privacy.clip_norm=0.0', 'privacy.noise_multiplier=0.0', 'algorithm.weighting="uniform"')
PRIVATE = ('privacy.mode="central"', 'privacy.clipping="fixed"', f"privacy.delta={DELTA}",
           'privacy.accountant="rdp"', 'privacy.sampling="poisson"', 'algorithm.weighting="uniform"')

TASKS = {
    # examples/dp_fedavg_digits.toml: 50 clients on a Dirichlet(0.5) split, 10 a round, MLP(64), C = 0.5
    "digits": Task("digits, 50 clients (Dirichlet 0.5), 10 a round", EXAMPLES / "dp_fedavg_digits.toml",
                   (*PRIVATE, "privacy.clip_norm=0.5")),
    # docs/claims.md's LEAF natural partition: 30 writers, 10 a round, MLP(64), one client process
    "femnist": Task("LEAF-format FEMNIST, 30 writers, 10 a round", EXAMPLES / "claims" / "leaf" / "femnist_natural.toml",
                    (*PRIVATE, "privacy.clip_norm=0.8"),
                    ("femnist_niid", "data/femnist_niid", "--writers", "30", "--samples", "60")),
}


@dataclass
class Point:
    """One (task, z), or a task's plain baseline: the recorded epsilon and the final test accuracy of every seed."""

    task: str
    z: float
    epsilon: float | None                  # None: z = 0 (no finite epsilon), or the plain baseline
    rounds_accounted: int
    sampling_rate: float                   # q of the last round (run.db's privacy_sampling_rate; plain: m / N)
    accuracy: dict[int, float] = field(default_factory=dict)   # seed -> final test accuracy
    plain: bool = False                    # no [privacy] at all: no clipping, no noise

    @property
    def mean(self) -> float:
        return sum(self.accuracy.values()) / len(self.accuracy)


def spec_text(config: Path, fixed: list[str], grid: dict[str, list], seeds: list[int], parallel: int) -> str:
    """A `fedhop sweep` spec over `grid`, seeds and fixed overrides; nothing is widened."""
    return "\n".join([
        "[sweep]",
        f"config = {json.dumps(str(config))}",
        f"seeds = {json.dumps(seeds)}",
        f"parallel = {parallel}",
        "extend = 0                 # z is the study's variable, not a setting to tune",
        f"set = {json.dumps(fixed)}",
        "",
        "[grid]",
        *(f"{json.dumps(key)} = {json.dumps(values)}" for key, values in grid.items()),
        "",
        "[criterion]",
        'kind = "final"',
        'metric = "test_accuracy"',
        "",
    ])


def start_sweep(folder: Path, kind: str, text: str) -> subprocess.Popen:
    """Write the spec `kind`.toml in `folder` and start `fedhop sweep` there into `kind`/ (output in `kind`.log)."""
    (folder / f"{kind}.toml").write_text(text)
    with open(folder / f"{kind}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "sweep", f"{kind}.toml", "--out", kind,
                                 "--quiet"], cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def run_tasks(names: list[str], out: Path, zs: list[float], seeds: list[int], rounds: int, parallel: int,
              plain: bool) -> dict[tuple[str, str], Path]:
    """Every task's sweeps at once (`parallel` runs each): `dp` over the noise multipliers and, with
    `plain`, the baseline without [privacy]; the sweep folder of each (task, kind)."""
    started: dict[tuple[str, str], subprocess.Popen] = {}
    for name in names:
        task, folder = TASKS[name], out / name
        folder.mkdir(parents=True, exist_ok=True)
        if task.data and not (folder / task.data[1]).is_dir():
            subprocess.run([sys.executable, "-m", "fedhop.common.data.fakedata", *task.data], cwd=folder, check=True)
        runs = [f"run.rounds={rounds}", f"run.eval_every={rounds}"]
        started[name, "dp"] = start_sweep(folder, "dp", spec_text(
            task.config, [*task.overrides, *runs], {"privacy.noise_multiplier": [float(z) for z in zs]}, seeds,
            parallel))
        if plain:
            started[name, "plain"] = start_sweep(folder, "plain", spec_text(
                task.config, [*PLAIN, *runs], {"privacy.mode": ["none"]}, seeds, parallel))
    for (name, kind), proc in started.items():
        if proc.wait() != 0:
            tail = (out / name / f"{kind}.log").read_text().strip().splitlines()[-1:]
            raise SystemExit(f"dp_epsilon_study: fedhop sweep {kind} for {name} exited {proc.returncode}: {tail}")
    return {key: out / key[0] / key[1] for key in started}


def collect(name: str, sweep: Path) -> list[Point]:
    """One point per z (or the plain baseline) from the sweep's results.json and each run's records."""
    results = json.loads((sweep / "results.json").read_text())
    points = []
    for setting in next(iter(results["settings"].values())):
        plain = setting["point"].get("privacy.mode") == "none"
        z = 0.0 if plain else float(setting["point"]["privacy.noise_multiplier"])
        point: Point | None = None
        for run in setting["runs"]:
            run_dir = sweep.parent / run["run_dir"]       # relative to the folder the sweep ran in
            result = fedhop.load(run_dir)
            if result.status != "completed":
                raise SystemExit(f"dp_epsilon_study: {run_dir} ended {result.status}")
            if plain and point is None:
                clients = result.config["clients"]
                point = Point(name, z, None, 0, clients["per_round"] / clients["count"], plain=True)
            privacy = result.summary.get("privacy") or {"epsilon": None}
            if point is None:
                point = Point(name, z, privacy["epsilon"], int(privacy["rounds_accounted"]),
                              float(result.rounds[-1]["privacy_sampling_rate"]))
            elif privacy["epsilon"] != point.epsilon:     # epsilon depends on q, z, delta, rounds only
                raise SystemExit(f"dp_epsilon_study: {name} z={z}: seeds recorded different epsilons")
            point.accuracy[int(run["seed"])] = float(run["final"])
        assert point is not None
        points.append(point)
    return sorted(points, key=lambda p: (not p.plain, p.z))


def table(points: list[Point]) -> str:
    lines = ["| task | z | epsilon (delta = 1e-5) | accuracy, mean | min | max | seeds |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        eps = "none (no DP)" if p.plain else "inf (no noise)" if p.epsilon is None else f"{p.epsilon:.3f}"
        acc = p.accuracy.values()
        lines.append(f"| {p.task} | {'plain' if p.plain else f'{p.z:g}'} | {eps} | {p.mean:.4f} | {min(acc):.4f} | {max(acc):.4f} | "
                     f"{len(p.accuracy)} |")
    return "\n".join(lines)


def plot(points: list[Point], path: Path, labels: dict[str, str]) -> None:
    """Accuracy against epsilon (log scale), mean with min-max bars per z; z = 0 as a band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(dict.fromkeys(p.task for p in points)):
        color = f"C{i}"
        noisy = [p for p in points if p.task == name and p.epsilon is not None]
        if noisy:
            eps = [float(p.epsilon or 0.0) for p in noisy]      # every epsilon here is finite
            mean = [p.mean for p in noisy]
            low = [p.mean - min(p.accuracy.values()) for p in noisy]
            high = [max(p.accuracy.values()) - p.mean for p in noisy]
            ax.errorbar(eps, mean, yerr=[low, high], marker="o", capsize=4, color=color, label=labels[name])
            for p in noisy:
                ax.annotate(f"z={p.z:g}", (p.epsilon, p.mean), textcoords="offset points", xytext=(5, -12),
                            fontsize=8, color=color)
        for p in (q for q in points if q.task == name and q.plain):
            ax.axhline(p.mean, color=color, linestyle=":", linewidth=1.5,
                       label=f"{name}: plain (no clipping, no noise)")
        for p in (q for q in points if q.task == name and q.epsilon is None and not q.plain):
            ax.axhline(p.mean, color=color, linestyle="--", linewidth=1,
                       label=f"{name}: z = 0 (clipping only, epsilon infinite)")
            ax.axhspan(min(p.accuracy.values()), max(p.accuracy.values()), color=color, alpha=0.12)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("epsilon after the last round (delta = 1e-5, RDP)")
    ax.set_ylabel("final test accuracy (mean, min-max over seeds)")
    ax.set_title("DP-FedAvg (central, fixed clipping): accuracy against epsilon")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="study folder: DIR/TASK/sweep holds each task's sweep")
    ap.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["digits", "femnist"])
    ap.add_argument("--z", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.2, 2.0], help="noise multipliers")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time per sweep (the sweeps run at once)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain baseline (no [privacy]) of each task")
    ap.add_argument("--plot", default="", help="the plot's path (default DIR/dp_accuracy_vs_epsilon.png)")
    args = ap.parse_args(argv)
    if any(z < 0 for z in args.z) or args.rounds < 1 or args.parallel < 1:
        print("dp_epsilon_study: --z must be >= 0, --rounds and --parallel >= 1", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    sweeps = run_tasks(args.tasks, out, args.z, args.seeds, args.rounds, args.parallel, plain=not args.no_plain)
    points = [p for (name, _), sweep in sweeps.items() for p in collect(name, sweep)]
    points.sort(key=lambda p: (args.tasks.index(p.task), not p.plain, p.z))
    print(f"{args.rounds} rounds, seeds {args.seeds}; central DP-FedAvg, fixed clipping, delta = {DELTA}\n")
    print(table(points))
    (out / "study.json").write_text(json.dumps({"rounds": args.rounds, "seeds": args.seeds, "delta": DELTA,
                                                "points": [asdict(p) | {"mean": p.mean} for p in points]}, indent=2))
    figure = Path(args.plot) if args.plot else out / "dp_accuracy_vs_epsilon.png"
    plot(points, figure, {n: TASKS[n].label for n in args.tasks})
    print(f"\nwrote {out / 'study.json'} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
