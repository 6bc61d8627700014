"""`fedhop examples` (deploy/cli/examples.py): the example configs ship inside the package, are listed
with their first comment line, and are copied into a user's folder with the files they reference,
never over a file the user has.  Run as the command a user types, from a folder outside the checkout;
tests/test_installed.py runs the copy from an installed wheel."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FEDHOP = [sys.executable, "-m", "fedhop.deploy.cli.cli", "examples"]


def examples(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*FEDHOP, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def shipped() -> set[str]:
    """Every example in the checkout, by the name `fedhop examples` gives it (computed from the
    folder, not from the command)."""
    names = {str(p.relative_to(ROOT / "examples").with_suffix("")) for p in (ROOT / "examples").rglob("*.toml")
             if "plugin" not in p.relative_to(ROOT / "examples").parts}
    return names | {"plugin"}


def test_the_list_names_every_example_with_its_first_comment_line(tmp_path):
    res = examples(cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    listed = {line.split()[0].rstrip("/"): line for line in res.stdout.splitlines() if line and "  " in line}
    assert set(listed) == shipped()
    first = next(line for line in (ROOT / "examples" / "fedavg_digits.toml").read_text().splitlines())
    assert first.lstrip("# ") in listed["fedavg_digits"]


def test_copy_writes_the_same_bytes_and_brings_a_sweeps_base_config(tmp_path):
    res = examples("copy", "fedavg_digits", "claims/fedli_tuning", "plugin", "--to", "exp", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    exp = tmp_path / "exp"
    assert (exp / "fedavg_digits.toml").read_bytes() == (ROOT / "examples" / "fedavg_digits.toml").read_bytes()
    spec = exp / "claims" / "fedli_tuning.toml"
    assert spec.read_bytes() == (ROOT / "examples" / "claims" / "fedli_tuning.toml").read_bytes()
    base = (spec.parent / tomllib.loads(spec.read_text())["sweep"]["config"]).resolve()
    assert base == (exp / "fedavg_digits.toml").resolve()
    plugin = {str(p.relative_to(exp)) for p in (exp / "plugin").rglob("*") if p.is_file()}
    want = {str(p.relative_to(ROOT / "examples")) for p in (ROOT / "examples" / "plugin").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert plugin == want
    assert "next: fedhop run exp/fedavg_digits.toml" in res.stderr


def test_copy_never_replaces_a_file_and_writes_nothing_then(tmp_path):
    (tmp_path / "fedavg_digits.toml").write_text("mine\n")
    res = examples("copy", "hierfavg_digits", "fedavg_digits", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "fedavg_digits.toml exists" in res.stderr and "--force" in res.stderr
    assert (tmp_path / "fedavg_digits.toml").read_text() == "mine\n"
    assert not (tmp_path / "hierfavg_digits.toml").exists()          # all or nothing
    res = examples("copy", "fedavg_digits", "--force", cwd=tmp_path)
    assert res.returncode == 0
    assert (tmp_path / "fedavg_digits.toml").read_bytes() == (ROOT / "examples" / "fedavg_digits.toml").read_bytes()


@pytest.mark.parametrize("name, hint", [("fedavg_digit", "fedavg_digits"), ("plugins", "plugin"),
                                        ("claims/fedli_tunning", "claims/fedli_tuning")])
def test_an_unknown_name_is_one_line_with_a_hint(tmp_path, name, hint):
    res = examples("copy", name, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert f"no example named '{name}' (did you mean '{hint}'?)" in res.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("to, said", [("mine.toml", "--to mine.toml: a file, not a folder"),
                                      ("mine.toml/sub", "mine.toml is a file, so no folder can be made under it")])
def test_copy_to_a_file_is_one_line_naming_it(tmp_path, to, said):
    (tmp_path / "mine.toml").write_text("mine\n")
    res = examples("copy", "fedavg_digits", "--to", to, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and said in res.stderr, res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.toml"] and (tmp_path / "mine.toml").read_text() == "mine\n"


@pytest.mark.parametrize("setup, to, said", [
    ("folder", "d", "d/fedavg_digits.toml is a folder, not a file; --force replaces files only"),
    ("dangling_file", "d", "d/fedavg_digits.toml is a link to nothing"),
    ("dangling_to", "link", "link is a link to nothing, so link/hosts.toml cannot be made under it"),
    ("", "", "--to '': name a folder"),
])
def test_copy_with_force_refuses_what_it_cannot_replace_before_writing_any_file(tmp_path, setup, to, said):
    """`copy hosts fedavg_digits --force` where one target is a folder (or a link to nothing) wrote
    hosts.toml and then failed with a bare errno line: now one line naming the target, exit 2,
    and no file of the copy written."""
    (tmp_path / "d").mkdir()
    if setup == "folder":
        (tmp_path / "d" / "fedavg_digits.toml").mkdir()
    elif setup == "dangling_file":
        (tmp_path / "d" / "fedavg_digits.toml").symlink_to(tmp_path / "nowhere")
    elif setup == "dangling_to":
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    res = examples("copy", "hosts", "fedavg_digits", "--to", to, "--force", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and said in res.stderr, res.stderr
    assert "Errno" not in res.stderr and not (tmp_path / "d" / "hosts.toml").exists()
    assert not (tmp_path / "hosts.toml").exists() and not (tmp_path / "nowhere").exists()
