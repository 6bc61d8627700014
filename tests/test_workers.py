"""deploy/launch/workers.py's pieces: the pipe's message format (bytes and JSON, no pickle) and
how many worker processes a config gets.  The engine's runs with workers are in
tests/test_inprocess_engine.py."""
from __future__ import annotations

import os

import pytest

from fedhop.common.config import parse_config
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


def _cfg(workers: int, topology: str = "star") -> object:
    text = (f'[run]\nworkers = {workers}\n\n[topology]\nkind = "{topology}"\n' +
            ('edges = 2\n' if topology == "hierarchical" else "") +
            '\n[data]\ndataset = "digits"\n\n[clients]\ncount = 20\nper_round = 4\nprocesses = 3\n')
    return parse_config(text)


@pytest.mark.parametrize("workers, processes, expected", [
    (1, 3, 0),            # every client in the run's process
    (2, 3, 2),
    (8, 3, 3),            # at most one per client process
    (2, 1, 1),
    (2, 0, 0),
    (0, 3, min(3, os.cpu_count() or 1) if (os.cpu_count() or 1) > 1 else 0),   # one per core
])
def test_the_worker_count_follows_run_workers_and_the_client_processes(workers, processes, expected):
    assert worker_count(_cfg(workers), processes) == expected


def test_clients_that_call_each_other_stay_in_the_run_process():
    assert worker_count(_cfg(2, "hierarchical"), 3) == 2
    assert worker_count(_cfg(2, "gossip"), 3) == 0
