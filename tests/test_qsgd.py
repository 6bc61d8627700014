"""QSGD (common/processors/compress.py): unbiased, equal to its definition, exact packing, and the ledger
records the encoded size; Hier-Local-QSGD = HierFAVG with QSGD uploads."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.config import parse_config
from fedhop.common.processors.compress import (
    bits_per_element,
    compress_payload,
    decompress_payload,
    encoded_bytes,
    pack_codes,
    unpack_codes,
)
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config


def roundtrip(v: torch.Tensor, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    enc = compress_payload(Payload(tensors={"w": v}, scalars={"weight": 1.0}), s, g)
    return decompress_payload(enc, {"w": (v.dtype, tuple(v.shape))}, s).tensors["w"]


def test_bits_per_element():
    assert [bits_per_element(s) for s in (1, 2, 3, 4, 7, 15, 16, 255)] == [2, 3, 3, 4, 4, 5, 6, 9]
    assert encoded_bytes(10, 3) == 4 + math.ceil(10 * 3 / 8)


@pytest.mark.parametrize("s", [1, 3, 15, 16, 255])
def test_pack_unpack_exact(s):
    rng = np.random.default_rng(s)
    d = 37
    level = torch.from_numpy(rng.integers(0, s + 1, size=d))
    negative = torch.from_numpy(rng.random(d) < 0.5)
    packed = pack_codes(negative, level, s)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(d * bits_per_element(s) / 8)
    neg2, lev2 = unpack_codes(packed, d, s)
    assert torch.equal(lev2, level) and torch.equal(neg2, negative)


def test_decoded_vector_matches_the_definition():
    """Q_s(v)_i = ||v|| sign(v_i) xi_i / s, xi_i = floor(r_i) + [u_i < r_i - floor(r_i)], r_i = s|v_i|/||v||,
    with u = torch.rand(d) of the same generator, computed here in numpy."""
    v = torch.tensor(np.random.default_rng(0).normal(size=(4, 6)), dtype=torch.float32)
    s = 5
    got = roundtrip(v, s, seed=123).numpy().reshape(-1)
    u = torch.rand(v.numel(), generator=torch.Generator().manual_seed(123), dtype=torch.float32).numpy()
    flat = v.numpy().reshape(-1).astype(np.float32)
    norm = np.float32(np.linalg.norm(flat.astype(np.float64)))
    r = s * np.abs(flat) / norm
    low = np.floor(r)
    xi = low + (u < (r - low))
    expected = norm * np.sign(flat) * xi / s
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    # every decoded magnitude is one of the two neighbouring levels
    mags = np.abs(got) * s / norm
    assert np.all((np.abs(mags - low) < 1e-4) | (np.abs(mags - (low + 1)) < 1e-4))
    assert roundtrip(torch.zeros(5), s, 0).abs().sum() == 0


def test_unbiased():
    rng = np.random.default_rng(1)
    v = torch.tensor(rng.normal(size=40), dtype=torch.float32)
    s, n = 2, 4000
    g = torch.Generator().manual_seed(7)
    spec = {"w": (torch.float32, (40,))}
    total = torch.zeros(40, dtype=torch.float64)
    for _ in range(n):
        enc = compress_payload(Payload(tensors={"w": v}, scalars={"weight": 1.0}), s, g)
        total += decompress_payload(enc, spec, s).tensors["w"].double()
    mean = total / n
    # per-coordinate std of Q_s(v)_i <= ||v|| / (2 s); the mean of n draws within 5 sigma
    bound = 5 * float(v.norm()) / (2 * s * math.sqrt(n))
    assert float((mean - v.double()).abs().max()) < bound
    # and a single draw is not v itself (the quantizer is lossy), so the test can tell
    assert not torch.allclose(roundtrip(v, s, 3), v, atol=1e-3)


def _quad(topology: str, s: int = 3, d: int = 10) -> str:
    rng = np.random.default_rng(5)
    centers = rng.normal(size=(6, d))
    return quadratic_config(centers, np.ones_like(centers), [3, 5, 2, 4, 6, 1], rounds=3, local_steps=2,
                            lr=0.2, processes=2, topology=topology,
                            extra_algorithm=f'compress = "qsgd"\nqsgd_levels = {s}')


@pytest.mark.parametrize("topology, up_links", [
    ('kind = "star"', {"client-server"}),
    ('kind = "hierarchical"\nedges = 2', {"client-edge", "edge-server"}),   # Hier-Local-QSGD
])
def test_ledger_records_the_encoded_size(tmp_path, topology, up_links):
    s, d = 3, 10
    summary, coord = run_inmemory(parse_config(_quad(topology, s, d)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    store = RunStore(tmp_path / "run.db")
    uploads = [r for r in store.messages() if r["role"] == "sender" and r["direction"] == "up"
               and r["method"] in ("train.reply", "edge_round.reply")]
    assert uploads and {r["link"] for r in uploads} == up_links
    assert {r["tensor_bytes"] for r in uploads} == {encoded_bytes(d, s)} == {4 + math.ceil(d * 3 / 8)}
    downs = [r for r in store.messages() if r["role"] == "sender" and r["direction"] == "down" and r["tensor_bytes"]]
    assert downs and {r["tensor_bytes"] for r in downs} == {4 * d}     # downloads stay float32
    assert store.check_agreement().ok
    # the model moved toward the optimum: quantized updates still descend
    w_star = coord.task.optimum()
    assert float((coord.state.params["w"].double() - w_star).norm()) < float(w_star.norm())


def test_compress_key_is_validated():
    from fedhop.common.config import ConfigError
    with pytest.raises(ConfigError, match="algorithm.compress"):
        parse_config(_quad('kind = "star"').replace('compress = "qsgd"', 'compress = "topk"'))
    with pytest.raises(ConfigError, match="algorithm.qsgd_levels"):
        parse_config(_quad('kind = "star"', s=0))


def test_fedchs_gradient_uploads_are_quantized(tmp_path):
    s, d = 7, 10
    rng = np.random.default_rng(8)
    centers = rng.normal(size=(4, d))
    text = quadratic_config(centers, np.ones_like(centers), [2, 3, 4, 5], rounds=3, local_steps=1, lr=1.0,
                            algorithm="fedchs", processes=2,
                            extra_algorithm=f'compress = "qsgd"\nqsgd_levels = {s}',
                            topology='kind = "sequential"\nedges = 2\ngraph = "ring"\nstart = 0\nsteps_per_round = 3')
    summary, _ = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    store = RunStore(tmp_path / "run.db")
    ups = [r for r in store.messages() if r["role"] == "sender" and r["method"] == "train.reply"]
    assert len(ups) == 3 * 3 * 2 and {r["tensor_bytes"] for r in ups} == {encoded_bytes(d, s)}
    handoffs = [r for r in store.messages() if r["role"] == "sender" and r["method"] == "seq_handoff"]
    assert handoffs and {r["tensor_bytes"] for r in handoffs} == {4 * d}   # the model itself is not quantized
