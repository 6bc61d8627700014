"""deploy/launch/forkstart.py: a forked child behaves as `python -m MODULE` would, and the launcher's
own state (atexit handlers, environment, stdout) stays the launcher's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.deploy.launch.forkstart import ForkedProcess, _stop_behind, tune_malloc
from fedhop.deploy.launch.malloc import TUNED_MALLOC_ENV

REPO = Path(__file__).resolve().parents[1]

PROBE = '''
import gc, json, os, sys, time
mode = sys.argv[1]
print("probe stdout line")
print("probe stderr line", file=sys.stderr)
if mode == "sleep":
    time.sleep(60)
if mode == "crash":
    raise ValueError("probe crashed on purpose")
with open(sys.argv[2], "w") as fh:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
               "env_probe": os.environ.get("PROBE_VALUE"), "env_parent_only": os.environ.get("PARENT_ONLY"),
               "name": __name__, "frozen": gc.get_freeze_count()}, fh)
sys.exit(3)
'''

LAUNCHER = '''
import atexit, gc, json, os, signal, subprocess, sys
from pathlib import Path
from fedhop.deploy.launch.forkstart import allow_fork, fork_allowed, fork_module
tmp = Path({tmp!r})
assert not fork_allowed()   # not without opting in
allow_fork()
os.environ["PARENT_ONLY"] = "launcher"
atexit.register(lambda: (tmp / "parent-atexit-ran").write_text(str(os.getpid())))
assert fork_allowed()
env = {{"PROBE_VALUE": "from-env", "PATH": os.environ.get("PATH", "")}}
out = {{"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}}
done = fork_module("probe", ["write", str(tmp / "probe.json")], env, tmp / "write.log", tmp)
out["write_rc"] = done.wait(30)
out["atexit_after_child"] = (tmp / "parent-atexit-ran").exists()
crash = fork_module("probe", ["crash"], env, tmp / "crash.log", tmp)
out["crash_rc"] = crash.wait(30)
sleeper = fork_module("probe", ["sleep"], env, tmp / "sleep.log", tmp)
try:
    sleeper.wait(0.2)
    out["timeout_raised"] = False
except subprocess.TimeoutExpired:
    out["timeout_raised"] = True
sleeper.terminate()
out["sleep_rc"] = sleeper.wait(30)
out["launcher_pid"] = os.getpid()
print(json.dumps(out))
'''


@pytest.mark.skipif(sys.platform != "linux", reason="the launcher forks on Linux only")
def test_forked_child_is_its_own_process_and_leaves_the_launchers_state_alone(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    script = LAUNCHER.format(repo=str(REPO), tmp=str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "FEDHOP_START"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    probe = json.loads((tmp_path / "probe.json").read_text())
    # its own process, a child of the launcher, run as __main__ with the given argv, cwd and environment
    assert probe["pid"] != out["launcher_pid"] and probe["ppid"] == out["launcher_pid"]
    assert probe["name"] == "__main__" and probe["argv"] == ["write", str(tmp_path / "probe.json")]
    assert probe["cwd"] == str(tmp_path)
    assert probe["env_probe"] == "from-env" and probe["env_parent_only"] is None
    # sys.exit(3) is its exit status; the launcher's atexit handler ran only when the launcher exited
    assert out["write_rc"] == 3
    # what it inherited from the launcher is out of the collector's view from its start (the
    # launcher froze nothing): a collection of the role's own would otherwise walk all of it
    assert out["frozen"] == 0 and probe["frozen"] >= 0.9 * out["tracked"] > 0
    assert out["atexit_after_child"] is False
    assert (tmp_path / "parent-atexit-ran").read_text() == str(out["launcher_pid"])
    # stdout and stderr went to the child's log, not to the launcher's stdout
    log = (tmp_path / "write.log").read_text()
    assert "probe stdout line" in log and "probe stderr line" in log
    assert "probe stdout line" not in done.stdout
    # a crash is status 1 with its traceback in the log; terminate is -SIGTERM; wait times out
    assert out["crash_rc"] == 1
    assert "ValueError: probe crashed on purpose" in (tmp_path / "crash.log").read_text()
    assert out["timeout_raised"] is True and out["sleep_rc"] == -15


@pytest.mark.parametrize("setting, expected", [("", True), ("exec", False)])
def test_fork_is_refused_once_grpc_is_imported_or_exec_is_asked_for(setting: str, expected: bool) -> None:
    code = ("from fedhop.deploy.launch.forkstart import allow_fork, fork_allowed; "
            "allow_fork(); a = fork_allowed(); import grpc; print(a, fork_allowed())")
    env = dict(os.environ, FEDHOP_START=setting)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(expected and sys.platform == "linux"), "False"]


def test_forked_process_reports_a_child_reaped_elsewhere() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()   # reaped here: the ForkedProcess view of the same pid cannot read a status
    assert ForkedProcess(child.pid, ["x"]).poll() == 255


@pytest.mark.skipif(sys.platform != "linux", reason="glibc")
def test_malloc_tuning_is_accepted_by_glibc() -> None:
    code = ("import json; from fedhop.deploy.launch.forkstart import tune_malloc; "
            "from fedhop.deploy.launch.malloc import TUNED_MALLOC_ENV; print(json.dumps(tune_malloc(dict(TUNED_MALLOC_ENV))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout) == {key: True for key in TUNED_MALLOC_ENV}
    assert tune_malloc({"MALLOC_TOP_PAD_": "not-a-number"}) == {}


def test_a_stop_that_lands_while_a_class_is_made_is_a_stop():
    """Python reports a KeyboardInterrupt raised while a dataclass's fields are set up (on a
    forked child's imports) as the RuntimeError it caused: the child still reports a stop, not
    a crash; an error of its own is not one."""
    from dataclasses import dataclass, field


    class Interrupting:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    with pytest.raises(RuntimeError) as caught:
        @dataclass
        class Made:
            value: int = field(default=0)
            hook: object = Interrupting()
    assert isinstance(_stop_behind(caught.value), KeyboardInterrupt)
    assert _stop_behind(RuntimeError("its own")) is None
    assert _stop_behind(ValueError("wrapped")) is None
