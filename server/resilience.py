"""The server's side of reliability: checkpoints, resume, and the fault section of summary.json.

    ckpt = Checkpointer(coordinator)        # writes run.checkpoint_every checkpoints (common/records/checkpoint.py)
    resume(coordinator)                     # before serving: continue from the newest checkpoint

Checkpoint after round r (r % checkpoint_every == 0, and after the last round): the server pulls
every client process's persistent client state (`state_get`, through the edges in the
hierarchical topology) and writes one atomic file with the model, the algorithm's server state,
the client states, RNG states and the ledger position.

Resume: the coordinator takes the checkpoint's run id, model, state, round and failure count; the
run store keeps every row, but the messages and events of rounds after the checkpoint -- the
attempt the killed server did not finish -- are marked (messages: status 'lost', error
'aborted: ...'; events: kind 'aborted:KIND') and their round rows removed, so those rounds are
stored once, as re-run.  When the new client processes have registered, `on_ready` pushes the
saved client states to them (`state_set`), and the rounds go on from r + 1 with the same
sampling and minibatch streams, so the final model equals an uninterrupted run's bit for bit.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from fedhop.common.algorithms.local import frozen_params
from fedhop.common.processors.validation import rejection_code
from fedhop.common.records.checkpoint import (
    STATE_GET,
    STATE_SET,
    Checkpoint,
    CheckpointError,
    capture_rng,
    check_frozen,
    config_digest,
    latest_checkpoint,
    restore_rng,
    save_checkpoint,
    split_node_state,
    states_from_payload,
    states_to_payload,
    with_node_state,
)
from fedhop.common.transport.fabric import Send
from fedhop.common.wire.message import Payload
from fedhop.server.agreement import bounded_consistency
from fedhop.server.driver import driver_class

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.server.coordinator import Coordinator, RoundResult

log = logging.getLogger("fedhop.server")
#: `Checkpointer.states_by_node`'s key for restored client states not yet filed under a child
RESTORED = ""


class Checkpointer:
    """Writes checkpoints after rounds (a round listener of the coordinator) and pushes the
    restored client states after a resume (a ready listener)."""

    def __init__(self, coord: "Coordinator", every: int | None = None, keep: int | None = None) -> None:
        self.coord = coord
        self.every = coord.cfg.run.checkpoint_every if every is None else every
        self.keep = coord.cfg.security.keep_checkpoints if keep is None else keep
        # each hosting child's clients that have state, as last pulled (or restored): a child's
        # reply replaces all of its entry, and a dead child's last saved states stay
        self.states_by_node: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.node_states: dict[str, dict[str, torch.Tensor]] = {}     # edges' own, last pulled (or restored)
        self.restored: Checkpoint | None = None
        self.written: list[tuple[int, float]] = []                     # (round, seconds to write)
        coord.round_listeners.insert(0, self.after_round)   # the checkpoint is written before others hear of the round
        coord.ready_listeners.append(self.on_ready)

    # -- writing ---------------------------------------------------------------------
    def after_round(self, result: "RoundResult") -> None:
        r = result.round
        if self.every and (r % self.every == 0 or r == self.coord.cfg.run.rounds):
            self.save(r)

    def save(self, round: int) -> None:
        coord = self.coord
        started = time.perf_counter()
        self.pull(round)
        torch_rng, numpy_rng = capture_rng()
        coord.store_ledger()
        info = {"algorithm": coord.cfg.algorithm.name, "wall_time": time.time()}
        topology = coord.driver.checkpoint_state() if coord.driver is not None else None
        if topology is not None:   # e.g. a walk's holder and sequence (topologies/sequential/driver.py, topologies/chain/driver.py)
            info["topology"] = topology
        if coord.engine.privacy is not None:   # [privacy]: the accountant's rounds, C (common/privacy/mechanism.py)
            info["privacy"] = coord.engine.privacy.checkpoint_state()
        ckpt = Checkpoint(round=round, run_id=coord.run_id, params=coord.state.params, extra=coord.state.extra,
                          frozen=frozen_params(coord.model),   # model.exchange: the whole model is saved
                          scalars=dict(coord.state.scalars), client_states=self.client_states(),
                          node_states=self.node_states,
                          torch_rng=torch_rng, numpy_rng=numpy_rng, failures_total=coord.failures_total,
                          ledger=coord.store.row_counts(), config_sha256=config_digest(coord.config_toml),
                          info=info)
        path = save_checkpoint(coord.run_dir, ckpt, keep=self.keep)
        seconds = time.perf_counter() - started
        self.written.append((round, seconds))
        coord.store.add_event("checkpoint", node="server", round=round,
                              detail=f"{path.name}: {len(ckpt.client_states)} client states, {seconds:.3f}s")

    def pull(self, round: int) -> None:
        """Each answering hosting child's client states replace its entry (`pull_client_states`)."""
        self.states_by_node.update(self.pull_client_states(round))

    def client_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every client's state that a checkpoint holds, in the children's order."""
        return {cid: state for node in sorted(self.states_by_node) for cid, state in self.states_by_node[node].items()}

    def _children_hosting(self) -> list:
        """The children that host logical clients (client processes, or edges)."""
        return sorted(self.coord.children.values(), key=lambda n: n.node_id)

    def pull_client_states(self, round: int) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
        """Each answering hosting child's clients that have state (its `state_get` reply)."""
        out: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        nodes = [node for node in self._children_hosting() if node.clients or node.role == "edge"]
        ask = Payload()
        replies, failures = self.coord.fabric.send_to_all(
            [Send(node.node_id, node.address, node.node_id, STATE_GET, ask) for node in nodes],
            round=round, call_timeout=self.coord.cfg.run.call_timeout)
        for node in nodes:   # merged in node order, as the checkpoint lists them
            why = failures.get(node.node_id)
            if why is None:
                try:
                    own, reply = split_node_state(replies[node.node_id])
                    if own and node.role == "edge":   # the edge's own state (error feedback, broadcast reference)
                        self.node_states[node.node_id] = own
                    out[node.node_id] = {cid: state for cid, state in states_from_payload(
                        reply, allowed=node.clients or None).items() if state}
                except ValueError as exc:
                    why = str(exc)
            if why is not None:   # a dead child: its last saved state stays
                self.coord.store.add_event("checkpoint_partial", node=node.node_id, round=round,
                                           detail=f"client state not saved: {why}")
        return out

    # -- resume ----------------------------------------------------------------------
    def on_ready(self) -> None:
        """After registration: give the (fresh) client processes their saved states, and file
        each restored state under its hosting child (a state no child hosts stays as restored)."""
        if self.restored is None:
            return
        round = self.restored.round
        unhomed = self.states_by_node.pop(RESTORED, {})
        sends = []
        for node in self._children_hosting():
            mine = {c: unhomed.pop(c) for c in node.clients if c in unhomed} if unhomed else {}
            if mine:
                self.states_by_node[node.node_id] = mine
            own = self.restored.node_states.get(node.node_id, {}) if node.role == "edge" else {}
            if mine or own:
                payload = with_node_state(states_to_payload(mine), own)
                sends.append(Send(node.node_id, node.address, node.node_id, STATE_SET, payload))
        if unhomed:
            self.states_by_node[RESTORED] = unhomed
        if not sends:
            return
        _, failures = self.coord.fabric.send_to_all(sends, round=round, call_timeout=self.coord.cfg.run.call_timeout)
        for send in sends:   # in node order
            if send.key in failures:
                self.coord.store.add_event("restore_failed", node=send.dst, round=round,
                                           detail=f"client states not restored: {failures[send.key]}")
                log.error("resume: client states of %s not restored: %s", send.dst, failures[send.key])


def resume(coord: "Coordinator", checkpointer: Checkpointer) -> Checkpoint:
    """Continue `coord`'s run from the newest checkpoint in its run directory (module docstring)."""
    skipped: list[str] = []   # unreadable newer checkpoints: events once the run id is known
    ckpt = latest_checkpoint(coord.run_dir, on_skip=skipped.append)
    if ckpt.config_sha256 and ckpt.config_sha256 != config_digest(coord.config_toml):
        raise CheckpointError(f"checkpoint of round {ckpt.round} was written under another config than "
                              f"{coord.run_dir / 'config.toml'}; resume needs the run's own config, read by the "
                              f"fedhop version that wrote the checkpoint (the resolved config, every key, is "
                              f"what its digest covers)")
    missing = sorted(set(coord.state.params) ^ set(ckpt.params))
    if missing:
        raise CheckpointError(f"checkpoint model tensors differ from the config's model: {missing[:10]}")
    for name, t in ckpt.params.items():
        want = coord.state.params[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            raise CheckpointError(f"checkpoint of round {ckpt.round}: tensor {name!r} is {t.dtype} "
                                  f"{tuple(t.shape)}, the config's model has {want.dtype} {tuple(want.shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"checkpoint of round {ckpt.round}: tensor {name!r} holds NaN or Inf (a model "
                                  f"no round writes: the file was changed)")
    check_frozen(ckpt, frozen_params(coord.model))   # model.exchange: the parameters nobody sends
    if driver_class(coord.cfg.topology.kind).checkpoint_needs_state and "topology" not in ckpt.info:
        raise CheckpointError(f"checkpoint of round {ckpt.round} holds no state of the {coord.cfg.topology.kind} "
                              f"topology's walk (written by a fedhop that could not resume it)")
    coord.restored_topology = ckpt.info.get("topology")   # the topology driver takes it (TopologyDriver.restore)
    if coord.engine.privacy is not None:   # [privacy]: epsilon goes on from where the checkpoint left it
        if "privacy" not in ckpt.info:
            raise CheckpointError(f"checkpoint of round {ckpt.round} holds no privacy accountant state (written by a "
                                  f"fedhop without [privacy] support); epsilon could not go on from it")
        coord.engine.privacy.restore(ckpt.info["privacy"])
    coord.run_id = ckpt.run_id
    coord.endpoint.run_id = ckpt.run_id
    device = coord.device   # the server's state lives on run.device (common/transport/placement.py)
    coord.state.params = {k: v.to(device, copy=True) for k, v in ckpt.params.items()}
    coord.state.extra = {k: v.to(device, copy=True) for k, v in ckpt.extra.items()}
    coord.state.scalars = dict(ckpt.scalars)
    coord.rounds_completed = ckpt.round
    coord.failures_total = ckpt.failures_total
    restore_rng(ckpt)
    checkpointer.restored = ckpt
    # filed under their hosting children once they register (`on_ready`); a checkpoint of an
    # earlier fedhop lists clients without state too, which need nothing restored
    checkpointer.states_by_node = {RESTORED: {c: dict(s) for c, s in ckpt.client_states.items() if s}}
    checkpointer.node_states = {n: dict(s) for n, s in ckpt.node_states.items()}
    # the killed attempt's records: merge what its processes wrote, then mark the unfinished rounds
    store = coord.store
    store.run_id = ckpt.run_id
    coord.merge_ledgers()
    r = ckpt.round
    aborted = store.abort_after(r)
    store.add_event("resumed", node="server", round=r,
                    detail=json.dumps({"from_round": r, "aborted_messages": int(aborted[0]),
                                       "aborted_framed_bytes": int(aborted[1]), "run_id": ckpt.run_id,
                                       "client_states": len(checkpointer.states_by_node[RESTORED])}))
    for why in skipped:
        store.add_event("checkpoint_skipped", node="server", round=r, detail=why)
    log.info("resuming run %s after round %d (%d client states)", ckpt.run_id, r,
             len(checkpointer.states_by_node[RESTORED]))
    return ckpt


# events after which a node's missing records are explained losses; node_restarted: a process
# registered again before it was marked dead, so its earlier process died with records unwritten
LOSS_EVENTS = ("node_dead", "node_restarted", "client_failed", "edge_failed", "rejected_payload",
               "aborted:client_failed", "aborted:edge_failed", "aborted:node_dead", "aborted:rejected_payload")


def ledger_consistency(store) -> dict:
    """Is the ledger consistent after faults?  Every received message has its sender's record, or
    the loss is recorded; every sent message has its receiver's record, or the loss is recorded.

    A lone record counts as an *explained loss* when
    - it is a sender record with status 'lost' (the sender saw the call fail), or a receiver
      record with status 'rejected' (a forged, replayed or corrupt message, its code recorded);
    - it is a reply ('ID.reply') whose request 'ID' is recorded lost or with an error (the caller
      saw the reply fail: dropped, corrupt, cut off; common/transport/base.py), or the sender
      record of the typed error reply to a request its receiver rejected (a caller that keeps
      no ledger of its own, such as a participant using another node's credential);
    - it is a request whose receiver process is recorded dead or failed in that round
      (its ledger died with it), or a message of a round the server aborted (resume);
    - it is a receiver record (a heartbeat, a result) from a node recorded dead or failed, from a
      process whose ledger ends before it (killed between sending and recording), or from a
      sender without a ledger (a hostile client: its rejection is recorded); or a sender record
      to a node that keeps no ledger, or a control message (the reply to its last heartbeat)
      to a process whose ledger ends before it (killed before recording it).
    Anything else is `unexplained`; `mismatched` pairs disagree on bytes, ends or link.
    `ok` = no unexplained lone record and no mismatch (what the fault tests assert)."""
    rep = store.check_agreement()
    lone = store.lone_messages()
    if not lone and not rep.mismatched:   # every record has its other end: nothing to explain
        return {"ok": True, "matched": rep.matched, "mismatched": 0, "partial_losses": 0, "lost_explained": 0,
                "unexplained": 0, "unexplained_first": []}
    by_id = store.message_status()
    failed_nodes: dict[int, set[str]] = {}
    for e in store.events():
        if e["kind"] in LOSS_EVENTS or e["kind"].startswith("aborted:"):
            failed_nodes.setdefault(int(e["round"] or 0), set()).add(e["node"])
    ever_failed = set().union(*failed_nodes.values()) if failed_nodes else set()
    last_record = store.last_record_by_recorder()
    recorders = set(last_record)
    # logical nodes ('client-7') are recorded by their process: they keep a ledger when some
    # record names them as the recording end
    recorders |= store.recording_ends()
    # a logical node -> the processes that recorded as it, looked up together for every lone
    # receiver record's logical sender (one scan of the messages, however many there are)
    hosts = store.recorders_of({m["src"] for m in lone if m["role"] == "receiver" and m["src"] not in last_record
                                and m["src"] in recorders})

    def last_time(node: str) -> float:
        """The newest record of the process that records as `node`: its own ledger's, or for a
        logical client ('client-15', not a recorder itself) its hosting process's."""
        if node in last_record:
            return last_record[node]
        return max((last_record[p] for p in hosts.get(node, ()) if p in last_record), default=float("inf"))
    explained: list[dict] = []
    unexplained: list[dict] = []
    for m in lone:
        why = None
        err = m["error"] or ""
        if m["role"] == "sender" and m["status"] == "lost":
            why = "sender recorded the loss"
        elif m["role"] == "receiver" and m["status"] == "rejected":
            why = "receiver rejected it with a typed error"
        elif err.startswith("aborted:"):
            why = "round aborted by a server restart"
        elif m["msg_id"].endswith(".reply"):
            req = by_id.get((m["msg_id"][:-len(".reply")], "sender"))
            if req is not None and (req["status"] != "ok" or req["error"]):
                why = "the caller recorded the reply's loss"
            elif m["role"] == "sender" and by_id.get((m["msg_id"][:-len(".reply")], "receiver"), {}).get("status") \
                    == "rejected":
                why = "the typed error reply to a request the receiver rejected"
        if why is None and m["role"] == "sender" and (m["dst"] in failed_nodes.get(int(m["round"]), set())
                                                      or m["dst"] in ever_failed and m["link"] == "control"):
            why = "receiver recorded dead or failed"
        if why is None and m["role"] == "receiver" and (m["src"] in ever_failed or not _ledgered(m["src"], recorders)):
            why = "sender recorded dead or failed, or keeps no ledger"
        if why is None and m["role"] == "sender" and not _ledgered(m["dst"], recorders):
            why = "receiver keeps no ledger"
        if why is None and m["role"] == "receiver" and m["src"] in recorders \
                and last_time(m["src"]) <= m["wall_time"]:
            why = "sender stopped (killed) before recording it"
        if why is None and m["role"] == "sender" and m["link"] == "control" and m["dst"] in last_record \
                and last_record[m["dst"]] < m["wall_time"]:
            why = "receiver process stopped (killed) before recording it"
        (explained if why else unexplained).append({"msg_id": m["msg_id"], "role": m["role"], "method": m["method"],
                                                    "round": m["round"], "src": m["src"], "dst": m["dst"],
                                                    "why": why or ""})
    # a pair that disagrees on bytes because the message was cut off on the way (one side
    # recorded it lost or rejected) is a recorded partial loss, not an accounting error
    partial = [m for m in rep.mismatched
               if any(by_id.get((m, role), {}).get("status", "ok") != "ok" for role in ("sender", "receiver"))]
    mismatched = [m for m in rep.mismatched if m not in partial]
    return {"ok": not unexplained and not mismatched, "matched": rep.matched,
            "mismatched": len(mismatched), "partial_losses": len(partial), "lost_explained": len(explained),
            "unexplained": len(unexplained), "unexplained_first": unexplained[:5]}


def _ledgered(node: str, recorders: set[str]) -> bool:
    """Does `node` keep a ledger that reached run.db (it appears as the recording end of some
    record)?  A hostile or foreign client does not."""
    return node in recorders


def record_refusals(store) -> int:
    """A `not_allowed` event in run.db for every call that a client or edge process refused
    because the caller may not use the method (common/transport/router.py): the refusing
    process recorded it in its ledger as a rejected message; this reads the merged ledgers.
    Idempotent (one event per refused message).  Returns the number of events added."""
    done = {e["detail"].rsplit("message ", 1)[-1] for e in store.events("not_allowed")}
    added = 0
    for m in store.refused_messages("NOT_ALLOWED"):   # those rows only: a run's ledger is millions of records
        if m["msg_id"] not in done:
            store.add_event("not_allowed", node=m["src"], round=m["round"],
                            detail=f"{m['error']}; {m['method']} to {m['dst']} refused by {m['recorder']}, "
                                   f"message {m['msg_id']}")
            added += 1
    return added


def fault_summary(store) -> dict:
    """summary.json's `faults` section: events by kind, rejections by typed code, resumes."""
    events = store.events()
    kinds = Counter(e["kind"] for e in events)
    rejections: Counter = Counter()
    for e in events:
        if e["kind"] in ("rejected_payload", "auth_refused", "register_refused", "not_allowed"):
            rejections[rejection_code(e["detail"] or "") or e["kind"].upper()] += 1
    resumes = [json.loads(e["detail"]) for e in events if e["kind"] == "resumed"]
    return {"faults": {"events": dict(sorted(kinds.items())), "rejections": dict(sorted(rejections.items())),
                       "resumes": resumes, "restarts": len(resumes),
                       "nodes_dead": kinds.get("node_dead", 0), "auth_refused": kinds.get("auth_refused", 0),
                       "ledger": bounded_consistency(store)}}
