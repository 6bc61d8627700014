"""Tensor codec: round trips for every dtype and shape, chunking, and rejection of bad payloads."""
from __future__ import annotations

import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from fedhop.common.algorithms.base import Payload
from fedhop.common.wire import codec
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import (
    DTYPES,
    FRAME_OVERHEAD,
    Decoded,
    FrameDecoder,
    PayloadError,
    SnapshotChanged,
    check_tensors,
    decode_frames,
    encode,
    hand_over,
    make_envelope,
)
from fedhop.common.wire.message import FlatView, all_finite


def env(**kw):
    base = dict(run_id="r1", round=3, src="server", dst="client-4", method="train")
    base.update(kw)
    return make_envelope(**base)


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2 ** 31)), min(info.max, 2 ** 31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (4, 7), (2, 3, 5, 1)])
def test_round_trip_every_dtype_and_shape(dtype_name, shape):
    dtype = DTYPES[dtype_name]
    try:
        t = sample_tensor(dtype, shape)
    except (RuntimeError, TypeError):
        pytest.skip(f"torch cannot sample {dtype_name}")
    enc = encode(Payload(tensors={"t": t}), env(), chunk_bytes=5)
    out = decode_frames(enc.frames).payload.tensors["t"]
    assert out.dtype == t.dtype and tuple(out.shape) == tuple(t.shape)
    as_bytes = lambda x: x.contiguous().reshape(-1).view(torch.uint8).tolist()  # noqa: E731
    assert as_bytes(out) == as_bytes(t)


def test_large_tensor_spans_many_chunks_and_bytes_are_counted():
    t = torch.randn(3_000_001)  # 12 MB, not a multiple of the chunk
    small = torch.arange(10, dtype=torch.int64)
    chunk = 1 << 20
    payload = Payload(tensors={"w": t, "idx": small}, scalars={"lr": 0.5, "n": 7, "flag": True, "tag": "x"})
    enc = encode(payload, env(), chunk_bytes=chunk)
    data_bytes = t.numel() * 4 + small.numel() * 8
    assert enc.tensor_bytes == data_bytes
    assert len(enc.frames) == 1 + -(-data_bytes // chunk) + 1    # header, data, the XXH3 trailer
    assert len(enc.frames[-1]) == 9 and enc.envelope.checksum
    assert enc.payload_bytes == sum(len(f) for f in enc.frames)
    assert enc.framed_bytes == enc.payload_bytes + FRAME_OVERHEAD * len(enc.frames)
    dec = decode_frames(enc.frames)
    assert torch.equal(dec.payload.tensors["w"], t) and torch.equal(dec.payload.tensors["idx"], small)
    assert dec.payload.scalars == {"lr": 0.5, "n": 7, "flag": True, "tag": "x"}
    assert dec.payload_bytes == enc.payload_bytes and dec.envelope.round == 3


def test_frames_are_valid_protobuf_frames():
    enc = encode(Payload(tensors={"a": torch.ones(1000)}), env(), chunk_bytes=1024)
    first = pb.Frame.FromString(enc.frames[0])
    assert first.WhichOneof("body") == "header" and first.header.dst == "client-4"
    data = b"".join(pb.Frame.FromString(f).data for f in enc.frames[1:-1])
    assert data == torch.ones(1000).numpy().tobytes()
    last = pb.Frame.FromString(enc.frames[-1])
    assert last.WhichOneof("body") == "data_xxh3" and last.data_xxh3 == xxhash.xxh3_64_intdigest(data)


def test_decoded_tensors_are_views_of_one_buffer_not_copies():
    enc = encode(Payload(tensors={"a": torch.ones(100), "b": torch.zeros(50)}), env())
    out = decode_frames(enc.frames).payload.tensors
    # "b" lies right after "a" in the message's one receive buffer: no copy of either
    assert out["b"].data_ptr() == out["a"].data_ptr() + 100 * 4
    out["a"][0] = 7.0
    assert decode_frames(enc.frames).payload.tensors["a"][0] == 1.0   # each message its own buffer


def test_a_decoded_message_checks_all_its_tensors_at_once_and_any_change_voids_it():
    """message.FlatView: a small message of one float dtype is one array for finiteness and the
    fold; a processor that replaces a tensor voids it (each tensor is checked again)."""
    enc = encode(Payload(tensors={"a": torch.ones(3, 4), "b": torch.zeros(5)}), env())
    p = decode_frames(enc.frames).payload
    assert all_finite(p) is True and FlatView.of(p).array.shape == (17,)
    p.tensors["b"][2] = float("nan")   # in place: the flat view sees the same memory
    assert all_finite(p) is False
    p.tensors["b"] = torch.zeros(5)
    assert all_finite(p) is None   # replaced: no flat view
    mixed = decode_frames(encode(Payload(tensors={"a": torch.ones(3), "i": torch.ones(2, dtype=torch.int64)}),
                                 env()).frames).payload
    assert all_finite(mixed) is None


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_flat_views_finiteness_is_each_values_whatever_their_sum(dtype):
    """FlatView.finite is True exactly when every value is finite: a NaN, an Inf, or both
    infinities anywhere make it False; finite values whose sum overflows (the dtype's largest,
    twice) and an empty view are finite.  Checked against numpy's elementwise isfinite."""
    big = np.finfo(dtype).max
    cases = [np.arange(9, dtype=dtype) / 7, np.zeros(0, dtype=dtype), np.array([big, big, -1], dtype=dtype),
             np.array([1, np.nan, 2], dtype=dtype), np.array([np.inf, 1], dtype=dtype),
             np.array([-np.inf, 0.5, np.inf], dtype=dtype), np.array([big, big, np.nan], dtype=dtype),
             np.array([0, -np.inf], dtype=dtype)]
    for values in cases:
        with np.errstate(over="ignore", invalid="ignore"):
            got = FlatView(values, ()).finite()
        assert got is bool(np.isfinite(values).all()), values


def _tamper(frames, mutate):
    head = pb.Frame.FromString(frames[0]).header
    mutate(head)
    return [pb.Frame(header=head).SerializeToString(), *frames[1:]]


def test_rejects_wrong_byte_count():
    enc = encode(Payload(tensors={"a": torch.ones(10)}), env())
    frames = _tamper(enc.frames, lambda h: setattr(h.tensors[0], "nbytes", 44))
    with pytest.raises(PayloadError, match="SIZE_MISMATCH.*'a'"):
        decode_frames(frames)
    with pytest.raises(PayloadError, match="SIZE_MISMATCH"):
        decode_frames(enc.frames[:1])  # truncated: data frame missing


def test_rejects_unknown_dtype_and_bad_shape():
    enc = encode(Payload(tensors={"a": torch.ones(10)}), env())
    with pytest.raises(PayloadError, match="BAD_DTYPE.*'float128'"):
        decode_frames(_tamper(enc.frames, lambda h: setattr(h.tensors[0], "dtype", "float128")))
    with pytest.raises(PayloadError, match="SIZE_MISMATCH"):
        decode_frames(_tamper(enc.frames, lambda h: h.tensors[0].shape.__setitem__(0, 11)))


def test_rejects_huge_declared_size_before_allocating():
    enc = encode(Payload(tensors={"a": torch.ones(10)}), env())

    def huge(h):
        h.tensors[0].shape[0] = 10 ** 12
        h.tensors[0].nbytes = 4 * 10 ** 12
        h.data_bytes = 4 * 10 ** 12
    with pytest.raises(PayloadError, match="TOO_LARGE"):
        decode_frames(_tamper(enc.frames, huge), max_payload_bytes=1 << 30)


def test_rejects_garbage_frames():
    with pytest.raises(PayloadError, match="MALFORMED"):
        decode_frames([b"\x12\x05abc"])
    with pytest.raises(PayloadError, match="MALFORMED"):
        decode_frames([b"\x7f\x01a"])
    with pytest.raises(PayloadError, match="MALFORMED_HEADER"):
        decode_frames([b"\x0a\x03\xff\xff\xff"])


def test_check_tensors_names_the_problem():
    p = Payload(tensors={"w": torch.zeros(3)})
    check_tensors(p, {"w": (torch.float32, (3,))}, "reply")
    with pytest.raises(PayloadError, match="BAD_SHAPE.*'w'"):
        check_tensors(p, {"w": (torch.float32, (4,))}, "reply")
    with pytest.raises(PayloadError, match="BAD_DTYPE.*'w'"):
        check_tensors(p, {"w": (torch.float64, (3,))}, "reply")
    with pytest.raises(PayloadError, match="missing.*'v'"):
        check_tensors(p, {"v": (torch.float32, (3,))}, "reply")


# ----------------------------------------------------------------------------- frames, snapshot, hand-over
def eager_frames(payload: Payload, envelope: pb.Envelope, chunk: int) -> list[bytes]:
    """The frames as protobuf itself serialises them, cut all at once: the wire bytes that both
    the default and the lazy (handed-over) frames must reproduce exactly."""
    data = b"".join(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for t in payload.tensors.values())
    head = pb.Frame(header=envelope).SerializeToString()
    trailer = [pb.Frame(data_xxh3=xxhash.xxh3_64_intdigest(data)).SerializeToString()] if envelope.checksum else []
    return [head] + [pb.Frame(data=data[o:o + chunk]).SerializeToString() for o in range(0, len(data), chunk)] + trailer


def test_frames_are_the_eager_cut_byte_for_byte_whether_cut_now_or_lazily():
    import random
    rng = random.Random(21)
    dtypes = [torch.float32, torch.float16, torch.int8, torch.float64, torch.bool, torch.int64, torch.bfloat16]
    for trial in range(200):
        tensors = {}
        for i in range(rng.randint(0, 5)):
            t = sample_tensor(rng.choice(dtypes), tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3))))
            tensors[f"t{i}"] = t.transpose(0, 1) if t.dim() >= 2 and rng.random() < 0.3 else t   # strided too
        chunk = rng.choice([1, 3, 5, 8, 64, 200, 4096])
        checksum = rng.random() < 0.8
        for handed in (False, True):
            payload = Payload(tensors={k: v.clone() if handed else v for k, v in tensors.items()}, scalars={"n": trial})
            if handed:
                hand_over(payload)
            enc = encode(payload, env(), chunk_bytes=chunk, checksum=checksum)
            lengths = enc.frame_lengths()                # from the chunk layout
            assert enc.envelope.checksum == (checksum and any(t.numel() for t in tensors.values()))   # no data, no trailer
            framed = enc.framed_bytes
            assert all(f is None for f in enc.frames._cuts.cut) == handed or not enc.frames._cuts.cut   # handed over: nothing cut yet
            want = eager_frames(payload, enc.envelope, chunk)
            assert list(enc.frames) == want, (trial, handed)
            assert lengths == [len(f) for f in want] and len(enc.frames) == len(want)
            assert framed == sum(lengths) + FRAME_OVERHEAD * len(want)
            assert enc.frames[1:] == want[1:] and enc.frames[-1] == want[-1]
            resent = enc.with_header(env(dst="client-5"))  # same data frames, another header
            assert list(resent.frames)[1:] == want[1:] and resent.frames[0] != want[0]
            assert decode_frames(resent.frames).tensor_bytes == enc.tensor_bytes


def test_frames_carry_the_values_at_encode_time_whatever_the_caller_does_later():
    w = torch.arange(3000, dtype=torch.float32)
    b = torch.ones(7, 5, dtype=torch.float64).t()              # strided
    before = {"w": w.clone(), "b": b.clone()}
    enc = encode(Payload(tensors={"w": w, "b": b}), env(), chunk_bytes=1000)
    shared = enc.with_header(env(dst="client-5"))
    frames = iter(enc.frames)
    first = [next(frames), next(frames)]                        # a call in flight: two frames pulled
    w.add_(1.0)
    w[:10] = -5.0
    b.zero_()
    for out in (decode_frames(first + list(frames)), decode_frames(shared.frames)):
        assert out.payload.tensors.keys() == before.keys()
        for name, t in before.items():
            assert torch.equal(out.payload.tensors[name], t), name   # checksum verified too


def test_a_handed_over_tensor_changed_in_flight_is_never_sent():
    w = torch.arange(3000, dtype=torch.float32)
    enc = encode(hand_over(Payload(tensors={"w": w})), env(), chunk_bytes=1000)
    frames = iter(enc.frames)
    next(frames), next(frames)
    w.add_(1.0)                                                 # the caller broke its promise
    with pytest.raises(SnapshotChanged):
        next(frames)
    w.sub_(1.0)                                                 # changed since: a new encode snapshots it
    again = encode(Payload(tensors={"w": w}), env(), chunk_bytes=1000)
    assert all(f is not None for f in again.frames._cuts.cut)


def test_handed_over_frames_are_cut_as_pulled_once_and_shared():
    enc = encode(hand_over(Payload(tensors={"w": torch.randn(10_000)})), env(), chunk_bytes=4096)
    cuts = enc.frames._cuts
    frames = iter(enc.frames)
    next(frames)                                                 # the header: nothing cut yet
    assert cuts.left == len(cuts.cut) == 10
    next(frames)
    assert cuts.left == 9
    again = enc.with_header(env(dst="client-5"))
    assert again.frames._cuts is cuts                            # one cut for every copy of the message
    rest = list(again.frames)
    assert cuts.left == 0 and cuts.views is None                 # all cut: the tensors' memory is let go
    assert all(a is b for a, b in zip(enc.frames[1:-1], rest[1:-1]))   # the data frames; the trailer is 9 bytes made per send


def test_the_digest_trails_the_data_and_a_missing_or_wrong_trailer_is_refused():
    """The XXH3-64 goes last (the header does not depend on the data's values, so it can go before
    any byte is hashed); the receiver refuses a message whose trailer is missing, wrong, early,
    misshapen or followed by more frames, and one whose header declares none but gets one."""
    a, b = torch.randn(5000), torch.randn(5000)
    enc = encode(Payload(tensors={"w": a}), env(msg_id="m"), chunk_bytes=4096)
    other = encode(Payload(tensors={"w": b}), env(msg_id="m"), chunk_bytes=4096)
    assert enc.frames[0] == other.frames[0] and enc.frames[-1] != other.frames[-1]
    frames = list(enc.frames)
    data = b"".join(pb.Frame.FromString(f).data for f in frames[1:-1])
    assert frames[-1] == b"\x19" + xxhash.xxh3_64_intdigest(data).to_bytes(8, "little")
    assert torch.equal(decode_frames(frames).payload.tensors["w"], a)

    def refused(bad: list[bytes]) -> str:
        with pytest.raises(PayloadError) as exc:
            decode_frames(bad)
        return exc.value.code

    assert refused(frames[:-1]) == "CHECKSUM_MISMATCH"                         # cut off after the data
    assert refused([*frames[:-1], other.frames[-1]]) == "CHECKSUM_MISMATCH"    # another message's digest
    assert refused([*frames[:2], frames[-1], *frames[2:-1]]) == "SIZE_MISMATCH"  # the trailer before the end
    assert refused([*frames, frames[-1]]) == "MALFORMED_FRAME"                  # a frame after the trailer
    assert refused([*frames[:-1], frames[-1] + b"\0"]) == "MALFORMED_FRAME"    # a trailer of 10 bytes
    assert refused([frames[-1], *frames]) == "MALFORMED_FRAME"                  # before the header
    plain = list(encode(Payload(tensors={"w": a}), env(), chunk_bytes=4096, checksum=False).frames)
    assert not pb.Frame.FromString(plain[0]).header.checksum and len(plain) == len(frames) - 1
    assert refused([*plain, frames[-1]]) == "MALFORMED_FRAME"                   # undeclared trailer
    flipped = bytearray(frames[1])
    flipped[100] ^= 0x04
    assert refused([frames[0], bytes(flipped), *frames[2:]]) == "CHECKSUM_MISMATCH"


def test_a_receiver_that_requires_the_checksum_refuses_a_message_that_leaves_it_out():
    """`security.checksum` on the receiver (`FrameDecoder.require_checksum`): a message with data
    bytes and no XXH3-64 declared is refused CHECKSUM_MISSING at its header, before any data is
    read; the same bytes with their trailer, and a message without data bytes, are accepted."""
    a = torch.randn(3000)

    def decoded(frames: list[bytes]) -> Decoded:
        dec = FrameDecoder(require_checksum=True)
        for f in frames:
            dec.feed(f)
        return dec.finish()

    plain = list(encode(Payload(tensors={"w": a}), env(), chunk_bytes=4096, checksum=False).frames)
    dec = FrameDecoder(require_checksum=True)
    with pytest.raises(PayloadError) as exc:
        dec.feed(plain[0])
    assert exc.value.code == "CHECKSUM_MISSING" and dec.filled == 0
    assert torch.equal(decode_frames(plain).payload.tensors["w"], a)   # a receiver that does not require it
    summed = list(encode(Payload(tensors={"w": a}), env(), chunk_bytes=4096).frames)
    assert torch.equal(decoded(summed).payload.tensors["w"], a)
    scalars = list(encode(Payload(scalars={"loss": 0.5}), env(), checksum=False).frames)
    assert decoded(scalars).payload.scalars == {"loss": 0.5}


def test_a_handed_over_message_is_hashed_as_its_frames_are_cut_and_a_change_fails_the_send():
    """A handed-over message of more than one chunk is hashed frame by frame as its send cuts
    the frames: once its data frames are pulled the digest is made, and its trailer equals an
    eager encode's.  A tensor changed in place fails the send (SnapshotChanged): at the next cut,
    or, for frames cut per send, at the trailer."""
    w = torch.randn(10_000)   # 40,000 bytes: ten 4 KiB frames
    eager = list(encode(Payload(tensors={"w": w.clone()}), env(msg_id="m"), chunk_bytes=4096).frames)
    enc = encode(hand_over(Payload(tensors={"w": w})), env(msg_id="m"), chunk_bytes=4096)
    cuts = enc.frames._cuts
    frames = iter(enc.frames)
    sent = [next(frames) for _ in range(len(eager) - 1)]   # header and every data frame
    assert sent == eager[:-1] and cuts._digest is not None and cuts._hasher is None   # hashed as cut
    assert next(frames) == eager[-1] and list(enc.frames) == eager

    per_send = encode(hand_over(Payload(tensors={"w": w}), keep_frames=False), env(msg_id="m"), chunk_bytes=4096)
    frames = iter(per_send.frames)
    assert [next(frames) for _ in range(len(eager) - 1)] == eager[:-1]
    w.add_(1.0)                                            # the caller broke its promise after the data
    with pytest.raises(SnapshotChanged):
        next(frames)                                       # the trailer

    enc = encode(hand_over(Payload(tensors={"w": w})), env(msg_id="m"), chunk_bytes=4096)
    frames = iter(enc.frames)
    next(frames), next(frames)                             # the header, the first data frame
    w.add_(1.0)
    with pytest.raises(SnapshotChanged):
        next(frames)                                       # the next cut


def test_a_digest_covers_frames_cut_out_of_order_or_never_cut_once():
    """Frames pulled out of order (a retry, another send) or not pulled at all are hashed by
    `digest` from the kept frames or the tensors, so the trailer is always the eager encode's; a
    second send of the same message hashes nothing again, and one whose bytes differ from those
    hashed (a write that bypassed the version counter) is refused by its receiver."""
    w = torch.randn(10_000)
    eager = list(encode(Payload(tensors={"w": w.clone()}), env(msg_id="o"), chunk_bytes=4096).frames)
    n = len(eager)
    for order in ([n - 2, 1, 3], [2, 5], []):              # data frames pulled before the trailer (1-based)
        for keep in (True, False):
            enc = encode(hand_over(Payload(tensors={"w": w}), keep_frames=keep), env(msg_id="o"), chunk_bytes=4096)
            assert [enc.frames[i] for i in order] == [eager[i] for i in order]
            assert enc.frames[n - 1] == eager[-1]         # the trailer
            assert list(enc.frames) == eager

    for keep in (True, False):   # sends of one message at once (a broadcast): every one the eager bytes
        enc = encode(hand_over(Payload(tensors={"w": w}), keep_frames=keep), env(msg_id="o"), chunk_bytes=4096)
        with ThreadPoolExecutor(max_workers=8) as pool:
            sends = list(pool.map(lambda _: list(enc.frames), range(16)))
        assert all(frames == eager for frames in sends)

    enc = encode(hand_over(Payload(tensors={"w": w}), keep_frames=False), env(msg_id="o"), chunk_bytes=4096)
    first = list(enc.frames)
    assert first == eager
    w.numpy()[7] += 1.0                                    # in place, the version counter untouched
    second = list(enc.frames)                              # cut again per send, not hashed again
    assert second[1] != eager[1] and second[-1] == eager[-1]
    with pytest.raises(PayloadError, match="CHECKSUM_MISMATCH"):
        decode_frames(second)


_VIEW_CASES = {
    "float32": lambda: torch.randn(5, 3), "0-d": lambda: torch.tensor(3.5), "bool": lambda: torch.tensor([True, False, True]),
    "empty": lambda: torch.zeros(0, 3), "requires grad": lambda: torch.randn(3, requires_grad=True),
    "transposed": lambda: torch.randn(4, 4).t(), "bfloat16": lambda: torch.randn(3).to(torch.bfloat16),
    "negative bit": lambda: torch.randn(3, dtype=torch.complex64).conj().imag,
    "parameter": lambda: torch.nn.Parameter(torch.randn(2, 2)), "slice": lambda: torch.randn(10)[2:5],
    "int64 column": lambda: torch.arange(12).reshape(4, 3)[:, 1]}


@pytest.mark.parametrize("case", list(_VIEW_CASES))
def test_a_tensors_bytes_view_holds_its_values_in_order_whatever_its_layout(case):
    """codec.tensor_bytes_view: numpy's view where `numpy()` gives one it can cast, torch's way
    for every other tensor (strided, empty, requiring grad, bfloat16, a negative bit); the bytes
    are always those of the tensor's values in row-major order, computed here through torch."""
    from fedhop.common.wire.codec import tensor_bytes_view

    t = _VIEW_CASES[case]()
    want = (t.detach().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if t.numel() else b"")
    assert bytes(tensor_bytes_view(t)) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_the_fold_over_decoded_replies_gives_the_bits_of_the_fold_tensor_by_tensor(dtype):
    """ReplyAccumulator folds a decoded reply through its flat view (two calls for all its
    tensors: numpy's for float32 and float64, torch's for float16); the running sums equal, bit
    for bit, those of the same replies folded tensor by tensor with torch (payloads not decoded),
    whatever the order of decoded and other replies.  The weights have full mantissas, so a
    product made in another precision than torch's (w rounded to the dtype, then one rounding)
    differs in some elements; the sums are checked after every reply.  A weight beyond the
    dtype's range, on a reply of zeros, gives torch's NaN (or zeros in float64) and no warning."""
    from fedhop.common.wire.message import ReplyAccumulator

    gen = torch.Generator().manual_seed(5)
    replies = [Payload(tensors={"w": (torch.randn(7, 30, generator=gen) * 2.0 ** (k % 7)).to(dtype),
                                "b": torch.randn(30, generator=gen).to(dtype)},
                       scalars={"weight": float(torch.rand(1, generator=gen)) * 10 + 1 / 3, "loss": 0.25 * k})
               for k in range(12)]
    decoded = [decode_frames(encode(r, env()).frames).payload for r in replies]
    assert all(FlatView.of(d) is not None for d in decoded)

    plain_acc, decoded_acc = ReplyAccumulator({}), ReplyAccumulator({})
    for built, received in zip(replies, decoded):
        assert plain_acc.add_if_finite(built) is None and decoded_acc.add_if_finite(received) is None
        for name in ("w", "b"):
            assert torch.equal(decoded_acc.out.tensors[name].view(-1).view(torch.int8),
                               plain_acc.out.tensors[name].view(-1).view(torch.int8))

    def fold(payloads):
        acc = ReplyAccumulator({})
        for p in payloads:
            assert acc.add_if_finite(p) is None
        return acc.result()

    plain = fold(replies)
    for mix in (decoded, [replies[0], *decoded[1:]], [*decoded[:3], replies[3], *decoded[4:]]):
        got = fold(mix)
        for name in ("w", "b"):
            assert torch.equal(got.tensors[name], plain.tensors[name])
        assert got.scalars == plain.scalars
    # a weight past the dtype's largest value on a reply of zeros (weight * 0 is no bound on the
    # sum): the product of the weight rounded to the dtype, as torch makes it, without a warning
    zeros = Payload(tensors={"w": torch.zeros(7, 30, dtype=dtype), "b": torch.zeros(30, dtype=dtype)},
                    scalars={"weight": 1e300})
    heavy = [zeros, decode_frames(encode(zeros, env()).frames).payload]
    sums = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for reply in heavy:
            acc = ReplyAccumulator({})
            assert acc.add_if_finite(reply) is None
            sums.append(acc.out.tensors["w"])
    assert torch.equal(sums[0].isnan(), sums[1].isnan()) and bool(sums[1].isnan().all()) is (dtype != torch.float64)
    # an overflowing reply is still refused, with the sums left as they were
    big = decode_frames(encode(Payload(tensors={"w": torch.full((7, 30), torch.finfo(dtype).max * 0.9, dtype=dtype),
                                                "b": torch.zeros(30, dtype=dtype)},
                                       scalars={"weight": 1.0}), env()).frames).payload
    acc = ReplyAccumulator({})
    assert acc.add_if_finite(decoded[0]) is None and acc.add_if_finite(big) is None
    before = acc.out.tensors["w"].clone()
    assert acc.add_if_finite(big) is not None and torch.equal(acc.out.tensors["w"], before)


@pytest.mark.parametrize("control", [False, True])
def test_a_broadcast_under_each_receivers_header_decodes_as_the_merged_envelope(control):
    """`Encoded.with_header` (one broadcast, one header per receiver): the header made from the
    routing fields and the broadcast's fields serialised once decodes to the envelope built by
    merging them field by field (computed here), is as long as that envelope serialised (the
    ledger's bytes), and carries the same data; an envelope holding more than routing fields is
    refused."""
    g = torch.Generator().manual_seed(5)
    payload = Payload(tensors={"w": torch.randn(7, 3, generator=g), "b": torch.randn(3, generator=g).double()},
                      scalars={"lr": 0.05, "round": 3, "last": True, "tag": "x" * 40},
                      control=pb.Control(peers=[pb.EdgeAddress(edge=2, address="10.0.0.2:7000")]) if control else None)
    shared = encode(payload, make_envelope(run_id="run-a", round=3, src="server", dst="", method="train"))
    for k in range(3):
        routing = dict(run_id="run-a", round=3, step=k, src="server", dst=f"client-{k}", method="train",
                       token="t" * k, msg_id=f"m{k}")
        sent = shared.with_header(make_envelope(**routing))
        merged = make_envelope(**routing)
        merged.tensors.extend(shared.envelope.tensors)
        for name, value in shared.envelope.scalars.items():
            merged.scalars[name].CopyFrom(value)
        if control:
            merged.control.CopyFrom(shared.envelope.control)
        merged.data_bytes, merged.checksum = shared.envelope.data_bytes, shared.envelope.checksum
        assert sent.envelope == merged
        head = merged.SerializeToString()
        assert len(sent.frames[0]) == len(codec._header_frame(merged)) == 1 + len(codec._varint(len(head))) + len(head)
        got = decode_frames(list(sent.frames))
        assert got.envelope == merged and got.payload.scalars == payload.scalars
        assert all(torch.equal(got.payload.tensors[n], t) for n, t in payload.tensors.items())
    preset = make_envelope(run_id="run-a", round=3, src="server", dst="client-9", method="train")
    preset.data_bytes = 1
    with pytest.raises(ValueError, match="routing fields only"):
        shared.with_header(preset)


def test_the_header_holds_the_specs_each_tensor_adds_for_any_layout():
    """encode merges a layout's serialized specs into the envelope (`_specs_bytes`, built once per
    layout): the header frame must be the bytes of an envelope whose specs were added one by one,
    for layouts of every dtype, 0-d and empty tensors, non-ASCII names and more layouts than the
    cache keeps."""
    gen = torch.Generator().manual_seed(11)
    names = sorted(DTYPES)
    for k in range(300):
        tensors = {}
        for j in range(int(torch.randint(1, 5, (1,), generator=gen))):
            dtype = DTYPES[names[int(torch.randint(len(names), (1,), generator=gen))]]
            shape = tuple(int(d) for d in torch.randint(0, 4, (int(torch.randint(0, 4, (1,), generator=gen)),),
                                                        generator=gen))
            tensors[f"t{k}.{j}-é"] = sample_tensor(dtype, shape)
        payload = Payload(tensors=tensors, scalars={"weight": 2.0})
        enc = encode(payload, env())
        by_hand = env()
        by_hand.msg_id = enc.envelope.msg_id
        for name, t in tensors.items():
            by_hand.tensors.add(name=name, dtype=codec.DTYPE_NAMES[t.dtype], shape=list(t.shape),
                                nbytes=t.numel() * t.element_size())
        codec.scalar_to_pb(2.0, by_hand.scalars["weight"])
        by_hand.data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        by_hand.checksum = by_hand.data_bytes > 0
        assert enc.frames[0] == codec._header_frame(by_hand), f"layout {k}"
        got = decode_frames(enc.frames).payload.tensors
        assert [(n, t.dtype, tuple(t.shape)) for n, t in got.items()] == \
               [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    assert len(codec._SPECS) <= 256


def test_a_header_declaring_a_negative_dimension_or_a_repeated_name_is_refused():
    enc = encode(Payload(tensors={"a": torch.ones(2, 3), "b": torch.ones(6)}), env())
    with pytest.raises(PayloadError, match="BAD_NAME"):
        decode_frames(_tamper(enc.frames, lambda h: setattr(h.tensors[1], "name", "a")))
    with pytest.raises(PayloadError, match="BAD_SHAPE.*'a'"):   # shape is int64 on the wire
        decode_frames(_tamper(enc.frames, lambda h: h.tensors[0].shape.__setitem__(0, -2)))


def _header_frame_of(header: bytes) -> bytes:
    """A header frame holding `header` as given (not re-serialized by protobuf)."""
    return bytes([0x0A]) + codec._varint(len(header)) + header


def test_a_layout_is_checked_once_by_the_bytes_its_specs_travel_in():
    """A receiver remembers a layout it has checked by its specs' bytes as the header carries them
    (`_checked_layout`): a second message of the layout gets the same checked layout; a change to
    any field of any spec is a new layout, checked and refused as before; the same specs in other
    bytes decode to the same tensors; a header past LAYOUT_HEADER_MAX is checked each time and
    not remembered, and no more than LAYOUTS_KEPT layouts are."""
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(6, dtype=torch.float64)}
    enc = encode(Payload(tensors=tensors, scalars={"weight": 1.5}), env())
    first, second = FrameDecoder(), FrameDecoder()
    for dec in (first, second):
        for f in enc.frames:
            dec.feed(f)
    assert second._layout is first._layout
    got = second.finish().payload
    assert {n: (t.dtype, tuple(t.shape)) for n, t in got.tensors.items()} == {"a": (torch.float32, (2, 3)),
                                                                              "b": (torch.float64, (6,))}
    assert torch.equal(got.tensors["a"], tensors["a"]) and torch.equal(got.tensors["b"], tensors["b"])
    # every field of every spec is part of what is remembered: each change is checked afresh
    refused = [(lambda h: setattr(h.tensors[0], "nbytes", 20), "SIZE_MISMATCH.*'a'"),
               (lambda h: setattr(h.tensors[1], "nbytes", 40), "SIZE_MISMATCH.*'b'"),
               (lambda h: setattr(h.tensors[1], "dtype", "float128"), "BAD_DTYPE.*'b'"),
               (lambda h: setattr(h.tensors[1], "name", "a"), "BAD_NAME"),
               (lambda h: h.tensors[0].shape.__setitem__(1, -3), "BAD_SHAPE.*'a'"),
               (lambda h: h.tensors[0].shape.__setitem__(1, 4), "SIZE_MISMATCH.*'a'"),
               (lambda h: h.tensors[0].shape.extend([1] * 40), "BAD_SHAPE.*'a'")]
    for mutate, match in refused:
        with pytest.raises(PayloadError, match=match):
            decode_frames(_tamper(enc.frames, mutate))
    # a layout of the same names and bytes but another shape and dtype: its own tensors
    other = {"a": torch.arange(6, dtype=torch.int32).reshape(3, 2), "b": torch.full((3, 2), 7.0, dtype=torch.float64)}
    got = decode_frames(encode(Payload(tensors=other), env()).frames).payload.tensors
    assert {n: (t.dtype, tuple(t.shape)) for n, t in got.items()} == {"a": (torch.int32, (3, 2)),
                                                                      "b": (torch.float64, (3, 2))}
    assert torch.equal(got["a"], other["a"]) and torch.equal(got["b"], other["b"])
    # the same specs, each with its fields in the reverse order: other bytes, the same tensors
    head = pb.Frame.FromString(enc.frames[0]).header
    specs = list(head.tensors)
    del head.tensors[:]
    raw = head.SerializeToString()
    for spec in specs:
        fields = [pb.TensorSpec(nbytes=spec.nbytes), pb.TensorSpec(shape=spec.shape),
                  pb.TensorSpec(dtype=spec.dtype), pb.TensorSpec(name=spec.name)]
        body = b"".join(f.SerializeToString() for f in fields)
        assert body != spec.SerializeToString()
        raw += bytes([0x42]) + codec._varint(len(body)) + body   # Envelope field 8, length-delimited
    got = decode_frames([_header_frame_of(raw), *enc.frames[1:]]).payload.tensors
    assert torch.equal(got["a"], tensors["a"]) and torch.equal(got["b"], tensors["b"])
    # a header past LAYOUT_HEADER_MAX: checked, decoded, not remembered
    big = encode(Payload(tensors={"w": torch.ones(3)}), env(run_id="r" * codec.LAYOUT_HEADER_MAX))
    known = len(codec._LAYOUTS)
    assert torch.equal(decode_frames(big.frames).payload.tensors["w"], torch.ones(3))
    assert len(codec._LAYOUTS) == known
    with pytest.raises(PayloadError, match="SIZE_MISMATCH.*'w'"):
        decode_frames(_tamper(big.frames, lambda h: setattr(h.tensors[0], "nbytes", 16)))
    for k in range(codec.LAYOUTS_KEPT + 10):   # more layouts than are kept
        decode_frames(encode(Payload(tensors={f"t{k}": torch.ones(1)}), env()).frames)
        assert len(codec._LAYOUTS) <= codec.LAYOUTS_KEPT


@pytest.mark.parametrize("dims", [33, 100])
def test_a_header_declaring_more_dimensions_than_a_tensor_holds_is_refused(dims):
    """A tensor spec of many dimensions of size 1 (its byte count right) is BAD_SHAPE before numpy
    or torch is asked to make it (numpy's ValueError past 64 dimensions crashed the receiver);
    MAX_DIMS dimensions decode, in the small-message (numpy view) and the large-message path."""
    enc = encode(Payload(tensors={"a": torch.ones(1)}), env())
    with pytest.raises(PayloadError, match=f"BAD_SHAPE.*'a': {dims} dimensions; at most {codec.MAX_DIMS}"):
        decode_frames(_tamper(enc.frames, lambda h: h.tensors[0].shape.extend([1] * (dims - 1))))
    for shape in ((1,) * codec.MAX_DIMS, (2,) * 21 + (1,) * (codec.MAX_DIMS - 21)):   # 4 B, 8 MiB
        t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        got = decode_frames(encode(Payload(tensors={"a": t}), env()).frames).payload.tensors["a"]
        assert got.shape == t.shape and torch.equal(got, t)


def test_varint_len_is_the_length_of_the_varint():
    """`varint_len(n)` (the framed-byte formulas' varint sizes, worked out without making the bytes)
    equals len(_varint(n)) at every 7-bit boundary up to 2^64 and on a dense range below 2^17."""
    values = list(range(0, 1 << 17, 7)) + [(1 << k) + d for k in range(65) for d in (-1, 0, 1) if (1 << k) + d >= 0]
    assert [codec.varint_len(n) for n in values] == [len(codec._varint(n)) for n in values]
    assert codec.varint_len(0) == 1 and codec.varint_len(127) == 1 and codec.varint_len(128) == 2
