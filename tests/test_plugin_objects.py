"""A plug-in reference reaches only code its module defines (issue 44, item 2; red team B6.4).

An allowed module's own imports are not plug-ins: `mymodels:os.system`, where mymodels.py does
`import os`, is refused (common/util/plugins.py `resolve_attribute`), as is every builtin,
imported function or class, inherited method and dunder name; an allow-list entry may name a
single object (`mymodels:make_net`); the object's kind is checked before anything calls it
(`check_kind`), and the options a config passes are bound to its signature first (`check_call`,
common/processors/pipeline.py `_check_options`).  The same rule holds for the server's own config
(`fedhop run` refuses it, exit 2, nothing started) and for a config a client receives from its
parent (it refuses at registration, exit 2).

The user's module (`MYMODELS`) records every call of its code into the file `$CALLS`, so a test
can prove that what it refuses was never called.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.processors import pipeline
from fedhop.common.util import plugins
from tests.helpers import quadratic_config

MYMODELS = '''
import functools
import os
import sys
from functools import partial

import torch
from torch.nn import Linear
from torch.serialization import load


def _record(what):
    with open(os.environ["CALLS"], "a") as fh:
        fh.write(what + "\\n")


class Count:
    """A legitimate processor: one line per message into `path`."""

    def __init__(self, path):
        self.path = path

    def process(self, message, ctx):
        with open(self.path, "a") as fh:
            fh.write(f"{os.getpid()}|{ctx.method}|{ctx.direction}|{ctx.round}\\n")
        return message

    @classmethod
    def make(cls, path):
        return cls(path)


def make_count(path) -> Count:
    return Count(path)


class NotAProcessor:
    def __init__(self, **options):
        _record("NotAProcessor()")


def side_effect(**options):
    _record("side_effect()")


class Factory:
    def build(input_shape, n_outputs):
        return torch.nn.Linear(input_shape[0], n_outputs)

    build = staticmethod(build)
    shell = staticmethod(os.system)


class Net(torch.nn.Module):
    def __init__(self, input_shape, n_outputs):
        super().__init__()
        _record("Net()")
        self.fc = torch.nn.Linear(input_shape[0], n_outputs)


def make_net(input_shape, n_outputs, width=4):
    _record("make_net()")
    return torch.nn.Linear(input_shape[0], n_outputs)


class Runner:
    def __call__(self, *args, **kwargs):
        _record("Runner()")


RUN = Runner()
runner = partial(os.system)
settings = {"shell": os.system}
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    """mymodels.py in a user's folder on the plug-in search path; calls recorded in `calls`."""
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    calls = tmp_path / "calls"
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv(plugins.PLUGIN_PATH_ENV, str(tmp_path))
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    yield calls
    pipeline.unconfigure()
    plugins.unrestricted()
    sys.modules.pop("mymodels", None)


# ----------------------------------------------------------------------------- the resolver
@pytest.mark.parametrize("restricted", [False, True])   # the server's own config, a client allowing mymodels
@pytest.mark.parametrize("ref, group, why", [
    ("mymodels:os.system", "processors", "passes through the module 'os'"),
    ("mymodels:os.popen", "processors", "passes through the module 'os'"),
    ("mymodels:sys.exit", "processors", "passes through the module 'sys'"),
    ("mymodels:torch.load", "models", "passes through the module 'torch'"),
    ("mymodels:functools.partial", "processors", "passes through the module 'functools'"),
    ("mymodels:load", "models", "is a function defined in 'torch.serialization'"),
    ("mymodels:partial", "processors", "is a class defined in 'functools'"),
    ("mymodels:Linear", "models", "is a class defined in 'torch.nn.modules.linear'"),
    ("mymodels:runner", "processors", "is a partial object defined in 'functools'"),
    ("mymodels:Factory.shell", "processors", "is a built-in defined in 'posix'"),
    ("mymodels:Net.load_state_dict", "models", "is a function defined in 'torch.nn.modules.module'"),
    ("mymodels:settings.get", "models", "is a dict object defined in 'builtins' (at 'settings')"),
    ("mymodels:Count.mro", "processors", "is a built-in defined in 'builtins'"),
    ("mymodels:Count.__init__", "processors", "names the special attribute '__init__'"),
    ("mymodels:__builtins__", "models", "names the special attribute '__builtins__'"),
])
def test_an_object_the_module_did_not_define_is_refused_in_one_line(user, restricted, ref, group, why):
    if restricted:
        plugins.restrict(["mymodels"])
    with pytest.raises(plugins.PluginRefused) as exc:
        plugins.load_plugin(ref, group)
    text = str(exc.value)
    assert text.startswith(f"PLUGIN_NOT_ALLOWED: plug-in {ref!r}") and why in text and "\n" not in text, text
    assert "defined in its module 'mymodels'" in text
    assert not user.exists()


def test_objects_the_module_defines_are_admitted(user, tmp_path):
    plugins.restrict(["mymodels"])
    assert plugins.load_plugin("mymodels:Count", "processors").__name__ == "Count"
    assert plugins.load_plugin("mymodels:Count.make", "processors").__self__.__name__ == "Count"   # its classmethod
    assert plugins.load_plugin("mymodels:make_count", "processors").__name__ == "make_count"     # -> Count
    assert plugins.load_plugin("mymodels:make_net", "models").__name__ == "make_net"
    assert plugins.load_plugin("mymodels:Factory.build", "models").__name__ == "build"
    assert plugins.load_plugin("mymodels:Net", "models").__name__ == "Net"
    assert not user.exists()   # resolving calls nothing
    # a package's objects defined in its submodules, re-exported by its __init__
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("import os\nfrom .nets import make\n")
    (tmp_path / "mypkg" / "nets.py").write_text("def make(input_shape, n_outputs):\n    return None\n")
    plugins.restrict(["mypkg"])
    try:
        assert plugins.load_plugin("mypkg:make", "models").__module__ == "mypkg.nets"
        assert plugins.load_plugin("mypkg.nets:make", "models").__name__ == "make"
        with pytest.raises(plugins.PluginRefused, match="passes through the module 'mypkg.nets'"):
            plugins.load_plugin("mypkg:nets.make", "models")   # name it where it is defined: mypkg.nets:make
        with pytest.raises(plugins.PluginRefused, match="passes through the module 'os'"):
            plugins.load_plugin("mypkg:os.system", "models")
    finally:
        for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
            del sys.modules[name]


def test_an_entry_may_name_one_object(user):
    plugins.restrict(["mymodels:make_net", "mymodels:Factory"])
    assert plugins.load_plugin("mymodels:make_net", "models").__name__ == "make_net"
    assert plugins.load_plugin("mymodels:Factory.build", "models").__name__ == "build"   # defined beneath it
    for ref in ("mymodels:Count", "mymodels:make_netx", "mymodels:Net", "mymodels:os.system"):
        with pytest.raises(plugins.PluginRefused, match=f"PLUGIN_NOT_ALLOWED: the config names plug-in '{ref}'"):
            plugins.load_plugin(ref, "processors")
    with pytest.raises(plugins.PluginRefused, match="is a built-in defined in 'posix'"):
        plugins.load_plugin("mymodels:Factory.shell", "processors")   # beneath the entry, but not defined there
    assert not user.exists()


# ----------------------------------------------------------------------------- kind, then signature, then the call
def _entry(name: str, roles: str = '["client"]', **options: str) -> str:
    opts = "".join(f'{k} = "{v}"\n' for k, v in options.items())
    return f'\n[[processors]]\nname = "{name}"\nmethods = ["train"]\ndirection = "out"\nroles = {roles}\n{opts}'


BASE = quadratic_config(np.zeros((3, 2)), np.ones((3, 2)), [4, 4, 4], rounds=2, processes=2, local_steps=1,
                        name="objects")


@pytest.mark.parametrize("name, why", [
    ("mymodels:NotAProcessor", "is a class without a process(message, ctx) method"),
    ("mymodels:side_effect", "is a function that is not known to make a processor"),
    ("mymodels:RUN", "is a Runner without a process(message, ctx) method"),
])
def test_a_callable_that_is_not_a_processor_is_never_called(user, name, why):
    with pytest.raises(ConfigError) as exc:
        parse_config(BASE + _entry(name, flag="x"))
    assert not user.exists(), user.read_text()   # never called
    text = str(exc.value)
    assert text.startswith("config key 'processors[0].name'") and why in text and "\n" not in text, text


def test_options_are_bound_to_the_signature_before_the_call(user):
    with pytest.raises(ConfigError, match=r"config key 'processors\[0\].command': mymodels:Count takes no option "
                                          r"'command' \(its options: path\)"):
        parse_config(BASE + _entry("mymodels:Count", path="c.txt", command="touch MARK"))
    digits = '[data]\ndataset = "digits"\n[model]\nfactory = "{}"\nfactory_args = {}\n[clients]\ncount = 3\n'
    with pytest.raises(ConfigError) as exc:
        parse_config(digits.format("mymodels:make_net", "{depth = 3}"))
    assert str(exc.value).startswith("config key 'model.factory_args': 'mymodels:make_net' does not take") \
        and "depth" in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    with pytest.raises(ConfigError, match="'mymodels:RUN' is not a function or class"):
        parse_config(digits.format("mymodels:RUN", "{}"))   # a callable object: not a model factory
    assert not user.exists()   # neither the factory nor the callable object was called
    assert parse_config(digits.format("mymodels:make_net", "{width = 3}")).model.factory_args == {"width": 3}


# ----------------------------------------------------------------------------- real processes
def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("FEDHOP_TOKEN", plugins.ALLOW_ENV, "FEDHOP_NODE_CRED", plugins.PLUGIN_PATH_ENV, "CALLS")}


def _fedhop_run(folder: Path, config: str, out: str) -> subprocess.CompletedProcess:
    (folder / "exp.toml").write_text(config)
    return subprocess.run([str(Path(sys.executable).parent / "fedhop"), "run", "exp.toml", "--out", out, "--quiet"],
                          cwd=folder, env=_env(), capture_output=True, text=True, timeout=600)


def test_fedhop_run_refuses_os_system_through_an_allowed_module_and_runs_its_processor(tmp_path):
    """`fedhop run` from a user's folder outside the checkout: a [[processors]] entry naming
    `mymodels:os.system` with `command = "touch MARK"` for the clients is exit 2, one line, no
    process started, MARK never made; the module's own processor, for the clients, runs in both
    client processes (which `fedhop run` allows mymodels) on every upload."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "mymodels.py").write_text(MYMODELS)
    done = _fedhop_run(folder, BASE + _entry("mymodels:os.system", roles='["server", "client"]', command="touch MARK"),
                       "runs/evil")
    assert not (folder / "MARK").exists(), "os.system ran the config's command"
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "processors[0].name" in err[0] and "mymodels:os.system" in err[0] \
        and "passes through the module 'os'" in err[0], done.stderr
    assert not (folder / "runs").exists()
    done = _fedhop_run(folder, BASE + _entry("mymodels:Count", path="counts.txt"), "runs/good")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line.split("|") for line in (folder / "counts.txt").read_text().splitlines()]
    assert sorted((m, d, int(r)) for _, m, d, r in lines) == [("train", "out", r) for r in (1, 2) for _ in range(3)]
    assert len({pid for pid, *_ in lines}) == 2   # the two client processes, each its own instance


@pytest.mark.parametrize("name", ["mymodels:os.system", "mymodels:Factory.shell"])
def test_a_client_allowing_the_module_refuses_os_system_at_registration(tmp_path, name):
    """A real client process started with `--allow-plugin mymodels`, told by its parent of a
    config whose processor is `mymodels:os.system` (command = "touch MARK"): it registers,
    refuses the config in one PLUGIN_NOT_ALLOWED line, exits 2, and nothing made MARK."""
    from tests.test_plugin_allowlist import FakeParent
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "mymodels.py").write_text(MYMODELS)
    parent = FakeParent(f'[clients]\ncount = 4\n{_entry(name, command="touch MARK")}')
    env = {**_env(), plugins.PLUGIN_PATH_ENV: str(tmp_path / "plugins"), "CALLS": str(tmp_path / "calls")}
    try:
        proc = subprocess.run([sys.executable, "-m", "fedhop.client", "--parent", parent.address, "--clients", "0-3",
                               "--node-id", "client-proc0", "--allow-plugin", "mymodels"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    finally:
        parent.endpoint.stop(grace=0.1)
    out = proc.stdout
    assert not (tmp_path / "MARK").exists(), "os.system ran the parent's command: " + out
    assert proc.returncode == 2, out
    refusal = [line for line in out.splitlines() if "PLUGIN_NOT_ALLOWED" in line]
    assert len(refusal) == 1 and "processors[0].name" in refusal[0] and name in refusal[0], out
    assert parent.registered and "Traceback" not in out and not (tmp_path / "calls").exists()


def test_a_value_the_module_imported_is_refused_one_it_made_is_admitted(user, tmp_path):
    """A value (no code to call: what `topology.kind` and `transport.kind` may name) is admitted only
    when the allowed module made it: one it imported from another module (a TopologySpec of a module
    off the allow-list, whose driver would then run) is refused in one line naming that module; an
    object made in the module from a class defined elsewhere is admitted, also when the package
    above it re-exports it."""
    pkg = tmp_path / "valsrc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from valsrc.made import MADE\n")
    (pkg / "elsewhere.py").write_text("class Entry:\n    pass\n\n\nENTRY = Entry()\n")
    (pkg / "allowed.py").write_text("from valsrc import elsewhere\nfrom valsrc.elsewhere import ENTRY\n\n"
                                    "OWN = elsewhere.Entry()\nALIAS = ENTRY\n")
    (pkg / "made.py").write_text("from valsrc import elsewhere\n\nMADE = elsewhere.Entry()\n")
    plugins.restrict(["valsrc.allowed", "valsrc.made"])
    try:
        for ref in ("valsrc.allowed:ENTRY", "valsrc.allowed:ALIAS"):
            for group in ("topologies", "transports"):
                with pytest.raises(plugins.PluginRefused) as exc:
                    plugins.load_plugin(ref, group)
                text = str(exc.value)
                assert "module 'valsrc.elsewhere' holds too" in text and "\n" not in text, text
        assert type(plugins.load_plugin("valsrc.allowed:OWN", "transports")).__name__ == "Entry"
        assert type(plugins.load_plugin("valsrc.made:MADE", "topologies")).__name__ == "Entry"
    finally:
        for name in [m for m in sys.modules if m == "valsrc" or m.startswith("valsrc.")]:
            del sys.modules[name]
