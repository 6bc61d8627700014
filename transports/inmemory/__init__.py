"""The in-memory transport: endpoints of one process on an `InMemoryNetwork` (endpoint.py), the
same codec and ledger as gRPC and the same byte counts, no sockets: the in-process engine
(run.engine = "inprocess") and unit tests.  A launcher that starts processes refuses it
(`one_process`)."""
from __future__ import annotations

from fedhop.common.transport.entry import Transport

TRANSPORT = Transport("fedhop.transports.inmemory.endpoint:network_endpoint",
                      "fedhop.common.transport.groups:FANOUT_WORLDS", one_process=True, in_process=True, listed=2)
