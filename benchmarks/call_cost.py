"""What one small call costs, and what one reply's inbound pipeline costs (README, Performance).

    python benchmarks/call_cost.py [--calls 3000] [--json OUT]

1. Calls: a served client process (its own OS process, on loopback) answers `--calls` sequential
   `train` calls of a 610-parameter model with its tensors and two scalars; the caller prints the
   wall time and its own CPU per call, and the served process's CPU per call.  It runs twice in
   the same run, with the reply read in the calling thread (fedhop's channels: grpcio's
   SingleThreadedUnaryStream option) and with grpcio's default (a channel spin thread per call on
   an idle channel), so the ratio is measured on the same machine state.
2. Reply pipeline: a digits-MLP reply through `reply_chain` (decompression, validation by form
   and meaning, limits), microseconds per reply, beside `torch.isfinite` against fedhop's
   `tensor_finite` on the same tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]


def serve() -> None:
    """The served process: echo the request's tensors with a weight and a loss."""
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.transport.grpc import GrpcEndpoint
    from fedhop.common.wire.ledger import Ledger
    endpoint = GrpcEndpoint("client-proc0", Ledger())
    address = endpoint.serve(lambda request: Payload(tensors=dict(request.payload.tensors),
                                                     scalars={"weight": 3.0, "train_loss": 0.5}), "127.0.0.1:0")
    print(address, flush=True)
    sys.stdin.read()
    endpoint.stop()


def calls(n: int, single_threaded: bool) -> dict:
    """`n` sequential calls to a fresh served process; per-call wall, caller CPU, served CPU."""
    import fedhop.common.transport.grpc as fedhop_grpc
    from fedhop.common.algorithms.base import Payload
    from fedhop.common.wire.ledger import Ledger
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    address = child.stdout.readline().strip()
    options = fedhop_grpc.CALL_OPTIONS
    if not single_threaded:   # grpcio's default
        fedhop_grpc.CALL_OPTIONS = []
    try:
        endpoint = fedhop_grpc.GrpcEndpoint("server", Ledger())
        prepared = endpoint.prepare(Payload(tensors={"w": torch.randn(10, 60), "b": torch.randn(10)}))
        for i in range(min(200, n)):   # connect and warm up
            endpoint.call(address, f"client-{i}", "train", round=1, timeout=30, prepared=prepared)
        served = psutil.Process(child.pid).cpu_times()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for i in range(n):
            endpoint.call(address, f"client-{i}", "train", round=1, timeout=30, prepared=prepared)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        after = psutil.Process(child.pid).cpu_times()
        endpoint.stop()
    finally:
        fedhop_grpc.CALL_OPTIONS = options
        child.stdin.close()
        child.wait(30)
    served_cpu = (after.user + after.system) - (served.user + served.system)
    return {"calls": n, "wall_ms": 1e3 * wall / n, "caller_cpu_ms": 1e3 * cpu / n, "served_cpu_ms": 1e3 * served_cpu / n}


def reply_pipeline(repeats: int) -> dict:
    """Microseconds per reply through the inbound pipeline of the digits example's model."""
    import numpy as np

    from fedhop.common.algorithms import build_algorithm
    from fedhop.common.algorithms.base import Payload, tensor_finite
    from fedhop.common.algorithms.local import get_params
    from fedhop.common.config import load_config
    from fedhop.common.processors.pipeline import reply_chain
    from fedhop.common.processors.validation import ReplyLimiter
    from fedhop.common.tasks import build_task
    cfg = load_config(str(ROOT / "examples" / "fedavg_digits.toml"), [])
    algorithm, task = build_algorithm(cfg), build_task(cfg)
    state = algorithm.init_state(get_params(task.build_model()))
    spec = algorithm.reply_spec(state)
    reply = Payload(tensors={k: torch.randn(shape).to(dtype) for k, (dtype, shape) in spec.items()},
                    scalars={"weight": 10.0, "train_loss": 0.5, "compute_seconds": 0.01})
    limiter = ReplyLimiter(algorithm, task, 60.0)
    pipeline = reply_chain(cfg, spec, "train", algorithm.reply_scalars(), limiter.limits([1]))

    def per_call(fn) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e6 * (time.perf_counter() - started) / repeats

    tensors = list(reply.tensors.values())
    out = {"tensors": len(tensors), "parameters": int(sum(t.numel() for t in tensors)),
           "pipeline_us": per_call(lambda: pipeline(reply, "a reply")),
           "torch_isfinite_us": per_call(lambda: [bool(torch.isfinite(t).all()) for t in tensors]),
           "tensor_finite_us": per_call(lambda: [tensor_finite(t) for t in tensors])}
    assert all(tensor_finite(t) == bool(np.isfinite(t.numpy()).all()) for t in tensors)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="sequential calls per variant (at least 1)")
    ap.add_argument("--repeats", type=int, default=5000, help="replies through the pipeline (at least 1)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from fedhop.common.util.cliparser import figures_file_problem
    if problem := figures_file_problem(args.json):
        ap.error(problem)
    if args.serve:
        serve()
        return 0
    if args.calls < 1 or args.repeats < 1:
        ap.error("--calls and --repeats must be at least 1")
    out = {"load_average": os.getloadavg()[0],
           "single_threaded": calls(args.calls, True), "spin_thread": calls(args.calls, False),
           "reply_pipeline": reply_pipeline(args.repeats)}
    st, spin = out["single_threaded"], out["spin_thread"]
    print(f"small calls ({args.calls} sequential, load average {out['load_average']:.1f}):")
    for name, row in (("reply read in the calling thread (fedhop)", st), ("grpcio default, spin thread", spin)):
        print(f"  {name:42s} wall {row['wall_ms']:.3f} ms  caller CPU {row['caller_cpu_ms']:.3f} ms  "
              f"served CPU {row['served_cpu_ms']:.3f} ms")
    print(f"  ratio fedhop / default: wall {st['wall_ms'] / spin['wall_ms']:.2f}, caller CPU "
          f"{st['caller_cpu_ms'] / spin['caller_cpu_ms']:.2f}")
    rp = out["reply_pipeline"]
    print(f"reply pipeline ({rp['tensors']} tensors, {rp['parameters']} parameters): {rp['pipeline_us']:.1f} us a reply; "
          f"finiteness {rp['tensor_finite_us']:.1f} us (torch.isfinite {rp['torch_isfinite_us']:.1f} us)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
