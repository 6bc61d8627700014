"""`fedhop bench gpu`: one client's local epoch in a fedhop client process against the same
epoch in plain torch, on the same GPU.

For a digits-sized CNN (model.kind = "cnn" on 8x8 digits) and a ResNet-18-sized model
(model.kind = "resnet18_gn" on 3x32x32 images), fedhop runs a real run: a server and one client
process, both on cuda:0, one client, one local epoch per round.  The client's local-solver seconds
of each round (run.db metrics `time_compute`: measured inside the client process around the
solver, which reads its losses back from the GPU at the end, so the GPU's work is in it) are set
against the same epoch written in plain torch in this process: the same model and data on the GPU,
the same batch size, `torch.optim.SGD`, one synchronize at the end.  Medians over rounds 2..R
(round 1 holds CUDA's and cuDNN's warm-up); ratio = fedhop / torch, target <= 1.1.
Without a CUDA device it says so and exits 0.
"""
from __future__ import annotations

import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MODELS = {   # name: (config text, images for the npz file or None for digits)
    "digits_cnn": ('[data]\ndataset = "digits"\npartition = "iid"\n[model]\nkind = "cnn"\n', None),
    "resnet18_gn": ('[data]\ndataset = "npz"\npath = "images.npz"\n[model]\nkind = "resnet18_gn"\n', (3, 32, 32)),
}


def _config(model_text: str, rounds: int, batch: int) -> str:
    return (f'[run]\nname = "bench-gpu"\nseed = 0\nrounds = {rounds}\neval_every = 0\n'
            f'[algorithm]\nname = "fedavg"\nlr = 0.05\nlocal_epochs = 1\nbatch_size = {batch}\n'
            f'[clients]\ncount = 1\nprocesses = 1\n' + model_text)


def _write_images(folder: Path, shape: tuple[int, ...], samples: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, *shape)).astype(np.float32)
    y = rng.integers(0, 10, size=samples).astype(np.int64)
    np.savez(folder / "images.npz", x_0=x, y_0=y)


def _fedhop_epochs(folder: Path, rounds: int) -> list[float]:
    """The client's local-solver seconds of each round of a real run on cuda:0."""
    out = folder / "run"
    done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "bench.toml", "--out", str(out), "--quiet",
                           "--set", "run.device=cuda", "--set", "clients.device=cuda"],
                          cwd=folder, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"fedhop bench gpu: the fedhop run failed: {done.stderr.strip()[-2000:]}")
    with sqlite3.connect(out / "run.db") as db:
        rows = db.execute("SELECT metrics_json FROM rounds ORDER BY round").fetchall()
    return [float(json.loads(r[0])["time_compute"]) for r in rows][:rounds]


def _torch_epochs(folder: Path, rounds: int, batch: int) -> tuple[list[float], int, int]:
    """The same epoch in plain torch: (seconds per epoch, parameters, samples)."""
    import torch
    import torch.nn.functional as F

    from fedhop.common.config import load_config
    from fedhop.common.tasks import build_task
    from fedhop.common.transport.placement import configure

    device = configure("cuda:0")   # the same deterministic settings as fedhop's processes
    cfg = load_config(folder / "run" / "config.toml")   # the fedhop run's own, its paths made absolute
    task = build_task(cfg)
    x, y = (t.to(device) for t in task.client_data(0).tensors)
    model = task.build_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.algorithm.lr)
    n = int(x.shape[0])
    seconds = []
    for r in range(rounds):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(r)).to(device)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for start in range(0, n, batch):
            idx = perm[start:start + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds, sum(p.numel() for p in model.parameters()), n


def bench_gpu(args: Any) -> dict:
    from fedhop.common.transport.placement import cuda_count
    if cuda_count() == 0:
        print("fedhop bench gpu: no CUDA device here; nothing measured")
        return {"cuda": False, "rows": []}
    import torch
    rounds = 3 if args.tiny else max(args.rounds, 3)
    out: dict = {"cuda": True, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    print(f"{out['device']}, torch {out['torch']}: one local epoch, median of rounds 2..{rounds}")
    print(f"{'model':<12} {'params':>10} {'samples':>8} {'batch':>6} {'fedhop ms':>10} {'torch ms':>9} {'ratio':>6}")
    for name, (model_text, image) in MODELS.items():
        batch = 64 if image else 32
        with tempfile.TemporaryDirectory(prefix="fedhop-bench-gpu-") as tmp:
            folder = Path(tmp)
            (folder / "bench.toml").write_text(_config(model_text, rounds, batch))
            if image:
                _write_images(folder, image, 512 if args.tiny else 4096)
            fedhop_s = statistics.median(_fedhop_epochs(folder, rounds)[1:])
            torch_runs, params, samples = _torch_epochs(folder, rounds, batch)
        torch_s = statistics.median(torch_runs[1:])
        row = {"model": name, "params": params, "samples": samples, "batch": batch, "fedhop_s": fedhop_s,
               "torch_s": torch_s, "ratio": fedhop_s / torch_s}
        out["rows"].append(row)
        print(f"{name:<12} {params:>10,} {samples:>8} {batch:>6} {fedhop_s * 1e3:>10.1f} {torch_s * 1e3:>9.1f} "
              f"{row['ratio']:>6.2f}")
    return out
