"""Batches (common/transport/grpc.py, Batches): several logical clients' requests to one process
in one gRPC call, each still its own message with its own ledger records on both ends.

Checked on real loopback sockets: every reply reaches its request in order; an error reply or a
bad reply costs only its own request; each message's tensor and payload bytes equal its frames,
and the batch's framed bytes add up to the bundle's real size on the wire; and over real
processes a batched run gives the unbatched run's model bit for bit with the same messages."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.algorithms.base import Payload
from fedhop.common.records.runstore import RunStore
from fedhop.common.transport.base import Batched, HandlerError, RemoteError
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.wire.codec import FRAME_OVERHEAD, PayloadError, bundle_bytes, split_bundle
from fedhop.common.wire.ledger import Ledger
from fedhop.deploy.launcher import run_local
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


def test_batched_run_equals_the_unbatched_run(tmp_path):
    """Real processes, 3 client processes, 30 of 3,000 clients a round: the same model bit for
    bit, the same messages (ids aside) with the same tensor and payload bytes, one call per
    process and round instead of one per client."""
    def run(batch: bool):
        out = tmp_path / ("batch" if batch else "plain")
        text = xd_config(count=3000, per_round=30, processes=3, rounds=3)
        if batch:
            text = text.replace("[clients]", "[transport]\nbatch = true\n[clients]")
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
