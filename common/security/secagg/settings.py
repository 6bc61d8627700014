"""The `[secure_aggregation]` section's rules and the round's parameters from it.

Secure aggregation needs a round whose replies are summed and nothing else: a topology whose spec
declares the four phases' methods (the star's, the hierarchical one's), a transport that moves tensors inside its calls
(style "fanout": grpc, inmemory), a FedAvg-family algorithm (its reply is a parameter delta and
the server step reads only the weighted mean), uniform weighting (every weight is 1, so the sum of
the weights is the number of clients unmasked and no weight has to travel), the plain mean (a
robust rule needs every update), and an upload compressor only where its integer code decodes by
one affine map shared by every client (codes.py: `rounding`, `qsgd` with bucket = 0, `sign`; the
code is computed in the masked-input phase, in place of SecAgg+'s own quantization; on the star).
Behind edges each edge runs the protocol for its cluster, so the parameters are checked against
the smallest cluster's clients per round.  The config is read duck-typed: this layer sits below
the config schema."""
from __future__ import annotations

from typing import Any

from .codes import GRID, SIGN
from .messages import PHASES
from .params import SecAggParams

DROPOUT_ACTIONS = ("refuse", "exit")

#: the algorithms whose reply is a summable delta with the default weighted-sum aggregation
SUMMABLE = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
ADVERTISE = "secagg_advertise"   # the first phase's method: a topology serves secure aggregation when it declares it


#: the upload compressors whose integer codes SecAgg+ sums (codes.py), and what each needs
CODED = {"rounding": "its range shared: [-clip, clip]", "qsgd": "bucket = 0, the norm scale shared: clip",
         "sign": ""}


def params_of(section: Any, n: int, seed: int, compression: Any = None) -> SecAggParams:
    """The round's parameters for `n` sampled clients (threshold 0 = floor(k / 2) + 1); with
    `compression` (the config's section) the code of its upload compressor (`code_of`)."""
    k = n - 1 if section.degree <= 0 or section.degree >= n - 1 else int(section.degree)
    t = int(section.threshold) or k // 2 + 1
    code, levels = code_of(compression)
    return SecAggParams(n=n, degree=k, threshold=t, modulus_bits=int(section.modulus_bits), clip=float(section.clip),
                        quant_bits=int(section.quant_bits), seed=seed, code=code, levels=levels)


def dropout_plan(entries: list) -> dict[tuple[int, str, int], str]:
    """`secure_aggregation.dropouts` (tests and development only) as {(round, phase, client):
    action}: each entry "ROUND:PHASE:CLIENT" or "ROUND:PHASE:CLIENT:ACTION", ACTION "refuse" (the
    default: the client's call fails) or "exit" (its process ends).  ValueError names a bad entry."""
    plan: dict[tuple[int, str, int], str] = {}
    for entry in entries:
        parts = str(entry).split(":")
        ok = len(parts) in (3, 4) and parts[0].isdigit() and parts[2].isdigit() and parts[1] in PHASES
        action = parts[3] if ok and len(parts) == 4 else "refuse"
        if not ok or action not in DROPOUT_ACTIONS or int(parts[0]) < 1:
            raise ValueError(f"entry {entry!r} is not ROUND:PHASE:CLIENT[:ACTION] with ROUND >= 1, PHASE one of "
                             f"{', '.join(PHASES)} and ACTION one of {', '.join(DROPOUT_ACTIONS)}")
        plan[(int(parts[0]), parts[1], int(parts[2]))] = action
    return plan


def code_of(compression: Any) -> tuple[str, int]:
    """(code, levels) of SecAggParams for `compression.up`: none: SecAgg+'s own grid (levels 0 =
    2^quant_bits - 1); rounding with b bits: the grid of 2^b - 1 levels; qsgd with s levels: the
    grid of 2s levels (QSGD's sign * level, shifted by s); sign: the sign code."""
    up = getattr(compression, "up", "none") if compression is not None else "none"
    params: Any = getattr(compression, "params", None)
    if up == "rounding":
        return GRID, (1 << int(params.bits)) - 1
    if up == "qsgd":
        return GRID, 2 * int(params.levels)
    if up == "sign":
        return SIGN, 0
    return GRID, 0



def config_problem(cfg: Any, per_round: int, topology_methods: tuple[str, ...], transport_style: str,
                   where: str = "clients per round", compression: Any = None) -> str | None:
    """One line naming what the config asks that secure aggregation cannot do, or None.
    `per_round`: the clients of the smallest protocol round (the star's round, behind edges the
    smallest cluster's share of it), `where` says which; `topology_methods`: the methods the
    topology's spec declares; `transport_style`: the transport's (common/transport/entry.py);
    `compression`: cfg.compression with its compressor's keys resolved (`params`; default
    cfg.compression)."""
    sa = cfg.secure_aggregation
    if not sa.enabled:
        return None
    key = "config key 'secure_aggregation.enabled'"
    if ADVERTISE not in topology_methods:
        return (f"{key}: topology.kind = '{cfg.topology.kind}' does not run secure aggregation's phases "
                f"(star and hierarchical do)")
    if transport_style != "fanout":
        return (f"{key}: secure aggregation's phases travel inside the fabric's calls (transport.kind = grpc or "
                f"inmemory), not over transport.kind = '{cfg.transport.kind}' ({transport_style})")
    if cfg.algorithm.name not in SUMMABLE:
        return (f"{key}: algorithm.name = '{cfg.algorithm.name}' does not reply with a summable delta (allowed: "
                f"{', '.join(SUMMABLE)})")
    if getattr(cfg.algorithm, "weighting", "samples") != "uniform":
        return (f"{key}: needs algorithm.weighting = \"uniform\" (a sample-count weight would have to be revealed "
                f"or masked)")
    if cfg.security.aggregation != "mean":
        return f"{key}: security.aggregation = '{cfg.security.aggregation}' needs every update; secure aggregation " \
               f"gives the server only their sum"
    comp = compression or cfg.compression
    problem = _compression_problem(cfg, comp)
    if problem:
        return f"{key}: {problem}"
    if comp.up != "none" and where != "clients per round":
        return (f"{key}: compression.up = '{comp.up}' behind edges: integer codes under secure aggregation are "
                f"built for the star (each edge would code its cluster's sum again); use compression.up = \"none\"")
    try:
        plan = dropout_plan(list(sa.dropouts))
    except ValueError as exc:
        return f"config key 'secure_aggregation.dropouts': {exc}"
    stray = sorted({c for (_, _, c) in plan if c >= int(cfg.clients.count)})
    if stray:
        return f"config key 'secure_aggregation.dropouts': clients {stray} are not among the {cfg.clients.count} clients"
    problems = params_of(sa, per_round, int(cfg.run.seed), comp).problems()
    if problems:
        return f"config key 'secure_aggregation': {problems[0]} ({per_round} {where})"
    return None


def _compression_problem(cfg: Any, comp: Any) -> str | None:
    """What of `[compression]` (`comp`, its keys resolved) SecAgg+ cannot sum (codes.py), or None."""
    allowed = ", ".join(f"{n} ({need})" if need else n for n, need in CODED.items())
    if comp.up != "none" and comp.up not in CODED:
        return (f"compression.up = '{comp.up}' has no integer code with one decoding shared by every client, so "
                f"the sum of its codes is not the sum of its values (allowed: none, {allowed})")
    if comp.up == "qsgd" and int(getattr(getattr(comp, "params", None), "bucket", 0)) != 0:
        return "compression.up = 'qsgd' needs compression.bucket = 0 (SecAgg+ shares one norm scale, clip)"
    if comp.up != "none" and (comp.error_feedback != "none" or comp.layers):
        return ("compression.error_feedback and compression.layers must be left unset (SecAgg+ codes every "
                "coordinate of the flattened update with one code)")
    if comp.down != "none" or getattr(cfg.algorithm, "compress", "none") != "none":
        return "compression.down and algorithm.compress must be \"none\" (SecAgg+ codes only the uploads)"
    return None
