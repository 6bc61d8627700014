"""The gRPC transport: real sockets, every message a gRPC call (docs/performance.md), groups as
fan-outs of fabric calls.

Its endpoint is common/transport/grpc.py, not a module of this folder: every child process
speaks gRPC to register before it holds a config (factory.py `PROCESS_TRANSPORT`), and the torch
transport carries its control messages on it, so it is the fabric's own endpoint; this folder is
the transport kind that uses it alone.
"""
from __future__ import annotations

from fedhop.common.transport.entry import Transport

TRANSPORT = Transport("fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.common.transport.groups:FANOUT_WORLDS",
                      in_process=True, listed=0)
