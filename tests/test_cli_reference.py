"""The command-line reference (docs/cli.md) against the parsers the commands really use.

The page is generated (deploy/cli/clidoc.py); these tests hold it to the committed text and check it
against `fedhop ... --help` as a user's command line reaches each parser, not against the
generator's own way of finding them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedhop.deploy.cli import clidoc
from fedhop.deploy.cli.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"


def _help(capsys, monkeypatch, *argv: str) -> str:
    """`fedhop ARGV --help`, in this process, through deploy/cli/cli.py's dispatch."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("FEDHOP_NO_MALLOC_TUNING", "1")   # `bench large` would re-execute Python first
    with pytest.raises(SystemExit) as stop:
        cli_main([*argv, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def _section(page: str, command: str) -> str:
    """The text under `command`'s heading, up to the next command's heading."""
    m = re.search(rf"^#+ {re.escape(command)}\n(.*?)(?=^#+ fedhop |\Z)", page, re.M | re.S)
    assert m, f"docs/cli.md has no section for {command!r}"
    return m.group(1)


def test_docs_cli_md_is_the_generated_reference():
    assert DOC.read_text() == clidoc.markdown(), \
        f"docs/cli.md is out of date with the parsers; regenerate it: {clidoc.REGENERATE}"


def _commands(capsys, monkeypatch) -> list[tuple[str, ...]]:
    """Every command and sub-command `fedhop --help` and each command's --help name."""
    top = _help(capsys, monkeypatch)
    names = re.search(r"\{([\w,-]+)\}", top).group(1).split(",")
    assert {"run", "report", "sweep", "examples", "data", "bench", "slurm"} <= set(names)
    out: list[tuple[str, ...]] = []
    for name in names:
        out.append((name,))
        text = _help(capsys, monkeypatch, name)
        usage = text.split("\n\n")[0]
        if m := re.search(r"\{([\w,-]+)\} \.\.\.", usage):    # argparse sub-commands: examples copy, data show
            out += [(name, sub) for sub in m.group(1).split(",")]
    out += [("bench", "large"), ("bench", "flower"), ("data", "fetch")]   # their own command lines
    return out


def test_every_command_and_flag_of_the_help_is_in_its_section(capsys, monkeypatch):
    page = DOC.read_text()
    commands = _commands(capsys, monkeypatch)
    assert len(commands) >= 20
    checked = 0
    for argv in commands:
        section = _section(page, " ".join(("fedhop", *argv)))
        text = _help(capsys, monkeypatch, *argv)
        flags = set(re.findall(r"(?<![\w./-])(--[a-z][\w-]*)", text.split("\n\n", 1)[0])) - {"--help"}
        for flag in flags:
            assert f"`{flag}" in section, f"fedhop {' '.join(argv)}: {flag} is not in docs/cli.md"
            checked += 1
    assert checked >= 80


def test_run_section_states_each_flag_with_its_help(capsys, monkeypatch):
    """The table row of a flag carries the help text --help prints for it."""
    section = _section(DOC.read_text(), "fedhop run")
    assert re.search(r"^\| `--resume RUN_DIR` \| +\| continue a stopped run from its newest checkpoint \|$", section, re.M)
    assert re.search(r"^\| `--dashboard \[PORT\]` \| +\| serve the live run page on 127\.0\.0\.1:PORT", section, re.M)
    assert "`fedhop run`" in DOC.read_text().split("## fedhop run")[0]   # listed in the command table


def test_generating_the_page_runs_nothing(tmp_path, monkeypatch):
    """Asking each command for its parser must not run it: nothing is written in the folder the
    generator runs in (`fedhop data show` would write partition.png, `examples copy` its files)."""
    monkeypatch.chdir(tmp_path)
    page = clidoc.markdown()
    assert "## fedhop examples" in page and "### fedhop data fetch" in page
    assert list(tmp_path.iterdir()) == []
