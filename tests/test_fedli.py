"""FedLi-LS and FedLi-LU (common/algorithms/fedli.py) against the paper's closed forms, hand
computations and the ledger's byte formulas (digest shared/research/seed-000.md sections 2, 6)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import ClientContext, Payload, ServerState, reduce_payloads
from fedhop.common.algorithms.fedli import (
    LOSS_KEY,
    STEP_KEY,
    FedLiLS,
    FedLiLSParams,
    FedLiLU,
    FedLiLUParams,
    armijo_sgd,
    dfw_gamma,
)
from fedhop.common.algorithms.local import get_params, set_params
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.tasks import build_task
from fedhop.common.tasks.base import ClientData, Task
from fedhop.common.tasks.quadratic import VectorModel
from fedhop.common.util.rng import torch_stream
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config


def _algo_cfg(extra: str = ""):
    return parse_config(f'[algorithm]\nname = "fedli_ls"\nlocal_steps = 1\nbatch_size = 0\n'
                        f'weighting = "uniform"\n{extra}').algorithm


# ----------------------------------------------------------------------------- Remark 2 (digest 6)
class CubicTask(Task):
    """1-D clients f_i(x) = a3_i x^3 + a2_i x^2 (float64); the model is the vector w = [x]."""

    kind = "quadratic"

    def __init__(self, coeffs: list[tuple[float, float]]) -> None:
        self.coeffs = torch.tensor(coeffs, dtype=torch.float64)

    @property
    def num_clients(self) -> int:
        return len(self.coeffs)

    def build_model(self) -> torch.nn.Module:
        return VectorModel(torch.ones(1, dtype=torch.float64))

    def client_data(self, client_id: int) -> ClientData:
        return ClientData(tensors=(self.coeffs[client_id][None],), num_samples=1)

    def loss(self, model, batch, generator=None) -> torch.Tensor:
        a3, a2 = batch[0][:, 0], batch[0][:, 1]
        x = model.w[0]
        return (a3 * x ** 3 + a2 * x ** 2).mean()

    def evaluate(self, model) -> dict[str, float]:
        x = float(model.w[0])
        return {"objective": float(np.mean([a3 * x ** 3 + a2 * x ** 2 for a3, a2 in self.coeffs.tolist()]))}


def _ctx(task: Task, cid: int, model: torch.nn.Module, local_steps: int = 1, round: int = 1) -> ClientContext:
    return ClientContext(client_id=cid, task=task, model=model, num_samples=task.client_data(cid).num_samples,
                         generator=torch_stream(0, "client", cid, "round", round), round=round,
                         local_steps=local_steps, local_epochs=1)


def test_remark2_local_descent_global_ascent():
    """f_1 = 3x^3 - x^2, f_2 = x^2 - x^3, f = (f_1 + f_2)/2 = x^3, x_0 = 1.  One capped Armijo
    step per client (client 1: eta = 0.2/7, gradient 7 -> x = 0.8; client 2: eta = 0.5,
    gradient -1 -> x = 1.5), both pass Armijo (local descent), and the unit server step (the
    mean) lands at 1.15 with f = 1.520875 > f(1) = 1 (the paper's Remark 2)."""
    task = CubicTask([(3.0, -1.0), (-1.0, 1.0)])
    w0 = {"w": torch.ones(1, dtype=torch.float64)}
    replies, trials = [], []
    for cid, cap in ((0, 0.2 / 7), (1, 0.5)):
        algo = FedLiLS(_algo_cfg(), FedLiLSParams(eta_max=cap, cap=True))
        algo.observer = trials.append
        model = task.build_model()
        replies.append((cid, algo.client_update(_ctx(task, cid, model), Payload(tensors=dict(w0)))))
        with torch.no_grad():
            f_before = float(task.loss(task.build_model(), task.client_data(cid).tensors))
            f_after = float(task.loss(model, task.client_data(cid).tensors))
        assert f_after < f_before                                   # local descent at each client
    x1, x2 = (float(r.tensors["w"]) + 1.0 for _, r in replies)
    assert x1 == pytest.approx(0.8, abs=1e-12) and x2 == pytest.approx(1.5, abs=1e-12)
    assert 3 * x1 ** 3 - x1 ** 2 == pytest.approx(0.896, abs=1e-12)        # f_1: 2 -> 0.896
    assert x2 ** 2 - x2 ** 3 == pytest.approx(-1.125, abs=1e-12)           # f_2: 0 -> -1.125
    assert all(t.accepted and t.backtracks == 0 for t in trials)
    algo = FedLiLS(_algo_cfg(), FedLiLSParams())
    state = ServerState(params={k: v.clone() for k, v in w0.items()})
    agg = algo.aggregate(replies)
    algo.server_update(state, agg, 1)
    x = float(state.params["w"])
    assert x == pytest.approx(1.15, abs=1e-12)
    assert x ** 3 == pytest.approx(1.520875, abs=1e-11) and x ** 3 > 1.0    # global ascent
    assert state.scalars["fedli_server_step"] == 1.0
    assert state.scalars["fedli_client_step_max"] == pytest.approx(0.5)     # max of the sent steps


# ----------------------------------------------------------------------------- Armijo instrumentation
DIGITS = """
[run]
seed = 3
rounds = 3
[algorithm]
name = "fedli_ls"
local_epochs = 2
batch_size = 8
weight_decay = 0.001
eta_max = {eta_max}
cap = {cap}
[data]
dataset = "digits"
partition = "dirichlet"
alpha = 0.5
[model]
kind = "logreg"
[clients]
count = 10
per_round = 10
"""


def _recompute(task: Task, model: torch.nn.Module, trial, wd: float, data: ClientData) -> tuple[float, float, float]:
    """Independent f(w), ||g||^2 and f(w - eta g) on the trial's minibatch (autograd, fresh model)."""
    batch = tuple(t[trial.batch] for t in data.tensors)
    set_params(model, trial.start)
    model.zero_grad(set_to_none=True)
    loss = task.loss(model, batch) + 0.5 * wd * sum((p * p).sum() for p in model.parameters())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    g_sq = float(sum((g.double() ** 2).sum() for g in grads.values()))
    set_params(model, {n: trial.start[n] - trial.eta * grads[n] for n in grads})
    with torch.no_grad():
        after = float(task.loss(model, batch) + 0.5 * wd * sum((p * p).sum() for p in model.parameters()))
    return float(loss.detach()), g_sq, after


@pytest.mark.parametrize("cap,eta_max", [(True, 0.05), (False, 0.05), (True, 20.0), (False, 20.0)])
def test_every_accepted_armijo_step_satisfies_the_condition(cap, eta_max):
    """Every accepted step, recomputed independently on its own minibatch, satisfies
    f(w - eta g) <= f(w) - c eta ||g||^2; with eta_max = 20 the first trials fail and the search
    backtracks.  With the cap on no step exceeds eta_max; with it off and eta_max = 0.05 the reset
    growth does exceed it (so the cap assertion can fail)."""
    cfg = parse_config(DIGITS.format(eta_max=eta_max, cap=str(cap).lower()))
    task = build_task(cfg)
    algo = build_algorithm(cfg)
    trials = []
    algo.observer = trials.append
    checker = task.build_model()
    model = task.build_model()
    w = {k: v.clone() for k, v in get_params(model).items()}
    for cid in range(4):
        set_params(model, w)
        reply = algo.client_update(_ctx(task, cid, model, local_steps=0), Payload(tensors=dict(w)))
        data = task.client_data(cid)
        mine = [t for t in trials if not hasattr(t, "cid")]
        for t in mine:
            t.cid = cid
            f0, g_sq, f1 = _recompute(task, checker, t, cfg.algorithm.weight_decay, data)
            assert f0 == pytest.approx(t.loss_before, rel=1e-5) and g_sq == pytest.approx(t.grad_sq, rel=1e-4)
            if t.accepted:
                assert f1 <= f0 - algo.params.c * t.eta * g_sq + 1e-6 * max(1.0, abs(f0))
            if cap:
                assert t.eta <= eta_max
        assert float(reply.tensors[STEP_KEY]) == pytest.approx(mine[-1].eta)   # the last step is sent
    assert sum(t.accepted for t in trials) >= 0.9 * len(trials) and len(trials) > 20
    if eta_max > 1:
        assert sum(t.backtracks for t in trials) > len(trials)     # the condition did reject trials
    elif cap:
        assert max(t.eta for t in trials) == pytest.approx(eta_max)
    else:
        assert max(t.eta for t in trials) > eta_max


def test_armijo_step_lower_bound_on_quadratic():
    """Lemma 2 with the backtracking factor (digest 6): on L-smooth full-batch quadratics every
    accepted step is >= min(beta * 2(1 - c)/L, eta_max), and some step backtracks."""
    centers = [[1.0, -2.0, 0.5], [0.0, 1.0, -1.0]]
    curv = [[4.0, 1.0, 0.5], [10.0, 2.0, 1.0]]
    cfg = parse_config(quadratic_config(centers, curv, [1, 1], algorithm="fedli_ls", local_steps=6))
    task = build_task(cfg)
    p = FedLiLSParams()
    for cid in range(2):
        trials = []
        model = task.build_model()
        armijo_sgd(_ctx(task, cid, model, local_steps=6), p, 0, 0.0, trials.append)
        big_l = max(curv[cid])
        bound = min(p.beta * 2 * (1 - p.c) / big_l, p.eta_max)
        assert all(t.eta >= bound * (1 - 1e-6) for t in trials if t.accepted)
        assert any(t.backtracks > 0 for t in trials)


# ----------------------------------------------------------------------------- FedLi-LU server step
def _lu(eta=0.5, lam=0.1, mu=0.0, eps=0.0) -> FedLiLU:
    cfg = parse_config('[algorithm]\nname = "fedli_lu"\nweighting = "samples"').algorithm
    return FedLiLU(cfg, FedLiLUParams(eta=eta, server_weight_decay=lam, momentum=mu, eps=eps))


def _lu_replies(loss_a=2.0, loss_b=4.0):
    # fedhop deltas Delta_i = w_i - w_t; weights 1 and 3
    a = Payload(tensors={"w": torch.tensor([-1.0, 0.0]), LOSS_KEY: torch.tensor(loss_a)}, scalars={"weight": 1.0})
    b = Payload(tensors={"w": torch.tensor([-1.0, -4.0]), LOSS_KEY: torch.tensor(loss_b)}, scalars={"weight": 3.0})
    return [(0, a), (1, b)]


def test_fedli_lu_server_step_by_hand():
    """w_t = [1, 2], lambda = 0.1 -> r = [0.1, 0.2]; weighted mean delta = [-1, -3] so the
    paper's D = [1, 3], ||D||^2 = 10, <D, r> = 0.7; f^g = (1*2 + 3*4)/4 = 3.5; eta = 0.5, eps = 0:
    gamma = (3.5 - 0.35) / 5 = 0.63; w_{t+1} = w - 0.5 (r + 0.63 D) = [0.635, 0.955]."""
    algo = _lu()
    state = ServerState(params={"w": torch.tensor([1.0, 2.0])})
    agg = algo.aggregate(_lu_replies())
    algo.server_update(state, agg, 1)
    assert state.scalars["fedli_gamma"] == pytest.approx(0.63, abs=1e-7)
    assert state.scalars["fedli_f_global"] == pytest.approx(3.5)
    torch.testing.assert_close(state.params["w"], torch.tensor([0.635, 0.955]))
    assert 0.0 < state.scalars["fedli_gamma"] < 1.0


def test_fedli_lu_momentum_two_rounds():
    """mu = 0.5, lambda = 0.1, eta = 0.5, eps = 0, the same replies twice (f = 3.5, D = [1, 3]).
    Round 1 by hand: gamma = 0.63, w' = [0.635, 0.955], z = -0.315 (D + r) = [-0.3465, -1.008],
    w_1 = w' + 0.5 z = [0.46175, 0.451].  Round 2 against a numpy transcription of the DFW code."""
    algo = _lu(lam=0.1, mu=0.5)
    state = ServerState(params={"w": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    replies = [(c, Payload(tensors={k: v.double() for k, v in p.tensors.items()}, scalars=p.scalars))
               for c, p in _lu_replies()]
    algo.server_update(state, algo.aggregate(replies), 1)
    torch.testing.assert_close(state.params["w"], torch.tensor([0.46175, 0.451], dtype=torch.float64))
    torch.testing.assert_close(state.extra["fedli_lu_z.w"], torch.tensor([-0.3465, -1.008], dtype=torch.float64))
    algo.server_update(state, algo.aggregate(replies), 2)
    w, z, d = np.array([0.46175, 0.451]), np.array([-0.3465, -1.008]), np.array([1.0, 3.0])
    r = 0.1 * w
    gamma = min(max((3.5 - 0.5 * d @ r) / (0.5 * d @ d), 0.0), 1.0)
    w = w - 0.5 * (r + gamma * d)
    z = 0.5 * z - 0.5 * gamma * (d + r)
    w = w + 0.5 * z
    assert state.scalars["fedli_gamma"] == pytest.approx(gamma, rel=1e-12)
    np.testing.assert_allclose(state.params["w"].numpy(), w, rtol=1e-12)
    np.testing.assert_allclose(state.extra["fedli_lu_z.w"].numpy(), z, rtol=1e-12)


@pytest.mark.parametrize("f,ds,dr,eta,want", [
    (3.5, 10.0, 0.7, 0.5, 0.63),        # interior
    (100.0, 10.0, 0.7, 0.5, 1.0),        # clipped at 1
    (0.0, 10.0, 0.7, 0.5, 0.0),          # f = 0 with <D, r> > 0: clipped at 0
    (0.2, 0.0, 0.0, 1.0, 1.0),           # D = 0: eps keeps it finite, then the clip
])
def test_dfw_gamma_clip(f, ds, dr, eta, want):
    eps = 1e-5 if ds == 0 else 0.0
    g = dfw_gamma(f, ds, dr, eta, eps)
    assert 0.0 <= g <= 1.0 and g == pytest.approx(want, abs=1e-9)


def test_fedli_lu_without_decay_is_a_capped_polyak_step():
    """lambda = 0: eta * gamma = min(eta, f / ||D||^2) (digest 2.5), for f below and above eta ||D||^2."""
    for loss, eta in ((0.5, 1.0), (0.5, 0.01)):
        algo = _lu(eta=eta, lam=0.0)
        state = ServerState(params={"w": torch.tensor([1.0, 2.0])})
        algo.server_update(state, algo.aggregate(_lu_replies(loss, loss)), 1)
        step = eta * state.scalars["fedli_gamma"]
        assert step == pytest.approx(min(eta, loss / 10.0), rel=1e-6)


def test_edge_partials_reduce_to_the_flat_aggregate():
    """Hierarchical rule: an edge reduces its clients with reduce_payloads (step max, loss wsum),
    the server reduces the partials; equals reducing all clients at once."""
    rng = np.random.default_rng(0)
    replies = [Payload(tensors={"w": torch.tensor(rng.normal(size=3), dtype=torch.float32),
                                STEP_KEY: torch.tensor(float(rng.uniform()), dtype=torch.float32),
                                LOSS_KEY: torch.tensor(float(rng.uniform()), dtype=torch.float32)},
                       scalars={"weight": float(rng.integers(1, 9))}) for _ in range(5)]
    for algo in (FedLiLS(_algo_cfg(), FedLiLSParams()), _lu()):
        flat = reduce_payloads(replies, algo.reply_reduce)
        if isinstance(algo, FedLiLS):
            assert float(flat.tensors[STEP_KEY]) == pytest.approx(max(float(r.tensors[STEP_KEY]) for r in replies))
        else:
            want = sum(float(r.scalars["weight"]) * float(r.tensors[LOSS_KEY]) for r in replies)
            assert float(flat.tensors[LOSS_KEY]) == pytest.approx(want, rel=1e-6)
        edges = [reduce_payloads(replies[:2], algo.reply_reduce), reduce_payloads(replies[2:], algo.reply_reduce)]
        tree = reduce_payloads(edges, algo.reply_reduce)
        for name in flat.tensors:
            torch.testing.assert_close(flat.tensors[name], tree.tensors[name])
        assert flat.scalars["weight"] == tree.scalars["weight"]


CENTERS = [[1.0, 2.0], [-1.0, 0.5], [0.0, -2.0], [2.0, 1.0]]
CURV = [[1.0, 2.0], [0.5, 1.0], [2.0, 1.0], [1.0, 0.5]]


def _quad_run(tmp_path: Path, algo: str, extra: str = "", topology: str = "", rounds: int = 3, lr: float = 0.1):
    text = quadratic_config(CENTERS, CURV, [1, 2, 3, 4], rounds=rounds, algorithm=algo, local_steps=3, lr=lr,
                            extra_algorithm=extra, topology=topology).replace('kind = "grpc"', 'kind = "inmemory"')
    summary, coord = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "completed", summary.get("error")
    return summary, coord


@pytest.mark.parametrize("algo,extra", [("fedli_ls", 'server_step = "max"'), ("fedli_lu", "eta = 0.7")])
def test_hierarchical_equals_star(tmp_path, algo, extra):
    _, star = _quad_run(tmp_path / "star", algo, extra)
    _, hier = _quad_run(tmp_path / "hier", algo, extra, topology='kind = "hierarchical"\nedges = 2')
    torch.testing.assert_close(star.state.params["w"], hier.state.params["w"], rtol=1e-5, atol=1e-6)
    key = "fedli_server_step" if algo == "fedli_ls" else "fedli_gamma"
    assert star.state.scalars[key] == pytest.approx(hier.state.scalars[key], rel=1e-6)
    assert not torch.allclose(star.state.params["w"], torch.zeros(2))


# ----------------------------------------------------------------------------- ledger
def _varint_len(v: int) -> int:
    return max(1, (v.bit_length() + 6) // 7)


def _spec_entry_bytes(name: str) -> int:
    """Envelope.tensors entry of a 0-dim float64 tensor: TensorSpec{name (2 + len), dtype
    "float64" (2 + 7), shape [] (0), nbytes 8 (2)} = len + 13, plus field tag and length = len + 15."""
    return len(name) + 15


def _int_scalar_entry_bytes(name: str, value: int) -> int:
    """Envelope.scalars map entry {key (2 + len), value Scalar{i} (2 + 1 + varint)} plus tag and length."""
    inner = 2 + len(name) + 2 + 1 + _varint_len(value)
    return 1 + _varint_len(inner) + inner


def _replies(run_dir: Path) -> dict[tuple[int, str], dict]:
    rows = RunStore(run_dir / "run.db").messages()
    return {(m["round"], m["src"]): m for m in rows
            if m["role"] == "sender" and m["method"] == "train.reply" and m["link"] == "client-server"}


def test_ledger_one_more_scalar_per_reply(tmp_path):
    """Against FedAvg on the same config (same sampling, same local steps): each client reply
    of FedLi carries exactly 8 more tensor_bytes (one 0-dim float64: the loss for LU, the step
    size for LS), which is the paper's "one extra word".  The encoded message grows by more:
    payload_bytes = FedAvg + 8 data bytes + the tensor's spec in the envelope (len(name) + 15
    bytes: 19 for "loss", 24 for "step_size"), and for LS also the bookkeeping int scalar
    `ls_forwards` (a map entry of len + 8 bytes for values < 128; not a paper quantity, so
    it is a payload scalar, not a tensor).  framed_bytes grows by the same amount (same number
    of frames; every length varint here stays one or two bytes wide in both runs).  A float
    payload scalar would instead cost len(name) + 15 bytes and 0 tensor_bytes.  The runs share
    run.name, so the run id every envelope carries has the same length."""
    _, avg = _quad_run(tmp_path / "avg", "fedavg")
    _, lu = _quad_run(tmp_path / "lu", "fedli_lu")
    _, ls = _quad_run(tmp_path / "ls", "fedli_ls")
    base, r_lu, r_ls = _replies(tmp_path / "avg"), _replies(tmp_path / "lu"), _replies(tmp_path / "ls")
    assert set(base) == set(r_lu) == set(r_ls) and len(base) == 3 * 4
    forwards = {}
    for key, m in base.items():
        for other, extra in ((r_lu[key], _spec_entry_bytes(LOSS_KEY) + 8), (r_ls[key], _spec_entry_bytes(STEP_KEY) + 8)):
            assert other["tensor_bytes"] - m["tensor_bytes"] == 8
            diff = other["payload_bytes"] - m["payload_bytes"]
            if other is r_ls[key]:
                # recover the ls_forwards value's varint width: the only free term of the formula
                forwards[key] = diff - extra
                assert diff - extra in {_int_scalar_entry_bytes("ls_forwards", v) for v in (1, 200, 20000)}
            else:
                assert diff == extra
            assert other["framed_bytes"] - m["framed_bytes"] == diff
    assert all(v == _int_scalar_entry_bytes("ls_forwards", 10) for v in forwards.values())   # 3 steps, < 128 evals
    # the protobuf library agrees with the hand formulas
    env = pb.Envelope()
    env.tensors.add(name=STEP_KEY, dtype="float64", shape=[], nbytes=8)
    assert env.ByteSize() == _spec_entry_bytes(STEP_KEY)
    env = pb.Envelope()
    env.scalars["ls_forwards"].i = 10
    assert env.ByteSize() == _int_scalar_entry_bytes("ls_forwards", 10)
    env = pb.Envelope()
    env.scalars["loss"].f = 0.25
    assert env.ByteSize() == len("loss") + 15
    assert ls.state.scalars["fedli_server_step"] == 1.0 and 0.0 <= lu.state.scalars["fedli_gamma"] <= 1.0


# ----------------------------------------------------------------------------- config
def test_params_defaults_and_bad_values():
    cfg = parse_config('[algorithm]\nname = "fedli_ls"')
    p = cfg.algorithm.params
    assert (p.c, p.beta, p.eta_max, p.reset, p.delta, p.cap, p.server_step) == (0.1, 0.9, 1.0, "grow", 2.0, False, "unit")
    lu = build_algorithm(parse_config('[algorithm]\nname = "fedli_lu"\npreset = "code"'))
    assert lu.resolved() == (0.01, 1e-5, 0.9)
    lu = build_algorithm(parse_config('[algorithm]\nname = "fedli_lu"\nserver_lr = 0.3\nmomentum = 0.2'))
    assert lu.resolved() == (0.3, 1e-3, 0.2)
    with pytest.raises(ConfigError, match="algorithm.server_step"):
        parse_config('[algorithm]\nname = "fedli_ls"\nserver_step = "mean"')
    with pytest.raises((ConfigError, ValueError), match="algorithm.beta"):
        parse_config('[algorithm]\nname = "fedli_ls"\nbeta = 1.5')
    with pytest.raises(ConfigError, match="algorithm.loss_report"):
        parse_config('[algorithm]\nname = "fedli_lu"\nloss_report = "best"')


# ----------------------------------------------------------------------------- reductions to FedAvg
def test_fedli_lu_clipped_without_decay_is_fedavg(tmp_path):
    """Digest 6: with gamma clipped at 1 every round and lambda = 0, eta = 1, FedLi-LU is FedAvg
    bit for bit (r = 0, w - 1 * (0 + 1 * D) = w + mean Delta)."""
    _, avg = _quad_run(tmp_path / "avg", "fedavg", rounds=4)
    _, lu = _quad_run(tmp_path / "lu", "fedli_lu", "server_weight_decay = 0.0\neta = 1.0", rounds=4)
    assert lu.state.scalars["fedli_gamma_clipped_rounds"] == 4
    assert torch.equal(avg.state.params["w"], lu.state.params["w"])
    _, lu_wd = _quad_run(tmp_path / "lu_wd", "fedli_lu", rounds=4)          # lambda = 1e-3: differs
    assert not torch.equal(avg.state.params["w"], lu_wd.state.params["w"])


def test_fedli_ls_case2_equals_fedavg(tmp_path):
    """Digest 6, Theorem 2 (b): with the cap on and eta_max <= 2(1 - c)/L_max, Armijo never
    backtracks on these deterministic quadratics (L_max = 2), so FedLi-LS is FedAvg with lr = eta_max."""
    eta = 0.8   # 2 (1 - 0.1) / 2 = 0.9
    _, avg = _quad_run(tmp_path / "avg", "fedavg", rounds=4, lr=eta)
    _, ls = _quad_run(tmp_path / "ls", "fedli_ls", f"eta_max = {eta}\ncap = true", rounds=4)
    _, ls_big = _quad_run(tmp_path / "ls_big", "fedli_ls", "eta_max = 1.5\ncap = true", rounds=4)
    torch.testing.assert_close(avg.state.params["w"], ls.state.params["w"], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(avg.state.params["w"], ls_big.state.params["w"], atol=1e-3)


def test_kappa2_edges_carry_the_extras(tmp_path):
    """HierFAVG with kappa2 = 2 edge iterations: the edge's partial keeps the last iteration's
    reduced loss (and step size), so the server's reply check passes, and FedLi-LU with gamma = 1,
    lambda = 0, eta = 1 equals FedAvg on the same hierarchy."""
    topo = 'kind = "hierarchical"\nedges = 2\nkappa2 = 2'
    _, avg = _quad_run(tmp_path / "avg", "fedavg", topology=topo)
    _, lu = _quad_run(tmp_path / "lu", "fedli_lu", "server_weight_decay = 0.0\neta = 1.0", topology=topo)
    _, ls = _quad_run(tmp_path / "ls", "fedli_ls", 'server_step = "max"\neta_max = 0.5\ncap = true', topology=topo)
    assert lu.state.scalars["fedli_gamma_clipped_rounds"] == 3
    torch.testing.assert_close(avg.state.params["w"], lu.state.params["w"], rtol=1e-6, atol=1e-7)
    assert ls.state.scalars["fedli_server_step"] == pytest.approx(0.5)
