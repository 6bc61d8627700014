"""SecAgg+ bytes per phase, per client and at the server: the formulas of
common/security/secagg/messages.py against the lengths of the messages a simulated round builds.

    python benchmarks/secagg_bytes.py [--d 1000] [--bits 32] [--n 10 50 100 200] [--drop 0]
        [--degrees complete log 8 16] [--plot docs/img/secagg_bytes.png]

For each n and each degree (`complete`: the complete graph, SecAgg; `log`: SecAgg+'s sparse graph of
degree k = 2 ceil(log2 n); an integer: that degree, skipped where it is n - 1 or more), with
threshold t = floor(k/2) + 1, runs the four rounds in one process (simulate.py: real X25519,
AES-GCM, Shamir, masks) with `--drop` clients dropping after sharing (masked-input phase), and
prints one Markdown row: the mean bytes per client per phase (request + reply), the per-client
total, the server's total, and the formula's server total, which must equal the measured one (the
script exits 1 otherwise).  With no dropouts the per-client total is 100 + 376 deg(u) + d
ceil(bits/8) bytes (docs/secure-aggregation.md).

`--plot PATH` draws, against n, the bytes per client of each phase, the per-client total and the
server's total: the measured points as markers over the formula evaluated at 40 values of n between the
smallest and the largest as lines, one colour per degree (log-log axes)."""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedhop.common.security.secagg import messages
from fedhop.common.security.secagg.graph import neighbours
from fedhop.common.security.secagg.messages import PHASES, Counts
from fedhop.common.security.secagg.params import SecAggParams
from fedhop.common.security.secagg.simulate import simulate_round


def degree_of(spec: str, n: int) -> int | None:
    """The neighbour degree `spec` names at n clients; None where an integer degree is not sparse at n."""
    if spec == "complete":
        return n - 1
    if spec == "log":
        return min(n - 1, 2 * math.ceil(math.log2(n)))
    k = int(spec)
    return k if k < n - 1 else None


def params_for(n: int, k: int, bits: int) -> SecAggParams:
    return SecAggParams(n=n, degree=k, threshold=k // 2 + 1 if k < n - 1 else (n - 1) // 2 + 1,
                        modulus_bits=bits, clip=1.0, quant_bits=min(16, bits - math.ceil(math.log2(n))), seed=1)


def formula_per_phase(params: SecAggParams, d: int, dropped: set[int]) -> dict[str, int]:
    """The server's bytes per phase (all requests and replies) from the formulas, dropouts in the masked phase."""
    g = neighbours(params.n, params.k, params.seed)
    everyone = set(range(params.n))
    survivors = everyone - dropped
    total = dict.fromkeys(PHASES, 0)
    for u in everyone:
        c = Counts(a=len(g[u]), b=len(g[u]), s=len(g[u] & survivors), r=len(g[u] & dropped))
        for phase in PHASES:
            asked = phase != "unmask" or u in survivors
            answered = asked and (phase not in ("masked", "unmask") or u in survivors)
            total[phase] += messages.request_bytes(phase, c) * asked
            total[phase] += messages.reply_bytes(phase, c, d, params.modulus_bits) * answered
    return total


def formula_server_total(params: SecAggParams, d: int, dropped: set[int]) -> int:
    """The server's bytes (all requests and replies) from the formulas, dropouts in the masked phase."""
    return sum(formula_per_phase(params, d, dropped).values())


@dataclass
class Measured:
    """One simulated round: the server's bytes per phase as built, and as the formulas give them."""

    params: SecAggParams
    per_phase: dict[str, int]
    formula: dict[str, int]
    seconds: float

    @property
    def total(self) -> int:
        return sum(self.per_phase.values())


def measure(n: int, k: int, d: int, bits: int, drop: int) -> Measured:
    params = params_for(n, k, bits)
    rng = np.random.default_rng(0)
    updates = {u: rng.normal(scale=0.01, size=d) for u in range(n)}
    dropped = set(range(drop))
    start = time.perf_counter()
    sim = simulate_round(params, updates, {"masked": dropped})
    seconds = time.perf_counter() - start
    per_phase = {p: sum(sim.down[p].values()) + sum(sim.up[p].values()) for p in PHASES}
    return Measured(params, per_phase, formula_per_phase(params, d, dropped), seconds)


def row(m: Measured) -> str:
    n, formula = m.params.n, sum(m.formula.values())
    cells = [str(n), "complete" if m.params.complete else str(m.params.k), str(m.params.threshold),
             *(f"{m.per_phase[p] / n:,.0f}" for p in PHASES), f"{m.total / n:,.0f}", f"{m.total:,}", f"{formula:,}",
             f"{m.seconds:.1f}"]
    return "| " + " | ".join(cells) + " |"


def plot(results: dict[str, list[Measured]], d: int, bits: int, drop: int, path: Path) -> None:
    """Six panels against n: each phase per client, the per-client total, the server total."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [*PHASES, "per client", "server"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 7.5))
    for i, (spec, points) in enumerate(results.items()):
        color = f"C{i}"
        label = "complete graph (SecAgg)" if spec == "complete" else \
            ("k = 2 ceil(log2 n)" if spec == "log" else f"k = {spec}")
        ns = sorted({m.params.n for m in points})
        grid = sorted({*np.geomspace(ns[0], ns[-1], 40).round().astype(int).tolist(), *ns})
        dense = [(n, k) for n in grid if (k := degree_of(spec, n)) is not None]
        lines = [(n, formula_per_phase(params_for(n, k, bits), d, set(range(drop)))) for n, k in dense]
        for ax, panel in zip(axes.flat, panels):
            def value(per_phase: dict[str, int], n: int) -> float:
                total = sum(per_phase.values()) if panel in ("per client", "server") else per_phase[panel]
                return total if panel == "server" else total / n
            ax.plot([n for n, _ in lines], [value(f, n) for n, f in lines], color=color, linewidth=1,
                    label=f"{label}: formula")
            ax.plot([m.params.n for m in points], [value(m.per_phase, m.params.n) for m in points], "o",
                    color=color, label=f"{label}: measured")
    for ax, panel in zip(axes.flat, panels):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients n")
        ax.set_ylabel("bytes at the server (round)" if panel == "server" else "bytes per client (mean)")
        ax.set_title(panel if panel in ("per client", "server") else f"{panel} (request + reply)")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"SecAgg+ bytes per round: measured messages (markers) over the byte formulas (lines); "
                 f"d = {d}, R = 2^{bits}, {drop} dropout(s)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=1000, help="model parameters")
    parser.add_argument("--bits", type=int, default=32, help="modulus bits: R = 2^bits")
    parser.add_argument("--n", type=int, nargs="+", default=[10, 50, 100, 200], help="clients per round")
    parser.add_argument("--drop", type=int, default=0, help="clients that drop after sharing")
    parser.add_argument("--degrees", nargs="+", default=["complete", "log"],
                        help="complete | log (2 ceil(log2 n)) | an integer degree")
    parser.add_argument("--plot", default="", help="write the plot of bytes against n to this PNG")
    args = parser.parse_args(argv)
    for spec in args.degrees:
        if spec not in ("complete", "log") and not (spec.isdigit() and int(spec) >= 2):
            print(f"secagg_bytes: --degrees {spec}: expected complete, log or an integer >= 2", file=sys.stderr)
            return 2
    print(f"d = {args.d}, R = 2^{args.bits}, {args.drop} dropout(s) in the masked-input phase; bytes per client are "
          "means over the round's clients (request + reply)\n")
    print("| n | degree | t | advertise | share | masked | unmask | per client | server (measured) | "
          "server (formula) | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    results: dict[str, list[Measured]] = {spec: [] for spec in args.degrees}
    for n in args.n:
        for spec in args.degrees:
            k = degree_of(spec, n)
            if k is None:
                continue
            m = measure(n, k, args.d, args.bits, args.drop)
            results[spec].append(m)
            ok &= m.per_phase == m.formula
            print(row(m), flush=True)
    if args.plot:
        plot({s: r for s, r in results.items() if r}, args.d, args.bits, args.drop, Path(args.plot))
        print(f"\nwrote {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
