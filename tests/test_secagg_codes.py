"""SecAgg+ summing a compressor's integer codes (common/security/secagg/codes.py,
docs/secure-aggregation.md "Compressors"): the unmasked vector is the exact sum of the clients'
codes with and without dropouts, the decoded sum is the sum of the decoded values (signs against
numpy; QSGD's levels on its grid), the masked input's bytes follow d ceil(modulus_bits / 8) with
the smallest modulus the code's bits allow, and the compressors without a shared decoding are
refused, one line.  Over real processes: SecAgg+ with the sign code gives the plain run's model
with compression.up = "sign" bit for bit."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.torch import load_file

from fedhop.common.config import load_config
from fedhop.common.config.schema import ConfigError
from fedhop.common.security.secagg import quantize
from fedhop.common.security.secagg.codes import GRID, SIGN
from fedhop.common.security.secagg.params import SecAggParams
from fedhop.common.security.secagg.settings import code_of
from fedhop.common.security.secagg.simulate import simulate_round
from tests.helpers import db_rows
from tests.test_secagg_run import config, run

N, D, CLIP = 8, 40, 1.5


def _params(code: str, levels: int, modulus_bits: int = 16) -> SecAggParams:
    return SecAggParams(n=N, degree=0, threshold=5, modulus_bits=modulus_bits, clip=CLIP, quant_bits=8, seed=4,
                        code=code, levels=levels)


def _updates() -> dict[int, np.ndarray]:
    rng = np.random.default_rng(9)
    return {u: rng.normal(0, 0.2, D) for u in range(N)}


@pytest.mark.parametrize("code,levels", [(GRID, 15), (GRID, 6), (SIGN, 0)])
@pytest.mark.parametrize("dropped", [set(), {2, 5}])
def test_the_unmasked_vector_is_the_sum_of_the_codes(code, levels, dropped):
    """rounding with 4 bits (top 15), QSGD with s = 3 (top 2s = 6), sign: complete graph, t = 5, 0
    or 2 clients dropping in the masked-input phase."""
    params = _params(code, levels)
    ups = _updates()
    sim = simulate_round(params, ups, {"masked": dropped}, round_number=3)
    survivors = sim.aggregate.clients
    assert survivors == sorted(set(range(N)) - dropped)
    c = params.integer_code
    codes = {u: c.encode(ups[u], quantize.rounding_rng(params.seed, 3, u)) for u in survivors}
    assert sim.aggregate.total.astype(np.int64).tolist() == sum(codes[u].astype(np.int64) for u in survivors).tolist()
    assert all(int(codes[u].max()) <= c.top for u in survivors)
    decoded = c.decode_sum(sim.aggregate.total, len(survivors))
    if code == SIGN:   # the sum of the signs, sign(0) = +, exactly
        assert decoded.tolist() == sum(np.where(ups[u] >= 0, 1.0, -1.0) for u in survivors).tolist()
    else:   # each client's decoded value is a neighbouring point of x on the grid of 2 clip / top
        for u in survivors:
            one = c.decode_sum(codes[u], 1)
            assert np.all(np.abs(one - ups[u]) < c.step + 1e-12)
            assert np.allclose((one + CLIP) / c.step, np.rint((one + CLIP) / c.step), atol=1e-9)
        assert np.allclose(decoded, sum(c.decode_sum(codes[u], 1) for u in survivors), atol=1e-9)


def test_qsgd_levels_with_a_shared_norm_are_the_grid_of_2s():
    """QSGD (Alistarh et al. 2017) with the norm replaced by clip: |x| / clip * s rounded up with
    probability its fraction, the sign kept; the grid code with top 2s gives those values with the
    same probabilities (the frequency of the upper level over 20,000 draws is within 5 sd)."""
    s, x = 3, np.array([0.7, -0.7, 0.0, 0.5, -0.3, 0.1])   # ||x|| < clip: the L2 clip leaves it
    c = _params(GRID, 2 * s).integer_code
    draws = np.stack([c.decode_sum(c.encode(x, np.random.default_rng([1, i])), 1) for i in range(20_000)])
    a = np.abs(x) / CLIP * s
    low, p = np.floor(a), a - np.floor(a)
    for j in range(x.size):   # the two QSGD values sign * l * clip / s and sign * (l + 1) * clip / s
        values = set(np.round(draws[:, j] / (CLIP / s)).astype(int).tolist())
        assert values <= {int(np.sign(x[j]) * low[j]), int(np.sign(x[j]) * (low[j] + 1))}
        upper = np.mean(np.abs(np.round(draws[:, j] / (CLIP / s))) == low[j] + 1)
        assert abs(upper - p[j]) <= 5 * math.sqrt(max(p[j] * (1 - p[j]), 1e-12) / 20_000) + 1e-12


@pytest.mark.parametrize("code,levels,bits", [(SIGN, 0, 1), (GRID, 15, 4), (GRID, 6, 3), (GRID, 0, 8)])
def test_masked_input_bytes_follow_the_codes_bits(code, levels, bits):
    """The smallest modulus is the code's bits + ceil(log2 n) (one less is refused); each masked
    input is then d ceil(modulus_bits / 8) bytes (quant_bits = 8 for the plain grid)."""
    need = bits + math.ceil(math.log2(N))
    assert _params(code, levels, need - 1).problems()
    params = _params(code, levels, need)
    assert params.problems() == [] and params.integer_code.bits == bits
    sim = simulate_round(params, _updates())
    assert set(sim.up["masked"].values()) == {D * math.ceil(need / 8)}


def _cfg(tmp_path, *sets: str):
    path = tmp_path / "c.toml"
    path.write_text('[data]\ndataset = "digits"\n[model]\nkind = "mlp"\nhidden = [8]\n'
                    '[algorithm]\nlocal_steps = 2\nbatch_size = 8\nweighting = "uniform"\n'
                    '[clients]\ncount = 20\nper_round = 5\n[secure_aggregation]\nenabled = true\n')
    return load_config(path, list(sets))


@pytest.mark.parametrize("sets,code", [(["compression.up=rounding", "compression.bits=4"], (GRID, 15)),
                                       (["compression.up=qsgd", "compression.levels=7"], (GRID, 14)),
                                       (["compression.up=sign"], (SIGN, 0)), ([], (GRID, 0))])
def test_the_allowed_compressors_set_the_code(tmp_path, sets, code):
    assert code_of(_cfg(tmp_path, *sets).compression) == code


@pytest.mark.parametrize("sets,needle", [
    (["compression.up=topk"], "allowed: none, rounding"),
    (["compression.up=scaled_sign"], "allowed: none, rounding"),
    (["compression.up=natural"], "no integer code"),
    (["compression.up=fp16"], "no integer code"),
    (["compression.up=qsgd", "compression.bucket=64"], "compression.bucket = 0"),
    (["compression.up=sign", "compression.error_feedback=ef"], "error_feedback"),
    (["compression.up=sign", "privacy.mode=central", "privacy.clip_norm=0.5", "privacy.noise_multiplier=1.0"],
     "compression.up"),
])
def test_compressors_without_a_shared_decoding_are_refused(tmp_path, sets, needle):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, *sets)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_sign_code_over_real_processes_is_the_plain_sign_run_bit_for_bit(tmp_path):
    """Two rounds of 6 clients with compression.up = "sign": the secure run (modulus_bits = 4 = 1 +
    ceil(log2 6)) and the plain run end with the same model bytes; each masked input is d bytes."""
    plain = run(tmp_path, "plain", config(False, rounds=2, extra='[compression]\nup = "sign"\nmin_numel = 1\n'))
    secure = run(tmp_path, "secure", config(True, rounds=2, extra='[compression]\nup = "sign"\nmin_numel = 1\n')
                 .replace("modulus_bits = 16", "modulus_bits = 4"))
    assert plain.returncode == 0 and secure.returncode == 0, plain.stderr[-2000:] + secure.stderr[-2000:]
    w_plain = load_file(str(tmp_path / "plain" / "model.safetensors"))["w"]
    w_secure = load_file(str(tmp_path / "secure" / "model.safetensors"))["w"]
    assert w_secure.numpy().tobytes() == w_plain.numpy().tobytes()
    assert not np.allclose(w_plain.numpy(), 0)
    sizes = {b for (b,) in db_rows(tmp_path / "secure" / "run.db", "SELECT tensor_bytes FROM messages WHERE "
                                   "recorder = 'server' AND method = 'secagg_masked.reply'")}
    assert sizes == {4}   # d = 4 coordinates of 1 byte
    assert json.loads((tmp_path / "secure" / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("extra,needle", [
    ('[compression]\nup = "topk"\n', "compression.up = 'topk'"),
    ('[compression]\nup = "qsgd"\nbucket = 8\n', "compression.bucket = 0"),
    ('[privacy]\nmode = "central"\nclip_norm = 3.0\nnoise_multiplier = 1.0\n', "privacy.clip_norm"),
])
def test_bad_combinations_are_one_line_exit_2(tmp_path, extra, needle):
    """`fedhop run` from a folder outside the checkout: a compressor SecAgg+ cannot sum, QSGD with
    per-bucket norms, a DP clip norm above secure_aggregation.clip (2.0)."""
    done = run(tmp_path, "bad", config(True, extra=extra))
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and needle in lines[0], done.stderr
