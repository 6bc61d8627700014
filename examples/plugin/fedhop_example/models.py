"""A model factory: fedhop calls `small_cnn(input_shape, n_outputs, **model.factory_args)` under the
run's seeded RNG in every process, so the server and every client build the same initial model."""
from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """conv3x3 (padding 1) -> ReLU -> maxpool 2 -> linear: C*9 + C + C*(H/2)*(W/2)*n + n parameters."""

    def __init__(self, in_channels: int, hw: tuple[int, int], n_outputs: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, kernel_size=3, padding=1)
        self.head = nn.Linear(channels * (hw[0] // 2) * (hw[1] // 2), n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(h.flatten(1))


def small_cnn(input_shape: tuple[int, ...], n_outputs: int, channels: int = 8) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(f"small_cnn needs images (channels, height, width), got samples of shape {input_shape}")
    return SmallCNN(input_shape[0], (input_shape[1], input_shape[2]), n_outputs, channels)
