"""The model table (common/models/): every built-in kind is a row, built under its seed exactly as
its class constructed directly under that seed; the algorithms declare whether they can exchange a
part of the model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fedhop.common.algorithms import algorithm_class, partial_exchange_algorithms, registry
from fedhop.common.config.schema import ModelConfig
from fedhop.common.models import build_model, model_kinds
from fedhop.common.models.conv import CNN, CifarCNN, ResNet18GN, TwoConvCNN
from fedhop.common.models.dense import MLP, Linear, LogReg
from fedhop.common.models.text import CharLSTM


def test_the_table_holds_the_kinds_the_config_allows() -> None:
    choices = {f.name: f for f in dataclasses.fields(ModelConfig)}["kind"].metadata["choices"]
    assert model_kinds() == sorted(choices)


@pytest.mark.parametrize("kind,shape,n,direct", [
    ("linear", (5,), 3, lambda: LogReg(5, 3)),                     # a classifier: softmax regression
    ("logreg", (2, 4), 3, lambda: LogReg(8, 3)),
    ("mlp", (6,), 3, lambda: MLP(6, [7, 5], 3)),
    ("cnn", (1, 8, 8), 10, lambda: CNN(1, (8, 8), 10)),
    ("mcmahan_cnn", (1, 28, 28), 10, lambda: TwoConvCNN(1, (28, 28), 10, fc=512)),
    ("leaf_cnn", (1, 28, 28), 62, lambda: TwoConvCNN(1, (28, 28), 62, fc=2048)),
    ("cifar_cnn", (3, 32, 32), 10, lambda: CifarCNN(3, (32, 32), 10)),
    ("resnet18_gn", (3, 16, 16), 10, lambda: ResNet18GN(3, 10)),
    ("char_lstm", (80,), 80, lambda: CharLSTM(vocab=80)),
])
def test_each_kind_is_its_class_under_the_seed(kind, shape, n, direct) -> None:
    built = build_model(kind, shape, n, hidden=(7, 5), seed=13)
    torch.manual_seed(13)
    expected = direct().state_dict()
    got = built.state_dict()
    assert type(built).__name__ == type(direct()).__name__ and list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_linear_is_a_regression_model_for_a_regression_task() -> None:
    built = build_model("linear", (4,), 1, seed=2, bias=False, task="regression")
    torch.manual_seed(2)
    expected = Linear(4, 1, bias=False).state_dict()
    assert isinstance(built, Linear) and list(built.state_dict()) == ["linear.weight"]
    assert torch.equal(built.state_dict()["linear.weight"], expected["linear.weight"])


def test_an_unknown_kind_names_the_table() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'vgg' \(allowed: char_lstm, cifar_cnn, cnn"):
        build_model("vgg", (3, 8, 8), 10)


def test_the_algorithms_that_exchange_a_part_declare_it() -> None:
    # the algorithms whose parties touch the model only through get_params / set_params
    assert sorted(partial_exchange_algorithms()) == sorted(
        ["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "fedexp", "scaffold", "feddyn",
         "fednova", "fedli_ls", "fedli_lu"])
    assert not algorithm_class("fedlga").partial_exchange and not algorithm_class("fedchs").partial_exchange
    assert all(isinstance(cls.partial_exchange, bool) for cls in registry().values())
