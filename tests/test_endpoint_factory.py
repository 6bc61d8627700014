"""The transport registry (common/transport/factory.py): `transport.kind` -> endpoint and group worlds."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.config.schema import TransportConfig
from fedhop.common.transport import factory
from fedhop.common.transport.base import Endpoint
from fedhop.common.transport.factory import TRANSPORTS, Transport, UnknownTransport, make_endpoint
from fedhop.common.transport.groups import FANOUT_WORLDS, FanoutWorlds, worlds
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.wire.ledger import Ledger
from fedhop.server.__main__ import main as server_main
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_in_kinds_are_the_transport_folders_and_the_config_takes_each():
    kind = next(f for f in dataclasses.fields(TransportConfig) if f.name == "kind")
    assert kind.default in TRANSPORTS and "choices" not in kind.metadata   # open: a plug-in's import path too
    folders = sorted(p.parent.name for p in (ROOT / "transports").glob("*/__init__.py"))
    assert sorted(TRANSPORTS) == folders and list(TRANSPORTS)[:3] == ["grpc", "torch", "inmemory"]   # `listed` order
    for name in TRANSPORTS:
        assert parse_config(f'[transport]\nkind = "{name}"\n').transport.kind == name


@pytest.mark.parametrize("kind", ["", "GRPC", "carrier-pigeon", "grpc "])
def test_an_unknown_kind_is_a_one_line_error_naming_it_and_the_known_kinds(kind):
    with pytest.raises(UnknownTransport) as exc:
        make_endpoint(kind, "server", Ledger())
    text = str(exc.value)
    assert "\n" not in text and repr(kind) in text
    assert all(known in text for known in TRANSPORTS)
    assert isinstance(exc.value, ValueError)   # the roles' `except ValueError` exits 2 on it


@pytest.mark.parametrize("kind,cls", [("grpc", GrpcEndpoint), ("torch", GrpcEndpoint)])
def test_a_socket_kind_builds_a_grpc_endpoint_with_the_given_options(kind, cls):
    ep = make_endpoint(kind, "edge-3", Ledger(), chunk_bytes=8192, max_message_bytes=1 << 20, workers=5)
    try:
        assert type(ep) is cls and isinstance(ep, Endpoint)
        assert (ep.node_id, ep.chunk_bytes, ep.max_message_bytes, ep.workers) == ("edge-3", 8192, 1 << 20, 5)
    finally:
        ep.stop()


def test_the_builder_still_checks_its_options():
    with pytest.raises(ValueError, match="max_message_bytes"):
        make_endpoint("grpc", "server", Ledger(), chunk_bytes=1 << 20, max_message_bytes=1 << 20)
    with pytest.raises(TypeError, match="bogus"):
        make_endpoint("grpc", "server", Ledger(), bogus=1)


def test_inmemory_builds_an_endpoint_on_its_network_and_refuses_without_one():
    net = InMemoryNetwork()
    ep = make_endpoint("inmemory", "client-proc0", Ledger(), network=net, chunk_bytes=4096)
    assert type(ep) is InMemoryEndpoint and ep.network is net and ep.chunk_bytes == 4096
    with pytest.raises(ValueError) as exc:
        make_endpoint("inmemory", "server", Ledger())
    assert "\n" not in str(exc.value) and "inmemory" in str(exc.value)


def test_each_kind_has_its_worlds():
    assert worlds("grpc") is FANOUT_WORLDS and worlds("inmemory") is FANOUT_WORLDS
    torch_worlds = worlds("torch")
    assert not isinstance(torch_worlds, FanoutWorlds) and type(torch_worlds).__name__ == "TorchWorlds"
    with pytest.raises(UnknownTransport):
        worlds("carrier-pigeon")


class PigeonEndpoint(InMemoryEndpoint):
    """A transport added by its own file (here, this test module) and one registry line."""

    def __init__(self, node_id: str, ledger: Ledger, **options) -> None:
        super().__init__(InMemoryNetwork(), node_id, ledger, **options)


def test_a_new_transport_is_one_registration_line(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "pigeon", Transport(f"{__name__}:PigeonEndpoint",
                                                        "fedhop.common.transport.groups:FANOUT_WORLDS"))
    ep = factory.make_endpoint("pigeon", "server", Ledger(), chunk_bytes=2048)
    assert type(ep) is PigeonEndpoint and ep.chunk_bytes == 2048
    assert worlds("pigeon") is FANOUT_WORLDS


def test_a_server_process_with_the_inmemory_kind_exits_2_with_one_line(tmp_path, monkeypatch, caplog):
    rng = np.random.default_rng(3)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(quadratic_config(rng.normal(size=(3, 2)), rng.uniform(0.5, 2, size=(3, 2)),
                                                      [2, 3, 4], rounds=1))
    with caplog.at_level(logging.ERROR):
        rc = server_main(["--config", "c.toml", "--run-dir", "run", "--set", "transport.kind=inmemory",
                          "--register-timeout", "5"])
    assert rc == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "inmemory" in errors[0] and "\n" not in errors[0]


@dataclasses.dataclass
class PigeonParams:
    """[transport] keys of the test's "pigeon" kind."""

    loft: int = dataclasses.field(default=1, metadata={"min": 1})
    exclusive: bool = False


def pigeon_needs_a_device(options: dict) -> bool:
    return bool(options.get("exclusive"))


def test_what_a_transport_declares_reaches_the_config_and_the_device_plan(monkeypatch):
    """The config checks and the device plan ask the registry, not a kind: a new kind that sums
    in a collective, takes its own keys and wants a device per process is treated like torch."""
    from fedhop.common.config import ConfigError, parse_config
    from fedhop.common.topologies.plan import plan_processes
    from fedhop.common.transport.placement import DeviceError, plan_devices
    monkeypatch.setitem(TRANSPORTS, "pigeon", Transport(
        "fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.common.transport.groups:FANOUT_WORLDS",
        params=f"{__name__}:PigeonParams", sums_in_collective=True, own_device=f"{__name__}:pigeon_needs_a_device"))
    base = '[clients]\ncount = 4\nprocesses = 2\n[transport]\nkind = "pigeon"\n'
    cfg = parse_config(base + "loft = 3\n", ["clients.device=cpu"])
    assert cfg.transport.options["loft"] == 3
    with pytest.raises(ConfigError, match=r"config key 'transport.loft': got 0, must be >= 1"):
        parse_config(base + "loft = 0\n")
    with pytest.raises(ConfigError, match=r"'transport.wings'"):
        parse_config(base + "wings = 2\n")
    with pytest.raises(ConfigError, match=r"'algorithm.compress'.*transport.kind = 'pigeon' reduces uploads as raw "
                                          r"float sums"):
        parse_config(base + '[algorithm]\nname = "fedavg"\ncompress = "qsgd"\n')
    with pytest.raises(ConfigError, match=r"'security.aggregation'.*transport.kind = 'pigeon' sums them"):
        parse_config(base + '[security]\naggregation = "median"\n')
    plan = plan_processes(cfg)
    assert set(plan_devices(cfg, plan, count=0).values()) == {"cpu"}   # not exclusive: the device keys apply
    cfg.transport.options["exclusive"] = True
    n = len(plan.node_ids)
    assert [plan_devices(cfg, plan, count=n)[node] for node in plan.node_ids] == [f"cuda:{k}" for k in range(n)]
    with pytest.raises(DeviceError, match="one GPU per process"):
        plan_devices(cfg, plan, count=n - 1)


def test_fedhop_run_refuses_a_one_process_transport_with_one_line(tmp_path):
    """`fedhop run` starts processes: a transport that connects endpoints inside one process
    (the in-memory one) is refused before anything starts, naming the kinds that work."""
    import subprocess
    import sys
    rng = np.random.default_rng(5)
    (tmp_path / "c.toml").write_text(quadratic_config(rng.normal(size=(3, 2)), rng.uniform(0.5, 2, size=(3, 2)),
                                                      [2, 3, 4], rounds=1))
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "c.toml", "--out", "r",
                           "--set", "transport.kind=inmemory"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'inmemory'" in lines[0]
    assert all(k in lines[0] for k, t in TRANSPORTS.items() if not t.one_process)
    assert not (tmp_path / "r").exists()   # nothing started, no run folder
