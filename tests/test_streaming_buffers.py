"""What a streamed round's server holds at once (issue 32 item 2; common/processors/streaming.py,
common/transport/fabric.py, common/wire/codec.py):

- a reply offered with `take=True` leaves its tensors with the fold (folded, held or spilled), so
  its receive buffer is free for the next reply or a spilled one read back: one buffer serves the
  whole round, and the aggregate has the bits of the id-order reduction;
- a receive slot (`admit`) is held until the thread that received the reply has folded it
  (`release`), so with the default window of 1 one reply is being received or folded at a time;
- a reply larger than HOLD_FLOOR_BYTES is never held in memory ahead of its turn (`reply_budget`);
- a message handed over with `keep_frames=False` keeps none of its frames: each send cuts its own,
  byte for byte the eager cut, and an in-place change still stops a send (`SnapshotChanged`).
Over real processes (the fabric's large broadcast cut per send, the server's peak memory): the
memory tests of tests/test_streaming_aggregation.py (FEDHOP_SLOW) and `fedhop bench large`.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from fedhop.common.algorithms.base import WEIGHT_KEY, Payload
from fedhop.common.processors.streaming import HOLD_FLOOR_BYTES, OrderedFold, reply_budget
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import RECV_BUFFERS, SnapshotChanged, decode_frames, encode, hand_over

N = (RECV_BUFFERS.min_bytes // 4) + 1001   # float32 elements: a reply above the receive pool's minimum


def big_replies(seed: int, count: int, n: int = N) -> list[Payload]:
    g = torch.Generator().manual_seed(seed)
    return [Payload(tensors={"w": torch.rand(n, generator=g) - 0.5, "b": torch.randn(5, generator=g)},
                    scalars={WEIGHT_KEY: float(torch.rand(1, generator=g)) * 5 + 0.1}) for _ in range(count)]


def id_order(payloads: list[Payload]) -> dict[str, torch.Tensor]:
    """sum_i w_i t_i in id order, whole-tensor (independent of the fold's pieces)."""
    acc: dict[str, torch.Tensor] = {}
    for p in payloads:
        for name, t in p.tensors.items():
            term = t * float(p.scalars[WEIGHT_KEY])
            acc[name] = term.clone() if name not in acc else acc[name] + term
    return acc


def received_copy(p: Payload) -> Payload:
    """The reply as a transport hands it over: tensors in a receive buffer of the process pool."""
    enc = encode(p, pb.Envelope(), chunk_bytes=1 << 20)
    return decode_frames(enc.frames).payload


@pytest.mark.parametrize("seed", [1, 2])
def test_taken_replies_free_their_buffers_and_fold_to_the_id_order_bits(tmp_path, seed):
    count = 4
    payloads = big_replies(seed, count)
    expect = id_order(payloads)
    order = list(range(count))
    random.Random(seed).shuffle(order)
    fold = OrderedFold(list(range(count)), {}, budget_bytes=0, spill_dir=tmp_path)
    reused = RECV_BUFFERS.reused
    for key in order:
        reply = received_copy(payloads[key])
        assert fold.offer(key, reply, take=True)
        assert reply.tensors == {} and reply.scalars[WEIGHT_KEY] == payloads[key].scalars[WEIGHT_KEY]
        del reply
    fold.close()
    assert fold.folded == list(range(count))
    # every reply after the first, and every read-back, took a buffer another had freed
    assert RECV_BUFFERS.reused - reused >= count - 1 + fold.spilled - 1
    result = fold.result()
    assert result is not None
    for name, t in expect.items():
        assert torch.equal(result.tensors[name], t), name
    assert not list(tmp_path.iterdir())   # spill files removed


def test_without_take_the_callers_reply_is_left_whole():
    payloads = big_replies(4, 2, n=100)
    fold = OrderedFold([0, 1], {}, budget_bytes=0)
    fold.offer(1, payloads[1])
    fold.offer(0, payloads[0])
    fold.close()
    assert all(set(p.tensors) == {"w", "b"} for p in payloads)


def test_a_receive_slot_is_held_until_the_reply_is_folded():
    fold = OrderedFold([0, 1], {})
    assert fold.window == 1
    assert fold.admit(timeout=1.0)
    second = threading.Event()
    other = threading.Thread(target=lambda: fold.admit(timeout=60.0) and second.set())
    other.start()
    assert not second.wait(0.2)             # waits for the slot
    fold.release()                          # folded: the other reply may come in
    other.join(60.0)
    assert second.is_set()
    fold.release()                          # this thread holds none now: nothing changes
    assert not fold.admit(timeout=0.0)      # the other thread still holds its slot


def test_a_large_reply_is_never_held_in_memory_ahead_of_its_turn():
    small = {"w": (torch.float32, (1000,))}
    large = {"w": (torch.float32, (HOLD_FLOOR_BYTES // 4 + 1,))}
    assert reply_budget(small, 1.0) == HOLD_FLOOR_BYTES
    assert reply_budget(large, 1.0) == HOLD_FLOOR_BYTES < 4 * (HOLD_FLOOR_BYTES // 4 + 1)
    assert reply_budget({"w": (torch.float32, (HOLD_FLOOR_BYTES // 8,))}, 4.0) == HOLD_FLOOR_BYTES * 2


def test_frames_cut_per_send_are_not_kept_and_are_the_eager_bytes():
    w = torch.randn(50_000)
    b = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()   # strided
    eager = encode(Payload(tensors={"w": w, "b": b}, scalars={"n": 3}), pb.Envelope(), chunk_bytes=4096)
    enc = encode(hand_over(Payload(tensors={"w": w, "b": b}, scalars={"n": 3}), keep_frames=False),
                 pb.Envelope(), chunk_bytes=4096)
    for _ in range(2):   # two sends of the same message
        assert list(enc.frames) == list(eager.frames)
    assert all(f is None for f in enc.frames._cuts.cut)   # nothing kept between sends
    out = decode_frames(enc.with_header(pb.Envelope(dst="client-1")).frames).payload   # XXH3 checked
    assert torch.equal(out.tensors["w"], w) and torch.equal(out.tensors["b"], b)
    frames = iter(enc.frames)
    next(frames), next(frames)
    w.add_(1.0)
    with pytest.raises(SnapshotChanged):
        next(frames)


def test_a_clients_fresh_large_reply_is_handed_over_and_one_it_keeps_is_snapshot():
    """client/host.py `_hand_over_fresh`: a reply larger than one chunk whose tensors the process
    keeps nowhere else is sent from its own memory (no snapshot); one that shares memory with the
    model or a client's persistent state, or a small one, is snapshot at encode as before."""
    from fedhop.client.host import ClientHost

    host = ClientHost.__new__(ClientHost)   # only what `_hand_over_fresh` reads
    host.model = torch.nn.Linear(1500, 1000)   # a 6 MB weight
    host.states = {3: {"c": torch.zeros(2_000_000)}}

    def handed(p: Payload) -> bool:
        return all(getattr(t, "_fedhop_handed_over", None) == t._version for t in p.tensors.values())

    fresh = Payload(tensors={"w": torch.randn(2_000_000), "b": torch.randn(3)}, scalars={WEIGHT_KEY: 1.0})
    assert host._hand_over_fresh(fresh) is fresh and handed(fresh)
    enc = encode(fresh, pb.Envelope(), chunk_bytes=1 << 20)
    assert enc.frames._cuts.left == len(enc.frames) - 2   # nothing cut before the send (header and digest trailer aside)
    assert decode_frames(list(enc.frames)).payload.tensors["w"].equal(fresh.tensors["w"])
    for kept in (Payload(tensors={"w": host.model.weight.detach()}),
                 Payload(tensors={"w": torch.randn(2_000_000), "c": host.states[3]["c"][10:]}),
                 Payload(tensors={"w": torch.randn(1000)})):
        assert not handed(host._hand_over_fresh(kept))
        enc = encode(kept, pb.Envelope(), chunk_bytes=1 << 20)
        assert enc.frames._cuts.left == 0   # every frame cut at encode: the snapshot
