"""A sparsifier's upload folded by its nonzeros (issue 47; common/wire/message.py SparseTensor):
where a reply goes straight into a streaming fold, top-k / random-k / threshold replies are
decoded into (indices, values) and added where they belong (`index_add_`), never made dense.

Checked against the dense path the rest of fedhop takes (decode to a dense tensor, then fold):
the same accumulator bits (replies, partials, weights, a max field, an overflow refused), the
same held and spilled replies read back, the same model after a whole run; and every malformed
(indices, values) pair refused with a one-line PayloadError.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.processors import pipeline
from fedhop.common.processors.compressors.payload import decode_payload, encode_payload
from fedhop.common.processors.compressors.sparse import RandK, Threshold, TopK
from fedhop.common.processors.streaming import OrderedFold
from fedhop.common.processors.validation import validate_reply
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import COUNT_KEY, WEIGHT_KEY, Payload, ReplyAccumulator, SparseTensor, reduce_payloads
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

SPEC = {"w": (torch.float32, (40, 25)), "b": (torch.float32, (25,))}


def coded_reply(compressor, seed: int, weight: float, partial: bool = False) -> Payload:
    """A reply with random (nonzero) tensors of SPEC coded by `compressor` (min_numel 1: every tensor)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(shape, generator=g) + 0.01 for n, (_, shape) in SPEC.items()}
    scalars: dict = {WEIGHT_KEY: weight, "train_loss": float(seed)}
    if partial:
        scalars[COUNT_KEY] = 2
    return encode_payload(Payload(tensors=tensors, scalars=scalars), compressor, torch.Generator().manual_seed(seed), 1)


def both(compressor, reply: Payload) -> tuple[Payload, Payload]:
    """(dense decode, decode by nonzeros) of one coded reply."""
    return (decode_payload(reply, SPEC, compressor, 1),
            decode_payload(reply, SPEC, compressor, 1, sparse=True))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


COMPRESSORS = [TopK(ratio=0.1), RandK(k=37, values="float16"), Threshold(threshold=1.0)]


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=lambda c: c.name)
def test_decoding_by_nonzeros_stands_for_the_dense_decode(compressor):
    dense, sparse = both(compressor, coded_reply(compressor, 3, 1.0))
    assert not dense.sparse and not sparse.tensors and set(sparse.sparse) == set(SPEC)
    for name, (dtype, shape) in SPEC.items():
        sp = sparse.sparse[name]
        assert sp.shape == shape and sp.dtype == dtype and sp.indices.dtype == torch.int64
        assert torch.equal(bits(sp.dense()), bits(dense.tensors[name]))
        nonzero = torch.nonzero(dense.tensors[name].reshape(-1)).reshape(-1)
        assert torch.equal(sp.indices, nonzero)     # every kept value is nonzero here, nothing else kept
    validate_reply(sparse, SPEC, "reply")


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=lambda c: c.name)
def test_the_fold_of_nonzeros_gives_the_dense_folds_bits(compressor):
    """Weighted replies, a partial (already weighted), dense and sparse mixed, a max field: the
    accumulator's bits equal the dense fold's (reduce_payloads over dense decodes)."""
    replies = [coded_reply(compressor, s, w, partial=(s == 4)) for s, w in [(1, 3.0), (2, 0.7), (4, 5.5), (5, 1e-3)]]
    decoded = [both(compressor, r) for r in replies]
    for ops in ({}, {"b": "max"}):
        expect = reduce_payloads([d for d, _ in decoded], ops)
        acc = ReplyAccumulator(ops)
        for i, (d, s) in enumerate(decoded):
            acc.add(s if i != 1 else d)              # one reply dense among the sparse ones
        got = acc.result()
        for name in SPEC:
            assert torch.equal(bits(got.tensors[name]), bits(expect.tensors[name])), name
        assert got.scalars == expect.scalars
        assert acc.sparse_added == (6 if not ops else 3)   # a max field is combined dense
        checked = ReplyAccumulator(ops)
        for d, s in decoded:
            assert checked.add_if_finite(s) is None
        for name in SPEC:
            assert torch.equal(bits(checked.result().tensors[name]), bits(expect.tensors[name])), name


def test_a_sum_the_nonzeros_would_overflow_is_refused_as_the_dense_one_is():
    big = 3e38
    idx = torch.tensor([3, 7])
    reply = Payload(sparse={"b": SparseTensor(idx, torch.tensor([big, 1.0]), (25,))},
                    tensors={"w": torch.zeros(40, 25)}, scalars={WEIGHT_KEY: 1.0})
    dense = Payload(tensors={"b": reply.sparse["b"].dense(), "w": torch.zeros(40, 25)}, scalars={WEIGHT_KEY: 1.0})
    for first, second in [(dense, dense), (reply, reply), (dense, reply), (reply, dense)]:
        acc = ReplyAccumulator({})
        assert acc.add_if_finite(first) is None
        why = acc.add_if_finite(second)
        assert why is not None and "'b'" in why and "NaN or Inf" in why
        assert acc.added == 1 and float(acc.result().tensors["b"][3]) == float(torch.tensor(big))   # unchanged


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["spilled", "held"])
def test_replies_ahead_of_their_turn_stay_their_nonzeros_held_or_spilled(tmp_path, budget):
    compressor = TopK(k=50)
    keys = [1, 2, 3, 4, 5]
    coded = {k: coded_reply(compressor, 10 + k, float(k)) for k in keys}
    fold = OrderedFold(keys, {}, budget_bytes=budget, spill_dir=tmp_path)
    for k in reversed(keys):                         # all but the last ahead of their turn
        reply = decode_payload(coded[k], SPEC, compressor, 1, sparse=True)
        held_before = fold.peak_held_bytes
        assert fold.offer(k, reply, take=True)
        assert not reply.tensors and not reply.sparse
        if budget and k != 1:
            assert fold.peak_held_bytes - held_before == (50 + 25) * (8 + 4)   # k = 50 of w, all 25 of b: int64 index + float32 value each
    assert fold.close() == []
    assert fold.spilled == (4 if budget == 0 else 0) and fold.acc.sparse_added == 10
    expect = reduce_payloads([decode_payload(coded[k], SPEC, compressor, 1) for k in keys], {})
    for name in SPEC:
        assert torch.equal(bits(fold.result().tensors[name]), bits(expect.tensors[name]))
    assert not list(tmp_path.glob("fedhop-fold-*/*"))   # spill files removed


@pytest.mark.parametrize("indices, values, why", [
    ([3, 2], [1.0, 2.0], "BAD_SHAPE"),               # not increasing
    ([1, 1], [1.0, 2.0], "BAD_SHAPE"),               # repeated
    ([0, 25], [1.0, 2.0], "BAD_SHAPE"),              # beyond numel
    ([-1, 2], [1.0, 2.0], "BAD_SHAPE"),              # negative
    ([0, 1, 2], [1.0, 2.0], "BAD_SHAPE"),            # counts differ
    ([0, 1], [1.0, math.nan], "NON_FINITE"),
    ([0, 1], [1.0, math.inf], "NON_FINITE"),
])
def test_malformed_nonzeros_are_refused_in_one_line(indices, values, why):
    reply = Payload(tensors={"w": torch.zeros(40, 25)}, scalars={WEIGHT_KEY: 1.0},
                    sparse={"b": SparseTensor(torch.tensor(indices), torch.tensor(values), (25,))})
    with pytest.raises(PayloadError) as err:
        validate_reply(reply, SPEC, "round 2 reply of client 5")
    assert err.value.code == why and "client 5" in str(err.value) and "'b'" in str(err.value)
    assert "\n" not in str(err.value)


def test_undeclared_or_doubled_nonzeros_are_refused():
    sp = SparseTensor(torch.tensor([0]), torch.tensor([1.0]), (25,))
    extra = Payload(tensors={"w": torch.zeros(40, 25), "b": torch.zeros(25)}, scalars={WEIGHT_KEY: 1.0},
                    sparse={"c": sp})
    with pytest.raises(PayloadError, match="undeclared tensor 'c'"):
        validate_reply(extra, SPEC, "reply")
    twice = Payload(tensors={"w": torch.zeros(40, 25), "b": torch.zeros(25)}, scalars={WEIGHT_KEY: 1.0},
                    sparse={"b": sp})
    with pytest.raises(PayloadError, match=r"\['b'\] given both dense and by their nonzeros"):
        validate_reply(twice, SPEC, "reply")
    wrong_dtype = Payload(tensors={"w": torch.zeros(40, 25)}, scalars={WEIGHT_KEY: 1.0},
                          sparse={"b": SparseTensor(torch.tensor([0]), torch.tensor([1.0], dtype=torch.float64), (25,))})
    with pytest.raises(PayloadError, match="'b' is torch.float64, expected torch.float32"):
        validate_reply(wrong_dtype, SPEC, "reply")


def _cfg(compression: str):
    """A config with `compression`, every float tensor coded."""
    return parse_config(quadratic_config(np.zeros((3, 25)), np.ones((3, 25)), [5, 5, 5], rounds=1, local_steps=1,
                                         lr=0.1) + f"\n[compression]\n{compression}\nmin_numel = 1\n")


class _Identity:
    def process(self, message, ctx):
        return message


def test_only_a_folded_reply_without_a_users_reader_stays_sparse():
    spec = {"w": (torch.float32, (25,))}
    cfg = _cfg('up = "topk"\nk = 5')
    reply = encode_payload(Payload(tensors={"w": torch.arange(1.0, 26.0)}, scalars={WEIGHT_KEY: 1.0}),
                           cfg.compression.params, torch.Generator(), 1)
    out = pipeline.reply_chain(cfg, spec, "train", folded=True)(reply, "r")
    assert set(out.sparse) == {"w"} and out.sparse["w"].indices.tolist() == [20, 21, 22, 23, 24]
    assert set(pipeline.reply_chain(cfg, spec, "train")(reply, "r").tensors) == {"w"}   # not folded: dense
    remove = pipeline.install(_Identity(), methods=["train"])
    try:   # a user's processor reads the reply: it gets it dense
        assert set(pipeline.reply_chain(cfg, spec, "train", folded=True)(reply, "r").tensors) == {"w"}
    finally:
        remove()
    half = _cfg('up = "fp16"')   # not a sparsifier: dense whatever the fold
    fp16 = encode_payload(Payload(tensors={"w": torch.arange(25.0)}, scalars={WEIGHT_KEY: 1.0}),
                          half.compression.params, torch.Generator(), 1)
    assert set(pipeline.reply_chain(half, spec, "train", folded=True)(fp16, "r").tensors) == {"w"}


@pytest.mark.parametrize("topology", ['kind = "star"', 'kind = "hierarchical"\nedges = 2'], ids=["star", "hierarchical"])
def test_a_run_folding_nonzeros_ends_with_the_dense_folds_model(tmp_path, topology):
    """The same top-k run twice over processes in memory: folded by nonzeros, and with a user's
    (identity) processor on `train` and `edge_round` replies, which makes every reply dense
    before the fold.  Same model bits; the first folded every upload by its nonzeros."""
    rng = np.random.default_rng(5)
    centers, curv = rng.normal(0, 2, (6, 300)), rng.uniform(0.5, 2.0, (6, 300))
    text = quadratic_config(centers, curv, [10, 30, 20, 5, 40, 15], rounds=3, local_steps=2, lr=0.2, processes=2,
                            per_round=4, topology=topology)
    cfg = parse_config(text + '\n[compression]\nup = "topk"\nratio = 0.05\nedge = "same"\n')
    sparse_summary, sparse_coord = run_inmemory(cfg, tmp_path / "sparse")
    remove = pipeline.install(_Identity(), methods=["train", "edge_round"])
    try:
        dense_summary, dense_coord = run_inmemory(cfg, tmp_path / "dense")
    finally:
        remove()
    assert sparse_summary["status"] == dense_summary["status"] == "completed"
    assert sparse_summary["aggregation"]["streamed_rounds"] == 3
    folded = sparse_summary["aggregation"]["sparse_tensors_folded"]   # one tensor "w" a reply
    if topology == 'kind = "star"':
        assert folded == 3 * 4                       # 4 clients' uploads a round
    else:
        assert 3 <= folded <= 3 * 2                  # the partials of the 2 edges (of those with sampled clients)
    assert dense_summary["aggregation"]["sparse_tensors_folded"] == 0
    assert torch.equal(bits(sparse_coord.state.params["w"]), bits(dense_coord.state.params["w"]))
