"""What one small message costs on its way through a fedhop process (issue 49: the per-sampled-
client work that bounds a cross-device round).

A W2 reply (the update of MLP 64-32-10 on digits: six float32 tensors, 6,570 values, with its
weight and loss) goes through the steps every served call makes: `make_envelope`, `encode`,
`decode_frames`, the broadcast's finiteness check on the client (`finite_or_raise`), the
reply's validation on the server (`validate_reply`), its fold into the round's sum
(`ReplyAccumulator.add_if_finite`) and one ledger record written to its JSONL file
(`Ledger.record`).  Each step is timed over `--repeat` calls in this one process and printed
in microseconds a call (median of `--passes` passes).  A round of W2 makes, per sampled client,
one envelope, one encode and one decode on each side, one finiteness check, one validation, one
fold and four ledger records.

The fold is checked on every run: folding the decoded replies (each through its flat view,
common/wire/message.py `FlatView`) gives the bits of folding the same replies as built
(tensor by tensor); a difference is an error (exit 1).

    python benchmarks/message_path_speed.py [--repeat 2000] [--passes 5] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from fedhop.common.processors.validation import validate_reply
from fedhop.common.wire.codec import decode_frames, encode, make_envelope
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload, ReplyAccumulator, finite_or_raise

#: W2's model, MLP 64-32-10 (common/models/dense.py): weights and biases in order
W2_SHAPES = {"net.0.weight": (32, 64), "net.0.bias": (32,), "net.2.weight": (32, 32), "net.2.bias": (32,),
             "net.4.weight": (10, 32), "net.4.bias": (10,)}


def w2_reply(seed: int) -> Payload:
    gen = torch.Generator().manual_seed(seed)
    return Payload(tensors={name: torch.randn(shape, generator=gen) * 0.01 for name, shape in W2_SHAPES.items()},
                   scalars={"weight": float(1 + seed % 2), "client_train_loss": 2.3})


def fold(replies: list[Payload]) -> Payload:
    acc = ReplyAccumulator({})
    for r in replies:
        if acc.add_if_finite(r) is not None:
            raise RuntimeError("a W2 reply was refused by the fold")
    return acc.result()


def same_fold(built: list[Payload], decoded: list[Payload]) -> list[str]:
    """The tensors whose folded sums differ between the decoded and the built replies."""
    a, b = fold(built), fold(decoded)
    return [name for name in W2_SHAPES if not torch.equal(a.tensors[name], b.tensors[name])]


def per_call_us(step: Callable[[], object], repeat: int) -> float:
    step()
    started = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - started) / repeat * 1e6


def steps(folder: Path) -> dict[str, Callable[[], object]]:
    """The timed steps, each a closure over one W2 reply."""
    reply = w2_reply(0)
    env = lambda: make_envelope(run_id="bench", round=1, src="client-1", dst="server", method="train")  # noqa: E731
    frames = list(encode(reply, env()).frames)
    decoded = decode_frames(frames).payload
    spec = {name: (torch.float32, shape) for name, shape in W2_SHAPES.items()}
    ledger = Ledger(folder / "ledger.jsonl")
    acc = ReplyAccumulator({})

    def record() -> object:
        return ledger.record(run_id="bench", round=1, step=0, src="client-1", dst="server", link="client-server",
                             direction="up", method="train.reply", tensor_bytes=26280, payload_bytes=26500,
                             framed_bytes=26510, seconds=0.001, recorder="server", role="receiver",
                             msg_id="0123456789abcdef0123456789abcdef.reply", status="ok", error="")

    return {"make_envelope": env,
            "encode": lambda: encode(reply, env()),
            "decode": lambda: decode_frames(frames),
            "finite_or_raise (decoded)": lambda: finite_or_raise(decoded, "bench"),
            "validate_reply (decoded)": lambda: validate_reply(decoded, spec, "bench"),
            "fold add_if_finite (decoded)": lambda: acc.add_if_finite(decoded),
            "ledger record (JSONL)": record}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2000, help="calls of each step in a pass")
    ap.add_argument("--passes", type=int, default=5, help="passes; the median is printed")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    if args.repeat < 1 or args.passes < 1:
        ap.error("--repeat and --passes must be >= 1")
    torch.set_num_threads(1)   # as every fedhop process (run.torch_threads)
    built = [w2_reply(k) for k in range(8)]
    decoded = [decode_frames(encode(r, make_envelope(run_id="b", round=1, src="a", dst="b", method="train")).frames).payload
               for r in built]
    differ = same_fold(built, decoded)
    if differ:
        print(f"message_path_speed: the decoded replies fold to other bits: {', '.join(differ)}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as folder:
        timed = steps(Path(folder))
        passes: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(args.passes):
            for name, step in timed.items():
                passes[name].append(per_call_us(step, args.repeat))
    figures = {name: statistics.median(v) for name, v in passes.items()}
    print(f"message_path_speed: a W2 reply (6 float32 tensors, 6,570 values), median of {args.passes} passes "
          f"of {args.repeat} calls; the fold of decoded replies equals the fold of the built ones bit for bit")
    for name, us in figures.items():
        print(f"  {name:32s} {us:8.1f} us")
    per_client = (2 * figures["make_envelope"] + 2 * figures["encode"] + 2 * figures["decode"]
                  + figures["finite_or_raise (decoded)"] + figures["validate_reply (decoded)"]
                  + figures["fold add_if_finite (decoded)"] + 4 * figures["ledger record (JSONL)"])
    print(f"  per sampled client (both sides)  {per_client:8.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"us_per_call": figures, "per_client_us": per_client,
                                               "repeat": args.repeat, "passes": args.passes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
