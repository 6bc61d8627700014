"""The transport registry (common/transport/factory.py): `transport.kind` -> endpoint and group worlds."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from fedhop.common.config_schema import TransportConfig
from fedhop.common.ledger import Ledger
from fedhop.common.transport import factory
from fedhop.common.transport.base import Endpoint
from fedhop.common.transport.factory import TRANSPORTS, Transport, UnknownTransport, make_endpoint
from fedhop.common.transport.groups import FANOUT_WORLDS, FanoutWorlds, worlds
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.transport.inmemory import InMemoryEndpoint, InMemoryNetwork
from fedhop.server.__main__ import main as server_main
from tests.helpers import quadratic_config


def test_every_config_kind_has_one_entry_and_no_entry_lacks_a_config_kind():
    choices = next(f for f in dataclasses.fields(TransportConfig) if f.name == "kind").metadata["choices"]
    assert sorted(choices) == sorted(TRANSPORTS)


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
