"""Where a stop signal ends the server's rounds (common/util/procexit.py `stops_at_waits`): a
SIGINT or SIGTERM that arrives while the main thread computes or holds a lock is only noted, and
the stop is raised at the next wait for replies (`fabric.gather`, `Fabric.call`), at once rather
than at the wait's deadline.  An exception raised by the handler at an arbitrary bytecode can
land inside a `with lock:` and leave the lock held for the shut-down that follows.

Each case runs in a fresh interpreter: the handlers are process-wide and pytest keeps its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from concurrent.futures import Future
    from fedhop.common.util.procexit import Stopped, stop_on_sigterm, stops_at_waits, stops_deferred
    from fedhop.common.transport.fabric import gather

    sig = getattr(signal, sys.argv[1])
    stop_on_sigterm(deferred=True)
    lock = threading.Lock()
    out = {}
    try:
        with stops_at_waits():
            with lock:
                os.kill(os.getpid(), sig)      # delivered at the next bytecode boundary
                total = 0
                for i in range(200_000):       # many boundaries pass while the lock is held
                    total += i
                out["computed"] = total
            with stops_deferred():             # recording a round: a wait there is not a stop point
                out["deferred_wait"] = len(gather({"r": Future()}, 0.3, "timeout")[1])
            started = time.monotonic()
            try:
                gather({"never": Future()}, 60.0, "timeout")
            finally:
                out["waited"] = time.monotonic() - started
    except (KeyboardInterrupt, Stopped) as exc:
        out["raised"] = type(exc).__name__
    out["lock_free"] = not lock.locked()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_is_raised_at_the_next_wait_never_inside_a_computation(tmp_path, sig):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, sig], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["computed"] == sum(range(200_000))      # the computation was not cut
    assert out["lock_free"] is True
    assert out["deferred_wait"] == 1                   # the deferred wait ran to its deadline
    assert out["raised"] == ("KeyboardInterrupt" if sig == "SIGINT" else "Stopped")
    assert out["waited"] < 5.0, out                    # at the wait, not at its 60 s deadline
