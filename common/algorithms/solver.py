"""An algorithm whose client loop is a generator of local steps (`SolverAlgorithm`): written once,
trained one client at a time or many at once ([algorithm] vectorized, docs/vectorized.md).

`local_solver(ctx, message, steps)` is the client's round of `steps` local steps. It yields the
point w_k of each step (every model parameter by name, in the dtype the solver keeps its state
in) and is sent the minibatch gradient there: the task's loss on the client's next minibatch,
differentiated at w_k cast to the model's dtype, cast back to w_k's dtype, with
`weight_decay * w_k` added. It returns the tensors of its reply.

- One at a time (`client_update`), the gradient is taken on the process's model, each minibatch
  drawn from the client's generator as the step comes (`gradient`, `solve_alone`).
- Vectorized (`client_updates`), the solvers of a call's clients run side by side and each
  step's gradients come from one stacked computation (common/algorithms/vectorized.py
  `solve_together`), on the same minibatches. Each solver's own updates run for its client
  alone, so a client's result does not depend on the clients beside it.

The composite solvers (common/algorithms/composite.py) are written this way, and so may a
plug-in's (docs/plugins.md, "An algorithm").
"""
from __future__ import annotations

from typing import Iterator

import torch

from fedhop.common.algorithms.base import Algorithm, ClientContext, Payload
from fedhop.common.algorithms.local import LocalStats, set_params
from fedhop.common.algorithms.vectorized import Solver, Tensors, solve_alone, solve_together
from fedhop.common.numerics.sampling import batch_count, local_batches
from fedhop.common.wire.message import COMPUTE_KEY


class SolverAlgorithm(Algorithm):
    """An algorithm whose client step is `local_solver` (module docstring)."""

    def local_solver(self, ctx: ClientContext, message: Payload, steps: int) -> Solver:
        """The client's round of `steps` local steps: yields each step's point, is sent the
        gradient there (`gradient`), returns the reply's tensors."""
        raise NotImplementedError(f"algorithm '{self.name}' defines no local_solver")

    def reply(self, ctx: ClientContext, tensors: Tensors, stats: LocalStats) -> Payload:
        """The reply of a client whose solver returned `tensors` (a subclass may cast them for the wire)."""
        return Payload(tensors=tensors, scalars={"weight": self.client_weight(ctx), "train_loss": stats.mean_loss,
                                                 "local_steps": stats.steps})

    def check_steps(self, ctx: ClientContext) -> None:
        """A ValueError where the client was given a number of local steps the algorithm cannot take."""

    def batches(self, ctx: ClientContext) -> Iterator[tuple[torch.Tensor, ...]]:
        """This round's minibatches (without replacement within a pass, as `local_sgd`)."""
        self.check_steps(ctx)
        data = ctx.task.client_data(ctx.client_id)
        for idx in local_batches(data.rows, self.cfg.batch_size, ctx.local_steps, ctx.local_epochs, ctx.generator):
            yield tuple(t[idx] for t in data.tensors)

    def gradient(self, ctx: ClientContext, w: Tensors, batch: tuple[torch.Tensor, ...],
                 stats: LocalStats) -> Tensors:
        """The minibatch gradient of the task loss at w (in w's dtype), plus weight_decay * w."""
        set_params(ctx.model, w)
        ctx.model.zero_grad(set_to_none=True)
        loss = ctx.task.loss(ctx.model, batch, ctx.generator)
        loss.backward()
        wd = float(getattr(self.cfg, "weight_decay", 0.0) or 0.0)
        grads = {}
        for name, p in ctx.model.named_parameters():
            dtype = w[name].dtype
            g = p.grad.detach().to(dtype) if p.grad is not None else torch.zeros(p.shape, dtype=dtype, device=p.device)
            grads[name] = g + wd * w[name] if wd else g
        stats.steps += 1
        stats.loss_sum += float(loss.detach())
        return grads

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        """The local solver on the process's model, its minibatches drawn as it goes."""
        self.check_steps(ctx)
        stats = LocalStats()
        batches = self.batches(ctx)
        steps = batch_count(ctx.task.client_data(ctx.client_id).rows, self.cfg.batch_size, ctx.local_steps,
                            ctx.local_epochs)
        out = solve_alone(self.local_solver(ctx, message, steps),
                          lambda w: self.gradient(ctx, w, next(batches), stats))
        return self.reply(ctx, out, stats)

    @classmethod
    def trains_together(cls) -> bool:
        """A solver written as `local_solver`: its gradients computed in a stack (`client_updates`);
        a subclass with a `client_update` of its own does not."""
        return (cls.local_solver is not SolverAlgorithm.local_solver
                and cls.client_update is SolverAlgorithm.client_update)

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client, the solvers side by side and each step's gradients
        computed together (common/algorithms/vectorized.py `solve_together`)."""
        for ctx in ctxs:
            self.check_steps(ctx)
        wd = float(getattr(self.cfg, "weight_decay", 0.0) or 0.0)
        outs, stats, seconds = solve_together(
            ctxs, lambda i, steps: self.local_solver(ctxs[i], messages[i], steps), self.cfg.batch_size, wd)
        replies = [self.reply(ctx, out, s) for ctx, out, s in zip(ctxs, outs, stats)]
        for reply, share in zip(replies, seconds):
            reply.scalars[COMPUTE_KEY] = share
        return replies
