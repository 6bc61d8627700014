"""[algorithm] vectorized for FedLi-LS (common/algorithms/fedli.py `armijo_sgd_together`): the
clients of a call take each local step together, and each trial of their line searches is one
stacked forward pass of the clients still searching.

What must hold: every client's line search is the one-at-a-time `armijo_sgd`'s, trial for trial
(the same minibatches, first steps, accepted steps, backtracks, fallbacks and loss evaluations),
its losses and reply tensors the same to float rounding; a client's result does not depend on the
clients beside it, so the engines give the same model bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedhop.common.algorithms.fedli import FALLBACK_STEP, FORWARDS_KEY, STEP_KEY, FedLiLS
from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine, local_update, local_updates
from fedhop.common.wire.message import COMPUTE_KEY
from tests.test_vectorized import _same_ways, engines_agree

ROOT = Path(__file__).resolve().parents[1]

# softmax regression on cross-device synthetic clients of log-normal sizes, an epoch each
_CROSSDEVICE = ('[run]\nseed = 4\nrounds = 3\neval_every = 0\n[algorithm]\nname = "fedli_ls"\nbatch_size = 8\n'
                'local_epochs = 1\n{extra}vectorized = {vec}\n[data]\ndataset = "crossdevice"\nbase = "synthetic"\n'
                'sizes = "lognormal"\n[model]\nkind = "logreg"\n[clients]\ncount = 3000\nper_round = 30\n')

CASES = {
    # examples/fedavg_digits.toml (a Dirichlet split: clients of many sizes) with the SLS defaults
    "digits": "",
    # a first step far too long: every step backtracks, and after 3 rejected trials some fall back
    "fallbacks": "eta_max = 20.0\nmax_backtracks = 3\nweight_decay = 0.01\n",
    # the last accepted step kept as the next first one, capped at eta_max, and a server step of max_i eta_i
    "keep": "reset = \"keep\"\ncap = true\neta_max = 5.0\nserver_step = \"max\"\n",
    # a gradient norm bound above every gradient's: no search, every step eta_max (plain SGD)
    "no_search": "min_grad_norm = 1e9\nreset = \"keep\"\neta_max = 0.05\n",
    "crossdevice": "eta_max = 2.0\n",
}


def _text(case: str, vec: bool) -> str:
    if case == "crossdevice":
        return _CROSSDEVICE.format(extra=CASES[case], vec=str(vec).lower())
    text = (ROOT / "examples" / "fedavg_digits.toml").read_text().replace("rounds = 30", "rounds = 3")
    text = text.replace('name = "fedavg"', f'name = "fedli_ls"\n{CASES[case]}')
    return text.replace("batch_size = 16\n", f"batch_size = 16\nvectorized = {'true' if vec else 'false'}\n")


def _items(engine: RoundEngine, round: int) -> list:
    sampled = engine.sample(round)
    _, own = engine.messages(round, sampled)
    return [(cid, round, own[cid], {}, 0) for cid in sampled]


@pytest.mark.parametrize("case", list(CASES))
def test_line_searches_together_are_armijo_sgd_trial_for_trial(case):
    plain, vec = RoundEngine(parse_config(_text(case, False))), RoundEngine(parse_config(_text(case, True)))
    assert vec.algorithm.trains_together() and vec.cfg.algorithm.vectorized
    alone, together = [], []
    plain.algorithm.observer, vec.algorithm.observer = alone.append, together.append
    items = _items(plain, 1)
    one = [local_update(plain.cfg, plain.task, plain.algorithm, plain.task.build_model(), *item) for item in items]
    both = local_updates(vec.cfg, vec.task, vec.algorithm, vec.task.build_model(), items)
    steps = [int(r.scalars["local_steps"]) for r in one]
    assert len(set(steps)) > 1   # clients of several sizes: fewer search together at each later step
    mine = {cid: [t for t in together if t.client == cid] for cid, *_ in items}
    for cid, *_ in items:
        a, b = [t for t in alone if t.client == cid], mine[cid]
        assert [(t.step, t.eta, t.accepted, t.backtracks) for t in a] == [(t.step, t.eta, t.accepted, t.backtracks)
                                                                           for t in b], cid
        assert all(torch.equal(x.batch, y.batch) for x, y in zip(a, b))   # the same minibatches
        for x, y in zip(a, b):
            assert y.loss_before == pytest.approx(x.loss_before, rel=1e-5, abs=1e-7)
            assert y.loss_after == pytest.approx(x.loss_after, rel=1e-5, abs=1e-7)
            assert y.grad_sq == pytest.approx(x.grad_sq, rel=1e-4, abs=1e-10)
    for a, b in zip(one, both):
        assert list(a.tensors) == list(b.tensors)
        for key in ("local_steps", FORWARDS_KEY, "weight"):
            assert a.scalars[key] == b.scalars[key], key
        assert float(a.tensors[STEP_KEY]) == float(b.tensors[STEP_KEY])
        assert b.scalars["train_loss"] == pytest.approx(a.scalars["train_loss"], rel=1e-5)
        assert b.scalars[COMPUTE_KEY] > 0
        for name, t in a.tensors.items():
            assert torch.allclose(t, b.tensors[name], rtol=1e-4, atol=1e-6), name
    backtracks, accepted = sum(t.backtracks for t in alone), sum(t.accepted for t in alone)
    forwards = sum(int(r.scalars[FORWARDS_KEY]) for r in one)
    if case == "no_search":
        assert accepted == 0 and forwards == sum(steps)          # one evaluation a step: the gradient's
    elif case == "fallbacks":
        assert 0 < accepted < len(alone) and backtracks > 0
        assert all(t.eta <= FALLBACK_STEP for t in alone if not t.accepted)   # the rejected steps fell back
    else:
        assert accepted > 0 and backtracks > 0 and forwards > 2 * sum(steps)
    plain.run(3)
    vec.run(3)
    for name, w in plain.state.params.items():
        assert torch.allclose(w, vec.state.params[name], rtol=1e-4, atol=1e-5), name


@pytest.mark.parametrize("case", ["digits", "fallbacks", "crossdevice"])
def test_a_line_searching_clients_result_does_not_depend_on_the_clients_beside_it(case):
    """Bit for bit: all at once, in halves, reversed and one by one (a stack of one is computed
    as a stack of two, as every trial whose searchers dwindle to one is)."""
    engine = RoundEngine(parse_config(_text(case, True)))
    replies = _same_ways(engine, _items(engine, 1), engine.task.build_model())
    assert len({int(r.scalars[FORWARDS_KEY]) for r in replies}) > 1


def test_fedli_ls_gives_one_model_in_both_engines_and_the_plain_runs_bytes(tmp_path):
    """From a user's folder: FedLi-LS vectorized in processes (batched gRPC calls) and in-process
    with two forked workers ends on the same model bit for bit, with the one-at-a-time run's
    messages and bytes (its step-size scalar included), and its model to rounding."""
    (tmp_path / "ls.toml").write_text(_text("fallbacks", False))   # two client processes
    engines_agree(tmp_path, "ls.toml")


def test_a_fedli_ls_subclass_with_a_client_update_of_its_own_does_not_train_together():
    class Own(FedLiLS):
        def client_update(self, ctx, message):
            return super().client_update(ctx, message)

    assert FedLiLS.trains_together() and not Own.trains_together()
