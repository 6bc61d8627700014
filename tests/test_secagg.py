"""SecAgg+ as a library (common/security/secagg/): the secret sharing, the graph, the quantization,
and the four rounds in one process with dropouts at every phase, against independent computations
(Python integer sums of the quantized updates, the byte formulas of messages.py, a chi-square test)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from cryptography.exceptions import InvalidTag
from scipy.stats import chi2

from fedhop.common.security.secagg import crypto, messages, quantize, shamir
from fedhop.common.security.secagg.client import SecAggClient, context
from fedhop.common.security.secagg.errors import SecAggFailure, SecAggRefusal
from fedhop.common.security.secagg.graph import harary_edges, neighbours
from fedhop.common.security.secagg.messages import PHASES, Counts
from fedhop.common.security.secagg.params import SecAggParams
from fedhop.common.security.secagg.server import plan_unmask
from fedhop.common.security.secagg.simulate import simulate_round

COMPLETE = SecAggParams(n=10, degree=0, threshold=6, modulus_bits=32, clip=1.0, quant_bits=16, seed=7)
SPARSE = SecAggParams(n=14, degree=6, threshold=4, modulus_bits=32, clip=1.0, quant_bits=16, seed=7)
D = 200


def updates(params: SecAggParams, d: int = D, scale: float = 0.05) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(params.seed + 1)
    return {u: rng.normal(scale=scale, size=d) for u in range(params.n)}


def quantized_sum(params: SecAggParams, ups: dict[int, np.ndarray], clients: list[int]) -> list[int]:
    """The plain sum of the quantized updates in Python integers (no modulus, no masks)."""
    total = [0] * len(next(iter(ups.values())))
    for u in clients:
        q = quantize.quantize(ups[u], params.clip, params.quant_bits, quantize.rounding_rng(params.seed, 0, u))
        total = [a + int(b) for a, b in zip(total, q)]
    return total


# -- Shamir

def test_any_t_shares_reconstruct_and_fewer_fail():
    secret = crypto.random_seed()
    points = list(range(1, 8))
    shares = shamir.split(secret, 4, points)
    assert shares.shape == (7, 11) and shares.min() >= 0 and shares.max() < shamir.PRIME
    for subset in itertools.combinations(range(7), 4):
        assert shamir.reconstruct({points[i]: shares[i] for i in subset}, 4, 32) == secret
    with pytest.raises(SecAggFailure) as failure:
        shamir.reconstruct({points[i]: shares[i] for i in range(3)}, 4, 32)
    assert failure.value.reason == "too_few_shares"
    # three points of a degree-3 polynomial interpolate some other polynomial: not the secret
    wrong = shamir.lagrange_at_zero(points[:3])
    guess = sum(int(c) * shares[i].astype(object) for i, c in enumerate(wrong)) % shamir.PRIME
    assert list(guess) != list(shamir.encode_secret(secret))


def test_lagrange_coefficients_interpolate_a_known_polynomial():
    """f(x) = 5 + 3x + 2x^2 over GF(p): l_i(0) recovers f(0) = 5 from f(2), f(5), f(9)."""
    xs = [2, 5, 9]
    lam = shamir.lagrange_at_zero(xs)
    assert sum(int(c) * (5 + 3 * x + 2 * x * x) for c, x in zip(lam, xs)) % shamir.PRIME == 5


# -- the graph

@pytest.mark.parametrize("n,k", [(10, 4), (10, 5), (11, 5), (11, 4), (100, 14), (7, 6)])
def test_harary_graph_degrees(n, k):
    degree = [0] * n
    for a, b in harary_edges(n, k):
        degree[a] += 1
        degree[b] += 1
    odd_odd = k % 2 == 1 and n % 2 == 1 and k < n - 1
    assert sorted(degree) == [k] * (n - 1) + [k + 1 if odd_odd else k]


def test_neighbour_graph_is_symmetric_seeded_and_complete_at_n_minus_1():
    g = neighbours(20, 6, seed=1)
    assert all(u in g[v] for u in g for v in g[u]) and all(u not in g[u] for u in g)
    assert g == neighbours(20, 6, seed=1) and g != neighbours(20, 6, seed=2)
    assert neighbours(6, 5, seed=3) == {u: frozenset(set(range(6)) - {u}) for u in range(6)}


# -- crypto and quantization

def test_key_agreement_is_symmetric_and_blobs_need_the_right_key():
    a, b, c = (crypto.new_private_key() for _ in range(3))
    ab = crypto.agree(a, crypto.public_bytes(b), crypto.ENCRYPTION_LABEL, b"r")
    assert ab == crypto.agree(b, crypto.public_bytes(a), crypto.ENCRYPTION_LABEL, b"r")
    assert ab != crypto.agree(a, crypto.public_bytes(b), crypto.MASK_LABEL, b"r")
    blob = crypto.encrypt(ab, b"x" * 96, b"r")
    assert len(blob) == 96 + 28 and crypto.decrypt(ab, blob, b"r") == b"x" * 96
    with pytest.raises(InvalidTag):
        crypto.decrypt(crypto.agree(a, crypto.public_bytes(c), crypto.ENCRYPTION_LABEL, b"r"), blob, b"r")


def test_dequantized_sum_is_within_the_stated_bound():
    clip, bits, m = 0.5, 8, 6
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=500) for _ in range(m)]          # norms ~22: clipped to 0.5
    qs = [quantize.quantize(x, clip, bits, rng) for x in xs]
    assert all(q.max() <= 255 for q in qs)
    clipped = sum(quantize.clip_update(x, clip) for x in xs)
    assert all(np.linalg.norm(quantize.clip_update(x, clip)) <= clip * (1 + 1e-12) for x in xs)
    error = np.abs(quantize.dequantize_sum(sum(qs), m, clip, bits) - clipped)
    assert error.max() <= m * 2 * clip / 255
    assert error.max() > 0.1 * 2 * clip / 255                 # the rounding is really there


# -- the rounds: exact sums with dropouts

def drop_sets(params: SecAggParams, count: int) -> set[int]:
    """`count` neighbours of client 0: the sharpest case (client 0 keeps exactly k - count holders)."""
    return set(sorted(neighbours(params.n, params.k, params.seed)[0])[:count])


@pytest.mark.parametrize("params", [COMPLETE, SPARSE], ids=["complete", "sparse"])
@pytest.mark.parametrize("phase", PHASES)
def test_unmasked_sum_is_the_exact_sum_with_dropouts(params, phase):
    ups = updates(params)
    for count in (0, 1, params.max_dropouts):
        dropped = drop_sets(params, count)
        sim = simulate_round(params, ups, {phase: dropped})
        kept = [u for u in range(params.n) if phase == "unmask" or u not in dropped]
        assert sim.aggregate.clients == kept
        assert [int(v) for v in sim.aggregate.total] == quantized_sum(params, ups, kept)


@pytest.mark.parametrize("params", [COMPLETE, SPARSE], ids=["complete", "sparse"])
def test_dropouts_spread_over_the_phases(params):
    ups = updates(params)
    spread = sorted(drop_sets(params, params.max_dropouts))
    drop = {phase: {u} for phase, u in zip(("advertise", "share", "masked", "unmask"), spread)}
    sim = simulate_round(params, ups, drop)
    gone = set().union(*(drop.get(p, set()) for p in ("advertise", "share", "masked")))
    kept = [u for u in range(params.n) if u not in gone]
    assert [int(v) for v in sim.aggregate.total] == quantized_sum(params, ups, kept)
    # and the dequantized sum is the float sum of the clipped updates within m steps
    approx = quantize.dequantize_sum(sim.aggregate.total, len(kept), params.clip, params.quant_bits)
    plain = sum(quantize.clip_update(ups[u], params.clip) for u in kept)
    assert np.abs(approx - plain).max() <= len(kept) * 2 * params.clip / (2 ** params.quant_bits - 1)


@pytest.mark.parametrize("params", [COMPLETE, SPARSE], ids=["complete", "sparse"])
@pytest.mark.parametrize("phase,reason", [("advertise", "neighbourhood_below_threshold"),
                                          ("share", "neighbourhood_below_threshold"),
                                          ("masked", "neighbourhood_below_threshold"),
                                          ("unmask", "too_few_shares")])
def test_one_dropout_too_many_is_a_typed_failure(params, phase, reason):
    with pytest.raises(SecAggFailure) as failure:
        simulate_round(params, updates(params), {phase: drop_sets(params, params.max_dropouts + 1)})
    assert failure.value.reason == reason and "threshold" in str(failure.value)


# -- what the server and the clients see

def test_masked_input_is_uniform_and_not_the_input():
    """chi-square over 64 buckets of the top 6 bits of y_u mod R: a uniform vector passes at p > 1e-4
    (a false failure once in 10^4 runs, the masks come from the OS); the quantized input itself fails
    at p < 1e-12, so the test can fail."""
    params = SecAggParams(n=5, degree=0, threshold=3, modulus_bits=32, clip=1.0, quant_bits=16, seed=2)
    d = 64 * 200
    sim = simulate_round(params, updates(params, d=d))
    y = messages.read_masked_reply(sim.replies["masked"][0], d, 32)
    x = sim.clients[0].quantized

    def p_value(values: np.ndarray) -> float:
        counts = np.bincount((values >> np.uint64(26)).astype(np.int64), minlength=64)
        expected = len(values) / 64
        return float(chi2.sf(((counts - expected) ** 2 / expected).sum(), df=63))

    assert p_value(y) > 1e-4
    assert p_value(x) < 1e-12
    assert np.mean(y == x) < 0.01


def test_relayed_shares_are_ciphertexts_of_the_expected_length():
    params = SPARSE
    sim = simulate_round(params, updates(params))
    ctx = context(0)
    for v, raw in sim.relayed["masked"].items():
        me = sim.clients[v]
        entries = messages.read_blobs(raw, "masked request")
        assert set(entries) == set(sim.server.graph[v])
        assert len(raw) == 4 + len(entries) * (4 + 12 + 96 + 16)
        for w, blob in entries.items():
            assert len(blob) == messages.BLOB == 124
            sk_share, b_share = me.held[w]
            assert shamir.to_bytes(sk_share) not in raw and shamir.to_bytes(b_share) not in raw
            right = crypto.agree(me.c_sk, me.keys[w][0], crypto.ENCRYPTION_LABEL, ctx)
            assert messages.read_share_plaintext(crypto.decrypt(right, blob, ctx))[:2] == (w, v)
            other = next(x for x in entries if x != w)
            with pytest.raises(InvalidTag):
                crypto.decrypt(crypto.agree(me.c_sk, me.keys[other][0], crypto.ENCRYPTION_LABEL, ctx), blob, ctx)


def test_a_changed_blob_is_refused():
    params = SecAggParams(n=4, degree=0, threshold=2, modulus_bits=24, clip=1.0, quant_bits=8)
    clients = {u: SecAggClient(params) for u in range(4)}
    keys = {u: messages.read_advertise_reply(clients[u].advertise(messages.advertise_request(0, u, 4)))
            for u in range(4)}
    sent = {u: messages.read_blobs(clients[u].share(messages.share_request({v: keys[v] for v in keys if v != u})), "s")
            for u in range(4)}
    to_zero = {u: sent[u][0] for u in (1, 2, 3)}
    to_zero[1] = to_zero[1][:20] + bytes([to_zero[1][20] ^ 1]) + to_zero[1][21:]
    with pytest.raises(SecAggRefusal, match="does not authenticate"):
        clients[0].masked(messages.blobs(to_zero), np.zeros(3))


def test_no_client_ever_has_both_secrets_revealed():
    """The server's plan refuses an overlap, a client refuses a request naming one id twice or a second
    request, and over rounds with dropouts no owner has both its b_u and s_u^SK shares given away."""
    graph = neighbours(6, 5, seed=0)
    with pytest.raises(SecAggRefusal):
        plan_unmask(graph, {0, 1, 2}, {2, 3})
    for phase in ("share", "masked", "unmask"):
        sim = simulate_round(SPARSE, updates(SPARSE), {phase: drop_sets(SPARSE, 2)})
        kinds: dict[int, set[str]] = {}
        for client in sim.clients.values():
            for owner, kind in client.revealed.items():
                kinds.setdefault(owner, set()).add(kind)
        assert kinds and all(len(k) == 1 for k in kinds.values())
        assert any(k == {"sk"} for k in kinds.values()) == (phase == "masked")
    client = next(c for c in sim.clients.values() if c.phase == "unmask")
    with pytest.raises(SecAggRefusal):
        client.unmask(messages.unmask_request([], []))
    fresh = simulate_round(COMPLETE, updates(COMPLETE), {"unmask": set(range(COMPLETE.n))}, stop_before="unmask")
    owner = next(iter(fresh.clients[0].held))
    with pytest.raises(SecAggRefusal, match="both"):
        fresh.clients[0].unmask(messages.unmask_request([owner], [owner]))


# -- bytes

def expected_bytes(params: SecAggParams, d: int, drop: dict[str, set[int]]):
    """The formulas of messages.py evaluated on the sets U1..U3 derived here from the dropouts."""
    g = neighbours(params.n, params.k, params.seed)
    u0 = set(range(params.n))
    u1 = u0 - drop.get("advertise", set())
    u2 = u1 - drop.get("share", set())
    u3 = u2 - drop.get("masked", set())
    u4 = u3 - drop.get("unmask", set())
    live = {"advertise": (u0, u1), "share": (u1, u2), "masked": (u2, u3), "unmask": (u3, u4)}
    down, up = {}, {}
    for phase, (asked, answered) in live.items():
        counts = {u: Counts(a=len(g[u] & u1), b=len(g[u] & u2), s=len(g[u] & u3), r=len(g[u] & (u2 - u3)))
                  for u in asked}
        down[phase] = {u: messages.request_bytes(phase, counts[u]) for u in asked}
        up[phase] = {u: messages.reply_bytes(phase, counts[u], d, params.modulus_bits) for u in answered}
    return down, up


@pytest.mark.parametrize("n", [10, 50, 100])
@pytest.mark.parametrize("sparse", [False, True], ids=["complete", "sparse"])
def test_bytes_equal_the_formulas(n, sparse):
    k = 2 * int(np.ceil(np.log2(n))) if sparse else n - 1
    params = SecAggParams(n=n, degree=k, threshold=k // 2 + 1, modulus_bits=20, clip=1.0, quant_bits=12, seed=5)
    d = 64
    drop = {"share": {3}, "masked": {4}, "unmask": {5}}
    sim = simulate_round(params, updates(params, d=d), drop)
    down, up = expected_bytes(params, d, drop)
    assert sim.down == down and sim.up == up
    nodrop = simulate_round(params, updates(params, d=d))
    for u in range(n):
        deg = len(nodrop.server.graph[u])
        total = sum(nodrop.down[p][u] + nodrop.up[p][u] for p in PHASES)
        assert total == 100 + 376 * deg + d * 3 == messages.client_total_no_dropouts(deg, d, 20)


def test_parameter_rules():
    assert SecAggParams(n=10, degree=4, threshold=5).problems()[0].startswith("threshold 5 is above the degree 4")
    assert "above half" in SecAggParams(n=10, degree=4, threshold=2).problems()[0]
    assert "too small" in SecAggParams(n=100, degree=0, threshold=60, modulus_bits=20, quant_bits=16).problems()[0]
    assert SecAggParams(n=100, degree=0, threshold=60, modulus_bits=23, quant_bits=16).problems() == []


def test_the_bytes_script_prints_measured_equal_to_formula(tmp_path):
    """benchmarks/secagg_bytes.py from outside the checkout: its rows' measured and formula columns agree
    and the per-client total of the complete graph is 100 + 376 (n - 1) + d w."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "secagg_bytes.py"
    done = subprocess.run([sys.executable, str(script), "--n", "10", "12", "--d", "40", "--bits", "20"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines()
            if line.startswith("| 1")]
    assert len(rows) == 4 and all(r[8] == r[9] for r in rows)
    complete = next(r for r in rows if r[0] == "10" and r[1] == "complete")
    assert int(complete[7].replace(",", "")) == 100 + 376 * 9 + 40 * 3
