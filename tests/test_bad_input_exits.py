"""Issue 17, item 6: loopback decided by address; one line and exit 2 for every bad config or
flag; `fedhop run --resume` of a completed run refused with its summary untouched."""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.common.security.addresses import is_loopback
from fedhop.deploy.cli.cli import main as fedhop
from fedhop.server.__main__ import main as server_main
from tests.helpers import quadratic_config

RNG = np.random.default_rng(5)
CENTERS, CURV, SIZES = RNG.normal(0, 1, size=(4, 3)), RNG.uniform(0.5, 2, size=(4, 3)), [3, 4, 5, 6]


@pytest.mark.parametrize("address,loop", [("memnode.example:7000", False), ("memory.lan:1", False),
                                          ("mem:client-proc0:3", True), ("127.0.0.2:7000", True),
                                          ("[::1]:7000", True), ("localhost:1", True), ("10.0.0.7:1", False)])
def test_loopback_is_decided_by_address_not_by_name_prefix(address, loop):
    assert is_loopback(address) is loop


BAD_CONFIGS = [
    (b'[run]\nname = "r\xff"\n', "not UTF-8"),
    (b"[transport]\nchunk_bytes = 2000000\nmax_message_bytes = 1000000\n", "transport.chunk_bytes"),
    (b'[topology]\nkind = "hierarchical"\nedges = 20\n[clients]\ncount = 4\n', "topology.edges"),
    (b'[security]\ncerts_dir = "/nonexistent/fedhop-certs"\n', "security.certs_dir"),
    (b"[clients]\ncount = 10\nper_round = 3\n[run]\nmin_results = 5\n", "run.min_results"),
    (b"[run]\nseed = 18446744073709551616\n", "run.seed"),
    (b'[transport]\nhost = ""\n', "transport.host"),   # it passed the checks, then the server could not listen
    (b'[transport]\nhost = "999.1.1.1"\n', "not an IPv4 address"),
    (b'[transport]\nhost = "not an address!"\n', "transport.host"),
    # EF21 where no parent keeps each client's estimate (it failed every reply EF21_DESYNC at round 1)
    (b'[topology]\nkind = "relay"\n[compression]\nup = "topk"\nerror_feedback = "ef21"\n', "'ef21' needs a parent"),
    (b'[topology]\nkind = "asynchronous"\n[compression]\nup = "sign"\nerror_feedback = "ef21"\n',
     "compression.error_feedback"),   # 2^64: past TOML's integers (it drew seed 0's model)
    # a run's name is one folder name: never a path out of runs/, never empty, no NUL
    (b'[run]\nname = "../../escaped"\n', "run.name"),
    (b'[run]\nname = "/tmp/absolute"\n', "run.name"),
    (b'[run]\nname = "a/b"\n', "run.name"),
    (b'[run]\nname = ""\n', "run.name"),
    (b'[run]\nname = ".."\n', "run.name"),
    (b'[run]\nname = "nul\\u0000byte"\n', "run.name"),
    # a topology's own refusals at load, not at its first round
    (b'[topology]\nkind = "sequential"\nedges = 2\n[algorithm]\nname = "fedavg"\n', "algorithm.name"),
    (b'[topology]\nkind = "sequential"\nedges = 2\ngraph = "rng"\n[algorithm]\nname = "fedchs"\n', "topology.graph"),
    (b'[topology]\nkind = "sequential"\nedges = 3\ngraph = [[1], [0], []]\n[algorithm]\nname = "fedchs"\n',
     "topology.graph"),
    (b'[topology]\nkind = "sequential"\nedges = 2\nstart = 7\n[algorithm]\nname = "fedchs"\n', "topology.start"),
    (b'[topology]\nkind = "chain"\nstart = 99\n[clients]\ncount = 4\n', "topology.start"),
]


@pytest.mark.parametrize("text,key", BAD_CONFIGS)
def test_a_bad_config_is_one_line_and_exit_2(tmp_path, capsys, text, key):
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(text)
    assert fedhop(["run", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("listen", [":47555", "127.0.0.1:99999", "nohostport"])
def test_a_bad_listen_flag_exits_2_naming_it(tmp_path, capsys, listen):
    cfg = tmp_path / "c.toml"
    cfg.write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=1))
    with pytest.raises(SystemExit) as exc:
        server_main(["--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--listen", listen])
    assert exc.value.code == 2
    assert f"argument --listen: '{listen}' is not HOST:PORT" in capsys.readouterr().err


def test_resume_of_a_completed_run_is_refused_and_its_summary_untouched(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=2, name="done"))
    out = tmp_path / "run"
    assert fedhop(["run", str(cfg), "--out", str(out), "--quiet", "--set", "run.checkpoint_every=1"]) == 0
    before = (out / "summary.json").read_bytes()
    assert list((out / "checkpoints").iterdir())   # a checkpoint to resume from exists
    capsys.readouterr()
    assert fedhop(["run", "--resume", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "already completed" in err and len(err.splitlines()) == 1
    assert (out / "summary.json").read_bytes() == before


@pytest.mark.parametrize("engine", ["inprocess", "processes"])
def test_a_char_lstm_on_data_that_is_not_characters_is_one_line_before_training(tmp_path, capsys, engine):
    """model.kind = "char_lstm" embeds each input as a character index: on digits' pixel values the
    embedding would index out of its table mid-training (an IndexError traceback); the task
    refuses the pairing as it builds the data, in one line naming the model and the values found.
    A refusal of the config's data: exit 2 in both engines (the server process's own line, not
    its log's tail), and the run folder it had made is gone (no false start left behind)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nrounds = 1\n[data]\ndataset = "digits"\n[model]\nkind = "char_lstm"\n'
                   '[clients]\ncount = 4\nper_round = 2\nprocesses = 1\n')
    code = fedhop(["run", str(cfg), "--out", str(tmp_path / "run"), "--quiet", "--engine", engine])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "char_lstm" in err and "character indices" in err and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "plaintext gRPC on loopback" not in ln]   # the processes engine's note
    assert len(lines) == 1 and lines[0].startswith("fedhop run: "), err
    assert not (tmp_path / "run").exists()
    (tmp_path / "empty").mkdir()   # a folder the user made is kept, empty as it was
    assert fedhop(["run", str(cfg), "--out", str(tmp_path / "empty"), "--quiet", "--engine", engine]) == 2
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())


def test_a_sweep_spec_or_certs_folder_that_cannot_be_one_is_one_line(tmp_path, capsys):
    (tmp_path / "spec.toml").write_bytes(b"\x00\xf0\x9f\xff binary")
    assert fedhop(["sweep", str(tmp_path / "spec.toml"), "--out", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not UTF-8" in err and len(err.splitlines()) == 1 and not (tmp_path / "sw").exists(), err
    (tmp_path / "afile").write_text("x")
    assert fedhop(["certs", str(tmp_path / "afile"), "--nodes", "server"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a folder" in err and len(err.splitlines()) == 1 and (tmp_path / "afile").read_text() == "x", err


def test_a_client_count_beyond_the_machines_memory_is_one_line_and_exit_2(tmp_path):
    """`clients.count` in the billions: refused in one line naming the key, the memory it needs and
    the memory available, before the process plan lists the clients and before any folder is
    made.  Run under a 6 GiB address-space limit, so that without the check the process fails
    with MemoryError instead of exhausting the machine."""
    import resource
    import subprocess
    import sys

    (tmp_path / "c.toml").write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=1))
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "c.toml", "--set",
                          "clients.count=1000000000", "--out", "o", "--quiet"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)))
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "clients.count = 1,000,000,000 needs about 1,907.3 GiB" in err and "available" in err, err
    assert not (tmp_path / "o").exists()


def test_no_local_training_is_refused_at_load(tmp_path, capsys):
    """local_epochs = 0 with local_steps = 0 (for every client, or some of a per-client list):
    those clients would train no step, and the run used to fail later as diverged (a NaN loss)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(quadratic_config(CENTERS, CURV, SIZES, rounds=1))
    for extra in (["algorithm.local_steps=0"], ["algorithm.local_steps=[1, 0, 2, 3]"]):
        args = ["run", str(cfg), "--set", "algorithm.local_epochs=0", *[a for s in extra for a in ("--set", s)],
                "--out", str(tmp_path / "run"), "--quiet"]
        assert fedhop(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "algorithm.local_epochs': got 0 with algorithm.local_steps = 0" in err
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("given, said", [("nosuch", "nosuch: no such folder"), ("afile", "afile: a file, not a run folder"),
                                         ("empty", "empty: holds no config.toml")])
def test_resume_of_what_is_no_run_folder_says_what_it_is(tmp_path, monkeypatch, capsys, given, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "empty").mkdir()
    assert fedhop(["run", "--resume", given, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty"]


@pytest.mark.parametrize("command", [["k8s", "c.toml", "--out", "o"], ["certs", "o", "--config", "c.toml"],
                                     ["netsim", "c.toml", "--out", "o"]])
def test_a_client_count_beyond_memory_is_refused_by_every_command_that_plans_processes(tmp_path, command):
    """Not only `fedhop run`: a command that plans the run's processes here (Kubernetes manifests,
    the certificates of every node, emulated hosts) lists every client id; `clients.count` in the
    billions is refused by the plan itself (common/topologies/plan.py `plan_beyond_memory`), one
    line, exit 2, nothing made; under a 6 GiB address-space limit, as above."""
    import resource
    import subprocess
    import sys

    text = quadratic_config(CENTERS, CURV, SIZES, rounds=1)
    assert text.count(f"count = {len(SIZES)}\n") == 1
    (tmp_path / "c.toml").write_text(text.replace(f"count = {len(SIZES)}\n", "count = 1000000000\n"))
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", *command], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)))
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "config key 'clients.count': 1,000,000,000 clients need about 238.4 GiB of memory to plan" in err, err
    assert not (tmp_path / "o").exists()
