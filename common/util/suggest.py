"""'did you mean ...?' for a misspelt name: a config key, an algorithm, a data set, a topology.

A name with the same letters in another order or case (`rl` for `lr`, `FedAvg`) is proposed first;
otherwise difflib's ratio (matching characters over total length) at 0.6 finds one- or two-letter
slips (`fedvag` for `fedavg`, `digts` for `digits`) without proposing unrelated keys.
"""
from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(word: object, candidates: Iterable[object]) -> str:
    """`" (did you mean 'lr'?)"` for the closest candidate to `word`, or "" when none is close."""
    text = str(word)
    names = [str(c) for c in candidates if str(c) != text]
    # the same letters in another order or case first ('rl' for 'lr': a ratio of only 0.5), then the closest
    close = [n for n in names if sorted(n.lower()) == sorted(text.lower())][:1]
    close = close or difflib.get_close_matches(text, names, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
