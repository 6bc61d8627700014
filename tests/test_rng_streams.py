"""Named seeded streams (common/util/rng.py, DESIGN.md section 8): a stream's seed is numpy's
SeedSequence over the run seed's low 32 bits and the CRC-32 of each name, whichever form the
words are handed over in, so the streams (and every run's bits) do not depend on it."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from fedhop.common.util.rng import numpy_stream, stream_seed, torch_stream


def _reference_words(seed: int, names: tuple) -> list[int]:
    return [seed & 0xFFFFFFFF] + [zlib.crc32(str(n).encode()) for n in names]


NAMES = [("client", 0, "round", 1), ("client", 999_999, "round", 12_345, "step", 3), ("sampling",),
         ("data/crossdevice/client", 17), (), ("stragglers", -4)]


@pytest.mark.parametrize("seed", [0, 1, 2 ** 32 + 5, 2 ** 40 - 1, 123_456_789])
@pytest.mark.parametrize("names", NAMES)
def test_a_streams_seed_is_seedsequence_over_the_words_as_a_python_list(seed, names):
    state = np.random.SeedSequence(_reference_words(seed, names)).generate_state(2, dtype=np.uint32)
    expect = ((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)
    assert stream_seed(seed, *names) == expect
    g = torch.Generator()
    g.manual_seed(expect)
    assert torch.equal(torch.randperm(50, generator=torch_stream(seed, *names)), torch.randperm(50, generator=g))
    reference = np.random.Generator(np.random.PCG64(np.random.SeedSequence(_reference_words(seed, names))))
    assert np.array_equal(numpy_stream(seed, *names).normal(size=20), reference.normal(size=20))


def test_streams_named_differently_differ():
    seeds = {stream_seed(0, *names) for names in NAMES}
    assert len(seeds) == len(NAMES)
    assert stream_seed(0, "client", 1) != stream_seed(1, "client", 1)
