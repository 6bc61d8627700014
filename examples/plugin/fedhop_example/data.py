"""A data-set plug-in: scikit-learn's 8x8 digits (bundled with fedhop), split so that each client
holds the samples of two digit classes only, as 1x8x8 images, one torch Dataset per client."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedhop.common.data.datasets import load_digits
from fedhop.common.util.plugins import DataRequest, FederatedData


@dataclass
class TwoLabelParams:
    """Extra [data] keys of this data set (fedhop validates them against this dataclass)."""

    test_fraction: float = 0.25


def digits_two_labels(request: DataRequest) -> FederatedData:
    """Client i holds classes (c_i, c_i + 1 mod 10), c_i = i mod 10; each class's training samples
    are dealt out evenly among the clients that hold it.  Every random choice uses request.seed."""
    p = request.params or TwoLabelParams()
    x, y = load_digits()
    rng = np.random.default_rng(request.seed)
    order = rng.permutation(len(y))
    n_test = int(round(p.test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    images = (np.asarray(x, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    holders = {c: [i for i in range(request.num_clients) if c in (i % 10, (i + 1) % 10)] for c in range(10)}
    shares: list[list[int]] = [[] for _ in range(request.num_clients)]
    for c, clients in holders.items():
        if not clients:
            continue
        for k, chunk in enumerate(np.array_split(train[y[train] == c], len(clients))):
            shares[clients[k]].extend(chunk.tolist())
    clients = [TensorDataset(torch.from_numpy(images[s]), torch.from_numpy(np.asarray(y)[s])) for s in map(sorted, shares)]
    return FederatedData(clients=clients, test=(images[test], np.asarray(y)[test]), n_classes=10)


digits_two_labels.Params = TwoLabelParams
