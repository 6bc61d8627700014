"""Config checks that several topologies share (each spec names the one it needs as its `check`)."""
from __future__ import annotations

from typing import Any


def per_client_calls(cfg: Any) -> None:
    """A topology that moves its model in per-client calls (the chain's walk, the relay's visits)
    runs over a transport that carries tensors inside its calls (`Transport.style` "fanout"), not
    over one that moves them in collectives."""
    from fedhop.common.transport.factory import known_transport  # local: the registry reads no topology
    entry = known_transport(cfg.transport.kind)   # None: the config's transport.kind check reports it
    if entry is not None and entry.style != "fanout":
        raise ValueError(f"transport.kind: '{cfg.transport.kind}' does not run topology.kind = '{cfg.topology.kind}' "
                         "(the walk's per-client model exchange is a gRPC call); use transport.kind = 'grpc'")
