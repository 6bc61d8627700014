"""The server's model-sized copies during a streamed round (issue 32 item 2; common/wire/message.py,
common/algorithms/fedavg.py, common/processors/validation.py, common/processors/streaming.py).

Each test records, with a torch dispatch mode, every tensor an operation allocates (an output
that shares no storage with the operation's inputs) and checks that folding a large reply, the
FedAvg server step and the finiteness check around it allocate nothing model-sized, while
giving the bits of the whole-tensor arithmetic they replace (computed here independently); and
that a client's local solver leaves no gradients behind for the client process to keep.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedhop.common.algorithms.base import COUNT_KEY, WEIGHT_KEY, Payload, ServerState
from fedhop.common.algorithms.fedavg import FedAvg
from fedhop.common.algorithms.fedopt import FedAvgM
from fedhop.common.processors import validation
from fedhop.common.processors.streaming import OrderedFold
from fedhop.common.processors.validation import _magnitude, finite_streamed
from fedhop.common.wire.codec import RECV_BUFFERS
from fedhop.common.wire.message import CHUNK, ReplyAccumulator, tensor_finite

N = 2 * CHUNK + 37   # a "large" tensor: three pieces, the last one short


class Allocations(TorchDispatchMode):
    """The largest numel of any tensor an operation allocated (views and in-place/out= results
    share their input's storage and are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def replies(seed: int, count: int = 4) -> list[Payload]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        scalars = {WEIGHT_KEY: float(torch.rand(1, generator=g)) * 7 + 0.01, "train_loss": 0.5 + i}
        if i == 2:
            scalars[COUNT_KEY] = 3   # a partial: its fields are already weighted
        out.append(Payload(tensors={"w": torch.randn(N, generator=g) * 1e3, "hi": torch.randn(N, generator=g),
                                    "s": torch.randn(N, generator=g), "b": torch.randn(7, generator=g)},
                           scalars=scalars))
    return out


def whole_tensor_reduction(payloads: list[Payload], ops: dict[str, str]) -> dict[str, torch.Tensor]:
    """The id-order reduction with whole-tensor operations: sum_i w_i t_i for `wsum` (a partial's
    fields unweighted), sum for `sum`, elementwise max for `max`."""
    acc: dict[str, torch.Tensor] = {}
    for p in payloads:
        w = float(p.scalars[WEIGHT_KEY])
        for name, t in p.tensors.items():
            op = ops.get(name, "wsum")
            term = t * w if op == "wsum" and COUNT_KEY not in p.scalars else t
            if name not in acc:
                acc[name] = term.clone()
            else:
                acc[name] = torch.maximum(acc[name], term) if op == "max" else acc[name] + term
    return acc


@pytest.mark.parametrize("checked", [True, False])
def test_folding_large_replies_makes_no_model_sized_copy_and_keeps_the_bits(checked):
    ops = {"hi": "max", "s": "sum"}
    payloads = replies(1)
    acc = ReplyAccumulator(ops)
    (acc.add_if_finite if checked else acc.add)(payloads[0])   # the first allocates the running sums
    with Allocations() as seen:
        for p in payloads[1:]:
            assert (acc.add_if_finite(p) if checked else acc.add(p)) is None
            if checked:
                assert acc.last_magnitude == _magnitude(p)
    assert seen.largest <= CHUNK, f"an allocation of {seen.largest} elements while folding"
    expect = whole_tensor_reduction(payloads, ops)
    for name, t in expect.items():
        assert torch.equal(acc.out.tensors[name], t), name


def test_a_sum_near_the_dtype_limit_is_checked_piece_by_piece_and_left_unchanged():
    """Near float32's largest value the bound cannot clear the addition: every new element is
    computed (not kept) and checked, nothing model-sized is allocated, and an overflowing reply
    leaves the sums exactly as they were; a reply that does not overflow is folded exactly."""
    big = torch.finfo(torch.float32).max
    first = Payload(tensors={"w": torch.full((N,), 0.6 * big)}, scalars={WEIGHT_KEY: 1.0})
    acc = ReplyAccumulator({})
    assert acc.add_if_finite(first) is None
    before = acc.out.tensors["w"].clone()
    over = torch.zeros(N)
    over[-1] = 0.5 * big   # only the last element, in the last (short) piece, overflows
    with Allocations() as seen:
        why = acc.add_if_finite(Payload(tensors={"w": over}, scalars={WEIGHT_KEY: 1.0}))
    assert why is not None and "tensor 'w'" in why
    assert seen.largest <= CHUNK
    assert torch.equal(acc.out.tensors["w"], before) and acc.added == 1
    fine = torch.full((N,), 0.3 * big)
    assert acc.add_if_finite(Payload(tensors={"w": fine}, scalars={WEIGHT_KEY: 1.0})) is None
    assert torch.equal(acc.out.tensors["w"], before + fine)


def fedavg(server_lr: float) -> FedAvg:
    algo = FedAvg.__new__(FedAvg)   # only cfg.server_lr is read by the server step
    algo.cfg = type("Cfg", (), {"server_lr": server_lr})()
    return algo


@pytest.mark.parametrize("server_lr", [1.0, 0.7])
def test_fedavg_checked_step_equals_server_update(server_lr):
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(N, generator=g), "b": torch.randn(3, 4, generator=g)}
    agg = Payload(tensors={k: torch.randn(v.shape, generator=g) * 5 for k, v in params.items()},
                  scalars={WEIGHT_KEY: 2.7})
    plain = ServerState(params={k: v.clone() for k, v in params.items()})
    checked = ServerState(params={k: v.clone() for k, v in params.items()})
    fedavg(server_lr).server_update(plain, agg, 1)
    with Allocations() as seen:
        assert fedavg(server_lr).server_update_checked(checked, agg, 1) is None
    for k in params:   # w + eta_g * (sum_i p_i Delta_i / W), independently
        assert torch.equal(checked.params[k], plain.params[k]), k
        assert torch.equal(checked.params[k], params[k].add(agg.tensors[k] / 2.7, alpha=server_lr)), k
    if server_lr == 1.0:
        assert seen.largest <= CHUNK, f"an allocation of {seen.largest} elements in the server step"


def test_fedavg_checked_step_that_overflows_leaves_the_state_and_copies_nothing(monkeypatch):
    """finite_streamed with FedAvg: no deepcopy of the state; an overflowing step names the worst
    folded result and the state keeps its bits.  An algorithm with its own step still rolls back."""
    big = torch.finfo(torch.float32).max
    state = ServerState(params={"w": torch.full((N,), 0.9 * big), "b": torch.ones(5)})
    before = {k: v.clone() for k, v in state.params.items()}
    agg = Payload(tensors={"w": torch.zeros(N), "b": torch.zeros(5)}, scalars={WEIGHT_KEY: 1.0, COUNT_KEY: 2})
    agg.tensors["w"][CHUNK + 1] = 0.5 * big

    def no_copy(*_a, **_k):
        raise AssertionError("the state was deep-copied")
    monkeypatch.setattr(validation.copy, "deepcopy", no_copy)
    with Allocations() as seen:
        out, blamed = finite_streamed(fedavg(1.0), state, agg, {0: 1.0, 1: 5.0}, round=4)
    assert out is None and list(blamed) == [1] and blamed[1].startswith("NON_FINITE_AGGREGATE: round 4:")
    assert "tensor 'w'" in blamed[1]
    assert seen.largest <= CHUNK
    for k, v in state.params.items():
        assert torch.equal(v, before[k]), k
    ok = Payload(tensors={"w": torch.zeros(N), "b": torch.full((5,), 2.0)}, scalars={WEIGHT_KEY: 2.0, COUNT_KEY: 2})
    out, blamed = finite_streamed(fedavg(1.0), state, ok, {0: 1.0}, round=5)
    assert out is ok and not blamed and torch.equal(state.params["b"], torch.full((5,), 2.0))
    assert validation._checked_step(FedAvgM.__new__(FedAvgM)) is None   # its own server_update: rolled back
    monkeypatch.setattr(validation.copy, "deepcopy", copy.deepcopy)


def test_large_tensor_finiteness_is_checked_piece_by_piece():
    t = torch.zeros(N)
    assert tensor_finite(t)
    t[-1] = float("nan")
    assert not tensor_finite(t)
    t[-1] = 0.0
    t[CHUNK] = float("inf")
    assert not tensor_finite(t)


def test_spilled_replies_are_read_back_into_free_receive_buffers():
    """Replies ahead of their turn, spilled (budget 0), are read back into the process's receive
    buffers (common/wire/codec.py RecvBuffers) rather than fresh memory, bit for bit."""
    payloads = replies(5)
    fold = OrderedFold([0, 1, 2, 3], {}, budget_bytes=0)
    reused = RECV_BUFFERS.reused
    for key in (3, 2, 1):
        fold.offer(key, payloads[key])
    assert fold.spilled == 3
    fold.offer(0, payloads[0])
    fold.close()
    assert fold.folded == [0, 1, 2, 3]
    assert RECV_BUFFERS.reused > reused   # the second read-back took the first one's buffer
    expect = whole_tensor_reduction(payloads, {})
    for name, t in expect.items():
        assert torch.equal(fold.result().tensors[name], t), name


def _engine(algorithm: str = "fedavg"):
    from fedhop.common.config import parse_config
    from fedhop.common.engine.rounds import RoundEngine
    from tests.helpers import quadratic_config

    centers = torch.arange(12, dtype=torch.float64).reshape(4, 3).numpy()
    text = quadratic_config(centers, centers * 0 + 1, [3, 1, 2, 5], rounds=2, processes=1, algorithm=algorithm)
    return RoundEngine(parse_config(text))


def test_the_servers_evaluation_model_holds_the_states_tensors_not_a_copy():
    """common/engine/rounds.py: the server's model is bound to its state (common/algorithms/local.py
    `bind_params`), so the process holds one model's parameters, not two; an in-place server step
    is what the model evaluates, and evaluating other parameters never writes into the state."""
    from fedhop.common.algorithms.local import bind_params

    engine = _engine()
    module = dict(engine.model.named_parameters())
    assert module.keys() == engine.state.params.keys()
    for name, t in engine.state.params.items():
        assert module[name].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    engine.state.params["w"].add_(1.5)                       # an in-place step, as FedAvg's
    assert torch.equal(dict(engine.model.named_parameters())["w"].detach(), engine.state.params["w"])
    before = {k: v.clone() for k, v in engine.state.params.items()}
    other = {k: torch.full_like(v, 7.0, dtype=torch.float64) for k, v in engine.state.params.items()}
    engine._evaluate(other)                                  # an algorithm's other output, another dtype
    bound = dict(engine.model.named_parameters())
    assert bound["w"].dtype == before["w"].dtype and torch.equal(bound["w"].detach(), torch.full_like(before["w"], 7.0))
    assert all(torch.equal(engine.state.params[k], before[k]) for k in before)   # the state untouched
    bind_params(engine.model, engine.state.params)
    assert dict(engine.model.named_parameters())["w"].untyped_storage().data_ptr() == \
        engine.state.params["w"].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="parameter 'w': got shape"):
        bind_params(engine.model, {"w": torch.zeros(5)})


def test_share_params_keeps_the_tensor_allocated_first_and_binds_a_resumed_state():
    """A fresh state (init_state's clone, equal bit for bit) takes the model's own tensors and drops
    its clone, so the memory freed is the last allocated (reused by the round's accumulator); a
    state that differs (a checkpoint's) keeps its tensors and the model is bound to them."""
    from fedhop.common.algorithms.local import get_params, share_params
    from fedhop.common.models import build_model

    model = build_model("mlp", (6,), 3, hidden=(5,), seed=4)
    first = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    fresh = {k: v.clone() for k, v in get_params(model).items()}
    share_params(model, fresh)
    assert {n: t.untyped_storage().data_ptr() for n, t in fresh.items()} == first
    resumed = {k: v + 1 for k, v in get_params(model).items()}
    share_params(model, resumed)
    assert {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()} == {
        n: t.untyped_storage().data_ptr() for n, t in resumed.items()}
    assert all(torch.equal(p.detach(), resumed[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "fedprox"])
def test_a_clients_local_solver_leaves_no_gradients_behind(algorithm):
    """local_sgd clears the parameters' gradients at its end: a client process does not keep a
    model's worth of them while it makes its update and between rounds.  The update is the
    numpy closed form of the quadratic task's local steps either way (tests/helpers.py)."""
    from fedhop.common.config import parse_config
    from fedhop.common.engine.rounds import RoundEngine, local_update
    from tests.helpers import numpy_fedavg_round, quadratic_config

    centers, curvatures, sizes = [[1.0, -2.0], [3.0, 0.5]], [[1.0, 2.0], [0.5, 1.5]], [10, 30]
    cfg = parse_config(quadratic_config(centers, curvatures, sizes, local_steps=4, algorithm=algorithm,
                                        extra_algorithm="mu = 0.0" if algorithm == "fedprox" else ""))
    engine = RoundEngine(cfg)
    model = engine.task.build_model()
    message = engine.algorithm.broadcast(engine.state, 1)
    reply = local_update(cfg, engine.task, engine.algorithm, model, 1, 1,
                         Payload(tensors={n: t.clone() for n, t in message.tensors.items()}, scalars=message.scalars), {}, 0)
    assert all(p.grad is None for p in model.parameters())
    if algorithm == "fedavg":   # client 1 alone, server_lr 1: the round's model is its local model
        expect = numpy_fedavg_round(np.zeros(2), np.asarray(centers), np.asarray(curvatures), sizes, [1], 4, 0.1, 1.0)
        (delta,) = reply.tensors.values()
        assert np.allclose(delta.double().numpy().reshape(-1), expect, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc")
def test_round_memory_reads_the_fields_proc_status_holds():
    """RoundMemory._status (read after every round) against a plain parse of the same file, in
    bytes: the peak (VmHWM) never falls, so a parse between two reads lies between them, and
    is at least the resident size read before; a field the file lacks is None."""
    from fedhop.common.processors.streaming import RoundMemory

    def parsed(field: str) -> int:
        lines = Path("/proc/self/status").read_text().splitlines()
        return int(next(ln for ln in lines if ln.startswith(field + ":")).split()[1]) * 1024

    rss = RoundMemory._status(b"VmRSS")
    before = RoundMemory._status(b"VmHWM")
    middle = parsed("VmHWM")
    after = RoundMemory._status(b"VmHWM")
    assert rss is not None and before is not None and after is not None
    assert rss <= before <= middle <= after
    assert abs(RoundMemory._status(b"VmRSS") - parsed("VmRSS")) < 64 << 20   # the same field, read twice
    assert RoundMemory._status(b"VmNoSuchField") is None
    assert RoundMemory._status(b"Vm") is None   # a prefix of other fields is not a field


@pytest.mark.parametrize("setting, kept", [((), False), (("algorithm.name=scaffold",), True),
                                           (("compression.up=topk", "compression.error_feedback=ef"), True)])
def test_a_client_process_keeps_state_only_for_clients_that_have_some(setting, kept):
    """ClientHost.states holds an entry for a client only when its algorithm (SCAFFOLD's control
    variate) or its upload (error feedback's residual) left it something: plain FedAvg clients
    cost the process nothing between their rounds, however many of them have trained."""
    from fedhop.client.host import ClientHost
    from fedhop.common.config import parse_config
    from fedhop.common.transport.base import Request
    from fedhop.common.wire.codec import make_envelope
    from fedhop.common.wire.ledger import Ledger
    from tests.helpers import quadratic_config

    rng = np.random.default_rng(3)
    cfg = parse_config(quadratic_config(rng.normal(size=(4, 3)), rng.uniform(0.5, 2, size=(4, 3)), [3, 5, 7, 9],
                                        local_steps=2), list(setting))
    host = ClientHost(cfg, "client-proc0", [0, 1, 2], "r", Ledger(hold=False))
    params = {n: p.detach().clone() for n, p in host.model.named_parameters()}
    message = host.algorithm.broadcast(host.algorithm.init_state(params), 1)
    for rnd in (1, 2):
        for cid in (0, 2):
            payload = Payload(tensors={k: v.clone() for k, v in message.tensors.items()}, scalars=dict(message.scalars))
            env = make_envelope(run_id="r", round=rnd, src="server", dst=f"client-{cid}", method="train")
            host.handle(Request(env, payload))
    assert sorted(host.states) == ([0, 2] if kept else [])
    assert all(state for state in host.states.values())
