"""Convolutional image models (model.kind cnn, mcmahan_cnn, leaf_cnn, cifar_cnn, resnet18_gn): inputs
are images (channels, height, width)."""
from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from fedhop.common.models.dense import stacked_linear

#: the smallest image (height x width) whose convolutions a stack of clients runs client by
#: client (`stacked_conv`): vmap's grouped convolution of 8x8 digits was measured faster, of
#: 28x28 FEMNIST and 32x32 CIFAR images slower than the clients' convolutions one after another
#: (docs/vectorized.md, "Where it does not pay")
LOOP_MIN_PIXELS = 16 * 16


def _loop_pays(model: nn.Module) -> bool:
    """The convolutional models' `forward_stacked_pays`: whether a stack is trained through
    `forward_stacked` (common/models/dense.py `stacked_forward`), for images (`model.image_hw`)
    of at least LOOP_MIN_PIXELS on the CPU.  Otherwise (small images, or a GPU, where one
    grouped convolution is one kernel) the task's loss is vmapped."""
    first = next(model.parameters(), None)
    h, w = cast("tuple[int, int]", model.image_hw)
    return first is not None and first.device.type == "cpu" and h * w >= LOOP_MIN_PIXELS


def stacked_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, padding: int) -> torch.Tensor:
    """`F.conv2d` of m clients: x (m, B, C, H, W), weight (m, out, C, k, k), bias (m, out) ->
    (m, B, out, H', W'), each client's images through its own filters, one client after
    another (so a client's result does not depend on the clients beside it)."""
    return torch.stack([F.conv2d(xi, wi, bi, padding=padding)
                        for xi, wi, bi in zip(x.unbind(0), weight.unbind(0), bias.unbind(0))])


def _relu_pool(h: torch.Tensor) -> torch.Tensor:
    """ReLU then a 2x2 max-pool of a stack (m, B, C, H, W), every image on its own."""
    return F.max_pool2d(F.relu(h.flatten(0, 1)), 2).unflatten(0, h.shape[:2])


def _stacked_features(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """conv1 and conv2 (5x5, padding 2, each with ReLU and a 2x2 max-pool) of a stack of m
    clients, flattened: (m, B, features), what the models' first linear layer takes."""
    h = _relu_pool(stacked_conv(x, params["conv1.weight"], params["conv1.bias"], 2))
    return _relu_pool(stacked_conv(h, params["conv2.weight"], params["conv2.bias"], 2)).flatten(2)


class CNN(nn.Module):
    """LeNet-style: conv5x5 -> ReLU -> maxpool2 -> conv5x5 -> ReLU -> maxpool2 -> FC -> ReLU -> FC.

    Both convolutions use padding 2 so the spatial size is kept by the convolutions and only
    halved by the pools: 8x8 digits -> 4x4 -> 2x2, 28x28 MNIST -> 14x14 -> 7x7.
    """

    def __init__(self, in_channels: int, image_hw: tuple[int, int] | int, n_classes: int,
                 channels: tuple[int, int] = (6, 16), fc: int = 120) -> None:
        super().__init__()
        h, w = (image_hw, image_hw) if isinstance(image_hw, int) else image_hw
        if h < 4 or w < 4:
            raise ValueError(f"CNN needs images of at least 4x4, got {h}x{w}")
        self.image_hw = (h, w)
        self.conv1 = nn.Conv2d(in_channels, channels[0], kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(channels[0], channels[1], kernel_size=5, padding=2)
        flat = channels[1] * (h // 2 // 2) * (w // 2 // 2)
        self.fc1 = nn.Linear(flat, fc)
        self.fc2 = nn.Linear(fc, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))

    def forward_stacked(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`forward` of m parameter sets at once (common/models/dense.py `LogReg.forward_stacked`),
        x (m, B, C, H, W) -> logits (m, B, classes)."""
        return _two_dense(params, _stacked_features(params, x))

    forward_stacked_pays = _loop_pays


def _two_dense(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """fc1 with ReLU, then fc2, of a stack: the rest of `CNN` and `TwoConvCNN`."""
    h = F.relu(stacked_linear(h, params["fc1.weight"], params["fc1.bias"]))
    return stacked_linear(h, params["fc2.weight"], params["fc2.bias"])


class TwoConvCNN(nn.Module):
    """The "CNN" of McMahan et al. (2017, Section 3): conv5x5(32) -> ReLU -> maxpool2 -> conv5x5(64) ->
    ReLU -> maxpool2 -> FC(fc) -> ReLU -> FC(classes), 'same' padding.

    fc = 512 is the paper's MNIST model: 1,663,370 parameters for 10 classes on 28x28.  LEAF's FEMNIST
    baseline (Caldas et al. 2018) is the same net with fc = 2048: 6,603,710 parameters for 62 classes.
    Closed form: 32(25c + 1) + 64(25*32 + 1) + (64 (h/4)(w/4) + 1) fc + (fc + 1) classes.
    """

    def __init__(self, in_channels: int, image_hw: tuple[int, int], n_classes: int, fc: int = 512) -> None:
        super().__init__()
        h, w = image_hw
        if h < 4 or w < 4:
            raise ValueError(f"the two-conv CNN needs images of at least 4x4, got {h}x{w}")
        self.image_hw = (h, w)
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * (h // 4) * (w // 4), fc)
        self.fc2 = nn.Linear(fc, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))

    def forward_stacked(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`forward` of m parameter sets at once (`CNN.forward_stacked`)."""
        return _two_dense(params, _stacked_features(params, x))

    forward_stacked_pays = _loop_pays


class CifarCNN(nn.Module):
    """The CIFAR model of McMahan et al. (2017), from TensorFlow's CIFAR-10 tutorial: conv5x5(64) ->
    ReLU -> maxpool -> conv5x5(64) -> ReLU -> maxpool -> FC 384 -> FC 192 -> linear(classes), without
    the tutorial's local response normalisation.  On 32x32 inputs (no 24x24 crop) it has
    1,756,426 parameters for 10 classes (the paper's ~10^6 is for 24x24 crops).
    """

    def __init__(self, in_channels: int, image_hw: tuple[int, int], n_classes: int) -> None:
        super().__init__()
        h, w = image_hw
        if h < 4 or w < 4:
            raise ValueError(f"cifar_cnn needs images of at least 4x4, got {h}x{w}")
        self.image_hw = (h, w)
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * (h // 4) * (w // 4), 384)
        self.fc2 = nn.Linear(384, 192)
        self.out = nn.Linear(192, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.out(F.relu(self.fc2(F.relu(self.fc1(h.flatten(1))))))

    def forward_stacked(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`forward` of m parameter sets at once (`CNN.forward_stacked`)."""
        h = F.relu(stacked_linear(_stacked_features(params, x), params["fc1.weight"], params["fc1.bias"]))
        h = F.relu(stacked_linear(h, params["fc2.weight"], params["fc2.bias"]))
        return stacked_linear(h, params["out.weight"], params["out.bias"])

    forward_stacked_pays = _loop_pays


class BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2016) with GroupNorm in place of batch norm."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.GroupNorm(groups, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(h)) + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 for small images (3x3 stem, no max-pool: the CIFAR variant) with GroupNorm.

    Batch norm keeps running means and variances that are buffers, not parameters: each client's
    statistics describe its own skewed label mix, averaging them does not give the statistics of the
    pooled data, and the model evaluated with averaged statistics misbehaves under non-IID data
    (Hsieh et al. 2020).  GroupNorm normalises within each sample, so it has no running statistics at
    all.  `groups` = 2 as in Hsieh et al.  11,173,962 parameters for 10 classes (the same count as
    the batch-norm model: both norms have one scale and one shift per channel).
    """

    def __init__(self, in_channels: int, n_classes: int, groups: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.norm = nn.GroupNorm(groups, 64)
        widths, layers, c_in = (64, 128, 256, 512), [], 64
        for i, c_out in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(c_in, c_out, stride, groups), BasicBlock(c_out, c_out, 1, groups)))
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(F.relu(self.norm(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _image(kind: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """`shape` as (channels, height, width); any other shape is a ValueError naming the kind."""
    if len(shape) != 3:
        raise ValueError(f"model.kind = {kind!r} needs image inputs (channels, height, width), "
                         f"got input shape {shape}")
    return shape[0], shape[1], shape[2]


def build_cnn(shape: tuple[int, ...], n_outputs: int, **_: Any) -> nn.Module:
    c, h, w = _image("cnn", shape)
    return CNN(c, (h, w), n_outputs)


def build_mcmahan_cnn(shape: tuple[int, ...], n_outputs: int, **_: Any) -> nn.Module:
    c, h, w = _image("mcmahan_cnn", shape)
    return TwoConvCNN(c, (h, w), n_outputs, fc=512)


def build_leaf_cnn(shape: tuple[int, ...], n_outputs: int, **_: Any) -> nn.Module:
    c, h, w = _image("leaf_cnn", shape)
    return TwoConvCNN(c, (h, w), n_outputs, fc=2048)


def build_cifar_cnn(shape: tuple[int, ...], n_outputs: int, **_: Any) -> nn.Module:
    c, h, w = _image("cifar_cnn", shape)
    return CifarCNN(c, (h, w), n_outputs)


def build_resnet18_gn(shape: tuple[int, ...], n_outputs: int, **_: Any) -> nn.Module:
    c, _h, _w = _image("resnet18_gn", shape)
    return ResNet18GN(c, n_outputs)


REGISTER = {"cnn": build_cnn, "mcmahan_cnn": build_mcmahan_cnn, "leaf_cnn": build_leaf_cnn,
            "cifar_cnn": build_cifar_cnn, "resnet18_gn": build_resnet18_gn}
