"""The in-memory engine (deploy/launch/inmemory.py, transport.kind = "inmemory") and a run of real
processes over gRPC (`fedhop run`, deploy/launch/launcher.py) keep the same ledger and reach the same
model: every message the two runs send has the same round, ends, method and tensor, payload
and framed bytes (the framing decided for both by common/transport/base.py's helpers).

Left out or made comparable, and why:
- Heartbeats (`heartbeat`, `heartbeat.reply`) are sent on a timer (common/transport/liveness.py
  `HeartbeatSender`), so how many there are depends on the wall clock, even between two gRPC
  runs; the in-memory engine sends none.  Every other control message (`register`, `probe`,
  `shutdown` and their replies) is driven by the run, not the clock, and is compared.
- A `register` message carries the registrant's address (`mem:client-proc0:2` in memory, a
  loopback host:port over gRPC), and a `register.reply` the run's config text (which names
  `transport.kind`, and over the launcher an absolute data_dir and security.insecure = true).
  Those two fields' encoded sizes are subtracted, exactly, from each such record's payload and
  framed bytes, taking the address from the run's `registered` event and the text from its
  config.toml (what the server sent); the rest of each message is compared byte for byte.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import run_local
from tests.helpers import quadratic_config

RNG = np.random.default_rng(3)
CENTERS = RNG.normal(0, 2, size=(8, 6))
CURV = RNG.uniform(0.5, 2.0, size=(8, 6))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]
HEARTBEATS = {"heartbeat", "heartbeat.reply"}   # wall-clock driven (module docstring)
COMPARED = {"register", "register.reply", "probe", "probe.reply", "train", "train.reply", "shutdown",
            "shutdown.reply"}


def _config(batch: bool) -> str:
    """test_processes.py's quadratic run (3 client processes, 3 of 8 clients a round)."""
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=4, per_round=3, processes=3, local_steps=3)
    return text + f"batch = {str(batch).lower()}\n"   # appended to its [transport] table


def _addresses(store: RunStore) -> dict[str, str]:
    """Each registered process's address, from the server's `registered` events
    (server/coordinator.py: "<role> at <address> hosting <n> clients")."""
    found = {e["node"]: re.fullmatch(r"\w+ at (\S+) hosting \d+ clients", e["detail"])
             for e in store.events("registered")}
    assert all(found.values()), found
    return {node: match.group(1) for node, match in found.items() if match is not None}


def _varying(record: dict, addresses: dict[str, str], config_toml: str) -> int | None:
    """The bytes of a record's fields that differ between the engines by their nature (module
    docstring): a registration's address, a registration reply's config text; 0 otherwise.  None
    for a registration whose address run.db does not name (a client process registering with an
    edge: only the server records the addresses of its registrants)."""
    if record["method"] == "register":
        if record["src"] not in addresses:
            return None
        return pb.RegisterRequest(address=addresses[record["src"]]).ByteSize()
    if record["method"] == "register.reply":
        return pb.RegisterReply(config_toml=config_toml).ByteSize()
    return 0


def _sent(run_dir: Path) -> Counter:
    """The multiset of (round, src, dst, method, tensor, payload, framed bytes) of every message
    but heartbeats and the registrations whose address run.db does not name (`_varying`), from its
    sender's record, less each record's engine-specific bytes."""
    store = RunStore(run_dir / "run.db", create=False)
    assert store.check_agreement().ok
    addresses, config_toml = _addresses(store), (run_dir / "config.toml").read_text()
    out: Counter = Counter()
    for r in store.messages():
        if r["role"] != "sender" or r["method"] in HEARTBEATS:
            continue
        varying = _varying(r, addresses, config_toml)
        if varying is None:
            continue
        out[(r["round"], r["src"], r["dst"], r["method"], r["tensor_bytes"], r["payload_bytes"] - varying,
             r["framed_bytes"] - varying)] += 1
    return out


@pytest.mark.parametrize("batch", [False, True])
def test_inmemory_engine_keeps_the_ledger_and_model_of_grpc_processes(tmp_path, monkeypatch, batch):
    text = _config(batch)
    monkeypatch.chdir(tmp_path)   # the launcher's paths are relative to the working directory
    Path("quad.toml").write_text(text)
    assert run_local("quad.toml", [], "grpc", quiet=True) == 0
    summary, _ = run_inmemory(parse_config(text.replace('kind = "grpc"', 'kind = "inmemory"')), tmp_path / "mem")
    assert summary["status"] == "completed" and summary["transport"] == "inmemory"

    grpc_sent, mem_sent = _sent(tmp_path / "grpc"), _sent(tmp_path / "mem")
    assert {k[3] for k in grpc_sent} == COMPARED
    assert mem_sent == grpc_sent
    # batched, the messages after a batch's first count no 5-byte bundle prefix (base.py `batch_framing`)
    overheads = {framed - payload for (_, _, _, method, _, payload, framed) in grpc_sent if method == "train"}
    assert len(overheads) == (2 if batch else 1), overheads

    grpc_model = load_file(str(tmp_path / "grpc" / "model.safetensors"))
    mem_model = load_file(str(tmp_path / "mem" / "model.safetensors"))
    assert grpc_model.keys() == mem_model.keys()
    assert all(torch.equal(grpc_model[k], mem_model[k]) for k in grpc_model)
