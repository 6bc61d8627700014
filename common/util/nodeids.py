"""Node ids: the names of processes and logical clients on the wire, in the ledger and in run.db.

- `server`: the server process;
- `edge-<e>`: edge server e (e selects its cluster of clients, common/topologies/graphs.py);
- `client-proc<k>`: client process k of the process plan (common/topologies/plan.py), hosting logical clients;
- `client-<c>`: logical client c, the destination of its calls (a process answers for each client it hosts).

Every role builds and parses these names here; `role_of` (common/wire/methods.py) reads the role of any of them.
"""
from __future__ import annotations

from collections.abc import Sequence

SERVER = "server"
_EDGE = "edge"
_CLIENT = "client"
_CLIENT_PROC = "client-proc"


def client_node(cid: int) -> str:
    """The node id of logical client `cid` (the destination of its `train` calls)."""
    return f"{_CLIENT}-{cid}"


def edge_node(edge: int) -> str:
    """The node id of edge server `edge`."""
    return f"{_EDGE}-{edge}"


def client_proc_node(k: int) -> str:
    """The node id of client process `k` of the process plan."""
    return f"{_CLIENT_PROC}{k}"


def _number(node_id: str, role: str) -> int | None:
    """n of `<role>-<n>` (n a non-negative decimal in ASCII digits), else None."""
    head, _, num = node_id.partition("-")
    return int(num) if head == role and num.isascii() and num.isdigit() else None


def client_id_of(node_id: str) -> int:
    """The logical client a node id names, or -1 when it names none (a process, an edge, the server)."""
    cid = _number(node_id, _CLIENT)
    return -1 if cid is None else cid


def client_id(node_id: str) -> int:
    """The logical client a node id names; ValueError when it names none."""
    cid = _number(node_id, _CLIENT)
    if cid is None:
        raise ValueError(f"'{node_id}' is not a logical client id")
    return cid


def edge_index(node_id: str) -> int:
    """The edge a node id names; ValueError when it names none."""
    edge = _number(node_id, _EDGE)
    if edge is None:
        raise ValueError(f"'{node_id}' is not an edge node id (expected edge-<n>)")
    return edge


__all__ = ["SERVER", "client_node", "edge_node", "client_proc_node", "client_id_of", "client_id", "edge_index"]


def id_spec(ids: Sequence[int]) -> str:
    """[0,1,2,5] -> '0-2,5' for the client command line."""
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(f"{ids[i]}-{ids[j]}" if j > i else str(ids[i]))
        i = j + 1
    return ",".join(parts)
