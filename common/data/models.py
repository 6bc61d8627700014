"""The old name of the model package, common/models/ (`fedhop.common.models`): it re-exports the
models and their helpers so that a user's Python code importing them from here keeps working.  A
config's plug-in reference names the defining module instead (`model.factory =
"fedhop.common.models.dense:MLP"`): common/util/plugins.py admits only objects defined in the
module a reference names."""
from __future__ import annotations

from fedhop.common.models import ModelBuilder, build_model, model_kinds, num_parameters, registry, zero_
from fedhop.common.models.conv import CNN, BasicBlock, CifarCNN, ResNet18GN, TwoConvCNN
from fedhop.common.models.dense import MLP, Linear, LogReg
from fedhop.common.models.exchange import (
    EXCHANGE_CHOICES,
    EXCHANGED_ATTR,
    check_model_selection,
    exchanged_names,
    freeze_parameters,
    load_selector,
    select_exchange,
    selects_part,
    with_model_selection,
)
from fedhop.common.models.text import LEAF_LETTERS, CharLSTM

__all__ = ["ModelBuilder", "build_model", "model_kinds", "num_parameters", "registry", "zero_", "CNN", "BasicBlock",
           "CifarCNN", "ResNet18GN", "TwoConvCNN", "MLP", "Linear", "LogReg", "EXCHANGE_CHOICES", "EXCHANGED_ATTR",
           "check_model_selection", "exchanged_names", "freeze_parameters", "load_selector", "select_exchange",
           "selects_part", "with_model_selection", "LEAF_LETTERS", "CharLSTM"]
