"""A bad flag of any fedhop command is one line on stderr, naming it, and exit status 2.

argparse's own answer is the usage block and then the error (4 to 8 lines); every command's parser
is common/util/cliparser.py's, whose error is the one line, with where the usage is.  Checked in
this process for the `fedhop` command and its subcommands (each builds its own parser), and for a
role's entry point, in a folder of the user's with relative paths.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from fedhop.deploy.cli.cli import main as fedhop

CASES = [
    (["bogus"], "fedhop", "invalid choice: 'bogus'"),
    (["run"], "fedhop", "CONFIG"),
    (["run", "x.toml", "--engine", "foo"], "fedhop run", "--engine"),
    (["slurm", "x.toml", "--nodes", "abc"], "fedhop slurm", "--nodes"),
    (["slurm", "x.toml", "--bogus"], "fedhop slurm", "--bogus"),
    (["compose", "--clients", "x", "certs"], "fedhop compose", "--clients"),
    (["k8s", "x.toml"], "fedhop k8s", "--out"),
    (["certs", "d", "--days", "soon"], "fedhop certs", "--days"),
    (["sweep", "s.toml", "--parallel", "many"], "fedhop sweep", "--parallel"),
    (["report", "--target-accuracy", "high", "r"], "fedhop report", "--target-accuracy"),
    (["examples", "copy"], "fedhop examples copy", "NAME"),
    (["config", "nope"], "fedhop config", "invalid choice: 'nope'"),
    (["dashboard", "runs/x", "--port", "70000"], "fedhop dashboard", "invalid port 70000"),
    (["dashboard", "runs/x", "--port", "-1"], "fedhop dashboard", "invalid port -1"),
    (["run", "x.toml", "--dashboard", "65536"], "fedhop run", "invalid port 65536"),
]
# the benchmarks start again under fedhop's process settings (deploy/bench/bench.py): a process each
IN_A_PROCESS = [
    (["bench", "large", "--repeats", "x"], "fedhop bench large", "--repeats"),
    (["bench", "peers", "--rounds", "x"], "fedhop bench peers", "--rounds"),
    (["bench", "transport", "--tiny", "--chunk", "0"], "fedhop bench", "--chunk 0"),
    (["bench", "transport", "--sizes", "a,b"], "fedhop bench", "--sizes a,b"),
    (["bench", "transport", "--tiny", "--json", "."], "fedhop bench", "is a folder"),
    (["bench", "scale", "--tiny", "--processes", "-2"], "fedhop bench", "--processes -2: at least 1"),
    (["bench", "scale", "--clients", "0"], "fedhop bench", "--clients 0: at least 1"),
]


@pytest.mark.parametrize("argv, prog, names", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_flag_is_one_line_and_exit_2(argv, prog, names, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        fedhop(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and names in lines[0], err
    assert lines[0].endswith(f"(see {prog} --help)") and "usage:" not in err
    assert list(tmp_path.iterdir()) == []   # nothing written


@pytest.mark.parametrize("argv, prog, names", IN_A_PROCESS, ids=[" ".join(c[0]) for c in IN_A_PROCESS])
def test_a_bad_benchmark_flag_is_one_line_and_exit_2(argv, prog, names, tmp_path):
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", *argv], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"{prog}: error: ") and names in lines[0] and lines[0].endswith(f"(see {prog} --help)")
    assert res.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_role_entry_point_answers_a_bad_flag_in_one_line(capsys):
    from fedhop.common.transport.startup import role_parser
    with pytest.raises(SystemExit) as exc:
        role_parser("python -m fedhop.client", None, "the device").parse_args(["--listen", "nowhere"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("python -m fedhop.client: error: argument --listen")


def test_data_show_refuses_a_folder_for_its_png_or_json(tmp_path, monkeypatch, capsys):
    """`fedhop data show --png DIR` said "wrote DIR" and wrote nothing: a folder is one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "c.toml").write_text('[data]\ndataset = "digits"\n[clients]\ncount = 4\n')
    for flag in ("--png", "--json"):
        assert fedhop(["data", "show", "c.toml", flag, "out"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag} out is a folder" in err[0], err
    assert list((tmp_path / "out").iterdir()) == []
