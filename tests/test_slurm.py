"""`fedhop slurm` and `fedhop sweep --slurm` on a real Slurm: a one-machine cluster (slurmctld,
slurmd, munged) with this machine's own CPUs (2 in CI) that deploy/slurm/localcluster.sh installs
if missing and starts as root; it skips, with the reason, where Slurm cannot be started.  A plain
`fedhop slurm CONFIG --wait` (no security keys) must run under mutual TLS with per-job credentials
and print the job's state and pending reason as they change; a job larger than the partition is
one line naming the CPUs and --overcommit, within 30 s, and runs with --overcommit; star and
hierarchical runs end with the job's status 0, a completed summary and an agreed ledger of exactly
the processes of the plan; a client that fails before registration ends the job with its status
and its error line; a two-setting sweep runs as a job array and resumes without running finished
runs again.  Without Slurm: `--print` writes nothing; the run folder `fedhop slurm` writes is
checked: secrets in 0600 files and never in the batch script, one step per planned process, per-task
credential folders with only that node's files (per-job or from security.certs_dir)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedhop.common.config import load_config
from fedhop.common.topologies.plan import plan_processes
from tests.helpers import read_lines

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
"""
HIER = ["topology.kind=\"hierarchical\"", "topology.edges=2", "clients.processes=2"]
INSECURE = ["--set", "security.insecure=true"]


def fedhop(*args: str, cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.fixture()
def user(tmp_path: Path) -> Path:
    (tmp_path / "small.toml").write_text(SMALL)
    return tmp_path


def inproc(capsys, *args: str) -> tuple[int, str, str]:
    """`fedhop slurm ARGS` in this process (the current folder is the user's)."""
    from fedhop.deploy.launch.slurm import main
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def prepare(*args: str) -> tuple[int, str, str]:
    """The run folder `fedhop slurm ARGS` writes just before it submits (plan_run, then write), in
    this process: (0, the batch script, "") or (2, "", the one-line refusal)."""
    from fedhop.deploy.launch.slurm import SlurmError, build_parser, options_from, plan_run
    a = build_parser().parse_args(list(args))
    try:
        prepared = plan_run(a.config, a.overrides, a.out, options_from(a))
        prepared.write(a.force)
    except SlurmError as exc:
        return 2, "", str(exc)
    return 0, prepared.script, ""


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ----------------------------------------------------------------------------- without Slurm
def test_print_writes_nothing(user, capsys, monkeypatch):
    """`--print` shows the script and describes the credentials; no run folder, no credentials."""
    monkeypatch.chdir(user)
    for extra in ([], ["--out", "runs/p"], INSECURE):
        code, script, err = inproc(capsys, "small.toml", "--print", *extra)
        assert code == 0, err
        assert script.startswith("#!/bin/bash") and "#SBATCH --ntasks=3" in script.splitlines()
        assert ("shared run token" if extra == INSECURE else "mutual TLS with per-job credentials") in script
        assert "nothing written" in err
        assert tree(user) == ["small.toml"], extra


def test_prepared_run_has_private_files_and_one_step_per_planned_process(user, monkeypatch):
    monkeypatch.chdir(user)
    code, script, err = prepare("small.toml", "--out", "runs/h", "--nodes", "2", "--gpus-per-node", "1", "--partition",
                                "gpu", "--time", "0:30:00", *INSECURE, *sum((["--set", s] for s in HIER), []))
    assert code == 0, err
    run = user / "runs" / "h"
    assert script == (run / "slurm" / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=0:30:00", f"#SBATCH --output={run}/slurm/job.out"):
        assert line in script.splitlines(), line
    token = (run / ".token").read_text().strip()         # shared-token mode: the named opt-out
    assert len(token) == 32 and not (run / "creds").exists()
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


def check_own_credentials(run: Path, nodes: list[str]) -> None:
    """RUN/creds/NODE (0700) per node with only its files (0600), chained to one CA; each step's
    argv names its own folder and --mtls; the server's config its own folder and mtls = true."""
    from cryptography import x509
    assert sorted(p.name for p in (run / "creds").iterdir()) == sorted(nodes)
    assert stat.S_IMODE((run / "creds").stat().st_mode) == 0o700
    cas = set()
    for node in nodes:
        d = run / "creds" / node
        assert sorted(p.name for p in d.iterdir()) == sorted(["ca.pem", f"{node}.pem", f"{node}.key", f"{node}.cred"])
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in d.iterdir())
        ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
        cert = x509.load_pem_x509_certificate((d / f"{node}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == node
        assert (d / f"{node}.cred").read_text().split(":")[1] == node
        cas.add((d / "ca.pem").read_bytes())
    assert len(cas) == 1
    tasks = json.loads((run / "slurm" / "tasks.json").read_text())
    for t in tasks[1:]:
        assert t["argv"][t["argv"].index("--certs-dir") + 1] == f"{run}/creds/{t['node_id']}" and "--mtls" in t["argv"]
    config = (run / "config.toml").read_text()
    assert f'certs_dir = "{run}/creds/server"' in config and "mtls = true" in config
    assert not (run / ".token").exists()


def test_per_job_credentials_by_default(user, monkeypatch):
    """No security keys: a new CA and per-node certificates and credentials in the run folder, each
    node's folder holding only its own; the CA and issuer keys are nowhere."""
    monkeypatch.chdir(user)
    code, script, err = prepare("small.toml", "--out", "r")
    assert code == 0, err
    run = user / "r"
    check_own_credentials(run, plan_processes(load_config(str(user / "small.toml"))).node_ids)
    assert not [p for p in run.rglob("*") if p.name in ("ca.key", "issuer.key", "cluster.secret")]
    assert "mutual TLS with per-job credentials" in script
    # a second run gets its own CA
    assert prepare("small.toml", "--out", "r2")[0] == 0
    assert (user / "r2" / "creds" / "server" / "ca.pem").read_bytes() != (run / "creds" / "server" / "ca.pem").read_bytes()


def test_bad_flags_and_configs_are_one_line_exit_2(user, capsys, monkeypatch):
    monkeypatch.chdir(user)
    code, _, err = inproc(capsys, "small.toml", "--print", "--set", "clients.count=zero")
    assert code == 2 and "clients.count" in err and len(err.strip().splitlines()) == 1
    code, _, err = inproc(capsys, "small.toml", "--print", "--nodes", "0")
    assert code == 2 and "--nodes 0: must be >= 1" in err and "--cpus-per-task" not in err, err   # the flag at fault only
    assert prepare("small.toml", "--out", "r")[0] == 0
    code, _, err = inproc(capsys, "small.toml", "--out", "r")
    assert code == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    # a certs_dir that is missing, lacks a node's files or cannot be read: one line, nothing written
    (user / "certs").mkdir()
    (user / "certs" / "ca.pem").write_text("x")
    for sets, needle in ((['security.certs_dir="nowhere"'], "not a folder"),
                         (['security.certs_dir="certs"'], "missing")):
        code, _, err = inproc(capsys, "small.toml", "--out", "bad", *sum((["--set", s] for s in sets), []))
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
        assert not (user / "bad").exists()
    from fedhop.deploy.launch.certs import main as certs_main
    assert certs_main(["certs2", "--config", "small.toml"]) == 0
    (user / "certs2" / "client-proc1.key").unlink()
    (user / "certs2" / "client-proc1.key").mkdir()        # no key file to read, even for root
    code, _, err = inproc(capsys, "small.toml", "--out", "bad", "--set", 'security.certs_dir="certs2"')
    assert code == 2 and "client-proc1.key" in err and len(err.strip().splitlines()) == 1, err
    assert not (user / "bad").exists()
    (user / "certs2" / "client-proc1.key").rmdir()
    (user / "certs2" / "client-proc1.key").write_text("x")
    real_read = Path.read_bytes

    def read_bytes(self: Path) -> bytes:                  # a file this user may not read (root reads all)
        if self.name == "client-proc1.key":
            raise PermissionError(13, "Permission denied")
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, _, err = inproc(capsys, "small.toml", "--out", "bad", "--set", 'security.certs_dir="certs2"')
    assert code == 2 and "cannot read" in err and "client-proc1.key" in err and len(err.strip().splitlines()) == 1, err
    assert not (user / "bad").exists()


def test_each_task_gets_only_its_own_credentials(user, monkeypatch):
    from fedhop.deploy.launch.certs import main as certs_main
    monkeypatch.chdir(user)
    assert certs_main(["certs", "--config", "small.toml"]) == 0
    code, _, err = prepare("small.toml", "--out", "r", "--set", 'security.certs_dir="certs"')
    assert code == 0, err
    run = user / "r"
    nodes = plan_processes(load_config(str(user / "small.toml"))).node_ids
    check_own_credentials(run, nodes)                  # mutual TLS although security.mtls was not set
    for node in nodes:
        assert (run / "creds" / node / f"{node}.key").read_bytes() == (user / "certs" / f"{node}.key").read_bytes()


def test_a_node_without_its_own_credential_is_refused(user, capsys, monkeypatch):
    """A certs folder where a node lacks NODE.cred is refused, one line, although the folder holds
    the shared cluster.secret: no node's folder ever gets the secret that mints any node's tokens."""
    from fedhop.deploy.launch.certs import main as certs_main
    monkeypatch.chdir(user)
    assert certs_main(["certs", "--config", "small.toml"]) == 0
    assert (user / "certs" / "cluster.secret").is_file()
    (user / "certs" / "client-proc1.cred").unlink()
    code, _, err = inproc(capsys, "small.toml", "--out", "r", "--set", 'security.certs_dir="certs"')
    assert code == 2 and "client-proc1.cred" in err and len(err.strip().splitlines()) == 1, err
    assert not (user / "r").exists()


def test_force_replaces_an_earlier_run_never_a_users_folder(user, capsys, monkeypatch):
    """--force replaces a folder holding an earlier `fedhop slurm` run; a non-empty folder that holds
    none (the working directory, a folder of the user's) is refused with or without --force, one
    line, and every file in it stays."""
    monkeypatch.chdir(user)
    (user / "notes.txt").write_text("keep")
    (user / "thesis").mkdir()
    (user / "thesis" / "chapter1.tex").write_text("keep too")
    for out in (".", "thesis", str(user / "thesis")):
        for force in ([], ["--force"]):
            code, _, err = prepare("small.toml", "--out", out, *force)
            assert code == 2 and "holds no fedhop slurm run" in err and "\n" not in err.strip(), err
    assert (user / "notes.txt").read_text() == "keep" and (user / "small.toml").is_file()
    assert (user / "thesis" / "chapter1.tex").read_text() == "keep too"
    (user / "afile").write_text("x")
    code, _, err = prepare("small.toml", "--out", "afile")
    assert code == 2 and "is a file" in err and (user / "afile").read_text() == "x"
    # an earlier run: refused without --force, replaced with it (its old files gone)
    assert prepare("small.toml", "--out", "r")[0] == 0
    (user / "r" / "logs" / "old.log").write_text("earlier run")
    code, _, err = prepare("small.toml", "--out", "r")
    assert code == 2 and "--force" in err
    assert prepare("small.toml", "--out", "r", "--force")[0] == 0
    assert not (user / "r" / "logs" / "old.log").exists() and (user / "r" / "slurm" / "tasks.json").is_file()


def test_bad_time_limit_is_one_line_exit_2(user, capsys, monkeypatch):
    """--time is checked against sbatch's formats before anything is written or submitted."""
    from fedhop.deploy.launch.slurm import SlurmOptions
    monkeypatch.chdir(user)
    for bad in ("bogus", "1:2:3:4", "1-", "-5", "1h"):
        code, _, err = inproc(capsys, "small.toml", "--print", "--time", bad)
        assert code == 2 and "--time" in err and len(err.strip().splitlines()) == 1, (bad, err)
    for good in ("30", "10:00", "1:00:00", "2-0", "2-12:30", "1-00:00:00", "UNLIMITED"):
        assert SlurmOptions(time=good).time_refusal() is None, good
        code, script, err = inproc(capsys, "small.toml", "--print", "--time", good)
        assert code == 0 and f"#SBATCH --time={good}" in script.splitlines(), err


def test_a_refused_submission_leaves_no_run_behind(user, capsys, monkeypatch):
    """sbatch refusing the job (a stand-in sbatch on PATH that fails as Slurm's does): exit 2 with
    sbatch's error line, and the run folder keeps none of what was written (no credentials left),
    so the same --out can be used again without --force."""
    from fedhop.deploy.launch import slurm
    monkeypatch.chdir(user)
    bin_dir = user / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account' >&2\n"
                                    "exit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "check_fit", lambda prepared: None)   # no partition to fit here
    code, _, err = inproc(capsys, "small.toml", "--out", "r")
    assert code == 2 and "Invalid account" in err and len(err.strip().splitlines()) == 1, err
    assert not (user / "r").exists() or not any((user / "r").iterdir())
    code, _, err = inproc(capsys, "small.toml", "--out", "r")
    assert code == 2 and "Invalid account" in err and "--force" not in err, err


def test_gpus_render_gres_and_bind_each_step_to_its_device(user, capsys, monkeypatch):
    """--gpus-per-node N: the job asks Slurm's gres (#SBATCH --gpus-per-node=N); on each node the
    client processes placed there go round-robin over its N GPUs, each step that computes on a GPU
    asks --gres=gpu:N and is told its --device, a CPU step asks --gres=none.  No GPU is needed:
    the rendered script, tasks.json and srun lines are checked against the plan."""
    from fedhop.deploy.launch.slurm import step_argv
    monkeypatch.chdir(user)
    sets = ["topology.kind=\"hierarchical\"", "topology.edges=1", "clients.processes=5", "clients.count=10",
            "clients.per_round=10", "clients.device=\"cuda\"", "edges.device=\"cpu\"", "run.device=\"cuda:1\""]
    code, script, err = prepare("small.toml", "--out", "g", "--nodes", "2", "--gpus-per-node", "2",
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
    code, _, err = prepare("small.toml", "--out", "g1", "--nodes", "2", "--gpus-per-node", "2",
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
    assert prepare("small.toml", "--out", "cpu")[0] == 0
    tasks = json.loads((user / "cpu" / "slurm" / "tasks.json").read_text())
    assert all("gres" not in t and "--device" not in t["argv"] for t in tasks)


def test_partition_fit_counts_tasks_cpus_nodes_and_overcommit():
    """The fit rule on a made-up partition (the real one is checked on the cluster below)."""
    from fedhop.deploy.launch.slurm import Partition, SlurmOptions
    part = Partition("p", [4, 2], None)
    assert part.fit_refusal(6, SlurmOptions(nodes=2)) is None
    why = part.fit_refusal(7, SlurmOptions(nodes=2))
    assert why is not None and "7 CPUs" in why and "--overcommit" in why and "at most 6" in why
    assert part.fit_refusal(5, SlurmOptions(nodes=1)) is not None and part.fit_refusal(4, SlurmOptions()) is None
    assert part.fit_refusal(3, SlurmOptions(cpus_per_task=2)) is not None
    assert part.fit_refusal(50, SlurmOptions(nodes=2, overcommit=True)) is None
    assert part.fit_refusal(2, SlurmOptions(nodes=3, overcommit=True)) is not None        # 2 nodes only
    assert part.fit_refusal(2, SlurmOptions(cpus_per_task=5, overcommit=True)) is not None
    assert Partition("q", [8, 8, 8], 2).fit_refusal(3, SlurmOptions(nodes=3)) is not None  # MaxNodes=2


def test_failure_reason_is_the_failing_steps_error_line(tmp_path):
    """`--wait`'s last line on failure: the error line of the step whose status is the job's, not
    its last line or the status alone; the server's when no step's status matches."""
    from fedhop.deploy.launch.slurm import failure_reason
    (tmp_path / "slurm").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "server.log").write_text(
        "2026-11-28 10:00:00,000 server INFO server computes on cpu\n"
        "2026-11-28 10:00:01,000 server ERROR refusing to start: plaintext gRPC to or on a non-loopback address\n"
        "2026-11-28 10:00:01,001 server INFO shutting down\n")
    (tmp_path / "logs" / "client-proc0.log").write_text("Traceback (most recent call last):\n  File x\n"
                                                        "ValueError: bad shard\nafter the error\n")
    (tmp_path / "slurm" / "exit.json").write_text(json.dumps({"status": 2, "steps": {"server": 2, "client-proc0": 143}}))
    assert failure_reason(tmp_path) == ("server: 2026-11-28 10:00:01,000 server ERROR refusing to start: plaintext "
                                        "gRPC to or on a non-loopback address")
    (tmp_path / "slurm" / "exit.json").write_text(json.dumps({"status": 1, "steps": {"server": 143, "client-proc0": 1}}))
    assert failure_reason(tmp_path) == "client-proc0: ValueError: bad shard"



@pytest.mark.parametrize("code, recorded, after", [(1, "running", "failed"), (130, "running", "stopped"),
                                                   (1, "failed", "failed"), (0, "running", "running")])
def test_wait_records_a_server_lost_with_its_job(tmp_path, monkeypatch, capsys, code, recorded, after):
    """`--wait` on a job that ended before its server recorded the run's end (a node lost, a kill
    past the step's grace): run.db's run, still "running", becomes failed (stopped for the job's
    Ctrl-C) with a `server_lost` event; a run the server recorded, or a job that completed, is left."""
    import fedhop.deploy.launch.slurm as slurm
    from fedhop.common.records.runstore import RunStore
    store = RunStore(tmp_path / "run.db")
    store.start_run(run_id="r", name="r")
    if recorded != "running":
        store.finish_run(recorded)
    store.close()
    monkeypatch.setattr(slurm, "wait_job", lambda job, poll, report: code)
    assert slurm.follow("17", tmp_path) == code
    with RunStore(tmp_path / "run.db", create=False) as db:
        assert db.run()["status"] == after
        lost = db.events("server_lost")
    changed = recorded == "running" and code != 0
    assert len(lost) == changed
    if changed:
        assert f"slurm job 17 ended with status {code} before the server recorded" in lost[0]["detail"]

# ----------------------------------------------------------------------------- on a real Slurm
CPUS = 2   # the node's CPUs, as on a small CI machine: the default 3-process star does not fit


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict:
    """A running one-machine cluster of CPUS CPUs: the environment whose SLURM_CONF names it."""
    if os.geteuid() != 0:
        pytest.skip("the one-machine Slurm cluster needs root (slurmd starts steps as the submitting user)")
    state = tmp_path_factory.mktemp("slurm")
    res = subprocess.run([str(LOCALCLUSTER), "start", str(state)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FEDHOP_SLURM_CPUS": str(CPUS)})
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
    return subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "slurm", "small.toml", "--out", out, *extra],
                            cwd=user, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    """`proc`'s output lines up to the first holding `needle`; fail after `timeout` s or at its exit."""
    return [line.rstrip("\n") for line in read_lines(proc, proc.stdout, needle, timeout)]   # type: ignore[arg-type]


def check_run(run: Path, cfg) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == cfg.run.rounds
    assert summary["ledger_agreement"]["ok"] and summary["ledger_agreement"]["matched"] > 0
    plan = plan_processes(cfg)
    assert sorted(p.stem for p in (run / "ledger").glob("*.jsonl")) == sorted(plan.node_ids)
    exits = json.loads((run / "slurm" / "exit.json").read_text())
    assert exits == {"status": 0, "steps": {n: 0 for n in plan.node_ids}}


def test_fit_wait_mtls_failure_and_sweep_on_a_real_slurm(user, slurm, monkeypatch):
    """An oversized job is refused before submission; then five jobs are submitted at once and
    waited for together (the partition lets jobs share its CPUs), so the test takes about as long
    as the slowest: a plain run (no security keys) held until its --wait has printed the pending
    reason, a hierarchical run with --overcommit and the plaintext opt-out, a run whose client fails
    before registering, and a two-setting sweep."""
    started = time.monotonic()
    big = fedhop("slurm", "small.toml", "--wait", "--out", "runs/big", cwd=user, env=slurm, timeout=60)
    took = time.monotonic() - started
    lines = big.stderr.strip().splitlines()
    assert big.returncode == 2 and len(lines) == 1 and not big.stdout, big.stderr + big.stdout
    assert "needs 3 CPUs" in lines[0] and f"at most {CPUS}" in lines[0] and "--overcommit" in lines[0], lines
    assert took < 30 and not (user / "runs").exists()
    assert subprocess.run(["squeue", "-h"], env=slurm, capture_output=True, text=True).stdout.strip() == ""

    # a client that fails at once (a bad flag: argparse's status 2) before anything registered
    monkeypatch.chdir(user)
    assert prepare("small.toml", "--overcommit", "--out", "runs/fail")[0] == 0
    fail = user / "runs" / "fail"
    tasks = json.loads((fail / "slurm" / "tasks.json").read_text())
    argv = tasks[-1]["argv"]
    argv[argv.index("--max-message-bytes") + 1] = "lots"
    (fail / "slurm" / "tasks.json").write_text(json.dumps(tasks))
    failing = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from fedhop.deploy.launch.slurm "
                                "import follow, submit; run = Path(sys.argv[1]); "
                                "sys.exit(follow(submit(run / 'slurm' / 'job.sbatch'), run))", str(fail)],
                               cwd=user, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    star = submit(user, slurm, "runs/star", "--wait", "--set", "clients.processes=1", "--sbatch-arg=--hold")
    hier = submit(user, slurm, "runs/hier", "--wait", "--overcommit", *INSECURE, *sum((["--set", s] for s in HIER), []))
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
    sweep_cmd = [sys.executable, "-m", "fedhop.deploy.cli.cli", "sweep", "sweep.toml", "--out", "sw", "--slurm", "--quiet"]
    sweep = subprocess.Popen(sweep_cmd, cwd=user, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        check_jobs(user, slurm, fail, tasks, failing, star, hier, sweep, sweep_cmd)
    finally:
        for proc in (failing, star, hier, sweep):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_jobs(user, slurm, fail, tasks, failing, star, hier, sweep, sweep_cmd) -> None:
    """The checks of the test above, once its submissions are on their way."""
    # the plain run: --wait says it is held (Slurm's pending reason), then follows it once released
    try:   # the five submissions and their set-up (keys, certificates) share a loaded machine
        seen = read_until(star, "PENDING (JobHeldUser)", timeout=300)
    except AssertionError as exc:   # what Slurm shows of the jobs, beside what --wait printed
        queue = subprocess.run(["squeue", "-h", "-o", "%i %T %r %j"], env=slurm, capture_output=True, text=True)
        raise AssertionError(f"{exc}\nsqueue: {queue.stdout or queue.stderr}") from None
    job = (user / "runs" / "star" / "slurm" / "job.id").read_text().strip()
    assert seen[-1] == f"fedhop slurm: job {job}: PENDING (JobHeldUser)", seen
    assert "mutual TLS, per-job credentials" in seen[0], seen
    subprocess.run(["scontrol", "release", job], env=slurm, check=True, capture_output=True)
    seen += star.communicate(timeout=300)[0].splitlines()
    assert star.returncode == 0, "\n".join(seen)
    states = [ln.split(": ", 2)[2] for ln in seen if ln.startswith(f"fedhop slurm: job {job}: ")]
    # once released it ran and completed; Slurm may show COMPLETING (its epilog) between the two
    after = states[states.index("PENDING (JobHeldUser)") + 1:]
    assert after[-1] == "COMPLETED" and "RUNNING" in after, seen
    assert set(after[after.index("RUNNING") + 1:-1]) <= {"RUNNING", "COMPLETING"}, seen
    assert seen[-1].startswith(f"fedhop slurm: job {job} ended with status 0"), seen
    run = user / "runs" / "star"
    cfg = load_config(str(user / "small.toml"), ["clients.processes=1"])
    check_run(run, cfg)
    check_own_credentials(run, plan_processes(cfg).node_ids)        # mutual TLS, per-job credentials
    assert not [p for p in run.rglob("*") if p.name in ("ca.key", "issuer.key", "cluster.secret", ".token")]
    import sqlite3
    with sqlite3.connect(run / "run.db") as db:                     # the config the server ran
        (recorded,) = db.execute("SELECT config_toml FROM runs").fetchone()
    assert "mtls = true" in recorded and f'certs_dir = "{run}/creds/server"' in recorded
    for log in (run / "logs").glob("*.log"):                       # no process announced a weaker mode
        assert "plaintext" not in log.read_text().lower() and "shared-token" not in log.read_text().lower(), log

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

    # more processes than CPUs with --overcommit, plaintext by name: runs, and says so in one line
    text = hier.communicate(timeout=300)[0]
    assert hier.returncode == 0, text
    assert sum("security.insecure = true: plaintext gRPC with one shared run token" in ln
               for ln in text.splitlines()) == 1, text
    run = user / "runs" / "hier"
    check_run(run, load_config(str(user / "small.toml"), HIER))
    assert "plaintext grpc" in (run / "logs" / "server.log").read_text().lower()

    # the failing client: its status is the job's, and --wait prints its error line
    text = failing.communicate(timeout=300)[0]
    assert failing.returncode == 2, text
    exits = json.loads((fail / "slurm" / "exit.json").read_text())
    assert exits["status"] == 2 and exits["steps"][tasks[-1]["node_id"]] == 2
    last = text.strip().splitlines()[-1]
    assert "ended with status 2: " + tasks[-1]["node_id"] in last and "invalid int value: 'lots'" in last, text
    assert not (fail / "summary.json").exists() or json.loads((fail / "summary.json").read_text())["status"] != "completed"
