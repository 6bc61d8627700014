"""The same clients' work in two orders (issue 49, item 2): each client's message handled whole
before the next client's (interleaved, as an engine serves a batch today), or each step done for
every client of the round before the next step (phased).

Inside `fedhop run --engine inprocess` a W1 client's `local_update` takes about twice as long as the
same call in the round engine's loop (deploy/bench/engine_loop.py), on the same inputs: between
two clients' training the engine runs its codec, records and checks, and the training then starts
on cold caches.  This benchmark isolates that effect with fedhop's own code and no engine: per
round, every sampled client's request is encoded and decoded (common/wire/codec.py), trained
(`local_update`) and its reply encoded and decoded, in one of three orders:

- interleaved: client by client, all four steps;
- phased: every request, then every client's training, then every reply;
- train+encode: every request, then each client's training with its reply encoded right after it
  (an engine must encode a reply before the next client trains: the reply may share memory with
  the model, client/host.py `_hand_over_fresh`), then every reply decoded.

It prints each order's median `local_update` time (the solver's own `compute_seconds`) and its
time a round, and checks that the three orders give the same replies bit for bit.

    python benchmarks/phase_locality.py [--workload W1|W2] [--rounds 300] [--repeats 3]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time

import torch

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine, local_update
from fedhop.common.util.nodeids import client_node
from fedhop.common.wire.codec import decode_frames, encode, make_envelope
from fedhop.common.wire.message import COMPUTE_KEY, Payload
from fedhop.deploy.bench.bench_peers import workloads

ORDERS = ("interleaved", "phased", "train+encode")


def _wire(payload: Payload, rnd: int, src: str, dst: str, method: str) -> Payload:
    """`payload` encoded and decoded as a message between two processes."""
    env = make_envelope(run_id="phase-locality", round=rnd, src=src, dst=dst, method=method)
    return decode_frames(encode(payload, env).frames).payload


def _reply_digest(reply: Payload) -> bytes:
    digest = hashlib.sha256()
    for name in sorted(reply.tensors):
        digest.update(name.encode() + reply.tensors[name].contiguous().numpy().tobytes())
    return digest.digest()


def play(order: str, config_text: str, rounds: int) -> tuple[float, float, bytes]:
    """(median local_update seconds, seconds a round, a digest of every reply) for one order."""
    cfg = parse_config(config_text)
    engine = RoundEngine(cfg)
    model = engine.task.build_model()   # the client host's own model
    updates: list[float] = []
    digest = hashlib.sha256()
    spent = 0.0

    def train(cid: int, rnd: int, message: Payload) -> Payload:
        reply = local_update(cfg, engine.task, engine.algorithm, model, cid, rnd, message, {})
        updates.append(float(reply.scalars[COMPUTE_KEY]))
        return reply

    for rnd in range(1, rounds + 1):
        sampled = engine.sample(rnd)
        _, own = engine.messages(rnd, sampled)
        started = time.perf_counter()
        replies: dict[int, Payload] = {}
        if order == "interleaved":
            for cid in sampled:
                message = _wire(own[cid], rnd, "server", client_node(cid), "train")
                replies[cid] = _wire(train(cid, rnd, message), rnd, client_node(cid), "server", "train.reply")
        elif order == "phased":
            messages = {cid: _wire(own[cid], rnd, "server", client_node(cid), "train") for cid in sampled}
            trained = {cid: train(cid, rnd, messages[cid]) for cid in sampled}
            replies = {cid: _wire(trained[cid], rnd, client_node(cid), "server", "train.reply") for cid in sampled}
        else:   # train+encode
            messages = {cid: _wire(own[cid], rnd, "server", client_node(cid), "train") for cid in sampled}
            encoded = {}
            for cid in sampled:
                env = make_envelope(run_id="phase-locality", round=rnd, src=client_node(cid), dst="server",
                                    method="train.reply")
                encoded[cid] = encode(train(cid, rnd, messages[cid]), env)
            replies = {cid: decode_frames(encoded[cid].frames).payload for cid in sampled}
        spent += time.perf_counter() - started
        for cid in sampled:
            digest.update(_reply_digest(replies[cid]))
        engine.finish_round(rnd, {cid: engine.accept(rnd, f"client {cid}", replies[cid]) for cid in sampled}, sampled)
    return statistics.median(updates), spent / rounds, digest.digest()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W1", choices=("W1", "W2"), help="issue 49's workload (fedhop bench peers)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each order, taking turns")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be >= 1")
    torch.set_num_threads(1)
    w = workloads(False)[args.workload]
    text = w.config(args.rounds, 0)
    figures: dict[str, list[tuple[float, float]]] = {o: [] for o in ORDERS}
    digests = set()
    for rep in range(args.repeats):
        for order in ORDERS[rep % len(ORDERS):] + ORDERS[:rep % len(ORDERS)]:
            update, per_round, digest = play(order, text, args.rounds)
            figures[order].append((update, per_round))
            digests.add(digest)
    print(f"{args.workload}: {w.title}; {args.rounds} rounds, {args.repeats} repeat(s) of each order, medians")
    base = statistics.median(r for _, r in figures["interleaved"])
    for order in ORDERS:
        update = statistics.median(u for u, _ in figures[order])
        per_round = statistics.median(r for _, r in figures[order])
        print(f"  {order:<13} local_update {update * 1e6:8.1f} us   a round {per_round * 1e3:8.3f} ms   "
              f"interleaved / this {base / per_round:.2f}")
    same = len(digests) == 1
    print("  replies: " + ("the same bits in every order" if same else "DIFFER between the orders"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
