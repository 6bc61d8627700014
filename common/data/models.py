"""Models: plain torch.nn modules with stable parameter names and seeded initialisation.

`build_model` constructs a model inside `torch.random.fork_rng()` after `torch.manual_seed`, so
the same seed gives the same initial parameters in every process and the caller's global RNG
is left untouched.  That RNG is one per process, so builds are serialised by a lock: threads of
one process (the in-memory transport's clients, a client process's hosts) that built at once
would reseed it under each other and draw different "seeded" parameters.  Parameter names
(state_dict keys) are fixed by the attribute names below; the wire format and checkpoints rely
on them.
"""
from __future__ import annotations

import fnmatch
import math
import threading
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: held while a model is built under the process's global RNG (see the module's docstring)
_BUILD_LOCK = threading.RLock()   # re-entrant: a user's model factory may build a built-in model inside

MODEL_KINDS = ("linear", "logreg", "mlp", "cnn", "mcmahan_cnn", "leaf_cnn", "cifar_cnn", "resnet18_gn", "char_lstm")
#: the 80 characters of LEAF's Shakespeare (models/utils/language_utils.py ALL_LETTERS); index = position
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


class LogReg(nn.Module):
    """Multinomial logistic regression: one affine map to the logits (input is flattened)."""

    def __init__(self, in_features: int, n_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Fully connected ReLU network; parameters `layers.<i>.{weight,bias}` and `out.*`."""

    def __init__(self, in_features: int, hidden: Sequence[int], n_classes: int) -> None:
        super().__init__()
        widths = [int(in_features), *[int(h) for h in hidden]]
        if any(w < 1 for w in widths[1:]):
            raise ValueError(f"model.hidden widths must be >= 1, got {list(hidden)}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(widths[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)
        for layer in self.layers:
            h = F.relu(layer(h))
        return self.out(h)


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
        self.conv1 = nn.Conv2d(in_channels, channels[0], kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(channels[0], channels[1], kernel_size=5, padding=2)
        flat = channels[1] * (h // 2 // 2) * (w // 2 // 2)
        self.fc1 = nn.Linear(flat, fc)
        self.fc2 = nn.Linear(fc, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


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
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * (h // 4) * (w // 4), fc)
        self.fc2 = nn.Linear(fc, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


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
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * (h // 4) * (w // 4), 384)
        self.fc2 = nn.Linear(384, 192)
        self.out = nn.Linear(192, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.out(F.relu(self.fc2(F.relu(self.fc1(h.flatten(1))))))


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


class CharLSTM(nn.Module):
    """The Shakespeare model of McMahan et al. (2017): an 8-dimensional character embedding, two LSTM
    layers of 256 units, and a linear map to the vocabulary's logits, read at the last position
    (next-character prediction, as in LEAF).  Inputs are character indices (any dtype; cast to int64).

    Parameters (torch keeps two bias vectors per LSTM gate): V*8 + [4*256*(8+256) + 2*4*256]
    + [4*256*(256+256) + 2*4*256] + 256*V + V = 819,920 for V = 80.  The paper reports 866,578 for
    its model; no bias convention of this architecture gives that figure (one bias: 817,872).
    """

    def __init__(self, vocab: int = 80, embed: int = 8, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x.long()))
        return self.out(h[:, -1])


class Linear(nn.Module):
    """Linear regression y = W x (+ b); with d_out == 1 the output is squeezed to (N,)."""

    def __init__(self, d_in: int, d_out: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x.flatten(1))
        return out.squeeze(1) if out.shape[1] == 1 else out


def zero_(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def build_model(kind: str, input_shape: Sequence[int], n_outputs: int,
                hidden: Sequence[int] = (64,), init: str = "default", seed: int = 0,
                *, bias: bool = True, task: str = "classification", factory: str = "",
                factory_args: dict | None = None) -> nn.Module:
    """A fresh model of `kind` for inputs of shape `input_shape` (without the batch dim).

    kind: "logreg" | "mlp" | "cnn" (classifiers with `n_outputs` logits), or "linear" (a
    regression model for `task == "regression"`, the same affine map as logreg otherwise).
    factory: a user's model factory (an import path or a `fedhop.models` entry point,
    common/util/plugins.py), called as `factory(input_shape, n_outputs, **factory_args)`; it
    replaces `kind`.  init: "default" (torch's initialisation under `seed`) or "zeros".
    """
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be non-empty with positive sizes, got {tuple(input_shape)}")
    if init not in ("default", "zeros"):
        raise ValueError(f"model.init = {init!r} is not allowed (allowed: default, zeros)")
    features = math.prod(shape)
    model: nn.Module
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        if factory:
            model = _from_factory(factory, shape, n_outputs, factory_args or {})
        elif kind == "logreg":
            model = LogReg(features, n_outputs)
        elif kind == "linear":
            model = Linear(features, n_outputs, bias) if task == "regression" else LogReg(features, n_outputs)
        elif kind == "mlp":
            model = MLP(features, list(hidden), n_outputs)
        elif kind == "cnn":
            if len(shape) != 3:
                raise ValueError(f"model.kind = 'cnn' needs image inputs (channels, height, width), "
                                 f"got input shape {shape}")
            model = CNN(shape[0], (shape[1], shape[2]), n_outputs)
        elif kind in ("mcmahan_cnn", "leaf_cnn", "cifar_cnn", "resnet18_gn"):
            if len(shape) != 3:
                raise ValueError(f"model.kind = {kind!r} needs image inputs (channels, height, width), "
                                 f"got input shape {shape}")
            if kind == "cifar_cnn":
                model = CifarCNN(shape[0], (shape[1], shape[2]), n_outputs)
            elif kind == "resnet18_gn":
                model = ResNet18GN(shape[0], n_outputs)
            else:
                model = TwoConvCNN(shape[0], (shape[1], shape[2]), n_outputs, fc=2048 if kind == "leaf_cnn" else 512)
        elif kind == "char_lstm":
            if len(shape) != 1:
                raise ValueError(f"model.kind = 'char_lstm' needs character sequences (length,), got input "
                                 f"shape {shape}")
            model = CharLSTM(vocab=n_outputs)
        else:
            raise ValueError(f"model.kind = {kind!r} is not allowed (allowed: {', '.join(MODEL_KINDS)})")
    if init == "zeros":
        zero_(model)
    return model


def _from_factory(factory: str, shape: tuple[int, ...], n_outputs: int, args: dict) -> nn.Module:
    from fedhop.common.util.plugins import check_call, load_plugin
    try:
        make = load_plugin(factory, "models")
    except LookupError:
        raise ValueError(f"model.factory = {factory!r}: no such entry point in group 'fedhop.models' and not an "
                         f"import path 'package.module:function'") from None
    check_call(make, factory, "model.factory_args", shape, int(n_outputs), **args)   # before the call
    model = make(shape, int(n_outputs), **args)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.factory = {factory!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- what is exchanged
EXCHANGE_CHOICES = ("all", "trainable")
#: the names of the parameters a model exchanges, set by `select_exchange`; absent: every parameter
EXCHANGED_ATTR = "_fedhop_exchanged"
#: algorithms whose parties touch the model only through get_params / set_params
#: (common/algorithms/local.py), so they can exchange a part of it (model.exchange != "all")
EXCHANGE_ALGORITHMS = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "fedexp", "scaffold",
                       "feddyn", "fednova", "fedli_ls", "fedli_lu")


def exchanged_names(model: nn.Module) -> frozenset[str] | None:
    """The names of the parameters `model` exchanges, or None for every parameter."""
    return model.__dict__.get(EXCHANGED_ATTR)


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Set requires_grad = False on the parameters whose names match one of the glob `patterns`
    (fnmatch: `*` also crosses dots, so "layers.*" freezes every layer); returns their names.
    A pattern that matches no parameter is a ValueError naming it."""
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"model.freeze: pattern {pattern!r} matches no parameter of the model ({shown})")
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def select_exchange(model: nn.Module, freeze: Sequence[str] = (), exchange: str = "all") -> nn.Module:
    """Freeze `freeze`'s parameters, then mark which parameters `model` exchanges (in place).

    exchange: "all" (every parameter travels, frozen ones too: no mark, today's messages),
    "trainable" (those with requires_grad after freezing: a factory's own frozen backbone
    counts too), or a plug-in `select(name, parameter) -> bool` by import path or fedhop.models
    entry point.  Whatever is not exchanged is frozen (requires_grad = False): it keeps the value
    every party built from the seeded init, the factory or a checkpoint, so a process hosting
    many logical clients never carries one client's update of it to the next.
    """
    if freeze:
        freeze_parameters(model, freeze)
    if exchange == "all":
        return model
    if exchange == "trainable":
        keep = [n for n, p in model.named_parameters() if p.requires_grad]
        if not keep:
            raise ValueError("model.exchange = 'trainable': every parameter is frozen, nothing is left to exchange "
                             "(loosen model.freeze)")
    else:
        select = load_selector(exchange)
        keep = [n for n, p in model.named_parameters() if bool(select(n, p))]
        if not keep:
            raise ValueError(f"model.exchange = {exchange!r} selects no parameter of the model, nothing is left to "
                             f"exchange")
        chosen = set(keep)
        for name, p in model.named_parameters():
            if name not in chosen:
                p.requires_grad_(False)
    model.__dict__[EXCHANGED_ATTR] = frozenset(keep)
    return model


def load_selector(ref: str) -> Callable[[str, nn.Parameter], bool]:
    """The user's selection `select(name, parameter) -> bool` named by `ref` (common/util/plugins.py,
    group fedhop.models, so a client's plug-in allow-list applies)."""
    from fedhop.common.util.plugins import check_call, load_plugin
    try:
        select = load_plugin(ref, "models")
    except LookupError:
        raise ValueError(f"model.exchange = {ref!r}: not all, trainable, an import path 'package.module:function' "
                         f"nor an entry point of group 'fedhop.models'") from None
    if not callable(select):
        raise ValueError(f"model.exchange = {ref!r} is a {type(select).__name__}, not a function (name, parameter) "
                         f"-> bool")
    check_call(select, ref, "model.exchange", "name", None)   # called as select(name, parameter)
    return select


def selects_part(model_cfg: Any) -> bool:
    """Whether a [model] section freezes or selects parameters (the default does neither)."""
    return bool(getattr(model_cfg, "freeze", ())) or getattr(model_cfg, "exchange", "all") != "all"


def with_model_selection(task: Any, model_cfg: Any) -> Any:
    """`task`, whose `build_model` now applies model.freeze and model.exchange (`select_exchange`)
    to every model it builds, whichever task kind it is; untouched under the defaults."""
    if not selects_part(model_cfg):
        return task
    build = task.build_model
    freeze, exchange = tuple(model_cfg.freeze), model_cfg.exchange

    def build_model() -> nn.Module:
        return select_exchange(build(), freeze, exchange)

    task.build_model = build_model   # the instance's own: the task's class and type checks stay as they were
    return task


def check_model_selection(cfg: Any) -> None:
    """Build the run's model once and apply model.freeze / model.exchange, so a pattern that matches
    nothing or a selection that leaves nothing to exchange is a ValueError before any process
    starts (`fedhop run`); nothing is built under the defaults."""
    if not selects_part(cfg.model):
        return
    from fedhop.common.tasks import build_task
    build_task(cfg).build_model()
