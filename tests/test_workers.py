"""deploy/launch/workers.py's pieces: the pipe's message format (bytes and JSON, no pickle) and
how many worker processes a config gets.  The engine's runs with workers are in
tests/test_inprocess_engine.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.util.procexit import YOUNG_COLLECTION_EVERY
from fedhop.deploy.launch.engine import usable_cores
from fedhop.deploy.launch.workers import pack, unpack, worker_count


def test_a_pipe_message_comes_back_as_it_was_packed():
    head = {"kind": "many", "node": "client-proc0", "counts": [2, 1], "framings": [17, None], "calls": [0, -1]}
    frames = [b"\x0a\x03abc", memoryview(b"x" * 70000), b""]
    out_head, out_frames = unpack(pack(head, frames))
    assert out_head == head
    assert out_frames == [b"\x0a\x03abc", b"x" * 70000, b""]


@pytest.mark.parametrize("cut", [1, 9, -1])
def test_a_pipe_message_whose_lengths_do_not_add_up_is_refused(cut):
    data = pack({"kind": "call"}, [b"abcdef", b"gh"])
    bad = data[:cut] if cut > 0 else data + b"?"
    with pytest.raises(ValueError, match="worker pipe message"):
        unpack(bad)


def _cfg(workers: int | str, topology: str = "star") -> object:
    text = (f'[run]\nworkers = {json.dumps(workers)}\n' +
            f'\n[topology]\nkind = "{topology}"\n' +
            ('edges = 2\n' if topology == "hierarchical" else "") +
            '\n[data]\ndataset = "digits"\n\n[clients]\ncount = 20\nper_round = 4\nprocesses = 3\n')
    return parse_config(text)


@pytest.mark.parametrize("workers, processes, expected", [
    (1, 3, 0),            # every client in the run's process
    (2, 3, 2),
    (8, 3, 3),            # at most one per client process
    (2, 1, 1),
    (2, 0, 0),
    (0, 3, min(3, usable_cores()) if usable_cores() > 1 else 0),   # one per core
])
def test_the_worker_count_follows_run_workers_and_the_client_processes(workers, processes, expected):
    assert worker_count(_cfg(workers), processes) == expected
    assert worker_count(_cfg(workers), processes, forkable=False) == expected   # a number is kept either way


PER_CORE = usable_cores()


@pytest.mark.parametrize("processes", [1, 3, 64])
def test_auto_gives_one_worker_per_core_only_where_the_run_forks_them(processes, monkeypatch):
    """run.workers = "auto" (the default): as 0 where `fedhop run` forks its workers, as 1 where
    each would be a fresh interpreter (the Python API, FEDHOP_START=exec, a GPU run)."""
    monkeypatch.delenv("FEDHOP_RUN_CORES", raising=False)
    cfg = parse_config('[data]\ndataset = "digits"\n\n[clients]\ncount = 80\nper_round = 4\n'
                       f'processes = {processes}\n')
    assert cfg.run.workers == "auto"
    assert worker_count(cfg, processes, forkable=True) == (min(PER_CORE, processes) if PER_CORE > 1 else 0)
    assert worker_count(cfg, processes, forkable=False) == 0
    assert worker_count(_cfg("auto", "gossip"), processes, forkable=True) == 0


@pytest.mark.parametrize("value", ['"many"', '"Auto"', '-1', '1.5', 'true'])
def test_run_workers_refuses_anything_but_a_count_or_auto(value):
    with pytest.raises(ConfigError, match="run.workers"):
        parse_config(f'[run]\nworkers = {value}\n')


def test_clients_that_call_each_other_stay_in_the_run_process():
    assert worker_count(_cfg(2, "hierarchical"), 3) == 2
    assert worker_count(_cfg(2, "gossip"), 3) == 0


@pytest.mark.parametrize("cores, processes", [("1", 3), ("2", 3), ("5", 3), ("2", 1)])
def test_auto_forks_as_many_workers_as_the_run_may_use_cores(monkeypatch, cores, processes):
    """FEDHOP_RUN_CORES (what `fedhop sweep` gives each of its parallel runs) bounds "auto";
    a number of workers set in the config is kept."""
    monkeypatch.setenv("FEDHOP_RUN_CORES", cores)
    share = int(cores)
    assert worker_count(_cfg("auto"), processes) == (min(share, processes) if share > 1 else 0)
    assert worker_count(_cfg(2), processes) == min(2, processes)


@pytest.mark.parametrize("cores", ["0", "-2", "two", "1.5"])
def test_a_bad_core_count_in_the_environment_is_refused_naming_it(monkeypatch, cores):
    monkeypatch.setenv("FEDHOP_RUN_CORES", cores)
    with pytest.raises(ConfigError, match="FEDHOP_RUN_CORES"):
        worker_count(_cfg("auto"), 3)


class _FailingWorker:
    """A worker that reports an error instead of a batch's first reply (its `_serve` failed the
    batch), as `Worker.receive` raises it; counts the reads."""

    def __init__(self) -> None:
        import threading
        self.lock = threading.Lock()
        self.sent: list[dict] = []
        self.reads = 0

    def send(self, head: dict, frames: list) -> None:
        self.sent.append(head)

    def receive(self, timeout: float | None = None):
        self.reads += 1
        raise RuntimeError("fedhop worker 0: ValueError: the batch could not be served")


def test_a_batch_the_worker_failed_fails_each_call_with_its_error_and_does_not_wait():
    """A worker's error in the middle of a batch ends the batch: the call that reads it and every
    later call of the batch fail at once with that error (INTERNAL, as gRPC's), and leaving the
    batch reads nothing more, where it used to wait for replies that never come."""
    from fedhop.common.transport.base import CallFailed
    from fedhop.common.transport.livebytes import LinkCounter
    from fedhop.common.wire.codec import encode, make_envelope
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload
    from fedhop.deploy.launch.workers import WorkerEndpoint
    from fedhop.transports.inmemory.endpoint import InMemoryNetwork

    worker = _FailingWorker()
    ep = WorkerEndpoint(InMemoryNetwork(), "client-proc0", Ledger(), worker, LinkCounter("client-proc0"))  # type: ignore[arg-type]
    msgs = [encode(Payload(scalars={"x": float(i)}), make_envelope(run_id="r", round=1, src="server",
                                                                   dst=f"client-{i}", method="train"))
            for i in range(3)]
    with ep.pipelined(msgs):
        for m in msgs:
            with pytest.raises(CallFailed) as err:
                ep.serve_frames(list(m.frames), lambda request: Payload())
            assert err.value.code == "INTERNAL" and "could not be served" in err.value.detail
    assert worker.sent[0]["kind"] == "many" and worker.reads == 1


class _Pipe:
    """The worker's end of its pipe, keeping what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


class _BatchServer:
    """`Endpoint.serve_batch` as far as the worker's reply groups see it: reply i is `sizes[i]`
    bytes in two frames, placed in its call's bundles (`reply_framing`) as the endpoint does."""

    def __init__(self, sizes: list[int], chunk_bytes: int = 4 << 20, per_bundle: int = 3) -> None:
        self.sizes, self.chunk_bytes, self.replies_per_bundle = sizes, chunk_bytes, per_bundle

    def serve_batch(self, batch, handler):
        for i, (_, _, reply_framing) in enumerate(batch):
            reply = [b"h%d" % i, b"x" * self.sizes[i]]
            if reply_framing is not None:
                reply_framing([len(f) for f in reply])
            yield reply


def _served(calls: list[int], sizes: list[int], chunk_bytes: int = 4 << 20) -> list[tuple[dict, list[bytes]]]:
    from fedhop.common.transport.livebytes import LinkCounter
    from fedhop.deploy.launch.workers import serve_many

    pipe = _Pipe()
    counter = LinkCounter("client-proc0")
    counter.add([["client-server", "up", 1, 10, 11, 12]])   # counts made before the batch's first group
    head = {"kind": "many", "counts": [1] * len(calls), "framings": [0] * len(calls), "calls": calls, "seq": 7}
    serve_many(pipe, _BatchServer(sizes, chunk_bytes), counter, head, [b"req"] * len(calls),  # type: ignore[arg-type]
               lambda request: None)
    return [unpack(data) for data in pipe.sent]


def test_a_batchs_replies_go_back_a_bundle_at_a_time():
    """A worker sends a batch's replies in groups (deploy/launch/workers.py `serve_many`): one
    pipe message per reply bundle of its call (3 replies here), one at a call's last reply, one
    for a reply that travels alone (call -1); every reply once, in order, with its own frames."""
    from fedhop.deploy.launch.workers import _replies

    calls = [0, 0, 0, 0, 0, -1, 1, 1]
    groups = _served(calls, [5] * len(calls))
    assert [out["i"] for out, _ in groups] == [[0, 1, 2], [3, 4], [5], [6, 7]]
    taken = [(i, frames) for out, frames in groups for i, frames in _replies(out, frames)]
    assert taken == [(i, [b"h%d" % i, b"xxxxx"]) for i in range(len(calls))]
    assert groups[0][0]["counts"] == [["client-server", "up", 1, 10, 11, 12]]   # counts travel once
    assert all(out["counts"] == [] for out, _ in groups[1:])


def test_a_group_that_would_pass_one_chunk_goes_before_the_reply_that_would_pass_it():
    groups = _served([0, 0, 0], [500, 400, 200], chunk_bytes=1000)
    assert [out["i"] for out, _ in groups] == [[0, 1], [2]]


@pytest.mark.parametrize("head", [
    {"i": [0, 1], "sizes": [2]},            # a place without its frame count
    {"i": [0], "sizes": [3]},               # more frames than the message holds
    {"i": [0], "sizes": [1]},               # fewer
    {"i": 0, "sizes": [2]},                 # not lists
    {"i": [-1], "sizes": [2]},
    {"sizes": [2]},
])
def test_a_group_of_replies_that_does_not_add_up_is_refused(head):
    from fedhop.deploy.launch.workers import _replies

    with pytest.raises(RuntimeError, match="does not add up"):
        _replies({"ok": True, **head}, [b"a", b"b"])


class _GroupWorker:
    """A worker that answers a batch of three with one group of its three replies."""

    def __init__(self, counts: list) -> None:
        import threading
        self.lock = threading.Lock()
        self.counts = counts
        self.reads = 0

    def send(self, head: dict, frames: list) -> None:
        self.head = head

    def receive(self, timeout: float | None = None):
        self.reads += 1
        return {"ok": True, "i": [2, 0, 1], "sizes": [1, 1, 1], "counts": self.counts}, [b"r2", b"r0", b"r1"]


def test_each_call_of_a_batch_takes_its_own_reply_from_a_group_and_its_counts_are_added_once():
    from fedhop.common.transport.livebytes import LinkCounter
    from fedhop.common.wire.codec import encode, make_envelope
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload
    from fedhop.deploy.launch.workers import WorkerEndpoint
    from fedhop.transports.inmemory.endpoint import InMemoryNetwork

    counts = [["client-server", "up", 3, 30, 33, 36]]
    worker = _GroupWorker(counts)
    counter = LinkCounter("client-proc0")
    ep = WorkerEndpoint(InMemoryNetwork(), "client-proc0", Ledger(), worker, counter)  # type: ignore[arg-type]
    msgs = [encode(Payload(scalars={"x": float(i)}), make_envelope(run_id="r", round=1, src="server",
                                                                   dst=f"client-{i}", method="train"))
            for i in range(3)]
    with ep.pipelined(msgs):
        got = [ep.serve_frames(list(m.frames), lambda request: Payload()) for m in msgs]
    assert got == [[b"r0"], [b"r1"], [b"r2"]] and worker.reads == 1
    assert counter.take() == counts


def test_both_ends_of_a_workers_pipe_get_the_buffers_asked_for():
    """`widen_socket_buffers`: the kernel gives at least what was asked, within its cap
    (net.core.rmem_max, wmem_max; Linux reports twice the size it was given)."""
    import multiprocessing
    import socket
    from pathlib import Path

    from fedhop.deploy.launch.workers import PIPE_BUFFER_BYTES, widen_socket_buffers

    caps = {}
    for name, option in (("rmem_max", socket.SO_RCVBUF), ("wmem_max", socket.SO_SNDBUF)):
        path = Path("/proc/sys/net/core") / name
        if not path.exists():
            pytest.skip("no /proc/sys/net/core here")
        caps[option] = int(path.read_text())
    a, b = multiprocessing.Pipe()
    try:
        widen_socket_buffers(a, b)
        for end in (a, b):
            sock = socket.socket(fileno=end.fileno())
            try:
                for option, cap in caps.items():
                    assert sock.getsockopt(socket.SOL_SOCKET, option) >= min(PIPE_BUFFER_BYTES, cap)
            finally:
                sock.detach()
        a.send_bytes(b"still a pipe")
        assert b.recv_bytes() == b"still a pipe"
    finally:
        a.close()
        b.close()


FREEZE_SCRIPT = """
import gc, json, sys
from pathlib import Path
from fedhop.common.config import config_to_toml, parse_config
from fedhop.deploy.launch import workers

seen = Path(sys.argv[2])
real = workers.freeze_heap
def noting():   # the worker's set-up freeze (patched before the fork, so the forked worker has it)
    before = {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}
    out = real()
    seen.write_text(json.dumps({"before": before, "frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}))
    return out
workers.freeze_heap = noting
cfg = parse_config(Path(sys.argv[1]).read_text())
tracked = len(gc.get_objects())
worker = workers.Worker(0, fork=True)
try:
    out, _ = worker.exchange({"kind": "init", "node": "client-proc0", "clients": [0, 1], "config": config_to_toml(cfg),
                              "run_id": "r", "token": "t", "parent": "server", "device": "", "ledger": ""}, [],
                             timeout=120)
finally:
    worker.close()
print(json.dumps({"ok": out["ok"], "tracked": tracked, "frozen": gc.get_freeze_count()}))
"""


def test_a_forked_worker_keeps_what_it_inherited_and_its_set_up_out_of_the_collectors_walks(tmp_path):
    """A forked worker freezes what it inherited from the run's process at once (its full
    collections used to walk all of it: 92-193 ms each, several a run, on the 1,000,000-client
    config), and freezes its host once built, with a role process's young-generation threshold
    (common/util/procexit.py `freeze_heap`).  Run in a fresh process: a fork from pytest's, with
    its threads, is not what `fedhop run` does."""
    root = Path(__file__).resolve().parents[1]
    seen = tmp_path / "seen.json"
    done = subprocess.run([sys.executable, "-c", FREEZE_SCRIPT, str(root / "examples" / "fedavg_digits.toml"), str(seen)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    parent = json.loads(done.stdout.strip().splitlines()[-1])
    assert parent["ok"] and parent["frozen"] == 0 and parent["tracked"] > 50_000   # the run's process froze nothing
    child = json.loads(seen.read_text())
    # at the host's freeze, what the worker inherited was frozen already, and only its own
    # objects (the host's) were still walked
    assert child["before"]["frozen"] >= 0.9 * parent["tracked"]
    assert child["before"]["tracked"] < parent["tracked"] / 10
    assert child["frozen"] > child["before"]["frozen"] and child["threshold"][0] == YOUNG_COLLECTION_EVERY
