"""[algorithm] vectorized = true (common/algorithms/vectorized.py): the clients of one call trained
together through torch.func.vmap.

What must hold: each client's local SGD is the one-at-a-time solver's (the same minibatches, the
same number of steps, the same loss) up to float rounding; a client's result does not depend on
which clients it was stacked with, so the engines, batched or not, give the same model bit for
bit; what cannot be vectorized is refused with one line naming the key.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.client.host import ClientHost
from fedhop.common.algorithms.vectorized import saved_bytes_per_row
from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine, local_update, local_updates
from fedhop.common.transport.base import Request
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.message import COMPUTE_KEY, Payload
from tests.test_engines import _sent

ROOT = Path(__file__).resolve().parents[1]


def _digits_text(vectorized: bool, **over: str) -> str:
    """examples/fedavg_digits.toml (a Dirichlet split: clients of many sizes, so several step
    counts and last-batch sizes in one call), shortened."""
    text = (ROOT / "examples" / "fedavg_digits.toml").read_text().replace("rounds = 30", "rounds = 4")
    text = text.replace("batch_size = 16\n", f"batch_size = 16\nvectorized = {'true' if vectorized else 'false'}\n")
    for key, value in over.items():
        text = text.replace(key, value)
    return text


def _engine(text: str) -> RoundEngine:
    return RoundEngine(parse_config(text))


def _items(engine: RoundEngine, round: int) -> list:
    sampled = engine.sample(round)
    _, own = engine.messages(round, sampled)
    return [(cid, round, own[cid], {}, 0) for cid in sampled]


@pytest.mark.parametrize("algorithm,extra", [
    ("fedavg", ""), ("fedprox", "mu = 0.5"), ("fedexp", ""),
    # FedLi-LU's reported loss: the epoch's mean minibatch loss, the last one's, the whole local loss after training
    ("fedli_lu", ""), ("fedli_lu", 'loss_report = "last_batch"'), ("fedli_lu", 'loss_report = "post_train"'),
])
def test_clients_trained_together_are_the_solver_one_at_a_time_to_rounding(algorithm, extra):
    """The same local SGD (FedProx's with its proximal gradient, mu = 0.5; FedExP's with each
    update's squared norm; FedLi-LU's with the loss it reports as a tensor): every reply tensor
    within float32 rounding of the one-at-a-time solver's, the same step count and loss; the
    rounds' models too (the engine's own loop)."""
    over = {'name = "fedavg"': f'name = "{algorithm}"\n{extra}'}
    plain, vec = _engine(_digits_text(False, **over)), _engine(_digits_text(True, **over))
    assert vec.algorithm.name == algorithm and vec.algorithm.trains_together()
    assert getattr(vec.algorithm, "proximal_mu", lambda: 0.0)() == (0.5 if algorithm == "fedprox" else 0.0)
    items = _items(plain, 1)
    model = plain.task.build_model()
    one = [local_update(plain.cfg, plain.task, plain.algorithm, model, *item) for item in items]
    together = local_updates(vec.cfg, vec.task, vec.algorithm, vec.task.build_model(), items)
    steps = [int(r.scalars["local_steps"]) for r in one]
    assert len(set(steps)) > 1   # clients of several sizes: the groups at each step differ
    for a, b in zip(one, together):
        assert list(a.tensors) == list(b.tensors)
        assert a.scalars["local_steps"] == b.scalars["local_steps"]
        assert a.scalars["weight"] == b.scalars["weight"]
        assert a.scalars["train_loss"] == pytest.approx(b.scalars["train_loss"], rel=1e-5)
        for name in a.tensors:
            assert torch.allclose(a.tensors[name], b.tensors[name], rtol=1e-4, atol=1e-6), name
    total = sum(r.scalars[COMPUTE_KEY] for r in together)   # each client's share of the one computation
    assert all(r.scalars[COMPUTE_KEY] > 0 for r in together) and total < 10
    plain.run(3)
    vec.run(3)
    # rounding, and a local training that rounding can move further: in FedLi-LU's round 3 here,
    # client 42 trained one at a time from the two runs' states (3e-8 apart) differs by 5.6e-4,
    # 4.3e-5 in the mean (its vectorized reply from the same state as the one-at-a-time one: 9e-8)
    for name, w in plain.state.params.items():
        assert torch.allclose(w, vec.state.params[name], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("text", [
    _digits_text(True),
    _digits_text(True, **{'name = "fedavg"': 'name = "fedexp"'}),   # each reply's squared norm
    # the loss over the client's data at its own final parameters
    _digits_text(True, **{'name = "fedavg"': 'name = "fedli_lu"\nloss_report = "post_train"'}),
    # a hidden layer of 1,100 units: its weight gradient (70,400 elements a client, above
    # ROW_COPY_MIN) is copied row by row into the parameters' layout before each step
    _digits_text(True, **{"hidden = [64]": "hidden = [1100]"}),
    # a float64 quadratic (W1's task) in step mode with weight decay, FedProx's proximal gradient
    '[run]\nseed = 3\nrounds = 2\n[algorithm]\nname = "fedprox"\nlr = 0.1\nbatch_size = 4\nlocal_steps = 3\n'
    'weight_decay = 0.01\nvectorized = true\n[data]\ndataset = "quadratic"\ndim = 30\ndtype = "float64"\n[clients]\ncount = 12\n'
    'per_round = 12\n',
    # softmax regression on cross-device synthetic clients (the 1,000,000-client bench's task)
    '[run]\nseed = 1\nrounds = 2\n[algorithm]\nname = "fedavgm"\nlr = 0.05\nbatch_size = 16\nlocal_steps = 2\n'
    'vectorized = true\n[data]\ndataset = "crossdevice"\nbase = "synthetic"\n[model]\nkind = "logreg"\n'
    '[clients]\ncount = 5000\nper_round = 40\n',
    # issue 49's W3: log-normal client sizes, so clients take from 1 to many steps of batches of 1 to 10 rows
    '[run]\nseed = 2\nrounds = 2\n[algorithm]\nname = "fedavg"\nlr = 0.05\nbatch_size = 10\nlocal_epochs = 1\n'
    'vectorized = true\n[data]\ndataset = "crossdevice"\nbase = "digits"\nlabel_alpha = 0.5\nsizes = "lognormal"\n'
    'size_mean = 3.0\nsize_sigma = 1.0\n[model]\nkind = "mlp"\nhidden = [64, 32]\n[clients]\ncount = 2000\n'
    'per_round = 60\n',
])
def test_a_clients_result_does_not_depend_on_the_clients_beside_it(text):
    """Bit for bit: the round's clients all at once, in two halves, in reverse order and one by
    one give every client the same reply."""
    engine = _engine(text)
    _same_ways(engine, _items(engine, 1), engine.task.build_model())


@pytest.mark.parametrize("algorithm,extra", [("scaffold", ""), ("feddyn", "alpha = 0.1"), ("fednova", "")])
def test_solvers_with_client_state_train_together(algorithm, extra):
    """SCAFFOLD (its correction c - c_i in every step), FedDyn (its regularizer's gradient) and
    FedNova (each update divided by its own step count): in round 3, after two rounds in which
    every client trained and kept its state, every reply and every new client state is the
    one-at-a-time solver's to float rounding; all at once, reversed and one by one give the same
    bits; and three rounds of the engine's loop end on the same model to rounding."""
    over = {'name = "fedavg"': f'name = "{algorithm}"\n{extra}', "per_round = 10": "per_round = 50"}
    plain, vec = _engine(_digits_text(False, **over)), _engine(_digits_text(True, **over))
    plain.run(2)
    sampled = plain.sample(3)
    _, own = plain.messages(3, sampled)
    states = {cid: plain.client_states.get(cid, {}) for cid in sampled}
    if algorithm != "fednova":   # the state the vectorized step must use: not zero
        assert all(any(bool(t.abs().max() > 0) for t in states[cid].values()) for cid in sampled)

    def items(order: list[int]) -> list:
        return [(cid, 3, own[cid], {k: t.clone() for k, t in states[cid].items()}, 0) for cid in order]

    model = plain.task.build_model()
    one = {item[0]: (local_update(plain.cfg, plain.task, plain.algorithm, model, *item), item[3])
           for item in items(sampled)}
    ways = []
    for groups in ([sampled], [sampled[::-1]], [[cid] for cid in sampled]):
        out = {}
        for group in groups:
            batch = items(group)
            for item, reply in zip(batch, local_updates(vec.cfg, vec.task, vec.algorithm, model, batch)):
                out[item[0]] = (reply, item[3])
        ways.append(out)
    steps = {int(reply.scalars["local_steps"]) for reply, _ in one.values()}
    assert len(steps) > 1   # clients of several sizes: the stacks change from step to step
    for cid, (a, a_state) in one.items():
        b, b_state = ways[0][cid]
        assert list(a.tensors) == list(b.tensors) and set(a.scalars) <= set(b.scalars)
        assert a.scalars["local_steps"] == b.scalars["local_steps"]
        assert a.scalars["train_loss"] == pytest.approx(b.scalars["train_loss"], rel=1e-5)
        for name in a.tensors:
            assert torch.allclose(a.tensors[name], b.tensors[name], rtol=1e-4, atol=1e-5), (cid, name)
        assert set(a_state) == set(b_state)
        for name in a_state:
            assert torch.allclose(a_state[name], b_state[name], rtol=1e-4, atol=1e-5), (cid, name)
        for other in ways[1:]:
            c, c_state = other[cid]
            assert all(torch.equal(t, c.tensors[name]) for name, t in b.tensors.items()), cid
            assert all(torch.equal(t, c_state[name]) for name, t in b_state.items()), cid
    plain.train_round(3)
    vec.run(3)
    for name, w in plain.state.params.items():
        assert torch.allclose(w, vec.state.params[name], rtol=1e-4, atol=1e-5)


def _stragglers_text(vectorized: bool, source: str) -> str:
    """examples/stragglers_digits.toml (FedLGA, half of each round's clients straggling), 3 rounds."""
    text = (ROOT / "examples" / "stragglers_digits.toml").read_text().replace("rounds = 150", "rounds = 3")
    return text.replace("[algorithm]\n", f'[algorithm]\nvectorized = {"true" if vectorized else "false"}\n'
                                         f'lga_grad_source = "{source}"\nlga_grad_batch = 5\n')


def _fedchs_items(vectorized: bool, local_iters: int) -> tuple[RoundEngine, list]:
    """examples/fedchs_digits.toml with E = `local_iters` and weight decay: the 10 clients of one
    cluster at step 2 of a round, each given the edge's message (E > 1: with its step sizes)."""
    text = (ROOT / "examples" / "fedchs_digits.toml").read_text().replace(
        "local_iters = 1", f"local_iters = {local_iters}\nweight_decay = 0.01\nvectorized = {str(vectorized).lower()}")
    engine = _engine(text)
    message = engine.algorithm.step_message({n: t.clone() for n, t in engine.state.params.items()}, 2,
                                            engine.algorithm.round_step_sizes(20))
    return engine, [(cid, 1, message, {}, 2) for cid in range(10)]


def _same_ways(engine: RoundEngine, items: list, model: torch.nn.Module) -> list[Payload]:
    """The items' replies trained all at once; in two halves, reversed and one by one must give
    every client the same bits and the same loss."""
    def replies(groups: list[list]) -> dict[int, Payload]:
        return {item[0]: reply for group in groups
                for item, reply in zip(group, local_updates(engine.cfg, engine.task, engine.algorithm, model, group))}
    half = len(items) // 2
    ways = [replies([items]), replies([items[:half], items[half:]]), replies([items[::-1]]),
            replies([[item] for item in items])]
    for other in ways[1:]:
        for cid, reply in ways[0].items():
            assert list(reply.tensors) == list(other[cid].tensors)
            assert all(torch.equal(t, other[cid].tensors[name]) for name, t in reply.tensors.items()), cid
            assert reply.scalars["train_loss"] == other[cid].scalars["train_loss"], cid
    return [ways[0][item[0]] for item in items]


@pytest.mark.parametrize("case", ["fedlga-delta", "fedlga-client_last_grad", "fedchs-1", "fedchs-3"])
def test_fedlga_and_fedchs_train_together(case):
    """FedLGA with stragglers (each client's own E_i from the server's plan; with
    "client_last_grad" a straggler's gradient at its w_{i,E_i} on a minibatch of its own
    generator), Fed-CHS with E = 1 (each client's one minibatch gradient) and E = 3 (local SGD
    with the step sizes of the edge's message): every reply tensor (tau_i and the straggler's
    gradient included) within float32 rounding of the one-at-a-time solver's, the same steps,
    weights and losses; all at once, reversed and one by one the same bits."""
    name, variant = case.split("-")
    if name == "fedlga":
        plain, vec = _engine(_stragglers_text(False, variant)), _engine(_stragglers_text(True, variant))
        items = _items(plain, 1)
    else:
        plain, items = _fedchs_items(False, int(variant))
        vec, _ = _fedchs_items(True, int(variant))
    model = plain.task.build_model()
    one = [local_update(plain.cfg, plain.task, plain.algorithm, model, *item) for item in items]
    together = _same_ways(vec, items, model)
    if name == "fedlga":
        taus = [int(r.tensors["tau"]) for r in one]
        assert 1 in taus and max(taus) > 1   # stragglers and full clients in one stack
        assert any(n.startswith("lga_grad.") for r in one for n in r.tensors) == (variant == "client_last_grad")
    for a, b in zip(one, together):
        assert list(a.tensors) == list(b.tensors)
        for key in ("local_steps", "weight", "lga_full_weight"):
            assert a.scalars.get(key) == b.scalars.get(key), key
        assert a.scalars["train_loss"] == pytest.approx(b.scalars["train_loss"], rel=1e-5)
        for n in a.tensors:
            assert torch.allclose(a.tensors[n], b.tensors[n], rtol=1e-4, atol=1e-6), n
    steps = {int(r.scalars["local_steps"]) for r in one}
    if name == "fedchs":
        assert steps == {int(variant)}
    else:
        assert len(steps) > 1   # E_i differ: the stack shrinks as the stragglers stop


def test_a_model_that_vmaps_only_under_grad_takes_the_gradient_transform(tmp_path, monkeypatch):
    """The vectorized solver runs the model once on the stacked parameters (vmap) and takes every
    client's gradients from one backward pass; char_lstm's LSTM has no batching rule outside
    torch.func's `grad`, so that model takes `vmap(grad_and_value)` at every step instead: its
    replies within float32 rounding of one at a time, all at once and one by one the same bits.
    W2's MLP takes the backward pass."""
    from fedhop.common.algorithms.vectorized import _GRAD_TRANSFORM
    from fedhop.common.data import fakedata
    fakedata.shakespeare(tmp_path / "made", roles=6, mean=12, per_file=50)
    (tmp_path / "data").mkdir()
    (tmp_path / "made").rename(tmp_path / "data" / "shakespeare")
    monkeypatch.chdir(tmp_path)
    text = ('[run]\nseed = 0\nrounds = 1\n[algorithm]\nname = "fedavg"\nlr = 0.8\nlocal_steps = 2\nbatch_size = 4\n'
            'vectorized = {}\n[data]\ndataset = "shakespeare"\npartition = "natural"\ndata_dir = "data"\n'
            '[model]\nkind = "char_lstm"\n[clients]\ncount = 6\nper_round = 6\n')
    plain, vec = _engine(text.format("false")), _engine(text.format("true"))
    items = _items(plain, 1)
    model = plain.task.build_model()
    one = [local_update(plain.cfg, plain.task, plain.algorithm, model, *item) for item in items]
    with pytest.warns(UserWarning, match="batching rule"):
        together = _same_ways(vec, items, model)
    assert _GRAD_TRANSFORM[model] is True and vec.task.stacked_sample_loss(model) is None   # vmapped
    for a, b in zip(one, together):
        assert a.scalars["local_steps"] == b.scalars["local_steps"] == 2
        for n in a.tensors:
            assert torch.allclose(a.tensors[n], b.tensors[n], rtol=1e-4, atol=1e-6), n
    mlp = _engine(_digits_text(True))
    mlp_model = mlp.task.build_model()
    local_updates(mlp.cfg, mlp.task, mlp.algorithm, mlp_model, _items(mlp, 1))
    assert _GRAD_TRANSFORM[mlp_model] is False


@pytest.mark.parametrize("text", [
    _digits_text(True),                                                          # mlp
    _digits_text(True, **{'kind = "mlp"': 'kind = "logreg"'}),                   # softmax regression
    '[run]\nseed = 1\nrounds = 1\n[algorithm]\nname = "fedavg"\nlocal_steps = 1\nbatch_size = 4\nvectorized = true\n'
    '[data]\ndataset = "npz"\npath = "{folder}/reg.npz"\ntask = "regression"\n[model]\nkind = "linear"\n'
    '[clients]\ncount = 3\n',   # least squares on the user's own data (written below)
    '[run]\nseed = 1\nrounds = 1\n[algorithm]\nname = "fedavg"\nlocal_steps = 1\nbatch_size = 4\nvectorized = true\n'
    '[data]\ndataset = "quadratic"\ndim = 9\n[clients]\ncount = 6\n',
])
def test_a_stack_of_a_dense_model_or_the_quadratic_is_computed_without_vmap(text, tmp_path):
    """`Task.stacked_sample_loss`: the per-sample losses of three clients' parameters on their own
    batches, computed on the stack at once (the dense models' `forward_stacked`), are each
    client's `sample_loss` with its own parameters loaded into the model."""
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(8, 5)) for _ in range(3)]
    np.savez(tmp_path / "reg.npz", **{f"x_{i}": x for i, x in enumerate(xs)},
             **{f"y_{i}": x @ np.arange(5.0) + 1 for i, x in enumerate(xs)})
    engine = _engine(text.replace("{folder}", str(tmp_path)))
    model = engine.task.build_model()
    stacked = engine.task.stacked_sample_loss(model)
    assert stacked is not None
    gen = torch.Generator().manual_seed(5)
    names = [name for name, _ in model.named_parameters()]
    sets = [{name: p.detach() + 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
             for name, p in model.named_parameters()} for _ in range(3)]
    batches = [tuple(t[:4] for t in engine.task.client_data(cid).tensors) for cid in (0, 1, 2)]
    together = stacked({name: torch.stack([s[name] for s in sets]) for name in names},
                       tuple(torch.stack([b[j] for b in batches]) for j in range(len(batches[0]))))
    for i, (params, batch) in enumerate(zip(sets, batches)):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name])
        assert torch.allclose(together[i], engine.task.sample_loss(model, batch), rtol=1e-6, atol=1e-7), i


def test_a_subclass_with_its_own_forward_is_not_run_by_its_parents_stacked_forward():
    """A model whose class defines `forward` without `forward_stacked` beside it (a plug-in's
    subclass of the MLP) goes through vmap: its parent's stacked forward would compute another
    function."""
    from fedhop.common.models.dense import MLP

    class Doubled(MLP):
        def forward(self, x):
            return 2 * super().forward(x)

    engine = _engine(_digits_text(True))
    assert engine.task.stacked_sample_loss(MLP(64, [8], 10)) is not None
    assert engine.task.stacked_sample_loss(Doubled(64, [8], 10)) is None


def _images_text(folder: Path, kind: str, vectorized: bool) -> str:
    """FedAvg with `kind` on fakedata's FEMNIST (28x28) or CIFAR-10 (32x32) files in `folder`:
    20 clients, 10 a round, 2 local steps of batches of 10."""
    from fedhop.common.data import fakedata
    if kind == "cifar_cnn":
        fakedata.cifar10(folder / "cifar10", per_batch=40, n_test=10)
        data = f'dataset = "cifar10"\npartition = "iid"\ndata_dir = "{folder / "cifar10"}"\n'
    else:
        fakedata.femnist(folder / "femnist", writers=20)
        data = f'dataset = "femnist"\npartition = "natural"\ndata_dir = "{folder}"\n'
    return (f'[run]\nseed = 4\nrounds = 2\neval_every = 0\n[algorithm]\nname = "fedavg"\nlr = 0.05\n'
            f'batch_size = 10\nlocal_steps = 2\nvectorized = {"true" if vectorized else "false"}\n[data]\n{data}'
            f'[model]\nkind = "{kind}"\n[clients]\ncount = 20\nper_round = 10\n')


@pytest.mark.parametrize("kind", ["cnn", "cifar_cnn"])
def test_the_convolutions_of_a_stack_of_larger_images_run_client_by_client(kind, tmp_path):
    """On the CPU a stack of clients of a convolutional model on 28x28 or 32x32 images is run
    through the model's `forward_stacked` (each client's convolutions on their own,
    common/models/conv.py `stacked_conv`), not vmapped: each client's reply the same bits in
    any grouping and within float32 rounding of the solver one at a time.  LeNet on 8x8 digits
    stays vmapped (its grouped convolution was measured faster)."""
    from fedhop.common.models.conv import CNN
    engine = _engine(_images_text(tmp_path, kind, True))
    model = engine.task.build_model()
    assert engine.task.stacked_sample_loss(model) is not None
    digits = _engine(_digits_text(True))
    assert digits.task.stacked_sample_loss(CNN(1, 8, 10)) is None
    items = _items(engine, 1)
    together = _same_ways(engine, items, model)
    plain = _engine(_images_text(tmp_path, kind, False))
    one = [local_update(plain.cfg, plain.task, plain.algorithm, plain.task.build_model(), *item) for item in items]
    for a, b in zip(one, together):
        assert a.scalars["local_steps"] == b.scalars["local_steps"]
        assert a.scalars["train_loss"] == pytest.approx(b.scalars["train_loss"], rel=1e-5)
        for name in a.tensors:
            assert torch.allclose(a.tensors[name], b.tensors[name], rtol=1e-4, atol=1e-6), name


def test_another_error_of_a_first_stack_is_raised_and_decides_no_way(monkeypatch):
    """Only vmap's refusal of an operator sends a model to the gradient transform: an error of
    another kind in a model's first stack (here the stacked losses running out of memory) is
    raised, and the model's next stack still takes the backward pass."""
    from fedhop.common.algorithms.vectorized import _GRAD_TRANSFORM
    engine = _engine(_digits_text(True))
    model = engine.task.build_model()
    good = engine.task.stacked_sample_loss

    def failing(m):
        def losses(params, batch):
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        return losses
    monkeypatch.setattr(engine.task, "stacked_sample_loss", failing)
    with pytest.raises(RuntimeError, match="not enough memory"):
        local_updates(engine.cfg, engine.task, engine.algorithm, model, _items(engine, 1))
    assert model not in _GRAD_TRANSFORM
    monkeypatch.setattr(engine.task, "stacked_sample_loss", good)
    local_updates(engine.cfg, engine.task, engine.algorithm, model, _items(engine, 1))
    assert _GRAD_TRANSFORM[model] is False


def test_a_call_is_trained_in_stacks_within_the_memory_budget(monkeypatch):
    """[algorithm] vectorized_memory_mb: the round's 50 clients in stacks of `stack_size`, each
    within the budget by its estimate, with the same bits as one stack of all of them."""
    over = {"per_round = 10": "per_round = 50"}
    small = _engine(_digits_text(True, **over).replace("vectorized = true", "vectorized = true\nvectorized_memory_mb = 1"))
    whole = _engine(_digits_text(True, **over).replace("vectorized = true", "vectorized = true\nvectorized_memory_mb = 100000"))
    items = _items(small, 1)
    model = small.task.build_model()
    stacks: list[int] = []
    together = small.algorithm.client_updates

    def counted(ctxs, messages):
        stacks.append(len(ctxs))
        return together(ctxs, messages)
    monkeypatch.setattr(small.algorithm, "client_updates", counted)
    bounded = local_updates(small.cfg, small.task, small.algorithm, model, items)
    size = max(stacks)
    assert len(stacks) > 2 and sum(stacks) == len(items) and stacks == [size] * (len(stacks) - 1) + [stacks[-1]]
    params = sum(p.numel() * 4 for p in model.parameters())
    row = tuple(t[:1] for t in small.task.client_data(items[0][0]).tensors)
    per_client = 4 * params + 2 * 16 * saved_bytes_per_row(small.task, model, row)
    assert size * per_client <= 1 << 20 < (size + 1) * per_client
    one = local_updates(whole.cfg, whole.task, whole.algorithm, model, _items(whole, 1))
    for a, b in zip(bounded, one):
        assert all(torch.equal(t, b.tensors[name]) for name, t in a.tensors.items())


def test_the_activations_one_example_keeps_grow_with_the_model():
    """`saved_bytes_per_row`: an MLP's linear layers keep their inputs for the backward pass (the
    example's 64 features and each hidden layer's output), the parameters left out."""
    sizes = {}
    for hidden in ([64], [256, 64]):
        engine = _engine(_digits_text(True, **{"hidden = [64]": f"hidden = {hidden}"}))
        model = engine.task.build_model()
        row = tuple(t[:1] for t in engine.task.client_data(0).tensors)
        sizes[len(hidden)] = saved_bytes_per_row(engine.task, model, row)
        assert sizes[len(hidden)] >= 4 * (64 + sum(hidden))
        assert sizes[len(hidden)] < sum(p.numel() * 4 for p in model.parameters())   # no weight counted
    assert sizes[2] > sizes[1] + 4 * 256


# the process's own peak from /proc (VmHWM, kB): `ru_maxrss` starts at the forking parent's
# resident size (Linux keeps it across exec), so a large pytest process would hide the round's growth
_PEAK = """
import re, sys
from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
engine = RoundEngine(parse_config(open(sys.argv[1]).read()))
engine.task.client_data(0)
before = peak()
engine.run(1)
print((peak() - before) // 1024)
"""


def test_a_stack_of_large_clients_stays_within_the_budget(tmp_path):
    """cifar_cnn (1.76 M parameters), 60 clients in one round of the engine's loop, each case in
    its own process, the growth of its peak resident memory over the round (which holds the
    round's 60 replies in every case): vectorized with the 60 clients in one stack, more than
    1 GB above one at a time (each client's parameters, gradients and activations); with the
    default budget of 512 MB, within the budget of it, and far below the unbounded."""
    from fedhop.common.data import fakedata
    fakedata.cifar10(tmp_path / "data", per_batch=240, n_test=20)
    base = ('[run]\nseed = 0\nrounds = 1\neval_every = 0\n[algorithm]\nname = "fedavg"\nlr = 0.05\nbatch_size = 10\n'
            'local_steps = 1\n{extra}\n[data]\ndataset = "cifar10"\npartition = "iid"\n[model]\nkind = "cifar_cnn"\n'
            '[clients]\ncount = 60\nper_round = 60\n')
    grown = {}
    for name, extra in [("plain", ""), ("budget", "vectorized = true"),
                        ("unbounded", "vectorized = true\nvectorized_memory_mb = 100000")]:
        (tmp_path / f"{name}.toml").write_text(base.format(extra=extra))
        out = subprocess.run([sys.executable, "-c", _PEAK, f"{name}.toml"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600, env=_env())
        assert out.returncode == 0, out.stderr[-2000:]
        grown[name] = int(out.stdout.split()[-1])
    assert grown["unbounded"] - grown["plain"] > 1000, grown   # both hold the round's 60 replies (7 MB each)
    assert grown["budget"] - grown["plain"] < 512 + 100, grown
    assert grown["budget"] < grown["unbounded"] - 900, grown


def _request(host: ClientHost, cid: int, message: Payload, src: str = "server") -> Request:
    env = pb.Envelope(run_id="r", round=1, step=0, src=src, dst=f"client-{cid}", method="train")
    return Request(env, message)


def test_a_batch_is_trained_once_and_each_call_takes_its_reply():
    """`ClientHost.prepare_batch`: the parent's train requests of a batch trained together, each
    `train` call answered with its own reply; a request from another node, for a client hosted
    elsewhere or with a non-finite tensor is left to its own call (which refuses it)."""
    engine = _engine(_digits_text(True))
    sampled = engine.sample(1)
    _, own = engine.messages(1, sampled)
    hosted = sampled[:4]
    host = ClientHost(engine.cfg, "client-proc0", hosted, "r")
    bad = Payload(tensors={k: torch.full_like(v, float("nan")) for k, v in own[hosted[3]].tensors.items()})
    requests = [_request(host, hosted[0], own[hosted[0]]), _request(host, hosted[1], own[hosted[1]]),
                _request(host, hosted[2], own[hosted[2]], src="client-9"), _request(host, hosted[3], bad),
                _request(host, sampled[5], own[sampled[5]])]
    host.prepare_batch(requests)
    assert sorted(host._trained) == sorted((cid, 1, 0) for cid in hosted[:2])
    prepared = dict(host._trained)
    for cid in hosted[:2]:
        reply = host.train(cid, 1, own[cid])
        assert reply is prepared[(cid, 1, 0)]
        alone = local_updates(engine.cfg, engine.task, engine.algorithm, engine.task.build_model(),
                              [(cid, 1, own[cid], {}, 0)])[0]
        assert all(torch.equal(alone.tensors[n], t) for n, t in reply.tensors.items())
    assert host._trained == {}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHOP_PLUGIN_PATH")}


def fedhop(args: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=_env() if env is None else env)


def _models(folder: Path, config: str, runs: dict[str, list[str]],
            env: dict[str, str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """`fedhop run CONFIG --out NAME FLAGS` in `folder` for each run; each run's final model."""
    models = {}
    for name, flags in runs.items():
        out = fedhop(["run", config, "--out", name, "--quiet", *flags], folder, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        models[name] = load_file(str(folder / name / "model.safetensors"))
    return models


def engines_agree(folder: Path, config: str, env: dict[str, str] | None = None) -> None:
    """`config` run vectorized in processes (batched gRPC calls) and in-process with two forked
    workers: the same model bit for bit and the same messages and bytes as its one-at-a-time
    run in processes, whose model is the same to rounding."""
    runs = {"plain": ["--engine", "processes"],
            "processes": ["--engine", "processes", "--set", "algorithm.vectorized=true"],
            "inprocess": ["--engine", "inprocess", "--set", "algorithm.vectorized=true", "--set", "run.workers=2"]}
    models = _models(folder, config, runs, env)
    assert all(torch.equal(models["processes"][k], models["inprocess"][k]) for k in models["processes"])
    assert _sent(folder / "processes") == _sent(folder / "plain") == _sent(folder / "inprocess")
    for k, w in models["plain"].items():
        assert np.allclose(w.numpy(), models["processes"][k].numpy(), rtol=1e-4, atol=1e-5), k


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_both_engines_give_one_model_and_the_plain_runs_bytes(tmp_path, algorithm):
    """From a user's folder: a vectorized run in processes (batched calls over gRPC), in-process with
    forked workers, in-process in one process (batches shown to the host by `InMemoryEndpoint.pipelined`)
    and with unbatched calls (each client alone) end on the same model bit for bit, with the same
    messages and bytes as the one-at-a-time run, whose model is the same to rounding.  SCAFFOLD's
    clients keep their control variates in the process that hosts them from round to round (10 of
    50 sampled in each of 4 rounds: some clients come back)."""
    (tmp_path / "digits.toml").write_text(_digits_text(False, **{'name = "fedavg"': f'name = "{algorithm}"'}))
    runs = {"plain": ["--engine", "processes"],
            "processes": ["--engine", "processes", "--set", "algorithm.vectorized=true"],
            "inprocess": ["--engine", "inprocess", "--set", "algorithm.vectorized=true", "--set", "run.workers=2"],
            "unbatched": ["--engine", "inprocess", "--set", "algorithm.vectorized=true", "--set", "run.workers=1",
                          "--set", "transport.batch=false"],
            "one_process": ["--engine", "inprocess", "--set", "algorithm.vectorized=true", "--set", "run.workers=1"]}
    models = _models(tmp_path, "digits.toml", runs)
    for name in ("inprocess", "unbatched", "one_process"):
        assert all(torch.equal(models["processes"][k], models[name][k]) for k in models["processes"]), name
    assert _sent(tmp_path / "processes") == _sent(tmp_path / "plain") == _sent(tmp_path / "inprocess")
    for k, w in models["plain"].items():
        assert np.allclose(w.numpy(), models["processes"][k].numpy(), rtol=1e-4, atol=1e-5), k


def test_fedchs_runs_vectorized_on_its_sequential_topology(tmp_path):
    """examples/fedchs_digits.toml from a user's folder, 3 rounds: each edge's train calls to the
    10 clients of its cluster trained together, in processes and in-process (forked workers), the
    same model bit for bit; in processes the one-at-a-time run's messages and bytes, and its model
    to rounding."""
    text = (ROOT / "examples" / "fedchs_digits.toml").read_text().replace("rounds = 60", "rounds = 3")
    (tmp_path / "chs.toml").write_text(text)
    runs = {"plain": ["--engine", "processes"],
            "processes": ["--engine", "processes", "--set", "algorithm.vectorized=true"],
            "inprocess": ["--engine", "inprocess", "--set", "algorithm.vectorized=true", "--set", "run.workers=2"]}
    models = _models(tmp_path, "chs.toml", runs)
    assert all(torch.equal(models["processes"][k], models["inprocess"][k]) for k in models["processes"])
    assert _sent(tmp_path / "processes") == _sent(tmp_path / "plain")   # in-process, `seq_round` names other addresses
    for k, w in models["plain"].items():
        assert np.allclose(w.numpy(), models["processes"][k].numpy(), rtol=1e-4, atol=1e-5), k


#: a plug-in whose client step is its own `client_update`: nothing tells how to train it together
_OWN_SOLVER = ("from fedhop.common.algorithms.fedavg import FedAvg\n\n\nclass Own(FedAvg):\n    name = \"own\"\n\n"
               "    def client_update(self, ctx, message):\n        return super().client_update(ctx, message)\n")


@pytest.mark.parametrize("sets,names", [
    (["algorithm.name=own:Own"], "algorithm.name = 'own:Own'"),
    (["privacy.mode=dpsgd", "privacy.noise_multiplier=1.0", "privacy.clip_norm=1.0"], "privacy.mode = 'dpsgd'"),
])
def test_what_cannot_train_together_is_one_line_exit_2(tmp_path, sets, names):
    """Every built-in algorithm trains together; a plug-in with a `client_update` of its own, and
    DP-SGD's per-example clipping, do not."""
    (tmp_path / "digits.toml").write_text(_digits_text(True))
    (tmp_path / "own.py").write_text(_OWN_SOLVER)
    env = {**_env(), "PYTHONPATH": str(tmp_path)}
    out = fedhop(["run", "digits.toml", *[a for s in sets for a in ("--set", s)]], tmp_path, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.vectorized" in lines[0] and names in lines[0], out.stderr
    assert not any(p.is_dir() for p in tmp_path.iterdir() if p.name != "__pycache__")   # no run folder left behind
    out = fedhop(["run", "digits.toml", "--set", "algorithm.vectorized=false", "--set", "run.rounds=1", "--quiet",
                  *[a for s in sets for a in ("--set", s)]], tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]   # the same config one client at a time runs


def test_a_loss_that_draws_noise_is_refused_before_any_process(tmp_path):
    """The quadratic task with gradient noise draws from each client's generator: refused when the
    task is built, before `fedhop run` starts a process."""
    (tmp_path / "q.toml").write_text(
        '[run]\nrounds = 2\n[algorithm]\nname = "fedavg"\nlocal_steps = 1\nvectorized = true\n'
        '[data]\ndataset = "quadratic"\ndim = 5\nnoise = 0.1\n[clients]\ncount = 4\n')
    out = fedhop(["run", "q.toml"], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.vectorized" in lines[0] and "quadratic" in lines[0], out.stderr
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)


def test_an_in_memory_batch_is_shown_to_the_host_before_it_is_served():
    """The in-process engine without workers: `InMemoryEndpoint.pipelined` hands the batch's decoded
    requests to `before_batch` (the host's `prepare_batch`) before the first is served, and
    records nothing (each request's records come when it is served)."""
    from fedhop.common.wire.codec import encode, make_envelope
    from fedhop.common.wire.ledger import Ledger
    from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

    ledger = Ledger()
    ep = InMemoryEndpoint(InMemoryNetwork(), "client-proc0", ledger)
    seen: list[list[Request]] = []
    ep.before_batch = seen.append
    msgs = [encode(Payload(tensors={"w": torch.full((3,), float(i))}),
                   make_envelope(run_id="r", round=1, src="server", dst=f"client-{i}", method="train"))
            for i in range(3)]
    with ep.pipelined(msgs):
        pass
    assert [[r.envelope.dst for r in batch] for batch in seen] == [["client-0", "client-1", "client-2"]]
    assert all(torch.equal(r.payload.tensors["w"], torch.full((3,), float(i))) for i, r in enumerate(seen[0]))
    assert ledger.records() == []


def _in_memory_batch(before_batch: bool) -> tuple[list, list, int]:
    """A batch of five requests (one refused by its handler) through `InMemoryEndpoint.call_many`
    to a callee with or without a `before_batch`: the replies, both ledgers' records (without
    their seconds and wall time) and how many requests the callee decoded."""
    from fedhop.common.transport.base import Batched, HandlerError
    from fedhop.common.wire.ledger import Ledger
    from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

    network = InMemoryNetwork()
    callee = InMemoryEndpoint(network, "client-proc0", Ledger())
    caller = InMemoryEndpoint(network, "server", Ledger())
    taken = 0
    take = callee._take

    def counted(*args, **kwargs):
        nonlocal taken
        taken += 1
        return take(*args, **kwargs)

    callee._take = counted   # type: ignore[method-assign]
    seen: list[tuple[str, int]] = []

    def handler(request: Request) -> Payload:
        w = request.payload.tensors["w"]
        seen.append((request.envelope.dst, w.data_ptr()))
        if request.envelope.dst == "client-3":
            raise HandlerError("UNKNOWN_CLIENT", "client 3 is not hosted here")
        k = int(request.envelope.dst.split("-")[1])
        return Payload(tensors={"w": w * k}, scalars={"k": k})

    batches: list[list[tuple[str, int]]] = []
    if before_batch:
        callee.before_batch = lambda requests: batches.append(
            [(r.envelope.dst, r.payload.tensors["w"].data_ptr()) for r in requests])
    address = callee.serve(handler)
    w = torch.arange(40, dtype=torch.float32)
    batch = [Batched(f"client-{k}", "train", caller.prepare(Payload(tensors={"w": w[:8 * (k + 1)]}))) for k in range(5)]
    out = caller.call_many(address, batch, round=3, timeout=10)
    assert [dst for dst, _ in seen] == [f"client-{k}" for k in range(5)]
    if before_batch:   # the handler was given the very tensors `before_batch` saw
        assert batches == [seen]
    records = [[(r.src, r.dst, r.method, r.role, r.recorder, r.tensor_bytes, r.payload_bytes, r.framed_bytes,
                 r.status, r.error) for r in ep.ledger.records()] for ep in (caller, callee)]
    return out, records, taken


def test_an_in_memory_batch_shown_to_the_host_is_served_from_that_decoding():
    """`InMemoryEndpoint.pipelined` decodes a batch's requests for `before_batch`; each is then
    answered from that decoding, not decoded again: as many decodings as requests, the handler
    given the very tensors `before_batch` saw, and the same replies and ledger records (both
    ends, the refused request's included) as a callee without `before_batch`."""
    plain_out, plain_records, plain_taken = _in_memory_batch(before_batch=False)
    out, records, taken = _in_memory_batch(before_batch=True)
    assert plain_taken == 5 and taken == 5
    assert records == plain_records and len(records[0]) == len(records[1]) == 10
    for k, (a, b) in enumerate(zip(plain_out, out)):
        if k == 3:
            assert type(a) is type(b) and a.code == b.code == "UNKNOWN_CLIENT"
            continue
        assert torch.equal(a.tensors["w"], b.tensors["w"]) and a.scalars == b.scalars == {"k": k}


def test_frozen_parameters_are_used_and_left_as_they_are():
    """model.freeze: the frozen layer travels (model.exchange = "all") and takes part in the forward
    pass, its delta is exactly 0, and the trained layers match the one-at-a-time solver's."""
    freeze = {'[model]': '[model]\nfreeze = ["layers.0.*"]'}
    plain, vec = _engine(_digits_text(False, **freeze)), _engine(_digits_text(True, **freeze))
    items = _items(plain, 1)
    one = [local_update(plain.cfg, plain.task, plain.algorithm, plain.task.build_model(), *item) for item in items]
    together = local_updates(vec.cfg, vec.task, vec.algorithm, vec.task.build_model(), items)
    for a, b in zip(one, together):
        assert set(b.tensors) == set(a.tensors) and "layers.0.weight" in b.tensors
        assert not b.tensors["layers.0.weight"].any() and not b.tensors["layers.0.bias"].any()
        for name in a.tensors:
            assert torch.allclose(a.tensors[name], b.tensors[name], rtol=1e-4, atol=1e-6), name
    vec.run(2)
    assert torch.isfinite(vec.state.params["out.weight"]).all()


def test_a_gradient_laid_out_otherwise_is_copied_row_by_row_to_the_same_values():
    """`_laid_out_as`: a stacked weight gradient transposed in each row (as autograd gives a
    vmapped linear layer's) copied into the parameters' contiguous layout, the same values, so
    the step `p - g * lr` has the same bits either way."""
    from fedhop.common.algorithms.vectorized import ROW_COPY_MIN, _laid_out_as

    p = torch.randn(3, 300, 400)
    g = torch.randn(3, 400, 300).transpose(1, 2)
    assert g[0].numel() >= ROW_COPY_MIN and not g.is_contiguous()
    laid = _laid_out_as(g, p)
    assert laid.is_contiguous() and laid.stride() == p.stride() and torch.equal(laid, g)
    assert torch.equal(p - laid.mul_(0.05), p - g * 0.05)


@pytest.mark.parametrize("with_bias", [True, False])
def test_a_stacked_linear_layers_weight_gradient_is_each_clients_own_laid_out_as_the_weight(with_bias):
    """`stacked_linear` (common/models/dense.py `_StackedLinear`): the forward pass is
    `baddbmm`'s, bit for bit; each client's gradients are those of its own `F.linear` (float64,
    to rounding); the weight's comes laid out as the weight, so the step reads it without a copy;
    and a gradient not asked for is not made."""
    import torch.nn.functional as F

    from fedhop.common.models.dense import stacked_linear

    gen = torch.Generator().manual_seed(3)
    m, rows, n_in, n_out = 4, 7, 40, 30
    h = torch.randn(m, rows, n_in, dtype=torch.float64, generator=gen)
    w = torch.randn(m, n_out, n_in, dtype=torch.float64, generator=gen)
    b = torch.randn(m, n_out, dtype=torch.float64, generator=gen) if with_bias else None
    c = torch.randn(m, rows, n_out, dtype=torch.float64, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (h, w, *([b] if b is not None else []))]
    out = stacked_linear(leaves[0], leaves[1], leaves[2] if with_bias else None)
    expected = torch.bmm(h, w.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
    assert torch.equal(out.detach(), expected)
    grads = torch.autograd.grad((out.sin() * c).sum(), leaves)
    assert grads[1].shape == w.shape and grads[1].is_contiguous() and grads[1].stride() == w.stride()
    for i in range(m):   # client i alone, through F.linear
        own = [t[i].clone().requires_grad_(True) for t in (h, w, *([b] if b is not None else []))]
        alone = F.linear(own[0], own[1], own[2] if with_bias else None)
        assert torch.allclose(alone.detach(), out[i].detach(), rtol=1e-13, atol=1e-13)
        for mine, theirs in zip(torch.autograd.grad((alone.sin() * c[i]).sum(), own), grads):
            assert torch.allclose(mine, theirs[i], rtol=1e-12, atol=1e-12)
    only_w = leaves[1].detach().clone().requires_grad_(True)
    (g_w,) = torch.autograd.grad((stacked_linear(h, only_w, b).sin() * c).sum(), [only_w])
    assert torch.equal(g_w, grads[1])
