"""`fedhop run` from a user's own folder (issue 25, "Broken"): relative paths, run folders that
are never shared or silently added to, progress that shows the last rounds, Ctrl-C and SIGTERM
recorded as a stopped run, plug-ins beside the config, and sweeps with a relative `--out`.

Every test runs the real command (`python -m fedhop.deploy.cli.cli`, separate OS processes on
loopback) with its working directory in a temporary folder outside the checkout, relative
paths only, and checks the records against an independent reading of run.db.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.helpers import max_round, quadratic_config, read_db, wait_until

CENTERS = [[1.0, -2.0], [3.0, 0.5], [-1.0, 1.0], [0.0, 2.0]]
CURVATURES = [[1.0, 2.0], [0.5, 1.0], [2.0, 1.0], [1.0, 1.0]]
SIZES = [10, 20, 30, 40]


def cfg_text(rounds: int = 3, **kw) -> str:
    return quadratic_config(CENTERS, CURVATURES, SIZES, rounds=rounds, **kw)


def fedhop(args: list[str], cwd: Path, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_PLUGIN_PATH")}
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def start(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_PLUGIN_PATH")}
    return subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def sent_bytes(run_dir: Path) -> tuple[int, int]:
    """(messages, framed bytes) the senders recorded in run.db: what the summary must total."""
    db = run_dir / "run.db"
    return (read_db(db, "SELECT COUNT(*) FROM messages WHERE role = 'sender'"),
            read_db(db, "SELECT SUM(framed_bytes) FROM messages WHERE role = 'sender'"))


def wait_for_round(db: Path, proc: subprocess.Popen, r: int, timeout: float = 180) -> None:
    """Poll run.db (read-only) until round `r` is recorded: the event the test waits on."""
    wait_until(f"round {r} recorded", lambda: max_round(db) >= r, [proc], timeout)


def start_long_run(user_dir: Path, rounds: int = 400) -> tuple[subprocess.Popen, Path]:
    """`fedhop run` of far more rounds than a test lets it play (a checkpoint every 2), into
    `r/` of the user's folder: the process and the run folder."""
    (user_dir / "exp.toml").write_text(cfg_text(rounds=rounds).replace("[run]", "[run]\ncheckpoint_every = 2"))
    return start(["run", "exp.toml", "--out", "r"], user_dir), user_dir / "r"


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def user_dir(tmp_path: Path) -> Path:
    """A folder of the user's, outside the checkout, holding their config."""
    d = tmp_path / "me"
    d.mkdir()
    (d / "exp.toml").write_text(cfg_text())
    return d


def test_relative_out_from_a_users_folder_and_its_records(user_dir):
    res = fedhop(["run", "exp.toml", "--out", "runs/a", "--quiet"], user_dir)
    assert res.returncode == 0, res.stderr
    run = user_dir / "runs" / "a"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    messages, framed = sent_bytes(run)
    assert (summary["bytes"]["total"]["messages"], summary["bytes"]["total"]["framed_bytes"]) == (messages, framed)
    assert str(run) in res.stdout                       # the table names the folder, absolute
    saved = (run / "config.toml").read_text()
    assert f'data_dir = "{user_dir / "data"}"' in saved   # paths recorded absolute: the same from any folder


def test_out_onto_an_earlier_run_is_refused_and_force_replaces_it(user_dir):
    assert fedhop(["run", "exp.toml", "--out", "runs/a", "--quiet"], user_dir).returncode == 0
    run = user_dir / "runs" / "a"
    before = digest(run)
    first = json.loads((run / "summary.json").read_text())["bytes"]["total"]
    res = fedhop(["run", "exp.toml", "--out", "runs/a", "--quiet"], user_dir)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds an earlier run" in lines[0] and "--force" in lines[0], res.stderr
    assert digest(run) == before                        # nothing lost, nothing added
    res = fedhop(["run", "exp.toml", "--out", "runs/a", "--quiet", "--force"], user_dir)
    assert res.returncode == 0, res.stderr
    again = json.loads((run / "summary.json").read_text())["bytes"]["total"]
    assert again == first                               # the same run again, not both runs added
    assert sent_bytes(run) == (first["messages"], first["framed_bytes"])


def test_out_onto_a_folder_of_other_files_is_refused_even_with_force(user_dir):
    keep = user_dir / "notes"
    keep.mkdir()
    (keep / "thesis.tex").write_text("mine")
    for extra in ([], ["--force"]):
        res = fedhop(["run", "exp.toml", "--out", "notes", "--quiet", *extra], user_dir)
        assert res.returncode == 2 and "holds no fedhop run" in res.stderr, res.stderr
    assert (keep / "thesis.tex").read_text() == "mine" and len(list(keep.iterdir())) == 1


@pytest.mark.parametrize("out, said", [("afile", "--out afile: a file, not a folder"),
                                       ("afile/sub", "afile is a file, so no folder can be made under it"),
                                       ("afile/a/b", "afile is a file, so no folder can be made under it")])
def test_out_at_or_under_a_file_is_one_line_exit_2(user_dir, out, said):
    (user_dir / "afile").write_text("mine")
    res = fedhop(["run", "exp.toml", "--out", out, "--quiet"], user_dir)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"fedhop run: --out {out}: "), res.stderr
    assert said in lines[0] and "Errno" not in lines[0]
    assert (user_dir / "afile").read_text() == "mine" and not (user_dir / "runs").exists()



@pytest.mark.parametrize("names", [("run.db",), ("config.toml",), ("ledger/",), ("config.toml", "run.db", "summary.json")])
def test_a_folder_with_run_files_no_fedhop_run_made_is_never_emptied(user_dir, names):
    """A project folder that happens to hold a `config.toml`, an empty `run.db` or a `ledger/`
    beside the user's own files (the names of a run's files, no round in them: what a false start
    looks like) is refused, with or without --force, and every file stays: only a folder a fedhop
    run marked as its own (.fedhop-run) is ever emptied."""
    project = user_dir / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('mine')\n")
    (project / "precious.txt").write_text("mine")
    for name in names:
        if name.endswith("/"):
            (project / name).mkdir()
        else:
            (project / name).write_text("")
    before = digest(project)
    listing = sorted(p.name for p in project.iterdir())
    for extra in ([], ["--force"]):
        res = fedhop(["run", "exp.toml", "--out", "project", "--quiet", *extra], user_dir)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and "no fedhop run made there" in lines[0], res.stderr
        assert digest(project) == before and sorted(p.name for p in project.iterdir()) == listing

def test_runs_started_together_get_their_own_folders(user_dir):
    procs = [start(["run", "exp.toml", "--set", f"run.seed={s}", "--quiet"], user_dir) for s in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-600:] for o in outs]
    folders = sorted((user_dir / "runs").iterdir())
    assert len(folders) == 3
    seeds = set()
    for f in folders:
        summary = json.loads((f / "summary.json").read_text())
        assert summary["status"] == "completed"
        seeds.add(int(next(line for line in (f / "config.toml").read_text().splitlines()
                           if line.startswith("seed = ")).split("=")[1]))
        assert sent_bytes(f) == (summary["bytes"]["total"]["messages"], summary["bytes"]["total"]["framed_bytes"])
    assert seeds == {0, 1, 2}


def test_piped_progress_shows_every_tenth_round_and_the_last(user_dir):
    (user_dir / "exp.toml").write_text(cfg_text(rounds=20))
    res = fedhop(["run", "exp.toml", "--out", "r"], user_dir)
    assert res.returncode == 0, res.stderr
    shown = [int(line.split()[1].split("/")[0]) for line in res.stderr.splitlines() if line.startswith("round ")]
    assert shown == list(range(2, 21, 2)), res.stderr


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "SIGINT (Ctrl-C)"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stopped_run_is_recorded_as_stopped_and_resumes(user_dir, sig, code, said):
    rounds = 400   # far more than the stop leaves done; resumed, the rest take seconds
    proc, run = start_long_run(user_dir, rounds)
    wait_for_round(run / "run.db", proc, 3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-1500:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["error"].startswith(f"stopped by {said} after round")
    assert summary["rounds_completed"] >= 3
    assert "run r: stopped" in out and "DISAGREE" not in out + err and "failed" not in out
    assert ("Ctrl-C again" in err) == (sig == signal.SIGINT) and "Ctrl-C" in err   # the hint fits the stop
    # the WAL is folded into run.db (checked before this test's own read-only connection makes one)
    assert not [p for p in run.iterdir() if p.name.endswith(("-wal", "-shm"))]
    db = run / "run.db"
    assert read_db(db, "SELECT status FROM runs") == "stopped"
    assert read_db(db, "SELECT COUNT(*) FROM events WHERE kind = 'run_stopped'") == 1
    assert summary["rounds_completed"] < rounds
    # the run continues from its newest checkpoint, started from another folder
    res = fedhop(["run", "--resume", str(run), "--quiet"], user_dir.parent)
    assert res.returncode == 0, res.stderr
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["rounds_completed"] == rounds


def server_process(proc: subprocess.Popen) -> psutil.Process:
    """The run's server process among `fedhop run`'s children (its title: `fedhop server <run>`)."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("fedhop server "):
                return child
        except psutil.Error:
            pass
    raise AssertionError("no `fedhop server` process under fedhop run")


@pytest.mark.parametrize("end", ["server killed", "Ctrl-C twice"])
def test_a_server_that_ends_unrecorded_leaves_run_db_saying_so(user_dir, end):
    """A server that cannot record the run's end (SIGKILL; or stopped, so that a second Ctrl-C
    kills every process first): `fedhop run` records it in run.db once the server is gone, with a
    `server_lost` event, `failed` (exit 1) or `stopped` (exit 130) instead of "running"; the run
    then resumes from its newest checkpoint and completes."""
    rounds = 400
    proc, run = start_long_run(user_dir, rounds)
    db = run / "run.db"
    wait_for_round(db, proc, 3)
    server = server_process(proc)
    if end == "server killed":
        server.send_signal(signal.SIGKILL)
    else:   # a server that is slow to record the stop (here: not running at all) meets a second Ctrl-C
        server.send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        said = ""
        assert proc.stderr is not None
        while "the server records the run as stopped" not in said:   # the launcher took the first one
            line = proc.stderr.readline()
            assert line, "fedhop run ended before it took the first Ctrl-C"
            said += line
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    status, code, why = (("failed", 1, "exited with status -9") if end == "server killed" else
                         ("stopped", 130, "Ctrl-C again: every process was killed"))
    assert proc.returncode == code, err[-1500:]
    assert not server.is_running() or server.status() == "zombie"
    assert read_db(db, "SELECT status FROM runs") == status
    assert read_db(db, "SELECT COUNT(*) FROM events WHERE kind = 'server_lost'") == 1
    assert why in read_db(db, "SELECT detail FROM events WHERE kind = 'server_lost'")
    assert not (run / "summary.json").exists() and max_round(db) >= 3
    assert "merged the ledgers of every process" in err   # the clients' records are in run.db
    res = fedhop(["run", "--resume", "r", "--quiet"], user_dir)
    assert res.returncode == 0, res.stderr
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["rounds_completed"] == rounds
    assert resumed["ledger_agreement"]["ok"], resumed["ledger_agreement"]
    assert read_db(db, "SELECT status FROM runs") == "completed"


MODEL_PACKAGE = """
import math

import torch


def make_net(input_shape, n_outputs):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), n_outputs))
"""

DIGITS = """
[run]
rounds = 2
[data]
dataset = "digits"
[model]
factory = "mymodels:make_net"
[clients]
count = 4
processes = 2
"""


@pytest.mark.parametrize("where", ["cwd", "config folder"])
def test_a_plugin_package_beside_the_user_is_found_without_pythonpath(tmp_path, where):
    """`model.factory = "mymodels:make_net"` with ./mymodels/ in the working directory or beside
    the config: found by the launcher and every child without PYTHONPATH or an install."""
    home = tmp_path / "home"
    cfgdir = home / "configs"
    cfgdir.mkdir(parents=True)
    pkg = (home if where == "cwd" else cfgdir) / "mymodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(MODEL_PACKAGE)
    (cfgdir / "exp.toml").write_text(DIGITS)
    res = fedhop(["run", "configs/exp.toml", "--out", "r", "--quiet"], home)
    assert res.returncode == 0, res.stderr[-1500:]
    summary = json.loads((home / "r" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_parameters"] == 64 * 10 + 10   # the plug-in's model


def test_a_missing_plugin_names_the_search_path(user_dir):
    (user_dir / "exp.toml").write_text(DIGITS.replace("mymodels:", "nosuchpkg:"))
    res = fedhop(["run", "exp.toml", "--out", "r", "--quiet"], user_dir)
    assert res.returncode == 2
    assert "No module named 'nosuchpkg'" in res.stderr and str(user_dir) in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2, res.stderr


def test_sweep_with_a_relative_out_from_a_users_folder(user_dir):
    (user_dir / "sweep.toml").write_text('[sweep]\nconfig = "exp.toml"\nseeds = [0, 1]\nparallel = 2\n'
                                         'set = ["run.rounds=2"]\n[grid]\n"algorithm.lr" = [0.05, 0.1]\n')
    res = fedhop(["sweep", "sweep.toml", "--out", "sweeps/x", "--quiet"], user_dir, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads((user_dir / "sweeps" / "x" / "results.json").read_text())
    runs = sorted((user_dir / "sweeps" / "x" / "runs").glob("*/*/seed*/summary.json"))
    assert len(runs) == 4
    for path in runs:
        summary = json.loads(path.read_text())
        assert summary["status"] == "completed"
        assert sent_bytes(path.parent)[1] == summary["bytes"]["total"]["framed_bytes"]
    assert results   # scored from those runs
    # the same command again reuses every finished run; another --set re-runs them, never mixes them in
    before = {path: path.read_bytes() for path in runs}
    res = fedhop(["sweep", "sweep.toml", "--out", "sweeps/x", "--quiet"], user_dir, timeout=300)
    assert res.returncode == 0 and {path: path.read_bytes() for path in runs} == before, res.stderr[-1500:]
    res = fedhop(["sweep", "sweep.toml", "--out", "sweeps/x", "--quiet", "--set", "run.rounds=3"], user_dir,
                 timeout=300)
    assert res.returncode == 0, res.stderr[-1500:]
    assert sorted(json.loads(path.read_text())["rounds_completed"] for path in runs) == [3, 3, 3, 3]


def test_npz_data_relative_to_the_users_folder(tmp_path):
    """data.path of an npz file relative to the working directory: read by the children too."""
    home = tmp_path / "home"
    home.mkdir()
    rng = np.random.default_rng(0)
    arrays = {}
    for i in range(3):
        arrays[f"x_{i}"] = rng.normal(size=(20, 4)).astype(np.float32)
        arrays[f"y_{i}"] = rng.integers(0, 2, size=20)
    np.savez(home / "mine.npz", **arrays)
    (home / "exp.toml").write_text('[run]\nrounds = 2\n[data]\ndataset = "npz"\npath = "mine.npz"\n'
                                   'task = "classification"\n[model]\nkind = "logreg"\n'
                                   '[clients]\ncount = 3\nprocesses = 1\n')
    res = fedhop(["run", "exp.toml", "--out", "r", "--quiet"], home)
    assert res.returncode == 0, res.stderr[-1500:]
    assert f'path = "{home / "mine.npz"}"' in (home / "r" / "config.toml").read_text()


def test_a_resumed_run_counts_the_whole_run_everywhere(user_dir):
    """Ctrl-C mid-run, `fedhop run --resume`: the live view (the live page's link table, the README's
    SQL over live_bytes), the progress line's bytes and the report's cumulative bytes all count the
    whole run, both attempts, and end equal to summary.json.  Before the resumed run's live view
    carried its earlier attempts (common/transport/livebytes.py `carried_rows`) each of them counted
    only the resumed attempt."""
    from fedhop.deploy.launch.launcher import read_progress
    from fedhop.deploy.tools.dashboard import snapshot
    from fedhop.deploy.tools.report import human_bytes, load_run
    rounds = 400
    proc, run = start_long_run(user_dir, rounds)
    db = run / "run.db"
    wait_for_round(db, proc, 5)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    stopped = json.loads((run / "summary.json").read_text())
    first, first_rounds = stopped["bytes"]["total"]["framed_bytes"], stopped["rounds_completed"]
    assert first > 0
    res = fedhop(["run", "--resume", "r"], user_dir)
    assert res.returncode == 0, res.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == rounds
    total = summary["bytes"]["total"]
    assert total["framed_bytes"] > first
    live_sql = read_db(db, "SELECT SUM(framed_bytes) FROM live_bytes")          # the README's live query
    assert live_sql == total["framed_bytes"]
    assert read_db(db, "SELECT SUM(messages) FROM live_bytes") == total["messages"]
    page = snapshot(run)
    assert sum(link["framed_bytes"] for link in page["links"]) == total["framed_bytes"]
    assert sum(link["messages"] for link in page["links"]) == total["messages"]
    star = next(link for link in page["graph"]["links"] if link["link"] == "client-server")
    assert sum(star["bytes"].values()) == summary["bytes"]["by_link"]["client-server"]["framed_bytes"]
    assert page["rounds"][-1]["bytes"] == total["framed_bytes"]
    assert read_progress(db, 0, final=True)[-1]["bytes"] == total["framed_bytes"]
    # every round the resumed attempt ran counts the whole first attempt too (none restarts at zero)
    resumed = read_db(db, "SELECT MIN(live_framed_bytes) FROM rounds WHERE round > ?", (first_rounds,))
    assert resumed >= first, (first_rounds, resumed, first)
    last = [line for line in res.stderr.splitlines() if line.startswith(f"round {rounds}/{rounds} ")]
    assert last and f"bytes={human_bytes(total['framed_bytes'])}" in last[0], res.stderr[-2000:]
    notes: list[str] = []
    data = load_run(run, notes)
    assert data is not None and data.cumulative[max(data.cumulative)]["framed_bytes"] == total["framed_bytes"]


FAILING_MODEL = 'def make_net(input_shape, n_outputs):\n    raise RuntimeError("no model today")\n'
WORKING_MODEL = ("import math\nimport torch\n\n\ndef make_net(input_shape, n_outputs):\n"
                 "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), n_outputs))\n")


def test_a_run_that_failed_before_its_first_round_leaves_a_folder_out_reuses(user_dir):
    """Issue 45, item 2: a run whose server fails while it starts (here a model factory that raises)
    leaves no trap: `--resume` says there is nothing to resume and how to start again, and the same
    `--out` is reused once the cause is fixed; a completed run's folder is still refused."""
    (user_dir / "mymodels.py").write_text(FAILING_MODEL)
    (user_dir / "digits.toml").write_text(DIGITS.replace("rounds = 2", "rounds = 2\ncheckpoint_every = 1"))
    failed = fedhop(["run", "digits.toml", "--out", "runs/x", "--quiet"], user_dir)
    assert failed.returncode != 0 and "no model today" in failed.stderr
    run = user_dir / "runs" / "x"
    assert (run / "config.toml").exists()
    res = fedhop(["run", "--resume", "runs/x"], user_dir)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "ended before its first round" in res.stderr and "--out runs/x" in res.stderr
    (user_dir / "mymodels.py").write_text(WORKING_MODEL)
    again = fedhop(["run", "digits.toml", "--out", "runs/x", "--quiet"], user_dir)
    assert again.returncode == 0, again.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert "no model today" not in "".join(p.read_text() for p in (run / "logs").iterdir())   # nothing left over
    refused = fedhop(["run", "digits.toml", "--out", "runs/x", "--quiet"], user_dir)
    assert refused.returncode == 2 and "holds an earlier run" in refused.stderr


def test_out_onto_a_folder_a_live_run_holds_is_refused_until_it_ends(user_dir):
    """A folder is held by its run while any of its processes lives (an flock every forked child
    shares), so even a run that has recorded no round yet is never replaced under its feet."""
    (user_dir / "exp.toml").write_text(cfg_text(rounds=400))
    proc = start(["run", "exp.toml", "--out", "r"], user_dir)
    run = user_dir / "r"
    wait_until("the first run's claim of r", (run / "config.toml").exists, [proc])   # claimed (and held) by it
    res = fedhop(["run", "exp.toml", "--out", "r", "--force"], user_dir)
    assert res.returncode == 2 and "a run is still using" in res.stderr, res.stderr
    res = fedhop(["run", "--resume", "r"], user_dir)
    assert res.returncode == 2 and "a run is still using" in res.stderr, res.stderr
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert json.loads((run / "summary.json").read_text())["status"] == "stopped"


def test_resume_of_a_completed_run_without_checkpoints_says_it_is_completed(user_dir):
    assert fedhop(["run", "exp.toml", "--out", "done", "--quiet"], user_dir).returncode == 0
    res = fedhop(["run", "--resume", "done"], user_dir)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "already completed" in res.stderr and "no usable checkpoint" not in res.stderr


def test_refusing_a_taken_out_does_not_wait_for_torch(user_dir):
    """The folder check runs before anything heavy is imported: refused in well under the time an
    import of torch takes (measured in the same test, so a slow machine slows both)."""
    assert fedhop(["run", "exp.toml", "--out", "taken", "--quiet"], user_dir).returncode == 0
    t0 = time.monotonic()
    res = fedhop(["run", "exp.toml", "--out", "taken"], user_dir)
    refuse = time.monotonic() - t0
    assert res.returncode == 2 and "holds an earlier run" in res.stderr
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    torch_import = time.monotonic() - t0
    assert refuse < torch_import, (refuse, torch_import)


def client_replies(run: Path, r: int) -> int:
    """Replies the client processes sent in round `r`, by their ledgers (written as they go)."""
    sent = 0
    for path in (run / "ledger").glob("client-proc*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:   # a line being written
                continue
            sent += rec.get("round") == r and rec.get("role") == "sender" and rec.get("method") == "train.reply"
    return sent


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_ends_the_virtual_clocks_sleep(user_dir, sig, code):
    """clients.sleep_scale pads each round's wall time to scale x its simulated time with a sleep
    at the server's round end, where a stop signal is only noted: a plain sleep went on (hours
    here) until the launcher killed the server after its STOP_GRACE of 60 s.  The sleep ends once
    a stop is noted, and the server records the run as stopped at once (round 1 recorded or not).
    The signal goes once every client has sent its round-1 reply: the server is then folding them
    or in the sleep."""
    from fedhop.deploy.launch.launcher import STOP_GRACE
    (user_dir / "exp.toml").write_text(cfg_text(rounds=3).replace("[clients]", "[clients]\nsleep_scale = 1000000.0"))
    proc = start(["run", "exp.toml", "--out", "r", "--quiet"], user_dir)
    run = user_dir / "r"
    wait_until("every client's round-1 reply", lambda: client_replies(run, 1) >= len(SIZES), [proc])
    stopped_at = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=STOP_GRACE + 60)
    took = time.monotonic() - stopped_at
    assert proc.returncode == code, err[-1500:]
    assert took < STOP_GRACE / 2, f"the stop took {took:.1f} s"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["rounds_completed"] <= 1, summary
