"""Text models (model.kind char_lstm): inputs are sequences of character indices."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: the 80 characters of LEAF's Shakespeare (models/utils/language_utils.py ALL_LETTERS); index = position
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


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


def build_char_lstm(shape: tuple[int, ...], n_outputs: int, **_: Any) -> nn.Module:
    if len(shape) != 1:
        raise ValueError(f"model.kind = 'char_lstm' needs character sequences (length,), got input "
                         f"shape {shape}")
    return CharLSTM(vocab=n_outputs)


REGISTER = {"char_lstm": build_char_lstm}
