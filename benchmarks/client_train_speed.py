"""A client's round in fedhop against a bare PyTorch loop doing the same steps (issue 49, item 3).

fedhop's side is what a client process runs for a `train` call once the message is decoded:
`ClientHost.train` (client/host.py), that is the round engine's `local_update`: the client's
context and RNG stream, the global model copied into the process's model, FedAvg's local SGD
over the client's batches, and the reply (the update Delta = w_local - w_global, its weight
and train loss).  The bare loop is what a user writes in plain PyTorch for the same round:
`load_state_dict` of the global model, `torch.optim.SGD`, a `torch.randperm` of the client's
rows from the same seed, `F.cross_entropy` on each batch, the update as the difference.  Both
see the same model, data, batches and learning rate, so they end on the same parameters bit
for bit (checked on every pass; tests/test_client_train_speed.py checks it too).

Timing: `--pairs` passes over the `--sampled` clients of one round, fedhop and the bare loop
taking turns in this one process (the order flipped every pass); the printed ratio is the
median over the passes of fedhop / bare in the thread's CPU time (what other work on a shared
machine does not move), the wall-time ratio beside it.  Two workloads, issue 49's:

- W2 (the default): digits, 1,000 clients, 100 sampled, MLP 64-32-10, 1 epoch, batch 10, lr
  0.05: one or two rows a client, one step each, so fixed per-client costs dominate;
- W1 (`--workload W1`): the 1,000-parameter quadratic, 10 clients, all sampled, one full-batch
  step, lr 0.1 (a client's one row: its center and curvature).  The bare loop is W2's with the
  task's loss written out, 1/2 sum_j C_ij (w_j - A_ij)^2 (common/tasks/quadratic.py), in place
  of the cross-entropy.

    python benchmarks/client_train_speed.py [--workload W2] [--clients N] [--sampled N]
                                            [--batch N] [--epochs N] [--pairs 30] [--json FILE]

`--clients`, `--sampled`, `--batch` and `--epochs` default to the workload's (`--epochs` counts for
W2; W1 takes one local step).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fedhop.client.host import ClientHost
from fedhop.common.config import parse_config
from fedhop.common.util.rng import stream_seed
from fedhop.common.wire.message import Payload
from fedhop.deploy.bench.bench_peers import Workload, workloads

#: issue 49's W1 and W2 as `fedhop bench peers` defines them (deploy/bench/bench_peers.py)
WORKLOADS: dict[str, Workload] = {name: w for name, w in workloads(quick=False).items() if name in ("W1", "W2")}


def config_text(clients: int, sampled: int, batch: int, epochs: int, lr: float, seed: int,
                workload: str = "W2") -> str:
    """The workload's run config (`fedhop bench peers`'s) at the given sizes, for one round.
    `epochs` counts where the workload trains by epochs (W2); W1 takes its one local step."""
    w = dataclasses.replace(WORKLOADS[workload], clients=clients, per_round=sampled, batch_size=batch,
                            epochs=epochs, lr=lr)
    return w.config(rounds=1, seed=seed)


class Bare:
    """The plain PyTorch client: its own model (the same architecture), the same data tensors,
    an SGD optimizer made once and reused across clients (plain SGD keeps no state).  `loss`
    is the workload's: cross-entropy on the model's logits (W2) or the quadratic (W1)."""

    def __init__(self, host: ClientHost, lr: float, batch_size: int, epochs: int, seed: int, round: int,
                 workload: str = "W2") -> None:
        self.loss = self._quadratic if WORKLOADS[workload].kind == "quadratic" else self._cross_entropy
        self.model = host.task.build_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.batch_size, self.epochs = batch_size, epochs
        self.data = {cid: host.task.client_data(cid).tensors for cid in host.client_ids}
        # the same minibatch streams as fedhop's clients (common/engine/rounds.py client_generator):
        # the seeds are given here, as a user's script would hold them
        self.seeds = {cid: stream_seed(seed, "client", cid, "round", round) for cid in host.client_ids}

    def train(self, cid: int, global_params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.model.load_state_dict(global_params)
        x, y = self.data[cid]
        n = x.shape[0]
        bs = n if self.batch_size <= 0 else min(self.batch_size, n)
        g = torch.Generator()
        g.manual_seed(self.seeds[cid])
        for _ in range(self.epochs):
            perm = torch.randperm(n, generator=g)
            for start in range(0, n, bs):
                idx = perm[start:start + bs]
                self.optimizer.zero_grad()
                self.loss(x[idx], y[idx]).backward()
                self.optimizer.step()
        with torch.no_grad():
            return {name: p.detach() - global_params[name] for name, p in self.model.named_parameters()}

    def _cross_entropy(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y, reduction="none").mean()

    def _quadratic(self, centers: torch.Tensor, curvatures: torch.Tensor) -> torch.Tensor:
        """1/2 sum_j C_ij (w_j - A_ij)^2, the batch's mean (the model is the vector `w`)."""
        w = self.model.w
        return (0.5 * (curvatures * (w[None, :] - centers).pow(2)).sum(1)).mean()


def setup(clients: int, sampled: int, batch: int, epochs: int, lr: float = 0.05, seed: int = 0,
          round: int = 1, workload: str = "W2") -> tuple[ClientHost, Bare, Payload, list[int]]:
    """A client host holding the round's sampled clients, the bare client, the round's message."""
    from fedhop.common.engine.rounds import RoundEngine  # the server's side: the broadcast and the sample

    cfg = parse_config(config_text(clients, sampled, batch, epochs, lr, seed, workload))
    engine = RoundEngine(cfg)
    cids = sorted(engine.sample(round))
    message = engine.algorithm.broadcast(engine.state, round)
    message = Payload(tensors={k: v.clone() for k, v in message.tensors.items()}, scalars=dict(message.scalars))
    host = ClientHost(cfg, "client-proc0", cids, run_id="")
    return host, Bare(host, lr, batch, epochs, seed, round, workload), message, cids


def fedhop_pass(host: ClientHost, message: Payload, cids: list[int], round: int = 1) -> dict[int, Payload]:
    return {cid: host.train(cid, round, message) for cid in cids}


def bare_pass(bare: Bare, message: Payload, cids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    return {cid: bare.train(cid, message.tensors) for cid in cids}


def same_math(ours: dict[int, Payload], theirs: dict[int, dict[str, torch.Tensor]]) -> list[str]:
    """The tensors whose values differ between the two (empty: bit for bit the same)."""
    return [f"client {cid} {name}" for cid, reply in ours.items() for name, t in reply.tensors.items()
            if not torch.equal(t, theirs[cid][name])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W2")
    ap.add_argument("--clients", type=int)
    ap.add_argument("--sampled", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    w = WORKLOADS[args.workload]
    args.clients = w.clients if args.clients is None else args.clients
    args.sampled = w.per_round if args.sampled is None else args.sampled
    args.batch = w.batch_size if args.batch is None else args.batch
    args.epochs = w.epochs if args.epochs is None else args.epochs
    if args.pairs < 1 or args.sampled < 1 or args.clients < args.sampled or args.epochs < 1 or args.batch < 0:
        ap.error("--pairs, --sampled and --epochs must be >= 1, --batch >= 0 and --clients >= --sampled")
    torch.set_num_threads(1)   # as every fedhop process (run.torch_threads)
    host, bare, message, cids = setup(args.clients, args.sampled, args.batch, args.epochs, w.lr,
                                      workload=args.workload)
    ours, theirs = fedhop_pass(host, message, cids), bare_pass(bare, message, cids)   # warm-up, and the check
    differ = same_math(ours, theirs)
    if differ:
        print(f"client_train_speed: fedhop and the bare loop differ: {', '.join(differ[:5])}", file=sys.stderr)
        return 1
    ratios: list[float] = []
    wall_ratios: list[float] = []
    ours_s: list[tuple[float, float]] = []
    bare_s: list[tuple[float, float]] = []
    for i in range(args.pairs):
        timed = []
        for side in (("fedhop", "bare") if i % 2 == 0 else ("bare", "fedhop")):
            started, cpu = time.perf_counter(), time.thread_time()
            if side == "fedhop":
                fedhop_pass(host, message, cids)
            else:
                bare_pass(bare, message, cids)
            timed.append((side, (time.thread_time() - cpu, time.perf_counter() - started)))
        t = dict(timed)
        ours_s.append(t["fedhop"])
        bare_s.append(t["bare"])
        ratios.append(t["fedhop"][0] / t["bare"][0])
        wall_ratios.append(t["fedhop"][1] / t["bare"][1])
    load = os.getloadavg()
    steps = sum(int(r.scalars["local_steps"]) for r in ours.values())
    out = {"workload": args.workload, "clients": args.clients, "sampled": args.sampled, "batch": args.batch, "epochs": args.epochs,
           "steps": steps, "pairs": args.pairs,
           "fedhop_cpu_ms": 1e3 * statistics.median(c for c, _ in ours_s),
           "bare_cpu_ms": 1e3 * statistics.median(c for c, _ in bare_s),
           "fedhop_wall_ms": 1e3 * statistics.median(w for _, w in ours_s),
           "bare_wall_ms": 1e3 * statistics.median(w for _, w in bare_s),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "wall_ratio": statistics.median(wall_ratios), "load_average": load}
    print(f"{args.workload}: {args.sampled} clients of {args.clients}, {steps} local steps, batch {args.batch}, "
          f"{args.epochs} epoch(s); {args.pairs} interleaved pairs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"  fedhop ClientHost.train  {out['fedhop_cpu_ms']:8.2f} ms CPU, {out['fedhop_wall_ms']:8.2f} ms wall a round")
    print(f"  bare PyTorch loop        {out['bare_cpu_ms']:8.2f} ms CPU, {out['bare_wall_ms']:8.2f} ms wall a round")
    print(f"  ratio fedhop / bare (CPU time): {out['ratio']:.3f} (median of pairs; {out['ratio_min']:.3f}-"
          f"{out['ratio_max']:.3f}); wall time {out['wall_ratio']:.3f}; same parameters bit for bit: yes")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
