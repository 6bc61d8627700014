"""A hosts file's strings never become shell code or ssh options (issue 26, item 7;
deploy/launch/hosts.py): `env` names must be shell names and their values reach the remote shell
verbatim; an ssh target that starts with '-' or holds whitespace or a control character is a
one-line error, exit 2, before any process starts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import parse_config
from fedhop.deploy.launch.hosts import hosts_from_dict, plan_roles, role_command
from fedhop.deploy.launch.hosts import main as launch_main

CFG = '[run]\nname = "q"\nrounds = 1\n[clients]\ncount = 2\n'


def _hosts_toml(host_lines: str) -> str:
    return ('[launch]\nworkdir = "."\n\n[[host]]\nname = "h1"\naddress = "127.0.0.1"\nserver = true\n'
            'clients = "0-1"\n' + host_lines)


def _launch_dry_run(tmp_path: Path, host_lines: str) -> subprocess.CompletedProcess:
    """`fedhop launch hosts.toml exp.toml --dry-run` from tmp_path, as a process."""
    (tmp_path / "hosts.toml").write_text(_hosts_toml(host_lines))
    (tmp_path / "exp.toml").write_text(CFG)
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "launch", "hosts.toml", "exp.toml", "--dry-run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _launch_main(tmp_path: Path, monkeypatch, capsys, host_lines: str) -> tuple[int, str, str]:
    """The same, in this process (hosts.main): (status, stdout, stderr)."""
    (tmp_path / "hosts.toml").write_text(_hosts_toml(host_lines))
    (tmp_path / "exp.toml").write_text(CFG)
    monkeypatch.chdir(tmp_path)
    status = launch_main(["hosts.toml", "exp.toml", "--dry-run"])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("host_lines,needle", [
    ('[host.env]\n"X=1; touch pwned; Y" = "v"\n', "env key"),
    ('[host.env]\n"A B" = "v"\n', "env key"),
    ('[host.env]\n"9LIVES" = "v"\n', "env key"),
    ('[host.env]\nOK = ["a", "b"]\n', "env.OK"),
    ('target = "-oProxyCommand=touch pwned"\n', "starts with '-'"),
    ('target = "alice@host -oProxyCommand=x"\n', "whitespace"),
    ('target = "alice@host\\u0007"\n', "control character"),
])
def test_a_hosts_string_that_would_run_as_code_is_a_one_line_error(tmp_path, monkeypatch, capsys, host_lines,
                                                                   needle):
    status, out, err = _launch_main(tmp_path, monkeypatch, capsys, host_lines)
    assert status == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "hosts.toml" in lines[0], err
    assert out == "" and not (tmp_path / "pwned").exists()


def test_a_hostile_target_exits_2_from_the_command_line(tmp_path):
    """As a process: exit 2, one line, no traceback."""
    res = _launch_dry_run(tmp_path, 'target = "-oProxyCommand=touch pwned"\n')
    assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
    assert res.stderr.count("\n") == 1 and "host[0].target = '-oProxyCommand=touch pwned'" in res.stderr
    assert not (tmp_path / "pwned").exists()


def test_a_name_used_as_the_target_is_checked_too(tmp_path, monkeypatch, capsys):
    status, _, err = _launch_main(tmp_path, monkeypatch, capsys, "")
    assert status == 0, err   # the plain file launches
    (tmp_path / "hosts.toml").write_text(_hosts_toml("").replace('name = "h1"', 'name = "-h1"'))
    assert launch_main(["hosts.toml", "exp.toml", "--dry-run"]) == 2
    assert "host[0].name = '-h1'" in capsys.readouterr().err


HOSTILE = "x'; touch pwned1; echo '$(touch pwned2)`touch pwned3`\" \\ $HOME"


def test_env_values_reach_the_remote_shell_verbatim(tmp_path):
    """The role's command run by sh, its final `exec python ...` replaced by `exec env`: each value
    arrives as written and no file is made."""
    import tomllib
    hf = hosts_from_dict(tomllib.loads(_hosts_toml(f'[host.env]\nWEIRD = {json.dumps(HOSTILE)}\nN = 3\n')))
    cfg = parse_config(CFG)
    role = plan_roles(hf, cfg)[1]   # a client process
    command = role_command(hf, role, cfg, "runs/r")
    prefix, _, last = command.rpartition(" && ")
    assert last.startswith("exec ")
    res = subprocess.run(["sh", "-c", prefix + " && exec env"], cwd=tmp_path, input="cred\nca\n.\ncert\n.\nkey\n.\n",
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    env = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    assert env["WEIRD"] == HOSTILE and env["N"] == "3" and "FEDHOP_TOKEN" not in env
    assert env["FEDHOP_NODE_CRED"] == "cred"     # the role's own credential, the first line
    assert not any((tmp_path / f"pwned{i}").exists() for i in (1, 2, 3))
