"""One start-up routine for the role processes (issue 46, item 5; common/transport/startup.py).

A client process and an edge go through the same set-up, so they refuse the same bad input the
same way: one logged line, exit status 2, and nothing written (their ledger is made only once
their parent, device and credentials are good).  Run as users run them, `python -m
fedhop.client | edge` from a folder outside the checkout with relative paths.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.transport.startup import publish_address

ROLES = {"client": ["--clients", "0-2"], "edge": ["--node-id", "edge-0"]}


def start(role: str, folder: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", f"fedhop.{role}", *ROLES[role], "--ledger-dir", "ledgers", *flags]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120)


def errors(done: subprocess.CompletedProcess) -> list[str]:
    return [line.split(" ERROR ", 1)[1] for line in done.stderr.splitlines() if " ERROR " in line]


@pytest.mark.parametrize("flags,why", [
    (("--parent", "10.1.2.3:9"), "refusing to start: plaintext gRPC to or on a non-loopback address (10.1.2.3:9)"),
    (("--parent-file", "parent.address"), "--parent-file parent.address: expected HOST:PORT, found 'nowhere'"),
    (("--parent", "127.0.0.1:9", "--mtls"), "mutual TLS needs a certificate directory"),
])
def test_child_roles_refuse_bad_set_up_alike_with_one_line_and_exit_2(tmp_path, flags, why):
    (tmp_path / "parent.address").write_text("nowhere\n")
    said = {}
    for role in ROLES:
        done = start(role, tmp_path, *flags)
        assert done.returncode == 2, done.stderr[-2000:]
        said[role] = errors(done)
        assert len(said[role]) == 1 and said[role][0].startswith(why), done.stderr[-2000:]
        assert not (tmp_path / "ledgers").exists()   # refused before its ledger was made
    assert said["client"] == said["edge"]   # one routine: the same line


def test_the_address_is_published_whole(tmp_path):
    target = tmp_path / "server.address"
    publish_address(str(target), "127.0.0.1:5050")
    assert target.read_text() == "127.0.0.1:5050"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.address"]   # the temporary file was renamed
    publish_address("", "127.0.0.1:5051")   # no --port-file: nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.address"]
