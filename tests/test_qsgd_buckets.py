"""QSGD with buckets (`qsgd_bucket`): each bucket quantized with its own norm, equal to the
definition computed in numpy, unbiased, the variance of the closed form, and the ledger counts
4 ceil(d / B) + ceil(d b / 8) bytes per upload (star, and Fed-CHS gradient uploads)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.processors.compress import (
    NORM_PREFIX,
    compress_payload,
    decompress_payload,
    encoded_bytes,
    num_buckets,
)
from fedhop.common.records.runstore import RunStore
from fedhop.common.wire.codec import PayloadError
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config


def draw(v: torch.Tensor, s: int, bucket: int, g: torch.Generator) -> torch.Tensor:
    enc = compress_payload(Payload(tensors={"w": v}, scalars={}), s, g, bucket)
    return decompress_payload(enc, {"w": (v.dtype, tuple(v.shape))}, s, bucket).tensors["w"]


def numpy_q(flat: np.ndarray, u: np.ndarray, s: int, bucket: int) -> np.ndarray:
    """Q_s per bucket: ||v_b|| sign(v_i) xi_i / s with xi_i from r_i = s |v_i| / ||v_b||."""
    out = np.zeros_like(flat)
    for start in range(0, flat.size, bucket):
        v = flat[start:start + bucket]
        norm = np.float32(np.linalg.norm(v))
        if norm == 0:
            continue
        r = s * np.abs(v) / norm
        xi = np.floor(r) + (u[start:start + bucket] < r - np.floor(r))
        out[start:start + bucket] = norm * np.sign(v) * xi / s
    return out


@pytest.mark.parametrize("bucket", [1, 4, 7, 24, 100])
def test_bucketed_encoding_matches_the_definition_and_its_size(bucket):
    v = torch.tensor(np.random.default_rng(2).normal(size=(4, 6)), dtype=torch.float32)
    v[1] = 0.0   # a zero stretch: a zero bucket (bucket 1, 4) encodes to zeros
    s, d = 5, 24
    enc = compress_payload(Payload(tensors={"w": v}, scalars={}), s, torch.Generator().manual_seed(9), bucket)
    assert enc.tensors[NORM_PREFIX + "w"].shape == (math.ceil(d / bucket),)
    nbytes = sum(t.numel() * t.element_size() for t in enc.tensors.values())
    assert nbytes == encoded_bytes(d, s, bucket) == 4 * math.ceil(d / bucket) + math.ceil(d * 4 / 8)
    got = decompress_payload(enc, {"w": (torch.float32, (4, 6))}, s, bucket).tensors["w"].numpy().reshape(-1)
    u = torch.rand(d, generator=torch.Generator().manual_seed(9), dtype=torch.float32).numpy()
    np.testing.assert_allclose(got, numpy_q(v.numpy().reshape(-1), u, s, bucket), rtol=1e-6, atol=1e-7)


def test_bucketed_is_unbiased_with_the_closed_form_variance():
    rng = np.random.default_rng(3)
    d, s, bucket, n = 64, 2, 8, 3000
    v = torch.tensor(rng.normal(size=d) * np.repeat([0.01, 1.0], d // 2), dtype=torch.float32)  # two scales
    g = torch.Generator().manual_seed(11)
    draws = torch.stack([draw(v, s, bucket, g).double() for _ in range(n)])
    flat = v.double().numpy()
    norms = np.repeat([np.linalg.norm(flat[i:i + bucket]) for i in range(0, d, bucket)], bucket)
    r = s * np.abs(flat) / norms
    p = r - np.floor(r)
    var = (norms / s) ** 2 * p * (1 - p)                       # Var Q_i = (||v_b|| / s)^2 p_i (1 - p_i)
    mean = draws.mean(0).numpy()
    assert np.all(np.abs(mean - flat) <= 5 * np.sqrt(var / n) + 1e-7)
    emp = draws.var(0).numpy()
    assert abs(emp.sum() - var.sum()) < 0.05 * var.sum()
    # one norm for the whole vector: the small half's variance grows with the large half's norm
    whole = torch.stack([draw(v, s, 0, g).double() for _ in range(300)]).var(0).numpy()
    assert whole[: d // 2].sum() > 50 * emp[: d // 2].sum()


def test_wrong_norm_shape_is_rejected():
    v = torch.arange(10, dtype=torch.float32)
    enc = compress_payload(Payload(tensors={"w": v}, scalars={}), 3, torch.Generator().manual_seed(0), 4)
    with pytest.raises(PayloadError):
        decompress_payload(enc, {"w": (torch.float32, (10,))}, 3, 5)   # expects 2 norms, got 3
    with pytest.raises(PayloadError):
        decompress_payload(enc, {"w": (torch.float32, (10,))}, 3, 0)   # expects a 0-dim norm
    assert num_buckets(10, 4) == 3 and num_buckets(10, 0) == 1


def quad(s: int, bucket: int, d: int = 10, **kw) -> str:
    rng = np.random.default_rng(5)
    centers = rng.normal(size=(6, d))
    return quadratic_config(centers, np.ones_like(centers), [3, 5, 2, 4, 6, 1], rounds=3, local_steps=2, lr=0.2,
                            processes=2, extra_algorithm=f'compress = "qsgd"\nqsgd_levels = {s}\nqsgd_bucket = {bucket}',
                            **kw)


@pytest.mark.parametrize("bucket", [3, 10, 64])
def test_ledger_counts_the_bucketed_bytes(tmp_path, bucket):
    s, d = 3, 10
    summary, coord = run_inmemory(parse_config(quad(s, bucket, d)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    store = RunStore(tmp_path / "run.db")
    ups = [r for r in store.messages() if r["role"] == "sender" and r["method"] == "train.reply"]
    assert ups and {r["tensor_bytes"] for r in ups} == {4 * math.ceil(d / bucket) + math.ceil(d * 3 / 8)}
    assert store.check_agreement().ok


def test_fedchs_uploads_use_the_buckets(tmp_path):
    s, d, bucket = 7, 10, 4
    rng = np.random.default_rng(8)
    centers = rng.normal(size=(4, d))
    text = quadratic_config(centers, np.ones_like(centers), [2, 3, 4, 5], rounds=2, local_steps=1, lr=1.0,
                            algorithm="fedchs", processes=2,
                            extra_algorithm=f'compress = "qsgd"\nqsgd_levels = {s}\nqsgd_bucket = {bucket}',
                            topology='kind = "sequential"\nedges = 2\ngraph = "ring"\nstart = 0\nsteps_per_round = 2')
    summary, _ = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    ups = [r for r in RunStore(tmp_path / "run.db").messages() if r["role"] == "sender" and r["method"] == "train.reply"]
    assert ups and {r["tensor_bytes"] for r in ups} == {encoded_bytes(d, s, bucket)} == {12 + math.ceil(d * 4 / 8)}


def test_bucket_key_is_validated():
    with pytest.raises(ConfigError, match="algorithm.qsgd_bucket"):
        parse_config(quad(3, -1))
