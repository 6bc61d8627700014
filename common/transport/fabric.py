"""The fabric: the one interface through which a role sends (shared/DESIGN.md section 2).

A role never calls `Endpoint.call` in a loop, keeps a thread pool or applies payload checks by
hand: it says what goes where and gets back results and failures.

- `send_and_receive(requests, timeout)`: fan-out with gather.  Every request is sent at once
  (each distinct message encoded once), the replies run through the request's inbound
  pipeline, and the call returns `(results, failures)` keyed as the requests are: a peer that
  fails, answers with an error, sends a reply the pipeline rejects or misses the deadline is a
  failure with its reason, never an exception.
  With `batch` (config `transport.batch`), the requests to the logical clients of one process
  share calls (`Endpoint.call_many`: each still its own message with its own ledger records
  and its own step; common/transport/grpc.py, Batches), at most one chunk of request bytes per
  call: per-call costs are paid once per process and round instead of once per client.
- `call`: one request, one reply (control calls, a hand-off to a peer); failures raise.
- `submit`: a call in the background (a control call that must overlap a collective).

The processor chain (common/processors/pipeline.py) lives at this seam: a request's `inbound` chain
(`reply_chain`: upload decompression, the algorithm's reply spec, the user's processors) runs on its reply
before the caller sees it.  The ledger is recorded by the endpoint underneath, for every message.

The transport underneath is the endpoint's (gRPC, or in memory for unit tests).  Group
broadcast and reduce (a root's message to every member of a group, the members' partials
reduced back) and peer sends are common/transport/groups.py, built on this fabric: as fan-outs
over gRPC, as collectives beside this fabric's control calls over torch.distributed
(transports/torch/groups.py).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Hashable, Mapping, TypeVar, cast

from fedhop.common.processors.pipeline import reply_chain, upload
from fedhop.common.transport.base import Batched, CallFailed, Endpoint, HandlerError, RemoteError, ReplyBound
from fedhop.common.util.procexit import stops_at_this_wait, wait_stoppable
from fedhop.common.wire.codec import Encoded, PayloadError, hand_over
from fedhop.common.wire.message import Payload

if TYPE_CHECKING:  # pragma: no cover
    from fedhop.common.processors.streaming import OrderedFold

__all__ = ["Fabric", "Send", "gather", "reply_chain", "upload", "CALL_ERRORS"]
# what makes a request fail without failing the caller: every typed outcome of a call
CALL_ERRORS = (CallFailed, RemoteError, PayloadError, HandlerError)
K = TypeVar("K", bound=Hashable)   # a fan-out's request keys (`gather`)


@dataclass
class Send(Generic[K]):
    """One request of a fan-out.  `message` is shared by identity: requests that carry the same
    Payload object are encoded once.  `inbound` checks the reply (None: taken as it comes);
    `who` names the reply in rejections."""

    key: K
    address: str
    dst: str
    method: str
    message: Payload = field(default_factory=Payload)
    step: int = 0
    inbound: Callable[[Payload, str], Payload] | None = None   # a reply_chain also bounds the reply's size
    who: str = ""
    on_reply: Callable[[K], None] | None = None   # e.g. the arrival time of a reply


class Fabric:
    """A role's sending side over its endpoint."""

    closed = False   # set by `close`: no more calls on the workers

    def __init__(self, endpoint: Endpoint, max_workers: int = 64, batch: bool = False) -> None:
        self.endpoint = endpoint
        self.node_id = endpoint.node_id
        self.batch = batch   # requests to one process share calls (module docstring)
        self._workers = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{endpoint.node_id}-call")

    # ------------------------------------------------------------------ one call
    def call(self, address: str, dst: str, method: str, message: Payload | None = None, *, round: int,
             step: int = 0, timeout: float, prepared: Encoded | None = None) -> Payload:
        """One request and its reply; raises CallFailed / RemoteError / PayloadError.  Where a
        stop signal is raised at waits (the server's rounds: common/util/procexit.py
        `stops_at_waits`), the call runs on a worker while this thread waits for it, so that a
        stop ends the wait at once rather than after the call's timeout."""
        if stops_at_this_wait() and not self.closed:
            pending = self._workers.submit(self.endpoint.call, address, dst, method, message, round=round, step=step,
                                           timeout=timeout, prepared=prepared)
            wait_stoppable([pending], None)
            return pending.result()
        return self.endpoint.call(address, dst, method, message, round=round, step=step, timeout=timeout,
                                  prepared=prepared)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run `fn` on the fabric's workers (a call that overlaps a collective or another call)."""
        return self._workers.submit(fn, *args, **kwargs)

    # ------------------------------------------------------------------ fan-out with gather
    def send_and_receive(self, requests: list[Send[K]], *, round: int, timeout: float, call_timeout: float,
                         timeout_reason: str = "", fold: "OrderedFold | None" = None
                         ) -> tuple[dict[K, Payload], dict[K, str]]:
        """Send every request at once and wait up to `timeout` for all replies.  Returns the
        replies that passed their inbound pipeline and, for every other request, why not.
        With `fold` (common/processors/streaming.py, keyed by the requests' keys) each reply that passed is
        folded in key order as it arrives and dropped: the results are then a `StreamedResults`
        of the folded replies' scalars, and a reply the fold refused or that came after the
        deadline is a failure.
        With `fold` the caller leaves the requests' tensors unchanged until the fold closes, so a
        large message is handed over (common/wire/codec.py `hand_over`): it is not snapshot, and each
        call cuts its own frames as it sends them, so the server never holds the broadcast's
        frames whole.  A tensor changed while a late call still sends fails that call
        (`SnapshotChanged`), never sends other bytes."""
        encoded: dict[int, tuple[Payload, Encoded]] = {}   # id(message) -> (message kept alive, frames)
        calls: dict[K, Future] = {}
        for req in requests:
            if id(req.message) not in encoded:
                encoded[id(req.message)] = (req.message, self._prepare(req.message, fold is not None))
        groups = self._batches(requests, encoded) if self.batch else [[req] for req in requests]
        for group in groups:
            if len(group) == 1:   # a call of its own, under its own deadline
                req = group[0]
                calls[req.key] = self._workers.submit(self._exchange, req, round, call_timeout,
                                                      encoded[id(req.message)][1], fold)
                continue
            futures: dict[K, Future] = {req.key: Future() for req in group}
            calls.update(futures)
            self._workers.submit(self._exchange_batch, group, futures, round, timeout, encoded, fold)
        reason = timeout_reason or f"timeout: no result within {timeout:g}s"
        if fold is None:
            return gather(calls, timeout, reason)
        # the fold is keyed by the requests' keys (OrderedFold takes any Hashable; mypy cannot see they are K)
        _, failures = gather(cast("dict[Hashable, Future]", calls), timeout, reason)
        fold.close()   # the deadline: what did not come is skipped, a later reply refused
        return cast("tuple[dict[K, Payload], dict[K, str]]", fold.outcome(failures, reason))

    def send_to_all(self, requests: list[Send[K]], *, round: int, call_timeout: float
                    ) -> tuple[dict[K, Payload], dict[K, str]]:
        """`send_and_receive` for a control fan-out (a shut-down, a query, a state pull): each call
        has its own deadline `call_timeout` and the wait covers the one-by-one worst case, so every
        request is sent (none is left queued at a deadline) and each failure is its call's own error.
        On a closed fabric (a second shut-down racing the first) the calls go one by one from this thread."""
        if not self.closed:
            return self.send_and_receive(requests, round=round, timeout=call_timeout * max(1, len(requests)),
                                         call_timeout=call_timeout)
        results: dict[K, Payload] = {}
        failures: dict[K, str] = {}
        for req in requests:
            try:
                results[req.key] = self.call(req.address, req.dst, req.method, req.message, round=round,
                                             step=req.step, timeout=call_timeout)
            except CALL_ERRORS as exc:
                failures[req.key] = str(exc)
        return results, failures

    def _prepare(self, message: Payload, streamed: bool) -> Encoded:
        """The message's frames; in a streamed round a message larger than one chunk is cut per
        call (`hand_over(keep_frames=False)`).  The hand-over marks are taken off once it is
        encoded: the calls check the tensors' versions they captured, and a later encode of the
        same tensors (outside this round's contract) snapshots them again."""
        large = streamed and message.tensor_bytes() > self.endpoint.chunk_bytes
        if not large:
            return self.endpoint.prepare(message)
        hand_over(message, keep_frames=False)
        try:
            return self.endpoint.prepare(message)
        finally:
            for t in message.tensors.values():
                t._fedhop_handed_over = None   # type: ignore[attr-defined]

    def _batches(self, requests: list[Send], encoded: dict[int, tuple[Payload, Encoded]]) -> list[list[Send]]:
        """The requests grouped by process address, in order, each group at most one chunk of
        request bytes.  A request whose message or whose reply may be larger than one chunk goes
        alone: a large reply is received under the streaming fold's gate, pulled and possibly into
        a file (`_exchange`, `GatedBound`), which a shared call cannot do per reply."""
        chunk = self.endpoint.chunk_bytes
        sizes = {key: prepared.payload_bytes for key, (_, prepared) in encoded.items()}   # each message once
        by_address: dict[str, list[list[Send]]] = {}
        filled: dict[str, int] = {}   # request bytes in each address's last group
        alone: list[list[Send]] = []
        for req in requests:
            size = sizes[id(req.message)]
            bound = getattr(req.inbound, "bound", None)
            if size > chunk or (bound is not None and bound.data_bytes > chunk):
                alone.append([req])
                continue
            where = req.address   # each request keeps its own step (`Batched.step`)
            groups = by_address.setdefault(where, [[]])
            if groups[-1] and filled[where] + size > chunk:
                groups.append([])
                filled[where] = 0
            groups[-1].append(req)
            filled[where] = filled.get(where, 0) + size
        return [g for groups in by_address.values() for g in groups] + alone

    def _exchange_batch(self, group: list[Send[K]], futures: dict[K, Future], round: int, timeout: float,
                        encoded: dict[int, tuple[Payload, Encoded]], fold: "OrderedFold | None" = None) -> None:
        """One batch (`Endpoint.call_many`); each request's future gets its reply, through its
        inbound pipeline, or its failure, as soon as that reply is in (`on_each`): a reply that
        came before the round's deadline counts even when a later one of its batch does not.
        The batch's deadline is the round's: its process runs the requests one after another."""
        batched = [Batched(req.dst, req.method, encoded[id(req.message)][1], getattr(req.inbound, "bound", None),
                           step=req.step) for req in group]

        def deliver(i: int, reply: Payload | BaseException) -> None:
            req = group[i]
            fut = futures[req.key]
            if fut.done():
                return
            if isinstance(reply, BaseException):
                if fold is not None:
                    fold.skip(req.key)
                fut.set_exception(reply)
                return
            if req.on_reply is not None:
                req.on_reply(req.key)
            try:
                reply = (req.inbound(reply, req.who or f"round {round} reply of {req.dst}")
                         if req.inbound is not None else reply)
                fut.set_result(reply if fold is None else _folded(fold, req.key, reply))
            except CALL_ERRORS as exc:
                if fold is not None:
                    fold.skip(req.key)
                fut.set_exception(exc)

        try:
            replies = self.endpoint.call_many(group[0].address, batched, round=round, step=group[0].step,
                                              timeout=timeout, on_each=deliver)
        except BaseException as exc:   # never leave a future unset
            for i in range(len(group)):
                deliver(i, exc)
            raise
        for i, reply in enumerate(replies):   # any the endpoint did not deliver on the way (it delivers each once)
            deliver(i, reply)

    def _exchange(self, req: Send, round: int, call_timeout: float, prepared: Encoded,
                  fold: "OrderedFold | None" = None) -> Payload:
        bound = getattr(req.inbound, "bound", None)   # what the reply may declare (reply_chain)
        if fold is not None and bound is not None and bound.data_bytes > self.endpoint.chunk_bytes:
            bound = GatedBound(bound.data_bytes, bound.header_bytes, fold)   # large replies a few at a time (OrderedFold.admit)
        try:
            reply = self.endpoint.call(req.address, req.dst, req.method, round=round, step=req.step,
                                       timeout=call_timeout, prepared=prepared, expect=bound)
            if req.on_reply is not None:
                req.on_reply(req.key)
            if req.inbound is not None:
                reply = req.inbound(reply, req.who or f"round {round} reply of {req.dst}")
            return reply if fold is None else _folded(fold, req.key, reply)
        except BaseException:
            if fold is not None:
                fold.skip(req.key)   # the turn moves past it
            raise
        finally:
            if fold is not None:
                fold.release()   # the reply is folded, spilled or refused: its receive slot is free

    def close(self) -> None:
        self.closed = True
        self._workers.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class GatedBound(ReplyBound):
    """A reply bound whose transport takes a receive slot of `gate` before reading the reply."""

    gate: Any = None


def _folded(fold: "OrderedFold", key: Hashable, reply: Payload) -> Payload:
    """`reply` offered to `fold`; what the caller keeps of it (its scalars)."""
    if not fold.offer(key, reply, take=True):
        raise CallFailed("timeout", "the reply came after the round's deadline")
    return Payload(scalars=dict(reply.scalars), control=reply.control)


def gather(calls: Mapping[K, Future], timeout: float, timeout_reason: str,
           pending_ok: bool = False) -> tuple[dict[K, Any], dict[K, str]]:
    """Wait for `calls` until `timeout`; split results from failures (a call still running at the
    deadline fails with `timeout_reason`, or is left out of both with `pending_ok`)."""
    _, pending = wait_stoppable(calls.values(), timeout)   # a stop signal is raised here (common/util/procexit.py)
    results: dict[K, Any] = {}
    failures: dict[K, str] = {}
    for key, fut in calls.items():
        if fut in pending:
            if not pending_ok:
                failures[key] = timeout_reason
            continue
        try:
            results[key] = fut.result()
        except CALL_ERRORS as exc:
            failures[key] = str(exc)
    return results, failures
