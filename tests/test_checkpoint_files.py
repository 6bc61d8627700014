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
