"""Minibatch index streams for local solvers."""
from __future__ import annotations

from typing import Iterator

import torch


def local_batches(num_samples: int, batch_size: int, steps: int, epochs: int,
                  generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Index tensors for one round of local work.

    `steps > 0`: exactly `steps` minibatches, reshuffling at each pass over the data.
    `steps == 0`: `epochs` full passes (the last batch of a pass may be smaller).
    `batch_size == 0` (or larger than the data) means full batch.
    """
    if num_samples <= 0:
        return
    bs = num_samples if batch_size <= 0 else min(batch_size, num_samples)
    if steps > 0:
        produced = 0
        while produced < steps:
            perm = torch.randperm(num_samples, generator=generator)
            for start in range(0, num_samples - bs + 1, bs):  # full batches only in step mode
                yield perm[start:start + bs]
                produced += 1
                if produced == steps:
                    return
    else:
        for _ in range(epochs):
            perm = torch.randperm(num_samples, generator=generator)
            for start in range(0, num_samples, bs):
                yield perm[start:start + bs]


def batch_count(num_samples: int, batch_size: int, steps: int, epochs: int) -> int:
    """How many minibatches `local_batches` gives for these arguments, without drawing them."""
    if num_samples <= 0:
        return 0
    return steps if steps > 0 else epochs * steps_per_epoch(num_samples, batch_size)


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Minibatches in one pass over `num_samples` rows (the last may be smaller); none without rows."""
    if num_samples <= 0:
        return 0
    bs = num_samples if batch_size <= 0 else min(batch_size, num_samples)
    return -(-num_samples // bs)


def batches_on(batches: Iterator[torch.Tensor], device: torch.device) -> Iterator[torch.Tensor]:
    """`local_batches` with its indices on `device`: each pass's permutation is copied once and
    its batches are slices of the copy, so a GPU's steps wait for no host copy (the draws, and
    so the batches, are the CPU's)."""
    source: torch.Tensor | None = None
    moved: torch.Tensor   # set by the first batch (its base is never None)
    for idx in batches:
        base = idx._base if idx._base is not None else idx   # the pass's permutation
        if base is not source:
            source, moved = base, base.to(device)
        start = idx.storage_offset() - base.storage_offset()
        yield moved[start:start + idx.numel()]
