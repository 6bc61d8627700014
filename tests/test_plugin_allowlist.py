"""Clients and edges run only the code they were started with (issue 26, item 5; DESIGN.md
section 9): a plug-in named by the parent's config but not on the process's allow-list
(`--allow-plugin`, FEDHOP_ALLOW_PLUGINS) is refused before anything is imported."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedhop.common.config import parse_config
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.util import plugins
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger

# a plug-in package whose import leaves a mark: the proof that its code ran
EVIL = '''
import os, pathlib
pathlib.Path(os.environ["EVIL_MARK"]).write_text("imported")
import torch
def make_net(input_shape, n_outputs, **kw):
    return torch.nn.Linear(input_shape[0], n_outputs)
'''
CONFIG = """
[run]
name = "allow"
rounds = 1
[topology]
kind = "{kind}"
{edges}
[data]
dataset = "digits"
[model]
factory = "evilpkg:make_net"
[clients]
count = 4
"""


@pytest.fixture
def evil(tmp_path, monkeypatch):
    folder = tmp_path / "plugins"
    (folder / "evilpkg").mkdir(parents=True)
    (folder / "evilpkg" / "__init__.py").write_text(EVIL)
    mark = tmp_path / "mark"
    monkeypatch.setenv(plugins.PLUGIN_PATH_ENV, str(folder))
    monkeypatch.setenv("EVIL_MARK", str(mark))
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    yield mark
    plugins.unrestricted()
    sys.modules.pop("evilpkg", None)


def test_a_plugin_off_the_allow_list_is_refused_before_its_import(evil):
    plugins.restrict(["mymodels", "other.pkg"])
    with pytest.raises(plugins.PluginRefused, match="PLUGIN_NOT_ALLOWED.*evilpkg:make_net.*--allow-plugin evilpkg"):
        plugins.load_plugin("evilpkg:make_net", "models")
    assert not evil.exists() and "evilpkg" not in sys.modules
    with pytest.raises(plugins.PluginRefused):   # a prefix of an allowed name is not that name
        plugins.load_plugin("mymodelsx:make", "models")
    with pytest.raises(plugins.PluginRefused):
        plugins.load_plugin("other:make", "models")
    plugins.restrict(["evilpkg"])
    assert callable(plugins.load_plugin("evilpkg:make_net", "models")) and evil.exists()


def test_the_allow_list_comes_from_flags_and_the_environment():
    assert plugins.allow_list_from(["a,b", " c "], env="d, a") == ["a", "b", "c", "d"]
    assert plugins.allow_list_from([], env="") == []


def test_the_launcher_allows_what_its_own_config_names(evil):
    cfg = parse_config(CONFIG.format(kind="star", edges=""))
    assert plugins.config_plugins(cfg) == ["evilpkg"]
    plain = parse_config(CONFIG.format(kind="star", edges="").replace('factory = "evilpkg:make_net"', ""))
    assert plugins.config_plugins(plain) == []   # built-ins are not plug-ins


class FakeParent:
    """A parent (the server's role) whose registration reply carries a config naming a plug-in."""

    def __init__(self, config: str) -> None:
        self.endpoint = GrpcEndpoint("server", Ledger())
        self.registered: list[str] = []

        def register(req: pb.RegisterRequest) -> pb.RegisterReply:
            self.registered.append(req.node_id)
            return pb.RegisterReply(accepted=True, run_id="allow-1", config_toml=config, node_id="server")

        self.address = self.endpoint.serve(lambda request: None, "127.0.0.1:0", register_handler=register)


def _start(role: str, address: str, mark: Path, tmp: Path, extra: list[str]) -> subprocess.Popen:
    args = (["--clients", "0-3", "--node-id", "client-proc0"] if role == "client" else ["--node-id", "edge-0"])
    env = {k: v for k, v in os.environ.items() if k not in ("FEDHOP_TOKEN", plugins.ALLOW_ENV, "FEDHOP_NODE_CRED")}
    env.update(EVIL_MARK=str(mark), **{plugins.PLUGIN_PATH_ENV: str(tmp / "plugins")})
    return subprocess.Popen([sys.executable, "-m", f"fedhop.{role}", "--parent", address, *args, *extra], cwd=tmp,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("role", ["client", pytest.param("edge", marks=pytest.mark.slow)])   # one code path
def test_a_parent_config_naming_another_plugin_is_refused_never_imported(evil, tmp_path, role):
    kind, edges = ("hierarchical", "edges = 1") if role == "edge" else ("star", "")
    parent = FakeParent(CONFIG.format(kind=kind, edges=edges))
    try:
        proc = _start(role, parent.address, evil, tmp_path, ["--allow-plugin", "mymodels"])
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 2, out
        refusal = [line for line in out.splitlines() if "PLUGIN_NOT_ALLOWED" in line]
        assert len(refusal) == 1 and "evilpkg:make_net" in refusal[0] and "Traceback" not in out, out
        assert parent.registered and not evil.exists()   # it registered, read the config, imported nothing
        # the same process started with the plug-in on its allow-list runs it
        proc = _start(role, parent.address, evil, tmp_path, ["--allow-plugin", "evilpkg"])
        try:
            deadline = time.monotonic() + 180
            while not evil.exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.communicate()
    finally:
        parent.endpoint.stop(grace=0.1)
