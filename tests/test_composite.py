"""Composite federated optimisation: FedMiD, FedDA, Fast-FedDA, C-FedDA, MC-FedDA (seed-001 digest).

References are independent of the algorithm code: numpy stochastic dual averaging, FISTA and
proximal gradient written here from the formulas; byte counts from the ledger.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.composite_compare import METHODS, first_round, method_config, run_direct
from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.composite import WeightSchedule, regularized_kinds
from fedhop.common.config import parse_config
from fedhop.common.numerics.sampling import local_batches
from fedhop.common.records.runstore import RunStore
from fedhop.common.tasks import build_task
from fedhop.common.util.rng import torch_stream
from fedhop.deploy.launch.inmemory import run_inmemory


# ---------------------------------------------------------------------------- configs
def toml(algorithm: str, keys: dict | None = None, *, rounds: int = 10, dataset: str = "lasso",
         data: dict | None = None, seed: int = 0, clients: int = 8, per_round: int = 4, local_steps: int = 10,
         batch_size: int = 10, reg: float = 0.05, regularizer: str | None = None, wire: str = "float64",
         topology: str = 'kind = "star"', eval_every: int = 0) -> str:
    """A small lasso / lowrank run (float64 data and wire unless asked)."""
    keys = dict(keys or {})
    keys.setdefault("wire_dtype", wire)
    regularizer = regularizer or ("l1" if dataset == "lasso" else "nuclear")
    defaults = ({"dim": 40, "sparsity": 8, "samples": 100, "shift": 0.5} if dataset == "lasso"
                else {"rows": 8, "cols": 8, "rank": 3, "samples": 100, "shift": 0.5})
    defaults.update(data or {})
    defaults.setdefault("dtype", "float64")
    fmt = lambda v: f'"{v}"' if isinstance(v, str) else ("true" if v is True else "false" if v is False  # noqa: E731
                                                           else repr(v))
    lines = lambda d: "\n".join(f"{k} = {fmt(v)}" for k, v in d.items())  # noqa: E731
    return f"""
[run]
name = "{algorithm}"
seed = {seed}
rounds = {rounds}
eval_every = {eval_every}

[topology]
{topology}

[algorithm]
name = "{algorithm}"
regularizer = "{regularizer}"
reg = {reg}
local_steps = {local_steps}
batch_size = {batch_size}
weighting = "uniform"
{lines(keys)}

[data]
dataset = "{dataset}"
{lines(defaults)}

[model]
kind = "linear"

[clients]
count = {clients}
per_round = {per_round}
processes = 2

[transport]
kind = "inmemory"
"""


#: per-method keys of the small problems (gamma equal in the code convention: same initial step)
SMALL_KEYS = {"fedmid": {"lr": 0.01}, "fedda": {"lr": 0.01}, "fast_fedda": {"mu": 0.5, "gamma": 20.0},
              "c_fedda": {"mu": 0.5, "gamma": 20.0},
              "mc_fedda": {"mu": 0.5, "gamma": 20.0, "stage_rounds": [60, 60, 130]}}


def soft(v: np.ndarray, th: float) -> np.ndarray:
    return np.sign(v) * np.maximum(np.abs(v) - th, 0.0)


def fista_lasso(x: np.ndarray, y: np.ndarray, lam: float, iters: int = 20_000) -> np.ndarray:
    """argmin 1/(2N) ||y - X w||^2 + lam ||w||_1 (Beck & Teboulle 2009)."""
    n = len(y)
    step = 1.0 / np.linalg.eigvalsh(x.T @ x / n).max()
    w = v = np.zeros(x.shape[1])
    tk = 1.0
    for _ in range(iters):
        wn = soft(v - step * x.T @ (x @ v - y) / n, step * lam)
        tn = (1 + math.sqrt(1 + 4 * tk * tk)) / 2
        v, w, tk = wn + (tk - 1) / tn * (wn - w), wn, tn
    return w


# ---------------------------------------------------------------------------- pieces
def test_weight_schedule_totals_match_cumulative_sums():
    for sched in (WeightSchedule("uniform"), WeightSchedule("poly2", 2.5), WeightSchedule("poly2", 4000.0)):
        alphas = np.array([sched.alpha(t) for t in range(200)])
        np.testing.assert_allclose([sched.total(t) for t in range(200)], np.cumsum(alphas), rtol=1e-13)
        assert sched.total(-1) == 0.0
    assert WeightSchedule("poly2", 3.0).alpha(4) == 49.0


def test_regularized_kinds_rules():
    shapes = {"linear.weight": (10, 64), "linear.bias": (10,)}
    assert regularized_kinds(shapes, "l1") == {"linear.weight": "l1", "linear.bias": "none"}
    assert regularized_kinds(shapes, "nuclear") == {"linear.weight": "nuclear", "linear.bias": "none"}
    with pytest.raises(ValueError, match="matrix"):
        regularized_kinds({"w": (5,)}, "nuclear")


def test_gamma_conventions_map_explicitly():
    e = 10
    code = build_algorithm(parse_config(toml("c_fedda", {"mu": 0.1, "gamma": 600.0}, local_steps=e)))
    paper = build_algorithm(parse_config(toml("c_fedda", {"mu": 0.1, "gamma": 60.0, "gamma_convention": "paper"},
                                              local_steps=e)))
    fast = build_algorithm(parse_config(toml("fast_fedda", {"mu": 0.1, "gamma": 550.0}, local_steps=e)))
    theory = build_algorithm(parse_config(toml("fast_fedda", {"mu": 0.1, "weights": "poly2", "a": 50.0,
                                                              "gamma_theory": True})))
    assert code.gamma == pytest.approx(60.0) and paper.gamma == pytest.approx(60.0)
    assert fast.gamma == 550.0                      # Fast-FedDA: both conventions coincide
    assert theory.gamma == pytest.approx(2 * 0.1 * 50.0 ** 3)


def test_gamma_code_and_paper_conventions_give_the_same_run():
    a = run_direct(parse_config(toml("c_fedda", {"mu": 0.5, "gamma": 200.0}, rounds=4)))[1]["w"]
    b = run_direct(parse_config(toml("c_fedda", {"mu": 0.5, "gamma": 20.0, "gamma_convention": "paper"},
                                     rounds=4)))[1]["w"]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="local_steps"):
        build_algorithm(parse_config(toml("fast_fedda", local_steps=0)))
    with pytest.raises(ValueError, match="stage_reg"):
        parse_config(toml("mc_fedda", {"stage_rounds": [5, 5], "stage_reg": [0.1]}))
    with pytest.raises(ValueError, match="stage_reg ends with"):
        build_algorithm(parse_config(toml("mc_fedda", {"stage_rounds": [5, 5], "stage_reg": [0.2, 0.1]}, reg=0.05)))
    with pytest.raises(ValueError, match="gamma_theory"):
        parse_config(toml("fast_fedda", {"gamma_theory": True, "a": 0.0}))


# ---------------------------------------------------------------------------- E = 1 equivalence
def numpy_sda(cfg, w0: np.ndarray, mu: float, gamma: float, sched_alpha, lam: float) -> np.ndarray:
    """Centralised minibatch stochastic dual averaging with the strongly convex prox of the paper
    (Chen, Lin & Pena 2012 / Section 2.1), in numpy, on the clients' own minibatches:
        G_t = mean_k grad f_k(w_t; B_k,t);  g_t = g_{t-1} + alpha_t G_t;  w~_t = w~_{t-1} + alpha_t w_t
        w_{t+1} = argmin <w, g_t - mu w~_t/2 - gamma w0> + (mu A_t/2 + gamma)||w||^2/2 + A_t lam ||w||_1."""
    task = build_task(cfg)
    g = np.zeros_like(w0)
    wt = np.zeros_like(w0)
    w = w0.copy()
    alphas = []
    for r in range(1, cfg.run.rounds + 1):
        t = r - 1
        alphas.append(sched_alpha(t))
        a_t, big_a = alphas[-1], float(np.sum(alphas))
        wt = wt + a_t * w
        grads = []
        for k in range(cfg.clients.count):      # full participation
            x, y = (tt.numpy() for tt in task.client_data(k).tensors)
            idx = next(iter(local_batches(len(y), cfg.algorithm.batch_size, 1, 1,
                                          torch_stream(cfg.run.seed, "client", k, "round", r)))).numpy()
            xb, yb = x[idx], y[idx]
            grads.append(xb.T @ (xb @ w - yb) / len(yb))
        g = g + a_t * np.mean(grads, axis=0)
        c = mu * big_a / 2 + gamma
        w = soft((gamma * w0 - (g - mu * wt / 2)) / c, big_a * lam / c)
    return w


@pytest.mark.parametrize("weights", [{"weights": "uniform", "gamma": 5.0},
                                     {"weights": "poly2", "a": 20.0, "gamma_theory": True}])
def test_fast_fedda_with_one_local_step_is_centralized_sda(tmp_path, weights):
    mu, lam = 0.5, 0.05
    text = toml("fast_fedda", {"mu": mu, **weights}, rounds=30, clients=4, per_round=4, local_steps=1,
                batch_size=8, reg=lam, data={"dim": 12, "sparsity": 3, "samples": 40})
    cfg = parse_config(text)
    summary, coord = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed"
    algo = build_algorithm(cfg)
    w0 = build_task(cfg).build_model().w.detach().double().numpy()
    ref = numpy_sda(cfg, w0, mu, algo.gamma, algo.schedule.alpha, lam)
    got = coord.state.params["w"].double().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-10)
    assert np.abs(got - w0).max() > 0.1                          # it moved
    assert (got == 0).sum() == (ref == 0).sum() > 0              # same exact zeros


# ---------------------------------------------------------------------------- framework faithfulness
@pytest.mark.parametrize("algorithm", ["fast_fedda", "mc_fedda", "fedmid"])
def test_direct_loop_equals_the_framework_run(tmp_path, algorithm):
    keys = dict(SMALL_KEYS[algorithm])
    if algorithm == "mc_fedda":
        keys["stage_rounds"] = [2, 2, 2]
    cfg = parse_config(toml(algorithm, keys, rounds=6, wire="float32", data={"dtype": "float32"}))
    _, coord = run_inmemory(cfg, tmp_path)
    _, direct = run_direct(cfg)
    torch.testing.assert_close(coord.state.params["w"], direct["w"], rtol=0, atol=0)


@pytest.mark.parametrize("algorithm", ["fast_fedda", "c_fedda", "fedda"])
def test_hierarchical_edges_preaggregate_to_the_star_result(tmp_path, algorithm):
    keys = SMALL_KEYS[algorithm]
    star = parse_config(toml(algorithm, keys, rounds=5, per_round=6))
    hier = parse_config(toml(algorithm, keys, rounds=5, per_round=6, topology='kind = "hierarchical"\nedges = 2'))
    _, c1 = run_inmemory(star, tmp_path / "star")
    s2, c2 = run_inmemory(hier, tmp_path / "hier")
    assert s2["status"] == "completed" and "edge-server" in s2["bytes"]["by_link"]
    torch.testing.assert_close(c1.state.params["w"], c2.state.params["w"], rtol=1e-12, atol=1e-12)


def uplink_downlink(run_dir) -> tuple[int, int]:
    """Tensor bytes client -> server and server -> client, each message once (ledger)."""
    with RunStore(run_dir / "run.db", create=False) as store:
        cs = store.bytes_by_link_direction()["client-server"]
    return cs["up"]["tensor_bytes"], cs["down"]["tensor_bytes"]


@pytest.mark.parametrize("wire,size", [("float32", 4), ("float64", 8)])
def test_ledger_counts_the_messages_of_digest_2_6(tmp_path, wire, size):
    p, rounds, per_round = 40, 3, 4
    expected = {"fedmid": (1, 1), "fedda": (1, 1), "fast_fedda": (2, 2), "c_fedda": (1, 2)}   # (up, down) vectors
    for algo, (up_vec, down_vec) in expected.items():
        run_dir = tmp_path / algo
        run_inmemory(parse_config(toml(algo, SMALL_KEYS[algo], rounds=rounds, per_round=per_round, wire=wire)), run_dir)
        up, down = uplink_downlink(run_dir)
        assert up == rounds * per_round * up_vec * p * size, algo
        assert down == rounds * per_round * down_vec * p * size, algo
    # MC-FedDA: w0 travels with every broadcast of stages >= 1 (rounds 3..4 here)
    run_dir = tmp_path / "mc"
    run_inmemory(parse_config(toml("mc_fedda", {"mu": 0.5, "gamma": 20.0, "stage_rounds": [2, 2]}, rounds=4,
                                   per_round=per_round, wire=wire)), run_dir)
    up, down = uplink_downlink(run_dir)
    assert up == 4 * per_round * p * size
    assert down == (2 * 2 + 2 * 3) * per_round * p * size


# ---------------------------------------------------------------------------- C-FedDA / MC-FedDA
def test_c_fedda_constraint_ball_holds_after_every_constrained_step():
    cfg = parse_config(toml("c_fedda", {"mu": 0.5, "gamma": 20.0, "radius": 3.0}, rounds=15))
    w0 = build_task(cfg).build_model().w.detach().double()
    free = run_direct(parse_config(toml("c_fedda", {"mu": 0.5, "gamma": 20.0}, rounds=15)))[1]["w"].double()
    assert float((free - w0).abs().sum()) > 3.0 * 1.5     # unconstrained it leaves the ball
    dists = []
    run_direct(cfg, on_state=lambda r, algo, state: dists.append(float((state.params["w"].double() - w0).abs().sum())))
    assert len(dists) == 15
    assert max(dists) <= 3.0 * (1 + 1e-12)
    assert max(dists) >= 3.0 * (1 - 1e-9)                  # the ball is active


def test_mc_fedda_single_stage_is_c_fedda():
    keys = {"mu": 0.5, "gamma": 20.0}
    c = run_direct(parse_config(toml("c_fedda", keys, rounds=8)))[1]["w"]
    mc = run_direct(parse_config(toml("mc_fedda", {**keys, "stage_rounds": [8]}, rounds=8)))[1]["w"]
    torch.testing.assert_close(c, mc, rtol=0, atol=0)


def test_mc_fedda_stages_reset_the_state_and_halve_lambda():
    cfg = parse_config(toml("mc_fedda", {"mu": 0.5, "gamma": 20.0, "stage_rounds": [3, 2, 4]}, rounds=8,
                            wire="float32", reg=0.05))
    algo = build_algorithm(cfg)
    assert algo.lams == pytest.approx([0.2, 0.1, 0.05])
    assert [algo.stage_of(r) for r in range(1, 9)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    seen = {}

    def look(r, algo, state):   # the restart runs when the next stage's first round is broadcast
        msg = algo.broadcast(state, r + 1) if r < 8 else None
        seen[r] = {k: v.clone() for k, v in state.extra.items()}
        seen[r]["msg"] = msg

    run_direct(cfg, on_state=look)
    for boundary in (3, 5):                                  # after the last round of stages 0 and 1
        ex = seen[boundary]
        assert float(ex["g/w"].abs().max()) == 0 and float(ex["wt/w"].abs().max()) == 0
        torch.testing.assert_close(ex["w0/w"], ex["w/w"], rtol=0, atol=0)
        assert float((ex["w0/w"] - seen[boundary - 1]["w0/w"]).abs().max()) > 0   # a new centre
        assert "w0/w" in ex["msg"].tensors and ex["msg"].scalars["r"] == 0
        torch.testing.assert_close(ex["msg"].tensors["w0/w"].double(), ex["w0/w"], rtol=0, atol=0)
    assert "w0/w" not in seen[1]["msg"].tensors                 # stage 0: w0 is the initial model
    assert float(seen[4]["g/w"].abs().max()) > 0                # a stage's own rounds accumulate again
    # the restart itself: w0 <- the last server iterate (rounded to the wire dtype), sums <- 0
    state = algo.init_state({"w": torch.zeros(40, dtype=torch.float64)})
    last = torch.linspace(-1, 1, 40, dtype=torch.float64) / 3
    state.extra["w/w"] = last.clone()
    state.extra["g/w"] = torch.ones(40, dtype=torch.float64)
    algo.restart(state)
    torch.testing.assert_close(state.extra["w0/w"], last.float().double(), rtol=0, atol=0)
    torch.testing.assert_close(state.params["w"], last.float().double(), rtol=0, atol=0)
    assert float(state.extra["g/w"].abs().max()) == 0


# ---------------------------------------------------------------------------- statistical behaviour
def test_small_lasso_every_method_reaches_the_centralized_solution_and_only_dual_averaging_is_sparse():
    rounds = 250
    lam = 0.05
    base = parse_config(toml("fedda", SMALL_KEYS["fedda"], reg=lam))
    task = build_task(base)
    x, y = task.design()
    w_hat = fista_lasso(x, y, lam)
    w_star = task.w_star.numpy()
    stat_err = np.linalg.norm(w_hat - w_star)
    off = w_star == 0
    fista_zeros = int((w_hat[off] == 0).sum())
    assert stat_err > 0.1 and fista_zeros >= 25
    tol = 0.05                                   # = about 1/3 of the statistical error ||w_hat - w*||
    finals = {}
    for algo in METHODS:
        _, params = run_direct(parse_config(toml(algo, SMALL_KEYS[algo], rounds=rounds, reg=lam)))
        finals[algo] = params["w"].double().numpy()
    for algo, w in finals.items():
        assert np.linalg.norm(w - w_hat) <= tol, (algo, np.linalg.norm(w - w_hat))
    for algo in ("fedda", "fast_fedda", "c_fedda", "mc_fedda"):
        assert (finals[algo][off] == 0).sum() >= fista_zeros - 2, algo        # many exact zeros
    assert (finals["fedmid"][off] == 0).sum() <= 8                             # primal averaging: few


def test_small_lowrank_fedmid_misses_the_rank_and_dual_averaging_recovers_it():
    lam, rounds = 0.2, 200
    base = parse_config(toml("fedda", SMALL_KEYS["fedda"], dataset="lowrank", reg=lam))
    task = build_task(base)
    x, y = task.design()
    n = len(y)
    step = 1.0 / np.linalg.eigvalsh(x.T @ x / n).max()
    w = np.zeros(x.shape[1])
    for _ in range(3000):                          # centralised proximal gradient (SVT)
        u, s, vt = np.linalg.svd((w - step * x.T @ (x @ w - y) / n).reshape(8, 8))
        w = ((u * np.maximum(s - step * lam, 0)) @ vt).ravel()
    assert np.linalg.matrix_rank(w.reshape(8, 8), tol=1e-8) == 3 == int(task.w_star.numpy().trace())
    ranks = {}
    for algo in METHODS:
        keys = dict(SMALL_KEYS[algo])
        if algo == "mc_fedda":
            keys["stage_rounds"] = [50, 50, 100]
            keys["stage_reg"] = [0.8, 0.4, 0.2]
        history, params = run_direct(parse_config(toml(algo, keys, rounds=rounds, dataset="lowrank", reg=lam)))
        ranks[algo] = history[-1]["rank"]
        assert history[-1]["distance_to_opt"] < 0.5, algo
    assert ranks["fedmid"] >= 6
    assert all(ranks[a] == 3 for a in ("fedda", "fast_fedda", "c_fedda", "mc_fedda")), ranks


def test_wire_float32_loses_no_precision_with_poly2_weights():
    """poly2 weights with a large a make the dual sums huge; the float64 state keeps a float32 wire
    run within float32 rounding of the float64 one."""
    keys = {"mu": 0.5, "weights": "poly2", "a": 2000.0, "gamma_theory": True}
    runs = [run_direct(parse_config(toml("fast_fedda", keys, rounds=20, wire=w)))[1]["w"].double()
            for w in ("float32", "float64")]
    assert float((runs[0] - runs[1]).norm()) <= 1e-5 * float(runs[1].norm())


def test_sparse_logistic_regression_on_digits(tmp_path):
    cfg = method_config("digits", "fast_fedda", 0, rounds=25,
                        extra={"reg": 2e-3})
    summary, coord = run_inmemory(cfg, tmp_path)
    weight = coord.state.params["linear.weight"]
    assert summary["final"]["test_accuracy"] >= 0.85
    base_zeros = int((build_task(cfg).build_model().linear.weight == 0).sum())   # init zeros: all
    assert base_zeros == weight.numel()
    zeros = int((weight == 0).sum())
    assert 0.1 * weight.numel() <= zeros < weight.numel()
    assert int((coord.state.params["linear.bias"] == 0).sum()) == 0              # bias unregularised


# ---------------------------------------------------------------------------- the paper's Lasso
@pytest.mark.slow
def test_paper_lasso_setting_digest_5_3():
    """Digest 5.3 acceptance: 64 clients, 10 per round, E = 10, batch 10, 2000 rounds (about 3 min).
    Driven by `run_direct` (same algorithm objects, sampling and minibatch streams as the framework;
    `test_direct_loop_equals_the_framework_run` shows the two agree bit for bit)."""
    hits, finals = {}, {}
    for algo in METHODS:
        history, _ = run_direct(method_config("lasso", algo, 0))
        hits[algo] = first_round(history, "distance_to_opt", 1.0)
        finals[algo] = history[-1]["distance_to_opt"]
    print("rounds to l2 <= 1:", hits, "final l2:", finals)
    baseline = min(hits["fedmid"], hits["fedda"])
    for algo in ("fast_fedda", "c_fedda", "mc_fedda"):
        assert hits[algo] is not None and hits[algo] <= baseline - 150, (algo, hits)
    for algo, value in finals.items():
        assert 0.38 <= value <= 0.50, (algo, value)
