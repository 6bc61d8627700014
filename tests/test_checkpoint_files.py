"""Checkpoint files a resume reads that are not what a round wrote: a field of the wrong kind, an
RNG state the generators refuse, a FIFO or a folder with a checkpoint's name.  Each is a
CheckpointError naming the file (a newer one is skipped for an older one), never a traceback
after the run has started again or an open that waits forever."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedhop.common.records.checkpoint import (
    Checkpoint,
    CheckpointError,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _saved(run_dir: Path, round: int = 3) -> Path:
    torch_rng, numpy_rng = capture_rng()
    ckpt = Checkpoint(round=round, run_id="r-1", params={"w": torch.arange(4.0)}, torch_rng=torch_rng,
                      numpy_rng=numpy_rng, client_states={2: {"c": torch.ones(2)}}, failures_total=1)
    return save_checkpoint(run_dir, ckpt, keep=5)


def _rewrite(path: Path, meta_change=None, tensors_change=None) -> None:
    """The file at `path` written again with its metadata or tensors changed (a tampered file)."""
    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["fedhop"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    if meta_change is not None:
        meta = meta_change(meta)
    if tensors_change is not None:
        tensors_change(tensors)
    save_file(tensors, str(path), metadata={"fedhop": json.dumps(meta)})


def test_a_saved_checkpoint_reads_back(tmp_path: Path) -> None:
    ckpt = load_checkpoint(_saved(tmp_path))
    assert ckpt.round == 3 and ckpt.failures_total == 1 and torch.equal(ckpt.params["w"], torch.arange(4.0))
    assert list(ckpt.client_states) == [2] and torch.equal(ckpt.client_states[2]["c"], torch.ones(2))


@pytest.mark.parametrize("change, said", [
    (lambda m: {k: v for k, v in m.items() if k != "round"}, "round is null, not a count"),
    (lambda m: dict(m, round="abc"), 'round is "abc", not a count'),
    (lambda m: dict(m, round=-5), "round is -5, not a count"),
    (lambda m: dict(m, round=10**12), "round is 1000000000000, not a count"),
    (lambda m: dict(m, round=True), "round is true, not a count"),
    (lambda m: dict(m, failures_total="many"), 'failures_total is "many", not a count'),
    (lambda m: dict(m, clients=["x"]), "clients is not a list of client ids"),
    (lambda m: dict(m, clients=5), "clients is not a list of client ids"),
    (lambda m: dict(m, scalars=[1]), "scalars is not an object"),
    (lambda m: dict(m, numpy_rng="abc"), "numpy_rng is not an object"),
    (lambda m: dict(m, numpy_rng=dict(m["numpy_rng"], keys="AAAA")), ""),   # the generator refuses the state
    (lambda m: {k: v for k, v in m.items() if k != "run_id"}, "no 'run_id' field"),
    (lambda m: [m], "format None"),
])
def test_a_metadata_field_of_the_wrong_kind_is_a_checkpoint_error_naming_the_file(tmp_path: Path, change,
                                                                                said) -> None:
    path = _saved(tmp_path)
    _rewrite(path, meta_change=change)
    with pytest.raises(CheckpointError, match=rf"^(checkpoint|cannot read checkpoint) {path}") as err:
        load_checkpoint(path)
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("change, said", [
    (lambda t: t.update({"rng/torch": torch.zeros(3)}), "RNG state must be a torch.ByteTensor"),
    (lambda t: t.update({"client/abc/x": torch.ones(1)}), "'abc' is not a client id"),
])
def test_a_tensor_of_the_wrong_kind_is_a_checkpoint_error_naming_the_file(tmp_path: Path, change, said) -> None:
    path = _saved(tmp_path)
    _rewrite(path, tensors_change=change)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {path}: .*{said}"):
        load_checkpoint(path)


def test_a_tampered_newest_checkpoint_gives_way_to_the_one_before(tmp_path: Path) -> None:
    _saved(tmp_path, round=3)
    newest = _saved(tmp_path, round=4)
    _rewrite(newest, meta_change=lambda m: dict(m, round="four"))
    skipped: list[str] = []
    assert latest_checkpoint(tmp_path, on_skip=skipped.append).round == 3
    assert len(skipped) == 1 and 'round is "four"' in skipped[0]


@pytest.mark.parametrize("make", ["fifo", "folder", "dangling link"])
def test_an_entry_with_a_checkpoints_name_that_is_no_file_is_refused_without_opening_it(tmp_path: Path,
                                                                                      make: str) -> None:
    """A FIFO would block the open forever; a folder would make the run's next checkpoint fail."""
    _saved(tmp_path, round=3)
    odd = tmp_path / "checkpoints" / "round-000004.safetensors"
    if make == "fifo":
        os.mkfifo(odd)
    elif make == "folder":
        odd.mkdir()
    else:
        odd.symlink_to(tmp_path / "nowhere")
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoints" / "round-000003.safetensors"]
    with pytest.raises(CheckpointError, match=rf"^{odd} is not a checkpoint file \(a regular file\)"):
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_checkpoint(odd)


def _config(rounds: int) -> str:
    """A two-client quadratic run in one process, checkpointed every round."""
    return (f'[run]\nname = "ck"\nrounds = {rounds}\ncheckpoint_every = 1\nengine = "inprocess"\n'
            '[algorithm]\nname = "fedavg"\nlr = 0.1\nlocal_steps = 1\nbatch_size = 0\n'
            '[data]\ndataset = "quadratic"\ndim = 3\n[clients]\ncount = 2\nper_round = 2\nprocesses = 1\n')


def _resume(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "--resume", "run", "--quiet"],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def stopped_run(tmp_path: Path) -> Path:
    """A run folder whose run stopped after round 2 (its later rounds' records taken out)."""
    (tmp_path / "exp.toml").write_text(_config(2))
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "run", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (tmp_path / "run" / "summary.json").unlink()   # not completed: a resume has rounds to run
    return tmp_path


def test_resume_of_a_run_whose_run_db_is_not_a_database_is_one_line_exit_2(stopped_run: Path) -> None:
    (stopped_run / "run" / "run.db").write_bytes(b"this is not a database" * 100)
    done = _resume(stopped_run)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("run.db is not a SQLite database (file is not a database)")


def test_resume_refuses_a_checkpoint_whose_model_is_not_the_configs(stopped_run: Path) -> None:
    newest = list_checkpoints(stopped_run / "run")[-1]
    _rewrite(newest, tensors_change=lambda t: t.update({k: torch.full_like(v, float("nan")) for k, v in t.items()
                                                        if k.startswith("params/")}))
    done = _resume(stopped_run)
    assert done.returncode == 2 and "Traceback" not in done.stderr   # a run folder that cannot be resumed
    assert "holds NaN or Inf" in done.stderr
    _rewrite(newest, tensors_change=lambda t: t.update({k: v[:1].clone() for k, v in t.items()
                                                        if k.startswith("params/")}))
    done = _resume(stopped_run)
    assert done.returncode == 2 and "the config's model has torch.float32" in done.stderr


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_a_checkpoint_holds_only_the_clients_that_have_state(tmp_path: Path, algorithm: str) -> None:
    """400 clients in two processes, 12 a round, a checkpoint every round: each checkpoint lists
    exactly the clients with persistent state (none for FedAvg; for SCAFFOLD every client that
    trained by then, its c_i), and a process's `state_get` reply names no client without state,
    so neither grows with the clients a process hosts."""
    import sqlite3

    (tmp_path / "exp.toml").write_text(
        f'[run]\nname = "ck"\nrounds = 3\ncheckpoint_every = 1\nengine = "inprocess"\nseed = 3\n'
        f'[algorithm]\nname = "{algorithm}"\nlr = 0.1\nlocal_steps = 1\nbatch_size = 0\n'
        '[data]\ndataset = "quadratic"\ndim = 3\n[clients]\ncount = 400\nper_round = 12\nprocesses = 2\n')
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "run", "--quiet",
                           "--set", "security.keep_checkpoints=3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    db = sqlite3.connect(tmp_path / "run" / "run.db")
    trained = {r: {int(dst.split("-")[1]) for (dst,) in db.execute(
        "SELECT dst FROM messages WHERE method = 'train' AND role = 'sender' AND round <= ?", (r,))} for r in (1, 2, 3)}
    replies = db.execute("SELECT payload_bytes, tensor_bytes FROM messages WHERE method = 'state_get.reply' "
                         "AND role = 'sender'").fetchall()
    db.close()
    assert len(trained[1]) == 12 and trained[1] < trained[2] < trained[3]
    checkpoints = list_checkpoints(tmp_path / "run")
    assert [p.name for p in checkpoints] == [f"round-00000{r}.safetensors" for r in (1, 2, 3)]
    for r, path in enumerate(checkpoints, start=1):
        ckpt = load_checkpoint(path)
        with safe_open(str(path), framework="pt") as fh:
            listed = json.loads(fh.metadata()["fedhop"])["clients"]
        expect = set() if algorithm == "fedavg" else trained[r]
        assert set(ckpt.client_states) == expect and sorted(listed) == sorted(expect), (r, len(listed))
        assert all(ckpt.client_states[c] for c in expect)
    assert len(replies) == 6   # two processes, three checkpoints
    if algorithm == "fedavg":   # an envelope alone (about 100 bytes); 200 hosted ids would add 300-400
        assert all(tensor == 0 and payload < 160 for payload, tensor in replies), replies


def test_a_childs_reply_replaces_its_clients_states_and_a_dead_childs_stay() -> None:
    """The server's copy of the client states, child by child: a reply is the whole state of its
    process's clients (a client left out has none any more), a child that does not answer keeps
    what it last gave, with a `checkpoint_partial` event (a fabric and coordinator stand in)."""
    from types import SimpleNamespace

    from fedhop.common.records.checkpoint import states_to_payload
    from fedhop.server.driver import ChildNode
    from fedhop.server.resilience import Checkpointer

    answers: dict[str, object] = {}
    events: list[tuple[str, str]] = []

    def send_to_all(sends, round, call_timeout):
        replies = {s.key: answers[s.key] for s in sends if not isinstance(answers[s.key], str)}
        return replies, {s.key: answers[s.key] for s in sends if isinstance(answers[s.key], str)}

    coord = SimpleNamespace(
        cfg=SimpleNamespace(run=SimpleNamespace(checkpoint_every=1, call_timeout=5.0),
                            security=SimpleNamespace(keep_checkpoints=2)),
        round_listeners=[], ready_listeners=[], fabric=SimpleNamespace(send_to_all=send_to_all),
        children={"p0": ChildNode("p0", "client", "a0", [0, 1, 2]), "p1": ChildNode("p1", "client", "a1", [3, 4])},
        store=SimpleNamespace(add_event=lambda kind, node, round, detail: events.append((kind, node))))
    ck = Checkpointer(coord)   # type: ignore[arg-type]
    one, two = torch.ones(2), torch.full((2,), 2.0)
    answers.update(p0=states_to_payload({1: {"c": one}}), p1=states_to_payload({3: {"c": two}, 4: {"c": one}}))
    ck.pull(1)
    assert {c: float(s["c"].sum()) for c, s in ck.client_states().items()} == {1: 2.0, 3: 4.0, 4: 2.0}
    answers.update(p0=states_to_payload({2: {"c": two}}), p1="UNAVAILABLE: gone")
    ck.pull(2)
    assert {c: float(s["c"].sum()) for c, s in ck.client_states().items()} == {2: 4.0, 3: 4.0, 4: 2.0}
    assert events == [("checkpoint_partial", "p1")]
    answers.update(p0=states_to_payload({7: {"c": one}}), p1=states_to_payload({}))   # 7: not p0's client
    ck.pull(3)
    assert sorted(ck.client_states()) == [2] and events[-1] == ("checkpoint_partial", "p0")
