"""Checkpoint files: everything a run needs to continue exactly where it stopped.

One checkpoint is one safetensors file, `RUN_DIR/checkpoints/round-NNNNNN.safetensors`, written
atomically (temporary file, fsync, rename, fsync of the directory), so a server killed while
writing leaves the previous checkpoint intact.  It holds

- tensors: the model (`params/NAME`: the parameters the run exchanges; under model.exchange
  other than "all" the frozen rest under `frozen/NAME`, so a checkpoint holds the whole model),
  the algorithm's server state (`extra/NAME`: moments,
  control variates, dual sums), the persistent state of every logical client that has some
  (`client/ID/KEY`: SCAFFOLD's c_i, FedDyn's gradient memory, ...; a client without state is not
  listed, so a stateless algorithm's checkpoint does not grow with the clients), each edge's own state (`node/EDGE/KEY`: the
  error-feedback residuals and compressor memory of its partials, its broadcast reference), the
  server's torch RNG state (`rng/torch`);
- metadata (JSON under the key "fedhop"): format, round, run id, the algorithm's scalars, the
  numpy global RNG state, failures so far, the ledger position (message and event counts in
  run.db), the config's SHA-256.

What is not saved because it is derived: every random choice of round r draws from a stream
named after (seed, purpose, r) (common/util/rng.py): sampling ("sampling", r), minibatches ("client",
i, "round", r), stragglers; so the sampler's state *is* the round number.

Client state lives in the client processes during a run; at each checkpoint the server pulls it
(`state_get` calls, counted in the ledger like any message: each reply is the whole state of the
answering process's clients, those without state left out) and on resume pushes it back to the
fresh processes (`state_set`), so a resumed run needs no files on the client machines.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedhop.common.transport.control import control_of
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method

log = logging.getLogger("fedhop.checkpoint")

FORMAT = 1
DIRNAME = "checkpoints"
_NAME = re.compile(r"round-(\d{6,})\.safetensors$")
STATE_GET, STATE_SET = Method.STATE_GET, Method.STATE_SET


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not belong to this run/config."""


@dataclass
class Checkpoint:
    round: int
    run_id: str
    params: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)   # parameters not exchanged (model.exchange)
    scalars: dict[str, Any] = field(default_factory=dict)
    client_states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    node_states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)   # an edge's own (NODE_PREFIX)
    torch_rng: torch.Tensor | None = None
    numpy_rng: dict | None = None
    failures_total: int = 0
    ledger: dict[str, int] = field(default_factory=dict)
    config_sha256: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def config_digest(config_toml: str) -> str:
    return hashlib.sha256(config_toml.encode()).hexdigest()


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / DIRNAME


def checkpoint_path(run_dir: str | os.PathLike, round: int) -> Path:
    return checkpoint_dir(run_dir) / f"round-{round:06d}.safetensors"


def _numpy_state_to_json(state: tuple) -> dict:
    name, keys, pos, has_gauss, cached = state
    return {"name": name, "keys": base64.b64encode(np.asarray(keys, dtype=np.uint32).tobytes()).decode(),
            "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def _numpy_state_from_json(d: dict) -> tuple:
    keys = np.frombuffer(base64.b64decode(d["keys"]), dtype=np.uint32).copy()
    return (d["name"], keys, d["pos"], d["has_gauss"], d["cached"])


def capture_rng() -> tuple[torch.Tensor, dict]:
    return torch.get_rng_state().clone(), _numpy_state_to_json(cast(tuple, np.random.get_state()))   # numpy stubs: legacy=True gives the tuple


def restore_rng(ckpt: Checkpoint) -> None:
    if ckpt.torch_rng is not None:
        torch.set_rng_state(ckpt.torch_rng)
    if ckpt.numpy_rng:
        np.random.set_state(_numpy_state_from_json(ckpt.numpy_rng))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | os.PathLike, ckpt: Checkpoint, keep: int = 2) -> Path:
    """Write `ckpt` atomically; keep the newest `keep` checkpoints.  Returns the file."""
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, group in (("params", ckpt.params), ("extra", ckpt.extra), ("frozen", ckpt.frozen)):
        for name, t in group.items():
            tensors[f"{prefix}/{name}"] = t.detach().cpu().contiguous().clone()
    for cid, state in ckpt.client_states.items():
        for key, t in state.items():
            tensors[f"client/{int(cid)}/{key}"] = t.detach().cpu().contiguous().clone()
    for node, state in ckpt.node_states.items():
        for key, t in state.items():
            tensors[f"node/{node}/{key}"] = t.detach().cpu().contiguous().clone()
    if ckpt.torch_rng is not None:
        tensors["rng/torch"] = ckpt.torch_rng.clone()
    meta = {"format": FORMAT, "round": ckpt.round, "run_id": ckpt.run_id, "scalars": ckpt.scalars,
            "numpy_rng": ckpt.numpy_rng, "failures_total": ckpt.failures_total, "ledger": ckpt.ledger,
            "config_sha256": ckpt.config_sha256, "clients": sorted(int(c) for c in ckpt.client_states),
            "info": ckpt.info}
    final = checkpoint_path(run_dir, ckpt.round)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"fedhop": json.dumps(meta)})
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(d)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def _named_entries(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)))


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:   # a dangling link, a loop
        return False


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint files of a run, oldest first (regular files only: `not_checkpoints` names the rest)."""
    return [p for _, p in _named_entries(run_dir) if _is_regular(p)]


def not_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Entries of the checkpoints folder named like a checkpoint that are no regular file (a
    folder, a FIFO, which an open would wait on forever, a dangling link): a resume refuses them,
    since the run would later have to write a checkpoint where one of them is."""
    return [p for _, p in _named_entries(run_dir) if not _is_regular(p)]


#: the largest round a checkpoint may name (a run's rounds are far fewer; sqlite and torch take it)
MAX_ROUND = 2**31 - 1


def _count(meta: dict, key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if type(value) is not int or not 0 <= value <= MAX_ROUND:
        raise ValueError(f"{key} is {json.dumps(value)[:40]}, not a count (an integer 0..{MAX_ROUND})")
    return value


def _check_rng(torch_rng: torch.Tensor | None, numpy_rng: Any) -> None:
    """The RNG states must be ones the generators accept (tried on throwaway generators), so that
    a resume fails here, naming the file, and not after the run has started again."""
    if torch_rng is not None:
        torch.Generator().set_state(torch_rng)
    if numpy_rng:
        if not isinstance(numpy_rng, dict):
            raise ValueError("numpy_rng is not an object")
        np.random.RandomState().set_state(_numpy_state_from_json(numpy_rng))


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint file (safetensors: no code runs while loading); a file that is not one,
    or whose fields hold values of another kind, is a CheckpointError naming it."""
    path = Path(path)
    if not _is_regular(path):
        raise CheckpointError(f"checkpoint {path}: not a regular file")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("fedhop", "{}"))
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint {path}: format {found!r}, this fedhop reads format {FORMAT}")
    try:
        return _checkpoint(meta, tensors)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RuntimeError) as exc:
        why = f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else str(exc).splitlines()[0][:200]
        raise CheckpointError(f"checkpoint {path}: {why}") from None


def _checkpoint(meta: dict, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    for key in ("scalars", "ledger", "info"):
        if not isinstance(meta.get(key) or {}, dict):
            raise ValueError(f"{key} is not an object")
    ckpt = Checkpoint(round=_count(meta, "round"), run_id=str(meta["run_id"]), params={},
                      scalars=dict(meta.get("scalars") or {}), numpy_rng=meta.get("numpy_rng"),
                      failures_total=_count(meta, "failures_total", 0), ledger=dict(meta.get("ledger") or {}),
                      config_sha256=str(meta.get("config_sha256", "")), info=dict(meta.get("info") or {}))
    clients = meta.get("clients", [])
    if not isinstance(clients, list) or not all(type(c) is int and c >= 0 for c in clients):
        raise ValueError("clients is not a list of client ids")
    for cid in clients:
        ckpt.client_states[cid] = {}
    for key, t in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "params":
            ckpt.params[rest] = t
        elif kind == "extra":
            ckpt.extra[rest] = t
        elif kind == "frozen":
            ckpt.frozen[rest] = t
        elif kind == "client":
            cid, _, name = rest.partition("/")
            if not cid.isdigit():
                raise ValueError(f"tensor {key!r}: {cid!r} is not a client id")
            ckpt.client_states.setdefault(int(cid), {})[name] = t
        elif kind == "node":
            node, _, name = rest.partition("/")
            ckpt.node_states.setdefault(node, {})[name] = t
        elif key == "rng/torch":
            ckpt.torch_rng = t
    _check_rng(ckpt.torch_rng, ckpt.numpy_rng)
    return ckpt


def latest_checkpoint(run_dir: str | os.PathLike,
                      on_skip: Callable[[str], None] | None = None) -> Checkpoint:
    """The newest readable checkpoint of a run.  An unreadable newer one (truncated, corrupt) is
    skipped with a warning, and `on_skip(why)` is told (the server records an event)."""
    odd = not_checkpoints(run_dir)
    if odd:
        raise CheckpointError(f"{odd[0]} is not a checkpoint file (a regular file) but holds a checkpoint's name; "
                              f"move it out of {checkpoint_dir(run_dir)}")
    errors = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return load_checkpoint(path)
        except CheckpointError as exc:
            errors.append(str(exc))
            log.warning("checkpoint %s skipped: %s", path.name, exc)
            if on_skip is not None:
                on_skip(f"{path.name} skipped: {exc}")
    where = checkpoint_dir(run_dir)
    raise CheckpointError(f"no usable checkpoint in {where}" + (f" ({'; '.join(errors)})" if errors else
                          ": the run had run.checkpoint_every = 0, or was killed before its first checkpoint"))


def check_frozen(ckpt: Checkpoint, frozen: dict[str, torch.Tensor]) -> None:
    """Resume: the parameters this run does not exchange (`frozen`, as the config builds them)
    must be the checkpoint's, name for name and bit for bit: every party rebuilds them from the
    seeded init or the model factory, never from the checkpoint, so a factory whose pretrained
    weights changed since would silently train another model."""
    names = sorted(set(frozen) ^ set(ckpt.frozen))
    if names:
        raise CheckpointError(f"checkpoint of round {ckpt.round}: frozen parameters differ from the config's "
                              f"model.freeze / model.exchange: {names[:10]}")
    changed = [n for n, t in frozen.items() if not torch.equal(t.detach().cpu(), ckpt.frozen[n])]
    if changed:
        raise CheckpointError(f"checkpoint of round {ckpt.round}: frozen parameters {changed[:10]} differ from the "
                              f"model this config builds (its factory or pretrained weights changed)")


# ----------------------------------------------------------------------------- client state on the wire
def states_to_payload(states: dict[int, dict[str, torch.Tensor]]) -> Payload:
    """Logical clients' persistent states as one payload: tensor 'ID/KEY' per entry; the control
    data's `clients` lists every client id given (an empty state listed clears that client's on
    `state_set`; a `state_get` reply lists only the clients that have state)."""
    tensors = {f"{cid}/{key}": t for cid in sorted(states) for key, t in states[cid].items()}
    return Payload(tensors=tensors, control=pb.Control(clients=sorted(states)))


NODE_PREFIX = "node/"   # a state payload's tensors of the answering node's own state (an edge's)


def split_node_state(payload: Payload) -> tuple[dict[str, torch.Tensor], Payload]:
    """A state payload's node's own state (tensors 'node/KEY', cloned) and the rest (the clients')."""
    own = {n[len(NODE_PREFIX):]: t.clone() for n, t in payload.tensors.items() if n.startswith(NODE_PREFIX)}
    rest = {n: t for n, t in payload.tensors.items() if not n.startswith(NODE_PREFIX)}
    return own, Payload(tensors=rest, scalars=dict(payload.scalars), control=payload.control)


def with_node_state(payload: Payload, own: dict[str, torch.Tensor]) -> Payload:
    """`payload` with the node's own state added (`split_node_state` takes it apart)."""
    tensors = {**payload.tensors, **{NODE_PREFIX + k: t for k, t in own.items()}}
    return Payload(tensors=tensors, scalars=dict(payload.scalars), control=payload.control)


def states_from_payload(payload: Payload, allowed: Collection[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Inverse of `states_to_payload`; tensors are cloned (writable, own storage).  Raises
    ValueError for a name that is not 'ID/KEY' or an id outside `allowed` (read only when the
    payload names some client: a process's hosted ids need no set for an empty reply)."""
    out: dict[int, dict[str, torch.Tensor]] = {int(c): {} for c in control_of(payload).clients}
    for name, t in payload.tensors.items():
        cid, sep, key = name.partition("/")
        if not sep or not cid.isdigit() or not key:
            raise ValueError(f"client state payload: tensor name '{name}' is not 'CLIENT_ID/KEY'")
        out.setdefault(int(cid), {})[key] = t.clone()
    if allowed is not None and out:
        stray = sorted(set(out).difference(allowed))
        if stray:
            raise ValueError(f"client state payload names clients {stray[:10]} not hosted here")
    return out


def forward_client_state(endpoint, processes: dict[str, str], client_home: dict[int, tuple[str, str]], method: str,
                         round: int, payload: Payload, timeout: float) -> Payload:
    """An edge's part in checkpoints: gather its client processes' states (state_get) or hand
    each process the states of the clients it hosts (state_set)."""
    if method == STATE_GET:
        merged: dict[int, dict[str, torch.Tensor]] = {}
        for node, address in sorted(processes.items()):
            reply = endpoint.call(address, node, STATE_GET, Payload(), round=round, timeout=timeout)
            merged.update(states_from_payload(reply))
        return states_to_payload(merged)
    states = states_from_payload(payload, allowed=set(client_home))
    by_process: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    for cid, state in states.items():
        by_process.setdefault(client_home[cid], {})[cid] = state
    for (node, address), part in sorted(by_process.items()):
        endpoint.call(address, node, STATE_SET, states_to_payload(part), round=round, timeout=timeout)
    return Payload(scalars={"clients": len(states)})
