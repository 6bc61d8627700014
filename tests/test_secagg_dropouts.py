"""SecAgg+ with dropouts pinned to each phase, over real processes (`fedhop run` from a folder
outside the checkout), in the star and behind edges (docs/secure-aggregation.md).

Each run is one config whose rounds drop clients at chosen phases through
`secure_aggregation.dropouts` ("refuse": the client's call fails; "exit": its whole process ends):
0, 1 and the most the threshold tolerates (k - t = 2 with k = 5, t = 3) in each phase, then one
past it in each phase (the round has no sum: a `secagg_failed` event with the typed reason, and
the run goes on), and last a client process that exits in the masked-input phase.  The final
model is checked against an independent numpy computation of every round's sum of quantized
deltas (the clients' local steps, the clipping, quantization and stochastic rounding rule of
docs/secure-aggregation.md); one quantization step off in one coordinate of one round would be
caught (the tolerance is 1e-4, a step over the clients is above 2.6e-3).  Behind edges, the
edges' ledger records of every phase's messages equal the byte formulas of
common/security/secagg/messages.py (Bell et al. 2020's table) for the dropouts of the round."""
from __future__ import annotations

import sqlite3
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.security.secagg import messages
from fedhop.common.security.secagg.messages import PHASES, Counts
from tests.helpers import quadratic_config

STEPS, LR, CLIP, QBITS, SEED, BITS = 3, 0.1, 2.0, 8, 7, 16
LEVELS = 2 ** QBITS - 1
D = 4
T = 3   # threshold; clusters of 6 on the complete graph: k = 5, so k - t = 2 dropouts are tolerated

# round -> phase -> clients that refuse; clusters A = 0..5 and (behind edges) B = 6..11
STAR_PLAN: dict[int, dict[str, list[int]]] = {
    1: {},
    2: {"advertise": [0]}, 3: {"advertise": [1, 2]},
    4: {"share": [3]}, 5: {"share": [4, 5]},
    6: {"masked": [0]}, 7: {"masked": [2, 5]},
    8: {"unmask": [1]}, 9: {"unmask": [3, 4]},
    10: {"advertise": [0, 1, 2]}, 11: {"share": [0, 1, 2]}, 12: {"masked": [3, 4, 5]}, 13: {"unmask": [0, 1, 2]},
}
STAR_FAILS = {10: "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD", 11: "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD",
              12: "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD", 13: "SECAGG_TOO_FEW_SHARES"}
# behind edges: cluster A runs the phases forwards, B backwards, in the same rounds; then one past
# the threshold in every phase of each cluster (A's and B's in one round), and in round 14 the
# process of clients 0, 1 and 2 exits in the masked-input phase: A fails, B's sum is the round's
HIER_PLAN: dict[int, dict[str, list[int]]] = {
    1: {},
    2: {"advertise": [0], "unmask": [6]}, 3: {"advertise": [1, 2], "unmask": [7, 8]},
    4: {"share": [3], "masked": [9]}, 5: {"share": [4, 5], "masked": [10, 11]},
    6: {"masked": [0], "share": [6]}, 7: {"masked": [2, 5], "share": [7, 11]},
    8: {"unmask": [1], "advertise": [8]}, 9: {"unmask": [3, 4], "advertise": [9, 10]},
    10: {"advertise": [0, 1, 2], "unmask": [6, 7, 8]}, 11: {"share": [3, 4, 5], "masked": [9, 10, 11]},
    12: {"masked": [0, 1, 2], "share": [6, 7, 8]}, 13: {"unmask": [3, 4, 5], "advertise": [9, 10, 11]},
}
HIER_FAILS = {10: {"edge-0": "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD", "edge-1": "SECAGG_TOO_FEW_SHARES"},
              11: {"edge-0": "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD", "edge-1": "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD"},
              12: {"edge-0": "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD", "edge-1": "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD"},
              13: {"edge-0": "SECAGG_TOO_FEW_SHARES", "edge-1": "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD"},
              14: {"edge-0": "SECAGG_NEIGHBOURHOOD_BELOW_THRESHOLD"}}
EXIT_ROUND = 14


def problem(count: int):
    """The quadratic task of `count` clients, drawn from its own seed (whichever tests run)."""
    rng = np.random.default_rng([4848, count])
    centers = rng.normal(0, 1, size=(count, D))
    curvatures = rng.uniform(0.5, 2.0, size=(count, D))
    return centers, curvatures


def config(centers, curvatures, rounds: int, processes: int, dropouts: list[str], topology: str = "") -> str:
    text = quadratic_config(centers, curvatures, [4] * len(centers), rounds=rounds, local_steps=STEPS, lr=LR,
                            processes=processes, extra_algorithm='weighting = "uniform"', seed=SEED,
                            topology=topology)
    text = text.replace("round_timeout = 60.0", 'round_timeout = 60.0\non_short_round = "skip"\neval_every = 0')
    text = text.replace("eval_every = 1\n", "")
    return text + f"""
[secure_aggregation]
enabled = true
degree = 0
threshold = {T}
modulus_bits = {BITS}
clip = {CLIP}
quant_bits = {QBITS}
dropouts = {dropouts!r}
""".replace("'", '"')


def entries(plan: dict[int, dict[str, list[int]]]) -> list[str]:
    return [f"{r}:{phase}:{c}" for r, phases in sorted(plan.items()) for phase, cs in phases.items() for c in cs]


def run(tmp_path, name: str, text: str) -> subprocess.CompletedProcess:
    (tmp_path / f"{name}.toml").write_text(text)
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", f"{name}.toml", "--out", name],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


# ---------------------------------------------------------------- the independent computation
def delta(w: np.ndarray, center: np.ndarray, curvature: np.ndarray) -> np.ndarray:
    """STEPS full-batch gradient steps on 1/2 sum C (w - A)^2 from w: the client's reply."""
    v = w.copy()
    for _ in range(STEPS):
        v = v - LR * curvature * (v - center)
    return v - w


def quantized(x: np.ndarray, number: int, pos: int) -> np.ndarray:
    """docs/secure-aggregation.md's rule: clip to L2 norm CLIP, map [-CLIP, CLIP] onto [0, LEVELS],
    stochastic rounding with PCG64 seeded (seed, protocol round, protocol id, 0x9A)."""
    norm = np.linalg.norm(x)
    x = x * (CLIP / norm) if norm > CLIP else x
    y = (x + CLIP) / (2 * CLIP) * LEVELS
    u = np.random.default_rng([SEED, number, pos, 0x9A]).random(y.shape)
    return (np.floor(y) + (u < y - np.floor(y))).astype(np.int64)


def survivors(group: list[int], drops: dict[str, list[int]]) -> dict[str, set[int]]:
    """U1..U4 of one SecAgg+ round of `group` under `drops` (the clients whose inputs count: U3)."""
    live, out = set(group), {}
    for phase in PHASES:
        live -= set(drops.get(phase, []))
        out[phase] = set(live)
    return out


def cluster_sum(w: np.ndarray, centers, curvatures, group: list[int], inputs: set[int], number: int):
    """The integer sum of the quantized deltas of `inputs` (protocol id = position in `group`)."""
    total = sum(quantized(delta(w, centers[c], curvatures[c]), number, pos)
                for pos, c in enumerate(group) if c in inputs)
    return total, len(inputs)


def expected_model(centers, curvatures, groups: list[list[int]], plan, failed: dict[int, set[int]], rounds: int,
                   extra: dict[int, dict[str, list[int]]]) -> np.ndarray:
    """The model after `rounds`: each round w += (sum over the groups that did not fail of their
    dequantized sums) / (their inputs); a round where every group failed is skipped."""
    w = np.zeros(D)
    for r in range(1, rounds + 1):
        drops = {**plan.get(r, {}), **extra.get(r, {})}
        total, m = np.zeros(D), 0
        for g, group in enumerate(groups):
            if g in failed.get(r, set()):
                continue
            ints, count = cluster_sum(w, centers, curvatures, group, survivors(group, drops)["masked"], r)
            total, m = total + ints * (2 * CLIP / LEVELS) - count * CLIP, m + count
        if m:
            w = w + total / m
    return w


def final_model(tmp_path, name: str) -> np.ndarray:
    return load_file(str(tmp_path / name / "model.safetensors"))["w"].double().numpy()


def assert_model(tmp_path, name: str, problem_, groups, plan, failed, extra) -> None:
    """The run's final model against `expected_model`, to 1e-4 (a step is above 2e-3)."""
    want = expected_model(*problem_, groups, plan, failed, EXIT_ROUND, extra)
    got = final_model(tmp_path, name)
    assert np.abs(got - want).max() < 1e-4, (got, want)


# ---------------------------------------------------------------- the byte formulas at the edges
def expected_bytes(group: list[int], drops: dict[str, list[int]], last: str) -> dict[tuple[str, int], int]:
    """(method, client) -> tensor bytes of every message between the edge and its cluster in one
    round on the complete graph, through phase `last` (the round stops after the phase where it
    fails): messages.request_bytes / reply_bytes with the Counts the dropouts leave, the model
    beside the masked-input request (D float32), and an empty reply from a client that refused."""
    u = survivors(group, drops)
    asked = {"advertise": set(group), "share": u["advertise"], "masked": u["share"], "unmask": u["masked"]}
    out: dict[tuple[str, int], int] = {}
    for phase in PHASES[:PHASES.index(last) + 1]:
        for c in asked[phase]:
            others = set(group) - {c}
            counts = Counts(a=len(others & u["advertise"]), b=len(others & u["share"]),
                            s=len(others & u["masked"]), r=len(others & (u["share"] - u["masked"])))
            method = f"secagg_{phase}"
            out[(method, c)] = messages.request_bytes(phase, counts) + (4 * D if phase == "masked" else 0)
            out[(method + ".reply", c)] = (messages.reply_bytes(phase, counts, D, BITS) if c in u[phase] else 0)
    return out


# ---------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def star(tmp_path_factory):
    """6 clients on 3 processes (clients 0-1, 2-3, 4-5); in the last round the process of clients
    4 and 5 exits in the masked-input phase (two dropouts, tolerated; both named, so whichever
    call arrives first ends the process before either replies)."""
    tmp = tmp_path_factory.mktemp("star")
    centers, curvatures = problem(6)
    text = config(centers, curvatures, rounds=EXIT_ROUND, processes=3,
                  dropouts=entries(STAR_PLAN) + [f"{EXIT_ROUND}:masked:{c}:exit" for c in (4, 5)])
    done = run(tmp, "star", text)
    return tmp, done, centers, curvatures


@pytest.fixture(scope="module")
def hier(tmp_path_factory):
    """12 clients behind 2 edges (clusters 0-5 and 6-11), 4 client processes (0-2, 3-5, 6-8, 9-11)."""
    tmp = tmp_path_factory.mktemp("hier")
    centers, curvatures = problem(12)
    text = config(centers, curvatures, rounds=EXIT_ROUND, processes=4,
                  dropouts=entries(HIER_PLAN) + [f"{EXIT_ROUND}:masked:{c}:exit" for c in (0, 1, 2)],
                  topology='kind = "hierarchical"\nedges = 2')
    done = run(tmp, "hier", text)
    return tmp, done, centers, curvatures


def test_star_recovers_the_exact_sum_with_dropouts_in_every_phase(star):
    tmp, done, centers, curvatures = star
    assert done.returncode == 0, done.stderr[-3000:]
    db = tmp / "star" / "run.db"
    failed = rows(db, "select round, detail from events where kind = 'secagg_failed' order by round")
    assert [(r, d.split(":")[0]) for r, d in failed] == sorted(STAR_FAILS.items())
    # each failed round is skipped (run.on_short_round = "skip") and the run goes on
    assert [r for (r,) in rows(db, "select round from events where kind = 'round_skipped' order by round")] == \
        sorted(STAR_FAILS)
    completed = [r for (r,) in rows(db, "select round from rounds order by round")]
    assert completed == [r for r in range(1, EXIT_ROUND + 1) if r not in STAR_FAILS]
    # the exit: clients 4 and 5 (one process) are lost in round 14's masked input; the 4 others are summed
    assert rows(db, f"select detail from events where kind = 'secagg_phase' and round = {EXIT_ROUND} "
                    "and detail like 'masked%'") == [("masked: 4 of 6 clients replied",)]
    # a client that drops in unmasking has its input in the sum: the server says so
    late = rows(db, "select round, node from events where kind = 'secagg_late_dropout' order by round, node")
    assert late == [(8, "client-1"), (9, "client-3"), (9, "client-4")]
    assert_model(tmp, "star", (centers, curvatures), [list(range(6))], STAR_PLAN, {r: {0} for r in STAR_FAILS},
                 {EXIT_ROUND: {"masked": [4, 5]}})


def test_edges_recover_their_cluster_sums_with_dropouts_in_every_phase(hier):
    tmp, done, centers, curvatures = hier
    assert done.returncode == 0, done.stderr[-3000:]
    db = tmp / "hier" / "run.db"
    failed = rows(db, "select round, node, detail from events where kind = 'secagg_failed' order by round, node")
    want_failed = [(r, node, why) for r, by_edge in sorted(HIER_FAILS.items()) for node, why in sorted(by_edge.items())]
    assert [(r, node, d.split(":")[0]) for r, node, d in failed] == want_failed
    # rounds where both edges failed are skipped; round 10 and 14 go on with one edge's sum
    both = {r for r, by_edge in HIER_FAILS.items() if len(by_edge) == 2}
    assert [r for (r,) in rows(db, "select round from events where kind = 'round_skipped' order by round")] == \
        sorted(both)
    assert [r for (r,) in rows(db, "select round from rounds order by round")] == \
        [r for r in range(1, EXIT_ROUND + 1) if r not in both]
    # the server sees cluster sums only: no secagg message and no train call at the server
    assert rows(db, "select count(*) from messages where (src = 'server' or dst = 'server') "
                    "and (method like 'secagg%' or method like 'train%')") == [(0,)]
    fails = {r: {int(node[-1]) for node in by_edge} for r, by_edge in HIER_FAILS.items()}
    assert_model(tmp, "hier", (centers, curvatures), [list(range(6)), list(range(6, 12))], HIER_PLAN, fails,
                 {EXIT_ROUND: {"masked": [0, 1, 2]}})


def test_the_bytes_of_every_phase_at_the_edges_equal_the_formulas(hier):
    """Every round but the exit's: the edge's own records of its messages with its clients."""
    tmp, done, _, _ = hier
    assert done.returncode == 0, done.stderr[-3000:]
    db = tmp / "hier" / "run.db"
    for r, drops in sorted(HIER_PLAN.items()):
        for e, group in enumerate([list(range(6)), list(range(6, 12))]):
            node = f"edge-{e}"
            past = [p for p, cs in drops.items() if set(cs) <= set(group) and len(cs) > 2]   # past the threshold
            assert bool(past) == (node in HIER_FAILS.get(r, {}))
            last = past[0] if past else "unmask"   # the round stops after the phase where it fails
            want = expected_bytes(group, drops, last)
            got = {}
            for method, src, dst, size, link in rows(
                    db, f"select method, src, dst, tensor_bytes, link from messages where recorder = '{node}' "
                        f"and round = {r} and method like 'secagg%'"):
                assert link == "client-edge"
                client = int((dst if src == node else src).split("-")[1])
                assert (method, client) not in got
                got[(method, client)] = size
            assert got == want, (r, node)


def test_kappa2_edge_iterations_are_each_a_secagg_round(tmp_path):
    """kappa2 = 2: each edge iteration is its own SecAgg+ round (protocol round (r - 1) * 2 + k + 1);
    the edge steps its model by the first iteration's unmasked mean and answers with its model's
    change (HierFAVG's edge_partial), a client that dropped in the first iteration sitting out the
    second."""
    centers, curvatures = problem(8)
    text = config(centers, curvatures, rounds=2, processes=2, dropouts=["2:share:1"],
                  topology='kind = "hierarchical"\nedges = 2\nkappa2 = 2')
    text = text.replace("threshold = 3", "threshold = 2")
    done = run(tmp_path, "k2", text)
    assert done.returncode == 0, done.stderr[-3000:]
    groups = [list(range(4)), list(range(4, 8))]
    w = np.zeros(D)
    for r in (1, 2):
        change, weight = np.zeros(D), 0
        for group in groups:
            inputs = set(group) - ({1} if r == 2 else set())
            w_edge = w.copy()
            for k in range(2):   # the second iteration's protocol ids: positions among the clients left
                members = group if k == 0 else [c for c in group if c in inputs]
                ints, m = cluster_sum(w_edge, centers, curvatures, members, inputs, (r - 1) * 2 + k + 1)
                mean = (ints * (2 * CLIP / LEVELS) - m * CLIP) / m
                w_edge = w_edge + mean
            change, weight = change + (w_edge - w) * m, weight + m
        w = w + change / weight
    got = final_model(tmp_path, "k2")
    assert np.abs(got - w).max() < 1e-4, (got, w)
    # two SecAgg+ rounds per edge and server round: 4 + 4 advertise requests at edge-0 in round 1,
    # 4 + 3 in round 2 (client 1 dropped in the first)
    db = tmp_path / "k2" / "run.db"
    assert rows(db, "select round, count(*) from messages where recorder = 'edge-0' and method = 'secagg_advertise' "
                    "group by round order by round") == [(1, 8), (2, 7)]


BAD_BEHIND_EDGES = {   # case: (text of the good config, what replaces it)
    "dropout entry": ("dropouts = []", 'dropouts = ["1:train:3"]'),
    "threshold": ("threshold = 3", "threshold = 4"),
    "privacy": ("[secure_aggregation]", f'[privacy]\nmode = "central"\nclip_norm = {CLIP}\nnoise_multiplier = 1.0\n\n'
                                        f'[secure_aggregation]'),
    "compressor": ("[secure_aggregation]", '[compression]\nup = "sign"\n\n[secure_aggregation]'),
}


@pytest.mark.parametrize("case,needle", [
    ("dropout entry", "secure_aggregation.dropouts"),
    ("threshold", "smallest cluster"),
    ("privacy", "built for the star"),
    ("compressor", "behind edges"),
])
def test_bad_settings_behind_edges_are_one_line_exit_2(tmp_path, case, needle):
    """A malformed dropout entry; a threshold the smallest cluster (4 of assignment [[0..5], [6..9]],
    complete graph k = 3) cannot meet (t = 4 > k), though the larger one could; differential
    privacy and an integer-coded compressor with secure aggregation, both built for the star only."""
    centers, curvatures = problem(10)
    text = config(centers, curvatures, rounds=1, processes=2, dropouts=[],
                  topology='kind = "hierarchical"\nedges = 2\nassignment = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]')
    good, bad = BAD_BEHIND_EDGES[case]
    assert good in text
    done = run(tmp_path, "bad", text.replace(good, bad))
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and needle in lines[0], done.stderr
