"""torch.distributed data plane: model broadcasts and result reductions as collectives.

With `[transport] kind = "torch"` the control messages (registration, the round's sampled
clients, failures, scalars) stay on gRPC, while the tensors travel as collectives over one
process group: the server is rank 0, client process k (in node-id order) is rank k + 1.

Per round (star):
  1. the server broadcasts every tensor of the algorithm's broadcast message (`dist.broadcast`,
     src 0) to every client process;
  2. each client process trains its sampled logical clients and reduces their replies locally
     with the algorithm's own `aggregate` (exactly as an edge pre-aggregates);
  3. after a control round-trip that agrees on the tensor layout, the partial aggregates are
     summed into rank 0 (`dist.reduce`, SUM; MAX/MIN for fields that reduce that way).

Ledger: each collective is recorded per participating rank as a message between the server
and that rank: `tensor_bytes` is the tensor data the rank receives (broadcast) or contributes
(reduce); `payload_bytes` and `framed_bytes` are that size times the collective's algorithm
factor (`ALGO_FACTOR`, the bytes per rank gloo's algorithm moves relative to the buffer); the
method names the collective.  The summation order differs from the gRPC path (per process,
then across processes), so results equal gRPC's within float rounding, not bit for bit.

Hierarchical topology (docs/torch_transport.md): the same collectives run in process groups
(`build_groups`; `Collectives.scoped` picks the group, its root and the ledger link): a top
group of the server and the edges (link edge-server) and one group per edge cluster (link
client-edge, rooted at the edge).
"""
from __future__ import annotations

import copy
import datetime
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from fedhop.common.transport.base import direction_of
from fedhop.common.transport.placement import collective_device, current
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import DTYPE_NAMES, DTYPES
from fedhop.common.wire.ledger import Ledger

# bytes a rank moves per byte of buffer: a broadcast delivers the buffer once to each
# non-root rank; a reduce to one root sends each non-root rank's buffer once.
ALGO_FACTOR = {"broadcast": 1.0, "reduce": 1.0, "send": 1.0}

REDUCE_OPS = {"wsum": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}


@dataclass
class TorchParams:
    """[transport] keys of kind = "torch".

    `backend`: the torch.distributed backend: gloo (CPU) or nccl (CUDA)
    """

    backend: str = field(default="gloo", metadata={"choices": ("gloo", "nccl")})
    timeout: float = field(default=120.0, metadata={"min_exclusive": 0.0})   # seconds for init and each collective
    master_port: int = field(default=0, metadata={"min": 0, "max": 65535})    # 0: the store binds port 0


def rank_per_gpu(options: dict) -> bool:
    """NCCL runs one rank per GPU, and every process of a torch-transport run is a rank
    (common/transport/factory.py `Transport.own_device`)."""
    return options.get("backend") == "nccl"


def free_port(host: str) -> int:
    """A port that was free a moment ago, for a test that must name a port before starting a
    process that binds it.  fedhop itself never binds a port chosen this way (another process
    can take it in between): the rendezvous master binds first (`master_store`), every gRPC
    server binds port 0 and reports what it got."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


DEFAULT_PG_PREFIX = "default_pg"   # torch's init_process_group puts a tcp:// rendezvous's keys under it


def master_store(host: str, port: int, world_size: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store of a world, hosted by the process that will be rank 0, listening
    before any other rank is told where it is: `port` 0 lets the kernel pick a port at bind time
    (`store.port` is the one it got), so no other process can take the port between its choice
    and its bind.  A fixed `port` (transport.params.master_port) is bound as given."""
    return dist.TCPStore(host, port, world_size, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)


def master_address(host: str, store: dist.TCPStore) -> str:
    """HOST:PORT of a `master_store`, for the other ranks' tcp:// init method ([v6] bracketed)."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{shown}:{store.port}"


def specs_of(tensors: dict[str, torch.Tensor]) -> list[pb.TensorSpec]:
    """The typed specs of a broadcast's tensors (proto `Control.specs`)."""
    return [pb.TensorSpec(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape),
                          nbytes=t.numel() * t.element_size()) for name, t in tensors.items()]


def specs_from_pb(specs: Iterable[pb.TensorSpec]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    out = []
    for spec in specs:
        if spec.dtype not in DTYPES:
            raise ValueError(f"unknown dtype '{spec.dtype}' for tensor '{spec.name}'")
        out.append((spec.name, DTYPES[spec.dtype], tuple(int(d) for d in spec.shape)))
    return out


class Collectives:
    """One process's membership of the run's process group, with ledger records."""

    def __init__(self, node_id: str, rank: int, world_size: int, ledger: Ledger, params: TorchParams,
                 run_id: str) -> None:
        self.node_id = node_id
        self.rank = rank
        self.world_size = world_size
        self.ledger = ledger
        self.params = params
        self.run_id = run_id
        # collectives on the process's own GPU under NCCL; results stay on the process's device
        self.device = collective_device(params.backend)
        self.home = current()
        # the group the collectives run in (None: the whole world), its root's global rank and
        # node id, and the ledger link; star: the world, rooted at the server (rank 0)
        self.group = None
        self.root = 0
        self.root_node = "server"
        self.link = "client-server"

    def scoped(self, group, root: int, root_node: str, link: str) -> "Collectives":
        """The same membership, with collectives in `group` rooted at global rank `root`
        (hierarchical: the top group rooted at the server, a cluster group rooted at its edge)."""
        view = copy.copy(self)
        view.group, view.root, view.root_node, view.link = group, root, root_node, link
        return view

    def init(self, master: str, store: dist.Store | None = None) -> None:
        """Join the world: through `store` when this process hosts it (rank 0, `master_store`),
        else through the store at `master` (HOST:PORT)."""
        timeout = datetime.timedelta(seconds=self.params.timeout)
        if store is not None:
            # the keys under the prefix a tcp:// rendezvous gives the other ranks' default group
            dist.init_process_group(self.params.backend, store=dist.PrefixStore(DEFAULT_PG_PREFIX, store),
                                    rank=self.rank, world_size=self.world_size, timeout=timeout)
            return
        dist.init_process_group(self.params.backend, init_method=f"tcp://{master}", rank=self.rank,
                                world_size=self.world_size, timeout=timeout)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -------------------------------------------------------------------------- collectives
    def broadcast(self, tensors: list[torch.Tensor], round: int, peers: list[str], step: int = 0) -> list[torch.Tensor]:
        """Broadcast from the root (star: rank 0); returns the tensors (received ones on non-root ranks)."""
        started = time.perf_counter()
        out = []
        for t in tensors:
            buf = t.to(self.device).contiguous()
            dist.broadcast(buf, src=self.root, group=self.group)
            out.append(buf.to(self.home))
        self._record("broadcast", round, sum(t.numel() * t.element_size() for t in tensors),
                     time.perf_counter() - started, peers, downward=True, step=step)
        return out

    def reduce(self, groups: list[tuple[str, list[torch.Tensor]]], round: int, peers: list[str],
               step: int = 0) -> None:
        """In-place reduce into the root (star: rank 0), one call per tensor, with each group's op."""
        started = time.perf_counter()
        nbytes = 0
        for op, tensors in groups:
            for t in tensors:
                buf = t.to(self.device)  # NCCL reduces CUDA tensors; gloo works on the CPU tensor itself
                dist.reduce(buf, dst=self.root, op=REDUCE_OPS[op], group=self.group)
                if buf is not t and self.rank == self.root:
                    t.copy_(buf)
                nbytes += t.numel() * t.element_size()
        self._record("reduce", round, nbytes, time.perf_counter() - started, peers, downward=False, step=step)

    def _record(self, method: str, round: int, nbytes: int, seconds: float, peers: list[str], downward: bool,
                step: int = 0) -> None:
        """The root records the sender (broadcast) or receiver (reduce) side for every peer; a
        non-root rank records its own side; both use the same msg_id (`step`: an edge iteration)."""
        moved = int(round_bytes(nbytes * ALGO_FACTOR[method]))
        tag = f"-s{step}" if step else ""
        for peer in peers:
            src, dst = (self.root_node, peer) if downward else (peer, self.root_node)
            i_am_src = (self.node_id == src)
            self.ledger.record(run_id=self.run_id, round=round, step=step, src=src, dst=dst, link=self.link,
                               direction="down" if downward else "up", method=f"torch.{method}",
                               tensor_bytes=nbytes, payload_bytes=moved, framed_bytes=moved, seconds=seconds,
                               recorder=self.node_id, role="sender" if i_am_src else "receiver",
                               msg_id=f"{self.run_id}-r{round}{tag}-{method}-{peer}", status="ok",
                               wall_time=time.time(), error="")


    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst_rank: int, dst_node: str, round: int, link: str) -> None:
        """`dist.send` of each tensor to global rank `dst_rank` (Fed-CHS: the model hand-off to the
        next edge, link edge-edge, or the final model to the server); the receiver must post
        `recv` with the same shapes, in the same order."""
        started = time.perf_counter()
        for t in tensors:
            dist.send(t.to(self.device).contiguous(), dst=dst_rank)
        self._record_p2p(round, sum(t.numel() * t.element_size() for t in tensors), time.perf_counter() - started,
                         src=self.node_id, dst=dst_node, link=link)

    def recv(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], src_rank: int, src_node: str, round: int,
             link: str) -> dict[str, torch.Tensor]:
        """The other end of `send`: one `dist.recv` per (name, dtype, shape), into fresh tensors on
        the process's device."""
        started = time.perf_counter()
        out = {}
        for name, dtype, shape in specs:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(buf, src=src_rank)
            out[name] = buf.to(self.home)
        self._record_p2p(round, sum(t.numel() * t.element_size() for t in out.values()), time.perf_counter() - started,
                         src=src_node, dst=self.node_id, link=link)
        return out

    def _record_p2p(self, round: int, nbytes: int, seconds: float, src: str, dst: str, link: str) -> None:
        moved = round_bytes(nbytes * ALGO_FACTOR["send"])
        self.ledger.record(run_id=self.run_id, round=round, step=0, src=src, dst=dst, link=link,
                           direction=direction_of(src, dst), method="torch.send",
                           tensor_bytes=nbytes, payload_bytes=moved, framed_bytes=moved, seconds=seconds,
                           recorder=self.node_id, role="sender" if self.node_id == src else "receiver",
                           msg_id=f"{self.run_id}-r{round}-send-{src}-{dst}", status="ok", wall_time=time.time(),
                           error="")


def init_watching(coll: "Collectives", master: str, calls: dict, what: str, store: dist.Store | None = None) -> None:
    """Join the world (`coll.init`, through `store` when this process hosts it) while watching
    the control calls that asked the other ranks to join (node id -> future): if one of them
    fails, because a process died or refused, the set-up fails at once and names it, instead of
    waiting out the store's timeout for a rank that will never come.  (The join left blocked in
    its daemon thread ends with the process.)"""
    outcome: dict[str, BaseException] = {}

    def join() -> None:
        try:
            coll.init(master, store)
        except BaseException as exc:   # re-raised below, in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=join, daemon=True, name=f"torch-init-{coll.node_id}")
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
        for node, fut in sorted(calls.items()):
            if fut.done() and fut.exception() is not None:
                raise RuntimeError(f"{what}: {node} did not join torch.distributed: {fut.exception()}")
    if "error" in outcome:
        raise RuntimeError(f"{what}: {outcome['error']}")


def round_bytes(x: float) -> int:
    return int(x + 0.5)


# ----------------------------------------------------------------------------- hierarchical
IDENTITY = {"wsum": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


def build_groups(groups: list[list[int]], timeout: float) -> list:
    """Create the hierarchical topology's process groups (transports/torch/groups.py): every rank of
    the world calls this with the same list, in the same order (`new_group` is collective over
    the world); returns one handle per group (a non-member gets a handle it must not use)."""
    return [dist.new_group(ranks=sorted(ranks), timeout=datetime.timedelta(seconds=timeout)) for ranks in groups]


def layout_of(tensors: dict[str, torch.Tensor], ops) -> list[pb.ReduceEntry]:
    """The typed layout (name, dtype, shape, reduce op) of a partial aggregate's tensors."""
    return [pb.ReduceEntry(name=n, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), op=ops.get(n, "wsum"))
            for n, t in tensors.items()]


def _entry_text(e: pb.ReduceEntry) -> str:
    return f"[{e.dtype!r}, {list(e.shape)}, {e.op!r}]"


def merge_layouts(layouts: dict[str, Sequence[pb.ReduceEntry]], where: str) -> list[pb.ReduceEntry]:
    """The layout every rank of a reduce uses: the union of the ranks' partial layouts (from
    `layout_of`, keyed by node id), in first-seen order over the sorted node ids.

    A tensor held by only some ranks (FedLGA's per-client straggler deltas, named by client id)
    is contributed by the others as the op's identity (`reduce_buffers`), so the root receives it
    exactly (x + 0 = x): a gather by reduce, whose cost the ledger counts (every rank sends the
    whole union).  The same name with another dtype, shape or op is a LAYOUT_MISMATCH."""
    merged: dict[str, pb.ReduceEntry] = {}
    owner: dict[str, str] = {}
    for node in sorted(layouts):
        for entry in layouts[node]:
            name = entry.name
            if name in merged and merged[name] != entry:
                raise LayoutMismatch(f"{where}: tensor '{name}' is {_entry_text(merged[name])} at {owner[name]} but "
                                     f"{_entry_text(entry)} at {node} ([dtype, shape, reduce op])")
            merged.setdefault(name, entry)
            owner.setdefault(name, node)
    return list(merged.values())


class LayoutMismatch(ValueError):
    """Ranks report the same tensor name with another dtype, shape or reduce op."""


def reduce_buffers(layout: Sequence[pb.ReduceEntry], tensors: dict[str, torch.Tensor] | None) -> list[tuple[str, list[torch.Tensor]]]:
    """The buffers one rank contributes to a reduce of `layout`, grouped by op in sorted op order
    (the order every rank of the group uses): copies of its own tensors, or the op's identity
    where it has none.  On the root the same buffers receive the result."""
    groups: dict[str, list[torch.Tensor]] = {}
    for e in layout:
        if tensors is not None and e.name in tensors:
            t = tensors[e.name].contiguous().clone()
        else:
            t = torch.full(tuple(e.shape), IDENTITY[e.op], dtype=DTYPES[e.dtype])
        groups.setdefault(e.op, []).append(t)
    return sorted(groups.items())


def buffers_by_name(layout: Sequence[pb.ReduceEntry], buffers: list[tuple[str, list[torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Inverse of `reduce_buffers`: name -> reduced tensor, in layout order."""
    queues = {op: list(ts) for op, ts in buffers}
    out = {}
    for e in layout:
        out[e.name] = queues[e.op].pop(0)
    return out
