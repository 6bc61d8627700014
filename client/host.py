"""A client process: hosts one or many logical clients and runs their local solvers.

Each logical client has its own id, data partition, persistent state (kept here across rounds)
and RNG stream (derived from the run seed, the client id and the round, so a result does not
depend on which process hosts the client or in what order clients train).  One process trains
one logical client at a time: the process's cores go to that client's tensor ops.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.config import Config
from fedhop.common.engine.rounds import local_update, local_updates
from fedhop.common.processors.compressors.downlink import DownlinkReceiver, downlink_coding
from fedhop.common.processors.compressors.ef21 import RESET_KEY, take_reset
from fedhop.common.processors.pipeline import upload
from fedhop.common.records.checkpoint import states_from_payload, states_to_payload
from fedhop.common.tasks import build_task
from fedhop.common.tasks.base import Task
from fedhop.common.tasks.placed import place_task
from fedhop.common.topologies import spec_for
from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.factory import handler_fns
from fedhop.common.transport.placement import to_host
from fedhop.common.transport.router import MethodRouter, Peers, allowed
from fedhop.common.util.nodeids import client_id
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import DEFAULT_CHUNK, PayloadError, hand_over
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload, finite_or_raise
from fedhop.common.wire.methods import Method

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.transport.fabric import Fabric

T = TypeVar("T")


#: a process with more clients than this receives at most this many large train requests whole at once
TAKEN_TRAIN_REQUESTS = 2
#: a train request of at least this many data bytes waits for room before its data is read
HELD_REQUEST_BYTES = 64 << 20
#: how often a request waiting for room checks that its caller is still there (seconds)
ROOM_POLL_SECONDS = 0.5


def parse_client_id(node_id: str) -> int:
    """The logical client a call names (common/util/nodeids.py); an id that names none is a typed error reply."""
    try:
        return client_id(node_id)
    except ValueError as exc:
        raise HandlerError("UNKNOWN_CLIENT", str(exc)) from None


class ClientHost:
    """The logical clients of one process and the handler that serves their calls."""

    def __init__(self, cfg: Config, node_id: str, client_ids: list[int], run_id: str,
                 ledger: Ledger | None = None, parent: str = "server", device: torch.device | None = None,
                 task: Task | None = None) -> None:
        """`task`: the run's task already built from `cfg` (the in-process engine's forked workers:
        deploy/launch/workers.py `SharedTask`); None builds it here."""
        self.cfg = cfg
        self.parent = parent   # the node this process registered with: the only one it obeys (but `ping`)
        self.ledger = ledger if ledger is not None else Ledger()
        self.fabric: Fabric | None = None   # this process's sending side (client/runtime.py sets it): peer calls
        # the state a topology or a transport keeps in this process (`extension`), by its key
        self._extensions: dict[str, Any] = {}
        self._extensions_lock = threading.Lock()
        self.node_id = node_id
        self.run_id = run_id
        self.client_ids = sorted(client_ids)
        # the model, the hosted clients' data and their state live on the process's device
        self.task = place_task(task if task is not None else build_task(cfg), device)
        self.algorithm = build_algorithm(cfg)
        self.model = self.task.build_model()
        self.hosted = frozenset(self.client_ids)
        # persistent state (control variates, optimizer moments) of the clients that have some:
        # a client whose algorithm keeps none costs nothing here between its rounds
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self._train_lock = threading.Lock()
        # [algorithm] vectorized: the replies of a batch's train requests, trained together before
        # the batch is answered (`prepare_batch`), by (client, round, step); taken by `train`
        self._trained: dict[tuple[int, int, int], Payload] = {}
        # large train requests whose data is taken at once (`request_hold`): the one training and the next
        self._request_room = threading.BoundedSemaphore(TAKEN_TRAIN_REQUESTS)
        self.shutdown_event = threading.Event()
        self.before_shutdown: list[Callable[[], None]] = []   # run before the reply to `shutdown`
        coding = downlink_coding(cfg)   # coded broadcasts (`compression.down`): the reference this process holds
        self.downlink = DownlinkReceiver(coding) if coding is not None else None
        self.router = self._routes()
        for cid in self.client_ids:
            if not 0 <= cid < self.task.num_clients:
                raise ValueError(f"client id {cid} out of range: the task has {self.task.num_clients} clients")

    def extension(self, key: str, make: Callable[[ClientHost], T]) -> T:
        """The state that the topology or transport `key` keeps in this process (the chain's walk,
        gossip's models, the group plane's member side), made by `make(self)` on first use; calls
        that arrive together share the one made."""
        with self._extensions_lock:
            if key not in self._extensions:
                self._extensions[key] = make(self)
            return self._extensions[key]

    def num_samples(self, cid: int) -> int:
        return self.task.num_samples(cid)

    # ------------------------------------------------------------------ handler
    def _routes(self) -> MethodRouter:
        """The methods this process serves; every one obeyed only from its parent but `ping`."""
        router = MethodRouter(self.node_id, Peers(self.parent))
        router.register_all({
            Method.TRAIN: self._train_call,
            Method.SHUTDOWN: self._shutdown_call,
            Method.PING: lambda request: Payload(),
            # checkpoints and resume (common/records/checkpoint.py)
            Method.STATE_GET: lambda request: self.client_state(Method.STATE_GET, request.payload),
            Method.STATE_SET: lambda request: self.client_state(Method.STATE_SET, request.payload),
        })
        for handlers in spec_for(self.cfg.topology.kind).handler_fns():   # the topology's own methods
            router.register_all(handlers(self))
        for handlers in handler_fns(self.cfg.transport.kind, "client"):   # the transport's (its group plane)
            router.register_all(handlers(self))
        return router

    def handle(self, request: Request) -> Payload:
        env = request.envelope
        if self.run_id and env.run_id != self.run_id:
            raise HandlerError("WRONG_RUN", f"message for run '{env.run_id}', this process serves '{self.run_id}'")
        return self.router.dispatch(request)

    def _train_call(self, request: Request) -> Payload:
        env = request.envelope
        cid, step = parse_client_id(env.dst), int(env.step)
        message = request.payload
        if self.downlink is not None:   # a coded broadcast: the reference model it brings (downlink.py)
            message = self.downlink.receive(message, f"round {env.round} message to {env.dst}")
        if RESET_KEY in message.scalars and cid in self.hosted:   # EF21: the parent reset its copy of the estimate
            with self._train_lock:
                message = take_reset(message, self.states.get(cid))
        reply = to_host(self.train(cid, int(env.round), message, step))   # the seam: one copy to the CPU
        with self._train_lock:   # error feedback's residuals live in the client's persistent state
            state = self.states.get(cid, {})
            # coded where configured (common/processors/pipeline.py)
            coded = upload(self.cfg, reply, env.dst, int(env.round), step, state=state)
            if state:   # kept only when it holds something: a client without state costs nothing here
                self.states[cid] = state
            return self._hand_over_fresh(coded)

    def request_hold(self, env: pb.Envelope, alive: Callable[[], bool]) -> Callable[[], None] | None:
        """Room for a large train request's data (the transport's `Endpoint.request_hold`): one
        process trains one client at a time, so of the requests to its clients only the one in
        training and the next are received whole; the others' data stays with the caller until
        one of them is done (common/transport/grpc.py, Taken requests).  A process of at most
        TAKEN_TRAIN_REQUESTS clients, a request of another method or below HELD_REQUEST_BYTES
        takes its data at once.  A request whose caller gives up while it waits is refused."""
        if (env.method != Method.TRAIN or env.data_bytes < HELD_REQUEST_BYTES
                or len(self.client_ids) <= TAKEN_TRAIN_REQUESTS):
            return None
        while not self._request_room.acquire(timeout=ROOM_POLL_SECONDS):
            if not alive():
                raise PayloadError("CANCELLED", f"the caller gave up while the request to {env.dst} waited for room")
        return self._request_room.release

    def _hand_over_fresh(self, reply: Payload) -> Payload:
        """Hand a large reply over to the codec (common/wire/codec.py `hand_over`) when this
        process keeps none of its tensors: it is then not snapshot before the send, its frames
        are cut as gRPC pulls them, and the client never holds its update and a copy of it at
        once.  A reply tensor that shares memory with the model's parameters or buffers or with
        a hosted client's persistent state is snapshot as before: the next logical client's
        training may change it while the reply is still being sent."""
        if reply.tensor_bytes() <= DEFAULT_CHUNK:
            return reply
        kept = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers(),
                                                          *(t for state in self.states.values() for t in state.values()))}
        if any(t.untyped_storage().data_ptr() in kept for t in reply.tensors.values()):
            return reply
        return hand_over(reply, keep_frames=False)

    def prepare_batch(self, requests: list[Request]) -> None:
        """Under [algorithm] vectorized, train the clients of a batch's train requests together
        (common/engine/rounds.py `local_updates`) before the batch is answered one request at a
        time (the transport's `Endpoint.before_batch`); each `train` then takes its reply.  A
        request this would refuse (another run, a caller that is not the parent, a client not
        hosted here, a non-finite message) or one that needs more before training (a coded
        broadcast, an EF21 reset) is left to its own call, which trains that client alone: with
        the same result, since a client's result does not depend on the clients beside it."""
        if not self.cfg.algorithm.vectorized:
            return
        items: list[tuple[int, int, Payload, dict[str, torch.Tensor], int]] = []
        for request in requests:
            env, message = request.envelope, request.payload
            if (env.method != Method.TRAIN or (self.run_id and env.run_id != self.run_id)
                    or not allowed(Method.TRAIN, env.src, self.router.peers) or self.downlink is not None or RESET_KEY in message.scalars):
                continue
            try:
                cid = parse_client_id(env.dst)
                finite_or_raise(message, "")
            except (HandlerError, ValueError):
                continue
            if cid in self.hosted:
                items.append((cid, int(env.round), message, {}, int(env.step)))
        if len(items) < 2 or len({(cid, round, step) for cid, round, _, _, step in items}) < len(items):
            return
        with self._train_lock:
            for cid, _, _, state, _ in items:
                state.update(self.states.pop(cid, {}))
            try:
                replies = local_updates(self.cfg, self.task, self.algorithm, self.model, items)
            except Exception:  # noqa: BLE001 - each request's own call trains it alone and answers the error
                return
            finally:
                for cid, _, _, state, _ in items:
                    if state:
                        self.states[cid] = state
            oldest = min(round for _, round, _, _, _ in items)
            for key in [key for key in self._trained if key[1] < oldest]:   # a request refused after its training
                del self._trained[key]
            for (cid, round, _, _, step), reply in zip(items, replies):
                self._trained[(cid, round, step)] = reply

    def _shutdown_call(self, request: Request) -> Payload:
        for hook in self.before_shutdown:   # e.g. stop heartbeats, before the parent merges the ledgers
            hook()
        self.shutdown_event.set()
        return Payload(scalars={"clients": len(self.client_ids)})

    def train(self, cid: int, round: int, message: Payload, step: int = 0) -> Payload:
        if cid not in self.hosted:
            raise HandlerError("UNKNOWN_CLIENT", f"client {cid} is not hosted by {self.node_id}")
        try:
            finite_or_raise(message, f"round {round} message to client {cid}")
        except ValueError as exc:
            raise PayloadError("NON_FINITE", str(exc)) from None
        with self._train_lock:
            trained = self._trained.pop((cid, round, step), None)
            if trained is not None:   # trained with the rest of its batch (`prepare_batch`)
                return trained
            state = self.states.pop(cid, {})
            try:
                reply = local_update(self.cfg, self.task, self.algorithm, self.model, cid, round, message,
                                     state, step)   # the round engine's client step (common/engine/rounds.py)
            finally:
                if state:
                    self.states[cid] = state
        return reply

    def client_state(self, method: str, payload: Payload) -> Payload:
        """state_get: the persistent state of every hosted client that has some (a hosted client
        not in the reply has none: at 1,000,000 clients of a stateless algorithm the reply is
        empty, not a list of every id); state_set: replace the listed clients' states (resume)."""
        with self._train_lock:
            if method == Method.STATE_GET:
                return states_to_payload({cid: state for cid, state in self.states.items() if state})
            try:
                loaded = states_from_payload(payload, allowed=set(self.client_ids))
            except ValueError as exc:
                raise PayloadError("BAD_NAME", str(exc)) from None
            for cid, state in loaded.items():
                if state:
                    self.states[cid] = state
                else:
                    self.states.pop(cid, None)
            return Payload(scalars={"clients": len(loaded)})
