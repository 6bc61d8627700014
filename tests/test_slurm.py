"""`fedhop slurm` and `fedhop sweep --slurm` on a real Slurm: a one-machine cluster (slurmctld,
slurmd, munged) that deploy/slurm/localcluster.sh installs if missing and starts as root; it
skips, with the reason, where Slurm cannot be started.  Star and hierarchical runs must end with
the job's status 0, a completed summary and an agreed ledger of exactly the processes of the
plan; a client that fails before registration must end the job with its status; a two-setting
sweep runs as a job array and resumes without running finished runs again.  Without Slurm, the
run directory `--print` writes is checked: secrets in 0600 files and never in the batch script,
one step per planned process, per-task credential folders with only that node's files."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import load_config
from fedhop.common.topologies.plan import plan_processes

ROOT = Path(__file__).resolve().parents[1]
LOCALCLUSTER = ROOT / "deploy" / "slurm" / "localcluster.sh"
SMALL = """
[run]
name = "slurm-small"
seed = 0
rounds = 1
[topology]
kind = "star"
[algorithm]
name = "fedavg"
lr = 0.1
local_epochs = 1
batch_size = 16
[data]
dataset = "digits"
partition = "iid"
[model]
kind = "mlp"
hidden = [16]
[clients]
count = 4
per_round = 4
processes = 2
[security]
insecure = true
"""
HIER = ["topology.kind=\"hierarchical\"", "topology.edges=2", "clients.processes=2"]


def fedhop(*args: str, cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.fixture()
def user(tmp_path: Path) -> Path:
    (tmp_path / "small.toml").write_text(SMALL)
    return tmp_path


def inproc(capsys, *args: str) -> tuple[int, str, str]:
    """`fedhop slurm ARGS` in this process (the current folder is the user's)."""
    from fedhop.deploy.slurm import main
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- without Slurm
def test_print_writes_private_files_and_one_step_per_planned_process(user, capsys, monkeypatch):
    monkeypatch.chdir(user)
    code, script, err = inproc(capsys, "small.toml", "--print", "--out", "runs/h", "--nodes", "2", "--gpus-per-node",
                               "1", "--partition", "gpu", "--time", "0:30:00", *sum((["--set", s] for s in HIER), []))
    assert code == 0, err
    run = user / "runs" / "h"
    assert script == (run / "slurm" / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=0:30:00", f"#SBATCH --output={run}/slurm/job.out"):
        assert line in script.splitlines(), line
    token = (run / ".token").read_text().strip()
    assert len(token) == 32
    for private in (".token", "config.toml"):
        assert stat.S_IMODE((run / private).stat().st_mode) == 0o600, private
    tasks = json.loads((run / "slurm" / "tasks.json").read_text())
    assert token not in script and token not in json.dumps(tasks)
    plan = plan_processes(load_config(str(user / "small.toml"), HIER))
    assert [t["node_id"] for t in tasks] == plan.node_ids
    assert f"#SBATCH --ntasks={len(plan.node_ids)}" in script.splitlines()
    assert [t["node"] for t in tasks] == [0] + [i % 2 for i in range(1, len(tasks))]   # server on the first node
    parents = {t["node_id"]: t["argv"][t["argv"].index("--parent-file") + 1] for t in tasks[1:]}
    for p in plan.processes[1:]:
        assert parents[p.node_id] == f"{run}/{p.parent}.address"


def test_bad_flags_and_configs_are_one_line_exit_2(user, capsys, monkeypatch):
    monkeypatch.chdir(user)
    code, _, err = inproc(capsys, "small.toml", "--print", "--set", "clients.count=zero")
    assert code == 2 and "clients.count" in err and len(err.strip().splitlines()) == 1
    code, _, err = inproc(capsys, "small.toml", "--print", "--nodes", "0")
    assert code == 2 and "--nodes" in err
    assert inproc(capsys, "small.toml", "--print", "--out", "r")[0] == 0
    code, _, err = inproc(capsys, "small.toml", "--print", "--out", "r")
    assert code == 2 and "--force" in err


def test_each_task_gets_only_its_own_credentials(user, capsys, monkeypatch):
    from fedhop.deploy.certs import main as certs_main
    monkeypatch.chdir(user)
    assert certs_main(["certs", "--config", "small.toml"]) == 0
    code, _, err = inproc(capsys, "small.toml", "--print", "--out", "r", "--set", 'security.certs_dir="certs"',
                          "--set", "security.insecure=false", "--set", "security.mtls=true")
    assert code == 0, err
    run = user / "r"
    nodes = plan_processes(load_config(str(user / "small.toml"))).node_ids
    assert sorted(p.name for p in (run / "creds").iterdir()) == sorted(nodes)
    for node in nodes:
        d = run / "creds" / node
        assert sorted(p.name for p in d.iterdir()) == sorted(["ca.pem", f"{node}.pem", f"{node}.key", f"{node}.cred"])
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert (d / f"{node}.key").read_bytes() == (user / "certs" / f"{node}.key").read_bytes()
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in d.iterdir())
    tasks = json.loads((run / "slurm" / "tasks.json").read_text())
    for t in tasks[1:]:
        assert t["argv"][t["argv"].index("--certs-dir") + 1] == f"{run}/creds/{t['node_id']}"
    assert f'certs_dir = "{run}/creds/server"' in (run / "config.toml").read_text()


def test_gpus_render_gres_and_bind_each_step_to_its_device(user, capsys, monkeypatch):
    """--gpus-per-node N: the job asks Slurm's gres (#SBATCH --gpus-per-node=N); on each node the
    client processes placed there go round-robin over its N GPUs, each step that computes on a GPU
    asks --gres=gpu:N and is told its --device, a CPU step asks --gres=none.  No GPU is needed:
    the rendered script, tasks.json and srun lines are checked against the plan."""
    from fedhop.deploy.slurm import step_argv
    monkeypatch.chdir(user)
    sets = ["topology.kind=\"hierarchical\"", "topology.edges=1", "clients.processes=5", "clients.count=10",
            "clients.per_round=10", "clients.device=\"cuda\"", "edges.device=\"cpu\"", "run.device=\"cuda:1\""]
    code, script, err = inproc(capsys, "small.toml", "--print", "--out", "g", "--nodes", "2", "--gpus-per-node", "2",
                               *sum((["--set", s] for s in sets), []))
    assert code == 0, err
    assert "#SBATCH --gpus-per-node=2" in script.splitlines() and "#SBATCH --nodes=2" in script.splitlines()
    run = user / "g"
    tasks = json.loads((run / "slurm" / "tasks.json").read_text())
    plan = plan_processes(load_config(str(user / "small.toml"), sets))
    assert [t["node_id"] for t in tasks] == plan.node_ids
    seen_on_node: dict[int, int] = {}
    for t in tasks:
        device = t["argv"][t["argv"].index("--device") + 1]
        if t["kind"] == "client":       # the k-th client process of its node: GPU k mod 2 of that node
            k = seen_on_node.get(t["node"], 0)
            seen_on_node[t["node"]] = k + 1
            want = f"cuda:{k % 2}"
        else:
            want = {"server": "cuda:1", "edge": "cpu"}[t["kind"]]
        assert device == want, t
        srun = step_argv(t, "n0", run, "/py")
        gres = [a for a in srun if a.startswith("--gres=")]
        assert gres == (["--gres=gpu:2"] if want.startswith("cuda") else ["--gres=none"]), srun
        assert srun.index(gres[0]) < srun.index("/py")         # an srun option, not the task's
    assert sorted(seen_on_node) == [0, 1] and sum(seen_on_node.values()) == 5
    # clients.gpus picks the GPUs of each node
    code, _, err = inproc(capsys, "small.toml", "--print", "--out", "g1", "--nodes", "2", "--gpus-per-node", "2",
                          "--set", "clients.device=\"cuda\"", "--set", "clients.gpus=[1]")
    assert code == 0, err
    tasks = json.loads((user / "g1" / "slurm" / "tasks.json").read_text())
    assert {t["argv"][t["argv"].index("--device") + 1] for t in tasks if t["kind"] == "client"} == {"cuda:1"}
    assert tasks[0]["gres"] == "none"                                     # the server stays on the CPU
    # CUDA asked without GPUs, or a GPU the nodes lack: one line, exit 2, nothing written
    for flags, needle in ((["--set", "clients.device=\"cuda\""], "clients.device"),
                          (["--gpus-per-node", "1", "--set", "run.device=\"cuda:1\""], "run.device")):
        code, _, err = inproc(capsys, "small.toml", "--print", "--out", "nogpu", *flags)
        assert code == 2 and needle in err and "--gpus-per-node" in err and len(err.strip().splitlines()) == 1, err
        assert not (user / "nogpu").exists()
    # without --gpus-per-node a CPU run's steps carry no gres and no --device (as before)
    assert inproc(capsys, "small.toml", "--print", "--out", "cpu")[0] == 0
    tasks = json.loads((user / "cpu" / "slurm" / "tasks.json").read_text())
    assert all("gres" not in t and "--device" not in t["argv"] for t in tasks)


# ----------------------------------------------------------------------------- on a real Slurm
@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict:
    """A running one-machine cluster: the environment whose SLURM_CONF names it."""
    if os.geteuid() != 0:
        pytest.skip("the one-machine Slurm cluster needs root (slurmd starts steps as the submitting user)")
    state = tmp_path_factory.mktemp("slurm")
    res = subprocess.run([str(LOCALCLUSTER), "start", str(state)], capture_output=True, text=True, timeout=600)
    if res.returncode == 3:
        pytest.skip(f"Slurm could not be installed or started: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    try:
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run([str(LOCALCLUSTER), "stop", str(state)], capture_output=True, timeout=120)
        for name in ("munged", "slurmctld", "slurmd"):
            assert not (state / f"{name}.pid").exists(), f"{name} was not stopped"


def submit(user: Path, env: dict, out: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli", "slurm", "small.toml", "--overcommit",
                             "--out", out, *extra], cwd=user, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def check_run(run: Path, cfg) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == cfg.run.rounds
    assert summary["ledger_agreement"]["ok"] and summary["ledger_agreement"]["matched"] > 0
    plan = plan_processes(cfg)
    assert sorted(p.stem for p in (run / "ledger").glob("*.jsonl")) == sorted(plan.node_ids)
    exits = json.loads((run / "slurm" / "exit.json").read_text())
    assert exits == {"status": 0, "steps": {n: 0 for n in plan.node_ids}}


def test_star_hierarchical_failure_and_sweep_on_a_real_slurm(user, slurm):
    """All four jobs are submitted at once and waited for together (the cluster runs them side by
    side), so the test takes about as long as the slowest."""
    # a client that fails at once (a bad flag: argparse's status 2) before anything registered
    res = fedhop("slurm", "small.toml", "--print", "--overcommit", "--out", "runs/fail", cwd=user)
    assert res.returncode == 0, res.stderr
    fail = user / "runs" / "fail"
    tasks = json.loads((fail / "slurm" / "tasks.json").read_text())
    argv = tasks[-1]["argv"]
    argv[argv.index("--max-message-bytes") + 1] = "lots"
    (fail / "slurm" / "tasks.json").write_text(json.dumps(tasks))
    failing = subprocess.Popen([sys.executable, "-c", "import sys; from fedhop.deploy.slurm import submit, wait_job; "
                                "sys.exit(wait_job(submit(__import__('pathlib').Path(sys.argv[1]))))",
                                str(fail / "slurm" / "job.sbatch")], cwd=user, env=slurm)
    star = submit(user, slurm, "runs/star", "--wait")
    hier = submit(user, slurm, "runs/hier", "--wait", *sum((["--set", s] for s in HIER), []))
    (user / "sweep.toml").write_text(f"""
[sweep]
config = "{user / 'small.toml'}"
seeds = [0]
parallel = 2
set = ["run.rounds=1", "clients.processes=1"]
[grid]
"algorithm.lr" = [0.05, 0.2]
[criterion]
kind = "final"
metric = "test_accuracy"
""")
    sweep_cmd = [sys.executable, "-m", "fedhop.deploy.cli", "sweep", "sweep.toml", "--out", "sw", "--slurm", "--quiet"]
    sweep = subprocess.Popen(sweep_cmd, cwd=user, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        check_jobs(user, slurm, fail, tasks, failing, star, hier, sweep, sweep_cmd)
    finally:
        for proc in (failing, star, hier, sweep):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_jobs(user, slurm, fail, tasks, failing, star, hier, sweep, sweep_cmd) -> None:
    """The checks of the test above, once its four submissions are on their way."""
    text = sweep.communicate(timeout=300)[0]
    assert sweep.returncode == 0, text
    summaries = sorted((user / "sw" / "runs").glob("*/*/seed0/summary.json"))
    assert len(summaries) == 2 and all(json.loads(p.read_text())["status"] == "completed" for p in summaries)
    assert len(list((user / "sw" / "slurm").glob("array-*.sbatch"))) == 1
    results = json.loads((user / "sw" / "results.json").read_text())
    accs = {json.loads(p.read_text())["final"]["test_accuracy"] for p in summaries}
    assert results["best"]["base"]["mean"] == pytest.approx(max(accs))
    before = [p.stat().st_mtime_ns for p in summaries]
    again = subprocess.run(sweep_cmd, cwd=user, env=slurm, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert [p.stat().st_mtime_ns for p in summaries] == before   # resumed: nothing ran again
    assert len(list((user / "sw" / "slurm").glob("array-*.sbatch"))) == 1

    for proc, out, overrides in ((star, "runs/star", []), (hier, "runs/hier", HIER)):
        text = proc.communicate(timeout=240)[0]
        assert proc.returncode == 0, text
        check_run(user / out, load_config(str(user / "small.toml"), overrides))
    assert failing.wait(timeout=240) == 2
    exits = json.loads((fail / "slurm" / "exit.json").read_text())
    assert exits["status"] == 2 and exits["steps"][tasks[-1]["node_id"]] == 2
    assert not (fail / "summary.json").exists() or json.loads((fail / "summary.json").read_text())["status"] != "completed"
