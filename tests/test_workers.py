"""deploy/launch/workers.py's pieces: the pipe's message format (bytes and JSON, no pickle) and
how many worker processes a config gets.  The engine's runs with workers are in
tests/test_inprocess_engine.py."""
from __future__ import annotations

import json

import pytest

from fedhop.common.config import ConfigError, parse_config
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
