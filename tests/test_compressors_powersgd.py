"""PowerSGD (common/processors/compressors/lowrank.py; Vogels et al., NeurIPS 2019, Algorithm 1).

- the factors and the decoded gradient equal torch's own DDP hook (`powerSGD_hook`, world size 1,
  gloo) on the same gradients: the first compressed step from the hook's random Q, the next from
  its warm-start Q;
- an independent float64 numpy Gram-Schmidt reference (P, Q, M_hat) on held-out matrices and a
  conv-shaped tensor, with the Q drawn from the same generator; warm start uses the kept Q and
  draws nothing; warm_start = false draws every round; a matrix of rank k <= r is reproduced;
  repeated warm-start steps reach numpy's best rank-r approximation (SVD, Eckart-Young);
- bytes: encoded_bytes == nbytes(parts) == 4 (m + n) r, and 4 numel for the `v` cases;
- every malformed part raises PayloadError, random parts never raise anything else;
- end to end: FedAvg on digits with `[compression] up = "powersgd"`, rank = 2: every train.reply
  upload costs the sum of the model's tensors' formulas, and the warm-start Q of each tensor is in
  the client hosts' persistent states.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhop.common.config import ConfigError, parse_config
from fedhop.common.processors.compressors import builtin_compressors
from fedhop.common.processors.compressors.base import Compressor, nbytes
from fedhop.common.processors.compressors.lowrank import PowerSGD, orthogonalise
from fedhop.common.processors.compressors.payload import TensorMemory
from fedhop.common.records.runstore import RunStore
from fedhop.common.wire.codec import PayloadError
from fedhop.deploy.launch.inmemory import run_inmemory


def held_out(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 normal values (seeds 5000+, not used in the module)."""
    rng = np.random.default_rng(5000 + seed)
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def copy_of(g: torch.Generator) -> torch.Generator:
    c = torch.Generator()
    c.set_state(g.get_state())
    return c


# ----------------------------------------------------------------------------- numpy reference
def np_gram_schmidt(a: np.ndarray) -> np.ndarray:
    """Classical column-by-column Gram-Schmidt in float64 (Algorithm 1's ORTHOGONALIZE)."""
    out = np.array(a, dtype=np.float64)
    for i in range(out.shape[1]):
        for j in range(i):
            out[:, i] -= (out[:, j] @ out[:, i]) * out[:, j]
        out[:, i] /= np.linalg.norm(out[:, i])
    return out


def np_powersgd(m: np.ndarray, q0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """P^ = GS(M GS(Q0)), Q = M^T P^, M_hat = P^ Q^T (lowrank.py's docstring), float64."""
    p = np_gram_schmidt(m @ np_gram_schmidt(q0))
    q = m.T @ p
    return p, q, p @ q.T


SHAPES = [((8, 3), 1), ((4, 2), 1), ((20, 30), 4), ((64, 10), 3), ((3, 100), 2), ((6, 3, 3, 3), 2)]


@pytest.mark.parametrize("shape, r", SHAPES)
def test_factors_equal_numpy_gram_schmidt(shape, r):
    t = held_out(shape, seed=len(shape) * 100 + shape[0] + r)
    m_rows, n = shape[0], math.prod(shape) // shape[0]
    c = PowerSGD(rank=r)
    rng = torch.Generator().manual_seed(7)
    q0 = torch.randn(n, r, generator=copy_of(rng)).double().numpy()   # the draw encode makes
    memory: dict[str, torch.Tensor] = {}
    parts = c.encode_shaped(t, rng, memory)
    assert set(parts) == {"p", "q"}
    assert parts["p"].dtype == parts["q"].dtype == torch.float32
    assert tuple(parts["p"].shape) == (m_rows, r) and tuple(parts["q"].shape) == (n, r)
    mat = t.double().numpy().reshape(m_rows, n)
    p, q, m_hat = np_powersgd(mat, q0)
    scale = np.abs(mat).max()
    # float32 against float64 on well-conditioned P (Gaussian M): errors ~1e-6, bounds 100x that
    np.testing.assert_allclose(parts["p"].double().numpy(), p, rtol=0, atol=1e-4)
    np.testing.assert_allclose(parts["q"].double().numpy(), q, rtol=0, atol=1e-4 * scale * math.sqrt(m_rows))
    got = c.decode(parts, t.numel())
    assert got.dtype == torch.float32 and tuple(got.shape) == (t.numel(),)
    np.testing.assert_allclose(got.double().numpy(), m_hat.reshape(-1), rtol=0, atol=1e-4 * scale * math.sqrt(m_rows))
    np.testing.assert_allclose(parts["p"].double().numpy().T @ parts["p"].double().numpy(), np.eye(r), atol=1e-5)
    assert torch.equal(memory["q"], parts["q"])      # kept for the next round


def test_warm_start_uses_the_kept_q_and_draws_nothing():
    c = PowerSGD(rank=3)
    m1, m2 = held_out((40, 25), 1), held_out((40, 25), 2)
    rng = torch.Generator().manual_seed(3)
    q0 = torch.randn(25, 3, generator=copy_of(rng)).double().numpy()
    memory: dict[str, torch.Tensor] = {}
    c.encode_shaped(m1, rng, memory)
    state_after_first = rng.get_state()
    parts2 = c.encode_shaped(m2, rng, memory)
    assert torch.equal(rng.get_state(), state_after_first)           # the warm start drew nothing
    _, q1, _ = np_powersgd(m1.double().numpy(), q0)
    p2, q2, m2_hat = np_powersgd(m2.double().numpy(), q1)             # Q from round 1 (Sec. 3, warm start)
    np.testing.assert_allclose(parts2["p"].double().numpy(), p2, atol=1e-4)
    np.testing.assert_allclose(c.decode(parts2, m2.numel()).double().numpy(), m2_hat.reshape(-1), atol=1e-4)
    assert torch.equal(memory["q"], parts2["q"])
    # a fresh Q (no warm start) gives another result: the test above could fail
    _, _, cold = np_powersgd(m2.double().numpy(), torch.randn(25, 3, generator=torch.Generator().manual_seed(9))
                             .double().numpy())
    assert np.abs(cold - m2_hat).max() > 1e-2


def test_without_warm_start_q_is_drawn_every_round_and_nothing_kept():
    c = PowerSGD(rank=2, warm_start=False)
    m = held_out((30, 12), 3)
    rng = torch.Generator().manual_seed(5)
    memory: dict[str, torch.Tensor] = {"q": torch.ones(12, 2)}   # ignored
    draws = copy_of(rng)
    for _ in range(2):
        q0 = torch.randn(12, 2, generator=draws).double().numpy()
        parts = c.encode_shaped(m, rng, memory)
        _, _, m_hat = np_powersgd(m.double().numpy(), q0)
        np.testing.assert_allclose(c.decode(parts, m.numel()).double().numpy(), m_hat.reshape(-1), atol=1e-4)
    assert torch.equal(memory["q"], torch.ones(12, 2))


@pytest.mark.parametrize("m_rows, n, k, r", [(30, 20, 3, 3), (30, 20, 2, 3), (30, 20, 1, 4), (64, 50, 2, 8)])
def test_a_matrix_of_rank_at_most_r_is_reproduced(m_rows, n, k, r):
    """M = A B^T of rank k <= r: P^ spans M's columns, so M_hat = P^ P^T M = M (to float32
    rounding), also for k < r, where the extra columns of P are rounding noise that
    `orthogonalise` re-orthogonalises."""
    a, b = held_out((m_rows, k), 10 + k), held_out((n, k), 20 + k)
    mat = a @ b.t()
    c = PowerSGD(rank=r)
    got = c.decode(c.encode_shaped(mat, torch.Generator().manual_seed(1), {}), mat.numel()).reshape(m_rows, n)
    assert float((got - mat).abs().max()) <= 1e-5 * float(mat.abs().max())
    # one rank less is far from it (k >= 2): the check above could fail
    if k >= 2:
        lower = PowerSGD(rank=k - 1)
        worse = lower.decode(lower.encode_shaped(mat, torch.Generator().manual_seed(1), {}), mat.numel())
        assert float((worse.reshape(m_rows, n) - mat).abs().max()) > 1e-2 * float(mat.abs().max())


def test_warm_start_steps_reach_the_best_rank_r_approximation():
    """Repeated on one M, warm-started PowerSGD is subspace iteration: the error tends to numpy's
    SVD truncation error sqrt(sum_{i > r} sigma_i^2) (Eckart-Young); the error shrinks with r."""
    rng_np = np.random.default_rng(6001)
    u, _ = np.linalg.qr(rng_np.standard_normal((50, 20)))
    v, _ = np.linalg.qr(rng_np.standard_normal((40, 20)))
    sigma = 2.0 ** -np.arange(20)                              # a gap of 2 between singular values
    mat = torch.from_numpy((u * sigma) @ v.T).float()
    errors = []
    for r in (1, 2, 4):
        c, memory, rng = PowerSGD(rank=r), {}, torch.Generator().manual_seed(2)
        for _ in range(30):
            got = c.decode(c.encode_shaped(mat, rng, memory), mat.numel()).reshape(50, 40)
        err = float(torch.linalg.norm(got.double() - mat.double()))
        best = float(np.sqrt((sigma[r:] ** 2).sum()))
        assert best <= err * (1 + 1e-5) and err <= best * 1.01 + 1e-5, (r, err, best)
        errors.append(err)
    assert errors[0] > errors[1] > errors[2]


def test_orthogonalise_matches_torchs_gram_schmidt_and_keeps_zero_columns():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize_gram_schmidt
    a = held_out((17, 2), 4)
    ours = orthogonalise(a.clone())
    theirs = a.clone().unsqueeze(0)
    _orthogonalize_gram_schmidt(theirs)
    assert torch.equal(ours, theirs[0])               # the same operations: bit for bit
    z = torch.zeros(5, 2)
    assert torch.equal(orthogonalise(z), torch.zeros(5, 2))        # torch's gives NaN here
    c = PowerSGD(rank=2)
    parts = c.encode_shaped(torch.zeros(9, 8), torch.Generator().manual_seed(0), memory := {})
    assert torch.equal(c.decode(parts, 72), torch.zeros(72))
    # the kept Q of a zero update is all zero: the next round draws a fresh one instead
    rng = torch.Generator().manual_seed(4)
    q0 = torch.randn(8, 2, generator=copy_of(rng)).double().numpy()
    m = held_out((9, 8), 5)
    got = c.decode(c.encode_shaped(m, rng, memory), 72)
    np.testing.assert_allclose(got.double().numpy(), np_powersgd(m.double().numpy(), q0)[2].reshape(-1), atol=1e-4)


# ----------------------------------------------------------------------------- torch's DDP hook
def test_factors_equal_torchs_powersgd_hook(tmp_path):
    """torch's `powerSGD_hook` on a one-Linear DDP model, world size 1 (gloo, FileStore), error
    feedback off, warm start on, `start_powerSGD_iter = 2` (the smallest the hook allows with warm
    start): steps 0 and 1 are plain all-reduces; step 2 draws Q with `torch.manual_seed(
    RandomState(seed).randint(10^9))` and compresses; step 3 starts from its kept Q.  Our encoder,
    given a generator seeded the same way and one memory across the two steps, gives the same
    P, Q and gradient.  The bias (1-D) is not compressed by the hook; ours sends it as `v`.
    Rank 3 (the hook's Householder QR) is compared on the gradient and on the factors up to the
    signs of their columns."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for r in (1, 2, 3):
            out_f, in_f, seed = 24, 20, 100 + r
            torch.manual_seed(r)
            plain = torch.nn.Linear(in_f, out_f)
            model = torch.nn.Linear(in_f, out_f)
            model.load_state_dict(plain.state_dict())
            ddp = DistributedDataParallel(model)
            state = PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                  use_error_feedback=False, warm_start=True, random_seed=seed)
            ddp.register_comm_hook(state, powerSGD_hook)
            ours, memory = PowerSGD(rank=r), {}
            rng = torch.Generator().manual_seed(int(np.random.RandomState(seed).randint(1_000_000_000)))
            for step in range(4):
                x, y = held_out((8, in_f), 40 * r + step), held_out((8, out_f), 50 * r + step)
                for mod in (ddp, plain):
                    mod.zero_grad(set_to_none=True)
                    (mod(x) * y).sum().backward()
                grad_w, grad_b = model.weight.grad, model.bias.grad
                mat = plain.weight.grad.clone()
                assert torch.equal(grad_b, plain.bias.grad)               # 1-D: sent as it is
                bias_parts = ours.encode_shaped(plain.bias.grad.clone(), rng, memory)
                assert set(bias_parts) == {"v"} and torch.equal(ours.decode(bias_parts, out_f), grad_b)
                if step < 2:
                    assert torch.equal(grad_w, mat)                       # vanilla all-reduce
                    continue
                parts = ours.encode_shaped(mat, rng, memory)
                hook_p = state.p_memory_dict[0].view(out_f, r)
                hook_q = state.q_memory_dict[0].view(in_f, r)
                got = ours.decode(parts, mat.numel()).view(out_f, in_f)
                torch.testing.assert_close(got, grad_w, rtol=1e-5, atol=1e-5)
                assert float((got - mat).abs().max()) > 1e-3              # it did compress
                signs = torch.sign((parts["p"] * hook_p).sum(0)) if r > 2 else torch.ones(r)
                torch.testing.assert_close(parts["p"] * signs, hook_p, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(parts["q"] * signs, hook_q, rtol=1e-5, atol=1e-5)
            assert state.iter == 4
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("shape, r", [*SHAPES, ((100, 100), 49), ((1000, 7), 6)])
def test_bytes_are_four_times_m_plus_n_times_r(shape, r):
    t = held_out(shape, 7)
    m_rows, n = shape[0], math.prod(shape) // shape[0]
    assert (m_rows + n) * r < m_rows * n
    c = PowerSGD(rank=r)
    parts = c.encode_shaped(t, torch.Generator().manual_seed(0), {})
    assert c.encoded_bytes(t.numel(), parts) == nbytes(parts) == 4 * (m_rows + n) * r


@pytest.mark.parametrize("shape, r", [((1,), 1), ((7,), 1), ((4097,), 3), ((2, 2), 1), ((100, 100), 50),
                                      ((3, 1000), 3), ((5, 1), 1), ((1, 50), 1), ((6, 3, 3, 3), 5)])
def test_tensors_whose_factors_are_not_smaller_travel_as_v(shape, r):
    """1-D tensors (torch's hook sends them uncompressed too) and matrices with (m + n) r >= m n:
    the tensor as it is, float32[numel], 4 numel bytes, nothing kept and nothing drawn."""
    t = held_out(shape, 8)
    c = PowerSGD(rank=r)
    rng, memory = torch.Generator().manual_seed(0), {}
    before = rng.get_state()
    parts = c.encode_shaped(t, rng, memory)
    assert set(parts) == {"v"} and torch.equal(parts["v"], t.reshape(-1))
    assert c.encoded_bytes(t.numel(), parts) == nbytes(parts) == 4 * t.numel()
    assert torch.equal(c.decode(parts, t.numel()), t.reshape(-1))
    assert memory == {} and torch.equal(rng.get_state(), before)
    flat = c.encode(t.reshape(-1), rng)               # a caller with no shape
    assert set(flat) == {"v"} and torch.equal(c.decode(flat, t.numel()), t.reshape(-1))


def test_keys_and_interface():
    assert builtin_compressors()["powersgd"] is PowerSGD
    c = PowerSGD()
    assert isinstance(c, Compressor) and c.rank == 1 and c.warm_start is True and not PowerSGD.unbiased
    for bad in (0, 1025, 2.0, True):
        with pytest.raises(ValueError, match="rank"):
            PowerSGD(rank=bad)
    with pytest.raises(ValueError, match="warm_start"):
        PowerSGD(warm_start=1)
    # its [compression] keys
    cfg = parse_config(DIGITS.replace("rank = 2", "rank = 3\nwarm_start = false"))
    assert cfg.compression.params == PowerSGD(rank=3, warm_start=False)
    with pytest.raises(ConfigError, match=r"compression.rank"):
        parse_config(DIGITS.replace("rank = 2", "rank = 0"))
    with pytest.raises(ConfigError, match=r"compression.warm_start"):
        parse_config(DIGITS.replace("rank = 2", "warm_start = 1"))


# ----------------------------------------------------------------------------- malformed parts
def test_every_malformed_part_is_a_payload_error():
    c = PowerSGD(rank=2)
    m = held_out((12, 10), 9)
    good = c.encode_shaped(m, torch.Generator().manual_seed(0), {})
    numel = m.numel()
    p, q = good["p"], good["q"]
    nan_p = p.clone()
    nan_p[0, 0] = float("nan")
    inf_q = q.clone()
    inf_q[3, 1] = float("inf")
    cases = {
        "no parts": ({}, "BAD_NAME"),
        "p alone": ({"p": p}, "BAD_NAME"),
        "v with p": ({"v": m.reshape(-1), "p": p, "q": q}, "BAD_NAME"),
        "an extra part": ({"p": p, "q": q, "x": p}, "BAD_NAME"),
        "float64 p": ({"p": p.double(), "q": q}, "BAD_SHAPE"),
        "float16 q": ({"p": p, "q": q.half()}, "BAD_SHAPE"),
        "1-D p": ({"p": p.reshape(-1), "q": q}, "BAD_SHAPE"),
        "3-D q": ({"p": p, "q": q.unsqueeze(0)}, "BAD_SHAPE"),
        "rank 1 factors": ({"p": p[:, :1].contiguous(), "q": q[:, :1].contiguous()}, "BAD_SHAPE"),
        "rank 3 factors": ({"p": torch.zeros(12, 3), "q": torch.zeros(10, 3)}, "BAD_SHAPE"),
        "m n != numel": ({"p": p[:11], "q": q}, "BAD_SHAPE"),
        "a huge claimed shape": ({"p": torch.zeros(0, 2), "q": q}, "BAD_SHAPE"),
        "another factorisation, not smaller": ({"p": torch.zeros(2, 2), "q": torch.zeros(60, 2)}, "BAD_SHAPE"),
        "NaN in p": ({"p": nan_p, "q": q}, "NON_FINITE"),
        "Inf in q": ({"p": p, "q": inf_q}, "NON_FINITE"),
        "P Q^T overflows": ({"p": torch.full((12, 2), 3e19), "q": torch.full((10, 2), 3e19)}, "NON_FINITE"),
        "v of the wrong length": ({"v": torch.zeros(numel - 1)}, "BAD_SHAPE"),
        "v as float64": ({"v": torch.zeros(numel, dtype=torch.float64)}, "BAD_SHAPE"),
        "v 2-D": ({"v": torch.zeros(12, 10)}, "BAD_SHAPE"),
        "NaN in v": ({"v": torch.full((numel,), float("nan"))}, "NON_FINITE"),
    }
    for what, (parts, code) in cases.items():
        with pytest.raises(PayloadError) as err:
            c.decode(parts, numel)
        assert err.value.code == code, what
    # another factorisation that is smaller decodes (the receiver knows numel, not the shape)
    assert c.decode({"p": torch.ones(20, 2), "q": torch.ones(6, 2)}, numel).shape == (numel,)


def test_random_parts_never_raise_anything_but_payload_error():
    """Random part sets, dtypes, shapes and magnitudes (half of them factors of a valid-looking
    m x n, some perturbed): decode either returns numel finite float32 values or raises PayloadError."""
    c = PowerSGD(rank=2)
    g = np.random.default_rng(6100)
    dtypes = (torch.float64, torch.float16, torch.int32, torch.uint8)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        values = torch.from_numpy(np.asarray(g.standard_normal(shape) * 10.0 ** float(g.integers(-3, 22))))
        return values.float() if g.random() < 0.8 else values.to(dtypes[g.integers(len(dtypes))])

    decoded = 0
    for _ in range(400):
        m_rows, n = int(g.integers(1, 15)), int(g.integers(1, 15))
        numel = m_rows * n + (int(g.integers(-1, 2)) if g.random() < 0.2 else 0)
        kind = g.random()
        if kind < 0.4:        # factors, their rank sometimes off
            ranks = [2 if g.random() < 0.8 else int(g.integers(1, 4)) for _ in range(2)]
            parts = {"p": tensor((m_rows, ranks[0])), "q": tensor((n, ranks[1]))}
        elif kind < 0.6:      # the tensor as it is
            parts = {"v": tensor((max(numel, 0),) if g.random() < 0.8 else (m_rows, n))}
        else:                 # anything
            parts = {}
            for name in g.choice(["p", "q", "v", "w"], size=g.integers(0, 4), replace=False):
                parts[str(name)] = tensor(tuple(int(s) for s in g.integers(0, 14, size=g.integers(0, 4))))
        if numel < 1:
            continue
        try:
            out = c.decode(parts, numel)
        except PayloadError:
            continue
        decoded += 1
        assert out.shape == (numel,) and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    assert decoded > 0          # some random sets are well formed


# ----------------------------------------------------------------------------- end to end
DIGITS = """
[run]
name = "powersgd-digits"
seed = 3
rounds = 3
[algorithm]
name = "fedavg"
lr = 0.05
local_epochs = 1
batch_size = 16
[data]
dataset = "digits"
partition = "shards"
shards_per_client = 2
[model]
kind = "mlp"
hidden = [16]
[clients]
count = 6
per_round = 3
processes = 2
[transport]
kind = "inmemory"
[compression]
up = "powersgd"
rank = 2
"""


def test_fedavg_on_digits_uploads_cost_the_powersgd_formula_and_keep_q(tmp_path):
    cfg = parse_config(DIGITS)
    processes: list = []
    summary, coord = run_inmemory(cfg, tmp_path, before_run=lambda net, procs, c: processes.extend(procs))
    assert summary["status"] == "completed", summary["error"]
    params = coord.state.params
    r = 2
    expected = 0
    for name, t in params.items():   # the formula, written independently of the code
        if t.dim() >= 2:
            m_rows, n = t.shape[0], t.numel() // t.shape[0]
            assert (m_rows + n) * r < m_rows * n
            expected += 4 * (m_rows + n) * r
        else:
            expected += 4 * t.numel()
    assert any(t.dim() == 2 for t in params.values()) and any(t.dim() == 1 for t in params.values())
    store = RunStore(tmp_path / "run.db")
    try:
        assert store.check_agreement().ok
        ups = [row for row in store.messages() if row["role"] == "sender" and row["direction"] == "up"
               and row["method"] == "train.reply"]
    finally:
        store.close()
    assert len(ups) == 3 * 3
    assert {row["tensor_bytes"] for row in ups} == {expected}
    assert expected < 4 * sum(t.numel() for t in params.values())
    states = {cid: st for proc in processes for cid, st in proc.host.states.items()}
    seen = {i for res in coord.history for i in res.participants}
    assert seen
    for i in seen:
        for name, t in params.items():
            kept = TensorMemory(states[i], "powersgd", name)
            if t.dim() >= 2:
                q = states[i][f"powersgd_memory:{name}:q"]
                assert q.dtype == torch.float32 and tuple(q.shape) == (t.numel() // t.shape[0], r)
                assert bool(torch.isfinite(q).all()) and float(q.abs().max()) > 0
                assert set(kept) == {"q"}
            else:
                assert len(kept) == 0
    assert all(bool(torch.isfinite(t).all()) for t in params.values())
