"""The cross-device task (common/tasks/crossdevice.py): clients made on demand from the seed.

Checked against an independent numpy generator of FedProx's Synthetic(alpha, beta) and of the
size laws, against the bundled partition's rule, and over real processes: the same seed gives
the same model bit for bit whichever number of client processes hosts the clients."""
from __future__ import annotations

import json

import numpy as np
from safetensors.torch import load_file

from fedhop.common.config import parse_config
from fedhop.common.tasks import build_task
from fedhop.common.util.rng import numpy_stream
from fedhop.deploy.launch.launcher import run_local


def xd_config(count=5000, per_round=20, processes=2, rounds=3, seed=4, data="", model='kind = "logreg"') -> str:
    return f"""
[run]
name = "xd"
seed = {seed}
rounds = {rounds}
eval_every = {rounds}
torch_threads = 1
[algorithm]
name = "fedavg"
lr = 0.1
local_epochs = 1
batch_size = 8
[data]
dataset = "crossdevice"
{data}
[model]
{model}
[clients]
count = {count}
per_round = {per_round}
processes = {processes}
"""


def numpy_device(seed, k, n, alpha, beta, d=60, c=10):
    """FedProx's Synthetic(alpha, beta) for device k, written from the paper (Section 5.1)."""
    rng = numpy_stream(seed, "data/crossdevice/client", k)
    u = rng.normal(0.0, alpha)
    w = rng.normal(u, 1.0, (c, d))
    b = rng.normal(u, 1.0, c)
    big_b = rng.normal(0.0, beta)
    v = rng.normal(big_b, 1.0, d)
    cov_sd = np.sqrt(np.array([j ** -1.2 for j in range(1, d + 1)]))
    x = v + rng.standard_normal((n, d)) * cov_sd
    return x.astype(np.float32), np.argmax(x.astype(np.float32).astype(np.float64) @ w.T + b, axis=1)


def test_synthetic_clients_equal_an_independent_generator_and_sizes_follow_the_law():
    cfg = parse_config(xd_config(count=100_000, seed=9, data="alpha = 0.5\nbeta = 2.0\nsize_mean = 2.5\n"
                                                             "size_sigma = 1.2\nsize_min = 3\nsize_max = 400"))
    task = build_task(cfg)
    draws = numpy_stream(9, "data/crossdevice/sizes").lognormal(2.5, 1.2, 100_000)
    expect = np.minimum(np.floor(draws).astype(np.int64) + 3, 400)
    assert task.num_clients == 100_000 and np.array_equal(task.sizes, expect)
    for k in (0, 777, 99_999):
        data = task.client_data(k)
        x, y = numpy_device(9, k, int(expect[k]), 0.5, 2.0)
        assert task.num_samples(k) == data.num_samples == len(y)
        assert np.array_equal(data.tensors[0].numpy(), x) and np.array_equal(data.tensors[1].numpy(), y)
    # the test set: every sample of test_clients (200) held-out devices, ids count .. count + 199
    held = np.minimum(np.floor(numpy_stream(9, "data/crossdevice/sizes").lognormal(2.5, 1.2, 100_200))
                      .astype(np.int64) + 3, 400)[100_000:]
    assert task.x_test.shape[0] == int(held.sum())
    first = numpy_device(9, 100_000, int(held[0]), 0.5, 2.0)[0]
    assert np.array_equal(task.x_test[:len(first)].numpy(), first)


def test_pareto_sizes_and_no_client_data_until_asked():
    task = build_task(parse_config(xd_config(count=50_000, data='sizes = "pareto"\npareto_shape = 1.1\n'
                                                                 'size_min = 5\nsize_max = 0\ncache_clients = 2')))
    expect = np.floor(5 * (1.0 + numpy_stream(4, "data/crossdevice/sizes").pareto(1.1, 50_000))).astype(np.int64)
    assert np.array_equal(task.sizes, expect) and task.sizes.max() > 1000   # a heavy tail, uncapped
    assert task.num_samples(123) == expect[123] and len(task._cache) == 0
    for k in (1, 2, 3):
        task.client_data(k)
    assert sorted(task._cache) == [2, 3]   # cache_clients bounds what a process keeps


def test_bundled_digits_over_more_clients_than_samples():
    """digits (1,797 images) over 20,000 clients: client k's labels follow its Dirichlet mix and
    every sample is one of the training split's samples of that label."""
    cfg = parse_config(xd_config(count=20_000, data='base = "digits"\nlabel_alpha = 0.3\nsize_mean = 2.0'))
    task = build_task(cfg)
    from fedhop.common.data import datasets
    from fedhop.common.tasks import _split, standardize
    x, y = datasets.load_digits()
    x_tr, y_tr, x_te, _ = _split(cfg, x, y)
    if cfg.data.standardize:
        x_tr, x_te = standardize(x_tr, x_te)
    assert task.x_test.shape[0] == len(x_te)
    for k in (0, 19_999):
        data = task.client_data(k)
        rng = numpy_stream(4, "data/crossdevice/client", k)
        mix = rng.dirichlet(np.full(10, 0.3))
        labels = rng.choice(10, size=task.num_samples(k), p=mix / mix.sum())
        assert np.array_equal(np.sort(data.tensors[1].numpy()), np.sort(labels))
        rows = {tuple(r) for r in np.asarray(x_tr, dtype=np.float32)[y_tr == labels[0]]}
        first = data.tensors[0].numpy()[data.tensors[1].numpy() == labels[0]][0]
        assert tuple(first) in rows


def test_same_seed_same_model_whatever_the_process_count(tmp_path):
    """A client's data, stream and result do not depend on which process hosts it: 1, 2 and 4
    client processes end with the same model, bit for bit."""
    models = {}
    for procs in (1, 2, 4):
        out = tmp_path / f"p{procs}"
        cfg_file = tmp_path / f"p{procs}.toml"
        cfg_file.write_text(xd_config(count=6000, per_round=24, processes=procs, rounds=3))
        assert run_local(str(cfg_file), [], str(out), quiet=True, show_table=False) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["num_clients"] == 6000
        models[procs] = load_file(out / "model.safetensors")
    ref = models[1]
    assert any(bool(v.abs().sum() > 0) for v in ref.values())
    for procs in (2, 4):
        assert set(models[procs]) == set(ref)
        assert all(bool((models[procs][k] == ref[k]).all()) for k in ref), procs
