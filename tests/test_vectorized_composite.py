"""[algorithm] vectorized for the composite solvers (FedMiD, FedDA, Fast-FedDA, C-FedDA, MC-FedDA;
common/algorithms/composite.py `local_solver`, common/algorithms/vectorized.py `solve_together`).

What must hold: each client's round is the one-at-a-time solver's (the same minibatches, the same
number of steps, the same proxes, the same loss) up to the float rounding of its gradients; a
client's result does not depend on which clients it was trained beside, so the engines give the
same model bit for bit; the one-at-a-time solver is unchanged by the generator form (its reference
values live in tests/test_composite.py).
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine, local_update, local_updates
from fedhop.common.numerics.sampling import batch_count, local_batches, steps_per_epoch
from fedhop.common.wire.message import COMPUTE_KEY
from tests.test_vectorized import _same_ways, engines_agree

ROOT = Path(__file__).resolve().parents[1]

# softmax regression on cross-device synthetic clients with an l1 term (every weight but the bias) and weight decay
_LOGREG = ('[run]\nseed = 1\nrounds = 3\neval_every = 0\n[algorithm]\nname = "{algo}"\nregularizer = "l1"\n'
           'reg = 0.001\nlr = 0.05\nweight_decay = 0.01\nbatch_size = 16\nlocal_steps = 4\n{extra}vectorized = {vec}\n'
           '[data]\ndataset = "crossdevice"\nbase = "synthetic"\n[model]\nkind = "logreg"\n'
           '[clients]\ncount = 3000\nper_round = 30\n')


def _lowrank(algo: str, vec: bool, extra: str = "") -> str:
    """examples/lowrank_compare.toml (a nuclear-norm prox: an SVD of each client's 32 x 32 W),
    shortened; FedMiD and FedDA take none of the dual-averaging keys."""
    text = (ROOT / "examples" / "lowrank_compare.toml").read_text()
    text = text.replace('name = "fast_fedda"', f'name = "{algo}"').replace("rounds = 1500", "rounds = 3")
    if algo in ("fedmid", "fedda"):
        text = re.sub(r"\n(mu|gamma) = [^\n]*", "", text)
        text = text.replace("reg = 0.1\n", "reg = 0.1\nlr = 0.001\n")
    return text.replace("local_steps = 10\n", f"local_steps = 10\n{extra}vectorized = {'true' if vec else 'false'}\n")


def _text(case: str, algo: str, vec: bool) -> str:
    extra = "stage_rounds = [1, 1, 2]\n" if algo == "mc_fedda" else ""   # a restart before round 3
    if case == "lowrank":
        return _lowrank(algo, vec, extra)
    if case == "epochs":   # FedMiD takes epochs: clients of several sizes take several numbers of steps
        return _LOGREG.format(algo=algo, extra="", vec=str(vec).lower()).replace(
            "local_steps = 4\n", "local_epochs = 1\n").replace('"synthetic"', '"synthetic"\nsizes = "lognormal"')
    return _LOGREG.format(algo=algo, extra=extra, vec=str(vec).lower())


CASES = [("logreg", a) for a in ("fedmid", "fedda", "fast_fedda", "c_fedda", "mc_fedda")] + \
        [("lowrank", "fedda"), ("lowrank", "c_fedda"), ("epochs", "fedmid")]


def _items(engine: RoundEngine, round: int) -> list:
    sampled = engine.sample(round)
    _, own = engine.messages(round, sampled)
    return [(cid, round, own[cid], {}, 0) for cid in sampled]


@pytest.mark.parametrize("case,algo", CASES)
def test_composite_clients_trained_together_are_the_solver_one_at_a_time_to_rounding(case, algo):
    """In round 3 (after two rounds, so the duals are not zero and MC-FedDA has restarted its
    stage): every reply tensor within float32 rounding of the one-at-a-time solver's, the same
    step count, weight and loss to rounding; each reply a share of the stack's seconds; the
    models of three rounds in the engine's own loop the same to rounding."""
    plain, vec = RoundEngine(parse_config(_text(case, algo, False))), RoundEngine(parse_config(_text(case, algo, True)))
    assert vec.algorithm.trains_together()
    plain.run(2)
    vec.run(2)
    items = _items(plain, 3)
    one = [local_update(plain.cfg, plain.task, plain.algorithm, plain.task.build_model(), *item) for item in items]
    together = local_updates(vec.cfg, vec.task, vec.algorithm, vec.task.build_model(), items)
    steps = [int(r.scalars["local_steps"]) for r in one]
    assert min(steps) >= 1 and (case != "epochs" or len(set(steps)) > 1)
    for a, b in zip(one, together):
        assert list(a.tensors) == list(b.tensors) and a.tensors
        assert a.scalars["local_steps"] == b.scalars["local_steps"]
        assert a.scalars["weight"] == b.scalars["weight"]
        assert a.scalars["train_loss"] == pytest.approx(b.scalars["train_loss"], rel=1e-5)
        for name, t in a.tensors.items():
            scale = float(t.abs().max())
            assert scale > 0, name   # a delta that moved
            assert float((t.double() - b.tensors[name].double()).abs().max()) <= 1e-4 * scale, name
    assert all(r.scalars[COMPUTE_KEY] > 0 for r in together)
    plain, vec = RoundEngine(parse_config(_text(case, algo, False))), RoundEngine(parse_config(_text(case, algo, True)))
    plain.run(3)
    vec.run(3)
    for name, w in plain.state.params.items():
        assert torch.allclose(w, vec.state.params[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("case,algo", [("logreg", "fast_fedda"), ("lowrank", "c_fedda"), ("epochs", "fedmid")])
def test_a_composite_clients_result_does_not_depend_on_the_clients_beside_it(case, algo):
    """Bit for bit: the round's clients all at once, in two halves, in reverse order and one by
    one give every client the same reply."""
    engine = RoundEngine(parse_config(_text(case, algo, True)))
    engine.run(1)
    _same_ways(engine, _items(engine, 2), engine.task.build_model())


def test_a_client_given_steps_the_algorithm_cannot_take_is_refused_together_as_alone():
    """Fast-FedDA needs 1 <= a client's steps <= E: a stack with such a client raises the one-at-a-time
    solver's error before any step."""
    engine = RoundEngine(parse_config(_text("logreg", "fast_fedda", True)))
    items = _items(engine, 1)
    cid, round, message, state, step = items[0]
    engine.algorithm.E = 3   # the clients are given 4 steps
    with pytest.raises(ValueError, match=f"client {cid} was given 4 local steps; it needs between 1"):
        local_updates(engine.cfg, engine.task, engine.algorithm, engine.task.build_model(), items)
    with pytest.raises(ValueError, match=f"client {cid} was given 4 local steps; it needs between 1"):
        local_update(engine.cfg, engine.task, engine.algorithm, engine.task.build_model(), *items[0])


def test_batch_count_is_the_number_of_batches_local_batches_draws():
    for rows, batch, steps, epochs in itertools.product((0, 1, 5, 16, 17), (0, 1, 4, 16, 40), (0, 1, 3, 9), (1, 2)):
        drawn = list(local_batches(rows, batch, steps, epochs, torch.Generator().manual_seed(0)))
        assert batch_count(rows, batch, steps, epochs) == len(drawn), (rows, batch, steps, epochs)
        if steps == 0:   # an epoch's batches, as the clock and the privacy accountant count them
            assert epochs * steps_per_epoch(rows, batch) == len(drawn), (rows, batch, epochs)


def test_a_composite_run_gives_one_model_in_both_engines_and_the_plain_runs_bytes(tmp_path):
    """From a user's folder: Fast-FedDA with an l1 term, vectorized in processes (batched gRPC calls)
    and in-process with two forked workers, ends on the same model bit for bit, with the same
    messages and bytes as the one-at-a-time run, whose model is the same to rounding."""
    (tmp_path / "fd.toml").write_text(_text("logreg", "fast_fedda", False).replace(
        "[clients]\n", "[clients]\nprocesses = 2\n"))
    engines_agree(tmp_path, "fd.toml")


def test_a_subclass_with_a_client_update_of_its_own_does_not_train_together():
    """A plug-in that subclasses FedMiD with its own `client_update` keeps it: the key is refused
    for it rather than run FedMiD's solver in its place."""
    from fedhop.common.algorithms.composite import CompositeAlgorithm, FedMiD

    class Own(FedMiD):
        def client_update(self, ctx, message):
            return super().client_update(ctx, message)

    assert FedMiD.trains_together() and not Own.trains_together() and not CompositeAlgorithm.trains_together()
