"""Worker processes of the in-process engine (`[run] workers`): the client processes of the plan
trained in `run.workers` OS processes, one per core, instead of in the `fedhop run` process.

The server and the edges stay in the engine's process.  Each planned client process still
registers there (its `WorkerClientProcess` and endpoint, as deploy/launch/inprocess.py builds
them); what it hosts (client/host.py `ClientHost`: the task's data, the model, the clients'
state) lives in a worker, which serves its calls.  A call reaching such an
endpoint (`WorkerEndpoint.serve_frames`) hands the request's frames, as the codec produced
them, to the worker over a pipe; the worker serves them with the same `Endpoint.serve_frames`
(decode, handler, encode, the two ledger records) and hands back the reply's frames and what
its records count: the worker appends the records to the process's ledger file
(ledger/NODE.jsonl, where the registration's records are already) and counts them in a live
byte counter of the process's own (common/transport/livebytes.py `LinkCounter`), whose counts
since the last reply travel with each reply into the process's counter here, so run.db,
ledger/*.jsonl and the live byte view are those of a run without workers, and every client
trains the same code on the same inputs, so the model is the same bit for bit (the server folds
the replies in its own order).

What crosses the pipe is bytes only: the codec's frames, which the worker decodes as any
endpoint decodes what it receives, and JSON (the registration's config text, byte counts).
Nothing is pickled.  A worker serves its calls one after another, as a client process trains
one client at a time; the engine's calls to two workers run at once (the server's fabric sends
one batch per client process, each from its own thread), which is where the second core goes.
A batch's replies come back a reply bundle at a time (`serve_many`), as a gRPC callee sends
them, so the engine reads the pipe once a bundle; both ends of the pipe ask the kernel for
buffers of PIPE_BUFFER_BYTES (`widen_socket_buffers`), so that a batch or a bundle does not
fill it several times over, each time stopping the writer until the reader drains it.

`fedhop run` forks its workers before it sets up the server (`can_fork`: the rules it forks a
process run's children by), having built the run's data with one torch thread, which forked
workers use instead of building their own (`SharedTask`: in memory once, in copy-on-write
pages).  Where it may not fork (a GPU run, `FEDHOP_START=exec`, the Python API) a worker is a
fresh interpreter, `python -m fedhop.deploy.launch.workers` with its pipe's file descriptor
(`ExecProcess`), which builds its own.  A worker keeps what it inherited (`worker_main`) and each
host it builds out of the garbage collector's walks (common/util/procexit.py `freeze_inherited`,
`freeze_heap`), as every role process does once set up.

A topology whose clients call each other (its spec's `peer_link` is "client-client": chain,
gossip) keeps them in the run's process: they call through their process's fabric, which a
worker does not have.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Sequence

import psutil

from fedhop.client.runtime import ClientProcess
from fedhop.common.config import Config, config_to_toml, parent_config
from fedhop.common.config.schema import WORKERS_AUTO, ConfigError
from fedhop.common.tasks.base import Task
from fedhop.common.topologies import spec_for
from fedhop.common.transport.base import CallFailed, Handler, ReplyBundles
from fedhop.common.transport.livebytes import LinkCounter
from fedhop.common.transport.liveness import LivenessMonitor, register_with_backoff
from fedhop.common.util.procexit import freeze_heap, freeze_inherited
from fedhop.common.util.proctitle import set_role_title
from fedhop.common.wire.codec import Encoded
from fedhop.common.wire.ledger import Ledger
from fedhop.deploy.launch.engine import RUN_CORES_ENV, usable_cores
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

log = logging.getLogger("fedhop.workers")

#: the peer link of a topology whose clients call each other (its spec's `peer_link`): they keep
#: their process's fabric, so they stay in the run's process
CLIENT_PEERS = "client-client"
_U32 = struct.Struct("<I")
START_TIMEOUT = 300.0   # seconds a worker may take to import, build its task and answer
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}   # a terminal's Ctrl-C, a scheduler's stop: a worker ignores them
CLOSE_WAIT = 2.0   # seconds `Worker.close` waits for the pipe before it ends a worker that cannot be told
PIPE_BUFFER_BYTES = 4 << 20   # kernel buffer asked for each end of a worker's pipe (`widen_socket_buffers`)


def run_cores() -> int:
    """The cores this run may use: FEDHOP_RUN_CORES where set, else those this process may run on."""
    text = os.environ.get(RUN_CORES_ENV, "").strip()
    if not text:
        return usable_cores()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"environment variable {RUN_CORES_ENV}: got {text!r}, expected the number of cores a "
                          "run may use (a whole number >= 1)")
    return int(text)


def worker_count(cfg: Config, client_processes: int, forkable: bool = True) -> int:
    """How many worker processes the run's client processes go to: run.workers (0: one per
    core), at most one per client process; 0 where the clients stay in the engine's process
    (run.workers = 1, no client process, or a topology whose clients call each other: chain,
    gossip).  run.workers = "auto": one per core the run may use (`run_cores`) where it forks
    its workers (`forkable`, `can_fork` on a CPU run), else none: a fresh interpreter takes a
    second or more to start, which a short run from the Python API or a test would pay before
    its first round."""
    workers = cfg.run.workers
    if workers == WORKERS_AUTO:
        wanted = run_cores() if forkable else 1
    else:
        wanted = int(workers) or usable_cores()
    if wanted <= 1 or client_processes == 0 or spec_for(cfg.topology.kind).peer_link == CLIENT_PEERS:
        return 0
    return min(wanted, client_processes)


@dataclass(frozen=True)
class SharedTask:
    """The run's task (its data), built by the run's process just before it forks its workers.
    A forked worker inherits it: a worker whose client process's config is the one it was built
    from uses it instead of building its own, so the data sets sit in memory once (fork's
    copy-on-write pages: each process still reads and writes only its own copy).  Built only
    where the run computes with one torch thread until the fork (`run.torch_threads = 1`, the
    default): a fork after torch has started threads leaves a child that hangs (forkstart.py)."""

    config_toml: str   # the config it was built from (`config_to_toml`)
    task: Task


#: the run's task in a forked worker (`start_workers` sets it in the run's process for the fork)
_INHERITED: SharedTask | None = None


# ----------------------------------------------------------------------------- the pipe's messages
def pack(head: dict[str, Any], frames: Sequence[bytes | memoryview]) -> bytes:
    """One message on a worker's pipe: a JSON head, then the frames, each length-prefixed."""
    text = json.dumps(head, separators=(",", ":")).encode()
    parts: list[bytes | memoryview] = [_U32.pack(len(text)), text, _U32.pack(len(frames))]
    parts.extend(_U32.pack(len(f)) for f in frames)
    parts.extend(frames)
    return b"".join(parts)


def unpack(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """`pack`'s inverse; ValueError on a message that does not add up."""
    view = memoryview(data)
    try:
        (n,) = _U32.unpack_from(view, 0)
        head = json.loads(bytes(view[4:4 + n]))
        at = 4 + n
        (count,) = _U32.unpack_from(view, at)
        at += 4
        lengths = [_U32.unpack_from(view, at + 4 * i)[0] for i in range(count)]
    except (struct.error, ValueError) as exc:   # json.JSONDecodeError is a ValueError
        raise ValueError(f"a worker pipe message that does not parse: {exc}") from None
    at += 4 * count
    frames = []
    for length in lengths:
        frames.append(bytes(view[at:at + length]))
        at += length
    if at != len(data) or not isinstance(head, dict):
        raise ValueError("a worker pipe message whose lengths do not add up")
    return head, frames


# ----------------------------------------------------------------------------- the worker process
def worker_main(conn: Connection, index: int = 0, inherited: Sequence[Connection] = ()) -> None:
    """A worker process: serve its pipe (`_serve`), then close its client processes' ledger
    files and leave at once (common/util/procexit.py: every record is on disk by then, and a
    process with torch loaded spends about half a second in interpreter finalization; a forked
    worker must not run the atexit handlers it inherited from the run's process).  `inherited`:
    in a forked worker, its copies of the run's ends of its own pipe and of the pipes of the
    workers forked before it, closed here so that every worker sees EOF when the run's process
    is gone."""
    # Ctrl-C, and a scheduler's or `kill`'s SIGTERM to the process group, reach every process of
    # the run: the run's process stops the rounds, records the stop and closes its workers
    # (`Worker.close`), which serve until then (a worker whose run's process is gone ends at EOF)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)   # blocked by `ExecProcess` until now
    for other in inherited:
        other.close()
    set_role_title("worker", str(index))   # `ps`: "fedhop worker 0" (common/util/proctitle.py)
    freeze_inherited()   # the run's process's objects out of the collector's walks (common/util/procexit.py)
    ledgers: list[Ledger] = []
    status = 0
    try:
        _serve(conn, ledgers)
    except BaseException:  # noqa: BLE001 - shown on stderr, and the exit status says it
        traceback.print_exc()
        status = 1
    finally:
        for ledger in ledgers:
            ledger.close()
        for handler in logging.getLogger().handlers:   # the run's log file, in a forked worker
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def _serve(conn: Connection, ledgers: list[Ledger]) -> None:
    """A worker's loop: `init` builds a client process's host (its ledger appended to
    `ledgers`), `call` and `many` serve requests' frames for it, `close` or EOF ends the loop."""
    import torch

    from fedhop.client.host import ClientHost
    from fedhop.common.transport.placement import process_device

    hosts: dict[str, tuple[InMemoryEndpoint, ClientHost, LinkCounter]] = {}
    while True:
        try:
            head, frames = unpack(conn.recv_bytes())
        except EOFError:
            return
        kind = head.get("kind")
        if kind == "close":
            return
        try:
            if kind == "init":
                cfg = parent_config(head["config"], head["node"], head["parent"], role="client")
                torch.set_num_threads(cfg.run.torch_threads)
                ledger = Ledger(head["ledger"] or None, hold=False)   # appends to the process's ledger file
                ledgers.append(ledger)
                counter = LinkCounter(head["node"])   # what the records count, sent with each reply
                ledger.observers.append(counter.observe)
                ep = InMemoryEndpoint(InMemoryNetwork(), head["node"], ledger,
                                      run_id=head["run_id"], token=head["token"],
                                      chunk_bytes=cfg.transport.chunk_bytes)
                ep.replies_per_bundle = cfg.transport.reply_bundle
                ep.use_checksum(cfg.security.checksum)
                device = process_device(head["device"], cfg.clients.device, "clients.device")
                if device.type != "cpu":
                    ep.device = device
                shared = _INHERITED.task if (_INHERITED is not None and device.type == "cpu"
                                             and _INHERITED.config_toml == config_to_toml(cfg)) else None
                host = ClientHost(cfg, head["node"], head["clients"], head["run_id"], ep.ledger,
                                  parent=head["parent"], device=device, task=shared)
                if cfg.algorithm.vectorized:   # a batch's clients trained together (client/host.py)
                    ep.before_batch = host.prepare_batch
                hosts[head["node"]] = (ep, host, counter)
                freeze_heap()   # set-up done, as in every role process (`worker_main`, common/util/procexit.py)
                conn.send_bytes(pack({"ok": True, "shared": shared is not None}, []))
                continue
            ep, host, counter = hosts[head["node"]]
            if kind == "many":
                serve_many(conn, ep, counter, head, frames, host.handle)
                continue
            reply = ep.serve_frames(frames, host.handle, framing=head["framing"], pulled=head["pulled"])
            conn.send_bytes(pack({"ok": True, "counts": counter.take()}, list(reply)))
        except (BrokenPipeError, ConnectionResetError):   # the run's process is gone: nobody to serve
            return
        except Exception as exc:  # noqa: BLE001 - told to the engine, which raises it there
            try:
                conn.send_bytes(pack({"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []))
            except OSError:
                return


class _ReplyGroup:
    """A batch's replies that go back to the run's process in one pipe message: those of one reply
    bundle (`ReplyBundles`), which a gRPC callee sends in one message too, so that the run's
    process reads and parses the pipe once a bundle rather than once a reply.  A reply that
    would take the group over `limit` bytes (one chunk) sends the group before it."""

    def __init__(self, conn: Connection, counter: LinkCounter, limit: int) -> None:
        self.conn, self.counter, self.limit = conn, counter, limit
        self.index: list[int] = []   # the replies' places in the batch
        self.sizes: list[int] = []   # each reply's number of frames
        self.frames: list[bytes] = []
        self.bytes = 0

    def add(self, i: int, reply: list[bytes]) -> None:
        size = sum(len(f) for f in reply)
        if self.index and self.bytes + size > self.limit:
            self.send()
        self.index.append(i)
        self.sizes.append(len(reply))
        self.frames.extend(reply)
        self.bytes += size

    def send(self) -> None:
        """The group's replies, with the byte counts of the records made since the last group."""
        if not self.index:
            return
        self.conn.send_bytes(pack({"ok": True, "i": self.index, "sizes": self.sizes, "counts": self.counter.take()},
                                  self.frames))
        self.index, self.sizes, self.frames, self.bytes = [], [], [], 0


def serve_many(conn: Connection, ep: InMemoryEndpoint, counter: LinkCounter, head: dict[str, Any],
               frames: list[bytes], handler: Handler) -> None:
    """A batch's messages (a "many" message: each one's frame count, framing share and call)
    served in order (`Endpoint.serve_batch`), their replies sent back a bundle at a time: a
    group goes when its call's bundle is full (`ReplyBundles.full`), at its call's last reply, or
    for a reply that travels alone, as a gRPC callee sends its bundles."""
    bundles: dict[int, ReplyBundles] = {}   # the replies of one call of the batch share bundles
    ends = itertools.accumulate(head["counts"])
    calls = head["calls"]
    batch = [(frames[end - count:end], framing, None if call < 0 else _framing(bundles.setdefault(
                  call, ReplyBundles(ep.chunk_bytes, ep.replies_per_bundle))))
             for end, count, framing, call in zip(ends, head["counts"], head["framings"], calls)]
    group = _ReplyGroup(conn, counter, ep.chunk_bytes)
    for i, reply in enumerate(ep.serve_batch(batch, handler)):
        group.add(i, list(reply))
        call = calls[i]
        if call < 0 or bundles[call].full or i + 1 == len(calls) or calls[i + 1] != call:
            group.send()
    group.send()


def _framing(bundles: ReplyBundles) -> Callable[[list[int]], int]:
    return lambda lengths: bundles.place(lengths)[1]


class WorkerGone(RuntimeError):
    """The worker process has ended (killed, out of memory): its pipe is closed.  Its client
    processes' calls fail as a dead process's do over gRPC (`WorkerEndpoint`)."""

    def __init__(self, message: str, delivered: bool) -> None:
        super().__init__(message)
        self.delivered = delivered   # False: the request never reached the worker's pipe


class ExecProcess:
    """A worker started as a fresh interpreter (`python -m fedhop.deploy.launch.workers FD INDEX`),
    its end of the pipe passed as file descriptor FD, behind the part of multiprocessing's
    `Process` the engine uses.  Not multiprocessing's "spawn": that runs the parent's main script
    again in the child (a user's script calling `fedhop.run` without an `if __name__ ==
    "__main__":` guard started a second run there, and the worker died with exit code 1)."""

    def __init__(self, index: int, child: Connection) -> None:
        self.name = f"fedhop worker {index}"
        fd = child.fileno()
        # started with SIGINT and SIGTERM blocked (a mask survives exec), so that a group's Ctrl-C or
        # SIGTERM while it imports cannot end it before `worker_main` ignores them (the run's
        # process records the stop, then closes it); what came meanwhile is dropped there
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self._popen = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.launch.workers", str(fd), str(index)],
                                           pass_fds=(fd,), stdin=subprocess.DEVNULL)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        self.pid = self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """As multiprocessing's: None while it runs, -N when signal N ended it."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()


class Worker:
    """One worker process and its pipe, as the engine's process sees it.

    `fork`: the worker is forked from this process, which already has torch and fedhop imported,
    so it is ready in milliseconds rather than the second or more a fresh interpreter takes to
    import them (two at once beside the run's process on a 2-core machine: 1.4 s before the first
    round).  Only a process that may fork may ask (`can_fork`: the rules of a process run's
    children, deploy/launch/forkstart.py, and no thread but this one); otherwise the worker is a
    fresh interpreter (`ExecProcess`).  `others`: the workers started before this one, whose
    pipe ends a forked worker closes (`worker_main`).  `started`: "forked" or "spawned", for the log."""

    def __init__(self, index: int, fork: bool = False, others: Sequence["Worker"] = ()) -> None:
        self.process: multiprocessing.process.BaseProcess | ExecProcess
        if fork:
            ctx = multiprocessing.get_context("fork")
            self.conn, child = ctx.Pipe()
            widen_socket_buffers(self.conn, child)
            # a forked worker holds copies of the run's ends of its own pipe and of earlier
            # workers' pipes, which it must close to see EOF when the run's process is gone
            inherited = [self.conn, *(w.conn for w in others)]
            self.process = ctx.Process(target=worker_main, args=(child, index, inherited),
                                       name=f"fedhop worker {index}", daemon=True)
            self.process.start()
        else:
            self.conn, child = multiprocessing.Pipe()
            widen_socket_buffers(self.conn, child)
            self.process = ExecProcess(index, child)   # it holds only its own end (pass_fds)
        child.close()
        self.started = "forked" if fork else "spawned"
        self.lock = threading.RLock()   # one exchange (or one batch's, `WorkerEndpoint.pipelined`) at a time on the pipe
        self.gone = ""   # why the worker is known to have ended (`WorkerGone`); "" while it serves

    def _ended(self, delivered: bool) -> WorkerGone:
        if not self.gone:
            self.process.join(1.0)   # its exit code, where it has exited already
            self.gone = f"{self.process.name} ended (exit code {self.process.exitcode})"
        return WorkerGone(self.gone, delivered)

    def send(self, head: dict[str, Any], frames: Sequence[bytes | memoryview]) -> None:
        """One message to the worker; WorkerGone when its end of the pipe is closed."""
        if self.gone:
            raise WorkerGone(self.gone, delivered=False)
        try:
            self.conn.send_bytes(pack(head, frames))
        except OSError:   # BrokenPipeError, ConnectionResetError: the worker has ended
            raise self._ended(delivered=False) from None

    def exchange(self, head: dict[str, Any], frames: Sequence[bytes | memoryview],
                 timeout: float | None = None) -> tuple[dict[str, Any], list[bytes]]:
        with self.lock:
            self.send(head, frames)
            return self.receive(timeout)

    def receive(self, timeout: float | None = None) -> tuple[dict[str, Any], list[bytes]]:
        """The worker's next message; RuntimeError when it reports an error (or says nothing
        within `timeout`), WorkerGone when it has ended."""
        if self.gone:
            raise WorkerGone(self.gone, delivered=True)
        try:
            if timeout is not None and not self.conn.poll(timeout):
                raise RuntimeError(f"{self.process.name} did not answer within {timeout:g}s")
            out, reply = unpack(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self._ended(delivered=True) from None
        if not out.get("ok"):
            raise RuntimeError(f"{self.process.name}: {out.get('error')}")
        return out, reply

    def close(self) -> None:
        """Tell the worker to end and give it 10 s (`tell_close`, then `finish_close`)."""
        self.finish_close(self.tell_close())

    def tell_close(self) -> bool:
        """Tell the worker to end; False when it cannot be told within CLOSE_WAIT (a call on the
        pipe waits for it: frozen, hung, or still training a stopped round's batch) or has ended.
        Telling every worker before waiting for any (`close_all`) lets them end together."""
        if not self.lock.acquire(timeout=CLOSE_WAIT):
            return False
        try:
            self.send({"kind": "close"}, [])
            return True
        except (WorkerGone, ValueError):
            return False
        finally:
            self.lock.release()

    def finish_close(self, told: bool) -> None:
        """Wait up to 10 s for a worker that was told to end; one that was not told, or that does
        not end, is killed, which ends a call waiting on its pipe too (the pipe closes), so a stop
        never hangs on a worker."""
        if told:
            self.process.join(10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self.lock.acquire(timeout=CLOSE_WAIT):   # no call reads the pipe any more: its end can go
            try:
                self.conn.close()
            finally:
                self.lock.release()


def widen_socket_buffers(*ends: Connection, size: int = PIPE_BUFFER_BYTES) -> None:
    """Ask for `size`-byte kernel buffers on both ends of a worker's pipe (a Unix socket pair).
    With the default (about 200 KB) a bundle of replies, or a batch of requests, fills the
    buffer several times over, and each time the writer waits for the reader to drain it: two
    context switches per buffer.  The kernel caps the size at net.core.wmem_max and rmem_max;
    less than asked is no error."""
    for end in ends:
        sock = socket.socket(fileno=end.fileno())   # a view of the descriptor, detached below: it stays the pipe's
        try:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, option, size)
        finally:
            sock.detach()


def can_fork() -> bool:
    """Whether this process may fork its workers now: where it may fork a process run's children
    (deploy/launch/forkstart.py `fork_allowed`: `fedhop run`, no gRPC yet; its only torch work
    before the fork is the run's data, built with one thread, which starts no thread pool) and
    no thread but the main one runs (a fork copies only the calling thread, with whatever locks
    the others hold).  Asked again after the data is built."""
    from fedhop.deploy.launch.forkstart import fork_allowed
    return fork_allowed() and threading.active_count() == 1


def start_workers(count: int, fork: bool, shared: SharedTask | None = None) -> list[Worker]:
    """`count` workers, started at once (fresh interpreters import while the run sets up);
    forked ones inherit `shared`."""
    global _INHERITED
    workers: list[Worker] = []
    _INHERITED = shared if fork else None
    try:
        for i in range(count):
            workers.append(Worker(i, fork=fork, others=workers))
    finally:
        _INHERITED = None   # the run's process keeps the task through its server, not here
    return workers


def close_all(workers: Sequence[Worker]) -> None:
    """Tell every worker to end, then wait for each (`Worker.tell_close`, `finish_close`)."""
    told = [worker.tell_close() for worker in workers]
    for worker, was_told in zip(workers, told):
        worker.finish_close(was_told)


# ----------------------------------------------------------------------------- the engine's side
class WorkerLiveness(LivenessMonitor):
    """The server's liveness monitor in the in-process engine with workers: a worker can end apart
    from the run (killed, out of memory), and the client processes it served are then gone for
    good.  No heartbeats travel in this engine; a node counts as dead once its worker has ended
    (`Worker.gone`, or its OS process no longer running), seen when a call to it fails, when the
    next round samples, or by the monitor's thread (`check`, every heartbeat interval).  A worker
    whose OS process has been stopped (SIGSTOP, a frozen container) for longer than the heartbeat
    timeout is what a process run's monitor sees as silent: it is marked dead and killed, which
    ends the calls waiting on its pipe.  Sampling then leaves the node's clients out, as a process
    run's does for a dead process (common/transport/liveness.py `live_pool`), and a `node_dead`
    event records it once.  After `stop` (the run is ending and closes its workers) no further
    end is recorded."""

    def __init__(self, endpoint: InMemoryEndpoint, workers_of: dict[str, Worker],
                 on_event: Callable[[str, str, str], None], interval: float = 1.0, timeout: float = 5.0) -> None:
        super().__init__(endpoint, interval=interval, timeout=timeout, on_event=on_event)
        self.workers_of = workers_of   # node id -> the worker serving that client process
        self.ended: dict[str, str] = {}   # node id -> why it is dead
        self.stopped_since: dict[int, float] = {}   # a worker's pid -> when it was first seen stopped

    def _why_dead(self, worker: Worker, now: float, frozen_too: bool) -> str:
        """Why `worker` counts as ended ("" while it serves); `frozen_too`: also whether its OS
        process has been stopped longer than the timeout (the monitor thread's look: reading a
        process's state costs tens of microseconds, too much for every round's sampling)."""
        if worker.gone or not worker.process.is_alive():
            return worker.gone or f"{worker.process.name} ended (exit code {worker.process.exitcode})"
        if not frozen_too:
            return ""
        pid = worker.process.pid
        assert pid is not None   # started in `Worker.__init__`
        try:
            frozen = psutil.Process(pid).status() == psutil.STATUS_STOPPED
        except psutil.Error:   # ended meanwhile: the next look sees it
            return ""
        if not frozen:
            self.stopped_since.pop(pid, None)
            return ""
        since = self.stopped_since.setdefault(pid, now)
        if now - since <= self.timeout:
            return ""
        worker.process.kill()   # its pipe closes: a call waiting on it ends (UNAVAILABLE)
        return (f"{worker.process.name} was stopped (frozen) for {now - since:.1f}s "
                f"(security.heartbeat_timeout = {self.timeout:g}s) and was killed")

    def _look(self, frozen_too: bool = False) -> set[str]:
        found: list[tuple[str, str]] = []
        now = self.clock()
        with self._lock:
            if not self._stop.is_set():
                for node, worker in self.workers_of.items():
                    why = "" if node in self.ended else self._why_dead(worker, now, frozen_too)
                    if why:
                        self.ended[node] = why
                        self.stats.marked_dead += 1
                        found.append((node, why))
            ended = set(self.ended)
        for node, why in found:
            log.warning("node %s marked dead: %s", node, why)
            self._event("node_dead", node, f"node {node} marked dead: {why}; its clients are not sampled again")
        return ended

    def check(self) -> list[str]:
        """The monitor thread's look (`LivenessMonitor.start`): the nodes newly found dead."""
        before = set(self.ended)
        return sorted(self._look(frozen_too=True) - before)

    def suspect(self, node_id: str, reason: str) -> bool:
        """A failed call: the node is dead if its worker has ended (recorded as `node_dead`), never
        merely suspect, since nothing here would clear it."""
        self._look()
        return False

    def unavailable_nodes(self) -> set[str]:
        return self._look()

    def dead_nodes(self) -> set[str]:
        return self._look()

    def is_dead(self, node_id: str) -> bool:
        return node_id in self._look()


class WorkerEndpoint(InMemoryEndpoint):
    """A client process's endpoint on the engine's network whose calls its worker serves."""

    def __init__(self, network: InMemoryNetwork, node_id: str, ledger: Ledger, worker: Worker,
                 counter: LinkCounter, **kwargs: Any) -> None:
        super().__init__(network, node_id, ledger, **kwargs)
        self.worker = worker
        self.counter = counter   # the process's live byte counter: the worker's counts go in it
        self._batch: _Batch | None = None   # the batch sent ahead (`pipelined`)

    @contextlib.contextmanager
    def pipelined(self, messages: Sequence[Encoded]) -> Iterator[None]:
        """A batch's messages (`InMemoryEndpoint.call_many`) sent to the worker at once, before
        the caller serves the first: the worker trains them one after another and sends their
        replies a bundle at a time (`serve_many`), so it never waits for this process between
        two clients.  Inside,
        `serve_frames` of one of them (from the same thread, in any order) takes its reply as
        it comes; replies no call took are recorded on the way out."""
        self.worker.lock.acquire()
        try:
            frames = [list(m.frames) for m in messages]
            try:
                self.worker.send({"kind": "many", "node": self.node_id, "counts": [len(f) for f in frames],
                                  "framings": [m.framing for m in messages], "calls": _calls(messages)},
                                 [f for fs in frames for f in fs])
            except WorkerGone:   # each call of the batch fails on its own (`serve_frames`)
                yield
                return
            self._batch = _Batch({bytes(fs[0]): i for i, fs in enumerate(frames)}, threading.get_ident())
            try:
                yield
            finally:
                batch, self._batch = self._batch, None
                # a worker that ended, or that failed the batch (its error ends the batch), sends nothing more
                with contextlib.suppress(WorkerGone, RuntimeError):
                    while batch.failed is None and batch.received < len(frames):   # replies no call took
                        out, reply = self.worker.receive()
                        batch.received += len(_replies(out, reply))
                        self._count(out)
        finally:
            self.worker.lock.release()

    def serve_frames(self, frames, handler: Handler, framing: int | None = None, pulled: bool = False,
                     on_header=None, reply_framing: Callable[[list[int]], int] | None = None) -> Sequence[bytes]:
        """The worker serves the request (`Endpoint.serve_frames` there) and records its two ledger
        records in the process's ledger file; the live counter here gets their counts.  A batch's reply travels bundled (`reply_framing`, decided
        here where the batch's bundles are kept): its sender record's framed bytes are the reply's
        bytes and that framing, as `Endpoint._serve` records them."""
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in frames]
        batch = self._batch
        try:
            if batch is not None and batch.thread == threading.get_ident() and frames and frames[0] in batch.index:
                out, reply = batch.take(batch.index[frames[0]], self.worker)
                if reply_framing is not None:   # the caller's side of the call's bundles (the worker placed its own)
                    reply_framing([len(f) for f in reply])
            else:   # a call of its own: its reply travels streamed (a batch's always comes `pipelined`)
                out, reply = self.worker.exchange({"kind": "call", "node": self.node_id, "framing": framing,
                                                   "pulled": pulled}, frames)
        except WorkerGone as exc:   # as a call to a dead process over gRPC: the peer is unavailable
            failed = CallFailed("UNAVAILABLE", f"{exc}; {self.node_id} is gone", self.address)
            failed.delivered = exc.delivered
            raise failed from None
        except RuntimeError as exc:   # the worker failed serving (a defect there): as gRPC's INTERNAL, its error named
            failed = CallFailed("INTERNAL", str(exc), self.address)
            failed.delivered = True
            raise failed from None
        self._count(out)
        return reply

    def _count(self, out: dict[str, Any]) -> None:
        """The reply's byte counts (its records are in the ledger file already, the worker's) into
        the process's live counter."""
        self.counter.add(out["counts"])


def _replies(out: dict[str, Any], frames: list[bytes]) -> list[tuple[int, list[bytes]]]:
    """A worker's group of a batch's replies (`_ReplyGroup`): (place in the batch, frames) of each;
    RuntimeError where the group's head does not add up."""
    index, sizes = out.get("i"), out.get("sizes")
    if (not isinstance(index, list) or not isinstance(sizes, list) or len(index) != len(sizes)
            or not all(isinstance(v, int) and v >= 0 for v in [*index, *sizes]) or sum(sizes) != len(frames)):
        raise RuntimeError(f"a worker's group of replies that does not add up: {out!r}")
    replies, at = [], 0
    for i, n in zip(index, sizes):
        replies.append((i, frames[at:at + n]))
        at += n
    return replies


def _calls(messages: Sequence[Encoded]) -> list[int]:
    """Per message, the call of the batch it goes in (messages whose replies share bundles,
    `ReplyBundles`), numbered from 0; -1 for a message whose reply is not bundled."""
    numbers: dict[int, int] = {}
    return [-1 if m.reply_bundles is None else numbers.setdefault(id(m.reply_bundles), len(numbers))
            for m in messages]


@dataclass
class _Batch:
    """A batch sent ahead to a worker: its messages' index by header frame, and the replies
    read so far that no call has taken yet."""

    index: dict[bytes, int]
    thread: int
    received: int = 0
    early: dict[int, tuple[dict[str, Any], list[bytes]]] = field(default_factory=dict)
    failed: str | None = None   # the worker's error that ended the batch: no more of its replies come

    def take(self, i: int, worker: Worker) -> tuple[dict[str, Any], list[bytes]]:
        """Reply `i` of the batch, reading the worker's replies until it comes.  Where the worker
        reports an error instead (its `_serve` failed the batch), that call and every later one
        of the batch fail with it (RuntimeError), without waiting for replies that never come."""
        while i not in self.early:
            if self.failed is not None:
                raise RuntimeError(self.failed)
            try:
                out, reply = worker.receive()
                replies = _replies(out, reply)
            except RuntimeError as exc:
                self.failed = str(exc)
                raise
            for k, (j, frames) in enumerate(replies):   # the group's byte counts go with its first reply
                self.received += 1
                self.early[j] = ({"counts": out["counts"] if k == 0 else []}, frames)
        return self.early.pop(i)


class WorkerClientProcess(ClientProcess):
    """A planned client process whose host lives in a worker: it registers here, as any client
    process does, and has the worker build its host from the config the parent sent."""

    def __init__(self, endpoint: WorkerEndpoint, parent: str, client_ids: list[int], device: str = "") -> None:
        super().__init__(endpoint, parent, client_ids, device=device)
        self.worker = endpoint.worker

    def register(self, timeout: float = 60.0, deadline_s: float = 120.0) -> None:
        reply = register_with_backoff(self.endpoint, self.parent, self._request(), deadline_s=deadline_s,
                                      call_timeout=min(timeout, 10.0))
        if not reply.accepted:
            raise RuntimeError(f"{self.endpoint.node_id}: registration refused by {self.parent}: {reply.message}")
        cfg = parent_config(reply.config_toml, self.endpoint.node_id, self.parent, role="client")
        self.endpoint.run_id = reply.run_id
        self.endpoint.chunk_bytes = cfg.transport.chunk_bytes
        self.endpoint.replies_per_bundle = cfg.transport.reply_bundle   # the batch's bundles are placed here
        out, _ = self.worker.exchange({"kind": "init", "node": self.endpoint.node_id, "clients": list(self.client_ids),
                                       "config": reply.config_toml, "run_id": reply.run_id,
                                       "token": self.endpoint.token, "parent": reply.node_id or "server",
                                       "device": self.device_spec, "ledger": str(self.endpoint.ledger.path or "")},
                                      [], timeout=START_TIMEOUT)
        log.info("%s trains in %s (%s%s)", self.endpoint.node_id, self.worker.process.name, self.worker.started,
                 ", the run's data shared" if out.get("shared") else "")
        self._ready.set()


if __name__ == "__main__":   # an exec'd worker (`ExecProcess`): its pipe's file descriptor, its index
    worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]))
