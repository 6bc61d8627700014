"""A plug-in algorithm written as a local solver (common/algorithms/solver.py `SolverAlgorithm`):
from a module in the user's folder, its clients train one at a time or together
([algorithm] vectorized) with no code of its own for the latter.

The plug-in here is SGD whose every step's gradient is clipped to a norm over the whole model, a
step that local SGD with a gradient hook cannot make row by row.  What must hold: together is
one at a time to rounding, bit for bit whichever clients are trained beside each other, and the
same model in both engines; the clipping is in effect (a run without it ends elsewhere).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine, local_update, local_updates
from fedhop.common.wire.message import COMPUTE_KEY
from tests.test_vectorized import _same_ways, engines_agree

PLUGIN = '''"""SGD whose every step's gradient is clipped to norm `clip` over the whole model."""
from dataclasses import dataclass

import torch

from fedhop.common.algorithms.base import AlgorithmParams, weighted_mean
from fedhop.common.algorithms.solver import SolverAlgorithm


@dataclass
class ClippedSGDParams(AlgorithmParams):
    clip: float = 1.0


class ClippedSGD(SolverAlgorithm):
    name = "clipped_sgd"
    Params = ClippedSGDParams

    def local_solver(self, ctx, message, steps):
        start = {n: t.detach().clone() for n, t in message.tensors.items()}
        w = dict(start)
        for _ in range(steps):
            g = yield w
            norm = float(torch.sqrt(sum((t * t).sum() for t in g.values())))
            scale = min(1.0, self.params.clip / max(norm, 1e-12))
            w = {n: w[n] - self.cfg.lr * scale * g[n] for n in w}
        return {n: w[n] - start[n] for n in w}

    def server_update(self, state, aggregate, round):
        for name, w in state.params.items():
            w.add_(weighted_mean(aggregate, name), alpha=self.cfg.server_lr)
'''

CONFIG = ('[run]\nseed = 4\nrounds = 3\neval_every = 3\n[algorithm]\nname = "clipsgd:ClippedSGD"\nclip = {clip}\n'
          'lr = 0.5\nbatch_size = 10\nlocal_epochs = 1\nweight_decay = 0.001\n'
          '[data]\ndataset = "crossdevice"\nbase = "digits"\nlabel_alpha = 0.5\nsizes = "lognormal"\nsize_mean = 3.0\n'
          'size_sigma = 1.0\n[model]\nkind = "mlp"\nhidden = [16]\n[clients]\ncount = 200\nper_round = 20\n'
          'processes = 2\n')


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> Path:
    (tmp_path / "clipsgd.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("clipsgd", None)


def _engine(clip: float, vectorized: bool) -> RoundEngine:
    return RoundEngine(parse_config(CONFIG.format(clip=clip).replace(
        "local_epochs = 1\n", f"local_epochs = 1\nvectorized = {'true' if vectorized else 'false'}\n")))


def test_a_plugin_solver_trains_together_as_one_at_a_time(plugin):
    """Round 2: every reply within float32 rounding of the one-at-a-time solver's (clients of
    several sizes, so several step counts), the same steps and weights; the replies the same
    bits whichever clients are trained together; three rounds' models the same to rounding and
    not those of a run whose clip never binds."""
    plain, vec = _engine(0.5, False), _engine(0.5, True)
    assert vec.algorithm.trains_together() and vec.algorithm.name == "clipped_sgd"
    plain.run(1)
    vec.run(1)
    sampled = plain.sample(2)
    _, own = plain.messages(2, sampled)
    items = [(cid, 2, own[cid], {}, 0) for cid in sampled]
    one = [local_update(plain.cfg, plain.task, plain.algorithm, plain.task.build_model(), *item) for item in items]
    together = local_updates(vec.cfg, vec.task, vec.algorithm, vec.task.build_model(), items)
    assert len({int(r.scalars["local_steps"]) for r in one}) > 1
    for a, b in zip(one, together):
        assert a.scalars["local_steps"] == b.scalars["local_steps"] and a.scalars["weight"] == b.scalars["weight"]
        assert b.scalars[COMPUTE_KEY] > 0
        for name, t in a.tensors.items():
            assert torch.allclose(t, b.tensors[name], rtol=1e-4, atol=1e-6), name
    _same_ways(vec, items, vec.task.build_model())
    plain, vec, unclipped = _engine(0.5, False), _engine(0.5, True), _engine(1e9, True)
    for engine in (plain, vec, unclipped):
        engine.run(3)
    for name, w in plain.state.params.items():
        assert torch.allclose(w, vec.state.params[name], rtol=1e-4, atol=1e-5), name
    assert max(float((w - unclipped.state.params[n]).abs().max()) for n, w in vec.state.params.items()) > 1e-3


def test_a_plugin_solver_from_the_users_folder_gives_one_model_in_both_engines(tmp_path):
    """`fedhop run` from the folder that holds the plug-in (on PYTHONPATH, as an installed
    package would be): vectorized in processes and in-process with two workers, the same model bit
    for bit and the same messages and bytes as the one-at-a-time run, whose model agrees to rounding."""
    (tmp_path / "clipsgd.py").write_text(PLUGIN)
    (tmp_path / "clip.toml").write_text(CONFIG.format(clip=0.5))
    env = {**{k: v for k, v in os.environ.items() if k != "FEDHOP_PLUGIN_PATH"}, "PYTHONPATH": str(tmp_path)}
    engines_agree(tmp_path, "clip.toml", env)
