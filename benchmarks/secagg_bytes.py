"""SecAgg+ bytes per phase, per client and at the server: the formulas of
common/security/secagg/messages.py against the lengths of the messages a simulated round builds.

    python benchmarks/secagg_bytes.py [--d 1000] [--bits 32] [--n 10 50 100 200] [--drop 0]

For each n and two degrees (the complete graph, SecAgg; and SecAgg+'s sparse graph of degree
k = 2 ceil(log2 n)), with threshold t = floor(k/2) + 1, runs the four rounds in one process
(simulate.py: real X25519, AES-GCM, Shamir, masks) with `--drop` clients dropping after sharing
(masked-input phase), and prints one Markdown row: the mean bytes per client per phase (request +
reply), the per-client total, the server's total, and the formula's server total, which must equal
the measured one (the script exits 1 otherwise).  With no dropouts the per-client total is
100 + 376 deg(u) + d ceil(bits/8) bytes (docs/secure-aggregation.md)."""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from fedhop.common.security.secagg import messages
from fedhop.common.security.secagg.graph import neighbours
from fedhop.common.security.secagg.messages import PHASES, Counts
from fedhop.common.security.secagg.params import SecAggParams
from fedhop.common.security.secagg.simulate import simulate_round


def formula_server_total(params: SecAggParams, d: int, dropped: set[int]) -> int:
    """The server's bytes (all requests and replies) from the formulas, dropouts in the masked phase."""
    g = neighbours(params.n, params.k, params.seed)
    everyone = set(range(params.n))
    survivors = everyone - dropped
    total = 0
    for u in everyone:
        c = Counts(a=len(g[u]), b=len(g[u]), s=len(g[u] & survivors), r=len(g[u] & dropped))
        for phase in PHASES:
            asked = phase != "unmask" or u in survivors
            answered = asked and (phase not in ("masked", "unmask") or u in survivors)
            total += messages.request_bytes(phase, c) * asked
            total += messages.reply_bytes(phase, c, d, params.modulus_bits) * answered
    return total


def row(n: int, k: int, d: int, bits: int, drop: int) -> tuple[str, bool]:
    params = SecAggParams(n=n, degree=k, threshold=k // 2 + 1 if k < n - 1 else (n - 1) // 2 + 1,
                          modulus_bits=bits, clip=1.0, quant_bits=min(16, bits - math.ceil(math.log2(n))), seed=1)
    rng = np.random.default_rng(0)
    updates = {u: rng.normal(scale=0.01, size=d) for u in range(n)}
    dropped = set(range(drop))
    start = time.perf_counter()
    sim = simulate_round(params, updates, {"masked": dropped})
    seconds = time.perf_counter() - start
    per_phase = [sum(sim.down[p].values()) + sum(sim.up[p].values()) for p in PHASES]
    measured = sum(per_phase)
    formula = formula_server_total(params, d, dropped)
    cells = [str(n), "complete" if params.complete else str(params.k), str(params.threshold),
             *(f"{v / n:,.0f}" for v in per_phase), f"{measured / n:,.0f}", f"{measured:,}", f"{formula:,}",
             f"{seconds:.1f}"]
    return "| " + " | ".join(cells) + " |", measured == formula


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=1000, help="model parameters")
    parser.add_argument("--bits", type=int, default=32, help="modulus bits: R = 2^bits")
    parser.add_argument("--n", type=int, nargs="+", default=[10, 50, 100, 200], help="clients per round")
    parser.add_argument("--drop", type=int, default=0, help="clients that drop after sharing")
    args = parser.parse_args(argv)
    print(f"d = {args.d}, R = 2^{args.bits}, {args.drop} dropout(s) in the masked-input phase; bytes per client are "
          "means over the round's clients (request + reply)\n")
    print("| n | degree | t | advertise | share | masked | unmask | per client | server (measured) | "
          "server (formula) | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for n in args.n:
        for k in (n - 1, 2 * math.ceil(math.log2(n))):
            line, equal = row(n, k, args.d, args.bits, args.drop)
            ok &= equal
            print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
