"""Batches (common/transport/grpc.py, Batches): several logical clients' requests to one process
in one gRPC call, each still its own message with its own ledger records on both ends.

Checked on real loopback sockets: every reply reaches its request in order; an error reply or a
bad reply costs only its own request; each message's tensor and payload bytes equal its frames,
and the batch's framed bytes add up to the bundle's real size on the wire; and over real
processes a batched run gives the unbatched run's model bit for bit with the same messages."""
from __future__ import annotations

import gc
import json

import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.algorithms.base import Payload
from fedhop.common.records.runstore import RunStore
from fedhop.common.transport.base import Batched, HandlerError, RemoteError
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.wire.codec import FRAME_OVERHEAD, PayloadError, bundle_bytes, split_bundle
from fedhop.common.wire.ledger import Ledger, read_jsonl
from fedhop.deploy.launch.launcher import run_local
from tests.test_crossdevice import xd_config


@pytest.fixture()
def pair():
    served: list[str] = []
    callee = GrpcEndpoint("client-proc0", Ledger())

    def handler(request):
        dst = request.envelope.dst
        served.append(dst)
        if dst == "client-3":
            raise HandlerError("UNKNOWN_CLIENT", "client 3 is not hosted here")
        k = int(dst.split("-")[1])
        return Payload(tensors={"w": request.payload.tensors["w"] * k}, scalars={"k": k})

    address = callee.serve(handler, "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger())
    yield caller, callee, address, served
    caller.stop()
    callee.stop()


def test_one_call_many_messages_each_answered_and_recorded_exactly(pair):
    caller, callee, address, served = pair
    w = torch.arange(100, dtype=torch.float32)
    sizes = [10, 100, 37, 5, 64]
    prepared = [caller.prepare(Payload(tensors={"w": w[:n]})) for n in sizes]
    batch = [Batched(f"client-{k}", "train", p) for k, p in enumerate(prepared)]
    out = caller.call_many(address, batch, round=7, timeout=10)
    assert served == [f"client-{k}" for k in range(5)]                       # one process, in order
    for k, (n, reply) in enumerate(zip(sizes, out)):
        if k == 3:
            assert isinstance(reply, RemoteError) and reply.code == "UNKNOWN_CLIENT"
            continue
        assert torch.equal(reply.tensors["w"], w[:n] * k) and reply.scalars["k"] == k
    sent = [r for r in caller.ledger.records() if r.method == "train" and r.role == "sender"]
    got = {r.msg_id: r for r in callee.ledger.records() if r.method == "train" and r.role == "receiver"}
    assert [r.dst for r in sent] == [f"client-{k}" for k in range(5)]
    assert len({r.msg_id for r in sent}) == 5 and set(got) == {r.msg_id for r in sent}
    for p, r in zip(prepared, sent):
        assert r.tensor_bytes == p.tensor_bytes                              # exactly its own tensors
        assert r.payload_bytes > p.payload_bytes                             # its frames and its own header
        assert (got[r.msg_id].payload_bytes, got[r.msg_id].framed_bytes) == (r.payload_bytes, r.framed_bytes)
    replies = {r.msg_id: r for r in caller.ledger.records() if r.role == "receiver"}
    assert all(f"{r.msg_id}.reply" in replies for r in sent)               # every reply recorded, paired


def test_each_request_of_a_batch_may_carry_its_own_step():
    """`Batched.step` (an asynchronous dispatch's own minibatch stream): each message of the one
    call carries its request's step in its envelope (None: the batch's), the callee sees it, each
    reply answers for that step (a reply for another step would be refused as stale), and the
    ledgers of both ends record it."""
    steps: list[tuple[str, int]] = []
    callee = GrpcEndpoint("client-proc0", Ledger())

    def handler(request):
        steps.append((request.envelope.dst, int(request.envelope.step)))
        return Payload(scalars={"step": int(request.envelope.step)})

    address = callee.serve(handler, "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger())
    try:
        w = Payload(tensors={"w": torch.ones(8)})
        own = [11, None, 4, 11]
        batch = [Batched(f"client-{k}", "train", caller.prepare(w), step=s) for k, s in enumerate(own)]
        out = caller.call_many(address, batch, round=2, step=7, timeout=10)
        want = [11, 7, 4, 11]
        assert steps == [(f"client-{k}", s) for k, s in enumerate(want)]
        assert [reply.scalars["step"] for reply in out] == want
        for ledger in (caller.ledger, callee.ledger):
            assert sorted((r.dst, r.step) for r in ledger.records() if r.method == "train") == \
                sorted((f"client-{k}", s) for k, s in enumerate(want))
    finally:
        caller.stop()
        callee.stop()


def test_a_batch_leaves_no_reference_cycles(pair):
    """A batch's replies (their buffers, tensors and decoders) are freed by reference counting
    once the caller drops them, not at the garbage collector's next pass: role processes collect
    the young generation rarely (common/util/procexit.py `freeze_heap`), so a cycle would keep a
    round's replies alive for many rounds."""
    caller, _, address, _ = pair
    prepared = [caller.prepare(Payload(tensors={"w": torch.ones(n)})) for n in (8, 40, 3, 16)]
    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)   # what a collection finds unreachable stays in gc.garbage
        out = caller.call_many(address, [Batched(f"client-{k}", "train", p) for k, p in enumerate(prepared)],
                               round=2, timeout=10)
        assert isinstance(out[3], RemoteError) and torch.equal(out[2].tensors["w"], torch.ones(3) * 2)
        del out
        gc.collect()
        ours = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("fedhop.")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert ours == []


def test_batch_framing_adds_up_to_the_bundle_on_the_wire(pair):
    caller, _, address, _ = pair
    prepared = [caller.prepare(Payload(tensors={"w": torch.ones(n)})) for n in (1, 40, 300, 2000)]
    caller.call_many(address, [Batched(f"client-{k}", "train", p) for k, p in enumerate(prepared)],
                     round=1, timeout=10)
    sent = [r for r in caller.ledger.records() if r.method == "train" and r.role == "sender"]
    # rebuild the call's request from the recorded envelopes' sizes: every message is a header
    # frame and one data frame (all under one chunk); the bundle serialises them back to back
    frames = []
    for p, r in zip(prepared, sent):
        data = p.frames[1:]
        header_len = r.payload_bytes - sum(len(f) for f in data)
        frames += [b"h" * header_len, *data]
    assert sum(r.framed_bytes for r in sent) == FRAME_OVERHEAD + len(bundle_bytes(frames))
    assert sum(r.payload_bytes for r in sent) == sum(len(f) for f in frames)


def test_a_batch_whose_headers_overflow_the_chunk_goes_in_two_calls():
    """The fabric groups requests by their payloads without headers (`Fabric._batches`), so a group
    filled to one chunk is over it once each message has its header (run, source, destination,
    token).  Such a batch goes in as many calls as keep each bundle within a chunk (`batch_calls`):
    every request is answered, and the framed bytes add up to those calls' bundles."""
    from fedhop.common.transport.base import batch_calls
    assert batch_calls([3, 3, 3], 6) == [range(0, 2), range(2, 3)]
    assert batch_calls([10], 5) == [range(0, 1)] and batch_calls([7, 1], 5) == [range(0, 1), range(1, 2)]
    chunk = 64 * 1024
    callee = GrpcEndpoint("client-proc0", Ledger(), chunk_bytes=chunk)
    address = callee.serve(lambda r: Payload(scalars={"n": len(r.payload.tensors["w"])}), "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger(), chunk_bytes=chunk, token="t" * 100)
    try:
        prepared = caller.prepare(Payload(tensors={"w": torch.ones(1000)}))
        n = chunk // prepared.payload_bytes   # the payloads fit one chunk, with headers they do not
        out = caller.call_many(address, [Batched(f"client-{k}", "train", prepared) for k in range(n)],
                               round=1, timeout=10)
        assert [o.scalars["n"] for o in out] == [1000] * n
        sent = [r for r in caller.ledger.records() if r.method == "train" and r.role == "sender"]
        calls = batch_calls([r.payload_bytes for r in sent], chunk)
        assert len(calls) == 2 and sum(r.payload_bytes for r in sent) > chunk
        data = prepared.frames[1:]
        on_wire = 0
        for call in calls:
            frames = [f for i in call for f in (b"h" * (sent[i].payload_bytes - sum(len(d) for d in data)), *data)]
            on_wire += FRAME_OVERHEAD + len(bundle_bytes(frames))
        assert sum(r.framed_bytes for r in sent) == on_wire
    finally:
        caller.stop()
        callee.stop()


def test_split_bundle_takes_messages_apart_and_gives_garbage_back_whole(pair):
    caller, _, _, _ = pair
    msgs = [caller.prepare(Payload(tensors={"w": torch.ones(n)})) for n in (3, 0, 7)]
    frames = [f for m in msgs for f in m.frames]
    parts = split_bundle(frames)
    assert [len(p) for p in parts] == [len(m.frames) for m in msgs] and sum(parts, []) == frames
    assert split_bundle(frames[1:]) == [frames[1:]]          # data before any header
    assert split_bundle(frames[:-1]) == [frames[:-1]]        # the last message cut short
    assert split_bundle([b"\x0a\xff"]) == [[b"\x0a\xff"]]    # a truncated varint


def test_a_bad_reply_costs_only_its_own_request():
    """A reply larger than its request's bound is rejected (TOO_LARGE); the replies before it
    stand, the ones after it are cut with a typed error, and nothing raises."""
    from fedhop.common.transport.base import ReplyBound
    callee = GrpcEndpoint("client-proc0", Ledger())
    address = callee.serve(lambda r: Payload(tensors={"w": torch.ones(int(r.envelope.dst.split("-")[1]))}),
                           "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger())
    try:
        tight = ReplyBound(data_bytes=4 * 10, header_bytes=1024)
        batch = [Batched(f"client-{n}", "train", caller.prepare(Payload()), tight) for n in (5, 50, 6)]
        out = caller.call_many(address, batch, round=1, timeout=10)
        assert torch.equal(out[0].tensors["w"], torch.ones(5))
        assert isinstance(out[1], PayloadError) and out[1].code == "TOO_LARGE"
        assert isinstance(out[2], PayloadError) and out[2].code == "BATCH_CUT"
    finally:
        caller.stop()
        callee.stop()


class CorruptingEndpoint(GrpcEndpoint):
    """A callee whose reply to `client-1` has its last data byte flipped after it was hashed, as a
    faulty link would: the caller's XXH3 check refuses that reply (CHECKSUM_MISMATCH)."""

    def _reply(self, taken, outcome, reply_framing):   # every reply of a batch is made here (serve_batch)
        out = list(super()._reply(taken, outcome, reply_framing))
        if taken.decoded is not None and taken.decoded.envelope.dst == "client-1":
            out[-1] = out[-1][:-1] + bytes([out[-1][-1] ^ 0xFF])
        return out


def test_a_corrupted_reply_in_the_middle_costs_only_itself():
    """A checksum failure leaves the batch's framing intact (the reply's header declared its size):
    the reply is refused alone and the replies after it are read and used, each recorded."""
    callee = CorruptingEndpoint("client-proc0", Ledger())
    address = callee.serve(lambda r: Payload(tensors={"w": torch.full((8,), float(r.envelope.dst[-1]))}),
                           "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger())
    try:
        batch = [Batched(f"client-{k}", "train", caller.prepare(Payload())) for k in range(4)]
        out = caller.call_many(address, batch, round=1, timeout=10)
        assert isinstance(out[1], PayloadError) and out[1].code == "CHECKSUM_MISMATCH"
        for k in (0, 2, 3):
            assert torch.equal(out[k].tensors["w"], torch.full((8,), float(k))), k
        sent = {r.dst: r for r in caller.ledger.records() if r.method == "train" and r.role == "sender"}
        assert "reply rejected: CHECKSUM_MISMATCH" in sent["client-1"].error
        assert [sent[f"client-{k}"].error for k in (0, 2, 3)] == ["", "", ""]
    finally:
        caller.stop()
        callee.stop()


def test_each_reply_of_a_batch_is_used_as_it_comes_and_kept_at_the_deadline():
    """With transport.reply_bundle = 1 the fabric gets each reply of a batch when it is complete
    (`call_many(on_each=)`), not when the batch ends: the first two clients' replies arrive while the third is still training, and
    when the third misses the round's deadline the first two still count; only the third fails,
    and the ledger records it lost."""
    import threading

    from fedhop.common.transport.fabric import Fabric, Send
    release, events = threading.Event(), []

    def handler(request):
        k = int(request.envelope.dst.split("-")[1])
        if k == 2:
            events.append("client-2 training")
            release.wait(60)   # past the round's deadline
        return Payload(scalars={"k": k})

    callee = GrpcEndpoint("client-proc0", Ledger())
    callee.replies_per_bundle = 1   # transport.reply_bundle = 1: each reply sent the moment it is computed
    address = callee.serve(handler, "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger())
    fabric = Fabric(caller, batch=True)
    try:
        requests = [Send(key=k, address=address, dst=f"client-{k}", method="train",
                         on_reply=lambda key: events.append(f"reply {key}")) for k in range(3)]
        results, failures = fabric.send_and_receive(requests, round=1, timeout=5, call_timeout=5)
        assert {k: r.scalars["k"] for k, r in results.items()} == {0: 0, 1: 1}
        assert list(failures) == [2] and ("DEADLINE_EXCEEDED" in failures[2] or "timeout" in failures[2])
        # client 2 is still held (`release` is set only below): replies 0 and 1 arrived during its training
        assert sorted(events) == ["client-2 training", "reply 0", "reply 1"]
        sent = {r.dst: r.status for r in caller.ledger.records() if r.method == "train" and r.role == "sender"}
        got = {r.msg_id.split(".")[0] for r in caller.ledger.records() if r.role == "receiver"}
        assert sent["client-0"] == sent["client-1"] == "ok" and len(got) == 2
    finally:
        release.set()
        fabric.close()
        caller.stop()
        callee.stop()


def test_requests_whose_message_or_reply_may_exceed_a_chunk_are_not_batched():
    """A large reply must be received under the streaming fold's gate (`GatedBound`, pulled,
    possibly into a file) and a large request is streamed: such requests go alone, with their own
    call's deadline; the small ones to one process share a call."""
    from fedhop.common.transport.base import ReplyBound
    from fedhop.common.transport.fabric import Fabric, Send

    class Bounded:
        def __init__(self, data_bytes: int) -> None:
            self.bound = ReplyBound(data_bytes=data_bytes, header_bytes=1024)

        def __call__(self, reply, who):
            return reply

    caller = GrpcEndpoint("server", Ledger())
    fabric = Fabric(caller, batch=True)
    try:
        chunk = caller.chunk_bytes
        small, large = Payload(tensors={"w": torch.ones(4)}), Payload(tensors={"w": torch.ones(chunk // 4 + 1)})
        reqs = [Send(key=0, address="a", dst="client-0", method="train", message=small, inbound=Bounded(chunk)),
                Send(key=1, address="a", dst="client-1", method="train", message=small, inbound=Bounded(chunk + 1)),
                Send(key=2, address="a", dst="client-2", method="train", message=large),
                Send(key=3, address="a", dst="client-3", method="train", message=small),
                Send(key=4, address="b", dst="client-4", method="train", message=small)]
        encoded = {id(r.message): (r.message, caller.prepare(r.message)) for r in reqs}
        groups = [[r.key for r in g] for g in fabric._batches(reqs, encoded)]
        assert groups == [[0, 3], [4], [1], [2]]
    finally:
        fabric.close()
        caller.stop()


def test_batched_run_equals_the_unbatched_run(tmp_path):
    """Real processes, 3 client processes, 30 of 3,000 clients a round: the same model bit for
    bit, the same messages (ids aside) with the same tensor and payload bytes, one call per
    process and round instead of one per client."""
    def run(batch: bool):
        out = tmp_path / ("batch" if batch else "plain")
        text = xd_config(count=3000, per_round=30, processes=3, rounds=3)
        text = text.replace("[clients]", f"[transport]\nbatch = {str(batch).lower()}\n[clients]")
        cfg = tmp_path / f"{out.name}.toml"
        cfg.write_text(text)
        assert run_local(str(cfg), [], str(out), quiet=True, show_table=False) == 0
        assert json.loads((out / "summary.json").read_text())["status"] == "completed"
        store = RunStore(out / "run.db", create=False)
        assert store.check_agreement().ok
        rows = sorted((m["round"], m["dst"], m["method"], m["tensor_bytes"]) for m in store.messages()
                      if m["role"] == "sender" and m["method"].startswith("train"))
        payload = sum(m["payload_bytes"] for m in store.messages() if m["role"] == "sender"
                      and m["method"].startswith("train"))
        return load_file(out / "model.safetensors"), rows, payload
    plain_model, plain_rows, plain_payload = run(False)
    batch_model, batch_rows, batch_payload = run(True)
    assert all(bool((plain_model[k] == batch_model[k]).all()) for k in plain_model)
    assert batch_rows == plain_rows and len(plain_rows) == 2 * 3 * 30   # requests and replies, per client
    assert batch_payload == plain_payload


def test_every_message_of_a_batch_must_speak_for_the_caller():
    """A participant holding client-proc1's node token sends client-proc0 one bundle: its own
    `ping`, then a `shutdown` whose envelope claims to come from the server.  The interceptor
    checks every message's `src` against the token's node (not only the first), so the call is
    refused PERMISSION_DENIED and client-proc0 never sees the shutdown."""
    import grpc

    from fedhop.common.security.auth import NodeCredentials
    from fedhop.common.transport.grpc import CALL
    from fedhop.common.wire.codec import encode, make_envelope
    secret = b"cluster-secret-for-the-batch-test"
    seen: list[str] = []
    victim = GrpcEndpoint("client-proc0", Ledger(), credentials=NodeCredentials("client-proc0", secret=secret))
    address = victim.serve(lambda r: seen.append(r.envelope.method) or Payload(), "127.0.0.1:0")
    hostile = NodeCredentials("client-proc1", secret=secret)

    def message(src: str, method: str) -> list[bytes]:
        env = make_envelope(run_id="", round=1, src=src, dst="client-proc0", method=method)
        return encode(Payload(), env).frames

    channel = grpc.insecure_channel(address)
    try:
        stub = channel.unary_stream(CALL, request_serializer=None, response_deserializer=None)
        honest = list(stub(bundle_bytes(message("client-proc1", "ping")), timeout=10,
                           metadata=hostile.metadata()))
        assert honest and seen == ["ping"]                                   # its own message is served
        with pytest.raises(grpc.RpcError) as refused:
            list(stub(bundle_bytes(message("client-proc1", "ping") + message("server", "shutdown")), timeout=10,
                      metadata=hostile.metadata()))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "server" in (refused.value.details() or "")
        assert seen == ["ping"]                                              # nothing of the forged bundle ran
    finally:
        channel.close()
        victim.stop()


# ----------------------------------------------------------------------------- reply bundles
def bundles_on_wire(reply_frames: list[list[int]], per_bundle: int, limit: int) -> tuple[int, int]:
    """The number of reply bundles and their bytes on the wire, computed here from the rule the
    docs state (a reply opens a bundle when the open one holds `per_bundle` replies or the reply's
    frames would take it over `limit`; a bundle is a FrameBundle message with gRPC's 5-byte
    prefix and each frame's tag and length varint), independently of ReplyBundles."""
    def varint_len(n: int) -> int:
        return max(1, (n.bit_length() + 6) // 7)

    groups: list[list[int]] = []
    count = 0
    for lengths in reply_frames:
        cost = sum(n + 1 + varint_len(n) for n in lengths)
        if not groups or count >= per_bundle or sum(n + 1 + varint_len(n) for n in groups[-1]) + cost > limit:
            groups.append([])
            count = 0
        groups[-1].extend(lengths)
        count += 1
    return len(groups), sum(FRAME_OVERHEAD + sum(n + 1 + varint_len(n) for n in g) for g in groups)


@pytest.mark.parametrize("per_bundle,chunk,count,numel", [(16, 4 << 20, 40, 50), (4, 4 << 20, 10, 1),
                                                          (16, 8192, 12, 600)])
def test_a_batchs_replies_come_in_bundles_whose_framing_both_ends_count_alike(per_bundle, chunk, count, numel):
    """`count` replies of `numel` floats: they come back in the bundles the rule gives (by count,
    or by size where three replies of 2.4 kB fill an 8 kB chunk), the caller reads that many reply
    messages, and the replies' framed bytes on both ends add up to those bundles on the wire."""
    import fedhop.common.transport.grpc as grpc_transport
    callee = GrpcEndpoint("client-proc0", Ledger(), chunk_bytes=chunk)
    callee.replies_per_bundle = per_bundle
    address = callee.serve(lambda r: Payload(tensors={"d": torch.full((numel,), 1.0)}), "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger(), chunk_bytes=chunk)
    seen: list[int] = []
    original = grpc_transport.BatchDecoder.feed_bundle
    grpc_transport.BatchDecoder.feed_bundle = lambda self, message: (seen.append(len(message)),
                                                                      original(self, message))[1]
    try:
        prepared = caller.prepare(Payload(tensors={"w": torch.ones(3)}))
        out = caller.call_many(address, [Batched(f"client-{k}", "train", prepared) for k in range(count)],
                               round=1, timeout=30)
        assert all(isinstance(o, Payload) and o.tensors["d"].numel() == numel for o in out)
    finally:
        grpc_transport.BatchDecoder.feed_bundle = original
        caller.stop()
        callee.stop()
    sent = sorted((r for r in callee.ledger.records() if r.method == "train.reply"), key=lambda r: int(r.src[7:]))
    got = {r.msg_id: r for r in caller.ledger.records() if r.method == "train.reply"}
    assert len(sent) == len(got) == count
    for r in sent:
        assert (got[r.msg_id].payload_bytes, got[r.msg_id].framed_bytes) == (r.payload_bytes, r.framed_bytes)
    data = [len(f) for f in callee.prepare(Payload(tensors={"d": torch.full((numel,), 1.0)})).frames[1:]]
    # each reply's header frame (its own msg_id) is the rest of its payload bytes, in the order served
    frames = [[r.payload_bytes - sum(data), *data] for r in sent]
    bundles, wire = bundles_on_wire(frames, per_bundle, chunk)
    assert len(seen) == bundles and sum(seen) + FRAME_OVERHEAD * bundles == wire
    assert sum(r.framed_bytes - r.payload_bytes for r in sent) == wire - sum(r.payload_bytes for r in sent)
    assert bundles == (-(-count // per_bundle) if chunk > 1 << 20 else -(-count // 3))


def test_the_caller_writes_a_reply_bundles_records_to_its_file_in_one_write(tmp_path):
    """Ten requests in one call, replies in bundles of four: the caller writes each bundle's
    records in one write (three writes, not twenty); the callee writes each record as it makes
    it (twenty: a request's receipt is on disk before it is served, should the process die);
    every record is in the files, paired by msg_id across the two ends."""
    callee = GrpcEndpoint("client-proc0", Ledger(tmp_path / "client.jsonl"))
    callee.replies_per_bundle = 4
    address = callee.serve(lambda r: Payload(tensors={"d": r.payload.tensors["w"] + 1}), "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger(tmp_path / "server.jsonl"))
    writes = {"server": 0, "client": 0}

    def count(end: str, ledger: Ledger) -> None:
        sink = ledger._sink
        assert sink is not None

        class Counting:
            def write(self, text: str) -> int:
                writes[end] += 1
                return sink.write(text)

            def __getattr__(self, name: str):
                return getattr(sink, name)

        ledger._sink = Counting()   # type: ignore[assignment]

    count("server", caller.ledger)
    count("client", callee.ledger)
    try:
        prepared = caller.prepare(Payload(tensors={"w": torch.ones(3)}))
        out = caller.call_many(address, [Batched(f"client-{k}", "train", prepared) for k in range(10)],
                               round=1, timeout=30)
        assert all(isinstance(o, Payload) and torch.equal(o.tensors["d"], torch.full((3,), 2.0)) for o in out)
    finally:
        caller.stop()
        callee.stop()
    assert writes == {"server": 3, "client": 20}
    on_server = read_jsonl(tmp_path / "server.jsonl")
    on_client = read_jsonl(tmp_path / "client.jsonl")
    assert len(on_server) == len(on_client) == 20
    key = lambda r: (r.msg_id, r.framed_bytes, r.payload_bytes)   # noqa: E731
    assert sorted(map(key, on_server)) == sorted(map(key, on_client))
    assert {r.role for r in on_server} == {"sender", "receiver"} == {r.role for r in on_client}


def test_with_bundles_of_four_the_first_four_replies_arrive_while_the_sixth_trains():
    """transport.reply_bundle = 4: replies 0-3 are one bundle, sent once the fourth is computed;
    the fifth waits for the sixth (their bundle is still open), so at the sixth's training the
    caller holds exactly the first four."""
    import threading
    release, arrived = threading.Event(), []
    holding: list[list[int]] = []

    def handler(request):
        k = int(request.envelope.dst.split("-")[1])
        if k == 5:
            deadline = threading.Event()
            for _ in range(600):   # until the first bundle is in at the caller (an event, not a sleep)
                if len(arrived) >= 4:
                    break
                deadline.wait(0.05)
            holding.append(sorted(arrived))
            release.wait(30)
        return Payload(scalars={"k": k})

    callee = GrpcEndpoint("client-proc0", Ledger())
    callee.replies_per_bundle = 4
    address = callee.serve(handler, "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger())
    try:
        prepared = caller.prepare(Payload())

        def on_each(i, result):
            arrived.append(i)
            if i == 4:   # the fifth came only with the sixth
                assert holding == [[0, 1, 2, 3]]

        t = threading.Thread(target=lambda: caller.call_many(
            address, [Batched(f"client-{k}", "train", prepared) for k in range(6)], round=1, timeout=30,
            on_each=on_each))
        t.start()
        for _ in range(600):
            if holding:
                break
            threading.Event().wait(0.05)
        assert holding == [[0, 1, 2, 3]]
        release.set()
        t.join(30)
        assert sorted(arrived) == list(range(6))
    finally:
        release.set()
        caller.stop()
        callee.stop()


def test_a_peer_that_leaves_the_checksum_out_is_refused_both_ways():
    """`security.checksum` (`Endpoint.use_checksum`, as every role sets it from its run's config) is
    required of what an endpoint receives, not only added to what it sends: a caller whose requests carry no XXH3-64 is refused CHECKSUM_MISSING by a callee that
    requires it (its handler never runs), and a callee whose reply carries none is refused by a
    caller that requires it; two endpoints that both turned it off exchange as before."""
    ran: list[str] = []

    def handler(r):
        ran.append(r.envelope.dst)
        return Payload(tensors={"w": torch.ones(16)})

    strict, lax = GrpcEndpoint("client-proc0", Ledger()), GrpcEndpoint("client-proc1", Ledger())
    strict.use_checksum(True)
    lax.use_checksum(False)
    strict_address, lax_address = strict.serve(handler, "127.0.0.1:0"), lax.serve(handler, "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger())
    try:
        w = Payload(tensors={"w": torch.zeros(16)})
        caller.use_checksum(False)
        with pytest.raises(RemoteError) as refused:
            caller.call(strict_address, "client-0", "train", w, round=1, timeout=10)
        assert "CHECKSUM_MISSING" in str(refused.value) and ran == []
        assert torch.equal(caller.call(lax_address, "client-1", "train", w, round=1, timeout=10).tensors["w"],
                           torch.ones(16))
        caller.use_checksum(True)
        with pytest.raises(PayloadError) as missing:
            caller.call(lax_address, "client-1", "train", w, round=2, timeout=10)
        assert missing.value.code == "CHECKSUM_MISSING"
        assert torch.equal(caller.call(strict_address, "client-0", "train", w, round=2, timeout=10).tensors["w"],
                           torch.ones(16))
    finally:
        caller.stop()
        strict.stop()
        lax.stop()


def _served_batch(one_by_one: bool = False) -> tuple[list[Payload | str], list[tuple]]:
    """Eight requests to one client process, the handler of client-3 refusing and of client-5
    failing, every other returning a tensor that shares memory with the handler's own state (as
    a client's model): the decoded replies (or the error codes) and the process's records less
    their times."""
    from fedhop.common.transport.base import ReplyBundles, batch_framing
    from fedhop.common.wire.codec import decode_frames, encode, make_envelope
    state = torch.zeros(4)

    def handler(request):
        k = int(request.envelope.dst.split("-")[1])
        if k == 3:
            raise HandlerError("UNKNOWN_CLIENT", "client 3 is not hosted here")
        if k == 5:
            raise ZeroDivisionError("a failed local step")
        state.fill_(float(k) + float(request.payload.tensors["w"][0]))   # the next call changes it again
        return Payload(tensors={"w": state}, scalars={"k": k})

    ep = GrpcEndpoint("client-proc0", Ledger(), run_id="r")
    bundles = ReplyBundles(ep.chunk_bytes, 4)
    place = lambda lengths: bundles.place(lengths)[1]   # noqa: E731
    messages = []
    for i in range(8):
        env = make_envelope(run_id="r", round=1, src="server", dst=f"client-{i}", method="train")
        frames = list(encode(Payload(tensors={"w": torch.full((4,), 10.0 * i)}), env).frames)
        messages.append((frames, batch_framing(i, map(len, frames)), place))
    served = ([ep.serve_frames(f, handler, framing=fr, reply_framing=rf) for f, fr, rf in messages] if one_by_one
              else list(ep.serve_batch(messages, handler)))
    out: list[Payload | str] = []
    for frames in served:
        decoded = decode_frames(frames)
        out.append(decoded.envelope.error.code if decoded.envelope.HasField("error") else decoded.payload)
    records = [(r.src, r.dst, r.role, r.method, r.tensor_bytes, r.payload_bytes, r.framed_bytes, r.status, r.error,
                r.msg_id) for r in ep.ledger.records()]
    return out, records


def test_a_batch_served_in_phases_gives_each_requests_own_reply_and_the_same_records():
    """`Endpoint.serve_batch` decodes every request first, then handles and answers each: each
    reply is what its handler returned when it returned (the handlers share one tensor and change
    it), a refusal and a failure answer only their own request, and the records are those of
    serving the requests one by one, in the same order."""
    out, records = _served_batch()
    expected_out, expected_records = _served_batch(one_by_one=True)
    assert out[3] == "UNKNOWN_CLIENT" and out[5] == "HANDLER_FAILED"
    for k in (0, 1, 2, 4, 6, 7):
        assert torch.equal(out[k].tensors["w"], torch.full((4,), float(k) + 10.0 * k)), k
        assert out[k].scalars["k"] == k
    assert [o if isinstance(o, str) else o.tensors["w"].tolist() for o in out] == \
        [o if isinstance(o, str) else o.tensors["w"].tolist() for o in expected_out]
    # msg ids are fresh per run of the helper: compared by position, the rest field by field
    assert [r[:-1] for r in records] == [r[:-1] for r in expected_records]
    assert [r[2] for r in records] == ["receiver", "sender"] * 8
    assert [r[7] for r in records if r[1] in ("client-3", "client-5")] == ["rejected", "rejected"]


def test_an_in_memory_batch_writes_its_callers_records_in_one_write_and_loses_none(tmp_path):
    """The in-process engine's batches (transports/inmemory/endpoint.py `call_many`): the caller's
    records of a batch's messages are written to its ledger file in one write when the batch
    ends (`Ledger.deferred`), as a gRPC caller writes a reply bundle's; every message's two
    records are there, in order, and the callee's own file is written as before."""
    from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

    net = InMemoryNetwork()
    callee = InMemoryEndpoint(net, "client-proc0", Ledger(tmp_path / "callee.jsonl"))
    address = callee.serve(lambda request: Payload(scalars={"k": int(request.envelope.dst.split("-")[1])}))
    caller = InMemoryEndpoint(net, "server", Ledger(tmp_path / "server.jsonl"))
    writes: list[str] = []
    sink = caller.ledger._sink
    real_write = sink.write
    sink.write = lambda text: writes.append(text) or real_write(text)   # type: ignore[method-assign]
    prepared = caller.prepare(Payload(tensors={"w": torch.ones(4)}))
    out = caller.call_many(address, [Batched(f"client-{k}", "train", prepared) for k in range(5)], round=3, timeout=10)
    assert [r.scalars["k"] for r in out] == list(range(5))
    assert len(writes) == 1
    lines = read_jsonl(tmp_path / "server.jsonl")
    assert [(r.dst if r.role == "sender" else r.src, r.role) for r in lines] == [
        (f"client-{k}", role) for k in range(5) for role in ("sender", "receiver")]
    assert len(read_jsonl(tmp_path / "callee.jsonl")) == 10
