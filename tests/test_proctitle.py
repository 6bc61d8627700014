"""Each role process names itself (issue 18, item 5): /proc/PID/cmdline reads `fedhop server <run>`,
`fedhop edge edge-0`, `fedhop client client-proc0 [0-3]`, whether the launcher forked or exec'd it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from fedhop.deploy.launch.launcher import registration_complete
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_role_titles_in_proc_cmdline(tmp_path, start):
    rng = np.random.default_rng(0)
    centers, curv = rng.normal(size=(8, 3)), rng.uniform(0.5, 2, size=(8, 3))
    text = quadratic_config(centers, curv, [1] * 8, rounds=100000, processes=2,
                            topology='kind = "hierarchical"\nedges = 1')
    cfg = tmp_path / "h.toml"
    cfg.write_text(text)
    out = tmp_path / "run"
    env = dict(os.environ, FEDHOP_START=start)
    launcher = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", str(cfg), "--out", str(out),
                                 "--quiet"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not registration_complete(out / "run.db"):
            assert launcher.poll() is None, launcher.stdout.read().decode()
            assert time.monotonic() < deadline, "the run did not register its processes in 120 s"
            time.sleep(0.1)
        titles = sorted(_cmdline(p.pid) for p in psutil.Process(launcher.pid).children())
        assert titles == ["fedhop client client-proc0 [0-3]", "fedhop client client-proc1 [4-7]",
                          "fedhop edge edge-0", f"fedhop server {out.name}"]
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
