"""Leaving a process quickly once its work is done.

A process that has imported torch spends 0.3 to 0.7 s in interpreter finalization at exit
(measured here: `python -c "import torch"` against the same with `os._exit(0)`), and a gRPC
server's worker threads are joined first. Every record a fedhop process keeps is already on
disk when its main returns: run.db commits per transaction, ledger files flush per record,
summaries and models are written and closed. So the process entry points flush what is left
(atexit handlers, logging, stdio) and leave with `os._exit`.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Iterable, Iterator, NoReturn


def exit_now(code: int | None) -> NoReturn:
    """Run atexit handlers, flush logs and stdio, then end the process with `code` (None: 0)."""
    status = 0 if code is None else int(code)
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(status)


def exit_code(exc: SystemExit) -> int:
    """The status `sys.exit(x)` asks for: None is 0, an int is itself, anything else is printed
    to stderr and is 1 (as the interpreter does)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


LAUNCHER_ENV = "FEDHOP_DIE_WITH"   # the pid of the launcher an exec'd child dies with


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux PR_SET_PDEATHSIG)."""
    if sys.platform != "linux":
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)   # PR_SET_PDEATHSIG, SIGTERM
    except OSError:
        pass


def die_with(parent: int) -> None:
    """Die with process `parent`, which started this one; if it is gone already (it died before
    the prctl took effect), exit now."""
    die_with_parent()
    if os.getppid() != parent:
        exit_now(1)


def die_with_launcher() -> None:
    """The first step of a child a launcher exec'd with LAUNCHER_ENV set (`fedhop run`'s roles, a
    sweep's runs): die with that launcher.  Done in the child rather than between fork and exec
    (`preexec_fn`): a `preexec_fn` makes Python fork instead of vfork, and a fork runs gRPC's fork
    handlers in the child, whose poller then aborts on the fds the exec closes (common/__init__.py)."""
    parent = os.environ.pop(LAUNCHER_ENV, "")
    if parent.isdigit():
        die_with(int(parent))


#: net allocations between two young-generation collections in a role process (CPython's own: 700)
YOUNG_COLLECTION_EVERY = 50_000


def freeze_inherited() -> None:
    """In a forked child as it starts (a role forked by the launcher, a worker of the in-process
    engine): what it inherited from its parent (torch, fedhop, the parent's objects) out of the
    garbage collector's view, without a collection first.  A collection would walk and write every
    inherited object's header, copying those pages from the parent (fork's copy-on-write), and
    without the freeze every later full collection walks them again: 92-193 ms each in a worker of
    the 1,000,000-client in-process run (docs/performance.md).  The child's own `freeze_heap`
    then walks only what it made."""
    gc.freeze()


def freeze_heap() -> tuple[int, int, int]:
    """Take every object alive now (the imported modules, torch, the task's data) out of the
    garbage collector's view (`gc.freeze`): a full collection then walks only what the run
    allocates since.  A role calls it once its set-up is done.  Without it a 100 MB send spent
    about 15 ms a call in full collections (docs/performance.md, native profile).

    The young generation is collected every `YOUNG_COLLECTION_EVERY` net allocations instead of
    every 700: a round's messages free themselves by reference counting (their paths make no
    reference cycles; tests/test_batch.py checks a batch's), so a pass finds nothing to free
    and only moves a round's live requests, futures and replies into older generations, which
    later passes walk again.  A 1,000-sampled round's server spent 37 ms a round in collections at
    700 and 5 ms at 50,000 (docs/performance.md).  Returns the collector's thresholds before."""
    gc.collect()
    gc.freeze()
    before = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, *before[1:])
    return before



class Stopped(BaseException):
    """The process was asked to stop (SIGTERM: `docker compose down`, a Kubernetes eviction, a
    scheduler's time limit, the launcher after Ctrl-C).  A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


# the stop signals this process received since its handlers were installed (`raise_if_stopped`)
_STOPS: list[int] = []


class _StopState:
    """How the handlers of `stop_on_sigterm` act on a signal now.  `deferred`: the signal is
    only noted (the process is in a part that must not be cut: set-up before the run's records
    exist, shutting children down, finalize); `raised`: an exception was raised for a stop
    already, and later signals are only noted, so that the code recording that stop is not cut
    by a second one (a second Ctrl-C, the launcher's SIGINT after the terminal's)."""
    deferred = False
    raised = False
    at_waits = False   # `stops_at_waits`: a noted stop is raised where the main thread waits (`stop_point`)


def stop_on_sigterm(deferred: bool = False) -> None:
    """Raise `Stopped` in the main thread at a SIGTERM, KeyboardInterrupt at a SIGINT (unless
    SIGINT is ignored, a background job's, or has a handler of the caller's), so the process
    can record how it ended.  The exception is raised once: later signals are noted only (SIGKILL
    still ends the process at once).  With `deferred`, or inside `stops_deferred`, a signal is
    noted and nothing is raised until the next `raise_if_stopped` (or `stops_at_waits`) outside a
    deferred part.  Installed again (a process that deferred its stops from its first line),
    the stops noted so far stay noted.  Signal handlers are the main thread's: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not _on_stop:   # installed again: what was noted stays
        _STOPS.clear()
        _StopState.raised = False
    _StopState.deferred = deferred
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_stop):
        signal.signal(signal.SIGINT, _on_stop)
    signal.signal(signal.SIGTERM, _on_stop)


def _on_stop(signum: int, frame: object) -> None:
    """The SIGINT and SIGTERM handler of `stop_on_sigterm`."""
    _STOPS.append(signum)
    if _StopState.deferred or _StopState.raised:
        return
    _StopState.raised = True
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


def stop_noted() -> int | None:
    """The first stop signal noted and not yet handled (`ignore_stops`), or None."""
    return _STOPS[0] if _STOPS else None


def forget_stops() -> None:
    """Start with no stop noted, handled as a fresh process's: a forked child (the launcher forks
    while its own stops are deferred, deploy/launch/launcher.py `LocalRun.spawn`)."""
    _STOPS.clear()
    _StopState.deferred = _StopState.raised = _StopState.at_waits = False


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """A part that a stop signal must not cut (closing the run's records): inside it a signal is
    noted only; leaving it raises nothing (the caller decides, with `stop_noted` or
    `raise_if_stopped`)."""
    before = _StopState.deferred, _StopState.at_waits
    _StopState.deferred, _StopState.at_waits = True, False
    try:
        yield
    finally:
        _StopState.deferred, _StopState.at_waits = before


@contextlib.contextmanager
def stops_at_waits() -> Iterator[None]:
    """A part that a stop signal ends soon but never cuts at an arbitrary bytecode: inside it a
    signal is only noted, and the stop is raised where the main thread waits (`stop_point`:
    for replies, for registrations) or at a loop's `raise_if_stopped`, and on entry if noted
    before.  An exception raised by a handler lands wherever the main thread is, inside a
    `with lock:` too (a lock a later shut-down then waits on for ever); at a wait nothing is
    held.  A long computation of the main thread (an evaluation) finishes before the stop."""
    with _stops_handled(deferred=True, at_waits=True):
        yield


@contextlib.contextmanager
def stops_raised() -> Iterator[None]:
    """A part that a stop signal may cut anywhere, inside a process whose stops are otherwise
    deferred: nothing of the run is recorded yet and the part may take any time (the run's task
    and model being built: a user's model factory, a data set read).  Inside it a signal raises
    at once, and a stop noted before raises on entry; leaving it restores how stops were handled."""
    with _stops_handled(deferred=False, at_waits=False):
        yield


@contextlib.contextmanager
def _stops_handled(deferred: bool, at_waits: bool) -> Iterator[None]:
    """Inside: stops handled as `deferred` and `at_waits` say (`_StopState`), a stop noted before
    raised on entry; on leaving, handled as before.  The main thread's only: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _StopState.deferred, _StopState.at_waits
    _StopState.deferred, _StopState.at_waits = deferred, at_waits
    try:
        raise_if_stopped()
        yield
    finally:
        _StopState.deferred, _StopState.at_waits = before


WAIT_SLICE = 0.1   # seconds: how often a wait in `stops_at_waits` looks for a noted stop


def stops_at_this_wait() -> bool:
    """Whether a wait of this thread now is where a noted stop is raised (`stops_at_waits`)."""
    return _StopState.at_waits and threading.current_thread() is threading.main_thread()


def stop_point() -> None:
    """Raise a stop noted inside `stops_at_waits` (the main thread only); nothing elsewhere."""
    if _STOPS and stops_at_this_wait():
        raise_if_stopped()


class _AllDone:
    """An event set once every future of `fs` has finished, by one done-callback per future: a
    wait in slices then costs nothing a slice, where `concurrent.futures.wait` takes and releases
    every future's lock twice a call (a server waiting on 1,000 calls for 0.4 s in 0.1 s slices
    spent 6 ms of its main thread's CPU in those calls, against 1.5 ms with this event:
    benchmarks/wait_calls_speed.py)."""

    def __init__(self, fs: set[Future]) -> None:
        self.event = threading.Event()
        self._left = len(fs)
        self._lock = threading.Lock()
        if not fs:
            self.event.set()
        for f in fs:
            f.add_done_callback(self._finished)   # called at once for a future already done

    def _finished(self, _: Future) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.event.set()


def wait_stoppable(fs: Iterable[Future], timeout: float | None) -> tuple[set[Future], set[Future]]:
    """`concurrent.futures.wait(fs, timeout)` (all completed), looking for a noted stop every
    WAIT_SLICE seconds where `stops_at_waits` asks for it (`stop_point`)."""
    futures = set(fs)
    if not stops_at_this_wait():
        return futures_wait(futures, timeout=timeout)
    all_done = _AllDone(futures)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        stop_point()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        finished = all_done.event.wait(WAIT_SLICE if left is None else min(left, WAIT_SLICE))
        if finished:   # every future is done: no look at each (a lock taken per future)
            stop_point()
            return futures, set()
        if left is not None and left <= WAIT_SLICE:
            stop_point()
            done = {f for f in futures if f.done()}
            return done, futures - done


def sleep_stoppable(seconds: float) -> None:
    """`time.sleep(seconds)` that a stop signal cuts short: it ends once a stop is noted (a
    handler that only notes the stop, inside `stops_deferred` or `stops_at_waits`, would let a
    plain sleep run on to its end: PEP 475 resumes it), and the caller goes on to where the stop
    is raised or handled.  For a sleep that only pads time (the virtual clock's `sleep_scale`)."""
    deadline = time.monotonic() + seconds
    while not _STOPS and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, WAIT_SLICE))


def raise_if_stopped() -> None:
    """Raise the stop a signal asked for whose exception never arrived.  A signal's handler runs
    in whatever Python code the main thread is in; when that code was called from C code that
    clears errors (an `isinstance` against an ABC inside a library call: the server went on with
    its rounds after the launcher's SIGINT, one run in about seven under load), the exception is
    lost.  A loop that must stop calls this at each turn (the server between rounds, the
    launcher while it waits)."""
    if _STOPS:
        signum = _STOPS[0]
        _StopState.raised = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum)


@contextlib.contextmanager
def signals_restored() -> Iterator[None]:
    """Put SIGINT's and SIGTERM's handlers back as they were on leaving (the Python API runs
    `fedhop run` inside a user's process: a notebook's kernel keeps its own handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ctrl-C ignored inside: a bounded clean-up that a second Ctrl-C must not cut (a launcher
    stopping the roles it started).  Only the main thread sets signal handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def ignore_stops() -> None:
    """Once a stop is being recorded, further SIGINT and SIGTERM are ignored (SIGKILL still ends
    the process): Ctrl-C reaches the launcher and its children together, and the launcher then
    asks the server to stop as well.  Nothing noted is pending any more."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _STOPS.clear()   # this stop is being handled


def stop_reason(exc: BaseException) -> tuple[str, int]:
    """(how a stop is described, the exit status a shell reports for it: 128 + signal)."""
    if isinstance(exc, Stopped):
        return f"stopped by {signal.Signals(exc.signum).name}", 128 + exc.signum
    return "stopped by SIGINT (Ctrl-C)", 128 + signal.SIGINT
