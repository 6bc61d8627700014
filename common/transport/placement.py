"""Where each process computes: device specs, the GPU map of client processes, and the seam.

Configuration (docs/gpus.md):

- ``run.device`` (the server), ``edges.device`` and ``clients.device``: ``"cpu"`` (default),
  ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when this machine has a CUDA device, else the CPU).
- ``clients.gpus = [0, 1]``: the CUDA devices the client processes are spread over,
  round-robin (client process k on ``gpus[k % len(gpus)]``); empty = every visible device.
  ``clients.processes_per_gpu``: at most this many client processes per GPU (0 = no limit).

Device indices are those torch sees, so they honour ``CUDA_VISIBLE_DEVICES`` (with
``CUDA_VISIBLE_DEVICES=2,3``, ``cuda:0`` is physical GPU 2).  A device that does not exist is a
`DeviceError` (one line, exit 2) before any process starts; a process started by hand checks its
own device the same way when it starts.

The seam (DESIGN.md section 6): every message is encoded from and decoded into CPU memory, so a
tensor crosses between the CPU and a process's device exactly once per message: on arrival, when
the endpoint places the decoded payload on its device (`to_device`, one copy per tensor), and on
departure, when the codec reads the tensor's bytes (common/wire/codec.py `tensor_bytes_view`, one copy
per tensor, once however many peers receive the message).  Models, batches, client state and the
server's state stay on the device between messages.  `CROSSINGS` counts the arrivals, so a test can
check the rule with the CPU standing in for a device.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any, Sequence

import torch

from fedhop.common.transport.factory import own_device_per_process
from fedhop.common.wire.message import Payload

DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
DEVICE_HELP = '"cpu", "cuda" (spread over the visible GPUs), "cuda:N" or "auto" (CUDA when present, else cpu)'

#: arrivals placed on a device: "messages" and "tensors" (`to_device`)
CROSSINGS: Counter = Counter()
_process_device = torch.device("cpu")   # what `configure` set up in this process


class DeviceError(ValueError):
    """A device spec that is malformed or names a device this machine does not have."""


def check_spec(key: str, spec: str) -> None:
    """Raise DeviceError naming `key` unless `spec` is a device spec (its syntax only)."""
    if not isinstance(spec, str) or not DEVICE_SPEC.match(spec):
        raise DeviceError(f"config key '{key}': got {spec!r}, expected {DEVICE_HELP}")


def cuda_count() -> int:
    """CUDA devices torch can use here (0 without a CUDA build or driver).  Counted through NVML
    where it can be, which leaves CUDA uninitialised: the launcher may still fork its children."""
    try:
        return max(torch.cuda.device_count(), 0)
    except Exception:  # a CUDA build without a usable driver
        return 0


def resolve(spec: str, key: str, count: int | None = None) -> str:
    """`spec` as this machine runs it: "cpu" or "cuda:N" ("cuda" and "auto" give cuda:0)."""
    check_spec(key, spec)
    if spec == "cpu":
        return "cpu"
    count = cuda_count() if count is None else count
    if spec == "auto" and count == 0:
        return "cpu"
    index = 0 if spec in ("auto", "cuda") else int(spec.split(":")[1])
    if count == 0:
        raise DeviceError(f"config key '{key}' = {spec!r}: this machine has no CUDA device "
                          f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={_visible()})")
    if index >= count:
        raise DeviceError(f"config key '{key}' = {spec!r}: no such device; this machine has {count} CUDA "
                          f"device(s), cuda:0..cuda:{count - 1} (CUDA_VISIBLE_DEVICES={_visible()})")
    return f"cuda:{index}"


def _visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset")


def client_devices(spec: str, gpus: Sequence[int], processes_per_gpu: int, processes: int,
                   count: int | None = None) -> list[str]:
    """The device of each client process 0..processes-1 (`clients.device`, `clients.gpus`,
    `clients.processes_per_gpu`): round-robin over the GPUs."""
    check_spec("clients.device", spec)
    count = cuda_count() if count is None else count
    if spec == "cpu" or (spec == "auto" and count == 0):
        if gpus:
            raise DeviceError(f"config key 'clients.gpus' = {list(gpus)}: needs clients.device = \"cuda\" or "
                              f"\"auto\" on a machine with CUDA (clients.device = {spec!r})")
        return ["cpu"] * processes
    if spec.startswith("cuda:"):
        if gpus:
            raise DeviceError(f"config key 'clients.gpus' = {list(gpus)}: give either clients.gpus or "
                              f"clients.device = {spec!r}, not both")
        pool = [int(resolve(spec, "clients.device", count).split(":")[1])]
    else:
        resolve("cuda", "clients.device", count)   # raises without CUDA
        pool = list(gpus) if gpus else list(range(count))
        for g in pool:
            if not 0 <= g < count:
                raise DeviceError(f"config key 'clients.gpus': no device {g}; this machine has {count} CUDA "
                                  f"device(s), 0..{count - 1} (CUDA_VISIBLE_DEVICES={_visible()})")
    if processes_per_gpu and processes > processes_per_gpu * len(pool):
        raise DeviceError(f"config key 'clients.processes_per_gpu' = {processes_per_gpu}: {processes} client "
                          f"processes do not fit on {len(pool)} GPU(s) {pool}")
    return [f"cuda:{pool[k % len(pool)]}" for k in range(processes)]


def check_gpus(gpus: Any) -> None:
    """`clients.gpus`: a list of distinct non-negative device indices."""
    if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0
                                             for g in gpus):
        raise DeviceError(f"config key 'clients.gpus': got {gpus!r}, expected a list of GPU indices like [0, 1]")
    if len(set(gpus)) != len(gpus):
        raise DeviceError(f"config key 'clients.gpus': got {gpus!r}, each GPU at most once "
                          f"(several processes per GPU: clients.processes_per_gpu)")


# ----------------------------------------------------------------------------- in a process
def configure(device: str) -> torch.device:
    """Set the process up for `device` ("cpu" or "cuda:N"): CUDA's deterministic modes, so a
    run on a GPU is reproducible from its seed (ops without a deterministic kernel warn)."""
    global _process_device
    dev = _process_device = torch.device(device)
    if dev.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS (before its first use)
        torch.cuda.set_device(dev)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False    # float32 as on the CPU, within rounding
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    return dev


def current() -> torch.device:
    """This process's device (`configure`; the CPU until a role sets one up)."""
    return _process_device


def collective_device(backend: str) -> torch.device:
    """Where torch.distributed moves tensors: the process's own GPU for NCCL (cuda:0 when the
    process computes on the CPU), the CPU for gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    return _process_device if _process_device.type == "cuda" else torch.device("cuda", 0)


def to_host(payload: Payload) -> Payload:
    """The departure side of the seam for a payload that is processed further on the CPU before
    it is encoded (a client's reply before QSGD): its tensors in CPU memory."""
    if any(t.device.type != "cpu" for t in payload.tensors.values()):
        payload.tensors = {k: v.cpu() for k, v in payload.tensors.items()}
    return payload


def to_device(payload: Payload, device: torch.device | None) -> Payload:
    """The arrival side of the seam: `payload`'s tensors on `device` (None: left where they are)."""
    if device is None or not payload.tensors:
        return payload
    CROSSINGS["messages"] += 1
    CROSSINGS["tensors"] += len(payload.tensors)
    payload.tensors = {k: v.to(device) for k, v in payload.tensors.items()}
    return payload


def flag_error(spec: str) -> str:
    """Why a role's `--device` flag cannot be used here ("" when it can, or when none was given)."""
    try:
        if spec:
            resolve(spec, "--device")
    except DeviceError as exc:
        return str(exc)
    return ""


def process_device(spec: str | None, cfg_spec: str, key: str) -> torch.device:
    """The device a role process computes on: its own `--device` / FEDHOP_DEVICE when given
    (the launcher's GPU map), else the config's `key`; resolved on this machine and set up."""
    chosen = spec or cfg_spec
    return configure(resolve(chosen, "--device" if spec else key))


def resolve_config(cfg: Any, count: int | None = None) -> None:
    """Replace "auto" in the config's device keys by what this machine gives ("cpu", "cuda" or
    "cuda:0"), so the run's config.toml records the choice; raises DeviceError for a device
    that does not exist."""
    count = cuda_count() if count is None else count
    for section, key in ((cfg.run, "run.device"), (cfg.edges, "edges.device")):
        section.device = resolve(section.device, key, count)
    if cfg.clients.device == "auto":
        cfg.clients.device = "cuda" if count else "cpu"


def plan_devices(cfg: Any, plan: Any, count: int | None = None) -> dict[str, str]:
    """node id -> device of every process of `plan` (common/topologies/plan.py): the server on run.device,
    every edge on edges.device, the client processes round-robin over their GPUs."""
    count = cuda_count() if count is None else count
    if own_device_per_process(cfg.transport.kind, cfg.transport.options):
        return nccl_devices(plan.node_ids, count)
    out = {plan.server.node_id: resolve(cfg.run.device, "run.device", count)}
    for edge in plan.edges:
        out[edge.node_id] = resolve(cfg.edges.device, "edges.device", count)
    clients = plan.clients
    for proc, device in zip(clients, client_devices(cfg.clients.device, cfg.clients.gpus,
                                                    cfg.clients.processes_per_gpu, len(clients), count)):
        out[proc.node_id] = device
    return out


def nccl_devices(node_ids: Sequence[str], count: int) -> dict[str, str]:
    """NCCL runs one rank per GPU (two ranks on one device are refused by NCCL itself), and
    every process of a torch-transport run is a rank: each gets its own GPU, in plan order
    (server, edges, client processes); the device keys do not apply."""
    if count < len(node_ids):
        raise DeviceError(f"config key 'transport.backend' = 'nccl': NCCL needs one GPU per process and this run "
                          f"has {len(node_ids)} processes (server, edges, client processes) for {count} CUDA "
                          f"device(s) (CUDA_VISIBLE_DEVICES={_visible()}); use backend = \"gloo\" or fewer processes")
    return {node: f"cuda:{k}" for k, node in enumerate(node_ids)}


def describe(devices: dict[str, str]) -> str:
    """One line: which processes compute where ("server cpu; client-proc0-1 cuda:0, ...")."""
    by_device: dict[str, list[str]] = {}
    for node, device in devices.items():
        by_device.setdefault(device, []).append(node)
    return "; ".join(f"{device}: {', '.join(nodes)}" for device, nodes in by_device.items())
