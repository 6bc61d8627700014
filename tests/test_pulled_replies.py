"""Pulled replies and taken requests (common/transport/grpc.py), between gRPC endpoints on real
loopback sockets: a reply that takes a receive slot of a streaming fold and may span frames is
pulled.  The callee sends its header frame, then waits for the caller's go (an empty message on
the request stream), which comes only once the reply has a slot.  So replies waiting for a slot
stay with their senders, not in the receiving process's gRPC buffers.  Each request counts the
go message's 5 bytes of gRPC framing on both ends.  Likewise a streamed request's data is sent
only once the callee took it (its initial metadata), so a client process hosting many clients
receives only the train requests it has room for (client/host.py `request_hold`)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from fedhop.client.host import HELD_REQUEST_BYTES, TAKEN_TRAIN_REQUESTS, ClientHost
from fedhop.common.algorithms.base import Payload
from fedhop.common.processors.streaming import OrderedFold
from fedhop.common.transport.base import CallFailed
from fedhop.common.transport.fabric import GatedBound
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.util.heap import FRAMES_IN_FLIGHT, TRIM_AFTER_BYTES, SendBurst, transient_bytes
from fedhop.common.wire import codec
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import FRAME_OVERHEAD, PayloadError, bundle_framing, hand_over
from fedhop.common.wire.ledger import Ledger

CHUNK = 64 << 10
NUMEL = 3 * CHUNK // 4 * 5          # 960 KB of float32: 15 data frames of a reply
CLIENTS = 3


class Clock:
    """A shared sequence: which of two events came first, without timing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def tick(self) -> int:
        with self._lock:
            self._n += 1
            return self._n


class CountingGate:
    """An OrderedFold's receive slots, recording when each admission returned and how many
    callers are waiting for one."""

    def __init__(self, fold: OrderedFold, clock: Clock) -> None:
        self.fold, self.clock = fold, clock
        self.receive_buffers = None
        self.waiting = threading.Semaphore(0)
        self.admitted_at: list[int] = []

    def admit(self, timeout: float) -> bool:
        self.waiting.release()
        ok = self.fold.admit(timeout)
        self.admitted_at.append(self.clock.tick())
        return ok

    def release(self) -> None:
        self.fold.release()


@pytest.fixture()
def cluster(monkeypatch):
    """Three callees whose replies record when gRPC pulled their first data frame."""
    clock = Clock()
    first_data: list[int] = []

    def recording(serve_frames):
        def serve(*args, **kwargs):
            for i, frame in enumerate(serve_frames(*args, **kwargs)):
                if i == 1:   # the first data frame, as the response stream takes it
                    first_data.append(clock.tick())
                yield frame
        return serve

    callees, addresses = [], []
    for k in range(CLIENTS):
        callee = GrpcEndpoint(f"client-{k}", Ledger(), chunk_bytes=CHUNK, max_message_bytes=1 << 20)
        monkeypatch.setattr(callee, "serve_frames", recording(callee.serve_frames))
        addresses.append(callee.serve(lambda request, k=k: Payload(
            tensors={"w": request.payload.tensors["w"] + k}, scalars={"n": 1}), "127.0.0.1:0"))
        callees.append(callee)
    caller = GrpcEndpoint("server", Ledger(), chunk_bytes=CHUNK, max_message_bytes=1 << 20)
    yield caller, callees, addresses, clock, first_data
    caller.stop()
    for callee in callees:
        callee.stop()


def test_a_reply_waiting_for_a_slot_sends_nothing_but_its_header(cluster):
    """The test holds the fold's only slot until all three replies' headers have arrived, so
    without pulling each callee's data frames would flow at once (gRPC's window is larger than
    a reply).  Pulled, no callee yields a data frame before its reply was admitted, every reply
    is whole, and the request's framed bytes count the go message on both ends."""
    caller, callees, addresses, clock, first_data = cluster
    fold = OrderedFold(list(range(CLIENTS)), {"w": "sum"}, window=1)
    gate = CountingGate(fold, clock)
    assert fold.admit(1.0)   # the test's slot
    w = torch.arange(NUMEL, dtype=torch.float32)
    bound = GatedBound(data_bytes=4 * NUMEL, header_bytes=4096, gate=gate)
    replies: dict[int, Payload] = {}

    def call(k: int) -> None:
        try:
            replies[k] = caller.call(addresses[k], f"client-{k}", "train", Payload(tensors={"w": w}),
                                     round=1, timeout=30, expect=bound)
        finally:
            gate.release()

    threads = [threading.Thread(target=call, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for _ in range(CLIENTS):   # every reply's header is in: its caller waits for a slot
        assert gate.waiting.acquire(timeout=30)
    released_at = clock.tick()
    fold.release()
    for t in threads:
        t.join(30)
    assert sorted(replies) == list(range(CLIENTS))
    for k in range(CLIENTS):
        assert torch.equal(replies[k].tensors["w"], w + k)
    assert len(first_data) == CLIENTS
    assert all(tick > released_at for tick in first_data)   # no data before the slot was free
    assert min(first_data) > min(gate.admitted_at)
    frames = 1 + -(-4 * NUMEL // CHUNK) + 1                 # header, data frames, the XXH3 trailer
    for k, callee in enumerate(callees):
        sent = next(r for r in caller.ledger.records() if r.method == "train" and r.dst == f"client-{k}")
        got = next(r for r in callee.ledger.records() if r.method == "train")
        assert sent.framed_bytes == sent.payload_bytes + FRAME_OVERHEAD * (frames + 1)   # + the go message
        assert got.framed_bytes == sent.framed_bytes and got.payload_bytes == sent.payload_bytes


def test_a_reply_that_gets_no_slot_in_time_fails_and_frees_the_callee(cluster):
    """The slot stays taken: the call fails DEADLINE_EXCEEDED after its header arrived, no data
    frame was ever pulled from the callee, and the callee serves the next call."""
    caller, callees, addresses, clock, first_data = cluster
    fold = OrderedFold([0], {"w": "sum"}, window=1)
    assert fold.admit(1.0)
    w = torch.arange(NUMEL, dtype=torch.float32)
    started = time.monotonic()
    with pytest.raises(CallFailed, match="no receive slot"):
        caller.call(addresses[0], "client-0", "train", Payload(tensors={"w": w}), round=1, timeout=2,
                    expect=GatedBound(data_bytes=4 * NUMEL, header_bytes=4096, gate=fold))
    assert time.monotonic() - started < 20
    assert first_data == []
    again = caller.call(addresses[0], "client-0", "train", Payload(tensors={"w": w}), round=2, timeout=30)
    assert torch.equal(again.tensors["w"], w)


def test_an_ungated_or_one_frame_reply_is_not_pulled(cluster):
    """Without a fold, or with a reply bound of at most one chunk, the request ends with its data
    (no go message in its framing) and a small request still goes bundled as `Call`."""
    caller, callees, addresses, clock, first_data = cluster
    big = torch.arange(NUMEL, dtype=torch.float32)
    caller.call(addresses[0], "client-0", "train", Payload(tensors={"w": big}), round=1, timeout=30)
    fold = OrderedFold([0], {"w": "sum"}, window=1)
    small = torch.arange(100, dtype=torch.float32)
    caller.call(addresses[1], "client-1", "train", Payload(tensors={"w": small}), round=1, timeout=30,
                expect=GatedBound(data_bytes=400, header_bytes=4096, gate=fold))
    streamed = next(r for r in caller.ledger.records() if r.method == "train" and r.dst == "client-0")
    assert streamed.framed_bytes == streamed.payload_bytes + FRAME_OVERHEAD * (1 + -(-4 * NUMEL // CHUNK) + 1)
    bundled = next(r for r in callees[1].ledger.records() if r.method == "train")
    data_frame = 1 + 2 + 400                               # tag, 2-byte length varint, the bytes
    trailer = 1 + 8                                        # tag, the fixed64 XXH3-64
    assert bundled.framed_bytes == bundled.payload_bytes + bundle_framing(
        [bundled.payload_bytes - data_frame - trailer, data_frame, trailer])


def test_the_last_send_of_a_burst_that_left_enough_trims_the_heap(monkeypatch):
    """SendBurst trims once, when the last of concurrent sends ends and together they left enough
    in the heap; a burst that left less does not trim, and carries nothing over to the next."""
    trims: list[int] = []
    monkeypatch.setattr("fedhop.common.util.heap.trim_heap", lambda: trims.append(1) or True)
    burst = SendBurst(trim_after_bytes=100)
    burst.begin()
    burst.begin()
    burst.end(60)
    assert trims == []            # one send still in flight
    burst.end(60)
    assert trims == [1] and burst.trims == 1
    for _ in range(3):            # lone sends, each leaving less than the threshold: never a trim
        burst.begin()
        burst.end(60)
    assert trims == [1] and burst.trims == 1


def test_a_send_leaves_its_frames_in_flight_in_the_heap():
    """A lone send of a large message leaves a few frames (no trim); two at once (a broadcast)
    leave enough."""
    chunk = 4 << 20
    assert transient_bytes(100 << 20, chunk) == FRAMES_IN_FLIGHT * chunk < TRIM_AFTER_BYTES
    assert 2 * transient_bytes(100 << 20, chunk) >= TRIM_AFTER_BYTES
    assert transient_bytes(3 << 20, chunk) == 3 << 20
    assert 8 * transient_bytes(500 << 20, chunk) >= TRIM_AFTER_BYTES


# ----------------------------------------------------------------------------- taken requests
def test_a_request_waits_with_its_sender_until_the_callee_takes_it(monkeypatch):
    """A streamed request's data frames are cut (the caller's one copy of them) only once the
    callee took the request: its `request_hold` waits on a slot the test holds, and no frame is
    cut until the test frees it, although gRPC's window could carry the whole request.  The
    request arrives whole and its framed bytes are the streamed formula on both ends."""
    clock = Clock()
    cut_at: list[int] = []
    getitem = codec._Cuts.__getitem__

    def recording(self, k):
        if not self.keep:   # the caller's handed-over request (the callee's reply is cut at encode)
            cut_at.append(clock.tick())
        return getitem(self, k)

    monkeypatch.setattr(codec._Cuts, "__getitem__", recording)
    room = threading.Semaphore(0)
    waiting = threading.Event()
    seen: list[str] = []

    def hold(env, alive):
        seen.append(env.method)
        waiting.set()
        assert room.acquire(timeout=30)
        return room.release

    callee = GrpcEndpoint("client-0", Ledger(), chunk_bytes=CHUNK, max_message_bytes=1 << 20)
    callee.request_hold = hold
    address = callee.serve(lambda request: Payload(tensors={"w": request.payload.tensors["w"] * 2}), "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger(), chunk_bytes=CHUNK, max_message_bytes=1 << 20)
    try:
        w = torch.arange(NUMEL, dtype=torch.float32)
        out: dict[str, Payload] = {}
        t = threading.Thread(target=lambda: out.setdefault("reply", caller.call(
            address, "client-0", "train", hand_over(Payload(tensors={"w": w.clone()}), keep_frames=False),
            round=1, timeout=30)))
        t.start()
        assert waiting.wait(30)        # the header is in; the callee has no room yet
        freed_at = clock.tick()
        room.release()
        t.join(30)
        assert torch.equal(out["reply"].tensors["w"], 2 * w) and seen == ["train"]
        frames = 1 + -(-4 * NUMEL // CHUNK) + 1       # header, data frames, the XXH3 trailer
        assert len(cut_at) == frames - 2 and min(cut_at) > freed_at   # no data frame before it was taken
        sent = next(r for r in caller.ledger.records() if r.method == "train")
        got = next(r for r in callee.ledger.records() if r.method == "train")
        assert sent.framed_bytes == sent.payload_bytes + FRAME_OVERHEAD * frames == got.framed_bytes
    finally:
        caller.stop()
        callee.stop()


def test_a_host_takes_two_large_train_requests_at_once_and_refuses_one_whose_caller_left():
    """client/host.py `request_hold`: with more clients than TAKEN_TRAIN_REQUESTS, large train
    requests take room (two at once); a small one, another method or a small process takes
    none; a request still waiting when its caller is gone is refused CANCELLED."""
    host = ClientHost.__new__(ClientHost)   # only the room and the client list are used
    host._request_room = threading.BoundedSemaphore(TAKEN_TRAIN_REQUESTS)
    host.client_ids = [0, 1, 2, 3]
    big = pb.Envelope(method="train", dst="client-1", data_bytes=HELD_REQUEST_BYTES)
    releases = [host.request_hold(big, lambda: True) for _ in range(TAKEN_TRAIN_REQUESTS)]
    assert all(callable(r) for r in releases)
    assert host.request_hold(pb.Envelope(method="train", data_bytes=HELD_REQUEST_BYTES - 1), lambda: True) is None
    assert host.request_hold(pb.Envelope(method="state_set", data_bytes=HELD_REQUEST_BYTES), lambda: True) is None
    checks: list[int] = []
    with pytest.raises(PayloadError, match="CANCELLED"):
        host.request_hold(big, lambda: bool(checks.append(1)))   # no room, and the caller left
    assert checks == [1]
    releases[0]()
    assert callable(host.request_hold(big, lambda: True))   # room again
    host.client_ids = [0, 1]
    assert host.request_hold(big, lambda: True) is None     # a small process takes its requests at once
