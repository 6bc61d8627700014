"""Replies that pass the codec but not their meaning (issue 17, item 1): a scalar of the wrong
type where arithmetic would use it, a weight no client of the sender could claim, a size the
reply spec does not allow, finite values whose weighted sum overflows.  Each ends in a typed
rejection of the hostile client only; the run completes with the honest clients' model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.client.host import ClientHost
from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import COUNT_KEY, WEIGHT_KEY, Payload
from fedhop.common.processors.validation import finite_step
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import encode
from fedhop.common.wire.ledger import Ledger
from tests.cluster import Cluster, failed_clients_by_round, fedavg_reference
from tests.test_hostile import CENTERS, CURV, LR, ROUNDS, SIZES, STEPS, HostileClient, _cfg, _frame_header


class MeaningClient(HostileClient):
    """Breaks the honest reply's meaning, not its form."""

    MODES = ("num_results_text", "compute_text", "weight_1e300", "weight_x1000", "overflowing_values",
             "compute_forever", "oversized")

    def corrupt(self, honest: Payload, env: pb.Envelope) -> list[bytes]:
        if self.mode not in self.MODES:   # the malformed-form attacks of tests/test_hostile.py
            return super().corrupt(honest, env)
        t, s = dict(honest.tensors), dict(honest.scalars)
        mode = self.mode
        if mode == "num_results_text":
            s[COUNT_KEY] = "x"
        elif mode == "compute_text":
            s["compute_seconds"] = "x"
        elif mode == "weight_1e300":
            s[WEIGHT_KEY] = 1e300
        elif mode == "weight_x1000":
            s[WEIGHT_KEY] = float(s[WEIGHT_KEY]) * 1000
        elif mode == "overflowing_values":   # finite, and within its weight bound: the weighted sum is Inf
            t["w"] = torch.full_like(t["w"], 3e38)
        elif mode == "compute_forever":
            s["compute_seconds"] = 1e12
        frames = encode(Payload(t, s), env).frames
        if mode == "oversized":   # 200 MB declared: far beyond the 24-byte spec, far below the 2 GiB codec limit
            env2 = pb.Envelope()
            env2.CopyFrom(env)
            env2.data_bytes = 50_000_000 * 4
            env2.tensors[0].shape[:] = [50_000_000]
            env2.tensors[0].nbytes = 50_000_000 * 4
            return [_frame_header(env2), *frames[1:]]
        return frames


CASES = [("num_results_text", "BAD_SCALAR"), ("compute_text", "BAD_SCALAR"), ("weight_1e300", "BAD_WEIGHT"),
         ("weight_x1000", "BAD_WEIGHT"), ("compute_forever", "BAD_SCALAR"), ("oversized", "TOO_LARGE"),
         ("overflowing_values", "NON_FINITE_AGGREGATE")]


def _run(tmp_path, mode: str, hostile_ids: list[int]):
    cfg = _cfg()
    cluster = Cluster(cfg, tmp_path)
    hostile = MeaningClient(cfg, mode)
    hostile.host = ClientHost(cfg, "client-procH", hostile_ids, "", Ledger())
    honest = [c for c in range(4) if c not in hostile_ids]
    try:
        cluster.add_client("client-proc0", honest[:1])
        cluster.add_client("client-proc1", honest[1:])
        assert hostile.register(cluster.address, ids=tuple(hostile_ids)).accepted
        summary = cluster.run()
    finally:
        cluster.close()
        hostile.close()
    return cluster, summary


@pytest.mark.parametrize("mode, code", CASES)
def test_reply_meaning_is_checked_before_arithmetic(tmp_path, mode, code):
    hostile_id = 3
    cluster, summary = _run(tmp_path, mode, [hostile_id])
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS, summary["error"]
    store = cluster.store()
    rejected = store.events("rejected_payload")
    assert [e["node"] for e in rejected] == [f"client-{hostile_id}"] * ROUNDS, rejected
    assert all(e["detail"].startswith(code) for e in rejected), [e["detail"] for e in rejected]
    assert all(ids == {hostile_id} for ids in failed_clients_by_round(store).values())   # no honest client blamed
    expected = fedavg_reference(CENTERS, CURV, SIZES, ROUNDS, STEPS, LR, {r: {hostile_id} for r in range(1, ROUNDS + 1)})
    np.testing.assert_allclose(cluster.coord.state.params["w"].double().numpy(), expected, rtol=1e-5, atol=1e-5)


def test_text_compute_seconds_from_the_lowest_ids_does_not_get_honest_results_rejected(tmp_path):
    """The hostile process hosts clients 0 and 1 of 4: a per-round vote on scalar types ties and
    sides with the lowest id; typed rules per reply reject the hostile results alone."""
    cluster, summary = _run(tmp_path, "compute_text", [0, 1])
    assert summary["status"] == "completed", summary["error"]
    assert {e["node"] for e in cluster.store().events("rejected_payload")} == {"client-0", "client-1"}
    assert all(ids == {0, 1} for ids in failed_clients_by_round(cluster.store()).values())


def test_finite_step_rolls_back_and_names_only_the_offender():
    cfg = _cfg()
    algo = build_algorithm(cfg)
    state = algo.init_state({"w": torch.zeros(6)})
    honest = {c: Payload({"w": torch.full((6,), float(c))}, {WEIGHT_KEY: 2.0}) for c in range(3)}
    results = {**honest, 7: Payload({"w": torch.full((6,), 3e38)}, {WEIGHT_KEY: 5.0})}
    aggregate, blamed = finite_step(algo, state, results, round=1)
    assert list(blamed) == [7] and blamed[7].startswith("NON_FINITE_AGGREGATE")
    expected = np.mean([0.0, 1.0, 2.0])   # the honest weighted mean, equal weights, server_lr 1
    np.testing.assert_allclose(state.params["w"].numpy(), np.full(6, expected), rtol=1e-6)
    assert float(aggregate.scalars[WEIGHT_KEY]) == 6.0


def test_an_edge_leaves_out_the_client_whose_values_overflow_its_partial():
    algo = build_algorithm(_cfg())
    honest = {c: Payload({"w": torch.full((6,), 1.0)}, {WEIGHT_KEY: 2.0}) for c in range(3)}
    partial, blamed = finite_step(algo, None, {**honest, 5: Payload({"w": torch.full((6,), 3e38)}, {WEIGHT_KEY: 4.0})},
                                  round=2)
    assert list(blamed) == [5]
    assert float(partial.scalars[WEIGHT_KEY]) == 6.0 and torch.equal(partial.tensors["w"], torch.full((6,), 6.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64])
def test_tensor_finite_agrees_with_torch_on_random_tensors_and_views(dtype):
    """common/algorithms/base.py `tensor_finite` (numpy's isfinite on the tensor's memory) gives
    torch.isfinite's answer on tensors holding NaN, +Inf, -Inf or none, on strided views and on
    0-dim tensors."""
    from fedhop.common.algorithms.base import tensor_finite
    rng = np.random.default_rng(17)
    for trial in range(60):
        shape = tuple(int(d) for d in rng.integers(1, 9, size=int(rng.integers(0, 4))))
        t = torch.from_numpy(np.asarray(rng.normal(size=shape) * 1e3)).to(dtype)
        if t.is_floating_point() and t.numel() and trial % 4:
            t.view(-1)[int(rng.integers(t.numel()))] = [float("nan"), float("inf"), float("-inf")][trial % 3]
        views = [t]
        if t.dim() >= 2:
            views += [t.transpose(0, 1), t[:, ::2]]
        for v in views:
            expected = bool(torch.isfinite(v).all()) if v.is_floating_point() else True
            assert tensor_finite(v) is expected, (trial, dtype, tuple(v.shape))


@pytest.mark.parametrize("seed", range(6))
def test_consistent_results_keeps_the_majority_kind_of_each_scalar(seed):
    """`consistent_results` against the rule computed here: per scalar, the kind (bool, str,
    number) most results send, ties to the kind of the lowest id; a result with any scalar of
    another kind is rejected with BAD_SCALAR naming it.  Random rounds where every result agrees
    (the same scalars and types: all kept, in id order) and where some do not (ints and floats
    are both numbers)."""
    from fedhop.common.processors.validation import consistent_results
    rng = np.random.default_rng(seed)
    values = {"number": [1, 2.5, -3.0, 0], "str": ["a", "bc"], "bool": [True, False]}
    names = ["loss", "label", "flag"]
    base = {"loss": "number", "label": "str", "flag": "bool"}
    ids = [int(i) for i in rng.choice(1000, size=int(rng.integers(3, 12)), replace=False)]
    results, kinds = {}, {}
    for cid in ids:
        odd = seed % 2 == 1 and rng.random() < 0.4
        kinds[cid] = {n: (str(rng.choice(list(values))) if odd else base[n]) for n in names}
        results[cid] = Payload(scalars={n: values[k][int(rng.integers(len(values[k])))] for n, k in kinds[cid].items()})
    want = {}
    for n in names:
        counts: dict[str, int] = {}
        for cid in sorted(ids):
            counts[kinds[cid][n]] = counts.get(kinds[cid][n], 0) + 1
        top = max(counts.values())
        want[n] = next(kinds[cid][n] for cid in sorted(ids) if counts[kinds[cid][n]] == top)
    kept, rejected = consistent_results(results)
    expect_kept = [cid for cid in sorted(ids) if all(kinds[cid][n] == want[n] for n in names)]
    assert list(kept) == expect_kept and all(kept[c] is results[c] for c in kept)
    assert sorted(rejected) == sorted(set(ids) - set(expect_kept))
    for cid, why in rejected.items():
        bad = next(n for n in names if kinds[cid][n] != want[n])
        assert why.startswith(f"BAD_SCALAR: result of client {cid}: scalar '{bad}' is a {kinds[cid][bad]}")
    if seed % 2 == 0:
        assert rejected == {} and list(kept) == sorted(ids)


def test_consistent_results_sees_the_same_scalars_in_another_order_as_one_layout(monkeypatch):
    """A decoded reply's scalars come in the order of its protobuf map, which differed between
    the client processes of one round (`fedhop bench scale`: a quarter of the replies in another
    order).  Such a round is the common case: every result kept, in id order, without the
    per-scalar count (`_kind`, made to fail here) that a round of mixed kinds needs."""
    from fedhop.common.processors import validation
    names = ["train_loss", "local_steps", "compute_seconds", "weight"]
    rng = np.random.default_rng(3)
    results = {}
    for cid in rng.choice(10_000, size=40, replace=False).tolist():
        order = [names[i] for i in rng.permutation(len(names))]
        results[cid] = Payload(scalars={n: (int(rng.integers(1, 9)) if n == "local_steps" else float(rng.random()))
                                        for n in order})
    assert len({tuple(p.scalars) for p in results.values()}) > 1

    def counted(v):
        raise AssertionError("the per-scalar count ran for a round whose results agree")

    monkeypatch.setattr(validation, "_kind", counted)
    kept, rejected = validation.consistent_results(results)
    assert rejected == {} and list(kept) == sorted(results) and all(kept[c] is results[c] for c in kept)
    results[min(results)].scalars["local_steps"] = 2.5   # a float where the others send an int: both numbers
    with pytest.raises(AssertionError, match="per-scalar count ran"):
        validation.consistent_results(results)
