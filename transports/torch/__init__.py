"""The torch.distributed transport (docs/torch_transport.md): the gRPC endpoint for every message
(registration, control, the round's calls) and the tensors as collectives and peer sends in its
worlds.

dist.py: one rank's membership of the process groups (`Collectives`), the TCP store, the
`[transport]` keys (`TorchParams`); groups.py: the fabric's group round as collectives
(`CollectiveGroup` at the root, `CollectiveMember` at a member, `TorchPeers`) and the worlds'
set-up (`TORCH_WORLDS`).  The roles' group planes (server/group_rounds.py, edge/group_edge.py,
client/group_worker.py) are written against common/transport/groups.py and named here.  This
`__init__` imports no torch.distributed: every process scans the folders.
"""
from __future__ import annotations

from fedhop.common.transport.entry import GROUP_PLANES, Transport

TRANSPORT = Transport("fedhop.common.transport.grpc:GrpcEndpoint", "fedhop.transports.torch.groups:TORCH_WORLDS",
                      GROUP_PLANES, style="group", params="fedhop.transports.torch.dist:TorchParams",
                      sums_in_collective=True, own_device="fedhop.transports.torch.dist:rank_per_gpu",
                      handlers={"client": ("fedhop.client.group_worker:torch_handlers",),
                                "edge": ("fedhop.edge.group_edge:torch_handlers",)},
                      listed=1)
