"""fedhop as installed (issue 25, item 2): the wheel built from this working tree, installed into a
fresh venv, and the user journey run with that venv's `fedhop`, as separate processes, from folders
outside the repository, with relative paths and no PYTHONPATH: a run with a relative --out, three
seeds started at once without --out, a sweep, a report, the dashboard, a plug-in package in the
current folder, certificates and mutual TLS, Ctrl-C then merge-ledgers then resume, and --out onto
a finished run (refused; --force reruns).

How the venv is made and why its dependencies come from the test venv: tests/installkit.py. The
wheel is built once per module; `FEDHOP_TEST_WHEEL=PATH` tests a given wheel instead.
"""
from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import textwrap
import tomllib
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from packaging.requirements import Requirement
from safetensors.numpy import load_file

from tests.helpers import numpy_fedavg_round, quadratic_config
from tests.installkit import (
    ROOT,
    Installed,
    explain,
    fedhop,
    install,
    interrupt,
    left_behind,
    probe,
    read_line,
    rounds_recorded,
    start,
    wait_for,
    wheel_under_test,
)

NAME = "journey"
ROUNDS = 2
# the smallest run that still learns something: 4 clients on digits, 2 sampled a round, one client process
EXP = f"""
[run]
name = "{NAME}"
seed = 0
rounds = {ROUNDS}
eval_every = 1

[algorithm]
name = "fedavg"
lr = 0.1
local_epochs = 1
batch_size = 32

[data]
dataset = "digits"
partition = "iid"

[model]
kind = "mlp"
hidden = [8]

[clients]
count = 4
per_round = 2
processes = 1

[transport]
kind = "grpc"
"""


def user_folder(path: Path, config: str = EXP) -> Path:
    """A user's own folder (outside the repository) holding exp.toml."""
    assert not path.resolve().is_relative_to(ROOT), f"{path} is inside the repository"
    path.mkdir(parents=True, exist_ok=True)
    (path / "exp.toml").write_text(config)
    return path


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def completed(done: subprocess.CompletedProcess, run_dir: Path, rounds: int = ROUNDS) -> dict:
    """Assert `fedhop run` exited 0 and its summary says completed, every round done."""
    assert done.returncode == 0, explain(done, run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["rounds_completed"] == rounds, s.get("error")
    return s


def ledger_totals(db: Path) -> dict[str, int]:
    """Each message once, straight from run.db: its sender's record, or its receiver's where the
    sender recorded nothing."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = con.execute(
            "SELECT COUNT(*), SUM(tensor_bytes), SUM(payload_bytes), SUM(framed_bytes) FROM messages AS m "
            "WHERE role = 'sender' OR NOT EXISTS (SELECT 1 FROM messages AS s WHERE s.msg_id = m.msg_id "
            "AND s.role = 'sender')").fetchone()
    finally:
        con.close()
    return dict(zip(("messages", "tensor_bytes", "payload_bytes", "framed_bytes"), row))


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[Installed]:
    work = tmp_path_factory.mktemp("installed")
    before = left_behind()
    inst = install(wheel_under_test(work), work / "venv")
    assert left_behind() == before, "building the wheel wrote into the checkout"
    yield inst
    assert left_behind() == before, "the journey wrote into the checkout"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return user_folder(tmp_path_factory.mktemp("user"))


@pytest.fixture(scope="module")
def run_a(installed, home) -> subprocess.CompletedProcess:
    """(a) `fedhop run exp.toml --out runs/a` in the user's folder (asserted by the test below;
    the report, dashboard and --out tests use its run folder)."""
    return fedhop(installed, "run", "exp.toml", "--out", "runs/a", cwd=home)


def need(run_a: subprocess.CompletedProcess, home: Path) -> Path:
    if run_a.returncode != 0 or not (home / "runs" / "a" / "summary.json").exists():
        pytest.fail("`fedhop run exp.toml --out runs/a` failed, so there is no run to use:\n"
                    + explain(run_a, home / "runs" / "a"))
    return home / "runs" / "a"


def test_fedhop_comes_from_the_wheel_and_its_dependencies_are_there(installed, home):
    got = probe(installed, home)
    venv = installed.venv.resolve()
    places = [*got["fedhop_path"], *got["modules"].values(), got["dist"]]
    for place in places:
        assert Path(place).resolve().is_relative_to(venv), (place, got["sys_path"])
        assert not Path(place).resolve().is_relative_to(ROOT), place
    assert got["version"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {Requirement(r).name.lower() for r in got["deps"]} == {Requirement(r).name.lower() for r in declared}
    for text, dep in got["deps"].items():
        assert dep["version"] is not None, f"{text}: not installed"
        assert Requirement(text).specifier.contains(dep["version"], prereleases=True), (text, dep["version"])
        assert dep["error"] is None, f"{text}: import {dep['module']}: {dep['error']}"
    version = fedhop(installed, "--version", cwd=home)
    assert version.returncode == 0 and version.stdout.strip() == f"fedhop {got['version']}", explain(version)


def test_a_run_with_a_relative_out(run_a, home):
    run_dir = home / "runs" / "a"
    s = completed(run_a, run_dir)
    assert s["ledger_agreement"]["ok"], s["ledger_agreement"]
    totals = ledger_totals(run_dir / "run.db")
    assert totals["messages"] > 0
    assert {k: s["bytes"]["total"][k] for k in totals} == totals


def test_three_seeds_started_at_once_without_out(installed, tmp_path):
    folder = user_folder(tmp_path / "seeds")
    procs = {seed: start(installed, "run", "exp.toml", "--set", f"run.seed={seed}", "--quiet", cwd=folder,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed in (0, 1, 2)}
    outputs = {seed: p.communicate(timeout=600) for seed, p in procs.items()}
    for seed, p in procs.items():
        assert p.returncode == 0, f"seed {seed}: " + explain(p, None, *outputs[seed])
    run_dirs = sorted(d for d in (folder / "runs").iterdir() if d.is_dir())
    assert len(run_dirs) == 3, run_dirs
    seeds, models = [], []
    for d in run_dirs:
        s = summary(d)
        assert s["status"] == "completed" and s["rounds_completed"] == ROUNDS, (d, s.get("error"))
        seeds.append(tomllib.loads((d / "config.toml").read_text())["run"]["seed"])
        models.append((d / "model.safetensors").read_bytes())
    assert sorted(seeds) == [0, 1, 2]
    assert len(set(models)) == 3, "two seeds gave the same final model"


def test_sweep_with_a_relative_out(installed, tmp_path):
    folder = user_folder(tmp_path / "sweeping")
    lrs = [0.05, 0.3]
    (folder / "sweep.toml").write_text(f"""
[sweep]
config = "exp.toml"
algorithms = ["fedavg"]
seeds = [0]
parallel = 2
set = ["run.rounds=1"]

[grid]
"algorithm.lr" = {lrs}

[criterion]
kind = "final"
metric = "test_accuracy"
""")
    done = fedhop(installed, "sweep", "sweep.toml", "--out", "sweeps/x", "--quiet", cwd=folder, timeout=600)
    out = folder / "sweeps" / "x"
    assert done.returncode == 0, explain(done)
    finals = {}
    for lr in lrs:
        run_dir = out / "runs" / "fedavg" / f"lr={lr}" / "seed0"
        log = run_dir.with_suffix(".log")   # the run's `fedhop run` output
        assert (run_dir / "summary.json").is_file(), \
            explain(done, run_dir) + (f"\n--- {log.name}\n{log.read_text()[-1500:]}" if log.is_file() else "")
        s = summary(run_dir)
        assert s["status"] == "completed" and s["rounds_completed"] == 1, s.get("error")
        assert tomllib.loads((run_dir / "config.toml").read_text())["algorithm"]["lr"] == lr
        finals[lr] = s["final"]["test_accuracy"]
    best = json.loads((out / "results.json").read_text())["best"]["fedavg"]
    assert best["mean"] == pytest.approx(max(finals.values()), abs=1e-12)
    assert (out / "results.md").is_file() and (out / "best" / "report.json").is_file()


def test_report_of_the_run(installed, home, run_a):
    run_dir = need(run_a, home)
    done = fedhop(installed, "report", "runs/a", "--out", "report-a", cwd=home)
    assert done.returncode == 0, explain(done)
    out = home / "report-a"
    for name in ("report.md", "report.json", "metric_vs_round.png", "metric_vs_bytes.png", "bytes_by_link.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    (row,) = json.loads((out / "report.json").read_text())["runs"]
    total = summary(run_dir)["bytes"]["total"]
    assert row["total_bytes"] == {k: total[k] for k in ("tensor_bytes", "payload_bytes", "framed_bytes")}
    assert row["total_bytes"]["framed_bytes"] == ledger_totals(run_dir / "run.db")["framed_bytes"]
    assert any(line.startswith(f"| {NAME} |") for line in (out / "report.md").read_text().splitlines())


def test_dashboard_serves_the_run(installed, home, run_a):
    run_dir = need(run_a, home)
    proc = start(installed, "dashboard", "runs/a", "--port", "0", cwd=home, stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE)
    try:
        line = read_line(proc, "http://")   # "fedhop dashboard: http://127.0.0.1:PORT/ (Ctrl-C to stop)"
        url = line[line.index("http://"):].split()[0]
        with urllib.request.urlopen(url, timeout=60) as page:
            html = page.read().decode()
        with urllib.request.urlopen(url + "api/state", timeout=60) as api:
            state = json.loads(api.read())
    finally:
        interrupt(proc)
        rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, rest
    assert f'"name": "{NAME}"' in html
    assert state["name"] == NAME and state["status"] == "completed"
    assert state["rounds"][-1]["bytes"] == summary(run_dir)["bytes"]["total"]["framed_bytes"]


def test_plugin_package_in_the_current_folder(installed, tmp_path):
    folder = user_folder(tmp_path / "plugin", EXP.replace('kind = "mlp"\nhidden = [8]',
                                                          'factory = "mymodels:make_net"\nfactory_args = {hidden = 5}'))
    (folder / "mymodels").mkdir()
    (folder / "mymodels" / "__init__.py").write_text(
        "import math\nimport torch\n\n\n"
        "def make_net(input_shape, n_outputs, hidden=3):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), hidden),\n"
        "                               torch.nn.ReLU(), torch.nn.Linear(hidden, n_outputs))\n")
    done = fedhop(installed, "run", "exp.toml", "--out", "runs/p", "--quiet", cwd=folder)
    s = completed(done, folder / "runs" / "p")
    assert s["num_parameters"] == 64 * 5 + 5 + 5 * 10 + 10   # digits: 64 features, 10 classes, hidden = 5


def test_examples_are_copied_from_the_wheel_and_run(installed, tmp_path):
    """A wheel install with no clone: `fedhop examples copy fedavg_digits` writes the example (the
    same bytes as the checkout's) into the user's folder, and it runs (shortened by --set)."""
    folder = tmp_path / "fresh"
    folder.mkdir()
    listed = fedhop(installed, "examples", cwd=folder)
    assert listed.returncode == 0 and "fedavg_digits " in listed.stdout and "plugin/" in listed.stdout, \
        explain(listed)
    copied = fedhop(installed, "examples", "copy", "fedavg_digits", "plugin", cwd=folder)
    assert copied.returncode == 0, explain(copied)
    assert (folder / "fedavg_digits.toml").read_bytes() == (ROOT / "examples" / "fedavg_digits.toml").read_bytes()
    assert (folder / "plugin" / "fedhop_example" / "models.py").is_file()
    done = fedhop(installed, "run", "fedavg_digits.toml", "--out", "runs/ex", "--quiet", "--set", "run.rounds=2",
                  "--set", "clients.processes=1", cwd=folder)
    s = completed(done, folder / "runs" / "ex")
    assert s["rounds_completed"] == 2 and s["algorithm"] == "fedavg"
    report = fedhop(installed, "report", "runs/ex", "--format", "pdf", cwd=folder)   # plots in the default install
    assert report.returncode == 0, explain(report)
    made = list((folder / "reports").glob("report-*/*.pdf"))
    assert made and all(p.read_bytes().startswith(b"%PDF") for p in made), explain(report)
    k8s = fedhop(installed, "k8s", "fedavg_digits.toml", "--out", "k8s-run", cwd=folder)   # no clone needed
    assert k8s.returncode == 0 and (folder / "k8s-run" / "fedhop.yaml").is_file(), explain(k8s)
    assert "client-proc0" in (folder / "k8s-run" / "fedhop.yaml").read_text()


def test_certs_and_mutual_tls_with_a_relative_certs_dir(installed, tmp_path):
    folder = user_folder(tmp_path / "tls", EXP + '\n[security]\ncerts_dir = "certs"\nmtls = true\n')
    made = fedhop(installed, "certs", "certs", "--nodes", "server,client-proc0", cwd=folder)
    assert made.returncode == 0, explain(made)
    assert {"ca.pem", "server.pem", "server.key", "client-proc0.pem", "client-proc0.key"} <= \
        {p.name for p in (folder / "certs").iterdir()}
    done = fedhop(installed, "run", "exp.toml", "--out", "runs/tls", cwd=folder)
    run_dir = folder / "runs" / "tls"
    s = completed(done, run_dir)
    assert s["faults"]["auth_refused"] == 0
    assert "plaintext" not in done.stderr
    saved = tomllib.loads((run_dir / "config.toml").read_text())["security"]
    assert saved["mtls"] is True and not saved.get("insecure", False)
    assert {p.stem for p in (run_dir / "logs").glob("*.log")} == {"server", "client-proc0"}


def test_ctrl_c_then_merge_ledgers_then_resume(installed, tmp_path):
    rng = np.random.default_rng(25)
    centers, curv, sizes = rng.normal(0, 2, size=(4, 3)), rng.uniform(0.5, 2.0, size=(4, 3)), [5, 9, 3, 7]
    rounds, steps, lr = 4, 1000, 0.01   # rounds of ~0.4 s unloaded: the interrupt lands mid-run
    folder = user_folder(tmp_path / "ctrlc", quadratic_config(centers, curv, sizes, rounds=rounds, local_steps=steps,
                                                              lr=lr, processes=2, name="slow"))
    run_dir = folder / "runs" / "h"
    # deadlines a loaded machine cannot miss: the closed form below needs every client in every round
    sets = ["run.checkpoint_every=1", "run.call_timeout=600", "run.round_timeout=900"]
    proc = start(installed, "run", "exp.toml", "--out", "runs/h", "--quiet", *(f"--set={s}" for s in sets),
                 cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:   # Ctrl-C once round 1 is in run.db and its checkpoint (written by rename: complete once there) on disk
        wait_for(proc, lambda: rounds_recorded(run_dir / "run.db") >= 1
                 and any((run_dir / "checkpoints").glob("round-*.safetensors")), "round 1 and its checkpoint")
    except AssertionError:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(explain(proc, run_dir, out, err)) from None
    interrupt(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, explain(proc, run_dir, out, err)
    assert (run_dir / "run.db").is_file()
    done_before = rounds_recorded(run_dir / "run.db")
    assert 1 <= done_before < rounds, done_before
    merged = fedhop(installed, "merge-ledgers", "runs/h", cwd=folder)
    assert merged.returncode == 0, explain(merged)

    resumed = fedhop(installed, "run", "--resume", "runs/h", "--quiet", cwd=folder)
    s = completed(resumed, run_dir, rounds)
    assert len(s["faults"]["resumes"]) == 1
    w = np.zeros(centers.shape[1])   # FedAvg on the quadratics from w = 0, every client every round
    for _ in range(rounds):
        w = numpy_fedavg_round(w, centers, curv, sizes, range(len(sizes)), steps, lr, 1.0)
    np.testing.assert_allclose(load_file(str(run_dir / "model.safetensors"))["w"], w, rtol=1e-4, atol=1e-5)


def test_out_onto_a_finished_run_is_refused_and_force_reruns(installed, home, run_a):
    again = home / "runs" / "again"
    shutil.copytree(need(run_a, home), again)
    before = files_of(again)
    refused = fedhop(installed, "run", "exp.toml", "--out", "runs/again", cwd=home)
    assert refused.returncode == 2, explain(refused)
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "again" in lines[0] and "--force" in lines[0], refused.stderr
    assert files_of(again) == before, "the refused run changed the folder"

    forced = fedhop(installed, "run", "exp.toml", "--out", "runs/again", "--force", cwd=home)
    s = completed(forced, again)
    con = sqlite3.connect(f"file:{again / 'run.db'}?mode=ro", uri=True)
    try:
        runs = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        run_ids = con.execute("SELECT COUNT(DISTINCT run_id) FROM messages").fetchone()[0]
    finally:
        con.close()
    assert runs == 1 and run_ids == 1, "the rerun's run.db holds the earlier run too"
    assert {k: s["bytes"]["total"][k] for k in ledger_totals(again / "run.db")} == ledger_totals(again / "run.db")
    assert s["bytes"]["total"]["messages"] == summary(home / "runs" / "a")["bytes"]["total"]["messages"]


def test_compressed_uploads_from_the_wheel(installed, tmp_path):
    """Issue 47 from the installed wheel, in a folder outside the checkout: a built-in compressor
    with error feedback (float16 casts: 2 bytes an element; EF-SGD, then EF21) and a user's
    compressor module beside the config each cost their formula on every upload, with the MLP's
    610 parameters."""
    plugin = (ROOT / "tests" / "test_compression.py").read_text().split("PLUGIN = textwrap.dedent('''")[1]
    folder = user_folder(tmp_path / "compressed", EXP + '\n[compression]\nup = "fp16"\nerror_feedback = "ef"\n')
    (folder / "mycomp.py").write_text(textwrap.dedent(plugin.split("''')")[0]))
    for out, sets in (("runs/fp16", []), ("runs/mine", ["--set", 'compression.up="mycomp:Halves"',
                                                         "--set", "compression.scale=2.0"]),
                      ("runs/fp16-ef21", ["--set", 'compression.error_feedback="ef21"'])):
        done = fedhop(installed, "run", "exp.toml", "--out", out, "--quiet", *sets, cwd=folder)
        completed(done, folder / out)
        con = sqlite3.connect(f"file:{folder / out / 'run.db'}?mode=ro", uri=True)
        try:
            sizes = {r[0] for r in con.execute("SELECT tensor_bytes FROM messages WHERE role = 'sender' AND "
                                               "direction = 'up' AND method = 'train.reply'")}
        finally:
            con.close()
        assert sizes == {2 * (64 * 8 + 8 + 8 * 10 + 10)}, (out, sizes)
    # top-k: the server folds each upload's four tensors by their nonzeros (docs/compression.md)
    done = fedhop(installed, "run", "exp.toml", "--out", "runs/topk", "--quiet", "--set", 'compression.up="topk"',
                  "--set", "compression.k=8", "--set", 'compression.error_feedback="none"', cwd=folder)
    completed(done, folder / "runs" / "topk")
    con = sqlite3.connect(f"file:{folder / 'runs' / 'topk' / 'run.db'}?mode=ro", uri=True)
    try:
        (uploads,) = con.execute("SELECT COUNT(*) FROM messages WHERE role = 'sender' AND direction = 'up' AND "
                                 "method = 'train.reply'").fetchone()
    finally:
        con.close()
    aggregation = json.loads((folder / "runs" / "topk" / "summary.json").read_text())["aggregation"]
    assert uploads == 2 * ROUNDS and aggregation["sparse_tensors_folded"] == 4 * uploads, aggregation


def test_coded_broadcasts_from_the_wheel(installed, tmp_path):
    """Issue 47's downlink from the installed wheel, outside the checkout: 4 clients each in a
    process of its own, 2 a round; every train message is either the plain model (610 float32
    parameters) or coded differences, smaller, and summary.json counts each kind as the ledger does."""
    folder = user_folder(tmp_path / "down", EXP.replace("processes = 1", "processes = 4")
                         + '\n[compression]\ndown = "topk"\ndown_keys = {k = 8}\n')
    rounds = 6
    done = fedhop(installed, "run", "exp.toml", "--out", "runs/down", "--quiet", "--set", f"run.rounds={rounds}",
                  cwd=folder)
    completed(done, folder / "runs" / "down", rounds)
    con = sqlite3.connect(f"file:{folder / 'runs' / 'down' / 'run.db'}?mode=ro", uri=True)
    try:
        sizes = [r[0] for r in con.execute("SELECT tensor_bytes FROM messages WHERE role = 'sender' AND "
                                           "method = 'train'")]
    finally:
        con.close()
    plain = 4 * (64 * 8 + 8 + 8 * 10 + 10)
    assert len(sizes) == 2 * rounds and all(0 < s <= plain for s in sizes), sizes
    counts = json.loads((folder / "runs" / "down" / "summary.json").read_text())["downlink"]
    assert counts["plain_messages"] == sizes.count(plain) and counts["coded_messages"] == len(sizes) - sizes.count(plain)
    assert counts["coded_messages"] > 0 and counts["reference_version"] == rounds


def test_bench_flower_runs_from_the_wheel(installed, tmp_path):
    """`fedhop bench flower` loads benchmarks/flower_compare.py, which the wheel carries
    (fedhop.benchmarks): its fedhop half runs from the installed package outside the checkout and
    prints its table (it was a FileNotFoundError from the wheel)."""
    folder = tmp_path / "flower"
    folder.mkdir()
    done = fedhop(installed, "bench", "flower", "--rounds", "2", "--no-flower", cwd=folder, timeout=600)
    assert done.returncode == 0, explain(done)
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("| fedhop |")]
    assert len(rows) == 1 and "Traceback" not in done.stderr, explain(done)
