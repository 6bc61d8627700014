"""Starting the processes of a local run by `os.fork()` from the launcher.

`fedhop run` has imported torch before it starts anything (validating the config imports the
algorithms). A child made with `python -m fedhop.server` imports it again: on this 2-core machine the
server and two client processes importing torch at once take about 2.5 s before the first
round. A forked child already has those modules, so it starts in a few milliseconds. It is
still its own OS process: its own address space, sockets, gRPC server, log file and exit
status; only the already-imported Python modules come from the launcher.

The child is made to look like `python -m MODULE ARGS` started with `env` in `cwd`: stdout and
stderr go to the log file, the environment is replaced, glibc's malloc is tuned the way the
environment variables would tune a fresh process (`deploy/launch/malloc.py`; glibc reads those only at
start), inherited atexit handlers and logging handlers are dropped, and it dies with its parent.

Forking is safe only from a process that has run no torch computation and no gRPC: a child
of a process that used torch's OpenMP thread pool hangs in its first parallel operation
(measured here), and gRPC's threads and polling state do not survive a fork. So a process
opts in with `allow_fork()`: `fedhop run` does, before it loads anything, because it only
validates the config and starts its children (the in-process engine forks its worker processes
by the same rule, having built only the run's data with one torch thread, which starts no thread
pool: deploy/launch/workers.py `can_fork`, `SharedTask`).
Everywhere else (a test, a benchmark, a user's
script calling the launcher) children are exec'd as before, and so are they once grpc is
imported. `FEDHOP_START=exec` asks for exec always.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from fedhop.common.util.procexit import (
    Stopped,
    die_with,
    exit_code,
    exit_now,
    forget_stops,
    freeze_inherited,
    stop_reason,
)
from fedhop.common.util.proctitle import prepare as prepare_title
from fedhop.deploy.launch.malloc import TUNED_MALLOC_ENV

# glibc's mallopt parameters for the environment variables in TUNED_MALLOC_ENV (malloc.h)
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}


_OPTED_IN = False


def allow_fork() -> None:
    """Declare that this process runs no torch computation and no gRPC before it starts its
    run's children, so it may fork them (module docstring). `fedhop run` calls it."""
    global _OPTED_IN
    _OPTED_IN = True


def fork_allowed() -> bool:
    """True where this process may fork its run's children: it opted in (`allow_fork`), runs
    on Linux, has not imported grpc, and FEDHOP_START is not 'exec'."""
    return (_OPTED_IN and sys.platform == "linux" and "grpc" not in sys.modules
            and os.environ.get("FEDHOP_START", "fork") != "exec")


class ForkedProcess:
    """A forked child, with the `subprocess.Popen` calls the launcher and tests use (pid,
    returncode, poll, wait, send_signal, terminate, kill)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:   # reaped by someone else: its status is gone
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if timeout is not None and deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_module(module: str, args: list[str], env: dict[str, str], log: Path, cwd: Path) -> ForkedProcess:
    """`python -m module *args` as a forked child writing stdout and stderr to `log`."""
    _flush_parent_output()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid, [sys.executable, "-m", module, *args])
    # the child: never returns into the launcher's code, and never runs the launcher's atexit
    # handlers (temporary directories, ...), however it ends
    atexit._clear()
    code = 1
    try:
        code = _run_child(module, args, env, log, cwd, parent)
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException as exc:   # noqa: BLE001 - a child's crash is reported in its log, as Python would
        stop = _stop_behind(exc)
        if stop is not None:   # a stop before the module handles its own: one line, 128 + N
            reason, code = stop_reason(stop)
            print(f"fedhop: `python -m {module}` {reason} while starting", file=sys.stderr)
        else:
            traceback.print_exc()
            code = 1
    finally:
        exit_now(code)   # ends the child: fork_module returns only in the parent


def _stop_behind(exc: BaseException) -> KeyboardInterrupt | Stopped | None:
    """The stop (Ctrl-C, a stop signal) that `exc` is or was directly caused by: Python reports a
    KeyboardInterrupt that lands while a class is being made (a dataclass's fields, on import) as
    the RuntimeError it caused."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (KeyboardInterrupt, Stopped)):
            return seen
        seen = seen.__cause__
    return None


def _run_child(module: str, args: list[str], env: dict[str, str], log: Path, cwd: Path, parent: int) -> int:
    die_with(parent)
    freeze_inherited()   # the launcher's objects out of the collector's walks (common/util/procexit.py)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    print(f"fedhop: `python -m {module}` forked from the launcher (pid {parent})", file=sys.stderr)
    os.chdir(cwd)
    prepare_title()   # before the environment is replaced (common/util/proctitle.py)
    os.environ.clear()
    os.environ.update(env)
    tune_malloc(env)
    logging.root.handlers.clear()   # the module's own logging set-up applies, as in a fresh process
    # as an exec'd Python: Ctrl-C raises KeyboardInterrupt, unless the launcher ignores SIGINT (a
    # background job's): the child then ignores it too, as a child inherits an ignored signal
    # across exec
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    forget_stops()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _flush_parent_output() -> None:
    """Empty the launcher's output buffers before forking, so that the child, which inherits
    them, cannot write them a second time when it flushes its own on exit."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            handler.flush()


def tune_malloc(env: dict[str, str]) -> dict[str, bool]:
    """mallopt() the TUNED_MALLOC_ENV settings that `env` holds, as glibc would from the
    environment at process start. Returns {variable: accepted by glibc}; a refusal is printed."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return {}
    accepted = {}
    for key in TUNED_MALLOC_ENV:
        value = env.get(key, "")
        if value.isdigit():
            accepted[key] = libc.mallopt(_MALLOPT[key], min(int(value), 2**31 - 1)) == 1   # takes a C int
            if not accepted[key]:
                print(f"fedhop: glibc refused {key}={value}", file=sys.stderr)
    return accepted
