"""Ports without races (issue 44, item 7): every port fedhop's own processes listen on is bound
by the process that listens, at port 0 or as configured, and reported; none is chosen free by
one process and bound later (by it or another), where a second run on a busy machine could take
it in between.  The torch.distributed rendezvous store is created by rank 0 listening before its
port is named to the other ranks (transports/torch/dist.py `master_store`)."""
from __future__ import annotations

import errno
import json
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fedhop.transports.torch.dist import master_address, master_store
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_rendezvous_store_listens_before_its_port_is_named():
    """The port `master_store` reports is already bound and listening: a connection succeeds at
    once and nobody else can bind it, for as long as the store lives (old code: `free_port`
    returned the number of a socket it had closed)."""
    stores = [master_store("127.0.0.1", 0, 2, 30.0) for _ in range(8)]
    ports = [s.port for s in stores]
    assert 0 not in ports and len(set(ports)) == len(ports)
    for store in stores:
        with socket.create_connection(("127.0.0.1", store.port), timeout=5):
            pass
        squatter = socket.socket()
        try:
            with pytest.raises(OSError) as taken:
                squatter.bind(("127.0.0.1", store.port))
            assert taken.value.errno == errno.EADDRINUSE
        finally:
            squatter.close()
        assert master_address("127.0.0.1", store) == f"127.0.0.1:{store.port}"
    assert master_address("::1", stores[0]) == f"[::1]:{stores[0].port}"


PRODUCTION = ("common", "client", "edge", "server", "deploy")


def test_no_process_binds_a_port_it_chose_free_earlier():
    """No production module calls `free_port` (a port number from a closed socket, kept for tests
    that must name a port before starting a process): the torch transport's master binds first."""
    users = []
    for top in PRODUCTION:
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            for m in re.finditer(r"\bfree_port\(", text):
                line = text[:m.start()].count("\n") + 1
                if not text[:m.start()].rstrip().endswith("def"):
                    users.append(f"{path.relative_to(ROOT)}:{line}")
    assert users == []


def test_concurrent_torch_transport_runs_each_complete_on_their_own_ports(tmp_path):
    """Three `fedhop run`s of the torch transport at once on this machine (what a parallel sweep
    does): each run's server, clients and rendezvous store bind their own ports, so every run
    completes."""
    rng = np.random.default_rng(3)
    centers, curv, sizes = rng.normal(0, 2, size=(4, 3)), rng.uniform(0.5, 2.0, size=(4, 3)), [3, 4, 5, 6]
    text = quadratic_config(centers, curv, sizes, rounds=2, per_round=4, processes=2).replace(
        'kind = "grpc"', 'kind = "torch"')
    (tmp_path / "exp.toml").write_text(text)

    def run(i: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", f"run{i}",
                               "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, range(3)))
    for i, res in enumerate(results):
        assert res.returncode == 0, (i, res.stderr[-2000:])
        summary = json.loads((tmp_path / f"run{i}" / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["transport"] == "torch", i
